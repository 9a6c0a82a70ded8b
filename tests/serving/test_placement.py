"""Placement search and the Conductor (serving/placement.py): predictions computed by
hand from the cost model, simulated disaggregated serving against the same arithmetic,
the interference that disaggregation removes, the bisection, and the command."""

import json
import math

import numpy as np
import pytest

from serving import scheduler as sched
from serving.placement import (Conductor, Decision, InstanceSetup, Placement, Rejection, at_rate, cost_path, main,
                               max_rate, placements, serve)
from serving.simulator import CostModel, SimRequest

COST = CostModel(prefill=(4e-2, 1.5e-3, 2e-6), decode=(3e-2, 4e-5, 1e-2))
PS = 16
CONFIG = sched.SchedulerConfig(page_size=PS, max_num_seqs=8, max_num_batched_tokens=256)


def _setup(transfer: float = 5e-3, pages: int = 256) -> InstanceSetup:
    return InstanceSetup(COST, CONFIG, pages, 1024, transfer)


def _first_step(prompt_len: int) -> float:
    """A decode instance's first step: the prompt's last partial page (one token: a decode row)."""
    tail = prompt_len - (prompt_len - 1) // PS * PS
    return COST.prefill_time([tail], [prompt_len]) if tail > 1 else COST.decode_time([prompt_len])


def test_conductor_predicts_queue_prefix_transfer_and_first_step():
    c = Conductor(COST, ["p0", "p1"], ["d0"], PS, transfer_s_per_page=5e-3)
    a = c.admit("a", 0.0, 100)
    assert isinstance(a, Decision) and a.prefill == "p0"
    assert a.ttft_s == pytest.approx(COST.prefill_time([100], [100]) + 6 * 5e-3 + _first_step(100), rel=1e-12)
    assert a.tpot_s == pytest.approx(COST.decode_time([100]), rel=1e-12)
    # p0 is busy with a's prefill: b goes to p1 unless p0 caches enough of b's prompt
    b = c.admit("b", 0.1, 100)
    assert b.prefill == "p1" and b.decode == "d0"
    assert b.tpot_s == pytest.approx(COST.decode_time([100, 100]), rel=1e-12)
    queued = COST.prefill_time([100], [100]) - 0.1
    d = c.admit("d", 0.1, 100, {"p0": 6})  # p0 holds 96 of its tokens: its queue is cheaper than p1's whole prompt
    expect_p0 = queued + COST.prefill_time([4], [100]) + 6 * 5e-3 + _first_step(100)
    assert d.prefill == "p0" and d.ttft_s == pytest.approx(expect_p0, rel=1e-12)
    # a's prefill answered early: p0's queue is d's prefill alone, from now
    c.prefill_done("a", 0.5)
    assert c.busy_until["p0"] == pytest.approx(0.5 + COST.prefill_time([4], [100]), rel=1e-12)
    c.finished("a", 2.0)
    assert set(c.running["d0"]) == {"b", "d"}
    with pytest.raises(ValueError, match="already admitted"):
        c.admit("b", 3.0, 10)


def test_conductor_rejects_early_without_recording():
    c = Conductor(COST, ["p0"], ["d0", "d1"], PS, ttft_slo=1.5, tpot_slo=0.1)
    assert isinstance(c.admit("a", 0.0, 300), Decision)  # ~1 s of prefill
    before = dict(c.busy_until)
    r = c.admit("b", 0.0, 300)  # behind a: ~2 s
    assert isinstance(r, Rejection) and "TTFT" in r.reason and r.ttft_s > 1.5
    assert c.busy_until == before and "b" not in c.where and c.counts["rejected_ttft"] == 1
    # decode: each request goes where the predicted step is shortest; a step over 0.1 s is rejected
    c = Conductor(COST, ["p0"], ["d0", "d1"], PS, tpot_slo=COST.decode_time([50] * 2) * 1.001)
    picks = [c.admit(k, 0.0, 50) for k in range(5)]
    assert [p.decode for p in picks[:4]] == ["d0", "d1", "d0", "d1"]
    assert isinstance(picks[4], Rejection) and "TPOT" in picks[4].reason
    with pytest.raises(ValueError, match="ttft_slo must be > 0"):
        Conductor(COST, ["p0"], ["d0"], PS, ttft_slo=0)
    with pytest.raises(ValueError, match="colocated instances"):
        Conductor(COST, ["p0"], ["d0"], PS, colocated=True)
    with pytest.raises(ValueError, match="at least one prefill"):
        Conductor(COST, [], ["d0"], PS)


