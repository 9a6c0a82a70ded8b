"""KV transfer between engines (serving/kv_transfer.py): the state machine, then a prompt's
pages moved from a prefill engine to a decode engine with jax.experimental.transfer, in
one process and between two processes on 127.0.0.1: greedy tokens equal one colocated
engine's, and every failure (an expired offer, another model, a pull that never gets its
bytes) falls back to computing the prompt."""

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import model
from model.config import ModelConfig
from serving import LLM, SamplingParams
from serving.engine import RemoteKV
from serving.kv_transfer import (BOOTSTRAPPING, DONE, FAILED, STATES, TRANSFERRING, WAITING, IllegalTransition,
                                 KVHandle, KVReceiver, KVSender, Transfer)
from serving.server import expire_offers
from serving.simulator import CostModel

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = np.random.default_rng(3).integers(3, 49152, 53).tolist()  # three full pages and 5 tokens
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_transfers_move_only_along_the_state_machine():
    allowed = {(BOOTSTRAPPING, WAITING), (WAITING, TRANSFERRING), (TRANSFERRING, DONE),
               (BOOTSTRAPPING, FAILED), (WAITING, FAILED), (TRANSFERRING, FAILED)}
    for a in STATES:
        for b in STATES:
            t = Transfer(1, a)
            if (a, b) in allowed:
                t.advance(b, "why" if b == FAILED else None)
                assert t.state == b and (t.error == "why") == (b == FAILED)
            else:
                with pytest.raises(IllegalTransition, match=f"{a} -> {b}"):
                    t.advance(b)
                assert t.state == a


def test_handles_round_trip_through_json_and_reject_garbage():
    h = KVHandle("127.0.0.1:5", 2**61 + 3, 4, "ab")
    assert KVHandle.from_json(json.loads(json.dumps(h.to_json()))) == h
    for bad in ({}, {"address": "a", "uuid": "x", "num_pages": 1, "fingerprint": ""},
                {"address": "a", "uuid": 1, "num_pages": 0, "fingerprint": ""}):
        with pytest.raises(ValueError, match="not a KV handle"):
            KVHandle.from_json(bad)


CONFIG_ARGS = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                   layer_kinds=["attention"] * 2, max_position_embeddings=512, eos_token_id=2)
CONFIG = ModelConfig(**{**CONFIG_ARGS, "layer_kinds": tuple(CONFIG_ARGS["layer_kinds"])})


@pytest.fixture(scope="module")
def tiny(default_tokenizer):
    return CONFIG, model.init_params(CONFIG, jax.random.key(0)), default_tokenizer


def make(tiny, params=None, **kw):
    config, p, tok = tiny
    return LLM.from_loaded(config, p if params is None else params, tok, max_model_len=128, max_num_seqs=2,
                           num_kv_blocks=16, **kw)


