"""The simulator's cost model and event loop: the least-squares fit recovers a known
model and predicts steps it was not fitted on, the measured layouts can separate every
coefficient, and simulated time is exactly the sum of the steps that ran."""

import dataclasses
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from serving import scheduler as sched
from serving.simulator import (CostModel, SimRequest, decode_features, decode_layout, fit_cost_model,
                               prefill_features, prefill_layout, simulate)

# Magnitudes of the default model's steps on a CPU: tens of ms per step, ~1 ms per
# prefill token (and as much again in a step of several chunks), tens of us per decode
# context token, ~10 ms per decode row.
TRUE = CostModel(prefill=(4e-2, 1.5e-3, 2e-6, 1e-3), decode=(3e-2, 4e-5, 1e-2))


def _noisy(t: float, rng, noise: float) -> float:
    return t * (1 + noise * rng.standard_normal())


def random_samples(rng, num: int, noise: float) -> tuple[list, list]:
    """Steps of random shape (mixed chunk lengths and starts, mixed contexts per batch)
    timed by TRUE with multiplicative noise."""
    prefill, decode = [], []
    for _ in range(num):
        k = int(rng.integers(1, 4))
        lens = rng.integers(2, 512, k).tolist()
        ends = [n + int(s) for n, s in zip(lens, rng.integers(0, 1536, k))]
        prefill.append((lens, ends, _noisy(TRUE.prefill_time(lens, ends), rng, noise)))
        contexts = rng.integers(1, 2048, int(rng.integers(1, 33))).tolist()
        decode.append((contexts, _noisy(TRUE.decode_time(contexts), rng, noise)))
    return prefill, decode


def layout_samples(max_model_len: int, rng, noise: float, repeats: int) -> tuple[list, list]:
    """The steps measure_engine_steps times, timed by TRUE with noise."""
    prefill = [([n] * k, [s + n] * k, _noisy(TRUE.prefill_time([n] * k, [s + n] * k), rng, noise))
               for _ in range(repeats) for n, s, k in prefill_layout(max_model_len)]
    decode = [([c] * b, _noisy(TRUE.decode_time([c] * b), rng, noise))
              for _ in range(repeats) for b, c in decode_layout(max_model_len)]
    return prefill, decode


def assert_close(fitted: tuple, true: tuple, rel: float) -> None:
    np.testing.assert_allclose(fitted, true, rtol=rel)


def test_fit_recovers_known_coefficients_from_noisy_steps():
    rng = np.random.default_rng(0)
    cost = fit_cost_model(*random_samples(rng, 200, noise=0.02))
    assert_close(cost.prefill, TRUE.prefill, 0.1)
    assert_close(cost.decode, TRUE.decode, 0.1)


@pytest.mark.parametrize("max_model_len", [64, 512, 2048, 8192])
def test_measured_layouts_separate_every_coefficient(max_model_len):
    # With one context per batch (the old layout), sum(context) = context * batch is a
    # multiple of the batch column: rank 2, and the per-token and per-row decode costs
    # trade off freely. Without a step of several chunks their term is never seen.
    decode = np.array([decode_features([c] * b) for b, c in decode_layout(max_model_len)])
    prefill = np.array([prefill_features([n] * k, [s + n] * k) for n, s, k in prefill_layout(max_model_len)])
    assert np.linalg.matrix_rank(decode) == 3
    assert np.linalg.matrix_rank(prefill) == 4
    for n, s, k in prefill_layout(max_model_len):
        assert n >= 2 and s + n <= max_model_len and k >= 1
    for b, c in decode_layout(max_model_len):
        assert b >= 1 and 1 <= c < max_model_len


def test_fit_on_the_measured_layout_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    cost = fit_cost_model(*layout_samples(2048, rng, noise=0.02, repeats=4))
    assert_close(cost.prefill, TRUE.prefill, 0.15)
    assert_close(cost.decode, TRUE.decode, 0.15)


