"""The batching scheduler as a pure function: schedule(state, ...) -> (state, plan).

State is immutable (frozen dataclasses, tuples); every transition returns a new
state. The same function drives the real engine and the discrete-event simulator.

Policies (TensorRT-LLM's batch manager, with the vLLM v1 scheduler's token-budget view
of prefill and the cache-aware order of SGLang, Zheng et al., "SGLang: Efficient
Execution of Structured Language Model Programs", NeurIPS 2024):
- capacity: GUARANTEED_NO_EVICT reserves every running sequence's pages to
  completion and admits while the newcomer's total fits; MAX_UTILIZATION counts only
  the pages the next step needs and pauses (preempts) the most recently started
  sequence on a misfit; STATIC_BATCH admits only into an empty batch. With
  speculative decoding every sequence also holds `num_lookahead_slots` KV slots past
  its step's tokens (the draft tree's), and a decode row costs `tokens_per_decode`
  tokens of the budget (the tree's nodes, all scored by the target).
- micro-batch: at most max_num_seqs sequences (a request of n samples counts n from its
  admission) and max_num_batched_tokens tokens a step; decode rows (1 token) first,
  then prefill chunks, first-come-first-served
  (chunks rounded down to chunk_unit_size) or equal-progress (round-robin units).
- order of the waiting queue: FCFS, or longest-prefix-match first (falls back to
  FCFS past 128 waiting), deferring a request that would share >= 32 uncached tokens
  with one admitted this step so it hits that one's KV next step.
- delayed hits (Strata, "Hierarchical Context Caching for Long Context LLM Serving"): a
  request whose cached prefix comes back from the host or disk tiers is admitted (its
  pages allocated, their load started) but computes nothing in the step that loads them:
  the step's token budget goes to work that is ready, and the request starts the step
  after, when its pages are in place.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from serving.kv_manager import pages_for

GUARANTEED_NO_EVICT = "guaranteed_no_evict"
MAX_UTILIZATION = "max_utilization"
STATIC_BATCH = "static_batch"
CAPACITY_POLICIES = (GUARANTEED_NO_EVICT, MAX_UTILIZATION, STATIC_BATCH)
FIRST_COME_FIRST_SERVED = "first_come_first_served"
EQUAL_PROGRESS = "equal_progress"
CHUNKING_POLICIES = (FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS)
FCFS = "fcfs"
LPM = "lpm"
ORDERS = (FCFS, LPM)
LPM_MAX_WAITING = 128
DEFER_MAX_CACHED = 32
DEFER_MIN_SHARED = 32


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    capacity_policy: str = MAX_UTILIZATION
    chunking_policy: str = FIRST_COME_FIRST_SERVED
    chunk_unit_size: int = 16
    order: str = FCFS
    enable_chunked_prefill: bool = True
    tokens_per_decode: int = 1
    num_lookahead_slots: int = 0
    max_loras: int = 0  # distinct LoRA adapters among running sequences (0: no LoRA)

    def __post_init__(self):
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_policy!r}")
        if self.chunking_policy not in CHUNKING_POLICIES:
            raise ValueError(f"chunking_policy must be one of {CHUNKING_POLICIES}, got {self.chunking_policy!r}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "chunk_unit_size",
                     "tokens_per_decode"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("num_lookahead_slots", "max_loras"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # Progress: a decode row and a prefill chunk of one unit always fit the budget.
        for name in ("chunk_unit_size", "tokens_per_decode"):
            if getattr(self, name) > self.max_num_batched_tokens:
                raise ValueError(f"{name}={getattr(self, name)} exceeds max_num_batched_tokens="
                                 f"{self.max_num_batched_tokens}: no step could schedule it")


@dataclasses.dataclass(frozen=True, slots=True)
class Seq:
    """What the scheduler knows of one sequence.

    prompt: the request's prompt (the engine's tuple, shared, not copied; the in-batch
    deferral compares prompts); num_tokens: tokens whose KV the sequence needs, the prompt
    and what it generated (the engine holds those); num_computed_tokens: how many of them
    have KV in its pages;
    max_total_tokens: prompt + max_tokens (what GUARANTEED_NO_EVICT reserves);
    num_forks: samples that will fork from it after its first token (n - 1 of parallel
    sampling; 0 once they have), whose pages the reserving policies count in advance;
    lora_id: the LoRA adapter it runs under (0: the base model).
    """

    seq_id: str
    prompt: tuple[int, ...]
    max_total_tokens: int
    arrival: float
    num_computed_tokens: int = 0
    started: int = -1  # step at which it last started running
    num_forks: int = 0
    num_tokens: int = -1  # -1: the prompt's length
    lora_id: int = 0

    def __post_init__(self):
        if self.num_tokens < 0:
            object.__setattr__(self, "num_tokens", len(self.prompt))

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    waiting: tuple[Seq, ...] = ()
    running: tuple[Seq, ...] = ()
    step: int = 0


@dataclasses.dataclass(frozen=True)
class KVView:
    """What the scheduler sees of the KV manager at one step (serving/kv_manager.py makes
    the page decisions; this is their summary).

    num_available: pages it can hand out now (free plus evictable cached ones);
    writable: for running sequences, pages they hold and can write from their next
    position without allocating (KVManager.writable_pages); cached: for waiting
    sequences, prompt tokens the prefix cache would serve; freeable: for running
    sequences, pages that preempting it makes available (KVManager.freeable_pages: those
    no other sequence holds; may be computed on access), 0 where absent; loading: for
    waiting sequences, how many of their `cached` tokens the host or disk tiers hold
    (loaded into new device pages when they are admitted), 0 where absent.
    """

    num_available: int
    writable: Mapping[str, int] = dataclasses.field(default_factory=dict)
    cached: Mapping[str, int] = dataclasses.field(default_factory=dict)
    freeable: Mapping[str, int] = dataclasses.field(default_factory=dict)
    loading: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """scheduled: (seq_id, num_new_tokens), prefill chunks before decode rows.
    admitted: seq ids that started running this step (the engine admits them into the
    KV manager first); preempted: seq ids sent back to waiting (the engine frees or
    swaps their pages)."""

    scheduled: tuple[tuple[str, int], ...] = ()
    admitted: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def add(state: SchedulerState, seq: Seq) -> SchedulerState:
    return dataclasses.replace(state, waiting=state.waiting + (seq,))


def remove(state: SchedulerState, seq_ids) -> SchedulerState:
    """Drop finished or aborted sequences from wherever they are."""
    ids = set(seq_ids)
    return dataclasses.replace(state, waiting=tuple(s for s in state.waiting if s.seq_id not in ids),
                               running=tuple(s for s in state.running if s.seq_id not in ids))


def update(state: SchedulerState, plan: StepPlan, num_new_tokens: Mapping[str, int]) -> SchedulerState:
    """After a step: scheduled tokens are computed; the tokens the engine took from the
    results are counted (the engine holds them).

    A speculative decode row emits k + 1 tokens (k accepted drafts, one bonus) and has
    computed the KV of all but the last: the row's token before them and the k drafts.
    """
    computed = dict(plan.scheduled)

    def advance(s: Seq) -> Seq:
        if s.seq_id not in computed:
            return s
        new = num_new_tokens.get(s.seq_id, 0)
        return dataclasses.replace(s, num_computed_tokens=s.num_computed_tokens + max(computed[s.seq_id], new),
                                   num_tokens=s.num_tokens + new)
    return dataclasses.replace(state, running=tuple(advance(s) for s in state.running))


def extend(state: SchedulerState, num_forced_tokens: Mapping[str, int]) -> SchedulerState:
    """Tokens the engine appended to running sequences without computing them (a
    grammar's forced tokens, jump-forward): the next steps compute them like a chunk."""
    def grow(s: Seq) -> Seq:
        n = num_forced_tokens.get(s.seq_id, 0)
        return dataclasses.replace(s, num_tokens=s.num_tokens + n) if n else s
    return dataclasses.replace(state, running=tuple(grow(s) for s in state.running)) if num_forced_tokens else state


def fork(state: SchedulerState, parent_id: str, child: Seq) -> SchedulerState:
    """Add a running child sharing the parent's computed KV (parallel sampling); the
    parent's reservation for it passes to the child."""
    i = next(i for i, s in enumerate(state.running) if s.seq_id == parent_id)
    parent = state.running[i]
    parent = dataclasses.replace(parent, num_forks=max(parent.num_forks - 1, 0))
    return dataclasses.replace(state, running=state.running[:i] + (parent, child) + state.running[i + 1:])


def reserved_pages(seq: Seq, config: SchedulerConfig) -> int:
    """Pages a sequence holds at completion under the reserving policies
    (GUARANTEED_NO_EVICT, STATIC_BATCH): its own, plus each future fork's. A fork shares
    the prompt's pages but the last, the one holding the prompt's last position, which it
    writes first and so copies: it adds only the rest."""
    ps = config.page_size
    total = pages_for(seq.max_total_tokens + config.num_lookahead_slots, ps)
    shared = pages_for(len(seq.prompt), ps) - 1 if seq.num_forks else 0
    return total + seq.num_forks * (total - shared)


def _order_waiting(waiting: tuple[Seq, ...], order: str, cached: Mapping[str, int]) -> list[Seq]:
    if order == LPM and len(waiting) <= LPM_MAX_WAITING:
        return sorted(waiting, key=lambda s: -cached.get(s.seq_id, 0))  # stable: FCFS on ties
    return list(waiting)


def schedule(state: SchedulerState, config: SchedulerConfig, kv: KVView,
             preempt_keeps_computed: bool = False, blocked: frozenset[str] = frozenset()
             ) -> tuple[SchedulerState, StepPlan]:
    """One scheduling step over what the KV manager shows (`kv`).

    preempt_keeps_computed: preempted sequences keep num_computed_tokens (swap
    preemption); otherwise they restart from zero (recompute). blocked: sequences that
    may not compute this step: waiting ones do not start (their structured-output
    grammar is still being built, their prefix is being prefetched) and keep their place
    in the queue while the others pass them; running ones get no tokens (their loaded
    pages have not landed yet). A waiting sequence with tier pages (`kv.loading`) is
    admitted without tokens: a delayed hit, it computes from the next step on. With
    config.max_loras, a sequence whose LoRA adapter would be one too many among the
    running ones waits the same way (S-LoRA: a step holds at most max_loras adapters).
    """
    cached, num_available_pages = kv.cached, kv.num_available
    active = list(state.running)
    preempted: list[Seq] = []
    idle = {s.seq_id for s in active if s.seq_id in blocked}  # running, computing nothing this step

    # 1. Capacity for the running batch; MAX_UTILIZATION pauses the newest on a misfit.
    while True:
        tokens = _micro_batch(active, config, state.step, idle)
        if _pages_needed(active, tokens, config, kv.writable) <= num_available_pages or not active \
                or config.capacity_policy != MAX_UTILIZATION:
            break
        victim = max(active, key=lambda s: (s.started, s.arrival))
        active.remove(victim)
        preempted.append(victim)
        num_available_pages += kv.freeable.get(victim.seq_id, 0)  # its pages come back

    # 2. Admission, in queue order, while the whole batch still fits (not after a preemption).
    admitted: list[Seq] = []
    if not preempted and not (config.capacity_policy == STATIC_BATCH and active):
        for seq in _order_waiting(state.waiting, config.order, cached):
            if sum(1 + s.num_forks for s in active) + 1 + seq.num_forks > config.max_num_seqs:
                break  # its future forks count too: n samples are n sequences (as vLLM counts them)
            if seq.seq_id in blocked:
                continue
            if seq.lora_id and config.max_loras:
                adapters = {s.lora_id for s in active if s.lora_id}
                if seq.lora_id not in adapters and len(adapters) >= config.max_loras:
                    continue  # every adapter slot is taken by running sequences; it waits its turn
            hit = 0 if seq.num_computed_tokens else cached.get(seq.seq_id, 0)
            if config.order == LPM and hit <= DEFER_MAX_CACHED and any(
                    _shared_prefix(seq.prompt, a.prompt) - hit >= DEFER_MIN_SHARED for a in admitted):
                continue  # a delayed hit: next step it reuses that request's KV
            candidate = dataclasses.replace(seq, num_computed_tokens=max(seq.num_computed_tokens, hit),
                                            started=state.step)
            loads = hit > 0 and kv.loading.get(seq.seq_id, 0) > 0
            trial = active + [candidate]
            trial_idle = idle | {seq.seq_id} if loads else idle
            trial_tokens = _micro_batch(trial, config, state.step, trial_idle)
            if not (loads or trial_tokens.get(seq.seq_id)) or \
                    _pages_needed(trial, trial_tokens, config, kv.writable) > num_available_pages:
                break  # the first misfit stops admission
            active, tokens, idle = trial, trial_tokens, trial_idle
            admitted.append(candidate)

    # 3. Preempted sequences go to the front of the queue.
    back = [dataclasses.replace(s, started=-1,
                                num_computed_tokens=s.num_computed_tokens if preempt_keeps_computed else 0)
            for s in preempted]
    admitted_ids = {s.seq_id for s in admitted}
    waiting = [s for s in state.waiting if s.seq_id not in admitted_ids]
    contexts, decodes = [], []
    for s in active:
        n = tokens.get(s.seq_id)
        if n:
            (decodes if s.remaining == 1 else contexts).append((s.seq_id, n))
    new_state = SchedulerState(waiting=tuple(back + waiting), running=tuple(active), step=state.step + 1)
    plan = StepPlan(scheduled=tuple(contexts + decodes), admitted=tuple(s.seq_id for s in admitted),
                    preempted=tuple(s.seq_id for s in preempted))
    return new_state, plan


def _pages_needed(seqs: list[Seq], tokens: Mapping[str, int], config: SchedulerConfig,
                  writable: Mapping[str, int]) -> int:
    """Pages to allocate beyond what `seqs` can write already (`writable`; none for a
    sequence being admitted): to completion (GUARANTEED_NO_EVICT, STATIC_BATCH) or for
    this step's tokens only (MAX_UTILIZATION)."""
    ps = config.page_size
    need = 0
    ahead = config.num_lookahead_slots
    for s in seqs:
        if config.capacity_policy == MAX_UTILIZATION:
            step = tokens.get(s.seq_id, 0)
            n = pages_for(s.num_computed_tokens + step + (ahead if step else 0), ps)
        else:
            n = reserved_pages(s, config)
        n -= writable.get(s.seq_id, 0)
        need += n if n > 0 else 0
    return need


def _micro_batch(seqs: list[Seq], config: SchedulerConfig, step: int = 0,
                 idle: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
    """Tokens per sequence this step: decode rows first (1 each, costing
    tokens_per_decode of the budget), then prefill chunks; none for the `idle` ones.
    When the budget cannot take every decode row (large speculative trees), the rows
    taken rotate with `step` so that none starves."""
    left = config.max_num_batched_tokens
    tokens: dict[str, int] = {}
    seqs = [s for s in seqs if s.seq_id not in idle] if idle else seqs
    contexts = [s for s in seqs if s.remaining > 1]
    decodes = [s for s in seqs if s.remaining <= 1]
    fits = left // config.tokens_per_decode
    if decodes and len(decodes) > fits:
        turn = step * max(fits, 1) % len(decodes)
        decodes = decodes[turn:] + decodes[:turn]
    for seq in decodes:
        if left >= config.tokens_per_decode:
            tokens[seq.seq_id] = 1
            left -= config.tokens_per_decode
    unit = config.chunk_unit_size
    if config.chunking_policy == FIRST_COME_FIRST_SERVED or not config.enable_chunked_prefill:
        for seq in contexts:
            n = seq.remaining if seq.remaining <= left else (
                left - left % unit if config.enable_chunked_prefill else 0)
            if n > 0:
                tokens[seq.seq_id] = n
                left -= n
        return tokens
    # Equal progress: chunk_unit_size increments round-robin (a partial unit only ends a prompt).
    given = {s.seq_id: 0 for s in contexts}
    progress = True
    while left > 0 and progress:
        progress = False
        for seq in contexts:
            n = min(unit, seq.remaining - given[seq.seq_id])
            if 0 < n <= left:
                given[seq.seq_id] += n
                left -= n
                progress = True
    tokens.update({k: v for k, v in given.items() if v})
    return tokens
