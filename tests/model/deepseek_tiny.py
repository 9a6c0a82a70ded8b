"""Shared pieces of the DeepSeek tests: the tiny preset's params, built once per session."""

import functools

import jax

import model
from model.deepseek import preset


@functools.cache
def tiny(seed: int = 0):
    """(config, params) of deepseek-v4.1-tiny, random init (jitted: eager init compiles per op)."""
    config = preset("deepseek-v4.1-tiny")
    return config, jax.jit(model.init_params, static_argnums=0)(config, jax.random.key(seed))


def positions(b: int, start: int, stop: int):
    return jax.numpy.broadcast_to(jax.numpy.arange(start, stop, dtype=jax.numpy.int32), (b, stop - start))
