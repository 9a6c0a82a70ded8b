"""Merging attention states (out, lse), FlashInfer's composition rule.

lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
Associative and commutative, so split-K partials and prefix/suffix parts computed apart
combine exactly. An empty part (lse = -inf, out = 0) is the identity. This is an
elementwise op that XLA fuses into its neighbours, so it has no Pallas kernel.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import validate as v


def merge_states(state_a, state_b):
    """Merge two attention states over disjoint KV sets of the same queries.

    state_a, state_b: (out [..., head_dim] float, lse f32 [...]) with equal shapes.
    Returns (out in out_a's dtype, lse f32).
    """
    (out_a, lse_a), (out_b, lse_b) = state_a, state_b
    v.check_shape("out_b", out_b, out_a.shape)
    v.check_shape("lse_a", lse_a, out_a.shape[:-1])
    v.check_shape("lse_b", lse_b, out_a.shape[:-1])
    lse_a, lse_b = lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)
    lse = jnp.logaddexp(lse_a, lse_b)
    # Both parts empty: lse = -inf and the weights below would be exp(nan).
    ref = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w_a = jnp.exp(lse_a - ref)[..., None]
    w_b = jnp.exp(lse_b - ref)[..., None]
    out = w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)
    return out.astype(out_a.dtype), lse
