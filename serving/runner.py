"""Runs the model for one engine step: padded buckets, one jitted function, pool donated.

A step's rows — prefill chunks and decode rows alike — are packed back to back into one
`StepBatch` (flat tokens and positions, cu_q_lens, kv_lens, block tables, sampling
arrays) and run by one jitted call, `_step`, through `model.forward_packed`, whose
attention layers are pallas_kernels.ragged_paged_attention. Tokens, rows and the longest
row are padded to buckets so a warm engine never recompiles, and there are few of them
(`ModelRunner.buckets`, what `LLM(precompile=True)` compiles at start-up): a decode-only
step has one shape per power-of-two row count; a step with prefill chunks one per
power-of-two token count, times whether it holds one chunk or several, its rows always
padded to max_num_seqs. Block tables are always max_model_len wide: attention walks
only the blocks of pages its queries can see (pallas_kernels/paged_blocks.py; the
kernels stop at each sequence's kv_len), so a step costs what the sequences hold rather
than max_model_len without a shape per context length. The KV pool (one page pool per
layer) lives here and is donated to every call.

The pool is a dict of named KV groups: "target" (the model's layers) and, with an
EAGLE-3 draft (speculative decoding), "draft" (its one layer), addressed by the same
block tables, so prefix caching, copy-on-write and swapping carry the draft's KV along.
With a draft every chunk also runs the draft over its positions and grows a draft tree
from its last one; a sequence that has a tree is
verified instead of decoded: the target scores the whole tree in one pass, the
accepted nodes' KV moves into place, the draft catches up on them and grows the
next tree (EAGLE-3; serving/speculative.py). A speculative step is one call too
(`_spec_step`), whose prefill, decode and verify parts are still separate [rows, tokens]
blocks (not packed), each through the same ragged attention (verify rows and the draft's
tree growth pass their trees as ancestor bits).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.sharding import NamedSharding, PartitionSpec as P

import model
from model import eagle3
from model import lora as model_lora
from model.kv_cache import KVCache
from model.transformer import forward_hidden, lm_head
from serving.draft_tree import DraftTree, TreeSpec
from serving.engine import Row, RowResult
from serving.lora import LoRAManager
from serving.params import LoRARequest
from serving.params import MAX_LOGPROBS
from serving.sampling import apply_adjustments, apply_token_masks, processed_probs, row_keys, sample
from serving.speculative import compact_kv, grow_trees, tree_masks, verify_trees


@dataclasses.dataclass(frozen=True)
class Drafter:
    """What speculative decoding adds to a runner: the EAGLE-3 draft and its tree shape."""

    config: eagle3.Eagle3Config
    params: dict
    spec: TreeSpec


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "positions", "cu_q_lens", "kv_lens", "block_tables",
                                "logits_indices", "seeds", "counters", "temperature", "top_k",
                                "top_p", "min_p", "targets", "token_masks", "constrained",
                                "adjust_ids", "adjust_counts", "adjust_seen", "adjust_bias",
                                "penalties", "lora_slots"],
                   meta_fields=["max_q_len", "max_chunks"])
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One engine step's rows, packed back to back: what the jitted step reads.

    N is the bucketed token count, S the bucketed row count; rows past the real ones
    have no tokens (q_len 0, kv_len 0) and tokens past cu_q_lens[-1] are padding.
    """

    tokens: jax.Array  # int32 [N]: every row's new tokens, row after row
    positions: jax.Array  # int32 [N]: each token's position (-1 for padding)
    cu_q_lens: jax.Array  # int32 [S + 1]: row s owns tokens [cu_q_lens[s], cu_q_lens[s + 1])
    kv_lens: jax.Array  # int32 [S]: the row's sequence length after the step
    block_tables: jax.Array  # int32 [S, W]: pages of each row, cut to the live width
    logits_indices: jax.Array  # int32 [S]: index of each row's last token (its logits)
    seeds: jax.Array  # uint32 [S, 2]: per-sequence 64-bit sampling seed (low, high words)
    counters: jax.Array  # uint32 [S]: tokens generated so far (the per-step key)
    temperature: jax.Array  # float32 [S]; 0 = greedy
    top_k: jax.Array  # int32 [S]; 0 = off
    top_p: jax.Array  # float32 [S]; 1 = off
    min_p: jax.Array  # float32 [S]; 0 = off
    targets: jax.Array  # int32 [N]: the prompt token after each token, -1 where not a prompt token
    token_masks: jax.Array  # int32 [S, ceil(V / 32)]: structured outputs' bitmask of allowed tokens
    constrained: jax.Array  # bool [S]: rows whose token_masks apply
    # penalties and biases (sampling.apply_adjustments): per row, the tokens it adjusts,
    # K of them (K = 1 and all padding when no row adjusts; padding ids = V)
    adjust_ids: jax.Array  # int32 [S, K]
    adjust_counts: jax.Array  # int32 [S, K]: times the row generated each token
    adjust_seen: jax.Array  # bool [S, K]: the token is in the prompt or the output
    adjust_bias: jax.Array  # float32 [S, K]: logit_bias, -inf for banned tokens
    penalties: jax.Array  # float32 [S, 3]: presence, frequency, repetition
    lora_slots: jax.Array  # int32 [N]: each token's LoRA adapter slot (-1: the base model)
    max_q_len: int  # static: bucketed longest row (1 for a decode-only step)
    max_chunks: int  # static: bucketed count of rows with more than one token (0 if none)

    @property
    def layout(self) -> model.RaggedLayout:
        return model.RaggedLayout(self.cu_q_lens, self.kv_lens, None, None, None, self.max_q_len,
                                  self.max_chunks)


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


