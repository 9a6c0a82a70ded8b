"""Greedy decoding's pick: the XLA statement (ref.py), the CPU kernel and the entry against
numpy's argmax, and the entry's choice of the kernel on CPU alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.first_max import cpu, first_max, ref

IMPLEMENTATIONS = {"ref": ref.first_max, "entry": first_max}
if jax.default_backend() == "cpu":
    IMPLEMENTATIONS["kernel"] = cpu.first_max_cpu


def _rows():
    """Random rows, rows of ties, -inf, the maximum twice, and in the last partial vector."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((7, 1000)).astype(np.float32)  # 62 vectors of 16 and 8 more
    rows[1] = np.round(rows[1])  # many ties at the maximum
    rows[2, :] = 1.5
    rows[3, ::2] = -np.inf
    rows[4, 997] = rows[4, 3] = 9.0
    rows[5, 995] = 9.0  # alone in the tail
    rows[6, :] = -np.inf
    return rows


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_first_max_is_numpys_argmax_ties_included(name):
    """numpy's argmax (the first of tied maxima) on the rows together and one at a time (the
    XLA statement's single-row path is lax.top_k), rows shorter than one vector, and 0 for a
    row holding a NaN anywhere (in the whole vectors or the tail)."""
    pick = jax.jit(IMPLEMENTATIONS[name])
    rows = _rows()
    np.testing.assert_array_equal(np.asarray(pick(jnp.asarray(rows))), rows.argmax(axis=1))
    for row in rows:
        assert pick(jnp.asarray(row[None])).tolist() == [row.argmax()]
    for width in (1, 3, 16, 17):
        short = np.random.default_rng(width).standard_normal((3, width)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(pick(jnp.asarray(short))), short.argmax(axis=1))
    assert pick(jnp.full((2, 5), jnp.nan)).tolist() == [0, 0]
    some_nan = np.tile(rows[4], (3, 1))
    some_nan[0, 500], some_nan[1, 999], some_nan[2, 0] = np.nan, np.nan, np.nan
    assert pick(jnp.asarray(some_nan)).tolist() == [0, 0, 0]
    assert pick(jnp.asarray(some_nan[:1])).tolist() == [0]


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_infinite_maxima_and_one_column_rows(name):
    pick = jax.jit(IMPLEMENTATIONS[name])
    rows = np.zeros((3, 40), np.float32)
    rows[0, [7, 30]] = np.inf
    rows[1, :] = -np.inf
    rows[2, 39] = np.inf
    np.testing.assert_array_equal(np.asarray(pick(jnp.asarray(rows))), [7, 0, 39])
    assert pick(jnp.asarray([[np.inf, np.inf]], jnp.float32)).tolist() == [0]
    assert pick(jnp.asarray([[2.5]], jnp.float32)).tolist() == [0]


def test_the_entry_keeps_leading_axes_and_refuses_bad_logits():
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, 40)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(first_max(logits)), np.asarray(logits).argmax(-1))
    row = logits[0, 0]
    assert first_max(row).shape == () and int(first_max(row)) == int(np.asarray(row).argmax())
    half = logits.astype(jnp.bfloat16)  # widened to float32 exactly
    np.testing.assert_array_equal(np.asarray(first_max(half)), np.asarray(half.astype(jnp.float32)).argmax(-1))
    with pytest.raises(ValueError, match="float logits"):
        first_max(jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="V >= 1"):
        first_max(jnp.zeros((2, 0)))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU backend")
def test_the_kernel_is_the_cpu_branch_alone():
    """The entry lowers to the kernel on this host, and an export for CUDA or TPU keeps the
    XLA statement."""
    from pallas_kernels.lowering import export_cuda, export_tpu
    from tests.pallas_kernels.helpers import spec

    logits = jnp.zeros((4, 100))
    assert cpu.available()
    assert cpu.TARGET in jax.jit(first_max).lower(logits).as_text()
    assert cpu.TARGET not in export_cuda(first_max, spec(logits))
    assert cpu.TARGET not in export_tpu(first_max, spec(logits))
