"""Shared test helpers: random paged KV, a float64 numpy oracle, lowering checks, a reader
of compiled HLO, and the switch that runs the kernel tests compiled on a GPU (or TPU)
instead of interpreted."""

from __future__ import annotations

import functools
import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# KVFOLD_KERNELS=compiled (tests/conftest.py; set by `python -m pallas_kernels.gpu_check`):
# the kernel tests keep their CPU meaning, "interpret=None is the XLA reference,
# interpret=True is the kernel", but the kernel runs compiled for the device (Triton /
# Mosaic GPU / Mosaic TPU where its entry has one, the XLA reference otherwise).
TPU_INTERPRET_ONLY = (
    "TPU interpret semantics (NaN-filled scratch, out-of-bounds reads raising) exist only "
    "in interpret mode; KVFOLD_KERNELS=compiled runs the kernels compiled"
)


@functools.partial(jax.jit, static_argnames=("ref",))
def _reference(*args, ref):
    return ref(*args)


def compile_kernels(monkeypatch, module) -> None:
    """Make one test module's kernel calls compiled for the device (undone by monkeypatch).

    pallas_kernels.dispatch, called on arrays: interpret falsy -> the XLA reference (the
    tests' "want", as on CPU); interpret=True -> the platform's own branch, compiled; a
    pltpu.InterpretParams skips the test (TPU_INTERPRET_ONLY). Called while tracing
    (jax.export lowering checks), interpret falsy keeps the real per-platform dispatch.
    Direct calls of a kernel_gpu function get interpret=False whatever the test passed.
    """
    from pallas_kernels import dispatch

    staged = dispatch._staged

    def compiled_staged(*args, ref, tpu, gpu, interpret, cpu=None):
        if interpret and interpret is not True:
            pytest.skip(TPU_INTERPRET_ONLY)
        if interpret and gpu is None and jax.default_backend() == "gpu":
            pytest.skip("this entry has no GPU kernel (CUDA runs its XLA reference): "
                        "there is no kernel to compare with the reference")
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        if not interpret and not traced:
            return _reference(*args, ref=ref)
        return staged(*args, ref=ref, tpu=tpu, gpu=gpu, cpu=cpu, interpret=None)

    monkeypatch.setattr(dispatch, "_staged", compiled_staged)
    for name, fn in list(vars(module).items()):
        if callable(fn) and getattr(fn, "__module__", "").endswith(".kernel_gpu"):
            if "interpret" in inspect.signature(fn).parameters:
                monkeypatch.setattr(module, name, _compiled(fn))


def _compiled(kernel):
    @functools.wraps(kernel)
    def call(*args, **kwargs):
        return kernel(*args, **{**kwargs, "interpret": False})

    return call


def assert_close(actual, expected, rtol=1e-5, atol=1e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = ~np.isneginf(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=rtol, atol=atol)


def paged_inputs(
    rng,
    *,
    kv_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    page_size,
    max_pages,
    num_pages=None,
    dtype=jnp.float32,
):
    """Random q and page pools; each sequence gets distinct random pages (shuffled).

    Block-table slots past a sequence's last page hold garbage (-7 or a huge id) to show
    they are never read.
    """
    batch = len(kv_lens)
    used = [-(-n // page_size) for n in kv_lens]
    num_pages = num_pages or max(sum(used), 1) + 1
    perm = rng.permutation(num_pages)
    table = np.where(rng.random((batch, max_pages)) < 0.5, -7, 10**6).astype(np.int32)
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[start : start + n]
        start += n
    q = rng.standard_normal((batch, num_q_heads, head_dim))
    k = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim))
    v = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim))
    as_dtype = lambda x: jnp.asarray(x, dtype)
    return (
        as_dtype(q),
        as_dtype(k),
        as_dtype(v),
        jnp.asarray(table),
        jnp.asarray(np.asarray(kv_lens, np.int32)),
    )


def dense_attention_f64(q, k, v, mask, sm_scale, sinks=None, logits_fn=None):
    """Independent float64 numpy softmax attention. q [Hq, D]; k, v [S, Hkv, D]; mask [S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if not mask.any() and sinks is None:
        return np.zeros(q.shape), np.full(q.shape[0], -np.inf)
    num_q_heads, num_kv_heads = q.shape[0], k.shape[1]
    kh = np.repeat(k, num_q_heads // num_kv_heads, axis=1)  # [S, Hq, D]
    vh = np.repeat(v, num_q_heads // num_kv_heads, axis=1)
    s = np.einsum("hd,shd->hs", q, kh) * sm_scale
    if logits_fn is not None:
        s = logits_fn(s)
    s = np.where(mask[None, :], s, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, np.asarray(sinks, np.float64)[:, None]], axis=1)
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m)
    denom = e.sum(axis=1, keepdims=True)
    if sinks is not None:
        e = e[:, :-1]
    return np.einsum("hs,shd->hd", e / denom, vh), (m + np.log(denom))[:, 0]


def spec(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def entry_ops_of_at_least(hlo: str, elements: int) -> list[tuple[str, str]]:
    """(opcode, line) of the compiled HLO's entry instructions whose array result has at
    least `elements` elements. A fusion goes by what its fused computation computes: its
    root's opcode, or under a root bitcast the opcode the bitcasts view (a fusion makes a
    new buffer, so a bitcast-convert or copy there is one; an entry bitcast is a view)."""
    instruction = re.compile(r"\s*(ROOT )?%([\w.-]+) = \w+\[([\d,]*)\](?:\{[^}]*\})?\s+([\w-]+)\((?:%([\w.-]+))?")
    computations, name, entry = {}, None, None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):  # a computation's header
            words = line.split()
            name = words[1] if words[0] == "ENTRY" else words[0]
            entry = name if words[0] == "ENTRY" else entry
            computations[name] = []
        elif name is not None and (match := instruction.match(line)):
            computations[name].append((match, line))

    def computed(body):
        ops = {m.group(2): (m.group(4), m.group(5)) for m, _ in body}
        op, operand = next(ops[m.group(2)] for m, _ in body if m.group(1))
        while op == "bitcast" and operand in ops:
            op, operand = ops[operand]
        return op

    found = []
    for match, line in computations[entry]:
        op = match.group(4)
        if op == "fusion":
            op = computed(computations[re.search(r"calls=(%[\w.-]+)", line).group(1)])
        if math.prod(int(d) for d in match.group(3).split(",") if d) >= elements:
            found.append((op, line.strip()[:200]))
    return found


def assert_written_in_place(hlo: str, elements: int, leaves: int) -> None:
    """The compiled program `hlo` over donated pool leaves of at least `elements` elements
    each holds every leaf as a parameter and a scatter into it, and nothing else as large
    but views (bitcasts): no copy of a pool."""
    large = entry_ops_of_at_least(hlo, elements)
    ops = [op for op, _ in large]
    assert ops.count("parameter") == leaves  # (the parse found them)
    assert ops.count("scatter") == leaves  # written in place
    assert not [line for op, line in large if op not in ("parameter", "bitcast", "scatter")]