def ids(llm, prompt=PROMPT):
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_prefill_engine_to_decode_engine_in_one_process(tiny):
    """The decode engine's request is a prefix hit on the three pages that came over and
    greedy equals a colocated engine; the sender's copy goes with the acknowledgement;
    an expired offer, another model's pages and a pull whose bytes never come each fail
    the transfer, cache nothing, and the prompt is computed instead."""
    colocated, _ = ids(make(tiny, enable_prefix_caching=False))
    prefill, decode = make(tiny), make(tiny)
    clock = Clock()
    sender, receiver = KVSender(prefill, ttl_s=5.0, clock=clock), KVReceiver(decode, timeout_s=2.0)
    prefill.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1))
    handle = sender.offer(PROMPT)
    assert handle.num_pages == 3 and sender.held == 1
    transfer = receiver.receive(KVHandle.from_json(handle.to_json()), PROMPT, sender.serve)
    assert transfer.state == DONE, transfer.error
    sender.ack(handle.uuid)
    assert sender.transfers[handle.uuid].state == DONE and sender.held == 0
    assert ids(decode) == (colocated, 48)
    decode.engine.kv.check()
    with pytest.raises(ValueError, match="waits for a pull"):
        sender.serve(handle.uuid)  # served once

    num_pages, data = prefill.engine.export_prefix(PROMPT)  # a decode engine holding the first page already
    partial = make(tiny)
    partial.generate({"prompt_token_ids": PROMPT[:20]}, SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(ValueError, match="do not fit a prompt of 40 tokens"):
        partial.engine.import_prefix(PROMPT[:40], num_pages, data)
    assert partial.engine.import_prefix(PROMPT, num_pages, data) == 2  # writes the other two only
    assert ids(partial) == (colocated, 48)
    partial.engine.kv.check()

    other = PROMPT[:20] + PROMPT[21:] + [7]  # another prompt: a fresh decode engine computes it
    prefill.generate({"prompt_token_ids": other}, SamplingParams(temperature=0, max_tokens=1))
    late = sender.offer(other)
    clock.now += 6.0  # past the time-to-live: the copy is dropped, by the server's loop with no request coming
    failed = sender.counts["failed"]

    async def briefly():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(expire_offers(sender, period_s=0.01), 0.2)
    asyncio.run(briefly())
    assert sender.held == 0 and sender.counts["failed"] == failed + 1 and late.uuid not in sender.transfers
    fresh = make(tiny)
    transfer = KVReceiver(fresh, timeout_s=2.0).receive(late, other, sender.serve)
    assert transfer.state == FAILED and "waits for a pull" in transfer.error
    assert ids(fresh, other) == (ids(make(tiny, enable_prefix_caching=False), other)[0], 0)

    params = jax.tree.map(lambda a: a * 2, tiny[1])  # another model refuses the pages
    handle = sender.offer(PROMPT)
    transfer = KVReceiver(make(tiny, params), timeout_s=2.0).receive(handle, PROMPT, sender.serve)
    assert transfer.state == FAILED and "model" in transfer.error

    stalled = make(tiny)  # the sender never serves: the pull gives up after its timeout
    start = time.monotonic()
    transfer = KVReceiver(stalled, timeout_s=1.0).receive(handle, PROMPT, lambda uuid: None)
    assert transfer.state == FAILED and "within 1.0 s" in transfer.error and time.monotonic() - start < 30
    assert ids(stalled) == (colocated, 0)
    stalled.engine.kv.check()


def test_a_request_waits_for_its_remote_kv_while_others_run(tiny):
    """The scheduler's wait for remote K/V (add_request's remote_kv): the request is passed
    over while another runs, is a prefix hit once the pages arrive, and computes its
    prompt when the transfer fails; greedy tokens equal a colocated engine's either way.
    Pages for a request aborted meanwhile are cached when they land."""
    import concurrent.futures

    prefill = make(tiny)
    prefill.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1))
    num_pages, data = prefill.engine.export_prefix(PROMPT)
    other = PROMPT[::-1]
    alone = make(tiny, enable_prefix_caching=False)
    want = [ids(alone)[0], ids(alone, other)[0]]
    for arrives in (True, False):
        decode = make(tiny)
        engine, remote = decode.engine, concurrent.futures.Future()
        engine.add_request("remote", PROMPT, GREEDY, remote_kv=RemoteKV(remote, num_pages))
        reserved = list(engine.kv.reserved["remote"])  # its pages are allocated before any byte comes
        assert len(reserved) == num_pages and engine.kv.pool.num_free == engine.kv.pool.num_pages - num_pages
        engine.add_request("local", other, GREEDY)
        engine.step()
        assert [s.seq_id for s in engine.state.running] == ["local#0"]  # remote waits for its pages
        assert [s.seq_id for s in engine.state.waiting] == ["remote#0"]
        engine.kv.check()
        if arrives:
            remote.set_result(lambda key: engine.import_prefix(PROMPT, num_pages, data, key))
        else:
            remote.set_exception(RuntimeError("the pull failed"))
        engine.step()
        assert not engine.kv.reserved  # taken by the write, or given back
        if arrives:
            assert engine.kv.cached_pages(PROMPT) == reserved  # the K/V landed in the reserved pages
        while engine.has_unfinished():
            engine.step()
        got = [engine.seqs[f"{r}#0"].output.tokens for r in ("remote", "local")]
        assert got == want
        assert engine.requests["remote"].num_cached_tokens == (48 if arrives else 0)
        engine.kv.check()
    # a request aborted while its pages are on the way: they are cached when they land
    # (which ends the transfer), not dropped with the request
    engine, remote = decode.engine, concurrent.futures.Future()
    engine.kv.flush_prefix_cache()
    engine.add_request("gone", PROMPT, GREEDY, remote_kv=RemoteKV(remote, num_pages))
    engine.add_request("stays", other, GREEDY)
    engine.step()
    engine.abort("gone")
    engine.step()
    assert not engine.kv.reserved  # the reservation went with the request
    remote.set_result(lambda key: engine.import_prefix(PROMPT, num_pages, data, key))
    engine.step()
    assert len(engine.kv.cached_pages(PROMPT)) == num_pages and not engine._orphans
    engine.kv.check()


