"""The pure scheduler against hand-worked cases of each TensorRT-LLM / SGLang policy."""


import pytest

from serving import scheduler as sched
from serving.scheduler import KVView, Seq, SchedulerConfig, SchedulerState, schedule


def cfg(**kw):
    return SchedulerConfig(**{"page_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64,
                              "chunk_unit_size": 4, **kw})


def waiting(*lens, max_new=4, tokens=None):
    return tuple(Seq(f"r{i}", tokens[i] if tokens else tuple(range(100 * i, 100 * i + n)),
                     n + max_new, float(i)) for i, n in enumerate(lens))


def decoding(seq_id, n_tokens, max_total, started):
    return Seq(seq_id, tuple(range(n_tokens)), max_total, float(started),
               num_computed_tokens=n_tokens - 1, started=started)


def pages(available, held=None, cached=None):
    """A KV view: `available` pages to hand out, running sequences' writable pages."""
    return KVView(available, held or {}, cached or {})


def test_is_pure():
    state = SchedulerState(waiting=waiting(8, 8))
    a = schedule(state, cfg(), pages(100))
    b = schedule(state, cfg(), pages(100))
    assert a == b and state == SchedulerState(waiting=waiting(8, 8))


def test_guaranteed_no_evict_reserves_to_completion_and_stops_at_first_misfit():
    # r0 needs pages for 8+4=12 tokens = 3 pages, r1 for 20+4 = 6, r2 for 4+4 = 2
    state = SchedulerState(waiting=waiting(8, 20, 4))
    _, plan = schedule(state, cfg(capacity_policy=sched.GUARANTEED_NO_EVICT), pages(8))
    assert plan.admitted == ("r0",)  # r1 misfits (3 + 6 > 8) and stops admission, r2 waits too
    _, plan = schedule(state, cfg(capacity_policy=sched.GUARANTEED_NO_EVICT), pages(11))
    assert plan.admitted == ("r0", "r1", "r2")


def test_max_utilization_counts_next_step_only_and_pauses_newest():
    run = (decoding("old", 8, 100, started=0), decoding("new", 8, 100, started=5))
    held = {"old": 2, "new": 2}
    state = SchedulerState(running=run, waiting=waiting(4))
    # Each decode row writes position 7 (page 1, already held): no new pages needed.
    _, plan = schedule(state, cfg(capacity_policy=sched.MAX_UTILIZATION), pages(1, held))
    assert set(dict(plan.scheduled)) == {"old", "new", "r0"} and not plan.preempted
    # At a page boundary both need a page; with one available the newest is paused.
    run = (decoding("old", 9, 100, started=0), decoding("new", 9, 100, started=5))
    new_state, plan = schedule(SchedulerState(running=run, waiting=waiting(4)),
                               cfg(capacity_policy=sched.MAX_UTILIZATION), pages(1, held))
    assert plan.preempted == ("new",) and dict(plan.scheduled) == {"old": 1}
    assert plan.admitted == ()  # nothing admitted in a step that preempted
    assert new_state.waiting[0].seq_id == "new" and new_state.waiting[0].num_computed_tokens == 0


def test_speculative_decode_rows_cost_the_tree_and_reserve_lookahead():
    """A decode row scores a whole draft tree (tokens_per_decode of the budget) and holds
    num_lookahead_slots past its step; rows the budget cannot take rotate across steps."""
    config = cfg(tokens_per_decode=10, max_num_batched_tokens=20, num_lookahead_slots=6)
    run = tuple(decoding(f"s{i}", 8, 100, started=0) for i in range(4))
    state = SchedulerState(running=run)
    seen = []
    for _ in range(2):
        state, plan = schedule(state, config, pages(100, {s.seq_id: 4 for s in run}))
        assert plan.num_tokens == 2  # two trees of 10 fill the budget of 20
        seen += [sid for sid, _ in plan.scheduled]
        state = sched.update(state, plan, {sid: 1 for sid, _ in plan.scheduled})
    assert sorted(seen) == ["s0", "s1", "s2", "s3"]  # nobody starved
    # position 7 + 6 lookahead slots reach page 3 (the 4th): a sequence holding 3 pages
    # needs one more
    tight = SchedulerState(running=(decoding("a", 8, 100, started=0),))
    assert schedule(tight, config, pages(0, {"a": 3}))[1].preempted == ("a",)
    assert schedule(tight, config, pages(1, {"a": 3}))[1].scheduled == (("a", 1),)


