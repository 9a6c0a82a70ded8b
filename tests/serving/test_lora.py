"""Multi-LoRA serving (S-LoRA / Punica): each request's output equals its merged weights
run alone, a batch mixing adapters equals the requests one by one, adapters swap through
the device slots without recompiling, the prefix cache keys on the adapter, and bad
adapters or arguments are clear errors. Adapters: PEFT fixtures of tiny_llama
(tests/model/golden.py)."""

import numpy as np
import pytest

import model
from model import lora as model_lora
from serving import LoRARequest, SamplingParams
from serving import scheduler as sched
from serving.llm import LLM
from tests.model.test_lora import adapter_path
from tests.model.test_hf_parity import tiny_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ALL = LoRARequest("all", 1, adapter_path("all"))
QV = LoRARequest("qv", 2, adapter_path("qv_rslora"))
KW = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=48)


@pytest.fixture(scope="module")
def base():
    return model.load(tiny_path("llama"))


def prompts(n, length=20, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 128, length).tolist()} for _ in range(n)]


def ids(outputs):
    return [tuple(c.token_ids) for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def make(base, default_tokenizer):
    def make(**kw):
        return LLM.from_loaded(*base, default_tokenizer, **{**KW, **kw})
    return make


@pytest.fixture(scope="module")
def merged(base, default_tokenizer):
    """Greedy outputs of the base and of each adapter merged into the weights (W + A B)."""
    config, params = base
    ps = prompts(4)
    out = {None: ids(LLM.from_loaded(config, params, default_tokenizer, **KW).generate(ps, GREEDY))}
    for req in (ALL, QV):
        adapter = model_lora.load_peft_adapter(req.lora_path, config)
        llm = LLM.from_loaded(config, model_lora.merge(params, adapter), default_tokenizer, **KW)
        out[req.lora_int_id] = ids(llm.generate(ps, GREEDY))
    assert len({out[k][0] for k in out}) == 3  # each adapter changes the output
    return out


def test_each_request_equals_its_merged_weights(make, merged):
    llm = make(enable_lora=True, max_loras=2, max_lora_rank=8)
    for req in (None, ALL, QV):
        assert ids(llm.generate(prompts(4), GREEDY, lora_request=req)) == merged[req and req.lora_int_id]


def test_a_mixed_batch_equals_the_requests_one_by_one(make, merged):
    """Requests of two adapters and the base in one batch (n=2 forks keep the adapter);
    with max_loras=1 the adapters take turns in the one slot, and reloading it compiles
    nothing."""
    ps = prompts(4)
    order = [ALL, QV, None, QV]
    want = [merged[r and r.lora_int_id][i] for i, r in enumerate(order)]
    two = make(enable_lora=True, max_loras=2, max_lora_rank=8)
    assert ids(two.generate(ps, GREEDY, lora_request=order)) == want
    assert two.runner.lora.num_device_loads == 2  # both adapters in slots at once, in one batch
    pair = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    assert ids(two.generate(ps[1], pair, lora_request=QV)) == [want[1]] * 2
    one = make(enable_lora=True, max_loras=1, max_lora_rank=8, enable_prefix_caching=False)
    assert ids(one.generate(ps, GREEDY, lora_request=order)) == want
    warm, loads = one.runner.num_compilations(), one.runner.lora.num_device_loads
    assert loads >= 2
    assert ids(one.generate(ps, GREEDY, lora_request=order)) == want  # same shapes, slot reloaded
    assert one.runner.num_compilations() == warm
    assert one.runner.lora.num_device_loads > loads


def test_the_prefix_cache_keys_on_the_adapter(make, merged):
    llm = make(enable_lora=True, max_loras=2, max_lora_rank=8)
    p = prompts(1, length=40, seed=5)
    first = llm.generate(p, GREEDY, lora_request=ALL)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate(p, GREEDY, lora_request=QV)[0].num_cached_tokens == 0  # ALL's KV is not QV's
    assert llm.generate(p, GREEDY)[0].num_cached_tokens == 0
    again = llm.generate(p, GREEDY, lora_request=ALL)[0]
    assert again.num_cached_tokens == 32 and ids([again]) == ids([first])
    llm.engine.kv.check()


def test_remove_lora_drops_its_slot_and_cached_prefixes(make, merged):
    """After remove_lora the id may name another adapter: nothing of the old one (its
    slot, its host copy, its cached K/V) is used for the new one."""
    llm = make(enable_lora=True, max_loras=2, max_lora_rank=8)
    assert llm.add_lora(ALL) and llm.list_loras() == {1}
    ps = prompts(4)
    assert ids(llm.generate(ps, GREEDY, lora_request=ALL)) == merged[1]
    cached = llm.engine.kv.radix.evictable_pages
    assert cached > 0
    assert llm.remove_lora(1) and not llm.remove_lora(1) and llm.list_loras() == set()
    assert llm.engine.kv.radix.evictable_pages < cached
    llm.engine.kv.check()
    reused = LoRARequest("qv-as-1", 1, QV.lora_path)
    out = llm.generate(ps, GREEDY, lora_request=reused)
    assert ids(out) == merged[2] and all(o.num_cached_tokens == 0 for o in out)
    stream = llm.stream(ps[0], GREEDY, lora_request=reused)
    next(stream)
    with pytest.raises(ValueError, match="in flight"):
        llm.remove_lora(1)
    list(stream)
    with pytest.raises(ValueError, match="enable_lora=True"):
        make().add_lora(ALL)


def test_the_host_lru_reads_an_evicted_adapter_again(make, merged):
    llm = make(enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    ps = prompts(4)
    for req in (ALL, QV, ALL):
        assert ids(llm.generate(ps, GREEDY, lora_request=req)) == merged[req.lora_int_id]
    assert llm.runner.lora.num_host_loads == 3


def test_bad_adapters_and_arguments_are_clear_errors(make, base, default_tokenizer, tmp_path):
    plain = make()
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(prompts(1), GREEDY, lora_request=ALL)
    llm = make(enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="max_lora_rank=4"):
        llm.generate(prompts(1), GREEDY, lora_request=QV)  # rank 8
    with pytest.raises(ValueError, match="already names adapter 'all'"):
        llm.generate(prompts(2), GREEDY, lora_request=[ALL, LoRARequest("other", 1, adapter_path("qv_rslora"))])
    with pytest.raises(ValueError, match="not a directory"):
        llm.generate(prompts(1), GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")))
    with pytest.raises(ValueError, match="lora_request must be"):
        llm.generate(prompts(1), GREEDY, lora_request="all")
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts(2), GREEDY, lora_request=[ALL])
    assert not llm.engine.has_unfinished()  # nothing half-added
    config, params = base
    wider = model.ModelConfig(**{**config.__dict__, "hidden_size": 32, "head_dim": 8})
    other = LLM.from_loaded(wider, model.init_params(wider, __import__("jax").random.key(0)),
                            default_tokenizer, **KW, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="another base model"):
        other.generate(prompts(1), GREEDY, lora_request=ALL)
    for bad, match in ((dict(max_loras=0), "max_loras"), (dict(max_lora_rank=0), "max_lora_rank"),
                       (dict(max_loras=2, max_cpu_loras=1), "max_cpu_loras"),
                       (dict(enable_lora="yes"), "enable_lora")):
        with pytest.raises(ValueError, match=match):
            make(**{"enable_lora": True, **bad})
    for bad, match in ((("", 1, "p"), "lora_name is empty"), (("a", 0, "p"), "lora_int_id"),
                       (("a", 1, None), "lora_path")):
        with pytest.raises(ValueError, match=match):
            LoRARequest(*bad)


def test_the_scheduler_admits_at_most_max_loras_adapters():
    config = sched.SchedulerConfig(page_size=16, max_loras=1)
    state = sched.SchedulerState()
    for i, lora in enumerate((1, 2, 1, 0)):
        state = sched.add(state, sched.Seq(f"s{i}", (1, 2, 3), 10, float(i), lora_id=lora))
    state, plan = sched.schedule(state, config, sched.KVView(num_available=100))
    assert plan.admitted == ("s0", "s2", "s3")  # s1's adapter waits for a slot, keeping its place
    assert [s.seq_id for s in state.waiting] == ["s1"]
    with pytest.raises(ValueError, match="max_loras"):
        sched.SchedulerConfig(page_size=16, max_loras=-1)


def test_the_server_serves_each_adapter_as_a_model(make, base, default_tokenizer):
    """vLLM's --lora-modules: a request's "model" picks the adapter; /v1/models lists them;
    an unknown name is model_not_found; a bad adapter stops the app from being built."""
    import asyncio

    import httpx
    import openai

    from serving.server import create_app

    config, params = base
    prompt = prompts(1)[0]["prompt_token_ids"]
    want = {}
    for name, req in (("tiny", None), ("all", ALL), ("qv", QV)):
        weights = params if req is None else model_lora.merge(params, model_lora.load_peft_adapter(req.lora_path, config))
        out = LLM.from_loaded(config, weights, default_tokenizer, **KW).generate([{"prompt_token_ids": prompt}], GREEDY)
        want[name] = out[0].outputs[0].text
    assert len(set(want.values())) == 3
    llm = make(enable_lora=True, max_loras=2, max_lora_rank=8)
    app = create_app(llm, "tiny", lora_modules={"all": ALL.lora_path, "qv": QV.lora_path})

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://kvfold") as http:
            client = openai.AsyncOpenAI(base_url="http://kvfold/v1", api_key="x", http_client=http, max_retries=0)
            models = await client.models.list()
            assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [
                ("tiny", None), ("all", "tiny"), ("qv", "tiny")]
            answers = await asyncio.gather(*(client.completions.create(
                model=name, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                for name in want))
            assert {name: a.choices[0].text for name, a in zip(want, answers)} == want
            with pytest.raises(openai.BadRequestError, match="model_not_found|does not exist"):
                await client.completions.create(model="nope", prompt=prompt, max_tokens=2)
            # vLLM's runtime loading: load, serve, unload; errors are 4xx naming the problem
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "qv2", "lora_path": QV.lora_path})
            assert loaded.status_code == 200, loaded.text
            answer = await client.completions.create(model="qv2", prompt=prompt, max_tokens=8, temperature=0,
                                                     extra_body={"ignore_eos": True})
            assert answer.choices[0].text == want["qv"]
            for body, status, text in (({"lora_name": "all", "lora_path": QV.lora_path}, 400, "already served"),
                                       ({"lora_name": "x", "lora_path": "/nowhere"}, 400, "not a directory"),
                                       ({"lora_name": "x"}, 400, "exactly")):
                bad = await http.post("/v1/load_lora_adapter", json=body)
                assert bad.status_code == status and text in bad.text, bad.text
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "qv2"})).status_code == 200
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "qv2"})).status_code == 404
            with pytest.raises(openai.BadRequestError, match="does not exist"):
                await client.completions.create(model="qv2", prompt=prompt, max_tokens=2)
            assert [m.id for m in (await client.models.list()).data] == ["tiny", "all", "qv"]
    with app.state.engine:
        asyncio.run(go())
    with pytest.raises(ValueError, match="max_lora_rank"):
        create_app(make(enable_lora=True, max_lora_rank=4), "tiny", lora_modules={"qv": QV.lora_path})
    with pytest.raises(ValueError, match="enable_lora=True"):
        create_app(make(), "tiny", lora_modules={"qv": QV.lora_path})


