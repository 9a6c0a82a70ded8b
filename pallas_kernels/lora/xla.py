"""The XLA path of the batched LoRA matmul (CPU, and any backend without a kernel).

Each token's rows of the shrink are computed against every slot at once (one matmul of
x with the slots' A stacked side by side), the slots a token does not use are zeroed,
and one matmul with the stacked B expands. Work is L times the gathered form's, but
L * R (slots times rank) is a few dozen columns, far below the base projection's
width, and no [T, in, R] gather is materialised.
"""

from __future__ import annotations

import jax.numpy as jnp


def lora_matmul_xla(x, lora_a, lora_b, slots):
    """As ref.lora_matmul_ref: x [T, in], lora_a [L, in, R], lora_b [L, R, out], slots [T]."""
    num_slots, d_in, rank = lora_a.shape
    a = jnp.moveaxis(lora_a, 0, 1).reshape(d_in, num_slots * rank)  # [in, L*R]
    shrink = jnp.matmul(x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    mine = slots[:, None] == jnp.arange(num_slots)[None, :]  # [T, L]; slot -1 matches none
    shrink = shrink.reshape(-1, num_slots, rank) * mine[:, :, None]
    b = lora_b.reshape(num_slots * rank, -1).astype(jnp.float32)  # [L*R, out]
    return jnp.matmul(shrink.reshape(-1, num_slots * rank), b)
