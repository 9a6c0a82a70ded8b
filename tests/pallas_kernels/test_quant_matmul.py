"""The quantized matmul: the XLA path and the Pallas kernels (TPU and GPU, interpreted) in
every packed format against a float64 numpy oracle of the packed weight; lowering for TPU
and CUDA; input validation."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quant_matmul
from pallas_kernels.quant_matmul import PackedWeight, prepare
from quant.packed import (ACTIVATION_INT8, FORMATS, can_interleave, concat_columns, deinterleave_rows, dequantize,
                          interleave, quantize)
from pallas_kernels.quant_matmul.kernel_gpu import quant_matmul_gpu
from pallas_kernels.quant_matmul.kernel_tpu import quant_matmul_tpu
from pallas_kernels.quant_matmul.ref import quant_matmul_ref
from pallas_kernels.quant_matmul.xla import quant_matmul_xla
from tests import conftest
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu, kernel_calls
from tests.pallas_kernels.helpers import TPU_INTERPRET_ONLY, assert_close, spec

FMTS = [f for f in FORMATS if not FORMATS[f].super_block]  # the ones `quantize` packs from floats
K_QUANTS = [f for f in FORMATS if FORMATS[f].super_block]  # GGUF's K-quants, from blocks
TILED = [f for f in FMTS if f != "q5_0"]  # q5_0 tiles as q8_0 does (test_q5_0_is_q8_0s_layout)
SHAPES = [(1, 64, 64), (5, 128, 48)]  # (num_tokens, in, out)
interpret_only = pytest.mark.skipif(conftest.kernel_mode() == "compiled", reason=TPU_INTERPRET_ONLY)


def _inputs(fmt, num_tokens, d_in, d_out, seed=0, dtype=np.float32):
    """x [T, in] and a packed weight whose scale differs from group to group (rows scaled
    by a random factor every 32 rows) and from column to column."""
    rng = np.random.default_rng(seed)
    rows = np.repeat(rng.uniform(0.2, 3.0, -(-d_in // 32)), 32)[:d_in]
    w = rng.normal(size=(d_in, d_out)) * rows[:, None] * rng.uniform(0.5, 2.0, d_out)
    x = rng.normal(size=(num_tokens, d_in)).astype(dtype)
    return jnp.asarray(x), quantize(w.astype(np.float32), fmt)


def _oracle(x, w: PackedWeight, activations: bool = False):
    """float64 x @ (the weight the packed codes represent); activations=True rounds each
    token of x to int8 first when the format says so (w8a8), as the entry does."""
    wd = np.asarray(dequantize(w.codes, *w.float_scales(), w.fmt, w.group), np.float64)
    x = np.asarray(x, np.float64)
    if activations and w.fmt in ACTIVATION_INT8:
        scale = np.abs(x).max(axis=1, keepdims=True) / 127
        x = np.clip(np.round(x / scale), -127, 127) * scale
    return x @ wd


def _close(got, want, rtol=1e-4):
    assert_close(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def _int8_activation_bound(x, w):
    """w8a8 rounds each token's x to 8 bits (absmax / 127 steps): its error is
    at most sum_k |w_kn| * absmax(x_t) / 254, plus float rounding."""
    wd = np.abs(np.asarray(w.dequantize(), np.float64))
    absmax = np.abs(np.asarray(x, np.float64)).max(axis=1, keepdims=True)
    return absmax / 254 * wd.sum(axis=0)[None, :] * (1 + 1e-3) + 1e-5


@pytest.mark.parametrize("fmt", FMTS)
def test_oracle_dequantizes_what_quantize_packed(fmt):
    """The oracle's dequantize undoes quantize (GGUF's own quantizer for q8_0 / q4_0 /
    q4_1) within the format's rounding: a nibble or scale order that disagreed with the
    packer would miss by whole weights."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(128, 48)).astype(np.float32)
    packed = quantize(w, fmt)
    got = np.asarray(packed.dequantize(), np.float64)
    step = np.abs(np.repeat(np.asarray(packed.scale, np.float64), packed.group, axis=0))
    if fmt == "fp8":  # 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals 2^-10
        bound = 2.0**-4 * np.abs(w) + step * 2.0**-10
    else:
        # Half a step; Q4_0 / Q5_0 map the group's extreme to -8 / -16 and clip the other
        # side at +7 / +15, a whole step. Slack for GGUF rounding its scale and minimum to float16.
        half_steps = 2 if fmt in ("q4_0", "q5_0") else 1
        bound = 0.5 * half_steps * step + 2.0**-9 * (1 + np.abs(w))
    assert np.all(np.abs(got - w) <= bound)
    x = np.ascontiguousarray(w.T[:4])  # any [4, 128] floats
    assert_close(quant_matmul_ref(jnp.asarray(x), packed), _oracle(x, packed, activations=True), 1e-5, 1e-4)