def test_one_request_served_disaggregated_and_colocated_costs_what_the_model_says():
    prompt, out = tuple(range(3, 43)), 4  # 40 tokens: 2 full pages move, the decode instance computes 8
    served = serve([SimRequest(0.0, prompt, out)], Placement(1, 1), _setup())
    ttft = COST.prefill_time([40], [40]) + 2 * 5e-3 + COST.prefill_time([8], [40])
    assert served.ttft_s[0] == pytest.approx(ttft, rel=1e-9)
    # each later token is one decode step at the context it reads (41, 42, 43)
    assert served.tpot_s[0] == pytest.approx(np.mean([COST.decode_time([c]) for c in (41, 42, 43)]), rel=1e-9)
    colocated = serve([SimRequest(0.0, prompt, out)], Placement(0, 2), _setup())
    assert colocated.ttft_s[0] == pytest.approx(COST.prefill_time([40], [40]), rel=1e-9)
    assert colocated.tpot_s[0] == pytest.approx(served.tpot_s[0], rel=1e-9)
    assert not served.rejected.any() and served.attainment(ttft, 1.0) == 1.0
    assert served.attainment(ttft * 0.99, 1.0) == 0.0


def test_disaggregation_removes_prefill_interference_from_decode():
    """DistServe's point: a long prompt arriving while a request decodes stretches that
    request's steps on a colocated engine, not on a decode instance."""
    long_decode = SimRequest(0.0, tuple(range(3, 23)), 40)
    prompts = [SimRequest(0.5 + 0.2 * i, tuple(range(100 + 500 * i, 100 + 500 * i + 400)), 2) for i in range(3)]
    requests = [long_decode, *prompts]
    alone = serve([long_decode], Placement(1, 1), _setup()).tpot_s[0]
    disagg = serve(requests, Placement(1, 1), _setup()).tpot_s[0]
    colocated = serve(requests, Placement(0, 1), _setup()).tpot_s[0]
    # the decode instance adds only the newcomers' short first steps and rows
    assert disagg < 1.5 * alone < colocated


def test_prefix_cached_on_the_prefill_instance_is_found_and_saves_prefill():
    shared = tuple(range(1000, 1320))  # 20 pages
    a = SimRequest(0.0, shared + (5, 6, 7), 2)
    b = SimRequest(5.0, shared + (8, 9, 10), 2)  # long after a's prefill
    served = serve([a, b], Placement(2, 1), _setup())
    # b goes to the instance holding the prefix (first choice alternates otherwise) and pays its 3 tokens
    expect = COST.prefill_time([3], [323]) + 20 * 5e-3 + COST.prefill_time([3], [323])
    assert served.ttft_s[1] == pytest.approx(expect, rel=1e-9)


def test_conductor_pulls_a_longer_prefix_from_a_busy_holder_when_that_predicts_less():
    """Mooncake's remote prefix reuse: p0 holds 6 pages of the prompt but is busy; idle p1
    pulls them (6 x 5 ms, while its empty queue waits) and computes the other 4 tokens."""
    c = Conductor(COST, ["p0", "p1"], ["d0"], PS, transfer_s_per_page=5e-3)
    c.admit("a", 0.0, 600, {"p0": 6})  # p0 is busy for about 1.6 s
    b = c.admit("b", 0.0, 100, {"p0": 6})
    assert (b.prefill, b.source, b.source_pages) == ("p1", "p0", 6)
    assert b.ttft_s == pytest.approx(6 * 5e-3 + COST.prefill_time([4], [100]) + 6 * 5e-3 + _first_step(100),
                                     rel=1e-12)
    assert c.busy_until["p1"] == pytest.approx(6 * 5e-3 + COST.prefill_time([4], [100]), rel=1e-12)
    assert c.counts["pulled"] == 1
    # a slow link: p1 computes the whole prompt instead of pulling
    slow = Conductor(COST, ["p0", "p1"], ["d0"], PS, transfer_s_per_page=0.5)
    slow.admit("a", 0.0, 600, {"p0": 6})
    b = slow.admit("b", 0.0, 100, {"p0": 6})
    assert (b.prefill, b.source, b.source_pages) == ("p1", None, 0)
    assert b.ttft_s == pytest.approx(COST.prefill_time([100], [100]) + 6 * 0.5 + _first_step(100), rel=1e-12)
    # colocated replicas never pull (each is its own decode instance)
    co = Conductor(COST, ["r0", "r1"], ["r0", "r1"], PS, transfer_s_per_page=5e-3, colocated=True)
    co.admit("a", 0.0, 600, {"r0": 6})
    assert co.admit("b", 0.0, 100, {"r0": 6}).source is None


