"""The engine's jitted step lowers to a Pallas kernel in every attention layer, for TPU
and CUDA, checked by jax.export from this CPU host (no device needed): decode-only steps
and mixed prefill + decode steps, float and low-bit pools. On CUDA only decode-only float
steps have a kernel (the Triton paged decode kernel); the rest lower to the XLA path."""

import jax
import jax.numpy as jnp
import pytest

import model
from model.config import ModelConfig
from serving.runner import ModelRunner, Row, _step
from tests.pallas_kernels.helpers import TRITON_CALL, export_cuda, export_tpu, spec

LAYERS = 3
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def tiny():
    # head_dim and page_size powers of two >= 16: what the Triton kernel takes
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_heads=4,
                         num_kv_heads=2, head_dim=32, layer_kinds=("attention",) * LAYERS,
                         max_position_embeddings=256)
    return config, model.init_params(config, jax.random.key(0))


def _step_specs(config, params, kv_cache_dtype, lens=(1, 1), pages_per_seq=8):
    """The packed step over rows of `lens` new tokens each, as abstract arrays."""
    runner = ModelRunner(config, params, num_pages=16, page_size=PAGE_SIZE, max_pages_per_seq=pages_per_seq,
                         max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    rows = [Row(tokens=[3] * n, start=5, block_table=[2 * i, 2 * i + 1], sample=True)
            for i, n in enumerate(lens)]
    batch = runner.step_batch(rows)
    fn = lambda params, pool, batch: _step(params, config, PAGE_SIZE, pool, batch, False)
    return fn, [jax.tree.map(spec, params), jax.tree.map(spec, runner.pool), jax.tree.map(spec, batch)]


def test_float_pool_decode_step_calls_the_kernel_in_every_layer(tiny):
    fn, specs = _step_specs(*tiny, "auto")
    assert export_tpu(fn, *specs).count("tpu_custom_call") == LAYERS
    assert export_cuda(fn, *specs).count(TRITON_CALL) == LAYERS


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "nvfp4", "turboquant-3.5"])
def test_quantized_pool_decode_step_calls_the_tpu_kernel_in_every_layer(tiny, kv_cache_dtype):
    fn, specs = _step_specs(*tiny, kv_cache_dtype)
    assert export_tpu(fn, *specs).count("tpu_custom_call") == LAYERS


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_mixed_prefill_and_decode_step_calls_the_tpu_kernel_in_every_layer(tiny, kv_cache_dtype):
    """A prefill chunk and a decode row in one packed step: one ragged kernel per layer."""
    fn, specs = _step_specs(*tiny, kv_cache_dtype, lens=(9, 1))
    assert export_tpu(fn, *specs).count("tpu_custom_call") == LAYERS
