"""Input checks for the entry points: clear ValueErrors at the edge, outside jit."""

from __future__ import annotations

import jax.numpy as jnp


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