def test_simulated_prefill_instance_pulls_the_prefix_from_a_busy_holder():
    shared = tuple(range(1000, 1320))  # 20 pages
    a = SimRequest(0.0, shared + (5, 6, 7), 2)  # p0 computes and caches the 20 pages
    u = SimRequest(1.5, shared + tuple(range(3000, 3600)), 2)  # extends them on p0: busy past 3 s
    b = SimRequest(1.6, shared + (8, 9, 10), 2)  # p1 is idle: it pulls p0's 20 pages, computes 3 tokens
    served = serve([a, u, b], Placement(2, 1), _setup())
    expect = 20 * 5e-3 + COST.prefill_time([3], [323]) + 20 * 5e-3 + COST.prefill_time([3], [323])
    assert served.ttft_s[2] == pytest.approx(expect, rel=1e-9)
    # without the pull p1 would have computed all 323 tokens
    assert COST.prefill_time([323], [323]) > 3 * expect


def test_placements_with_tensor_parallel_sizes_use_exactly_the_devices():
    got = placements(4, (1, 3))
    assert [p.label for p in got] == ["1P + 3D", "2P + 2D", "3P + 1D", "1P + 1D(tp3)", "1P(tp3) + 1D", "4 colocated"]
    assert all(p.devices == 4 for p in got)
    assert [p.label for p in placements(6, (1, 3))][-2:] == ["6 colocated", "2 colocated (tp3)"]
    for bad in ((1, 1), (0,), ()):
        with pytest.raises(ValueError, match="distinct ints >= 1"):
            placements(4, bad)


def test_tensor_parallel_instances_run_on_their_own_cost_models():
    """A prefill (decode) instance of 3 devices runs on the tp3 cost model, the other role
    on tp1's; the Conductor predicts TPOT with the decode instances' model."""
    half = lambda c: tuple(x / 2 for x in c)
    fast_prefill = CostModel(prefill=half(COST.prefill), decode=COST.decode)
    fast_decode = CostModel(prefill=COST.prefill, decode=half(COST.decode))
    prompt, out = tuple(range(3, 43)), 4
    request = [SimRequest(0.0, prompt, out)]
    tp3 = lambda cost: {1: _setup(), 3: InstanceSetup(cost, CONFIG, 256, 1024, 5e-3)}
    served = serve(request, Placement(1, 1, 3, 1), tp3(fast_prefill))
    ttft = fast_prefill.prefill_time([40], [40]) + 2 * 5e-3 + COST.prefill_time([8], [40])
    assert served.ttft_s[0] == pytest.approx(ttft, rel=1e-9)
    served = serve(request, Placement(1, 1, 1, 3), tp3(fast_decode))
    assert served.tpot_s[0] == pytest.approx(np.mean([fast_decode.decode_time([c]) for c in (41, 42, 43)]), rel=1e-9)
    c = Conductor(COST, ["p0"], ["d0"], PS, decode_cost=fast_decode)
    assert c.admit("a", 0.0, 100).tpot_s == pytest.approx(fast_decode.decode_time([100]), rel=1e-12)
    with pytest.raises(ValueError, match="one cost model"):
        Conductor(COST, ["r0"], ["r0"], PS, colocated=True, decode_cost=fast_decode)
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        serve(request, Placement(1, 1, 3, 1), {1: _setup()})
    with pytest.raises(ValueError, match="its own cost model"):
        serve(request, Placement(1, 1, 3, 1), _setup())