def test_fit_predicts_held_out_steps_within_15_percent():
    rng = np.random.default_rng(3)
    prefill, decode = random_samples(rng, 60, noise=0.03)
    cost = fit_cost_model(prefill[:40], decode[:40])
    for lens, ends, t in prefill[40:]:
        assert cost.prefill_time(lens, ends) == pytest.approx(t, rel=0.15)
    for contexts, t in decode[40:]:
        assert cost.decode_time(contexts) == pytest.approx(t, rel=0.15)


# -- simulate ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordingCost(CostModel):
    """TRUE's step times, each one also recorded in `times`."""

    times: list = dataclasses.field(default_factory=list, compare=False)

    def step_time(self, rows):
        t = super().step_time(rows)
        self.times.append(t)
        return t


def recording_cost() -> RecordingCost:
    return RecordingCost(TRUE.prefill, TRUE.decode)


def random_requests(rng, num: int, arrival_span_s: float) -> list[SimRequest]:
    prefix = tuple(rng.integers(3, 100, 12).tolist())  # shared: prefix-cache hits
    requests = []
    for _ in range(num):
        own = tuple(rng.integers(3, 100, int(rng.integers(1, 40))).tolist())
        shared = prefix[:int(rng.integers(0, 13))]
        requests.append(SimRequest(float(rng.uniform(0, arrival_span_s)), shared + own, int(rng.integers(1, 24))))
    return requests


@pytest.mark.parametrize("policy", [sched.MAX_UTILIZATION, sched.GUARANTEED_NO_EVICT])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arrival_span_s", [0.0, 2.0])
def test_every_request_gets_its_tokens_and_time_is_the_sum_of_steps(policy, seed, arrival_span_s):
    rng = np.random.default_rng(seed)
    requests = random_requests(rng, 12, arrival_span_s)
    config = sched.SchedulerConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
                                   capacity_policy=policy, chunk_unit_size=4)
    cost = recording_cost()
    res = simulate(requests, config, num_pages=24, max_model_len=128, cost=cost)
    assert res.output_tokens == sum(r.output_len for r in requests)
    assert len(res.ttft_s) == len(requests)
    assert np.all(res.ttft_s >= 0) and np.all(res.e2e_s >= res.ttft_s)
    assert res.steps == len(cost.times)
    if arrival_span_s == 0:
        assert res.makespan_s == pytest.approx(sum(cost.times), rel=1e-12)
    else:  # busy for the steps, idle at most until the last arrival
        assert sum(cost.times) <= res.makespan_s <= max(r.arrival_s for r in requests) + sum(cost.times)


def test_preemption_costs_only_the_steps_that_run():
    # Two sequences decoding in lockstep fill a 4-page pool at the same step: the
    # scheduler preempts the newer (its pages let the older continue) and recomputes it
    # later; time is the sum of the steps that ran.
    requests = [SimRequest(0.0, tuple(range(3, 11)), 7), SimRequest(0.0, tuple(range(20, 28)), 7)]
    config = sched.SchedulerConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                                   capacity_policy=sched.MAX_UTILIZATION)
    cost = recording_cost()
    res = simulate(requests, config, num_pages=4, max_model_len=64, cost=cost, enable_prefix_caching=False)
    assert res.num_preemptions >= 1
    assert res.output_tokens == 14
    assert res.makespan_s == pytest.approx(sum(cost.times), rel=1e-12)


def test_a_preempted_request_does_not_count_its_own_pages_as_cache_hits():
    """num_cached_tokens is what the cache served at a request's first admission (as vLLM
    counts it): after a recompute preemption, the pages it computed itself and cached are
    found again, but they are not a prefix hit (they made the trace bench's hit rates
    look higher than the unbounded cache's optimum)."""
    from serving.kv_tiers import TierConfig
    from serving.simulator import TierCost

    requests = [SimRequest(0.0, tuple(range(3, 11)), 7), SimRequest(0.0, tuple(range(20, 28)), 7)]
    config = sched.SchedulerConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=32,
                                   capacity_policy=sched.MAX_UTILIZATION)
    # a host tier keeps the preempted request's pages, which its older neighbour evicts
    res = simulate(requests, config, num_pages=4, max_model_len=64, cost=recording_cost(),
                   tiers=TierConfig(host_cache_bytes=8 * 16, write_policy="write_through"),
                   tier_cost=TierCost(0.0, 0.0, 0.0))
    assert res.num_preemptions >= 1 and res.hits["host"] > 0  # its own pages came back ...
    assert res.cached_tokens == 0  # ... and are not counted as a prefix hit


