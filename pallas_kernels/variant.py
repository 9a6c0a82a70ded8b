"""Attention variants: the logits transform and the weighting as traced functions.

FlashInfer compiles a user functor into its kernels; the JAX way is to pass a Python
function that the kernel traces, so soft-capping, ALiBi or sigmoid attention are a few
lines of jnp, compiled into the kernel body, and the reference runs the same function.

`logits_fn(logits, q_pos, kv_pos, q_head) -> logits` receives broadcastable arrays:
logits f32 [rows, cols] (already multiplied by sm_scale), q_pos int32 (the query's
absolute position), kv_pos int32 (the key's absolute position), q_head int32 (the
query head index). It must be elementwise and must not close over arrays (a Pallas
kernel cannot capture array constants); Python floats and ints are fine.

`weight_fn(logits) -> weights`, when given, replaces softmax: out = sum_t w_t v_t,
unnormalised, and lse = log(sum_t w_t) (FlashSigmoid-style). Sinks need softmax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

LogitsFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    logits_fn: LogitsFn | None = None
    weight_fn: Callable[[jax.Array], jax.Array] | None = None

    @property
    def uses_softmax(self) -> bool:
        return self.weight_fn is None

    def transform(self, logits, q_pos, kv_pos, q_head):
        if self.logits_fn is None:
            return logits
        return self.logits_fn(logits, q_pos, kv_pos, q_head)

    def then(self, logits_fn: LogitsFn) -> "AttentionVariant":
        """This variant with `logits_fn` applied after its own logits transform."""
        if self.logits_fn is None:
            return dataclasses.replace(self, logits_fn=logits_fn)
        return dataclasses.replace(self, logits_fn=_Then(self.logits_fn, logits_fn))


@dataclasses.dataclass(frozen=True)
class _Then:
    """second(first(logits)): a value, not a closure, so equal compositions key one jit entry."""

    first: LogitsFn
    second: LogitsFn

    def __call__(self, s, q_pos, kv_pos, q_head):
        return self.second(self.first(s, q_pos, kv_pos, q_head), q_pos, kv_pos, q_head)


SOFTMAX = AttentionVariant()


def soft_cap(cap: float) -> LogitsFn:
    """Gemma-2 style soft-capping: cap * tanh(logits / cap)."""
    return _SoftCap(float(cap))


@dataclasses.dataclass(frozen=True)
class _SoftCap:
    # A value rather than a lambda: the entries build it from their soft_cap argument on
    # every call, and the variant keys the dispatch jit (equal caps, one compilation).
    cap: float

    def __call__(self, s, q_pos, kv_pos, q_head):
        return self.cap * jnp.tanh(s / self.cap)


def alibi(num_q_heads: int) -> LogitsFn:
    """ALiBi bias -slope_h * (q_pos - kv_pos), slope_h = 2^(-8 (h+1) / num_q_heads).

    The slopes are computed from the head index inside the kernel (no captured array).
    """
    step = -8.0 / num_q_heads

    def fn(s, q_pos, kv_pos, q_head):
        slope = jnp.exp2(step * (q_head + 1).astype(jnp.float32))
        return s - slope * (q_pos - kv_pos).astype(jnp.float32)

    return fn


def sigmoid(bias: float = 0.0) -> AttentionVariant:
    """Sigmoid attention: out = sum_t sigmoid(logit_t + bias) v_t (no normalisation)."""
    bias = float(bias)
    return AttentionVariant(weight_fn=lambda s: jax.nn.sigmoid(s + bias))


def soft_cap_of(variant: AttentionVariant) -> float | None:
    """The cap of a variant that is softmax over soft-capped logits and nothing else (what
    `resolve(None, cap)` builds), else None."""
    fn = variant.logits_fn
    return fn.cap if variant.uses_softmax and isinstance(fn, _SoftCap) else None


def resolve(variant: AttentionVariant | None, soft_cap_value: float | None) -> AttentionVariant:
    """The entry points' `variant` plus their `soft_cap` shorthand (soft-cap applied first)."""
    variant = SOFTMAX if variant is None else variant
    if soft_cap_value is None:
        return variant
    cap = soft_cap(soft_cap_value)
    if variant.logits_fn is None:
        return dataclasses.replace(variant, logits_fn=cap)
    return AttentionVariant(logits_fn=cap, weight_fn=variant.weight_fn).then(variant.logits_fn)


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
