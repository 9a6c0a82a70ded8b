"""The OpenAI server through the official `openai` client: in process (httpx.ASGITransport)
for the protocol, and one real uvicorn subprocess for streaming over a socket,
disconnect-abort, 429 under a burst and /metrics. Both serve a tiny random Llama written
as a Hugging Face directory (what `--model DIR` reads), over the default tokenizer."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import SamplingParams
from serving.openai_protocol import chat_messages, chat_request, completion_request
from serving.params import StructuredOutputsParams

API_KEY = "sk-kvfold-test"
MAX_MODEL_LEN = 128
SLOW = 120  # seconds an HTTP call may take: the first requests compile steps, on a busy machine
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_tiny_checkpoint(path: str, tokenizer) -> None:
    """A tiny random Llama (2 layers, hidden 32) as config.json + model.safetensors +
    tokenizer.json (+ tokenizer_config.json with the chat template)."""
    import jax
    from safetensors.numpy import save_file

    import model
    from model.config import config_from_hf
    from model.hf_loader import _LAYER_TENSORS

    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=tokenizer.vocab_size, hidden_size=32,
              intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    params = model.init_params(config_from_hf(hf), jax.random.key(0))
    hf_name = {ours: theirs for theirs, ours in _LAYER_TENSORS.items()}
    tensors = {"model.embed_tokens.weight": np.asarray(params["embed"]),
               "model.norm.weight": np.asarray(params["final_norm"]),
               "lm_head.weight": np.ascontiguousarray(np.asarray(params["lm_head"]).T)}
    for i, layer in enumerate(params["layers"]):
        for name, w in layer.items():
            w = np.asarray(w)
            tensors[f"model.layers.{i}.{hf_name[name]}"] = np.ascontiguousarray(w.T) if w.ndim == 2 else w
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    tokenizer._tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tokenizer.chat_template,
                   "eos_token": tokenizer.token_to_str(tokenizer.eos_token_id)}, f)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_tokenizer):
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    write_tiny_checkpoint(path, default_tokenizer)
    return path


@pytest.fixture(scope="module")
def llm(tiny_dir):
    from serving.llm import LLM

    return LLM(tiny_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def app(llm, tiny_dir, server_process):  # the subprocess starts first: its startup overlaps these tests
    from serving.server import create_app

    app = create_app(llm, "tiny", API_KEY, max_waiting_requests=64, max_waiting_tokens=4096,
                     max_request_body_bytes=64 * 1024)
    with app.state.engine:  # ASGITransport runs no lifespan events
        yield app


def run(coro_fn, app, api_key=API_KEY):
    """Run `coro_fn(openai_client, raw_httpx_client)` against the in-process app."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://kvfold") as http:
            client = openai.AsyncOpenAI(base_url="http://kvfold/v1", api_key=api_key, http_client=http,
                                        max_retries=0)
            return await coro_fn(client, http)
    return asyncio.run(main())


def assert_engine_clean(llm):
    engine = llm.engine
    deadline = time.monotonic() + 5
    while (engine.requests or engine.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine thread frees finished requests after its step
    engine.kv.check()
    assert not engine.requests and not engine.has_unfinished() and not engine.kv.tables
    assert engine.kv.num_available == engine.kv.pool.num_pages


# -- in process ---------------------------------------------------------------------------

# 19 tokens: prefills pad to 32 tokens, as the chat prompts do (fewer step shapes to compile)
PROMPT = "The quick brown fox jumps over the lazy dog while the old cat sleeps on a warm mat"


def test_greedy_text_equals_llm_generate(app, llm):
    async def go(client, _):
        plain = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        parts, usage = [], None
        stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            parts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return plain, "".join(parts), usage
    plain, streamed, usage = run(go, app)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    assert want.outputs[0].text and plain.choices[0].text == want.outputs[0].text == streamed
    assert plain.choices[0].finish_reason == want.outputs[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == usage.prompt_tokens == len(want.prompt_token_ids)
    assert plain.usage.completion_tokens == usage.completion_tokens == 8
    assert plain.usage.total_tokens == len(want.prompt_token_ids) + 8
    assert_engine_clean(llm)


def test_chat_equals_llm_chat_and_stop_strings_cut_the_text(app, llm):
    if not llm.tokenizer.chat_template:
        pytest.skip("the synthetic test tokenizer has no chat template")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0].text
    stop = want[3:6]  # a stop string inside the greedy text: the answer ends before it

    async def go(client, _):
        full = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                                    temperature=0)
        parts = [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]
        cut = await client.chat.completions.create(
            model="tiny", messages=[messages[0], {"role": "user", "content": parts}], max_completion_tokens=10,
            temperature=0, stop=[stop])
        return full, cut
    full, cut = run(go, app)
    assert full.choices[0].message.content == want and full.choices[0].message.role == "assistant"
    assert cut.choices[0].message.content == want[:want.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_in_openai_shapes(app, llm):
    async def go(client, _):
        comp = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                               logprobs=3)
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
        return comp, chat
    comp, chat = run(go, app)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    lp = comp.choices[0].logprobs
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in want.token_ids]
    np.testing.assert_allclose(lp.token_logprobs, [d[t] for t, d in zip(want.token_ids, want.logprobs)],
                               rtol=1e-5)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for top, token, logprob in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == logprob and max(top.values()) <= 0
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        # greedy: the sampled token is the most likely one
        assert len(tops) == 2 and tops == sorted(tops, reverse=True) and item.logprob == tops[0]
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token