@pytest.mark.parametrize("interpret", [None, True], ids=["entry", "tpu-kernel"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", FMTS)
def test_entry_matches_the_oracle(fmt, shape, interpret):
    """The entry runs the platform's path on a weight `prepare` laid out for it: on CPU the
    C++ kernel on interleaved codes (test_quant_matmul_cpu.py), or xla.py for fp8 and w8a8;
    the TPU kernel in interpret mode (on the codes put back in row order)."""
    x, w = _inputs(fmt, *shape, seed=10 * FMTS.index(fmt) + SHAPES.index(shape))
    got = quant_matmul(x, prepare(w), interpret=interpret)
    assert got.shape == (shape[0], shape[2]) and got.dtype == jnp.float32
    _close(got, _oracle(x, w, activations=True))
    if fmt in ACTIVATION_INT8:
        err = np.abs(np.asarray(got, np.float64) - _oracle(x, w))
        assert np.all(err <= _int8_activation_bound(x, w))
        assert err.max() > 0  # it did round the activations: the bound is the right one


@pytest.mark.parametrize("fmt", FMTS + K_QUANTS)
def test_xla_path_matches_the_oracle(fmt):
    """xla.py, which CPU runs above the C++ kernel's max_tokens() (prefill chunks), for fp8
    and w8a8."""
    if fmt in FMTS:
        x, w = _inputs(fmt, 5, 128, 48, seed=11)
    else:
        x = jnp.asarray(np.random.default_rng(11).normal(size=(5, 512)), jnp.float32)
        w = _k_quant(fmt, 512, 48, seed=1)
    _close(quant_matmul_xla(x, w), _oracle(x, w, activations=True))


@pytest.mark.parametrize("fmt", TILED)
def test_gpu_kernel_matches_the_oracle_with_several_tiles(fmt):
    """K tiles of 64 rows (two loop steps; two groups of 32 per tile) and output tiles of
    16 (three programs across 48 columns); 5 tokens padded to 16."""
    x, w = _inputs(fmt, 5, 128, 48, seed=2)
    got = quant_matmul_gpu(x, w.codes, w.scale, w.offset, fmt=fmt, group=w.group, block_k=64,
                           block_n=16, interpret=True)  # compiled under gpu-check
    assert got.shape == (5, 48)
    _close(got, _oracle(x, w))


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "int4"])
def test_interleaved_codes_hold_four_rows_in_a_word(fmt):
    """quant.packed.interleave (the CPU kernel's order): stored row 4q + i of column n is
    byte 4n + i of word row q, checked index by index; the weight it represents, its
    columns (the tied embedding's lookup) and a concatenation of interleaved parts are the
    row-order weight's, and putting the rows back gives the original bytes."""
    _, w = _inputs(fmt, 1, 128, 48, seed=3)
    iw = interleave(w)
    rows, n = w.codes.shape
    codes, flat = np.asarray(w.codes), np.asarray(iw.codes).reshape(-1)
    for r, c in [(0, 0), (1, 0), (3, 5), (4, 0), (rows - 1, n - 1), (6, 47)]:
        assert flat[r // 4 * 4 * n + 4 * c + r % 4] == codes[r, c]
    assert iw.codes.shape == w.codes.shape and iw.nbytes == w.nbytes
    np.testing.assert_array_equal(np.asarray(deinterleave_rows(iw.codes)), codes)
    np.testing.assert_array_equal(np.asarray(iw.dequantize()), np.asarray(w.dequantize()))
    ids = jnp.asarray([47, 0, 5, 5, 30])
    np.testing.assert_array_equal(np.asarray(iw.columns(ids)), np.asarray(w.columns(ids)))
    _, w2 = _inputs(fmt, 1, 128, 32, seed=4)
    both = concat_columns([iw, interleave(w2)])
    assert both.interleaved and both.shape == (128, 80)
    np.testing.assert_array_equal(np.asarray(both.dequantize()),
                                  np.asarray(concat_columns([w, w2]).dequantize()))


def test_only_whole_words_of_integer_codes_interleave():
    """fp8 codes, a group whose blocks are not whole four-row words (int8 over 90 inputs: one
    block of 90 rows) and codes already interleaved stay as they are: `prepare` keeps them,
    `interleave` refuses with a ValueError naming the problem."""
    for fmt, d_in in (("fp8", 128), ("int8", 90)):
        _, w = _inputs(fmt, 1, d_in, 48)
        assert not can_interleave(w) and prepare(w) is w
        with pytest.raises(ValueError, match="cannot be interleaved"):
            interleave(w)
    _, w = _inputs("q4_1", 1, 128, 48)
    with pytest.raises(ValueError, match="already is"):
        interleave(interleave(w))
    with pytest.raises(ValueError, match="PackedWeight"):
        prepare(np.zeros((4, 4), np.float32))


def test_q5_0_is_q8_0s_layout():
    """q5_0 (GGUF's 5-bit codes, widened to int8 by from_gguf) decodes as q8_0 does, so the
    kernels' tiling tests cover it through q8_0; the entry test runs it."""
    q5, q8 = FORMATS["q5_0"], FORMATS["q8_0"]
    assert dataclasses.replace(q5, name=q8.name, gguf=q8.gguf) == q8


@pytest.mark.parametrize("fmt", ["q4_0", "int8", "fp8"])
def test_gpu_kernel_pads_odd_widths(fmt):
    """Output width 40 (not a multiple of 16) pads the weight's columns; an 8-bit
    per-channel weight 72 wide pads its rows to 80 (a 4-bit one is grouped: 96 = 3 x 32)."""
    d_in = 96 if FORMATS[fmt].bits == 4 else 72
    x, w = _inputs(fmt, 3, d_in, 40, seed=3)
    got = quant_matmul_gpu(x, w.codes, w.scale, w.offset, fmt=fmt, group=w.group,
                           interpret=True)  # compiled under gpu-check
    assert got.shape == (3, 40)
    _close(got, _oracle(x, w))


@interpret_only
@pytest.mark.parametrize("fmt", TILED)
def test_tpu_kernel_accumulates_over_k_tiles(fmt):
    """Two K tiles of 64 rows and three output tiles of 16: the accumulator carries across
    K steps and is reset for every output tile. (Mosaic's tiling would not take these
    blocks; interpret mode does, and the default tiles cover a 128-wide weight at once.)"""
    x, w = _inputs(fmt, 5, 128, 48, seed=4)
    got = quant_matmul_tpu(x, w.codes, w.scale, w.offset, fmt=fmt, group=w.group, block_k=64,
                           block_n=16, interpret=True)
    _close(got, _oracle(x, w))


@interpret_only
@pytest.mark.parametrize("fmt", ["q4_1", "fp8"])
def test_tpu_kernel_under_tpu_interpret_semantics(fmt):
    """Mosaic's semantics in interpret mode: scratch starts NaN and an out-of-bounds read
    raises, so an accumulator not reset at the first K tile, or a block read past the
    padded tokens or the weight, would show."""
    from jax.experimental.pallas import tpu as pltpu

    x, w = _inputs(fmt, 5, 128, 48, seed=5)
    semantics = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    got = quant_matmul_tpu(x, w.codes, w.scale, w.offset, fmt=fmt, group=w.group, block_k=64,
                           block_n=16, interpret=semantics)
    _close(got, _oracle(x, w))


@pytest.mark.parametrize("interpret", [None, True], ids=["entry", "tpu-kernel"])
def test_output_has_x_dtype(interpret):
    x, w = _inputs("q4_0", 5, 128, 48, seed=6)
    got = quant_matmul(x.astype(jnp.bfloat16), w, interpret=interpret)
    assert got.dtype == jnp.bfloat16
    _close(got, _oracle(x.astype(jnp.bfloat16), w), rtol=1e-2)


@pytest.mark.parametrize("fmt", ["q4_0", "int4", "q8_0", "fp8", "w8a8"])
def test_lowers_to_one_kernel_call_for_tpu_and_cuda(fmt):
    """A decoder-sized projection (576 -> 1536, SmolLM2's up projection): Mosaic's tiles
    for TPU, Triton's power-of-two tiles over a K that is not a power of two for CUDA."""
    x, w = _inputs(fmt, 3, 576, 1536, seed=7)
    fn = lambda x, w: quant_matmul(x, w)  # noqa: E731
    assert kernel_calls(export_tpu(fn, spec(x.astype(jnp.bfloat16)), w), "tpu_custom_call") == 1
    assert kernel_calls(export_cuda(fn, spec(x.astype(jnp.bfloat16)), w), TRITON_CALL) == 1


def test_bad_inputs_are_clear_errors():
    x, w = _inputs("q4_0", 5, 64, 48)
    with pytest.raises(ValueError, match="x must be 2-D"):
        quant_matmul(x[0], w)
    with pytest.raises(ValueError, match="floating"):
        quant_matmul(x.astype(jnp.int32), w)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, 64\]"):
        quant_matmul(x[:, :32], w)
    with pytest.raises(ValueError, match="PackedWeight"):
        quant_matmul(x, w.dequantize())


