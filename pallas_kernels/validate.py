"""Input checks for the entry points: clear ValueErrors at the edge, outside jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_ndim(name, x, ndim, layout):
    if getattr(x, "ndim", None) != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {getattr(x, 'shape', None)}")


def check_dtype(name, x, allowed):
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
        raise ValueError(
            f"{name} must have dtype in {[jnp.dtype(d).name for d in allowed]}, got {x.dtype}"
        )


def check_float(name, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {x.dtype}")


def check_shape(name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_positive(name, value):
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be positive or None, got {value}")


def check_heads(num_q_heads, num_kv_heads):
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )


def attention_options(head_dim, num_q_heads, sm_scale, soft_cap, sinks, variant) -> dict:
    """Checks every attention entry shares; returns the kernels' static sm_scale and variant."""
    from pallas_kernels.variant import default_scale, resolve

    check_positive("soft_cap", soft_cap)
    var = resolve(variant, soft_cap)
    if sinks is not None:
        check_shape("sinks", sinks, (num_q_heads,))
        if not var.uses_softmax:
            raise ValueError("sinks need softmax attention; this variant has a weight_fn")
    return dict(sm_scale=default_scale(head_dim, sm_scale), variant=var)


def check_block_tables(block_tables, num_pages: int, kv_lens=None, page_size: int = 1) -> None:
    """ValueError unless the entries of concrete int32 block_tables [B, P] are pages in
    [0, num_pages): every entry, or with kv_lens [B] only those a sequence reads or
    writes (its first ceil(kv_len / page_size)). Traced values (inside jit) are the
    caller's to trust."""
    if isinstance(block_tables, jax.core.Tracer) or isinstance(kv_lens, jax.core.Tracer):
        return
    tables = np.asarray(block_tables)
    bad = (tables < 0) | (tables >= num_pages)
    if kv_lens is not None:
        live = -(-np.asarray(kv_lens) // page_size)
        bad &= np.arange(tables.shape[1])[None, :] < live[:, None]
    if bad.any():
        b, i = map(int, np.argwhere(bad)[0])
        raise ValueError(f"block_tables[{b}, {i}] = {int(tables[b, i])} is not a page of the pool "
                         f"(pages are 0..{num_pages - 1}); {int(bad.sum())} bad entries")
