"""Property-based: after any random sequence of add / step / abort / finish / preempt /
evict events, no page is leaked or freed twice, every refcount equals its holders, the
radix tree's counters match its nodes, every page a running sequence reads holds its own
tokens (the simulator's stand-in K/V), also with host and disk tiers under the prefix
cache, and with a bounded pool everything finishes."""

import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from serving import scheduler as sched
from serving.engine import RECOMPUTE, SWAP, EngineCore
from serving.kv_manager import pages_for
from serving.kv_tiers import PREFETCH_POLICIES, WRITE_POLICIES, TierConfig
from serving.params import SamplingParams
from serving.simulator import CostModel, SimRunner

COST = CostModel((1e-3, 1e-5, 0.0), (1e-3, 1e-6, 1e-4))
PAGE = 4

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # small alphabet: shared prefixes


def event_lists(prompts, min_size=1):
    return st.lists(st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, 12), st.integers(1, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("finish"), st.integers(0, 30)),
        st.tuples(st.just("evict"), st.integers(1, 8)),
    ), min_size=min_size, max_size=60)


events = event_lists(prompts)
# with tiers: a few long shared prefixes, so that pages are evicted and asked for again
PREFIXES = tuple(np.random.default_rng(i).integers(0, 4, 12).tolist() for i in range(6))  # 18 pages: over 12
LONG_PREFIXES = tuple(np.random.default_rng(i).integers(0, 4, 16).tolist() for i in range(10))  # 40 pages: over 32
tier_events = event_lists(st.builds(lambda p, s: list(p) + s, st.sampled_from(LONG_PREFIXES),
                                    st.lists(st.integers(0, 3), max_size=4)), min_size=30)


class CheckedRunner(SimRunner):
    """Checks, as each step starts, that every row's pages hold its sequence's tokens up
    to the row (no row reads a page whose load or copy has not landed)."""

    engine = None

    def execute(self, rows):
        tables = {tuple(t): sid for sid, t in self.engine.kv.tables.items()}
        for row in rows:
            sid = tables[row.block_table]
            assert self.kv_tokens(row.block_table, row.start) == list(self.engine.tokens(sid, 0, row.start)), \
                "a row reads a page that does not hold its K/V yet"
        return super().execute(rows)


def make_engine(policy, preemption, num_pages=24, prefix=True, tiers=None):
    config = sched.SchedulerConfig(page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=16,
                                   capacity_policy=policy, chunk_unit_size=4,
                                   order=sched.LPM if prefix else sched.FCFS)
    runner = CheckedRunner(COST, vocab_size=4, page_size=PAGE)
    runner.engine = EngineCore(runner, config, num_pages, max_model_len=64, eos_token_id=None,
                               enable_prefix_caching=prefix, preemption_mode=preemption, tiers=tiers,
                               fingerprint=b"sim")
    return runner.engine


def check(engine):
    engine.kv.check()
    running = {s.seq_id for s in engine.state.running}
    waiting = {s.seq_id for s in engine.state.waiting}
    assert not running & waiting
    assert running <= set(engine.kv.tables), "a running sequence without pages"
    assert set(engine.kv.tables) <= running, "pages held by a sequence that is not running"
    for s in engine.state.running:  # a running sequence's pages hold its computed KV
        assert len(engine.kv.tables[s.seq_id]) >= pages_for(s.num_computed_tokens, PAGE)
        assert s.num_tokens == len(engine.tokens(s.seq_id)), "scheduler and engine disagree on tokens"
        assert engine.runner.kv_tokens(engine.kv.tables[s.seq_id], s.num_computed_tokens) == \
            list(engine.tokens(s.seq_id, 0, s.num_computed_tokens)), "a page holds another sequence's K/V"
    if engine.tiers is not None:
        assert not engine.kv.offloads and not engine.kv.loads, "tier copies left queued after a step"
        assert not engine.tiers.host.pinned, "host pages pinned past their step"
        assert not set(engine._loading) & running, "a sequence ran before its prefetch ended"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, policy=st.sampled_from(sched.CAPACITY_POLICIES),
       preemption=st.sampled_from([RECOMPUTE, SWAP]), prefix=st.booleans())
def test_random_events_keep_kv_consistent_and_everything_finishes(events, policy, preemption, prefix):
    run_events(make_engine(policy, preemption, prefix=prefix), events)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=tier_events, policy=st.sampled_from(sched.CAPACITY_POLICIES),
       preemption=st.sampled_from([RECOMPUTE, SWAP]), write_policy=st.sampled_from(WRITE_POLICIES),
       host_pages=st.integers(1, 12), disk_pages=st.integers(0, 12),
       prefetch=st.sampled_from([None, *PREFETCH_POLICIES]))
