"""The CPU kernel of the quantized matmul (pallas_kernels/quant_matmul/cpu_kernel.cc, through
the XLA FFI): every format it decodes against the float64 oracle of the packed weight, its
AVX-512 and portable builds, the entry's choice of it, and its errors."""

from __future__ import annotations

import ctypes
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi, quant_matmul
from pallas_kernels.quant_matmul import prepare
from pallas_kernels.quant_matmul import cpu
from quant.packed import FORMATS, interleave_rows
from tests.pallas_kernels.test_quant_matmul import _close, _inputs, _k_quant, _oracle

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU backend")

# (num_tokens, in, out): one token (two accumulator sets), 7 tokens (a tile of 4 and one
# of 3), 13 (tiles of 8, 4 and 1 over 32 columns); 80 columns are 64- or 32-column tiles
# and a 16-column strip; 1040 columns are several column ranges for the threads (3 x 128 x
# 1040 is above the size where the pool helps), the last one partial.
SHAPES = [(1, 128, 80), (7, 128, 80), (13, 128, 80), (3, 128, 1040)]
PORTABLE = "kvfold_quant_matmul_portable"


def _weight(fmt, d_in, d_out, seed):
    """A packed weight [in, out] (K-quants from random super-blocks, 512 inputs; int4 256,
    so one group of 128 is 64 byte rows)."""
    if FORMATS[fmt].super_block:
        return _k_quant(fmt, 512, d_out, seed)
    return _inputs(fmt, 1, 256 if fmt == "int4" else d_in, d_out, seed=seed)[1]


def _run(x, w, target=cpu.TARGET, **options):
    """The kernel on w's codes in its order (interleaved four rows to a word)."""
    scale, offset = w.float_scales()
    return cpu.quant_matmul_cpu(x, interleave_rows(w.codes), scale, offset, fmt=w.fmt, group=w.group,
                                target=target, **options)


