"""The engine's jitted step lowers to a Pallas kernel in every attention layer, for TPU
and CUDA, checked by jax.export from this CPU host (no device needed): decode-only steps
and mixed prefill + decode steps, float and low-bit pools. On CUDA decode-only float steps
run the Triton paged decode kernel and other steps over float, int8, fp8, nvfp4 and mxfp4
pools the Triton ragged kernel; TurboQuant pools lower to the XLA path there. On this CPU
a decode step runs the C++ kernel in every layer (every pool but MXFP4's), and so does a
mixed step."""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import model
from model import key_centers
from model.config import ModelConfig
from serving.engine import Row
from serving.runner import ModelRunner, _step

from pallas_kernels.lowering import TRITON_CALL, abstract_tpu_mesh, export_cuda, export_tpu, kernel_calls
from tests.pallas_kernels.helpers import spec
from tests.round_trips import rounding_round_trips

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
    fn = lambda params, pool, batch: _step(params, config, PAGE_SIZE, pool, batch, False, False)
    return fn, [jax.tree.map(spec, params), jax.tree.map(spec, runner.pool), jax.tree.map(spec, batch)]


def test_float_pool_decode_step_calls_the_kernel_in_every_layer(tiny):
    fn, specs = _step_specs(*tiny, "auto")
    assert kernel_calls(export_tpu(fn, *specs), "tpu_custom_call") == LAYERS
    assert kernel_calls(export_cuda(fn, *specs), TRITON_CALL) == LAYERS


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "nvfp4", "turboquant-3.5"])
def test_quantized_pool_decode_step_calls_the_kernels_in_every_layer(tiny, kv_cache_dtype):
    config, params = tiny  # with the key centers LLM gives quantized pools (model/key_centers.py)
    params = key_centers.set_key_centers(params, [jnp.ones(config.num_kv_heads * config.head_dim)] * LAYERS)
    fn, specs = _step_specs(config, params, kv_cache_dtype)
    assert kernel_calls(export_tpu(fn, *specs), "tpu_custom_call") == LAYERS
    on_gpu = kv_cache_dtype != "turboquant-3.5"  # TurboQuant pages take the XLA path on CUDA
    assert kernel_calls(export_cuda(fn, *specs), TRITON_CALL) == (LAYERS if on_gpu else 0)


def _cpu_kernel_available():
    from pallas_kernels.ragged_paged_attention import cpu

    return jax.default_backend() == "cpu" and cpu.available()


@pytest.mark.skipif(not _cpu_kernel_available(), reason="the C++ kernel is a CPU backend's, when built")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8", "fp8", "nvfp4", "mxfp4", "turboquant-3.5",
                                            "turboquant-2.5"])
@pytest.mark.parametrize("lens", [(1, 1), (9, 1)], ids=["decode", "mixed"])
def test_step_on_cpu_calls_the_cpu_kernel_in_every_layer(tiny, kv_cache_dtype, lens):
    """On this CPU a decode step's attention is the C++ kernel's (pallas_kernels/
    ragged_paged_attention/cpu.py) in every layer, over every pool but MXFP4's, whose pages
    take the XLA path; TurboQuant pools through the kernel's TurboQuant handler. So is a
    step with a prefill chunk (cut into tiles)."""
    from pallas_kernels.ragged_paged_attention import cpu

    config, params = tiny
    if key_centers.applies(config, kv_cache_dtype):
        params = key_centers.set_key_centers(params, [jnp.ones(config.num_kv_heads * config.head_dim)] * LAYERS)
    fn, specs = _step_specs(config, params, kv_cache_dtype, lens=lens)
    text = jax.jit(fn).lower(*specs).as_text()
    turbo = kv_cache_dtype.startswith("turboquant")
    assert kernel_calls(text, f"@{cpu.TURBO_TARGET}(") == (LAYERS if turbo else 0)
    assert kernel_calls(text, f"@{cpu.TARGET}(") == (0 if turbo or kv_cache_dtype == "mxfp4" else LAYERS)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_mixed_prefill_and_decode_step_calls_the_kernels_in_every_layer(tiny, kv_cache_dtype):
    """A prefill chunk and a decode row in one packed step: one ragged kernel per layer."""
    fn, specs = _step_specs(*tiny, kv_cache_dtype, lens=(9, 1))
    assert kernel_calls(export_tpu(fn, *specs), "tpu_custom_call") == LAYERS
    assert kernel_calls(export_cuda(fn, *specs), TRITON_CALL) == LAYERS