def test_tier_copies_add_their_measured_time(tmp_path):
    """Prefixes evicted from a small pool come back from the host tier; each page moved
    takes tier_cost's seconds (copies down on the engine's time, loads on the copy lane)."""
    from serving.kv_tiers import TierConfig
    from serving.simulator import TierCost

    prefixes = [tuple(range(3 + 20 * i, 19 + 20 * i)) for i in range(4)]  # 4 pages each at page 4
    requests = [SimRequest(float(t), prefixes[t % 4] + (99, t), 2) for t in range(12)]
    config = sched.SchedulerConfig(page_size=4, max_num_seqs=1, max_num_batched_tokens=32)
    cost = recording_cost()
    tier_cost = TierCost(load_host_s=1e-3, load_disk_s=5e-3, copy_down_s=2e-3)
    res = simulate(requests, config, num_pages=8, max_model_len=64, cost=cost,
                   tiers=TierConfig(host_cache_bytes=8 * 64, write_policy="write_through"), tier_cost=tier_cost)
    assert res.hits["host"] >= 8 * 4 * 4  # the last 8 requests' prefixes, every page from the host
    assert res.cached_tokens == res.hits["host"] + res.hits.get("device", 0)
    assert res.io_s > 0 and res.makespan_s >= sum(cost.times) + res.io_s - 1e-12
    with pytest.raises(ValueError, match="tier_cost"):
        simulate(requests, config, num_pages=8, max_model_len=64, cost=cost, tiers=TierConfig())


def test_a_load_from_the_host_delays_only_its_own_request():
    """Strata's delayed hit: r0's 4-page prefix leaves a 6-page pool for r1 and comes
    back from the host tier for r2; its load takes 4 pages x load_host_s on the copy
    lane, so r2's first token comes after it, while r3, arriving with r2 and hitting
    nothing, is not held by it (its TTFT is the same at any load speed)."""
    from serving.kv_tiers import TierConfig
    from serving.simulator import TierCost

    p0, p1 = tuple(range(3, 19)), tuple(range(23, 39))  # 4 pages each at page size 4
    requests = [SimRequest(0.0, p0 + (99,), 1), SimRequest(1.0, p1 + (99,), 1),
                SimRequest(2.0, p0 + (98,), 1), SimRequest(2.0, (7, 8, 9), 1)]
    config = sched.SchedulerConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    ttft = {}
    for load_s in (0.0, 1.0):
        res = simulate(requests, config, num_pages=6, max_model_len=64, cost=recording_cost(),
                       tiers=TierConfig(host_cache_bytes=8 * 64, write_policy="write_through"),
                       tier_cost=TierCost(load_host_s=load_s, load_disk_s=0.0, copy_down_s=0.0))
        assert res.hits["host"] == 16 and res.io_s == 4 * load_s
        ttft[load_s] = res.ttft_s
    assert ttft[1.0][2] >= 4.0 > ttft[0.0][2]
    assert ttft[1.0][3] == ttft[0.0][3] < 1.0
    assert list(ttft[1.0][:2]) == list(ttft[0.0][:2])


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_a_prefetch_from_disk_runs_in_simulated_time(policy, tmp_path):
    """P's 24 pages leave the device and, behind Q's and R's, a 28-page host tier: P's
    second request finds them on disk only, 384 tokens, over the prefetch threshold. The
    prefetch reads them on the disk lane (0.1 s a page) while the request waits:
    "wait_complete" until all 24 are read (its TTFT takes the 2.4 s), "timeout" for
    HiCache's 1 s + 0.25 s per 1,024 tokens, then it recomputes what has not landed. A
    small request arriving with it is not held."""
    from serving.kv_tiers import TierConfig
    from serving.simulator import TierCost

    p, q, r = (tuple(range(start, start + 384)) for start in (3, 1000, 2000))
    requests = [SimRequest(0.0, p + (99,), 1), SimRequest(1.0, q + (99,), 1), SimRequest(2.0, r + (99,), 1),
                SimRequest(4.0, p + (98,), 1), SimRequest(4.0, (7, 8, 9), 1)]  # after R's prefill
    config = sched.SchedulerConfig(page_size=16, max_num_seqs=2, max_num_batched_tokens=512)
    results = {}
    for load_s in (0.0, 0.1):
        tiers = TierConfig(host_cache_bytes=8 * 28, write_policy="write_through",
                           disk_cache_dir=str(tmp_path / str(load_s)), disk_cache_bytes=64 * (8 + 8 + 16 + 8 * 16),
                           prefetch_policy=policy)
        results[load_s] = simulate(requests, config, num_pages=30, max_model_len=512, cost=recording_cost(),
                                   tiers=tiers, tier_cost=TierCost(load_host_s=0.0, load_disk_s=load_s,
                                                                   copy_down_s=0.0))
    slow, fast = results[0.1], results[0.0]
    assert fast.hits["disk"] == 384 and fast.ttft_s[3] < 0.5
    assert slow.ttft_s[4] == fast.ttft_s[4] < 0.1
    timeout = 1.0 + 0.25 * 384 / 1024
    if policy == "wait_complete":
        assert slow.hits["disk"] == 384 and slow.ttft_s[3] >= 2.4 and slow.io_s == pytest.approx(2.4)
    else:
        assert 0 < slow.hits["disk"] < 384 and timeout <= slow.ttft_s[3] < 2.4