def test_max_rate_brackets_and_bisects():
    edge = 3.7
    calls = []

    def attainment(rate):
        calls.append(rate)
        return 1.0 if rate <= edge else 0.5

    rate, got = max_rate(attainment, guess=0.2, steps=7)
    assert got == 1.0 and edge / 2 ** (1 / 2 ** 7) <= rate <= edge
    assert len(calls) == 5 + 1 + 7  # 0.2 .. 6.4 doubling, then the bisection
    assert max_rate(lambda r: 0.0, guess=1.0, max_doublings=3) == (0.0, pytest.approx(math.nan, nan_ok=True))
    with pytest.raises(ValueError, match="must be > 0"):
        max_rate(attainment, guess=0.0)


def test_at_rate_draws_poisson_arrivals_and_rescales_them():
    requests = [SimRequest(0.0, (1, 2, i), 1) for i in range(4000)]
    slow, fast = at_rate(requests, 2.0), at_rate(requests, 8.0)
    assert [r.prompt for r in fast] == [r.prompt for r in requests]
    gaps = np.diff([r.arrival_s for r in slow])
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05) and np.std(gaps) == pytest.approx(0.5, rel=0.05)
    assert [4 * r.arrival_s for r in fast] == pytest.approx([r.arrival_s for r in slow])
    with pytest.raises(ValueError, match="rate must be > 0"):
        at_rate(requests, 0.0)
    assert [p.label for p in placements(3)] == ["1P + 2D", "2P + 1D", "3 colocated"]


