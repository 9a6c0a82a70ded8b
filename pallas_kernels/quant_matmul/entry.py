"""pallas_kernels.quant_matmul: the one entry for a matmul with a packed weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import validate as v
from pallas_kernels.dispatch import bind, dispatch
from quant.packed import (ACTIVATION_INT8, PackedWeight, can_interleave, deinterleave_rows, interleave,
                          quantize_activations, round_activation_blocks)
from pallas_kernels.quant_matmul import cpu
from pallas_kernels.quant_matmul.kernel_gpu import quant_matmul_gpu
from pallas_kernels.quant_matmul.kernel_tpu import quant_matmul_tpu
from pallas_kernels.quant_matmul.ref import rms_norm
from pallas_kernels.quant_matmul.xla import quant_matmul_xla


def _xla(x, codes, scale, offset, *, fmt, group, int8_activations=False, interleaved=False):
    w = PackedWeight(codes, scale, offset, fmt, group, (x.shape[1], codes.shape[1]),
                     int8_activations=int8_activations, interleaved=interleaved)
    return quant_matmul_xla(x, w).astype(x.dtype)


def _row_order(x, codes, scale, offset, *, kernel, **options):
    """A TPU / GPU kernel on codes put back row by row (a weight `prepare` laid out for a
    CPU, run elsewhere: correct, at the cost of a copy of the codes)."""
    return kernel(x, deinterleave_rows(codes), scale, offset, **options)


def prepare(w: PackedWeight) -> PackedWeight:
    """w laid out for the kernel this backend runs: on a CPU whose kernel (cpu.py) decodes
    w's format, its codes interleaved four rows to a word (quant.packed.interleave), the
    order that kernel reads; otherwise w as it is. model.load calls it (`prepare_params`
    for a tree); a weight not prepared still multiplies correctly, on the XLA path."""
    if not isinstance(w, PackedWeight):
        raise ValueError(f"prepare takes a PackedWeight, got {type(w).__name__}")
    if can_interleave(w) and cpu.supports(w.fmt, 1, w.shape[1]):
        return interleave(w)
    return w


def prepare_params(params):
    """params (any pytree) with every PackedWeight in it `prepare`d: for weights packed with
    quant.pack_params (model.load prepares the matrices it packs itself)."""
    packed = lambda x: isinstance(x, PackedWeight)  # noqa: E731
    return jax.tree.map(lambda x: prepare(x) if packed(x) else x, params, is_leaf=packed)


def _rounded_activations(x, codes, scale, offset, *, kernel, interpret, fmt, group, blocks=False):
    """A weight-only kernel on x rounded to int8 per token (w8a8's activations) or, with
    blocks, per activation block (int8_activations weights), so every backend computes
    what ref.py states."""
    if blocks:
        x_rounded = round_activation_blocks(x, fmt, group)
    else:
        xq, xs = quantize_activations(x)
        x_rounded = xq.astype(jnp.float32) * xs
    return kernel(x_rounded.astype(x.dtype), codes, scale, offset, interpret=interpret, fmt=fmt, group=group)


def _cpu(x, *flat, fmt, group, int8_activations=False, int8_tiles=False, eps=None):
    """The C++ kernel on one or more weights (flat: codes, scale, offset per weight; a tuple of
    results for several); int8_activations: on its int8_tiles it rounds x itself, else x is
    rounded here and the float tiles run. eps: flat starts with a norm weight, and the
    kernel RMS-normalizes x first (`_fold`)."""
    norm = None
    if eps is not None:
        norm, flat = (flat[0], eps), flat[1:]
    if int8_activations and not int8_tiles:
        if norm is not None:
            x, norm = rms_norm(x, norm[0], eps), None
        x = round_activation_blocks(x, fmt, group).astype(x.dtype)
    ys = cpu.quant_matmuls_cpu(x, [flat[i:i + 3] for i in range(0, len(flat), 3)], fmt=fmt, group=group,
                               int8_activations=int8_tiles, norm=norm)
    ys = tuple(y.astype(x.dtype) for y in ys)
    return ys if len(ys) > 1 else ys[0]


def _normed(x, weight, *flat, kernel, eps, **more):
    """`kernel` on x RMS-normalized first (ref.rms_norm): the paths beside a CPU kernel that
    folds the norm in (`_fold`)."""
    return kernel(rms_norm(x, weight, eps), *flat, **more)


def _each(x, *flat, kernel, **options):
    """A one-weight path run on each weight of flat (codes, scale, offset per weight)."""
    return tuple(kernel(x, *flat[i:i + 3], **options) for i in range(0, len(flat), 3))


def _fold(x, norm, paths):
    """(x, leading args, paths) for a matmul of x RMS-normalized by norm = (weight [in], eps):
    where the CPU kernel takes the step on float32 x, the native path normalizes x (in the
    kernel, or in XLA before it rounds x itself: `_cpu`), the weight going first among the
    args and every path getting eps; otherwise x is normalized here. norm None: (x, (),
    paths)."""
    if norm is None:
        return x, (), paths
    if not isinstance(norm, (tuple, list)) or len(norm) != 2:
        raise ValueError("norm must be a (weight, eps) pair or None")
    weight, eps = norm
    if weight.shape != (x.shape[1],):
        raise ValueError(f"the norm weight {weight.shape} must be [{x.shape[1]}], one per input feature of x")
    if not float(eps) >= 0:
        raise ValueError(f"the norm's eps must be a number >= 0, got {eps!r}")
    ref, tpu, gpu, native = paths
    if native is None or x.dtype != jnp.float32:
        return rms_norm(x, weight, eps), (), paths
    eps = float(eps)
    return x, (weight,), (bind(_normed, kernel=ref, eps=eps), bind(_normed, kernel=tpu, eps=eps),
                          bind(_normed, kernel=gpu, eps=eps), bind(native.fn, **dict(native.options), eps=eps))


def _check(x, w) -> None:
    if not isinstance(w, PackedWeight):
        raise ValueError(f"w must be a PackedWeight (quant.packed.quantize / from_gguf), got "
                         f"{type(w).__name__}")
    v.check_ndim("x", x, 2, "[num_tokens, in]")
    v.check_float("x", x)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x has {x.shape[1]} input features but the weight [in, out] is "
                         f"{list(w.shape)}: x must be [num_tokens, {w.shape[0]}]")


def _paths(x, w: PackedWeight):
    """(ref, tpu, gpu, cpu) of the dispatch for x @ w; cpu is None where the C++ kernel does
    not take the step."""
    options = dict(fmt=w.fmt, group=w.group)
    tpu, gpu = bind(quant_matmul_tpu, **options), bind(quant_matmul_gpu, **options)
    if w.fmt in ACTIVATION_INT8 or w.int8_activations:
        rounded = dict(options, blocks=True) if w.int8_activations else options
        tpu = bind(_rounded_activations, kernel=quant_matmul_tpu, **rounded)
        gpu = bind(_rounded_activations, kernel=quant_matmul_gpu, **rounded)
    if w.interleaved:
        tpu, gpu = bind(_row_order, kernel=tpu), bind(_row_order, kernel=gpu)
    rounding = dict(int8_activations=True) if w.int8_activations else {}
    tiles = dict(int8_tiles=True) if w.int8_activations and cpu.int8_tiles(w.fmt, w.group) else {}
    native = (bind(_cpu, **options, **rounding, **tiles)
              if w.interleaved and cpu.supports(w.fmt, x.shape[0], w.shape[1], **tiles) else None)
    return bind(_xla, **options, **rounding, interleaved=w.interleaved), tpu, gpu, native


def quant_matmul(x, w: PackedWeight, *, norm=None, interpret=None):
    """x @ w for a weight kept packed (quant/packed.py: GGUF Q8_0 / Q4_0 / Q4_1 blocks,
    kvfold's int8 / int4 / fp8 / w8a8); the kernels dequantize one tile of the weight at a
    time. For w8a8 each token's x is first rounded to int8 (absmax / 127) on every path;
    for a weight with int8_activations, each activation block of x
    (quant.packed.round_activation_blocks) on every path.

    Args:
      x: [num_tokens, in], float.
      w: a PackedWeight of shape [in, out].
      norm: (weight [in], eps) to multiply ref.rms_norm(x, weight, eps) instead of x (the
        norm before a layer's projections); the CPU kernel computes it itself.
      interpret: True runs the Pallas TPU kernel in interpret mode; None runs Mosaic on
        TPU, Triton on GPU, on CPU the C++ kernel (cpu.py) up to cpu.max_tokens() tokens and
        the XLA path (xla.py) above that, for fp8 and w8a8, or where the kernel cannot be
        built.

    Returns [num_tokens, out] in x.dtype (accumulated in float32).
    """
    _check(x, w)
    x, lead, (ref, tpu, gpu, native) = _fold(x, norm, _paths(x, w))
    scale, offset = w.float_scales()  # K-quants: float32 per group from their two-level scales
    return dispatch(x, *lead, w.codes, scale, offset, ref=ref, tpu=tpu, gpu=gpu, cpu=native, interpret=interpret)


def quant_matmuls(x, ws, *, norm=None, interpret=None) -> list:
    """[quant_matmul(x, w) for w in ws] for weights that multiply the same x (a layer's q, k
    and v projections; its gate and up): where the CPU kernel takes every one of them and
    they share format, group and activation rounding, one kernel call for all (x rounded
    once, all their columns one job for its threads); otherwise one entry call each. norm:
    as quant_matmul's, applied once for all.
    Returns a list of [num_tokens, out_i] in x.dtype."""
    ws = list(ws)
    if not ws:
        raise ValueError("quant_matmuls needs at least one weight")
    for w in ws:
        _check(x, w)
    paths = [_paths(x, w) for w in ws]
    key = lambda w: (w.fmt, w.group, w.int8_activations, w.interleaved)  # noqa: E731
    if len(ws) == 1 or any(key(w) != key(ws[0]) for w in ws) or any(p[3] is None for p in paths):
        if len(ws) > 1 and norm is not None:  # normalized once, not in each call
            x, _, _ = _fold(x, norm, (None, None, None, None))
            norm = None
        return [quant_matmul(x, w, norm=norm, interpret=interpret) for w in ws]
    ref, tpu, gpu, native = paths[0]  # the same for every weight but the column count
    x, lead, (ref, tpu, gpu, native) = _fold(x, norm, (bind(_each, kernel=ref), bind(_each, kernel=tpu),
                                                       bind(_each, kernel=gpu), native))
    flat = []
    for w in ws:
        flat += [w.codes, *w.float_scales()]
    return list(dispatch(x, *lead, *flat, ref=ref, tpu=tpu, gpu=gpu, cpu=native, interpret=interpret))
