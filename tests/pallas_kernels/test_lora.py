"""The batched LoRA matmul: XLA path and Pallas kernels (TPU and GPU, interpreted) against
the gathered statement and a float64 numpy loop; lowering for TPU and CUDA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora import lora_matmul
from pallas_kernels.lora.kernel_gpu import lora_matmul_gpu
from pallas_kernels.lora.ref import lora_matmul_ref
from pallas_kernels.lowering import TRITON_CALL, export_cuda, export_tpu, kernel_calls
from tests.pallas_kernels.helpers import assert_close, spec


def _inputs(num_tokens=37, d_in=64, rank=8, num_slots=3, d_out=96, seed=0, slots=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_tokens, d_in)).astype(np.float32)
    a = rng.normal(size=(num_slots, d_in, rank)).astype(np.float32)
    b = rng.normal(size=(num_slots, rank, d_out)).astype(np.float32)
    s = rng.integers(-1, num_slots, num_tokens).astype(np.int32) if slots is None else np.int32(slots)
    return x, a, b, s


def _numpy(x, a, b, s):
    """float64, one token at a time."""
    out = np.zeros((x.shape[0], b.shape[-1]))
    for t, slot in enumerate(s):
        if slot >= 0:
            out[t] = (x[t].astype(np.float64) @ a[slot]) @ b[slot]
    return out


def test_reference_is_the_per_token_statement():
    x, a, b, s = _inputs()
    assert_close(lora_matmul_ref(*map(jnp.asarray, (x, a, b, s))), _numpy(x, a, b, s), 1e-4, 1e-3)


@pytest.mark.parametrize("interpret", [None, True], ids=["xla", "tpu-kernel"])
@pytest.mark.parametrize("case", ["mixed", "one-adapter", "none", "decode-rows"])
def test_entry_matches_the_reference(interpret, case):
    slots = {"mixed": None, "one-adapter": [1] * 37, "none": [-1] * 37,
             "decode-rows": [0, 2, -1, 1, 2, 0, 0, 1] * 4 + [2] * 5}[case]
    x, a, b, s = _inputs(slots=slots)
    got = lora_matmul(*map(jnp.asarray, (x, a, b, s)), interpret=interpret)
    assert got.shape == (37, 96) and got.dtype == jnp.float32
    assert_close(got, _numpy(x, a, b, s), 1e-4, 1e-3)
    if case == "none":
        assert not np.any(np.asarray(got))


def test_gpu_kernel_matches_the_reference_on_odd_widths():
    """Triton needs power-of-two blocks: the wrapper pads d_in (72), rank (5), slots (3)
    and d_out (100) and cuts the result back."""
    x, a, b, s = _inputs(num_tokens=21, d_in=72, rank=5, num_slots=3, d_out=100, seed=1)
    got = lora_matmul_gpu(*map(jnp.asarray, (x, a, b, s)), interpret=True)  # compiled under gpu-check
    assert got.shape == (21, 100)
    assert_close(got, _numpy(x, a, b, s), 1e-4, 1e-3)


def test_bad_inputs_are_clear_errors():
    x, a, b, s = map(jnp.asarray, _inputs())
    with pytest.raises(ValueError, match="d_in"):
        lora_matmul(x[:, :32], a, b, s)
    with pytest.raises(ValueError, match="lora_b"):
        lora_matmul(x, a, b[:, :4], s)
    with pytest.raises(ValueError, match="slots"):
        lora_matmul(x, a, b, s[:5])
    with pytest.raises(ValueError, match="slots"):
        lora_matmul(x, a, b, s.astype(jnp.float32))
    with pytest.raises(ValueError, match="num_slots"):
        lora_matmul(x, jnp.zeros((32, 64, 8)), jnp.zeros((32, 8, 96)), s)


def test_lowers_to_one_kernel_call_for_tpu_and_cuda():
    x, a, b, s = map(jnp.asarray, _inputs(num_tokens=64, d_in=576, rank=16, num_slots=4, d_out=192))
    args = [spec(t) for t in (x, a, b, s)]
    fn = lambda *t: lora_matmul(*t)  # noqa: E731
    assert kernel_calls(export_tpu(fn, *args), "tpu_custom_call") == 1
    assert kernel_calls(export_cuda(fn, *args), TRITON_CALL) == 1


def test_tpu_kernel_under_tpu_interpret_semantics():
    """Mosaic's semantics in interpret mode: uninitialised memory is NaN and an
    out-of-bounds read raises, so a block read past the padded tokens or a slot stack
    would show."""
    from jax.experimental.pallas import tpu as pltpu

    x, a, b, s = _inputs(num_tokens=21, slots=[0, 2, -1, 1, 2, 0, 0] * 3)
    semantics = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    got = lora_matmul(*map(jnp.asarray, (x, a, b, s)), interpret=semantics)
    assert_close(got, _numpy(x, a, b, s), 1e-4, 1e-3)
