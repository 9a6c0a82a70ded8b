"""Tensor parallelism (model/sharding.py): which sizes are valid, the KV-head repetition is
the same model, every weight's split, and, on 8 simulated CPU devices (a subprocess, since
XLA_FLAGS must be set before jax starts: tests/model/eight_devices.py), sharded logits and
greedy output equal one device: the default model at tp = 3 (its 9 query and 3 KV heads)
and tp = 3 x dp = 2, a tiny Qwen3 at tp = 2 and 4, Qwen3-MoE and gpt-oss over 4 devices
with each expert split 4 ways and with whole experts per device (expert parallelism, both
token exchanges), with the weights and the pool really split. Engines at tp = 8 and dp = 2:
tests/serving/test_sharded_engine.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import model
from model.config import ATTENTION, SLIDING_ATTENTION, ModelConfig
from model.sharding import (EXPERT, MODEL, TENSOR, check_expert_parallel, check_tensor_parallel, expand_kv_heads,
                            param_specs, valid_expert_parallel_sizes, valid_tensor_parallel_sizes)
from tests.model.eight_devices import run_on_8_devices


def _config(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_heads=8, num_kv_heads=2, head_dim=16,
                layer_kinds=(ATTENTION, SLIDING_ATTENTION), max_position_embeddings=128, sliding_window=8,
                attention_bias=True, tie_word_embeddings=True)
    return ModelConfig(**{**base, **kw})


def test_valid_sizes_divide_the_query_heads_and_divide_or_repeat_the_kv_heads():
    assert valid_tensor_parallel_sizes(_config(num_heads=9, num_kv_heads=3)) == [1, 3, 9]
    assert valid_tensor_parallel_sizes(_config()) == [1, 2, 4, 8]
    assert valid_tensor_parallel_sizes(_config(num_heads=12, num_kv_heads=4)) == [1, 2, 4, 12]  # not 3, 6
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 3, 9\]"):
        check_tensor_parallel(_config(num_heads=9, num_kv_heads=3), 2)


def test_repeated_kv_heads_are_the_same_model():
    """tp = 8 over 2 KV heads repeats each 4 times: logits equal the original model's."""
    config = _config()
    params = model.init_params(config, jax.random.key(0))
    wide_config, wide = expand_kv_heads(config, params, 8)
    assert wide_config.num_kv_heads == 8 and wide["layers"][0]["wk"].shape == (64, 8 * 16)
    assert expand_kv_heads(config, params, 2)[1] is params  # nothing to repeat
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    positions = jnp.tile(jnp.arange(12), (2, 1))
    ref, _ = model.forward(params, config, tokens, positions, model.init_cache(config, 2, 32))
    out, _ = model.forward(wide, wide_config, tokens, positions, model.init_cache(wide_config, 2, 32))
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_param_specs_split_columns_rows_and_vocabulary():
    config = _config(vocab_size=98, tie_word_embeddings=False)  # 98 rows do not split 4 ways
    params = model.init_params(config, jax.random.key(0))
    specs = param_specs(params, config, 4)
    layer = specs["layers"][0]
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):
        assert layer[name] == P(None, TENSOR), name
    for name in ("wo", "w_down"):
        assert layer[name] == P(TENSOR, None), name
    assert layer["bq"] == P(TENSOR) and layer["attn_norm"] == P()
    assert specs["embed"] == P() and specs["lm_head"] == P()  # replicated: 98 % 4
    assert param_specs(params, config, 2)["embed"] == P(TENSOR, None)
    assert param_specs(params, config, 2)["lm_head"] == P(None, TENSOR)


