"""Zero padding to tile multiples, shared by the kernels' wrappers."""

from __future__ import annotations

import jax.numpy as jnp


def pad_to(x, axis: int, size: int):
    """x zero-padded along `axis` to `size`."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)