@pytest.mark.parametrize("lens", [(9, 1), (1, 1)], ids=["mixed", "decode"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "int8", "fp8", "nvfp4", "mxfp4", "turboquant-3.5"])
def test_step_keeps_every_kv_rounding_when_xla_gpu_folds_convert_pairs(tiny, kv_cache_dtype, lens):
    """A step that writes a prefill chunk and a decode row (or decode rows alone) into a pool of
    each kv_cache_dtype holds no float convert pair that XLA:GPU would fold away
    (tests/round_trips.py): on an H200 the NVFP4 writes picked their codes against unrounded
    block scales until E4M3 was decoded from its bits."""
    fn, specs = _step_specs(*tiny, kv_cache_dtype, lens=lens)
    assert rounding_round_trips(fn, *specs) == []


def test_speculative_step_runs_every_attention_of_target_and_draft_on_the_kernels(tiny):
    """One speculative step with a decode row and a verify row packed together: the
    target's layers (the tree as ancestor bits), the draft's pass over the same packed
    tokens and tree growth (a loop over levels) all call the ragged kernel, in one
    jitted call: Pallas on TPU and CUDA, and on this CPU the C++ kernel."""
    import dataclasses

    import numpy as np

    from model import eagle3
    from serving.draft_tree import DraftTree, TreeSpec
    from serving.runner import Drafter, _spec_step

    config = dataclasses.replace(tiny[0], layer_kinds=("attention",) * 4)  # EAGLE-3 needs 4
    params = model.init_params(config, jax.random.key(0))
    draft_config = eagle3.Eagle3Config(config, config.vocab_size, eagle3.feature_layers(4), "tiny")
    draft_params = eagle3.init_draft_params(draft_config, params, np.arange(config.vocab_size),
                                            jax.random.key(1))
    spec_ = TreeSpec(depth=3, top_k=2, num_tokens=4)
    runner = ModelRunner(config, params, num_pages=16, page_size=PAGE_SIZE, max_pages_per_seq=8,
                         max_num_seqs=4, draft=Drafter(draft_config, draft_params, spec_))
    tree = DraftTree(np.array([3, 4, 5, 6]), np.array([-1, 0, 0, 1]), np.zeros(4, np.float32))
    verify = Row(tokens=[3], start=5, block_table=[0, 1], sample=True, tree=tree)
    decode = Row(tokens=[3], start=7, block_table=[2, 3], sample=True)
    batch = runner.step_batch([decode, verify])
    assert batch.tokens.shape == (2 * spec_.num_tokens,) and batch.tree.start.tolist() == [-1, 5]
    fn = lambda params, draft_params, pool, batch: _spec_step(
        params, config, PAGE_SIZE, draft_params, draft_config, spec_, pool, batch, False, False)
    specs = [jax.tree.map(spec, x) for x in (params, draft_params, runner.pool, batch)]
    calls = 4 + 1 + 1  # target, draft over the packed tokens, the tree-growth loop's body
    assert kernel_calls(export_tpu(fn, *specs), "tpu_custom_call") == calls
    assert kernel_calls(export_cuda(fn, *specs), TRITON_CALL) == calls
    from pallas_kernels.ragged_paged_attention import cpu

    if _cpu_kernel_available():  # on this CPU, the C++ kernel, trees and all
        assert kernel_calls(jax.jit(fn).lower(*specs).as_text(), f"@{cpu.TARGET}(") == calls


