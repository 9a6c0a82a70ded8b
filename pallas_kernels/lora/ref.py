"""The jnp statement of the batched LoRA matmul (Punica's BGMV): every token gathers its
own adapter's A and B. The kernels and the XLA path are tested against it."""

from __future__ import annotations

import jax.numpy as jnp


def lora_matmul_ref(x, lora_a, lora_b, slots):
    """y[t] = (x[t] @ lora_a[slots[t]]) @ lora_b[slots[t]], 0 where slots[t] < 0.

    x [T, in]; lora_a [L, in, R]; lora_b [L, R, out] (the adapter's scaling folded in);
    slots int32 [T]. Returns float32 [T, out].
    """
    idx = jnp.clip(slots, 0, lora_a.shape[0] - 1)
    shrink = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), lora_a[idx].astype(jnp.float32))
    y = jnp.einsum("tr,tro->to", shrink, lora_b[idx].astype(jnp.float32))
    return jnp.where((slots >= 0)[:, None], y, 0.0)