def test_random_events_with_host_and_disk_tiers(events, policy, preemption, write_policy, host_pages,
                                                disk_pages, prefetch):
    """The same, with pages copied down to small host and disk tiers and loaded back
    (prefetched in the background under each policy, every disk hit large enough): a
    loaded page holds the tokens of the prefix it was matched for, and a sequence waiting
    on a prefetch never runs."""
    with tempfile.TemporaryDirectory() as tmp:
        file_bytes = 8 + 8 + 16 + 8 * PAGE  # kv_tiers.DiskTier's header, then a page of int64 tokens
        tiers = TierConfig(host_cache_bytes=8 * PAGE * host_pages, write_policy=write_policy,
                           disk_cache_dir=tmp if disk_pages else None,
                           disk_cache_bytes=max(disk_pages, 1) * file_bytes, prefetch_policy=prefetch or "timeout")
        engine = make_engine(policy, preemption, num_pages=32, tiers=tiers)
        if prefetch is not None:
            engine.tiers.prefetch_threshold = 0
        run_events(engine, events)
        engine.tiers.flush()
        if disk_pages:  # a restarted engine finds the disk's pages
            again = make_engine(policy, preemption, num_pages=32, tiers=tiers)
            assert len(again.tiers.disk.index) == len(engine.tiers.disk.index)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("preemption", [RECOMPUTE, SWAP])
def test_prefixes_come_back_from_host_and_disk(write_policy, preemption, tmp_path):
    """Six 3-page prefixes cycled three times through a 12-page pool, a 3-page host tier
    and a 20-page disk tier: later rounds are served from the tiers (each prefix is asked
    for three times in a row, so write-through-selective copies it down), every loaded page
    holds its prefix's tokens (`check`), and a new engine finds the disk's pages."""
    file_bytes = 8 + 8 + 16 + 8 * PAGE
    tiers = TierConfig(host_cache_bytes=8 * PAGE * 3, write_policy=write_policy, disk_cache_dir=str(tmp_path),
                       disk_cache_bytes=20 * file_bytes)
    engine = make_engine(sched.MAX_UTILIZATION, preemption, num_pages=12, tiers=tiers)
    events = [ev for r in range(3) for prefix in PREFIXES for k in range(3)
              for ev in [("add", prefix + [r, k], 2, 1), ("step",), ("step",), ("step",)]]
    run_events(engine, events)
    hits = engine.kv.hits
    assert hits["host"] + hits["disk"] >= 4 * 12, hits  # at least four prefixes came back
    engine.tiers.flush()
    again = make_engine(sched.MAX_UTILIZATION, preemption, num_pages=12, tiers=tiers)
    run_events(again, [("add", PREFIXES[0] + [9], 2, 1)])
    assert again.kv.hits["disk"] + again.kv.hits["host"] > 0 or write_policy == "write_back"


