"""Finding float round trips that XLA:GPU deletes, for tests of quantizers and steps.

A quantizer that rounds with a cast (f32 -> float8 or bfloat16) and goes on computing with
the rounded value cast back (-> f32) relies on the pair of converts. XLA:GPU's
SimplifyFPConversions pass (run whenever xla_allow_excess_precision is on, the default)
replaces every chain of two or more float converts by one convert from the first type to
the last, so on a GPU the rounding silently disappears: the codes are computed against an
unrounded scale while the stored scale is rounded. CPU and TPU keep the pair, so only a
test of the program itself catches this here. The cure is to decode the rounded value from
its bits (a bitcast is not a convert), as quant.formats.e4m3_decode does.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jcore

# Higher-order primitives whose inner jaxpr XLA inlines into the caller (a call, a custom
# derivative rule's primal): a convert chain can run through their boundary.
_INLINED = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "remat", "checkpoint")
# Ops that only move elements: XLA may move a convert across them (ReshapeMover sinks
# reshapes and transposes below elementwise ops, the simplifier hoists a convert above a
# slice), so a chain runs through them too.
_LAYOUT = ("reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim", "copy", "copy_p", "slice",
           "dynamic_slice", "concatenate", "rev", "pad")
# Control flow XLA may inline (a conditional whose branch is known at compile time, as
# lax.platform_dependent's are once lowered for one platform; a scan of one step): checked as
# if its operands flowed into every branch and its results came from any of them.
_MAYBE_INLINED = ("cond", "scan")


def _float(dtype) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.floating)


def _lossy(src, dst) -> bool:
    """Whether converting float src to float dst can change a value (fewer mantissa bits or a
    narrower exponent range)."""
    a, b = jax.numpy.finfo(src), jax.numpy.finfo(dst)
    return b.nmant < a.nmant or b.maxexp < a.maxexp or b.minexp > a.minexp


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(j, jcore.ClosedJaxpr):
                yield j.jaxpr
            elif isinstance(j, jcore.Jaxpr):
                yield j


def rounding_round_trips(fn, *args) -> list[str]:
    """The float convert chains in jax.make_jaxpr(fn)(*args) whose first step rounds
    (a lossy float -> float convert) and whose result is converted again: each one a place
    where XLA:GPU would compute with the unrounded value. Returned as 'f32 -> f8e4m3fn ->
    f32' strings (empty: none)."""
    found: list[str] = []

    def walk(jaxpr, rounded_in):
        # rounded[v]: the (source dtype, rounded dtype) of a lossy convert that produced v.
        rounded = {v: r for v, r in zip(jaxpr.invars, rounded_in) if r is not None}
        for eqn in jaxpr.eqns:
            ins = [rounded.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
            if eqn.primitive.name == "convert_element_type":
                src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
                if ins[0] is not None and _float(dst):
                    found.append(f"{ins[0][0]} -> {ins[0][1]} -> {np.dtype(dst).name}")
                if _float(src) and _float(dst) and _lossy(src, dst):
                    rounded[eqn.outvars[0]] = (np.dtype(src).name, np.dtype(dst).name)
                continue
            if eqn.primitive.name in _LAYOUT:
                if any(r is not None for r in ins):
                    rounded[eqn.outvars[0]] = next(r for r in ins if r is not None)
                continue
            subs = list(_sub_jaxprs(eqn))
            one_step = eqn.primitive.name != "scan" or eqn.params.get("length") == 1
            if eqn.primitive.name in _INLINED + _MAYBE_INLINED and subs and one_step:
                branches = subs if eqn.primitive.name == "cond" else subs[:1]
                operands = ins[1:] if eqn.primitive.name == "cond" else ins  # a cond's first is the index
                outs = [walk(sub, operands) for sub in branches]
                for i, v in enumerate(eqn.outvars):
                    r = next((out[i] for out in outs if out[i] is not None), None)
                    if r is not None:
                        rounded[v] = r
                for sub in subs[len(branches):]:
                    walk(sub, [None] * len(sub.invars))
            else:  # a real boundary (while loops, kernels): nothing flows through
                for sub in subs:
                    walk(sub, [None] * len(sub.invars))
        return [rounded.get(v) if isinstance(v, jcore.Var) else None for v in jaxpr.outvars]

    closed = jax.make_jaxpr(fn)(*args)
    walk(closed.jaxpr, [None] * len(closed.jaxpr.invars))
    return found