PREFILL_INSTANCE = r"""
import json, sys
import jax, model
from model.config import ModelConfig
from serving import LLM, SamplingParams
from serving.kv_transfer import KVSender
from tests.conftest import _synthetic_tokenizer

args = json.loads(sys.argv[1])
config = ModelConfig(**{**args, "layer_kinds": tuple(args["layer_kinds"])})
llm = LLM.from_loaded(config, model.init_params(config, jax.random.key(0)), _synthetic_tokenizer(),
                      max_model_len=128, max_num_seqs=2, num_kv_blocks=16)
sender = KVSender(llm)
for line in sys.stdin:  # the control channel: one JSON command a line, one answer a line
    cmd = json.loads(line)
    if cmd["op"] == "prefill":
        llm.generate({"prompt_token_ids": cmd["prompt"]}, SamplingParams(temperature=0, max_tokens=1))
        answer = sender.offer(cmd["prompt"]).to_json()
    elif cmd["op"] == "serve":
        sender.serve(cmd["uuid"])
        answer = {}
    else:
        sender.ack(cmd["uuid"])
        answer = {"state": sender.transfers[cmd["uuid"]].state, "held": sender.held}
    print(json.dumps(answer), flush=True)
"""


def test_prefill_process_to_decode_process(tiny):
    """A prefill instance in its own process (control channel: its stdin and stdout)
    offers the prompt's pages; this process pulls them over 127.0.0.1 and decodes greedy
    as one colocated engine does."""
    config = json.dumps(CONFIG_ARGS)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-c", PREFILL_INSTANCE, config], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def ask(**cmd):
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, "the prefill instance died"
        return json.loads(line)
    try:
        handle = KVHandle.from_json(ask(op="prefill", prompt=PROMPT))
        decode = make(tiny)
        transfer = KVReceiver(decode).receive(handle, PROMPT, lambda uuid: ask(op="serve", uuid=uuid))
        assert transfer.state == DONE, transfer.error
        assert ask(op="ack", uuid=handle.uuid) == {"state": DONE, "held": 0}
        assert ids(decode) == (ids(make(tiny, enable_prefix_caching=False))[0], 48)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


TEXT = ("The river ran past the old mill, where the miller kept his accounts in a ledger bound in green "
        "leather, and every evening he counted the sacks of flour by lamplight before he went to sleep.")