def test_idle_gaps_cost_nothing_and_arrivals_start_on_time():
    a = SimRequest(1.0, tuple(range(3, 23)), 5)
    b = SimRequest(50.0, tuple(range(30, 47)), 5)  # long after a has finished
    config = sched.SchedulerConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    cost = recording_cost()
    res = simulate([b, a], config, num_pages=32, max_model_len=64, cost=cost, max_steps=10_000)
    # each starts with its prompt alone in a step, at its arrival
    assert res.ttft_s[0] == pytest.approx(TRUE.step_time_for_prefill(20), rel=1e-9)
    assert res.ttft_s[1] == pytest.approx(TRUE.step_time_for_prefill(17), rel=1e-9)
    assert res.makespan_s == pytest.approx(50.0 + res.e2e_s[1], rel=1e-12)
    assert res.output_tokens == 10
    # the busy time is the steps that ran, the rest is waiting for arrivals
    assert res.makespan_s - sum(cost.times) == pytest.approx(1.0 + 50.0 - (1.0 + res.e2e_s[0]), rel=1e-9)


def test_an_engine_that_could_never_schedule_is_rejected_up_front():
    # Without chunked prefill a prompt longer than the step budget would never run.
    requests = [SimRequest(0.0, tuple(range(3, 43)), 2)]
    config = sched.SchedulerConfig(page_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="without chunked prefill"):
        simulate(requests, config, num_pages=32, max_model_len=64, cost=TRUE, max_steps=1000)
    with pytest.raises(ValueError, match="chunk_unit_size=16 exceeds max_num_batched_tokens=8"):
        sched.SchedulerConfig(page_size=4, max_num_batched_tokens=8)