# The fewest tokens a step with a prefill chunk is padded to.
MIN_CHUNK_TOKENS = 16


@functools.partial(jax.jit, static_argnames=("config", "page_size", "want_logprobs",
                                             "want_prompt_logprobs", "mesh"),
                   donate_argnames=("pool",))
def _step(params, config, page_size, pool, batch: StepBatch, want_logprobs, want_prompt_logprobs,
          lora_stacks=None, mesh=None):
    """One engine step of prefill chunks and decode rows: (sampled [S], logprob extras,
    prompt logprob extras (per token [N]), pool). With lora_stacks (serving/lora.py), each
    token's projections add its adapter slot's term (batch.lora_slots). mesh: the params
    and pool are sharded over it (model/sharding.py); the batch is replicated."""
    if lora_stacks is not None:
        params = model_lora.attach(params, lora_stacks, batch.lora_slots)
    cache = KVCache(pool["target"], batch.block_tables, page_size)
    hidden, cache, _ = model.forward_packed(params, config, batch.tokens, batch.positions, cache,
                                            batch.layout, mesh=mesh)
    logits = lm_head(params, config, hidden[batch.logits_indices])
    keys = row_keys(batch.seeds, batch.counters)
    adjusted = apply_adjustments(logits, batch.adjust_ids, batch.adjust_counts, batch.adjust_seen,
                                 batch.adjust_bias, batch.penalties)
    allowed = apply_token_masks(adjusted, batch.token_masks, batch.constrained)
    next_tokens = sample(allowed, keys, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    extra = _logprobs(logits, next_tokens) if want_logprobs else ()
    # Only steps with a prompt_logprobs request pay for logits at every token.
    prompt_extra = (_logprobs(lm_head(params, config, hidden), jnp.maximum(batch.targets, 0))
                    if want_prompt_logprobs else ())
    if mesh is not None:  # every device (every host) holds the whole results
        next_tokens, extra, prompt_extra = jax.tree.map(
            lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P())), (next_tokens, extra, prompt_extra))
    return next_tokens, extra, prompt_extra, {"target": cache.layers}