def test_n_samples_of_several_prompts_are_indexed_in_order(app, llm):
    prompts = [PROMPT, "Once upon a time, in a small village by the sea, there lived an old fisherman"]

    async def go(client, _):
        return await client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, n=2)
    out = run(go, app)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [want[0], want[0], want[1], want[1]]
    assert out.usage.completion_tokens == 16


BAD_BODIES = [  # (body, param the error names)
    ({"prompt": PROMPT, "bogus": 1}, None),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "temperature": "0.5"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "stop": 5}, "stop"),
    ({"prompt": PROMPT, "seed": 1.5}, "seed"),
    ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, None),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": list(range(5, 5 + MAX_MODEL_LEN))}, None),  # over the context
    ({"model": "gpt-4", "prompt": PROMPT}, "model"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"10000000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"prompt": PROMPT, "min_tokens": 99, "max_tokens": 4}, "min_tokens"),
    ({"prompt": PROMPT, "echo": True}, "echo"),
    ({"prompt": PROMPT, "best_of": 3}, "best_of"),
    ({"prompt": PROMPT, "response_format": {"type": "json"}}, "response_format"),
    ({"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format"),
    ({"prompt": PROMPT, "structured_outputs": {"regex": "a+", "choice": ["x"]}}, None),
    ({"prompt": PROMPT, "structured_outputs": {"choice": []}}, None),
    ({"prompt": PROMPT, "structured_outputs": {"regex": "(["}}, "regex"),  # checked by the engine
    ({"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "sometimes"}}}}}}, "json"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "message"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": []}, "messages"),
    ({}, "prompt"),
    ([1, 2], None),
    (b"{not json", None),
]


def test_bad_requests_are_400_naming_the_problem_and_leave_the_engine_untouched(app, llm):
    async def go(client, http):
        answers = []
        for body, _ in BAD_BODIES:
            route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
            body = body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}
                                                                   if isinstance(body, dict) else body)
            r = await http.post(route, content=body, headers={"Authorization": f"Bearer {API_KEY}",
                                                               "Content-Type": "application/json"})
            answers.append((r.status_code, r.json()))
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.completions.create(model="tiny", prompt=PROMPT, temperature=-0.5)
        return answers
    for (body, param), (status, answer) in zip(BAD_BODIES, run(go, app)):
        assert status == 400, (body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["message"] and (param is None or param in error["message"]), (body, error)
        if param in ("temperature", "n", "model", "stop", "seed"):
            assert error["param"] == param, (body, error)
    assert_engine_clean(llm)


def test_structured_output_fields_map_to_structured_outputs_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    assert completion_request(body, "m").params.structured_outputs == StructuredOutputsParams(json=schema)
    body = {"prompt": "x", "response_format": {"type": "json_object"}}
    assert completion_request(body, "m").params.structured_outputs == StructuredOutputsParams(json_object=True)
    assert completion_request({"prompt": "x", "response_format": {"type": "text"}}, "m").params.structured_outputs \
        is None
    for so in ({"regex": "[a-z]+"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a"'}, {"json": schema}):
        chat, _ = chat_messages({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": so}, "m")
        assert chat_request(chat, [1, 2], 64).params.structured_outputs == StructuredOutputsParams(**so)
    with pytest.raises(ValueError, match="not both"):
        completion_request({"prompt": "x", "structured_outputs": {"regex": "a"},
                            "response_format": {"type": "json_object"}}, "m")


def test_response_format_json_schema_answers_valid_json(app, llm):
    schema = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "unit": {"enum": ["cm", "kg"]}},
              "required": ["count", "unit"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "measure", "schema": schema}}

    async def go(client, _):
        return await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0,
                                               extra_body={"response_format": fmt})
    answer = run(go, app)
    value = json.loads(answer.choices[0].text)
    assert set(value) == {"count", "unit"} and 0 <= value["count"] <= 99 and value["unit"] in ("cm", "kg")
    assert answer.choices[0].finish_reason == "stop"
    assert_engine_clean(llm)


def test_api_key_guards_v1_routes_only(app):
    async def go(_, http):
        keyless = openai.AsyncOpenAI(base_url="http://kvfold/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await keyless.models.list()
        bare = await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT})
        return bare, await http.get("/health"), await http.get("/metrics")
    bare, health, metrics = run(go, app)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert health.status_code == 200 and metrics.status_code == 200


def test_models_and_oversized_bodies(app):
    async def go(client, http):
        models = await client.models.list()
        big = await http.post("/v1/completions", content=b" " * (65 * 1024),
                              headers={"Authorization": f"Bearer {API_KEY}"})
        return models, big
    models, big = run(go, app)
    assert [m.id for m in models.data] == ["tiny"]
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_penalties_and_logit_bias_reach_the_sampler(app, llm):
    """OpenAI's penalty fields and logit_bias (string keys) and vLLM's extras answer what
    LLM.generate answers for the same SamplingParams."""
    favoured = llm.tokenizer.encode(" fox", add_special_tokens=False)[0]
    fields = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2, min_tokens=2,
                  bad_words=["dog"])

    async def go(client, _):
        return await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                               logit_bias={str(favoured): 5.0}, presence_penalty=0.5,
                                               frequency_penalty=1.0, extra_body={  # vLLM's extras
                                                   k: fields[k] for k in ("repetition_penalty", "min_tokens",
                                                                          "bad_words")})
    got = run(go, app)
    fields.update(logit_bias={favoured: 5.0})
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, **fields))[0].outputs[0]
    assert got.choices[0].text == want.text and favoured in want.token_ids


