"""The engine's jitted decode step lowers to a Pallas kernel in every attention layer,
for TPU and CUDA, checked by jax.export from this CPU host (no device needed). Low-bit
pools are read by the TPU kernel; CUDA has no kernel for them yet (XLA reference).

Prefill chunks and draft-tree verification still take the dense XLA path (their
kernel, ragged_paged_attention with a tree mask, is not wired into the model yet)."""

import jax
import jax.numpy as jnp
import pytest

import model
from model.config import ModelConfig
from serving.runner import ModelRunner, _step
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


def _decode_step_specs(config, params, kv_cache_dtype, batch=2, pages_per_seq=8):
    runner = ModelRunner(config, params, num_pages=16, page_size=PAGE_SIZE, max_pages_per_seq=pages_per_seq,
                         max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    i32, u32, f32 = jnp.int32, jnp.uint32, jnp.float32
    arrays = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((batch, pages_per_seq), i32), ((batch, 1), i32), ((batch, 1), i32), ((batch,), i32),  # tables..last
        ((batch,), u32), ((batch,), u32), ((batch,), f32), ((batch,), i32), ((batch,), f32),
        ((batch,), f32)]]  # seeds, counters, temperature, top_k, top_p, min_p
    fn = lambda params, pool, *a: _step(params, config, PAGE_SIZE, pool, *a, False)
    return fn, [jax.tree.map(spec, params), jax.tree.map(spec, runner.pool), *arrays]


def test_float_pool_decode_step_calls_the_kernel_in_every_layer(tiny):
    fn, specs = _decode_step_specs(*tiny, "auto")
    assert export_tpu(fn, *specs).count("tpu_custom_call") == LAYERS
    assert export_cuda(fn, *specs).count(TRITON_CALL) == LAYERS


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "nvfp4", "turboquant-3.5"])
def test_quantized_pool_decode_step_calls_the_tpu_kernel_in_every_layer(tiny, kv_cache_dtype):
    fn, specs = _decode_step_specs(*tiny, kv_cache_dtype)
    assert export_tpu(fn, *specs).count("tpu_custom_call") == LAYERS