def _logprobs(logits, tokens):
    """(logprob of tokens, top MAX_LOGPROBS values, their ids) under the raw distribution
    (before temperature and filtering, as vLLM reports them); logits [..., V], tokens [...]."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_vals, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[-1]))
    return jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0], top_vals, top_ids


def _wants_logprobs(row: Row) -> bool:
    return row.params.logprobs is not None


def _prompt_targets(row: Row) -> list[int]:
    """The prompt tokens that follow the row's tokens, one per token while they are known
    (the row's own next tokens, then row.next_token): what prompt logprobs score."""
    if row.params.prompt_logprobs is None:
        return []
    return [*row.tokens[1:], *(() if row.next_token is None else (row.next_token,))]


def _draft_tree(tree, i: int) -> DraftTree:
    """Row i of the batched (tokens, parents, scores) a step returns."""
    return DraftTree(*(a[i] for a in tree))


def _logprob_entry(extra, *index) -> tuple[float, dict[int, float]]:
    chosen, top_vals, top_ids = extra
    return float(chosen[index]), {int(k): float(v) for k, v in zip(top_ids[index], top_vals[index])}


def _draft_and_grow(draft: Drafter, pool, block_tables, page_size, features, tokens, positions,
                    root_row, root_tokens):
    """Run the draft over rows (row at position p reads target feature p and token p + 1,
    writing its K/V into the pool's draft layer), then grow a tree from row root_row [B]
    whose root token is root_tokens [B]. Returns (tree, draft layers)."""
    rows = jnp.arange(tokens.shape[0])
    logits, hidden, cache = eagle3.draft_apply(draft.params, draft.config, features, tokens, positions,
                                               KVCache(pool["draft"], block_tables, page_size))

    def draft_step(dc, hidden, tokens, slots, tree):
        return eagle3.draft_apply(draft.params, draft.config, hidden, tokens, slots, dc, tree)
    tree, cache = grow_trees(draft_step, cache, logits[rows, root_row], hidden[rows, root_row],
                             root_tokens, positions[rows, root_row], draft.params["d2t"], draft.spec)
    return tree, cache.layers


def _target(params, config, draft: Drafter, pool, block_tables, page_size, tokens, positions,
            tree=None):
    """Target forward over the pool's target layers: (hidden, fused draft features, layers)."""
    cache = KVCache(pool["target"], block_tables, page_size)
    hidden, cache, captured = forward_hidden(params, config, tokens, positions, cache,
                                             draft.config.target_layer_ids, tree)
    return hidden, eagle3.fuse_features(draft.params, jnp.concatenate(captured, -1)), cache.layers


def _chunk_part(params, config, page_size, draft: Drafter, pool, block_tables, tokens, positions,
                last_index, next_known, seeds, counters, temperature, top_k, top_p, min_p,
                token_masks, constrained, want_logprobs, want_prompt_logprobs):
    """A chunk (prefill or plain decode) plus the draft over its positions and a new tree.

    The draft's row at position p reads token p + 1: the chunk's next token, then at the
    chunk's last position `next_known` (a prompt token) or, where it is -1, the sample.
    """
    hidden, features, layers = _target(params, config, draft, pool, block_tables, page_size,
                                       tokens, positions)
    rows = jnp.arange(tokens.shape[0])
    logits = lm_head(params, config, hidden[rows, last_index])
    sampled = sample(apply_token_masks(logits, token_masks, constrained), row_keys(seeds, counters),
                     temperature, top_k, top_p, min_p)
    following = jnp.where(next_known >= 0, next_known, sampled)
    draft_tokens = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1).at[rows, last_index].set(following)
    tree, draft_layers = _draft_and_grow(draft, pool, block_tables, page_size, features, draft_tokens,
                                         positions, last_index, sampled)
    extra = _logprobs(logits, sampled) if want_logprobs else ()
    # prompt logprobs score draft_tokens (the next token at each position); the engine
    # keeps only those that are prompt tokens
    prompt_extra = (_logprobs(lm_head(params, config, hidden), draft_tokens)
                    if want_prompt_logprobs else ())
    return sampled, extra, prompt_extra, tree, {"target": layers, "draft": draft_layers}