def test_the_command_prints_every_placement_and_the_best(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rng = np.random.default_rng(0)
    with open(trace, "w") as f:
        for i in range(24):
            n = int(rng.integers(2000, 6000))  # a shared first two blocks of 512 tokens, then its own
            ids = [0, 1] + [100 * (i + 1) + j for j in range(-(-n // 512) - 2)]
            f.write(json.dumps({"timestamp": i * 500, "input_length": n, "output_length": int(rng.integers(100, 400)),
                                "hash_ids": ids}) + "\n")
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"prefill": list(COST.prefill), "decode": list(COST.decode)}))
    main(["--trace", str(trace), "--devices", "2", "--ttft-slo", "3", "--tpot-slo", "0.1", "--cost", str(cost),
          "--num-requests", "24", "--max-model-len", "1024", "--kv-pages", "512"])
    out = capsys.readouterr().out
    assert "| 1P + 1D |" in out and "| 2 colocated |" in out
    assert "best disaggregated placement: 1P + 1D" in out and "| on |" in out and "| off |" in out
    # instances of 2 devices: their cost model is read from cost.tp2.json
    assert cost_path(str(cost), 2) == str(tmp_path / "cost.tp2.json") and cost_path(str(cost), 1) == str(cost)
    (tmp_path / "cost.tp2.json").write_text(json.dumps({"prefill": [x / 2 for x in COST.prefill],
                                                         "decode": [x / 2 for x in COST.decode]}))
    main(["--trace", str(trace), "--devices", "2", "--ttft-slo", "3", "--tpot-slo", "0.1", "--cost", str(cost),
          "--num-requests", "24", "--max-model-len", "1024", "--kv-pages", "512", "--tp-sizes", "1,2",
          "--overload", "0"])
    out = capsys.readouterr().out
    assert "| 1 colocated (tp2) |" in out and "| 2 colocated |" in out and "tp2: prefill" in out
    for bad in (["--devices", "0"], ["--devices", "2", "--tp-sizes", "1,x"], ["--devices", "2", "--tp-sizes", "2,2"]):
        with pytest.raises(SystemExit):
            main(["--trace", str(trace), *bad, "--ttft-slo", "3", "--tpot-slo", "0.1", "--cost", str(cost)])


def test_router_dispatches_by_predicted_ttft_and_rejects_early():
    """serving.router with a cost model over fake instances: a prompt goes to the idle
    prefill instance rather than to the one caching its prefix behind a long queued
    prefill, which pulls that prefix from the holder first (the holder's /kv/offer goes
    with the request), and to the prefix holder once that prefill answered; a request
    whose predicted TTFT breaks the SLO is answered 429 before any instance sees it."""
    import asyncio

    import httpx

    from serving.kv_tiers import chain
    from serving.router import create_router

    root = b"r" * 16
    long_prompt, prompt = list(range(5, 1005)), list(range(2000, 2200))
    held = chain(root, prompt, PS)[:12]  # p0 caches 192 of prompt's 200 tokens
    seen, offers, pulls, release = [], [], [], asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if path == "/kv/events":
            keys = [k.hex() for k in held] if host == "p0" else []
            return httpx.Response(200, json={"root": root.hex(), "page_size": PS, "reset": True, "keys": keys,
                                             "events": [], "next": 1})
        body = json.loads(request.content)
        if path == "/kv/offer":
            offers.append((host, len(body["prompt_token_ids"])))
            return httpx.Response(200, json={"kv_transfer_params": {"uuid": 99}})
        if path == "/kv/prefill":
            seen.append((host, len(body["request"]["prompt"])))
            pulls.append(body.get("kv_transfer_params"))
            if len(body["request"]["prompt"]) == len(long_prompt):
                await release.wait()  # a long prefill, still running
            return httpx.Response(200, json={"kv_transfer_params": {"uuid": len(seen)}})
        seen.append((host, body["kv_transfer_params"]["control"]))
        return httpx.Response(200, headers={"content-type": "application/json"},  # streamed, as the router reads it
                              stream=httpx.ByteStream(json.dumps({"choices": [{"text": "ok"}]}).encode()))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    router = create_router(["http://p0", "http://p1"], ["http://d0"], client, cost=COST, ttft_slo=5.0)

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(router), base_url="http://router") as c:
            def post(ids):
                return c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2})
            first = asyncio.create_task(post(long_prompt))
            while not seen:
                await asyncio.sleep(0.01)
            second = await post(prompt)  # p0 holds its prefix but is busy
            behind = await post(long_prompt + [7])  # ~7 s behind the long one on p0, ~3.5 s on p1: p1
            too_long = await post(list(range(3000, 4000)) * 2)  # 2,000 tokens: > 5 s anywhere
            release.set()
            await first
            third = await post(prompt + [9])  # p0 is idle again and caches its prefix
            return [r.status_code for r in (await first, second, behind, too_long, third)], too_long.json()
    codes, refused = asyncio.run(calls())
    assert codes == [200, 200, 200, 429, 200]
    assert "predicted TTFT" in refused["error"]["message"]
    prefills = [s for s in seen if isinstance(s[1], int)]
    assert prefills == [("p0", 1000), ("p1", 200), ("p1", 1001), ("p0", 201)]
    assert offers == [("p0", 200)] and pulls == [None, {"uuid": 99, "control": "http://p0"}, None, None]
    assert router.state.counts["prefix_pulled"] == 1
    conductor = router.state.conductor
    assert not any(conductor.queued.values()) and not any(conductor.running.values()) and not conductor.where
    assert router.state.counts["rejected_early"] == 1 and router.state.counts["prefix_routed"] == 1
    with pytest.raises(ValueError, match="pass cost"):
        create_router(["http://p0"], ["http://d0"], client, ttft_slo=1.0)