def test_a_lora_step_runs_every_projection_through_the_lora_kernel(tiny):
    """With LoRA stacks every projection of every layer (7 per layer) adds its tokens'
    adapter terms through the batched LoRA kernel, beside one attention kernel per layer."""
    from model import lora

    config, params = tiny
    fn, specs = _step_specs(config, params, "auto", lens=(9, 1))
    stacks = lora.init_stacks(config, num_slots=2, rank=16)
    lora_fn = lambda params, pool, batch, stacks: _step(params, config, PAGE_SIZE, pool, batch, False, False,
                                                        stacks)
    lora_specs = [*specs, jax.tree.map(spec, stacks)]
    per_layer = 1 + len(lora.PROJECTIONS)
    assert kernel_calls(export_tpu(lora_fn, *lora_specs), "tpu_custom_call") == LAYERS * per_layer
    assert kernel_calls(export_cuda(lora_fn, *lora_specs), TRITON_CALL) == LAYERS * per_layer


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "nvfp4"])
def test_a_tensor_parallel_step_runs_the_kernels_inside_shard_map(tiny, kv_cache_dtype):
    """A mixed step over a 2-way tensor-parallel mesh of TPU devices: weights and pages carry their
    shardings, and each layer's attention kernel runs inside a shard_map (a manual
    computation over the heads), which XLA cannot partition otherwise."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from model.sharding import AXES, kv_spec, param_specs

    config, params = tiny
    mesh = jax.sharding.AbstractMesh((1, 1, 2), AXES, abstract_device=abstract_tpu_mesh().abstract_device)
    fn, (params_spec, pool_spec, batch_spec) = _step_specs(config, params, kv_cache_dtype, lens=(9, 1))
    placed = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
    specs = [jax.tree.map(placed, params_spec, param_specs(params, config, 2)),
             jax.tree.map(lambda x: placed(x, kv_spec(x)), pool_spec),
             jax.tree.map(lambda x: placed(x, P()), batch_spec)]
    sharded = lambda params, pool, batch: _step(params, config, PAGE_SIZE, pool, batch, False, False, None, mesh)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(jax.jit(sharded), platforms=["tpu"])(*specs)
    mlir = exported.mlir_module()
    assert exported.nr_devices == 2
    assert kernel_calls(mlir, "tpu_custom_call") == LAYERS
    assert mlir.count("sdy.manual_computation") == LAYERS  # one shard_map per attention layer
    assert '#sdy.sharding<@mesh, [{}, {"expert", "model"}]>' in mlir  # the column-split projections


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_expert_parallel_moe_exchanges_tokens_by_ragged_all_to_all(platform):
    """On TPU and GPU a MoE layer over 2 expert groups of 2 devices sends its tokens to
    their experts and back with jax.lax.ragged_all_to_all (three: rows, their experts, the
    outputs), each within the devices of one "model" index, and sums the hidden-unit
    parts with one all-reduce; no padded all_to_all."""
    import os

    from jax.sharding import NamedSharding, PartitionSpec as P

    from model import moe
    from model.sharding import AXES, param_specs
    from tests.model import golden

    config, params = model.load(os.path.join(golden.FIXTURES, "tiny_qwen3_moe"))
    layer = params["layers"][config.moe_layers[0]]
    device = (abstract_tpu_mesh().abstract_device if platform == "tpu" else
              jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
    mesh = jax.sharding.AbstractMesh((1, 2, 2), AXES, abstract_device=device)
    specs = param_specs({"layers": [layer]}, config, 4)["layers"][0]
    placed = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
    args = [{n: placed(a, specs[n]) for n, a in layer.items()},
            jax.ShapeDtypeStruct((16, config.hidden_size), jax.numpy.float32, sharding=NamedSharding(mesh, P()))]
    with jax.sharding.use_abstract_mesh(mesh):
        exported = export.export(jax.jit(lambda p, x: moe.moe(p, config, x, mesh)), platforms=[platform],
                                 disabled_checks=[export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*args)
    mlir = exported.mlir_module()
    assert exported.nr_devices == 4
    calls = [line for line in mlir.splitlines() if "custom_call @ragged_all_to_all" in line]
    assert len(calls) == 3
    assert all("replica_groups = dense<[[0, 2], [1, 3]]>" in line for line in calls)  # over "expert"
    assert "stablehlo.all_to_all" not in mlir and mlir.count("stablehlo.all_reduce") == 1