def _verify_part(params, config, page_size, draft: Drafter, pool, block_tables, tree_tokens,
                 tree_parents, tree_scores, start, seeds, counters, temperature, top_k, top_p, min_p,
                 token_masks, constrained, want_logprobs):
    """Score each row's draft tree (root at position `start`, -1 for padding rows), accept
    a path, move its KV into place, catch the draft up and grow the next tree."""
    spec = draft.spec
    b, n = tree_tokens.shape
    rows = jnp.arange(b)[:, None]
    depth, ancestors = tree_masks(tree_parents)
    live = start[:, None] >= 0
    tree = model.TokenTree(start[:, None] + depth, start, ancestors)
    positions = jnp.where(live, start[:, None] + jnp.arange(n), -1)
    hidden, features, layers = _target(params, config, draft, pool, block_tables, page_size,
                                       tree_tokens, positions, tree)
    logits = lm_head(params, config, hidden)
    # one mask row per tree node: the grammar's state after the path to it
    probs = processed_probs(apply_token_masks(logits, token_masks, constrained), temperature, top_k, top_p,
                            min_p)
    path, count, bonus = verify_trees(probs, tree_tokens, tree_parents, tree_scores,
                                      row_keys(seeds, counters), spec)
    layers = compact_kv(layers, block_tables, page_size, start, path, count)
    # The draft catches up on the root and the accepted nodes (row i reads token i + 1).
    steps = jnp.arange(spec.depth + 1)[None]
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1)
    accepted = tree_tokens[rows, path]
    # emitted tokens: the accepted drafts, then the bonus (row i of the draft reads token i + 1)
    draft_tokens = jnp.where(steps < count[:, None], jnp.pad(accepted, ((0, 0), (0, 1))), bonus[:, None])
    draft_positions = jnp.where(live & (steps <= count[:, None]), start[:, None] + steps, -1)
    new_tree, draft_layers = _draft_and_grow(draft, pool, block_tables, page_size, features[rows, nodes],
                                             draft_tokens, draft_positions, count, bonus)
    extra = _logprobs(logits[rows, nodes], draft_tokens) if want_logprobs else ()
    return accepted, count, bonus, extra, new_tree, {"target": layers, "draft": draft_layers}


@functools.partial(jax.jit, static_argnames=("config", "page_size", "draft_config", "spec",
                                             "want_logprobs", "prompt_logprobs_parts"),
                   donate_argnames=("pool",))
def _spec_step(params, config, page_size, draft_params, draft_config, spec, pool, parts,
               want_logprobs, prompt_logprobs_parts):
    """One speculative engine step, one device call: parts maps "prefill", "decode" and
    "verify" (each present only when the step has such rows) to their padded inputs;
    the parts named in prompt_logprobs_parts also score their prompt tokens. Returns ({part: results without the pool}, pool)."""
    draft = Drafter(draft_config, draft_params, spec)
    results = {}
    for name in ("prefill", "decode", "verify"):
        if name in parts:
            if name == "verify":  # a verify row holds no prompt tokens
                *results[name], pool = _verify_part(params, config, page_size, draft, pool, *parts[name],
                                                    want_logprobs)
            else:
                *results[name], pool = _chunk_part(params, config, page_size, draft, pool, *parts[name],
                                                   want_logprobs, name in prompt_logprobs_parts)
    return results, pool


@functools.partial(jax.jit, donate_argnames=("pool",))
def _copy_pages(pool, src, dst):
    return jax.tree.map(lambda a: a.at[dst].set(a[src]), pool)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write_pages(pool, pages, data):
    return jax.tree.map(lambda a, d: a.at[pages].set(d), pool, data)


@jax.jit
def _read_pages(pool, pages):
    return jax.tree.map(lambda a: a[pages], pool)


def _padded(ids) -> np.ndarray:
    """Page ids as int32, padded to a power of two by repeating the first (a page copied or
    written twice gets the same value twice), so copies and swaps compile once per bucket."""
    ids = list(ids)
    return np.asarray(ids + ids[:1] * (bucket(len(ids)) - len(ids)), np.int32)