def test_router_sends_prefill_to_one_instance_and_decode_to_another(tiny):
    """serving.router over a prefill and a decode instance (OpenAI servers in this process):
    completions, streamed completions and chat answer as one colocated engine does, the
    decode instance pulled the prompt's pages each time, the prefill instance keeps no
    copy; with the prefill instance unreachable the decode instance computes the prompt;
    a request the prefill instance finds bad is answered with its 400."""
    import asyncio

    import httpx

    from serving.router import create_router
    from serving.server import create_app

    colocated = make(tiny, enable_prefix_caching=False)
    prefill_app = create_app(make(tiny), "tiny", kv_role="prefill")
    # a second prefill instance: for the index, and it pulls a prefix from the first
    second_app = create_app(make(tiny), "tiny", kv_role="prefill",
                            kv_client=httpx.AsyncClient(mounts={"http://prefill": httpx.ASGITransport(prefill_app)}))
    senders = {"http://prefill": httpx.ASGITransport(prefill_app), "http://second": httpx.ASGITransport(second_app)}
    decode_app = create_app(make(tiny), "tiny", kv_role="decode", kv_client=httpx.AsyncClient(mounts=senders))
    instances = {**senders, "http://decode": httpx.ASGITransport(decode_app)}
    router = create_router(["http://prefill"], ["http://decode"], httpx.AsyncClient(mounts=instances))
    lost = create_router(["http://127.0.0.1:1"], ["http://decode"], httpx.AsyncClient(mounts=instances))
    conductor = create_router(["http://second", "http://prefill"], ["http://decode"],
                              httpx.AsyncClient(mounts=instances), tokenizer=tiny[2])
    pulling = create_router(["http://second", "http://prefill"], ["http://decode"], httpx.AsyncClient(mounts=instances),
                            tokenizer=tiny[2], cost=CostModel(prefill=(1e-2, 1e-3, 0.0), decode=(1e-2, 0.0, 0.0)))
    pulled_prompt = TEXT + " Then he rested."
    want_pulled = colocated.generate(pulled_prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    chat = [{"role": "user", "content": TEXT}]
    want_text = colocated.generate(TEXT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    want_chat = colocated.chat(chat, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text

    async def go(app, path, **body):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://router") as c:
            return await c.post(path, json={"model": "tiny", "temperature": 0, "max_tokens": 8, **body})

    async def calls():
        out = [await go(router, "/v1/completions", prompt=TEXT),
               await go(router, "/v1/completions", prompt=TEXT, stream=True),
               await go(router, "/v1/chat/completions", messages=chat),
               await go(lost, "/v1/completions", prompt=TEXT),
               await go(router, "/v1/completions", prompt=TEXT, temperature=-1)]
        await asyncio.gather(*decode_app.state.kv_acks)  # the decode instance acknowledges in the background
        async with httpx.AsyncClient(mounts=instances) as c:  # bad input to each side's /kv routes
            refused = [await c.post("http://prefill/kv/serve", json={"uuid": 12345}),
                       await c.post("http://prefill/kv/serve", json={"uuid": "x"}),
                       await c.post("http://prefill/kv/ack", json={"uuid": 1, "ok": "yes"}),
                       await c.post("http://prefill/kv/prefill", json={"kind": "poem", "request": {}}),
                       await c.post("http://decode/v1/completions", json={
                           "model": "tiny", "prompt": TEXT, "kv_transfer_params": {"uuid": 1}})]
        refused.append(await go(router, "/v1/completions", prompt=TEXT, kv_transfer_params={}))
        # "prefill" caches TEXT by now: a prompt extending it goes there although "second" has the turn;
        # prompts nobody caches take turns
        routed = [await go(conductor, "/v1/completions", prompt=TEXT + " Then he slept.")]
        routed += [await go(conductor, "/v1/completions", prompt=t * 4) for t in (
            "A second story about a lighthouse keeper. ", "A third story about the sea and the gulls. ")]
        await asyncio.gather(*decode_app.state.kv_acks)
        assert all(r.status_code == 200 for r in routed)
        # "prefill" holds the longest prefix but looks busy: "second" pulls it (Mooncake's remote reuse)
        pulling.state.conductor.busy_until["http://prefill"] = time.monotonic() + 1e3
        out.append(await go(pulling, "/v1/completions", prompt=pulled_prompt))
        await asyncio.gather(*decode_app.state.kv_acks, *second_app.state.kv_acks)
        async with httpx.AsyncClient(mounts=instances) as c:
            refused.append(await c.post("http://prefill/kv/offer", json={"prompt_token_ids": [1, "x"]}))
        return out, [(r.status_code, r.json()["error"]["message"]) for r in refused]
    with prefill_app.state.engine, decode_app.state.engine, second_app.state.engine:
        (plain, streamed, chatted, fallback, bad, pulled), refused = asyncio.run(calls())
    assert conductor.state.counts == {"prefilled": 3, "prefix_routed": 1}
    # TEXT's three, then the extension, then one turn, then the prefix "second" pulled
    assert prefill_app.state.kv_sender.counts["offered"] == 3 + 2 + 1
    assert second_app.state.kv_sender.counts["offered"] == 1 + 1
    assert [code for code, _ in refused] == [404, 400, 400, 400, 400, 400, 400], refused
    assert "no offer 12345" in refused[0][1] and "kv_transfer_params" in refused[4][1]
    assert "router's to set" in refused[5][1] and "prompt_token_ids" in refused[6][1]
    assert pulling.state.counts == {"prefilled": 1, "prefix_pulled": 1}
    assert second_app.state.kv_receiver.counts == {"done": 1} and second_app.state.kv_receiver.pages > 0
    assert pulled.status_code == 200 and pulled.json()["choices"][0]["text"] == want_pulled
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == want_text
    pieces = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(p["choices"][0]["text"] for p in pieces if p["choices"]) == want_text
    assert chatted.json()["choices"][0]["message"]["content"] == want_chat
    assert fallback.status_code == 200 and fallback.json()["choices"][0]["text"] == want_text
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    assert decode_app.state.kv_receiver.counts == {"done": 7} and not decode_app.state.kv_receiver.transfers
    assert prefill_app.state.kv_sender.counts == {"offered": 6, "done": 6} and prefill_app.state.kv_sender.held == 0
    assert router.state.counts == {"prefilled": 3} and lost.state.counts == {"prefill_unreachable": 1}


def test_router_and_discovery_refuse_bad_instances(tiny):
    from serving.router import create_router, discover
    from serving.server import create_app

    with pytest.raises(ValueError, match="host:port"):
        create_app(make(tiny), kv_role="decode", kv_address="localhost")
    with pytest.raises(ValueError, match="kv_role"):
        create_app(make(tiny), kv_role="both")

    with pytest.raises(ValueError, match="at least one decode"):
        create_router(["http://a:1"], [])
    with pytest.raises(ValueError, match="http"):
        create_router([], ["a:1"])
    with pytest.raises(ValueError, match="does not answer GET /kv/role"):
        discover(["http://127.0.0.1:1"], timeout_s=2)


def test_router_command_starts_its_instances_and_serves(tmp_path, default_tokenizer):
    """`python -m serving.router --prefill-instances 1 --decode-instances 1` on a tiny
    checkpoint behind an API key: three processes, one OpenAI completion equal to an LLM
    on the same checkpoint, and a KV transfer done on the decode instance (which sends
    the key to the prefill instance); SIGTERM to the router stops its instances too."""
    import socket
    import urllib.request

    from tests.serving.test_server import write_tiny_checkpoint

    path = str(tmp_path / "tiny")
    write_tiny_checkpoint(path, default_tokenizer)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serving.router", "--prefill-instances", "1",
                             "--decode-instances", "1", "--port", str(port), "--model", path,
                             "--served-model-name", "tiny", "--max-model-len", "128", "--api-key", "k",
                             "--uvicorn-log-level", "warning"],
                            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, "the router exited"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "the router did not come up"
                time.sleep(1)
        body = json.dumps({"model": "tiny", "prompt": TEXT, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json",
                                                                         "Authorization": "Bearer k"})
        with urllib.request.urlopen(request, timeout=300) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        with urllib.request.urlopen(f"{health['decode'][0]}/kv/stats", timeout=30) as r:
            stats = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    for instance in health["prefill"] + health["decode"]:  # the router stopped its instances
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{instance}/health", timeout=5)
    want = LLM(path, max_model_len=128).generate(TEXT, SamplingParams(temperature=0, max_tokens=8))
    assert text == want[0].outputs[0].text
    assert stats["transfers"] == {"done": 1} and stats["pages"] >= 2


def test_prefix_cache_events_follow_stores_and_evictions():
    """The radix cache's block events: stored pages carry the same chained keys a router
    computes from the tokens, evicted ones come back as removed."""
    from serving.kv_tiers import chain, root_hash
    from serving.radix_cache import PagePool, RadixCache
    from serving.router import PrefixIndex

    cache = RadixCache(PagePool(8), 4)
    cache.record_events()
    tokens = list(range(1, 13))
    pool_pages = cache.pool.allocate(3)
    cache.insert(tokens, pool_pages)
    cache.pool.decref(pool_pages)
    cache.insert(tokens[:4] + [99, 98, 97, 96], [pool_pages[0], cache.pool.allocate(1)[0]])
    keys = chain(root_hash(b"", 0), tokens, 4)
    assert [(n, kind) for n, kind, _ in cache.events] == [(1, "stored"), (2, "stored")]
    assert cache.events[0][2] == keys
    index = PrefixIndex(["a"])
    update = {"root": cache.root.hash.hex(), "page_size": 4, "next": cache.num_events,
              "events": [[n, kind, [k.hex() for k in ks]] for n, kind, ks in cache.events]}
    index.apply("a", update)
    assert index.matched_pages("a", tokens + [5]) == 3 and index.matched_pages("a", tokens[:4] + [99] * 5) == 1
    cache.evict(8)
    removed = [ks for _, kind, ks in cache.events if kind == "removed"]
    assert sorted(k for ks in removed for k in ks) == sorted(keys + chain(keys[0], [99, 98, 97, 96], 4))
    index.apply("a", {**update, "next": cache.num_events,
                      "events": [[n, kind, [k.hex() for k in ks]] for n, kind, ks in cache.events if n > 2]})
    assert index.matched_pages("a", tokens + [5]) == 0 and not index.keys["a"]