def test_static_batch_admits_only_into_an_empty_batch():
    run = (decoding("a", 8, 12, started=0),)
    _, plan = schedule(SchedulerState(running=run, waiting=waiting(4)),
                       cfg(capacity_policy=sched.STATIC_BATCH), pages(100, {"a": 2}))
    assert plan.admitted == ()
    _, plan = schedule(SchedulerState(waiting=waiting(4, 4)), cfg(capacity_policy=sched.STATIC_BATCH), pages(100))
    assert plan.admitted == ("r0", "r1")


def test_token_budget_decode_first_then_fcfs_chunks_rounded_to_units():
    run = tuple(decoding(f"d{i}", 8, 100, started=0) for i in range(3))
    state = SchedulerState(running=run, waiting=waiting(30, 30))
    _, plan = schedule(state, cfg(max_num_batched_tokens=21), pages(100, {s.seq_id: 2 for s in run}))
    got = dict(plan.scheduled)
    assert [got[f"d{i}"] for i in range(3)] == [1, 1, 1]
    assert got["r0"] == 16  # 18 left, rounded down to the 4-token unit
    assert "r1" not in got  # 2 tokens left < one unit
    assert plan.num_tokens <= 21
    assert [s for s, _ in plan.scheduled][0] == "r0"  # prefill chunks listed before decode rows


def test_equal_progress_round_robins_units():
    state = SchedulerState(waiting=waiting(30, 30, 30))
    _, plan = schedule(state, cfg(max_num_batched_tokens=24, chunking_policy=sched.EQUAL_PROGRESS), pages(100))
    assert dict(plan.scheduled) == {"r0": 8, "r1": 8, "r2": 8}
    _, plan = schedule(state, cfg(max_num_batched_tokens=24), pages(100))
    assert dict(plan.scheduled) == {"r0": 24}  # first come, first served


def test_max_num_seqs_bounds_the_batch():
    _, plan = schedule(SchedulerState(waiting=waiting(*([4] * 10))), cfg(max_num_seqs=3), pages(100))
    assert len(plan.scheduled) == 3


def test_longest_prefix_first_and_in_batch_deferral():
    shared = tuple(range(64))
    toks = [tuple(range(500, 510)), shared + (1,), shared + (2,), tuple(range(900, 980))]
    state = SchedulerState(waiting=waiting(10, 65, 65, 80, tokens=toks))
    cached = {"r3": 48}
    _, plan = schedule(state, cfg(order=sched.LPM, max_num_batched_tokens=512), pages(100, cached=cached))
    # r3 has the longest cached prefix and goes first; r2 shares 64 uncached tokens with r1
    # admitted in the same step, so it is deferred to hit r1's KV next step.
    assert plan.admitted[0] == "r3"
    assert "r1" in plan.admitted and "r2" not in plan.admitted
    _, plan = schedule(state, cfg(order=sched.FCFS, max_num_batched_tokens=512), pages(100, cached=cached))
    assert plan.admitted == ("r0", "r1", "r2", "r3")


def test_admission_of_cached_prefix_skips_those_tokens():
    state = SchedulerState(waiting=waiting(40))
    new_state, plan = schedule(state, cfg(), pages(100, cached={"r0": 32}))
    assert dict(plan.scheduled) == {"r0": 8}
    assert new_state.running[0].num_computed_tokens == 32