def _k_quant(fmt, d_in, d_out, seed):
    """A K-quant weight from random GGUF super-blocks (random codes and sub-scales, small
    random float16 super-scales), as from_gguf reads them from a file."""
    from quant.packed import K_BLOCK_BYTES, from_gguf

    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    size = K_BLOCK_BYTES[f.gguf]
    raw = rng.integers(0, 256, (d_out, d_in // 256, size), dtype=np.uint8)
    for at in ([size - 2] if f.gguf == "Q6_K" else [0, 2]):
        scale = (rng.standard_normal((d_out, d_in // 256)) * 0.01).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(d_out, d_in // 256, 2)
    return from_gguf(raw.reshape(d_out, -1), f.gguf, (d_in, d_out))


@pytest.mark.parametrize("interpret", [None, True], ids=["entry", "tpu-kernel"])
@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quants_match_the_oracle(fmt, interpret):
    """The entry turns a K-quant's two-level scales into float32 group scales and runs the
    same kernels: the XLA path, the TPU kernel and the GPU kernel agree with the oracle."""
    w = _k_quant(fmt, 512, 48, seed=K_QUANTS.index(fmt))
    x = jnp.asarray(np.random.default_rng(9).normal(size=(3, 512)), jnp.float32)
    _close(quant_matmul(x, w, interpret=interpret), _oracle(x, w))
    if interpret:
        scale, offset = w.float_scales()
        got = quant_matmul_gpu(x, w.codes, scale, offset, fmt=fmt, group=w.group, block_k=128,
                               block_n=16, interpret=True)  # compiled under gpu-check
        _close(got, _oracle(x, w))


def test_k_quant_lowers_to_one_kernel_call_for_tpu_and_cuda():
    x, w = jnp.ones((3, 512), jnp.bfloat16), _k_quant("q4_k", 512, 1536, seed=8)
    fn = lambda x, w: quant_matmul(x, w)  # noqa: E731
    assert kernel_calls(export_tpu(fn, spec(x), w), "tpu_custom_call") == 1
    assert kernel_calls(export_cuda(fn, spec(x), w), TRITON_CALL) == 1


# -- int8 activations (weights_dtype "gguf_a8") ------------------------------------------

GGUF_BLOCKS = [f for f in FORMATS if FORMATS[f].gguf]


def _gguf_weight(fmt, d_in, d_out, seed):
    """A packed GGUF-format weight that rounds its activations (int8_activations)."""
    w = _k_quant(fmt, d_in, d_out, seed) if FORMATS[fmt].super_block else _inputs(fmt, 1, d_in, d_out, seed)[1]
    return dataclasses.replace(w, int8_activations=True)


def _blocks_by_hand(fmt, group, d_in):
    """activation_blocks restated from the storage order: a block is 16 stored code rows of
    one group; stored row r of an 8-bit format is input row r, of a 4-bit one input rows
    r // (group / 2) * group + r % (group / 2) (low nibble) and that + group / 2 (high)."""
    nibbles = FORMATS[fmt].bits == 4
    half = group // 2
    blocks = []
    for first in range(0, d_in // 2 if nibbles else d_in, 16):
        rows = []
        for r in range(first, first + 16):
            rows += [r // half * group + r % half, r // half * group + r % half + half] if nibbles else [r]
        blocks.append(sorted(rows))
    return blocks


def _round_by_hand(x, blocks):
    """float32 numpy: round(x / d) * d per token and block, d = max |x| / 127."""
    x = np.asarray(x, np.float32)
    out = np.zeros_like(x)
    for rows in blocks:
        xb = x[:, rows]
        d = np.abs(xb).max(axis=1, keepdims=True) / np.float32(127)
        q = np.where(d > 0, np.round(xb / np.where(d > 0, d, 1)), 0).astype(np.float32)
        out[:, rows] = q * d
    return out


@pytest.mark.parametrize("fmt", GGUF_BLOCKS + ["int4"])  # int4: a 4-bit group of 128, two blocks per half
def test_activation_blocks_follow_the_storage_order(fmt):
    from quant.packed import activation_blocks, round_activation_blocks

    group, d_in = FORMATS[fmt].group, 512
    got = activation_blocks(fmt, group, d_in)
    assert [sorted(b) for b in got.tolist()] == _blocks_by_hand(fmt, group, d_in)
    assert sorted(got.ravel().tolist()) == list(range(d_in))  # every input row in one block
    x = np.random.default_rng(3).normal(size=(3, d_in)).astype(np.float32)
    x[1, 5] = 40.0  # an outlier coarsens only its own block
    x[2, 64:96] = 0.0  # a zero block stays zero
    rounded = np.asarray(round_activation_blocks(jnp.asarray(x), fmt, group))
    # XLA may divide by 127 as a multiply by its reciprocal: the scales agree to an ulp
    np.testing.assert_allclose(rounded, _round_by_hand(x, _blocks_by_hand(fmt, group, d_in)), rtol=1e-6)
    d = np.zeros_like(x)
    for rows in _blocks_by_hand(fmt, group, d_in):
        d[:, rows] = np.abs(x[:, rows]).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(rounded - x) <= d / 2 * (1 + 1e-6))
    assert np.all(rounded[2, 64:96] == 0) and rounded[1, 5] == pytest.approx(40.0)


@pytest.mark.parametrize("fmt", GGUF_BLOCKS)
def test_int8_activation_weights_round_on_every_path(fmt):
    """A weight with int8_activations: the entry at decode (on CPU, the C++ kernel, which
    rounds x itself), at a prefill's length (xla.py), the reference and the TPU kernel all
    compute the oracle of the rounded x, so decode and prefill agree."""
    from pallas_kernels.quant_matmul import cpu
    from quant.packed import round_activation_blocks

    w = _gguf_weight(fmt, 512, 48, seed=GGUF_BLOCKS.index(fmt))
    longest = cpu.max_tokens(cpu.int8_tiles(fmt, w.group))  # the kernel's steps; beyond: xla.py
    x = jnp.asarray(np.random.default_rng(4).normal(size=(longest + 8, 512)), jnp.float32)
    want = _oracle(round_activation_blocks(x, fmt, w.group), w)
    _close(quant_matmul(x[:3], w), want[:3], rtol=1e-5)
    _close(quant_matmul(x, w), want, rtol=1e-5)
    _close(quant_matmul_ref(x[:3], w), want[:3], rtol=1e-5)
    _close(quant_matmul(x[:3], w, interpret=True), want[:3], rtol=1e-5)
    assert np.abs(np.asarray(quant_matmul(x[:3], w), np.float64) - _oracle(x[:3], w)).max() > 1e-4  # it rounded