@pytest.fixture(scope="module")
def portable():
    """The kernel built without AVX-512 (the loops a CPU without it runs), registered under
    its own name: (FFI name, library); an x86-64 build, skipped on other hosts."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the portable build targets x86-64-v2")
    return PORTABLE, cpu.register(cpu.build(flags=cpu_ffi.flags_for("x86-64-v2")), PORTABLE)


def test_the_kernel_builds_here():
    """CI installs a C++ compiler (Makefile setup), so the kernel must be available: a
    silent fallback to the XLA path would hide a broken build. It has the AVX-512 tiles
    exactly when this CPU has AVX-512 (-march=native), and takes steps as long as that
    build is faster than XLA for (unless KVFOLD_CPU_MARCH picks another instruction set)."""
    assert cpu.available()
    avx512 = {"avx512f", "avx512bw"} <= set(cpu_ffi.cpu_flags())
    if not os.environ.get("KVFOLD_CPU_MARCH") and cpu_ffi.cpu_flags():  # (no flags: another OS, AVX-512 unknown)
        assert cpu.max_tokens() == (cpu.MAX_TOKENS if avx512 else cpu.PORTABLE_MAX_TOKENS)


def test_kvfold_cpu_march_sets_the_instruction_set_of_the_builds(portable, monkeypatch):
    """KVFOLD_CPU_MARCH stands for -march=native in a build's flags and cache key (the
    quantized matmul's and the attention kernel's): with x86-64-v2 the matmul built is the
    portable one (no AVX-512 tiles), as the fixture's own build reports; a value that is not
    one compiler word is a ValueError naming the variable."""
    from pallas_kernels.ragged_paged_attention import cpu as attention

    assert portable[1].KvfoldQuantMatmulAvx512() == 0
    monkeypatch.setenv("KVFOLD_CPU_MARCH", "x86-64-v2")
    assert cpu_ffi.default_flags() == cpu_ffi.flags_for("x86-64-v2") != cpu_ffi.FLAGS
    assert "-march=x86-64-v2" in cpu_ffi.default_flags() and "-march=native" not in cpu_ffi.default_flags()
    for source in (cpu.SOURCE, attention.SOURCE):
        assert cpu_ffi.library_path(source) == cpu_ffi.library_path(source, cpu_ffi.flags_for("x86-64-v2"))
        assert cpu_ffi.library_path(source) != cpu_ffi.library_path(source, cpu_ffi.FLAGS)
    assert ctypes.CDLL(str(cpu.build())).KvfoldQuantMatmulAvx512() == 0
    monkeypatch.setenv("KVFOLD_CPU_MARCH", "x86-64-v3 -O0")
    with pytest.raises(ValueError, match="KVFOLD_CPU_MARCH.*'x86-64-v3 -O0'"):
        cpu_ffi.default_flags()
    monkeypatch.delenv("KVFOLD_CPU_MARCH")
    assert cpu_ffi.default_flags() == cpu_ffi.FLAGS


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", sorted(cpu.CPU_FORMATS))
def test_kernel_matches_the_oracle(fmt, shape):
    """Float16 scales (GGUF, int4) and float32 ones (int8, K-quants' products), offsets
    (q4_1, int4, q4_k, q5_k), q4_0's zero point, nibble groups of 32 and 128, int8 groups
    of 16 (q6_k), 32 and whole columns."""
    t, d_in, d_out = shape
    w = _weight(fmt, d_in, d_out, seed=sorted(cpu.CPU_FORMATS).index(fmt))
    x = jnp.asarray(np.random.default_rng(t).normal(size=(t, w.shape[0])), jnp.float32)
    got = _run(x, w)
    assert got.shape == (t, d_out) and got.dtype == jnp.float32
    _close(got, _oracle(x, w), rtol=1e-5)


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0", "int8", "q6_k"])
def test_portable_build_matches_the_oracle(fmt, portable):
    t, d_in, d_out = SHAPES[2]
    w = _weight(fmt, d_in, d_out, seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(t, w.shape[0])), jnp.float32)
    _close(_run(x, w, target=portable[0]), _oracle(x, w), rtol=1e-5)


def _lowered(t, fmt, prepared=True):
    x, w = _inputs(fmt, t, 128, 48, seed=5)
    return jax.jit(lambda x, w: quant_matmul(x, w)).lower(x, prepare(w) if prepared else w).as_text()


@pytest.mark.parametrize("fmt", ["q4_1", "w8a8", "fp8"])
def test_entry_runs_the_kernel_for_few_tokens(fmt):
    """Up to max_tokens() rows (decode steps) the entry calls the kernel on a prepared
    weight; above, it dequantizes and runs XLA's matmul. fp8 (no E4M3 decoder in it) and
    w8a8 (XLA's int8 matmul is faster) always take xla.py, and `prepare` leaves them as they
    are. Either way the result is the oracle's."""
    decodes = fmt in cpu.CPU_FORMATS
    _, w = _inputs(fmt, 1, 128, 48, seed=6)
    assert prepare(w).interleaved == decodes
    assert (cpu.TARGET in _lowered(cpu.max_tokens(), fmt)) == decodes
    assert cpu.TARGET not in _lowered(cpu.max_tokens() + 1, fmt)
    for t in (2, cpu.max_tokens() + 1):
        x, w = _inputs(fmt, t, 128, 48, seed=6)
        _close(quant_matmul(x, prepare(w)), _oracle(x, w, activations=True))


def test_a_weight_in_row_order_takes_the_xla_path():
    """The kernel reads only interleaved codes: a weight `prepare` has not laid out (packed by
    hand, quant.packed.quantize) multiplies on xla.py, with the same result."""
    assert cpu.TARGET not in _lowered(1, "q4_1", prepared=False)
    x, w = _inputs("q4_1", 1, 128, 48, seed=7)
    _close(quant_matmul(x, w), quant_matmul(x, prepare(w)), rtol=1e-5)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float-x", "int8-x"])
def test_weights_of_one_x_share_one_kernel_call(int8_activations):
    """quant_matmuls: a layer's q / k / v (three widths: whole 64-column tiles, half a tile,
    several column ranges) are one kernel call on CPU, each result the oracle's; weights of different formats are
    one call each; the TPU kernel (interpreted) runs them one by one; bad input is a
    ValueError."""
    from dataclasses import replace

    from pallas_kernels.quant_matmul import quant_matmuls
    from quant.packed import round_activation_blocks

    ws = [replace(_inputs("q4_1", 1, 128, n, seed=30 + n)[1], int8_activations=int8_activations)
          for n in (96, 32, 1040)]
    x = jnp.asarray(np.random.default_rng(31).normal(size=(3, 128)), jnp.float32)
    xr = round_activation_blocks(x, "q4_1", 32) if int8_activations else x
    text = jax.jit(lambda x, ws: quant_matmuls(x, ws)).lower(x, [prepare(w) for w in ws]).as_text()
    assert text.count(f"@{cpu.TARGET}(") == 1
    for interpret in (None, True):
        got = quant_matmuls(x, [prepare(w) for w in ws], interpret=interpret)
        for g, w in zip(got, ws):
            _close(g, _oracle(xr, w), rtol=1e-5)
    mixed = [prepare(ws[0]), prepare(_inputs("q8_0", 1, 128, 48, seed=32)[1])]
    text = jax.jit(lambda x, ws: quant_matmuls(x, ws)).lower(x, mixed).as_text()
    assert text.count(f"@{cpu.TARGET}(") == 2
    with pytest.raises(ValueError, match="at least one weight"):
        quant_matmuls(x, [])
    with pytest.raises(ValueError, match="input features"):
        quant_matmuls(x[:, :64], [prepare(w) for w in ws])


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float-x", "int8-x"])
def test_the_norm_before_the_projections_runs_inside_the_kernel(int8_activations):
    """norm=(weight, eps) multiplies x RMS-normalized (float64 oracle: x / sqrt(mean(x^2) +
    eps) * weight): on CPU inside the one kernel call, with no norm left to XLA; on the TPU
    kernel (interpreted) and for bfloat16 x after XLA's norm. A norm weight of another width
    is a ValueError, and the kernel refuses one that does not match x."""
    from dataclasses import replace

    from pallas_kernels.quant_matmul import quant_matmuls
    from quant.packed import round_activation_blocks

    raw = [replace(_inputs("q4_1", 1, 128, n, seed=40 + n)[1], int8_activations=int8_activations) for n in (96, 48)]
    ws = [prepare(w) for w in raw]
    rng = np.random.default_rng(41)
    x = jnp.asarray(rng.normal(size=(3, 128)) * 4, jnp.float32)
    weight, eps = jnp.asarray(rng.uniform(0.5, 1.5, 128), jnp.float32), 1e-5
    x64 = np.asarray(x, np.float64)
    xn = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    xr = round_activation_blocks(jnp.asarray(xn, jnp.float32), "q4_1", 32) if int8_activations else xn
    text = jax.jit(lambda x, w, ws: quant_matmuls(x, ws, norm=(w, eps))).lower(x, weight, ws).as_text()
    assert text.count(f"@{cpu.TARGET}(") == 1
    # Without VNNI int8 activations are rounded in XLA, after XLA's norm.
    assert ("rsqrt" in text) == (int8_activations and not cpu.int8_tiles("q4_1", 32))
    for interpret in (None, True):
        for got, w in zip(quant_matmuls(x, ws, norm=(weight, eps), interpret=interpret), raw):
            _close(got, _oracle(xr, w), rtol=1e-5)
        _close(quant_matmul(x, ws[0], norm=(weight, eps), interpret=interpret), _oracle(xr, raw[0]), rtol=1e-5)
    got = quant_matmuls(x.astype(jnp.bfloat16), ws, norm=(weight, eps))
    assert got[0].dtype == jnp.bfloat16
    _close(got[0], _oracle(xr, raw[0]), rtol=3e-2)
    with pytest.raises(ValueError, match="norm weight"):
        quant_matmuls(x, ws, norm=(weight[:64], eps))
    with pytest.raises(ValueError, match="eps must be a number >= 0"):
        quant_matmul(x, ws[0], norm=(weight, -1.0))
    with pytest.raises(ValueError, match="pair"):
        quant_matmul(x, ws[0], norm=weight)
    w = ws[0]
    with pytest.raises(Exception, match="norm weight must be float32"):
        cpu.quant_matmul_cpu(x, w.codes, *w.float_scales(), fmt="q4_1", group=32,
                             norm=(weight[:64], eps)).block_until_ready()


def test_bfloat16_activations_come_back_in_their_dtype():
    x, w = _inputs("q4_1", 3, 128, 48, seed=7)
    got = quant_matmul(x.astype(jnp.bfloat16), prepare(w))
    assert got.dtype == jnp.bfloat16
    _close(got, _oracle(x.astype(jnp.bfloat16), w), rtol=1e-2)


def test_mismatched_buffers_are_refused_by_the_kernel():
    x, w = _inputs("q4_1", 2, 128, 48, seed=8)
    with pytest.raises(Exception, match="codes / scale shapes"):
        cpu.quant_matmul_cpu(x, w.codes, w.scale, w.offset, fmt="q4_1", group=64).block_until_ready()
    with pytest.raises(Exception, match="codes must be int8 or uint8"):
        cpu.quant_matmul_cpu(x, w.codes.astype(jnp.int32), w.scale, w.offset, fmt="q4_1",
                             group=32).block_until_ready()
    x, w = _inputs("int8", 2, 90, 48, seed=8)  # one group of 90 rows: not whole four-row words
    assert not prepare(w).interleaved
    with pytest.raises(Exception, match="multiple of 4 stored rows"):
        cpu.quant_matmul_cpu(x, w.codes, w.scale, None, fmt="int8", group=90).block_until_ready()


def test_a_failed_build_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="building the CPU quantized-matmul kernel failed"):
        cpu.build(force=True)
    assert not list(tmp_path.iterdir())  # no half-written library left behind


@pytest.mark.skipif(not cpu.vnni(), reason="the int8-activation tiles need AVX-512 VNNI")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fmt", sorted(f for f in cpu.CPU_FORMATS if FORMATS[f].gguf))
def test_int8_activation_tiles_match_the_oracle_of_rounded_x(fmt, shape):
    """The kernel's own rounding of x (per activation block, in C++) and its integer dot
    products (nibble lanes of two stored rows, int8 lanes of four rows offset to unsigned)
    give the float64 oracle of the rounded x, over the shapes of the float tiles."""
    from quant.packed import round_activation_blocks

    t, d_in, d_out = shape
    w = _weight(fmt, d_in, d_out, seed=5)
    x = jnp.asarray(np.random.default_rng(t + 1).normal(size=(t, w.shape[0])), jnp.float32)
    got = _run(x, w, int8_activations=True)
    _close(got, _oracle(round_activation_blocks(x, fmt, w.group), w), rtol=1e-5)


@pytest.mark.skipif(not cpu.vnni(), reason="the int8-activation tiles need AVX-512 VNNI")
def test_int8_activations_of_an_uneven_block_round_row_by_row():
    """A block that is not 16 rows (int8 per channel over 100 inputs: one block of 25
    four-row lanes, an odd count) takes the kernel's row-by-row rounding and the odd lane's
    tail; the result is still the oracle of the rounded x."""
    from quant.packed import round_activation_blocks

    x, w = _inputs("int8", 1, 100, 80, seed=12)
    assert w.group == 100 and cpu.int8_tiles("int8", w.group)
    got = _run(x, w, int8_activations=True)
    _close(got, _oracle(round_activation_blocks(x, "int8", w.group), w), rtol=1e-5)


def test_a_build_without_vnni_refuses_int8_activations(portable):
    x, w = _inputs("q4_1", 2, 128, 48, seed=9)
    with pytest.raises(Exception, match="no int8 activations"):
        cpu.quant_matmul_cpu(x, w.codes, w.scale, w.offset, fmt="q4_1", group=32, target=portable[0],
                             int8_activations=True).block_until_ready()


def test_calls_running_at_once_each_get_their_own_result():
    """One call at a time holds the kernel's crew of helper threads; calls that XLA runs at
    the same time (programs from several Python threads) run beside it on their own thread.
    Each program is a chain of matmuls big enough for the crew, each result feeding the
    next, so a helper's late or misdirected write changes the end result: every thread's
    result is the float64 chain's, run after run."""
    import concurrent.futures

    weights = [_inputs("q4_1", 1, 512, 512, seed=20 + i)[1] for i in range(6)]
    assert 512 * 512 >= 1 << 18  # big enough for the crew
    dense = [np.asarray(w.dequantize(), np.float64) for w in weights]

    @jax.jit
    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(_run(x, w) * 0.05)
        return x

    def check(seed):
        x = np.random.default_rng(seed).normal(size=(1, 512))
        want = x
        for w in dense:
            want = np.tanh(want @ w * 0.05)
        for _ in range(30):
            _close(chain(jnp.asarray(x, jnp.float32), weights), want, rtol=1e-4)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(check, range(3)))