def test_a_delayed_hit_is_admitted_without_tokens_and_others_take_the_budget():
    """r0's 32 cached tokens come from the tiers: it is admitted (its 8 pages counted)
    but computes nothing while they load; r1 and the running decode row take the step's
    budget. Next step, running, it computes the rest of its prompt."""
    run = (decoding("d", 8, 100, started=0),)
    state = SchedulerState(running=run, waiting=waiting(40, 40, max_new=4)[:1] + (
        Seq("r1", tuple(range(500, 540)), 44, 1.0),))
    view = KVView(100, {"d": 2}, {"r0": 32}, loading={"r0": 32})
    new_state, plan = schedule(state, cfg(max_num_batched_tokens=32), view)
    assert plan.admitted == ("r0", "r1")
    assert dict(plan.scheduled) == {"d": 1, "r1": 28}  # the budget in chunk units, none of it r0's
    assert {s.seq_id: s.num_computed_tokens for s in new_state.running}["r0"] == 32
    _, plan = schedule(new_state, cfg(max_num_batched_tokens=32), KVView(100, {"d": 2, "r0": 8, "r1": 8}))
    assert dict(plan.scheduled)["r0"] == 8
    # Its pages count at admission: with room for r1's 8 only, r0 (8 pages) misfits first.
    _, plan = schedule(state, cfg(max_num_batched_tokens=32), KVView(7, {"d": 2}, {"r0": 32}, loading={"r0": 32}))
    assert plan.admitted == ()


def test_a_blocked_running_sequence_computes_nothing():
    run = (decoding("a", 8, 100, started=0), decoding("b", 8, 100, started=1))
    _, plan = schedule(SchedulerState(running=run), cfg(), pages(10, {"a": 2, "b": 2}), blocked=frozenset({"b"}))
    assert dict(plan.scheduled) == {"a": 1} and not plan.preempted


@pytest.mark.parametrize("bad", [dict(capacity_policy="nope"), dict(chunking_policy="x"),
                                 dict(order="random"), dict(max_num_seqs=0)])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        cfg(**bad)


def test_a_preempted_sequence_gives_its_pages_back_before_the_next_victim_is_chosen():
    """MAX_UTILIZATION with no free page: A (older) needs one more page for its next token;
    preempting C (newer) frees C's pages, which is enough, so A keeps running. Without
    counting what a victim frees, every sequence would be preempted and the step would
    run nothing."""
    a = Seq("A", tuple(range(40)), 100, 0.0, num_computed_tokens=48, started=0, num_tokens=49)
    c = Seq("C", tuple(range(100, 124)), 100, 1.0, num_computed_tokens=31, started=1, num_tokens=32)
    config = SchedulerConfig(page_size=16, capacity_policy=sched.MAX_UTILIZATION)
    state = SchedulerState(running=(a, c), step=9)
    _, plan = schedule(state, config, KVView(0, {"A": 3, "C": 2}, freeable={"A": 3, "C": 2}))
    assert plan.preempted == ("C",) and plan.scheduled == (("A", 1),)
    _, shared = schedule(state, config, KVView(0, {"A": 3, "C": 2}, freeable={"A": 3, "C": 0}))
    assert shared.preempted == ("C", "A")  # C's pages are shared: preempting it frees nothing


def test_the_engine_preempts_only_what_it_must():
    """The case above through the engine core (5 pages, a cost-model runner): each
    preemption leaves a sequence running, and every step computes something."""
    from serving.engine import EngineCore
    from serving.params import SamplingParams
    from serving.simulator import CostModel, SimRunner

    engine = EngineCore(SimRunner(CostModel((0, 0, 0), (0, 0, 0))),
                        SchedulerConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=64),
                        5, 512, eos_token_id=None, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    engine.add_request("A", list(range(40)), params, arrival=0.0)
    engine.add_request("C", list(range(100, 124)), params, arrival=1.0)
    rows_per_step, execute = [], engine.runner.execute

    def counting(rows):
        rows_per_step.append(len(rows))
        return execute(rows)
    engine.runner.execute = counting
    steps = 0
    while engine.has_unfinished():
        before = engine.num_preemptions
        engine.step()
        steps += 1
        assert len(rows_per_step) == steps and rows_per_step[-1] > 0, f"step {steps} ran nothing"
        assert engine.num_preemptions - before <= 1
        engine.kv.check()
    assert engine.num_preemptions >= 1 and steps < 120