def test_a_dead_engine_thread_is_a_503(app, llm, monkeypatch):
    """Last in process: it kills the module's engine thread."""
    def broken_step():
        raise RuntimeError("injected step failure")
    monkeypatch.setattr(llm.engine, "step", broken_step)

    async def go(client, http):
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        return await http.get("/health")
    health = run(go, app)
    assert health.status_code == 503 and "injected step failure" in health.json()["error"]["message"]
    monkeypatch.undo()
    assert_engine_clean(llm)


def test_an_engine_failing_while_adding_answers_503_not_never(llm, monkeypatch):
    from serving.server import create_app

    def broken_add(*args):
        raise RuntimeError("injected add failure")
    monkeypatch.setattr(llm, "_add", broken_add)
    app = create_app(llm, "tiny")

    async def go(client, _):
        with pytest.raises(openai.InternalServerError, match="injected add failure"):
            await asyncio.wait_for(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4), 30)
    with app.state.engine:
        run(go, app)
    assert not app.state.engine.alive


# -- one real server -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_process(tiny_dir, tmp_path_factory):
    """`python -m serving.server` on 127.0.0.1, small caps: 2 running, 2 waiting."""
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    cmd = [sys.executable, "-m", "serving.server", "--model", tiny_dir, "--served-model-name", "tiny",
           "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
           "--max-num-batched-tokens", "64", "--max-waiting-requests", "2", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "KVFOLD_API_KEY": API_KEY, "JAX_PLATFORMS": "cpu"},
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        log.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(server_process):
    """The subprocess's URL, once /health answers."""
    proc, url, log = server_process
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("the server did not come up in 120 s")
        time.sleep(0.2)


