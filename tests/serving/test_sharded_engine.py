"""Engines over 8 simulated CPU devices (a subprocess: tests/model/eight_devices.py): an
8-head model at tp = 8 (KV heads repeated) equals one device through LLM, before and after
update_weights (no recompilation), its host tier's rows in numpy; at dp = 2, each rank its own engine on its own device,
requests routed to the rank holding their prefix, through LLM and the OpenAI server, and an int8 pool's key centers
on every rank."""

from tests.model.eight_devices import run_on_8_devices

# the default model's tokenizer (its vocabulary) with a tiny random model
SCRIPT = r"""
from model import key_centers
tok = model.load_tokenizer("default")
ids = tok.encode("The quick brown fox jumps over the lazy dog, then it runs to the river.")
prompts = ["The capital of France is", "Write a haiku about the sea.", "Name three colors.", "Count to five."]

# 8 query heads over 2 KV heads at tp = 8, through LLM, and update_weights on the sharded engine
config = model.ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_heads=8,
                           num_kv_heads=2, head_dim=16, layer_kinds=("sliding_attention", "attention"),
                           max_position_embeddings=256, sliding_window=8, tie_word_embeddings=True)
params = jax.tree.map(lambda a: a * 10, model.init_params(config, jax.random.key(0)))  # varied greedy text
other = jax.tree.map(lambda a: a * 10, model.init_params(config, jax.random.key(1)))
check_forward(config, params, jnp.asarray([ids[:20]]), 8, "8-head")
sampling = SamplingParams(temperature=0, max_tokens=10)
wide = LLM.from_loaded(config, params, tok, max_model_len=128, tensor_parallel_size=8)
one = LLM.from_loaded(config, params, tok, max_model_len=128)
assert [r.outputs[0].token_ids for r in wide.generate(prompts, sampling)] == \
    [r.outputs[0].token_ids for r in one.generate(prompts, sampling)]
wide.update_weights(other)
one.update_weights(other)
compiled = wide.runner.num_compilations()
after = [r.outputs[0].token_ids for r in wide.generate(prompts, sampling)]
assert wide.runner.num_compilations() == compiled  # the new weights are arguments, not constants
assert after == [r.outputs[0].token_ids for r in one.generate(prompts, sampling)]
assert shard_shape(wide.runner.params["layers"][0]["wk"]) == (64, 16)
say("8-head LLM tp=8 equals tp=1, before and after update_weights:", after)

# a quantized pool's key centers and bases repeat with the KV heads they shift and turn
centered = LLM.from_loaded(config, params, tok, max_model_len=128, tensor_parallel_size=8,
                           kv_cache_dtype="turboquant-3.5")
want = key_centers.for_kv_cache(params, config, tok, "turboquant-3.5")["layers"][0]
got = centered.runner.params["layers"][0]
np.testing.assert_allclose(np.asarray(got["k_center"]),
                           np.broadcast_to(want["k_center"].reshape(2, 1, 16), (2, 4, 16)).reshape(-1),
                           rtol=1e-5, atol=1e-6)
for name in ("k_basis", "q_basis"):
    np.testing.assert_allclose(np.asarray(got[name]), np.repeat(want[name], 4, axis=0), rtol=1e-3, atol=1e-4)
    assert shard_shape(got[name]) == (1, 16, 16)
assert shard_shape(got["k_center"]) == (16,)
del centered

# a pool split over devices keeps numpy host rows (a pinned row would gather every device's heads)
tiered = LLM.from_loaded(config, params, tok, max_model_len=128, tensor_parallel_size=2,
                         enable_hierarchical_cache=True)
assert tiered.engine.tiers.host.memory is None
try:
    LLM.from_loaded(config, params, tok, max_model_len=128, tensor_parallel_size=2,
                    enable_hierarchical_cache=True, hicache_host_memory="pinned_host")
    raise AssertionError("pinned_host rows accepted for a split pool")
except ValueError as e:
    assert "tensor_parallel_size=1" in str(e), e

# data parallel over single devices: each rank its own engine; a prefix is routed to its rank
llm = LLM.from_loaded(config, other, tok, max_model_len=128, data_parallel_size=2)
assert [r.outputs[0].token_ids for r in llm.generate(prompts, sampling)] == \
    [r.outputs[0].token_ids for r in one.generate(prompts, sampling)]
assert [r.runner.params["layers"][0]["wq"].sharding.device_set for r in llm.engine.ranks] == \
    [{d} for d in jax.devices()[:2]]
long_a, long_b = [11 + i for i in range(20)], [900 + i for i in range(20)]
llm.generate([{"prompt_token_ids": long_a}, {"prompt_token_ids": long_b}], sampling)  # rank 0, then rank 1
assert llm.engine.route(long_b + [5, 6]) == 1 and llm.engine.route(long_a + [5, 6]) == 0
again = llm.generate([{"prompt_token_ids": long_b + [5, 6]}], sampling)[0]
assert again.num_cached_tokens == 16, again.num_cached_tokens  # long_b's first page, on rank 1

# every data-parallel rank stores keys about the same centers, held on its own device
quantized = LLM.from_loaded(config, other, tok, max_model_len=128, data_parallel_size=2, kv_cache_dtype="int8")
want = key_centers.for_kv_cache(other, config, tok, "int8")["layers"]
for rank, device in zip(quantized.engine.ranks, jax.devices()[:2]):
    for got, layer in zip(rank.runner.params["layers"], want):
        np.testing.assert_allclose(np.asarray(got["k_center"]), np.asarray(layer["k_center"]), rtol=1e-5, atol=1e-6)
        assert got["k_center"].sharding.device_set == {device}
del quantized

# the OpenAI server over the two ranks: concurrent completions, greedy as one device, nothing leaked
import asyncio, httpx, openai
from serving.server import create_app
app = create_app(llm, "tiny")

async def complete(texts):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://kvfold") as http:
        client = openai.AsyncOpenAI(base_url="http://kvfold/v1", api_key="none", http_client=http, max_retries=0)
        return await asyncio.gather(*(client.completions.create(model="tiny", prompt=t, max_tokens=10,
                                                                temperature=0) for t in texts))
with app.state.engine:
    served = asyncio.run(complete(prompts))
assert [r.choices[0].text for r in served] == [r.outputs[0].text for r in one.generate(prompts, sampling)]
llm.engine.kv.check()
assert not llm.engine.requests and llm.engine.kv.num_available == llm.engine.kv.pool.num_pages
say("dp = 2 equals one device, through LLM and the server; a shared prefix is routed to the rank that cached it")
"""


def test_tensor_and_data_parallel_engines_equal_one_device():
    run_on_8_devices(SCRIPT)