def test_loaded_pages_land_even_when_their_step_fails():
    """A load overlapping a step is written into the pool after it, in a `finally`: the
    pages are in the prefix cache already, so a step that raises must not leave them
    unwritten for the next request to read."""
    tiers = TierConfig(host_cache_bytes=8 * PAGE * 24, write_policy="write_through")
    engine = make_engine(sched.MAX_UTILIZATION, RECOMPUTE, num_pages=12, tiers=tiers)
    run_events(engine, [("add", prefix + [9], 1, 1) for prefix in PREFIXES])  # the first leaves the device
    execute = engine.runner.execute

    def failing(rows):
        if engine.step_loads:
            raise RuntimeError("the device failed")
        return execute(rows)
    engine.runner.execute = failing
    engine.add_request("again", PREFIXES[0] + [8], SamplingParams(max_tokens=1, temperature=0))
    engine.add_request("other", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    with pytest.raises(RuntimeError, match="device failed"):
        engine.step()  # admits "again" from the host tier: its load overlaps "other"'s row
    (sid,) = engine.step_loads
    assert engine.kv.hits["host"] == 12
    assert engine.runner.kv_tokens(engine.kv.tables[sid], 12) == PREFIXES[0]


def run_events(engine, events):
    ids = []
    for ev in events:
        if ev[0] == "add":
            rid = str(len(ids))
            engine.add_request(rid, ev[1], SamplingParams(max_tokens=ev[2], n=ev[3], temperature=0,
                                                          ignore_eos=True))
            ids.append(rid)
        elif ev[0] == "step" and engine.has_unfinished():
            engine.step()
        elif ev[0] == "abort" and ev[1] < len(ids):
            engine.abort(ids[ev[1]])
        elif ev[0] == "finish" and ev[1] < len(ids):
            for sid in engine.requests[ids[ev[1]]].seq_ids:
                engine.finish_seq(sid, "stop")
        elif ev[0] == "evict" and engine.kv.radix is not None:
            engine.kv.radix.evict(ev[1])
            if engine.tiers is not None:
                engine._move_tiered_pages()  # what the engine does before its next pool write
        check(engine)
    # With a bounded pool, whatever is left runs to completion (no deadlock).
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        check(engine)
    assert not engine.has_unfinished(), "deadlock: requests never finish"
    for rid in ids:
        assert engine.request_finished(rid)
        for sid in engine.requests[rid].seq_ids:
            seq = engine.seqs[sid]
            assert seq.output.finish_reason in ("length", "stop", "abort")
            if seq.output.finish_reason == "length":
                assert len(seq.output.tokens) == seq.params.max_tokens
    assert not engine.kv.tables
    engine.kv.check()
    if engine.kv.radix is not None:
        assert engine.kv.radix.protected_pages == 0  # nothing locked once all finished


@settings(max_examples=25, deadline=None)
@given(n_requests=st.integers(2, 8), policy=st.sampled_from(sched.CAPACITY_POLICIES))
def test_fcfs_no_starvation(n_requests, policy):
    """Under FCFS every request finishes; without preemption they finish in arrival order."""
    engine = make_engine(policy, RECOMPUTE, num_pages=12, prefix=False)
    for i in range(n_requests):
        engine.add_request(str(i), [1 + i % 3] * 10, SamplingParams(max_tokens=6, temperature=0,
                                                                    ignore_eos=True))
    order = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        engine.step()
        for rid in engine.requests:
            if engine.request_finished(rid) and rid not in order:
                order.append(rid)
    assert not engine.has_unfinished(), "deadlock: requests never finish"
    assert sorted(order, key=int) == [str(i) for i in range(n_requests)]
    if policy != sched.MAX_UTILIZATION:  # MAX_UTILIZATION may pause the newest and reorder
        assert order == sorted(order, key=int)


def test_parallel_samples_are_reserved_under_the_reserving_policies():
    """n > 1 under GUARANTEED_NO_EVICT / STATIC_BATCH: the forks' pages are counted at
    admission, so a small pool admits fewer requests instead of running out (it used to
    raise NoFreePages when the samples forked), and a request whose samples can never
    fit is rejected up front."""
    for policy in (sched.GUARANTEED_NO_EVICT, sched.STATIC_BATCH):
        engine = make_engine(policy, RECOMPUTE, num_pages=12, prefix=False)
        for rid, prompt in enumerate(([0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0])):
            engine.add_request(str(rid), prompt, SamplingParams(max_tokens=7, n=3, temperature=0,
                                                                ignore_eos=True))
        for _ in range(200):
            if not engine.has_unfinished():
                break
            engine.step()
            check(engine)
        assert not engine.has_unfinished()
        assert all(len(engine.seqs[f"{r}#{i}"].output.tokens) == 7 for r in "012" for i in range(3))
        try:
            engine.add_request("big", [0] * 20, SamplingParams(max_tokens=7, n=3, ignore_eos=True))
        except ValueError as e:
            assert "all n=3 samples" in str(e)
        else:
            raise AssertionError("a request whose samples cannot fit the pool was accepted")


def test_reserved_pages_receive_remote_kv_and_nothing_leaks():
    """KVManager.reserve holds pages for K/V on its way (all or none); adopt_prefix writes
    into them, gives back those a cached prefix makes unneeded, and allocates what they do
    not cover; a write that cannot fit gives them back; unreserve gives back the rest."""
    from serving.kv_manager import KVManager
    from serving.radix_cache import NoFreePages

    kv = KVManager(num_pages=8, page_size=PAGE)
    tokens = tuple(range(40, 61))  # 5 full pages and a token
    assert kv.reserve("a", 5) == 5 and kv.pool.num_free == 3
    assert kv.reserve("b", 4) == 0 and "b" not in kv.reserved  # does not fit: nothing held
    held = list(kv.reserved["a"])
    new, first, node = kv.adopt_prefix(tokens, 5, reservation="a")
    kv.filled(node)
    assert (new, first) == (held, 0) and not kv.reserved and kv.cached_pages(tokens) == held
    kv.check()
    longer = tokens[:20] + tuple(range(90, 94))  # 6 full pages, the first 5 those cached
    assert kv.reserve("c", 3) == 3 and kv.pool.num_free == 0
    held = list(kv.reserved["c"])
    new, first, node = kv.adopt_prefix(longer, 6, reservation="c")  # 1 of the 3 is written, 2 go back
    kv.filled(node)
    assert (new, first) == (held[:1], 5) and not kv.reserved and kv.pool.num_free == 2
    kv.check()
    assert kv.reserve("d", 2) == 2
    with pytest.raises(NoFreePages):  # 9 pages: the 2 reserved and the 6 cached are not enough
        kv.adopt_prefix(tuple(range(200, 240)), 9, reservation="d")
    assert not kv.reserved and kv.pool.num_free + kv.radix.evictable_pages == 8
    kv.check()
    assert kv.reserve("e", 1) == 1
    kv.unreserve("e")
    kv.unreserve("never")
    assert kv.pool.num_free + kv.radix.evictable_pages == 8
    kv.check()