def metrics(url: str) -> dict:
    """{sample name (with labels): value} from /metrics, parsed by prometheus_client."""
    text = httpx.get(f"{url}/metrics", timeout=SLOW).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_server_streams_over_http(server):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        plain = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=6, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        async with httpx.AsyncClient(timeout=SLOW) as http:
            raw = await http.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                        "stream": True})
        return plain, chunks, raw
    plain, chunks, raw = asyncio.run(go())
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]) == plain.choices[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


def test_server_disconnect_aborts_and_frees_pages(server):
    before = metrics(server)

    async def go():
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=SLOW) as http:
            async with http.stream("POST", f"{server}/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                lines = 0
                async for line in r.aiter_lines():
                    lines += line.startswith("data: ")
                    if lines == 3:
                        return metrics(server)
    during = asyncio.run(go())
    assert during["kvfold:num_requests_running"] == 1 and during["kvfold:kv_cache_usage_perc"] > 0
    deadline = time.monotonic() + 10
    while (after := metrics(server))["kvfold:kv_cache_usage_perc"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after["kvfold:kv_cache_usage_perc"] == 0 and after["kvfold:num_requests_running"] == 0
    # aborted, not run to its 100 tokens: no finished request and fewer than 100 tokens counted
    finished = "kvfold:request_success_total{finished_reason=length}"
    assert after.get(finished, 0) == before.get(finished, 0)
    assert after["kvfold:generation_tokens_total"] == before["kvfold:generation_tokens_total"]


def test_server_answers_429_past_the_waiting_cap(server):
    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*[
                http.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
                for _ in range(12)])
    answers = asyncio.run(go())
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error" and "max_waiting_requests=2" in error["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    m = metrics(server)
    assert m["kvfold:request_rejected_total{code=429}"] == codes.count(429)


def test_server_metrics_parse(server):
    before = metrics(server)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 40000, 20)]  # a full page and a part

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        for _ in range(2):  # the second finds the first's full page in the prefix cache
            await client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    asyncio.run(go())
    m = metrics(server)
    for name in ("kvfold:num_requests_running", "kvfold:num_requests_waiting", "kvfold:kv_cache_usage_perc",
                 "kvfold:num_preemptions_total", "kvfold:prefix_cache_hit_rate"):
        assert name in m, name

    def delta(name):
        return m[name] - before.get(name, 0)
    assert delta("kvfold:request_success_total{finished_reason=length}") == 2
    assert delta("kvfold:time_to_first_token_seconds_count") == 2
    assert delta("kvfold:inter_token_latency_seconds_count") == 4  # 2 gaps per 3-token request
    assert delta("kvfold:e2e_request_latency_seconds_count") == 2
    assert delta("kvfold:prompt_tokens_total") == delta("kvfold:prefix_cache_queries_total") == 40
    assert delta("kvfold:prefix_cache_hits_total") == 16
    assert delta("kvfold:generation_tokens_total") == 6
    hits, queries = m["kvfold:prefix_cache_hits_total"], m["kvfold:prefix_cache_queries_total"]
    assert m["kvfold:prefix_cache_hit_rate"] == pytest.approx(hits / queries)


def test_bench_serve_runs_at_tiny_size(tiny_dir, llm, capsys):
    """With the in-process engine's shapes (the `llm` fixture's), so its compiled steps are reused."""
    from serving import bench

    bench.main(["serve", "--model", tiny_dir, "--rates", "8", "inf", "--num-prompts", "8", "--input-len", "16",
                "--output-len", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--max-waiting-requests", "2", "--max-model-len", str(MAX_MODEL_LEN), "--warmup-rounds", "0"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isalnum() and not line.startswith("| rate")]
    assert [r[0].strip() for r in rows] == ["8", "inf"]
    for rate, sent, done, share, *_ in rows:
        assert int(sent) == 8 and int(done) >= 2
        # done + 429s = sent: no request failed otherwise
        assert int(done) + round(float(share.strip(" %")) / 100 * 8) == 8
    assert float(rows[1][3].strip(" %")) > 0  # all 8 at once overflow the 2 waiting places


def test_cli_rejects_bad_flags_with_a_message():
    from serving.server import cli

    for argv, message in ((["serve", "--port", "70000"], "--port is out of range"),
                          (["serve", "--speculative-config", "{eagle"], "not valid JSON"),
                          (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests is out of range")):
        with pytest.raises(SystemExit, match=message):
            cli(argv)


def test_update_weights_from_a_checkpoint_path(tiny_dir):
    """update_weights(path) loads the checkpoint's weights: negated weights change the
    answer, the checkpoint brings it back; a missing path is a ValueError."""
    import jax

    from serving.llm import LLM

    llm = LLM(tiny_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    answer = lambda: llm.generate(PROMPT, greedy)[0].outputs[0].token_ids
    before = answer()
    llm.update_weights(jax.tree.map(lambda x: -x, llm.runner.params))
    assert answer() != before
    llm.update_weights(tiny_dir)
    assert answer() == before
    with pytest.raises(ValueError, match="does not exist"):
        llm.update_weights(os.path.join(tiny_dir, "missing"))