def test_experts_split_whole_over_expert_and_by_hidden_units_over_model():
    """A MoE layer's experts: E over "expert", each expert's hidden units over "model"
    (the down projection's bias, added once after the sum, only over "expert")."""
    config = _config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, moe_bias=True,
                     layer_kinds=("attention", "attention"), moe_layers=(1,))
    params = model.init_params(config, jax.random.key(0))
    layer = param_specs(params, config, 4)["layers"][1]
    assert layer["experts_gate"] == layer["experts_up"] == P(EXPERT, None, MODEL)
    assert layer["experts_down"] == P(EXPERT, MODEL, None)
    assert layer["experts_gate_bias"] == P(EXPERT, MODEL) and layer["experts_down_bias"] == P(EXPERT)
    assert layer["router"] == P() and param_specs(params, config, 4)["layers"][0]["w_up"] == P(None, TENSOR)
    # ep divides tp and the experts; tp / ep divides the 48 hidden units (not 32 of them)
    assert valid_expert_parallel_sizes(config, 4) == [1, 2, 4]
    assert valid_expert_parallel_sizes(dataclasses.replace(config, moe_intermediate_size=12), 8) == [2, 4]
    assert valid_expert_parallel_sizes(dataclasses.replace(config, num_experts=6), 4) == [1, 2]
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 2\]"):
        check_expert_parallel(dataclasses.replace(config, num_experts=6), 4, 4)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_expert_parallel(_config(), 2, 2)


def test_bad_meshes_are_clear_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        model.make_mesh(16)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        model.make_mesh(0)
    with pytest.raises(ValueError, match="expert_parallel_size=2 must divide tensor_parallel_size=3"):
        model.make_mesh(3, expert_parallel_size=2, devices=jax.devices() * 3)
    assert model.make_mesh(4, 2, jax.devices() * 8, expert_parallel_size=2).shape == {"data": 2, "expert": 2,
                                                                                         "model": 2}
    config = _config(num_heads=9, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 3, 9\]"):
        model.forward({}, config, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                      model.init_cache(config, 1, 16), mesh=model.make_mesh(2, devices=jax.devices() * 2))