class ModelRunner:
    """Owns params and the KV page pool; executes rows."""

    def __init__(self, config: model.ModelConfig, params: dict, num_pages: int, page_size: int,
                 max_pages_per_seq: int, max_num_seqs: int, dtype=jnp.float32,
                 kv_cache_dtype: str = "auto", draft: Drafter | None = None, lora: LoRAManager | None = None,
                 mesh=None):
        """mesh: a tensor-parallel mesh (model.make_mesh) that `params` are sharded over
        (model.shard_params, whose config this takes); the pool is split by KV heads."""
        if lora is not None and draft is not None:
            raise ValueError("LoRA adapters are not supported with speculative decoding yet")
        if mesh is not None and (lora is not None or draft is not None):
            raise ValueError("LoRA adapters and speculative decoding are not sharded yet: "
                             "use them with tensor_parallel_size=1")
        self.config, self.params, self.draft, self.lora, self.mesh = config, params, draft, lora, mesh
        self.page_size, self.num_pages = page_size, num_pages
        self.max_pages_per_seq, self.max_num_seqs = max_pages_per_seq, max_num_seqs
        self.mask_words = -(-config.vocab_size // 32)
        self.pool = {"target": model.init_kv_pool(config, num_pages, page_size, dtype, kv_cache_dtype,
                                                  mesh=mesh)}
        if draft is not None:
            self.pool["draft"] = model.init_kv_pool(draft.config.layer_config, num_pages, page_size, dtype,
                                                    kv_cache_dtype)

    def execute(self, rows: list[Row]) -> list[RowResult | None]:
        """Compute every row; returns a result for rows with `sample`, else None."""
        results: list[RowResult | None] = [None] * len(rows)
        if not rows:
            return results
        if self.draft is None:  # one packed call for every row
            return self._run_packed(rows)
        groups = {"prefill": [i for i, r in enumerate(rows) if r.tree is None and len(r.tokens) > 1],
                  "decode": [i for i, r in enumerate(rows) if r.tree is None and len(r.tokens) == 1],
                  "verify": [i for i, r in enumerate(rows) if r.tree is not None]}
        groups = {name: [rows[i] for i in idx] for name, idx in groups.items() if idx}
        parts = {name: (self._verify_inputs(g) if name == "verify" else self._chunk_inputs(g))
                 for name, g in groups.items()}
        want_logprobs = any(_wants_logprobs(r) for r in rows)
        prompt_parts = tuple(name for name, g in groups.items() if any(_prompt_targets(r) for r in g))
        out, self.pool = _spec_step(self.params, self.config, self.page_size, self.draft.params,
                                    self.draft.config, self.draft.spec, self.pool, parts, want_logprobs,
                                    prompt_parts)
        by_row = {}
        for name, group in groups.items():
            done = self._verify_results if name == "verify" else self._chunk_results
            for r, res in zip(group, done(group, [jax.tree.map(np.asarray, x) for x in out[name]])):
                by_row[id(r)] = res
        return [by_row[id(r)] for r in rows]

    def _sampling_arrays(self, rows: list[Row], b: int) -> list[jax.Array]:
        """seeds, counters, temperature, top_k, top_p, min_p for `rows` padded to b."""
        seeds, counters = np.zeros((b, 2), np.uint32), np.zeros(b, np.uint32)
        temp, top_p, min_p = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.float32)
        top_k = np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            p = r.params
            seeds[i], counters[i] = (r.seed & 0xFFFFFFFF, (r.seed >> 32) & 0xFFFFFFFF), r.counter
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        return [jnp.asarray(a) for a in (seeds, counters, temp, top_k, top_p, min_p)]

    def _mask_arrays(self, rows: list[Row], b: int, per_row: tuple[int, ...] = ()) -> list[jax.Array]:
        """token_masks int32 [b, *per_row, words] and constrained bool [b] for `rows`
        padded to b (structured outputs; all zero when no row is constrained)."""
        masks = np.zeros((b, *per_row, self.mask_words), np.int32)
        constrained = np.zeros(b, bool)
        for i, r in enumerate(rows):
            if r.token_mask is not None:
                masks[i], constrained[i] = r.token_mask, True
        return [jnp.asarray(masks), jnp.asarray(constrained)]

    def _adjust_arrays(self, rows: list[Row], b: int) -> list[jax.Array]:
        """adjust_ids, adjust_counts, adjust_seen, adjust_bias [b, K] and penalties [b, 3]
        for `rows` padded to b (Row.adjust; K a power of two >= 16, or 1 when no row
        adjusts, so plain batches keep one shape)."""
        k = max((len(r.adjust[0]) for r in rows if r.adjust is not None), default=0)
        k = bucket(k, 16) if k else 1
        ids = np.full((b, k), self.config.vocab_size, np.int32)
        counts, seen = np.zeros((b, k), np.int32), np.zeros((b, k), bool)
        bias, penalties = np.zeros((b, k), np.float32), np.tile(np.float32([0, 0, 1]), (b, 1))
        for i, r in enumerate(rows):
            if r.adjust is not None:
                n = len(r.adjust[0])
                ids[i, :n], counts[i, :n], seen[i, :n], bias[i, :n] = r.adjust
                p = r.params
                penalties[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        return [jnp.asarray(a) for a in (ids, counts, seen, bias, penalties)]

    def _tables(self, rows: list[Row], b: int) -> jax.Array:
        """Block tables [b, max_pages_per_seq] (attention reads only the live pages)."""
        tables = np.zeros((b, self.max_pages_per_seq), np.int32)
        for i, r in enumerate(rows):
            n = min(self.max_pages_per_seq, len(r.block_table))
            tables[i, :n] = r.block_table[:n]
        return jnp.asarray(tables)

    def _verify_inputs(self, rows: list[Row]) -> tuple:
        b, n = bucket(len(rows)), self.draft.spec.num_tokens
        trees = [np.zeros((b, n), dt) for dt in (np.int32, np.int32, np.float32)]
        trees[1][:] = np.arange(n) - 1  # padding rows: a chain, never used
        start = np.full(b, -1, np.int32)
        for i, r in enumerate(rows):
            trees[0][i], trees[1][i], trees[2][i] = r.tree.tokens, r.tree.parents, r.tree.scores
            start[i] = r.start
        return (self._tables(rows, b), *map(jnp.asarray, trees), jnp.asarray(start),
                *self._sampling_arrays(rows, b), *self._mask_arrays(rows, b, (n,)))

    def _verify_results(self, rows: list[Row], out) -> list[RowResult]:
        accepted, count, bonus, extra, tree = out
        results = []
        for i, r in enumerate(rows):
            entries = None
            if _wants_logprobs(r):
                entries = tuple(_logprob_entry(extra, i, j) for j in range(count[i] + 1))
            results.append(RowResult((*accepted[i, :count[i]].tolist(), int(bonus[i])), entries,
                                     _draft_tree(tree, i)))
        return results

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check a LoRA adapter (ValueError: no LoRA in this runner, a bad adapter)."""
        if self.lora is None:
            raise ValueError("a LoRA request needs an engine with LoRA enabled (LLM(enable_lora=True))")
        self.lora.add(request)

    def step_batch(self, rows: list[Row], lora_slot: dict[int, int] | None = None) -> StepBatch:
        """Pack rows (none with a tree) into a StepBatch of the shape `shape` gives them.
        lora_slot: device slot of each LoRA adapter id the rows use."""
        lens = [len(r.tokens) for r in rows]
        n, s, max_q_len, max_chunks = self.shape(lens)
        tokens, positions = np.zeros(n, np.int32), np.full(n, -1, np.int32)
        cu_q_lens, kv_lens = np.zeros(s + 1, np.int32), np.zeros(s, np.int32)
        for i, r in enumerate(rows):
            start, end = cu_q_lens[i], cu_q_lens[i] + len(r.tokens)
            tokens[start:end] = r.tokens
            positions[start:end] = np.arange(r.start, r.start + len(r.tokens))
            kv_lens[i] = r.start + len(r.tokens)
            cu_q_lens[i + 1:] = end
        targets, lora_slots = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
        for i, r in enumerate(rows):
            following = _prompt_targets(r)
            targets[cu_q_lens[i]:cu_q_lens[i] + len(following)] = following
            if r.lora:
                lora_slots[cu_q_lens[i]:cu_q_lens[i + 1]] = lora_slot[r.lora]
        seeds, counters, temperature, top_k, top_p, min_p = self._sampling_arrays(rows, s)
        return StepBatch(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(cu_q_lens),
                         jnp.asarray(kv_lens), self._tables(rows, s),
                         jnp.asarray(np.maximum(cu_q_lens[1:] - 1, 0)), seeds, counters, temperature,
                         top_k, top_p, min_p, jnp.asarray(targets), *self._mask_arrays(rows, s),
                         *self._adjust_arrays(rows, s), jnp.asarray(lora_slots), max_q_len=max_q_len,
                         max_chunks=max_chunks)

    def shape(self, lens: list[int]) -> tuple[int, int, int, int]:
        """(tokens N, rows S, max_q_len, max_chunks) of a packed step whose rows bring
        `lens` new tokens each. Decode-only: N = S = rows to a power of two, max_q_len 1.
        With a chunk: N = tokens to a power of two (at least MIN_CHUNK_TOKENS), S = max_num_seqs
        to a power of two, max_q_len = N (a bound: the XLA path tiles chunks 16 tokens at a
        time whatever it is), max_chunks 1 or S. So the shapes are few (`buckets`), at the
        price of spare rows (sampled for nothing) and spare chunk tiles in some steps."""
        if max(lens) == 1:
            s = bucket(len(lens))
            return s, s, 1, 0
        n = bucket(sum(lens), MIN_CHUNK_TOKENS)
        s = bucket(max(len(lens), self.max_num_seqs))
        return n, s, n, 1 if sum(k > 1 for k in lens) == 1 else s

    def buckets(self, max_num_batched_tokens: int) -> dict[tuple[int, int, int, int], list[int]]:
        """Every (N, S, max_q_len, max_chunks) `shape` gives a step of at most max_num_seqs
        rows and max_num_batched_tokens tokens, each with the row lengths of one such step."""
        decode = {self.shape([1] * k): [1] * k for k in range(1, self.max_num_seqs + 1)}
        chunked = {}
        for n in range(MIN_CHUNK_TOKENS.bit_length() - 1,
                       max(bucket(max_num_batched_tokens), MIN_CHUNK_TOKENS).bit_length()):
            lens = [1 << n]
            chunked[self.shape(lens)] = lens  # one chunk
            if self.max_num_seqs > 1:
                chunked[self.shape([2, lens[0] - 2])] = [2, lens[0] - 2]  # several chunks
        return {**dict(sorted(decode.items())), **dict(sorted(chunked.items()))}

    def precompile(self, max_num_batched_tokens: int, swap: bool = False,
                   progress: bool = True) -> list[tuple[tuple, float]]:
        """Compile every step shape this runner can meet (`buckets`, ahead of time: nothing
        runs), then the page copies of copy-on-write for up to max_num_seqs pairs and, with
        swap, the page reads and writes of swapping for up to every page; returns each step
        bucket with its seconds. Steps asking for logprobs, prompt logprobs or penalties
        are variants compiled on first use."""
        if self.draft is not None:
            raise ValueError("precompile does not cover speculative decoding yet")
        times = []
        shapes = self.buckets(max_num_batched_tokens)
        bar = tqdm.tqdm(shapes.items(), desc="compiling steps", unit="shape", disable=not progress)
        for (n, s, max_q_len, max_chunks), lens in bar:
            batch = self.step_batch([Row(tuple([0] * k), 0, (0,), sample=True) for k in lens], {})
            start = time.perf_counter()  # compiled ahead of time: the first real call reuses it
            _step.lower(self.params, self.config, self.page_size, self.pool, batch, False, False,
                        self.lora.stacks if self.lora else None, self.mesh).compile()
            times.append(((n, s, max_q_len, max_chunks), time.perf_counter() - start))
            if progress:
                kind = "decode" if max_q_len == 1 else "one chunk" if max_chunks == 1 else "several chunks"
                bar.write(f"  step of {n} tokens, {s} rows, {kind}: {times[-1][1]:.1f} s")
        for k in range(bucket(self.max_num_seqs).bit_length()):  # pairs (0 -> 0): a no-op copy
            self.copy_pages([(0, 0)] * (1 << k))
        for k in range(bucket(self.num_pages).bit_length() if swap else 0):
            self.write_pages([0] * (1 << k), self.read_pages([0] * (1 << k)))
        return times

    def _run_packed(self, rows: list[Row]) -> list[RowResult | None]:
        if not rows:
            return []
        want_logprobs = any(_wants_logprobs(r) and r.sample for r in rows)
        lora_slot = self.lora.slots_for({r.lora for r in rows if r.lora}) if self.lora else None
        batch = self.step_batch(rows, lora_slot)
        next_tokens, extra, prompt_extra, self.pool = _step(
            self.params, self.config, self.page_size, self.pool, batch, want_logprobs,
            any(_prompt_targets(r) for r in rows), self.lora.stacks if self.lora else None, self.mesh)
        starts = np.asarray(batch.cu_q_lens)[:-1]
        return self._results(rows, np.asarray(next_tokens), [np.asarray(e) for e in extra],
                             prompt_extra=[np.asarray(e) for e in prompt_extra],
                             prompt_index=lambda i, j: (starts[i] + j,))

    def _results(self, rows: list[Row], next_tokens, extra, tree=None, prompt_extra=(),
                 prompt_index=None) -> list[RowResult | None]:
        """Row results: sampled rows always; a prompt chunk only when it carries prompt
        logprobs (prompt_index(i, j): where row i's token j is in prompt_extra)."""
        out: list[RowResult | None] = []
        for i, r in enumerate(rows):
            prompt = None
            if prompt_extra and (targets := _prompt_targets(r)):
                prompt = tuple(_logprob_entry(prompt_extra, *prompt_index(i, j)) for j in range(len(targets)))
            if not r.sample:
                out.append(None if prompt is None else RowResult((), prompt_logprobs=prompt))
                continue
            entries = (_logprob_entry(extra, i),) if _wants_logprobs(r) and extra else None
            out.append(RowResult((int(next_tokens[i]),), entries, _draft_tree(tree, i) if tree else None,
                                 prompt))
        return out

    def _chunk_inputs(self, rows: list[Row]) -> tuple:
        """Prefill chunks or decode rows of a speculative runner as [b, t] arrays."""
        b = bucket(len(rows))
        t = bucket(max(len(r.tokens) for r in rows), minimum=1 if all(len(r.tokens) == 1 for r in rows) else 16)
        tokens = np.zeros((b, t), np.int32)
        positions = np.full((b, t), -1, np.int32)
        last = np.zeros(b, np.int32)
        next_known = np.full(b, -1, np.int32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            tokens[i, :n] = r.tokens
            positions[i, :n] = np.arange(r.start, r.start + n)
            last[i] = n - 1
            if not r.sample and r.next_token is not None:
                next_known[i] = r.next_token
        return (self._tables(rows, b), jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(last),
                jnp.asarray(next_known), *self._sampling_arrays(rows, b), *self._mask_arrays(rows, b))

    def _chunk_results(self, rows: list[Row], out) -> list[RowResult | None]:
        next_tokens, extra, prompt_extra, tree = out
        return self._results(rows, next_tokens, extra, tree, prompt_extra, lambda i, j: (i, j))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: page src -> page dst in every layer."""
        if pairs:
            src, dst = (jnp.asarray(_padded(x)) for x in zip(*pairs))
            self.pool = _copy_pages(self.pool, src, dst)

    def read_pages(self, pages: list[int]):
        """Host copy of `pages` in every layer (swap out)."""
        data = _read_pages(self.pool, jnp.asarray(_padded(pages)))
        return jax.tree.map(lambda a: np.asarray(a)[:len(pages)], data)

    def write_pages(self, pages: list[int], data) -> None:
        """Put host data back into `pages` (swap in)."""
        pad = bucket(len(pages)) - len(pages)
        data = jax.tree.map(lambda d: np.concatenate([d, np.repeat(d[:1], pad, axis=0)]), data)
        self.pool = _write_pages(self.pool, jnp.asarray(_padded(pages)), data)

    def num_compilations(self) -> int:
        return _step._cache_size() + _spec_step._cache_size()