@pytest.mark.parametrize("flags,match", [
    (["--enable-lora", "--lora-modules", "all"], "NAME=PATH"),
    (["--enable-lora", "--lora-modules", f"a={adapter_path('all')}", f"a={adapter_path('all')}"], "twice"),
    (["--lora-modules", f"a={adapter_path('all')}"], "needs --enable-lora"),
])
def test_bad_lora_flags_are_clear_errors(flags, match):
    from serving.server import app_from_flags

    with pytest.raises(ValueError, match=match):
        app_from_flags(["--model", tiny_path("llama"), *flags])


def test_adapters_over_a_packed_base_equal_them_over_its_dequantized_weights(base, default_tokenizer):
    """A base kept packed (Q8_0 blocks, what weights_dtype does) under LoRA: the adapter's
    term adds to the quantized projection (model.lora.linear), so the output equals the
    same adapter over the float weights the blocks decode to."""
    from quant import PackedWeight, pack_params

    config, params = base
    packed = pack_params(params, "q8_0")
    dequantized = {**packed, "layers": [
        {k: v.dequantize() if isinstance(v, PackedWeight) else v for k, v in layer.items()}
        for layer in packed["layers"]]}
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    want = ids(LLM.from_loaded(config, dequantized, default_tokenizer, **KW, **lora)
               .generate(prompts(2), GREEDY, lora_request=ALL))
    got = ids(LLM.from_loaded(config, packed, default_tokenizer, **KW, **lora)
              .generate(prompts(2), GREEDY, lora_request=ALL))
    assert got == want