def test_replay_runs_requests_in_real_time_and_validate_compares_it():
    """serving.simulator.replay adds each request once its arrival has passed, records
    one time per sampled token and, asked to, every step the runner ran; validate pairs
    such runs with the simulator's prediction."""
    import time
    import types

    from serving.engine import EngineCore
    from serving.placement import validate
    from serving.simulator import SimRunner, replay

    def engine():
        return EngineCore(SimRunner(COST), CONFIG, 64, 256, eos_token_id=None)
    requests = [SimRequest(0.15, tuple(range(3, 40)), 3), SimRequest(0.0, tuple(range(50, 60)), 5)]
    start = time.perf_counter()
    record = ([], [])
    times = replay(engine(), requests, record=record)
    assert [len(t) for t in times] == [3, 5]
    assert times[0][0] >= 0.15 and time.perf_counter() - start >= 0.15
    assert all(np.all(np.diff(t) >= 0) for t in times)
    # every step was recorded in fit_cost_model's format: the two prompts, then decode rows
    prefill, decode = record
    assert sorted(n for lens, *_ in prefill for n in lens) == [10, 37]
    assert all(len(s) == 4 and s[3] >= 0 for s in prefill) and all(c and t >= 0 for c, t in decode)
    assert sum(len(c) for c, _ in decode) + sum(len(s[2]) for s in prefill) == (3 - 1) + (5 - 1)
    out = validate(types.SimpleNamespace(engine=engine()), requests, {"c": InstanceSetup(COST, CONFIG, 64, 256)},
                   repeats=2)
    assert len(out["real"]) == 2 and all(np.all(np.isfinite(run[0])) for run in out["real"])
    ttft, tpot = out["sim"]["c"]  # the simulator charges the cost model: a 10-token prompt alone in a step
    assert ttft[1] == pytest.approx(COST.prefill_time([10], [10]), rel=1e-9) and np.all(tpot > 0)


def test_fit_served_fits_isolated_and_served_steps_together(monkeypatch):
    """--cost's fit: the isolated steps (here exact samples of TRUE on measure_engine_steps'
    layout) and every step the engine ran serving the requests (here a runner that takes
    TRUE's time per step, so each is timed with real overhead) in one fit, which
    predicts TRUE's held-out steps within 15%."""
    import time
    import types

    from serving import simulator
    from serving.engine import EngineCore
    from serving.placement import fit_served
    from serving.simulator import SimRunner
    from tests.serving.test_simulator import TRUE, layout_samples

    class Sleeping(SimRunner):
        def execute(self, rows):
            out = super().execute(rows)
            time.sleep(self.last_step_time)
            return out

    fits, real_fit = [], simulator.fit_cost_model
    monkeypatch.setattr(simulator, "measure_engine_steps",
                        lambda llm: layout_samples(256, np.random.default_rng(0), noise=0.0, repeats=1))
    monkeypatch.setattr(simulator, "fit_cost_model", lambda p, d: fits.append((len(p), len(d))) or real_fit(p, d))
    llm = types.SimpleNamespace(engine=EngineCore(Sleeping(TRUE), CONFIG, 64, 256, eos_token_id=None))
    requests = [SimRequest(0.05 * i, tuple(range(100 * i, 100 * i + 20 + 9 * i)), 4) for i in range(6)]
    cost = fit_served(llm, requests)
    isolated = layout_samples(256, np.random.default_rng(0), noise=0.0, repeats=1)
    assert fits[-1][0] > len(isolated[0]) and fits[-1][1] > len(isolated[1])  # the served steps joined them
    for lens, ends in (([37], [37]), ([64, 16], [128, 80])):
        assert cost.prefill_time(lens, ends) == pytest.approx(TRUE.prefill_time(lens, ends), rel=0.15)
    for contexts in ([30], [40, 90, 150]):
        assert cost.decode_time(contexts) == pytest.approx(TRUE.decode_time(contexts), rel=0.15)


def test_router_forgets_a_request_whose_prefill_call_fails():
    """A prefill call that raises past what the router answers (here a bug in the
    transport; in serving, a cancelled request) leaves no prediction behind."""
    import asyncio

    import httpx

    from serving.router import create_router

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/kv/events":
            return httpx.Response(200, json={"root": "00" * 16, "page_size": PS, "reset": True, "keys": [],
                                             "events": [], "next": 1})
        raise RuntimeError("broken transport")

    router = create_router(["http://p0"], ["http://d0"], httpx.AsyncClient(transport=httpx.MockTransport(handler)),
                           cost=COST)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(router), base_url="http://router") as c:
            with pytest.raises(RuntimeError, match="broken transport"):
                await c.post("/v1/completions", json={"model": "m", "prompt": list(range(5, 105)), "max_tokens": 2})
    asyncio.run(call())
    conductor = router.state.conductor
    assert conductor.counts["admitted"] == 1 and not conductor.where and not any(conductor.running.values())