SCRIPT = r"""
# the default model (SmolLM2-135M) at tp = 3: logits, shards, then greedy through LLM (whose
# default at tp > 1 is float matrices: packed weights are not sharded yet)
config, params = model.load("default", weights_dtype="float32")
tok = model.load_tokenizer("default")
ids = tok.encode("The quick brown fox jumps over the lazy dog, then it runs to the river.")
sharded = check_forward(config, params, jnp.asarray([ids]), 3, "default")
assert shard_shape(sharded["layers"][0]["w_down"]) == (config.intermediate_size // 3, config.hidden_size)
assert shard_shape(sharded["embed"]) == (config.vocab_size // 3, config.hidden_size)
# tp = 3 x dp = 2 through LLM: greedy as transformers' on the same GGUF (the fixture), every step's
# logprobs as one device's forward; each rank on its own 3 devices with one KV head per device
golden_ref = np.load(os.path.join(golden.FIXTURES, "smollm2.npz"))
want = golden_ref["greedy0"].tolist()
prompts = [{"prompt_token_ids": golden_ref["prompt0"].tolist()}, {"prompt_token_ids": ids}]
llm = LLM(max_model_len=256, tensor_parallel_size=3, data_parallel_size=2)  # 2 ranks of 3 devices
split = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=len(want), ignore_eos=True, logprobs=1))
for r, runner in enumerate(llm.runners):
    pool = runner.pool["target"][0]["k"]
    assert pool.sharding.device_set == set(jax.devices()[3 * r:3 * r + 3]) and shard_shape(pool)[2] == 1, pool.sharding
assert split[0].outputs[0].token_ids == want, (split[0].outputs[0].token_ids, want)
full = ids + split[1].outputs[0].token_ids
logits, _ = model.forward(params, config, jnp.asarray([full]), jnp.arange(len(full))[None], model.init_cache(config, 1, 256))
logprobs = jax.nn.log_softmax(logits[0, len(ids) - 1:-1], axis=-1)
got = [lp[t] for t, lp in zip(split[1].outputs[0].token_ids, split[1].outputs[0].logprobs)]
assert np.max(np.abs(np.asarray(got) - np.take_along_axis(logprobs, jnp.asarray(split[1].outputs[0].token_ids)[:, None], 1)[:, 0])) < 1e-4
say("default LLM tp=3 x dp=2 greedy equals transformers and one device:", [r.outputs[0].token_ids for r in split])

# a tiny Qwen3 (4 query, 2 KV heads, q/k norms) at tp = 2 and 4 (KV heads repeated)
config, params = model.load(os.path.join(golden.FIXTURES, "tiny_qwen3"))
tokens = jnp.asarray(golden.tiny_tokens())
for tp in (2, 4):
    check_forward(config, params, tokens, tp, "tiny_qwen3")

# mixtures of experts over the ("expert", "model") grid: each expert split 4 ways (ep = 1) and
# experts split whole (ep = 4, tokens exchanged by all_to_all), attention sinks and biases
# split by head; greedy through LLM as transformers decoded it (the fixtures)
from model import moe
for name in ("tiny_qwen3_moe", "tiny_gpt_oss"):
    path = os.path.join(golden.FIXTURES, name)
    config, params = model.load(path)
    layer = config.moe_layers[0]
    hidden = config.moe_intermediate_size or config.intermediate_size
    for ep in (1, 4):
        sharded = check_forward(config, params, tokens, 4, name, ep)
        down = sharded["layers"][layer]["experts_down"]
        assert shard_shape(down)[:2] == (config.num_experts // ep, hidden // (4 // ep))
    x = model.transformer.embed(params, tokens, config).reshape(-1, config.hidden_size)[:13]  # 13: not a multiple of ep
    ref = moe.moe(params["layers"][layer], config, x)
    mesh = model.make_mesh(4, expert_parallel_size=2)  # 2 groups of 2 experts, each split 2 ways
    placed = model.shard_params(params, config, mesh)[1]["layers"][layer]
    for exchange in moe.EXCHANGES:  # "ragged" runs a reference of ragged_all_to_all on CPU
        out = jax.jit(lambda p, x: moe.moe(p, config, x, mesh, exchange))(placed, x)
        assert float(jnp.max(jnp.abs(out - ref))) < 1e-5 * float(jnp.max(jnp.abs(ref))), exchange
    load = moe.expert_load(params["layers"][layer], config, x)
    assert int(load.sum()) == x.shape[0] * config.num_experts_per_tok
    say(f"{name}: ep=2 x 2 equals the dense MoE by both exchanges; router load over {config.num_experts} experts:",
        load.tolist())
ref = np.load(os.path.join(path, "logits.npz"))
llm = LLM.from_loaded(config, params, tok, max_model_len=64, tensor_parallel_size=2, expert_parallel_size=2)
out = llm.generate({"prompt_token_ids": ref["tokens"][0, :golden.GREEDY_PROMPT].tolist()},
                   SamplingParams(temperature=0, max_tokens=len(ref["greedy"]), ignore_eos=True))
assert out[0].outputs[0].token_ids == ref["greedy"].tolist()
say("tiny gpt-oss LLM tp=2 ep=2 (expert parallel) greedy equals transformers")

"""


def test_sharded_logits_and_greedy_output_equal_one_device():
    run_on_8_devices(SCRIPT)


def test_llm_checks_its_parallel_sizes(default_tokenizer):
    from serving import LLM

    config = _config(vocab_size=default_tokenizer.vocab_size)
    params = model.init_params(config, jax.random.key(0))
    for kw, message in ((dict(tensor_parallel_size=0), "tensor_parallel_size"),
                        (dict(data_parallel_size="2"), "data_parallel_size"),
                        (dict(tensor_parallel_size=3), r"valid sizes: \[1, 2, 4, 8\]"),
                        (dict(expert_parallel_size=2), "needs a mixture-of-experts model"),
                        (dict(tensor_parallel_size=2), "needs 2 devices"),  # this process has one
                        (dict(tensor_parallel_size=1, data_parallel_size=2), "needs 2 devices")):
        with pytest.raises(ValueError, match=message):
            LLM.from_loaded(config, params, default_tokenizer, max_model_len=64, **kw)