def test_host_side_serving_imports_no_jax_and_no_model():
    """The engine, scheduler, KV manager, output processor and simulator run on the host:
    importing them (a fresh interpreter) loads neither jax nor the model."""
    code = ("import sys, serving.engine, serving.simulator, serving.scheduler, serving.kv_manager, "
            "serving.output, serving.draft_tree\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'model', 'pallas_kernels'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).parents[2])
    assert out.stdout.strip() == "[]", out.stdout


def test_request_tpot_is_aligned_with_ttft():
    """Per request, in TTFT's order: a single-token request's TPOT is 0 (what goodput
    pairs with its TTFT), the others' are the tpot_s values in order."""
    from serving import scheduler as sched
    from serving.simulator import CostModel, SimRequest, simulate

    requests = [SimRequest(0.0, tuple(range(8)), n) for n in (3, 1, 4, 1, 2)]
    res = simulate(requests, sched.SchedulerConfig(page_size=4), 64, 64,
                   CostModel((1e-3, 0, 0), (1e-3, 0, 0)))
    assert len(res.request_tpot_s) == len(res.ttft_s) == 5
    np.testing.assert_array_equal(res.request_tpot_s[[1, 3]], 0.0)
    np.testing.assert_array_equal(res.request_tpot_s[[0, 2, 4]], res.tpot_s)


def test_trace_loader_counts_the_optimum_and_the_working_set_by_brute_force(tmp_path):
    """bench.load_trace's unbounded-cache optimum and working set (distinct full pages)
    equal a brute-force count over the materialised token lists: a page is new unless the
    same tokens from position 0 to its end appeared before."""
    import json

    from serving.bench import load_trace

    rng = np.random.default_rng(0)
    lines = []
    for t in range(40):  # conversations that extend a few shared histories, with odd lengths
        root = int(rng.integers(0, 4))
        ids = [1000 * root + k for k in range(int(rng.integers(1, 7)))]
        lines.append(dict(timestamp=10 * t, input_length=int(rng.integers(1, 512 * len(ids) + 1)),
                          output_length=int(rng.integers(1, 300)), hash_ids=ids))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    block_tokens, page = 24, 16  # pages straddle blocks
    requests, optimum, working_set = load_trace(str(path), 40, block_tokens, 10**6, 1 / 16, page_size=page)
    pages = [tuple(r.prompt[:end]) for r in requests for end in range(page, len(r.prompt) + 1, page)]
    assert working_set == len(set(pages)) > 0
    blocks = [tuple(r.prompt[:end]) for r in requests for end in range(block_tokens, len(r.prompt) + 1, block_tokens)]
    seen, reused = set(), 0
    for b in blocks:
        reused += b in seen
        seen.add(b)
    assert optimum == pytest.approx(reused / len(blocks)) and 0 < optimum < 1
    assert [len(r.prompt) for r in requests] == [max(1, int(r["input_length"] * block_tokens / 512)) for r in lines]


def test_fit_on_served_steps_with_decode_rows_beside_chunks():
    """fit_cost_model on steps as an engine serves them (replay's record): chunks with
    decode rows beside them share decode's per-context-token cost, one joint fit; the
    fit recovers the model that timed them and predicts step_time of mixed steps."""
    from serving.engine import Row

    rng = np.random.default_rng(5)
    prefill, decode = random_samples(rng, 150, noise=0.02)
    mixed = []
    for _ in range(150):
        lens = rng.integers(2, 300, int(rng.integers(1, 3))).tolist()
        ends = [n + int(s) for n, s in zip(lens, rng.integers(0, 1000, len(lens)))]
        contexts = rng.integers(1, 2048, int(rng.integers(1, 12))).tolist()
        rows = [Row((0,) * n, e - n, (0,), True) for n, e in zip(lens, ends)]
        rows += [Row((0,), c - 1, (0,), True) for c in contexts]
        mixed.append((lens, ends, contexts, _noisy(TRUE.step_time(rows), rng, 0.02)))
    cost = fit_cost_model(prefill + mixed, decode)
    assert_close(cost.prefill, TRUE.prefill, 0.15)
    assert_close(cost.decode, TRUE.decode, 0.15)
    # without mixed steps the joint fit is the two separate ones
    joint = fit_cost_model(prefill, decode)
    np.testing.assert_allclose(joint.prefill, fit_cost_model(prefill, []).prefill, rtol=1e-9)
    np.testing.assert_allclose(joint.decode, fit_cost_model([], decode).decode, rtol=1e-9)
