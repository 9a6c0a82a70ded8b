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
layer) lives here and is donated to every call. With num_scheduler_steps > 1, a step whose
rows are all plain decode rows runs that many decode steps in one call, `_decode_steps`
(a loop over `_step`'s computation feeding each step's tokens to the next).

The pool is a dict of named KV groups: "target" (the model's layers) and, with an
EAGLE-3 draft (speculative decoding), "draft" (its one layer), addressed by the same
block tables, so prefix caching, copy-on-write and swapping carry the draft's KV along.
With a draft every chunk also runs the draft over its positions and grows a draft tree
from its last one; a sequence that has a tree is verified instead of decoded: the target
scores the whole tree in one pass, the accepted nodes' KV moves into place, the draft
catches up on them and grows the next tree (EAGLE-3; serving/speculative.py). A
speculative step is the same packed StepBatch plus a TreeBatch: a verify row owns its
tree's n nodes as packed tokens (ancestor bits given as data, inside the kernel), and
one call, `_spec_step`, runs the target over every row, the draft over the same packed
tokens and the tree growth; its shapes are as few (a step without chunks has S * n
tokens), so `LLM(precompile=True)` covers speculative engines too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import typing
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.sharding import NamedSharding, PartitionSpec as P

import model
from model import eagle3
from model import lora as model_lora
from model.deepseek import paged as paged_csa2
from model.kv_cache import KVCache
from model.transformer import lm_head
from pallas_kernels.paged_attention.kv_formats import from_bits, to_bits
from pallas_kernels.tree_mask import TreeMask, pack_mask
from serving.draft_tree import DraftTree, TreeSpec
from serving.engine import MIN_CHUNK_TOKENS, Row, RowResult, bucket
from serving.lora import LoRAManager
from serving.params import LoRARequest
from serving.params import MAX_LOGPROBS
from serving.sampling import apply_adjustments, apply_token_masks, processed_probs, row_keys, sample
from serving.speculative import compact_kv, grow_trees, tree_masks, verify_trees


# How a CSA2 sequence's window rings are rebuilt over cached pages (ModelRunner.replay_len).
EXACT_REPLAY, BOUNDED_REPLAY = "exact", "bounded"
WINDOW_REPLAYS = (EXACT_REPLAY, BOUNDED_REPLAY)


@dataclasses.dataclass(frozen=True)
class Drafter:
    """What speculative decoding adds to a runner: the EAGLE-3 draft and its tree shape."""

    config: eagle3.Eagle3Config
    params: dict
    spec: TreeSpec


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["start", "parents", "scores", "node_masks", "next_known"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TreeBatch:
    """What speculative decoding adds to a StepBatch. A verify row owns n packed tokens,
    its draft tree's nodes in order (node 0, the root, first), at KV slots start ..
    start + n - 1 (StepBatch.positions holds those slots; node j is rotated to position
    start + depth(j) and sees its ancestors only, from the parents, inside the kernel)."""

    start: jax.Array  # int32 [S]: each verify row's root slot, -1 for rows without a tree
    parents: jax.Array  # int32 [S, n]: each node's parent (-1 for the root)
    scores: jax.Array  # float32 [S, n]: the draft's path scores (sampled verification reads them)
    node_masks: jax.Array  # int32 [S, n, ceil(V / 32)]: structured outputs' mask after each node's path
    next_known: jax.Array  # int32 [S]: the prompt token after a chunk that does not sample (-1: sampled)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "positions", "cu_q_lens", "kv_lens", "block_tables",
                                "logits_indices", "seeds", "counters", "temperature", "top_k",
                                "top_p", "min_p", "targets", "token_masks", "constrained",
                                "adjust_ids", "adjust_counts", "adjust_seen", "adjust_bias",
                                "penalties", "lora_slots", "state_slots", "tree"],
                   meta_fields=["max_q_len", "max_chunks"])
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One engine step's rows, packed back to back: what the jitted step reads.

    N is the bucketed token count, S the bucketed row count; rows past the real ones
    have no tokens (q_len 0, kv_len 0) and tokens past cu_q_lens[-1] are padding.
    `shape` gives (N, S, max_q_len, max_chunks). `ModelRunner.step_batch` fills the fields
    with numpy arrays, which the jitted step's dispatch moves to the device (jax.Array
    inside the step).
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
    state_slots: jax.Array  # int32 [S]: each row's state slot (Row.slot; -1 for padding rows)
    max_q_len: int  # static: bucketed longest row (1 for a decode-only step)
    max_chunks: int  # static: bucketed count of rows with more than one token (0 if none)
    tree: TreeBatch | None = None  # speculative decoding's verify rows and draft inputs

    @property
    def layout(self) -> model.RaggedLayout:
        return model.RaggedLayout(self.cu_q_lens, self.kv_lens, None, None, None, self.max_q_len,
                                  self.max_chunks)


class StepShape(typing.NamedTuple):
    """What a step compiles for (ModelRunner.shape): tokens N, rows S and the static
    max_q_len and max_chunks."""

    tokens: int
    rows: int
    max_q_len: int
    max_chunks: int




def _forward_step(params, config, page_size, pool, batch: StepBatch, want_logprobs, want_prompt_logprobs,
                  lora_stacks=None, mesh=None, frozen=False, rope=None):
    """One engine step of prefill chunks and decode rows: (sampled [S], logprob extras,
    prompt logprob extras (per token [N]), pool). With lora_stacks (serving/lora.py), each
    token's projections add its adapter slot's term (batch.lora_slots). mesh: the params
    and pool are sharded over it (model/sharding.py); the batch is replicated. frozen (CSA2
    models): the rows only rebuild their state slots over pages already written
    (ModelRunner.restore_state). rope: model.packed_rope of batch.positions, when the
    caller made them (other models than CSA2)."""
    if lora_stacks is not None:
        params = model_lora.attach(params, lora_stacks, batch.lora_slots)
    if paged_csa2.is_csa2(config):
        last, hidden, pool = _csa2_forward(params, config, page_size, pool, batch, mesh, want_prompt_logprobs,
                                           frozen)
    else:
        cache = KVCache(pool["target"], batch.block_tables, page_size)
        hidden, cache, _ = model.forward_packed(params, config, batch.tokens, batch.positions, cache,
                                                batch.layout, mesh=mesh, rope=rope)
        last, pool = hidden[batch.logits_indices], {"target": cache.layers}
    logits = lm_head(params, config, last)
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
    return next_tokens, extra, prompt_extra, pool


_step = jax.jit(_forward_step, static_argnames=("config", "page_size", "want_logprobs", "want_prompt_logprobs",
                                                "mesh", "frozen"), donate_argnames=("pool",))


@functools.partial(jax.jit, static_argnames=("config", "page_size", "steps"), donate_argnames=("pool",))
def _decode_steps(params, config, page_size, pool, batch: StepBatch, steps: int):
    """`steps` decode steps of a decode-only batch in one call (ModelRunner's
    num_scheduler_steps): each step is `_step`'s, its sampled tokens the next step's input
    one position on, each row's sampling counter one further. Returns (tokens [steps, S],
    pool). Rows stay padding where they were (position -1)."""
    live = batch.positions >= 0  # [N] = [S]: one token per row
    # Every step's RoPE tables, made here once: inside the loop XLA would evaluate them again
    # in each layer's rotation (model.packed_rope).
    ropes = None if paged_csa2.is_csa2(config) else jax.vmap(
        lambda i: model.packed_rope(config, jnp.where(live, batch.positions + i, -1)))(jnp.arange(steps))

    def one(i, carry):
        pool, batch, out = carry
        rope = None if ropes is None else jax.tree.map(lambda t: t[i], ropes)
        tokens, _, _, pool = _forward_step(params, config, page_size, pool, batch, False, False, rope=rope)
        batch = dataclasses.replace(batch, tokens=jnp.where(live, tokens, 0),
                                    positions=jnp.where(live, batch.positions + 1, -1),
                                    kv_lens=jnp.where(live, batch.kv_lens + 1, 0), counters=batch.counters + 1)
        return pool, batch, out.at[i].set(tokens)

    out = jnp.zeros((steps, batch.kv_lens.shape[0]), jnp.int32)
    pool, _, out = jax.lax.fori_loop(0, steps, one, (pool, batch, out))
    return out, pool


def _csa2_forward(params, config, page_size, pool, batch: StepBatch, mesh, every_token: bool, frozen: bool):
    """A DeepSeek-V4.1 (CSA2) step through model.deepseek.paged.forward_rows on the paged
    pool and the rows' state slots, the CED way unless every token's hidden state is wanted
    (prompt logprobs). The packed rows run in passes of rows padded to a common length (the
    longest row alone, the next two at half its bucket, ...; rows of one token together),
    not all S rows padded to the longest. Returns (hidden at each row's last token [S, H],
    hidden [N, H] in packed order or None, pool)."""
    starts, q_lens = batch.cu_q_lens[:-1], batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    num_rows = q_lens.shape[0]
    pages, state = pool["target"], pool["state"]

    def run(rows, width, pages, state):
        """Rows `rows` int32 [R] (-1: none) over their first `width` tokens: (hidden, pages, state)."""
        col = jnp.arange(width)
        r = jnp.maximum(rows, 0)
        valid = (rows[:, None] >= 0) & (col[None] < q_lens[r][:, None])
        index = jnp.minimum(starts[r][:, None] + col[None], batch.tokens.shape[0] - 1)
        return paged_csa2.forward_rows(params, config, jnp.where(valid, batch.tokens[index], 0),
                                       jnp.where(valid, batch.positions[index], -1), pages, state,
                                       batch.block_tables[r], jnp.where(rows >= 0, batch.state_slots[r], -1),
                                       page_size, mesh, ced=not every_token, frozen=frozen)
    # Rows ranked by length: the rank-i row holds at most max_q_len / (i + 1) tokens (they
    # share the step's max_q_len), so pass k runs ranks [2^k - 1, 2^(k+1) - 1) at width
    # max_q_len / 2^k: each pass holds max_q_len token slots, and the rest run at width 1.
    passes, first = 0, 0  # passes of chunks; the first rank left to the width-1 pass
    while first < min(batch.max_chunks, num_rows) and batch.max_q_len >> passes > 1:
        passes, first = passes + 1, 2 * first + 1
    order = jnp.argsort(-q_lens, stable=True).astype(jnp.int32)
    out = jnp.zeros((num_rows,) + ((batch.max_q_len,) if every_token else ()) + (config.hidden_size,),
                    params["final_norm"].dtype)
    for k in range(passes + 1):
        ranks = np.arange((1 << k) - 1, min((1 << (k + 1)) - 1, num_rows) if k < passes else num_rows)
        if not len(ranks):
            continue
        hidden, pages, state = run(order[ranks], 1 if k == passes else batch.max_q_len >> k, pages, state)
        if every_token:  # [R, width, H] into [R, max_q_len, H]
            hidden = jnp.pad(hidden, ((0, 0), (0, batch.max_q_len - hidden.shape[1]), (0, 0)))
        out = out.at[order[ranks]].set(hidden.astype(out.dtype))
    hidden = out
    pool = {"target": pages, "state": state}
    if not every_token:
        return hidden, None, pool
    token = jnp.arange(batch.tokens.shape[0])
    row = jnp.clip(jnp.searchsorted(batch.cu_q_lens, token, side="right") - 1, 0, num_rows - 1)
    packed = hidden[row, jnp.clip(token - starts[row], 0, batch.max_q_len - 1)]
    last = jnp.take_along_axis(hidden, jnp.maximum(q_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    return last, packed, pool


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


@functools.partial(jax.jit, static_argnames=("config", "page_size", "draft_config", "spec",
                                             "want_logprobs", "want_prompt_logprobs"),
                   donate_argnames=("pool",))
def _spec_step(params, config, page_size, draft_params, draft_config, spec, pool, batch: StepBatch,
               want_logprobs, want_prompt_logprobs):
    """One speculative engine step over a packed StepBatch with a TreeBatch: prefill
    chunks, decode rows and verify rows (a draft tree's n nodes each) in one target pass.

    Chunk and decode rows sample after their last token, as `_step`; verify rows score
    their trees (ancestor bits, inside the attention kernel), accept a path and move its
    K/V into place. One draft pass over the same packed tokens then catches the draft up
    (a token at position p reads target feature p and the token at p + 1: a chunk's own
    next token, then the sample; a verify row's root and accepted nodes, then the bonus,
    at offsets 0 .. accepted), and a tree grows from each row's last real token. A verify
    row's draft offsets past the accepted ones write K/V past the sequence's end, where
    nothing reads before it is rewritten (like rejected branches).
    Returns (sampled [S], logprob extras, prompt logprob extras, (accepted [S, depth],
    count [S], bonus [S], their logprob extras [S, depth + 1]), next trees, pool)."""
    draft, tb = Drafter(draft_config, draft_params, spec), batch.tree
    num_tokens, s = batch.tokens.shape[0], batch.kv_lens.shape[0]
    rows = jnp.arange(s)
    verify = tb.start >= 0
    # node j of verify row s is packed token cu_q_lens[s] + j (num_tokens: not a node)
    node_index = jnp.minimum(batch.cu_q_lens[:-1, None] + jnp.arange(spec.num_tokens), num_tokens - 1)
    scatter_to = jnp.where(verify[:, None], node_index, num_tokens)
    depth, ancestors = tree_masks(tb.parents)
    bits = jnp.zeros((num_tokens, -(-spec.num_tokens // 32)), jnp.int32).at[scatter_to].set(
        pack_mask(ancestors), mode="drop")
    rope_positions = batch.positions.at[scatter_to].set(tb.start[:, None] + depth, mode="drop")
    tree = TreeMask(jnp.where(verify, tb.start, batch.kv_lens), bits)
    layout = dataclasses.replace(batch.layout, tree=tree)
    hidden, cache, captured = model.forward_packed(
        params, config, batch.tokens, rope_positions, KVCache(pool["target"], batch.block_tables, page_size),
        layout, draft.config.target_layer_ids)
    features = eagle3.fuse_features(draft.params, jnp.concatenate(captured, -1))
    layers = cache.layers

    logits = lm_head(params, config, hidden[batch.logits_indices])
    keys = row_keys(batch.seeds, batch.counters)
    sampled = sample(apply_token_masks(logits, batch.token_masks, batch.constrained), keys,
                     batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    extra = _logprobs(logits, sampled) if want_logprobs else ()
    prompt_extra = (_logprobs(lm_head(params, config, hidden), jnp.maximum(batch.targets, 0))
                    if want_prompt_logprobs else ())
    # the draft reads, at each packed token, the token that follows it
    row_of = jnp.clip(jnp.searchsorted(batch.cu_q_lens, jnp.arange(num_tokens), side="right") - 1, 0, s - 1)
    last = jnp.arange(num_tokens) == batch.cu_q_lens[row_of + 1] - 1
    following = jnp.where(tb.next_known >= 0, tb.next_known, sampled)
    draft_tokens = jnp.where(last, following[row_of], jnp.roll(batch.tokens, -1))
    # verify rows score their trees (every step does, even without any: S * n logits rows
    # for nothing then, the price of one shape per bucket instead of two)
    node_tokens = batch.tokens[node_index]
    node_logits = lm_head(params, config, hidden[node_index])
    # one mask row per tree node: the grammar's state after the path to it
    probs = processed_probs(apply_token_masks(node_logits, tb.node_masks, batch.constrained),
                            batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    path, count, bonus = verify_trees(probs, node_tokens, tb.parents, tb.scores, keys, spec)
    layers = compact_kv(layers, batch.block_tables, page_size, tb.start, path, count)
    # the draft catches up on the root and the accepted nodes, then reads the bonus
    steps = jnp.arange(spec.depth + 1)[None]
    nodes = jnp.concatenate([jnp.zeros((s, 1), jnp.int32), path], axis=1)
    accepted = node_tokens[rows[:, None], path]
    catch_up = jnp.where(steps < count[:, None], jnp.pad(accepted, ((0, 0), (0, 1))), bonus[:, None])
    to = scatter_to[:, :spec.depth + 1]
    draft_tokens = draft_tokens.at[to].set(catch_up, mode="drop")
    features = features.at[to].set(features[node_index[rows[:, None], nodes]], mode="drop")
    root_index = jnp.where(verify, batch.cu_q_lens[:-1] + count, batch.logits_indices)
    root_tokens = jnp.where(verify, bonus, sampled)
    verified = (accepted, count, bonus,
                _logprobs(node_logits[rows[:, None], nodes], catch_up) if want_logprobs else ())
    draft_layout = dataclasses.replace(batch.layout, tree=None)
    _, dhidden, dcache = eagle3.draft_apply(draft.params, draft.config, features, draft_tokens, batch.positions,
                                            KVCache(pool["draft"], batch.block_tables, page_size), layout=draft_layout)

    live = batch.cu_q_lens[1:] > batch.cu_q_lens[:-1]

    def draft_step(dc, hidden, tokens, slots, tree):
        return eagle3.draft_apply(draft.params, draft.config, hidden, tokens, slots, dc, tree)
    # draft logits at the roots only (the pass's logits at every token go unused: XLA drops them)
    root_logits = eagle3.draft_logits(draft.params, draft.config, dhidden[root_index])
    next_trees, dcache = grow_trees(draft_step, dcache, root_logits, dhidden[root_index], root_tokens,
                                    jnp.where(live, batch.positions[root_index], -1), draft.params["d2t"], spec)
    return sampled, extra, prompt_extra, verified, next_trees, {"target": layers, "draft": dcache.layers}


@functools.partial(jax.jit, donate_argnames=("pool",))
def _copy_pages(pool, src, dst):
    def copy(a):  # as bits, like _write_pages
        bits = to_bits(a)
        return from_bits(bits.at[dst].set(bits[src]), a.dtype)
    return jax.tree.map(copy, pool)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write_pages(pool, pages, data):
    # Leaves move as their bits (kv_formats.to_bits): byte-exact, bfloat16 NaN payloads too.
    return jax.tree.map(lambda a, d: from_bits(to_bits(a).at[pages].set(to_bits(d.astype(a.dtype))), a.dtype),
                        pool, data)


@jax.jit
def _read_pages(pool, pages):
    return jax.tree.map(lambda a: from_bits(to_bits(a)[pages], a.dtype), pool)


def _rows_of(pool, pages):
    """Each of `pages` as one uint8 row: every pool leaf's bytes of that page, in leaf
    order (serving.kv_tiers.PageCodec's row, built on the device)."""
    n = pages.shape[0]
    rows = jnp.concatenate([jax.lax.bitcast_convert_type(to_bits(a)[pages], jnp.uint8).reshape(n, -1)
                            for a in jax.tree.leaves(pool)], axis=1)
    return tuple(rows[i] for i in range(n))


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write_rows(pool, pages, rows):
    """Unpack `_rows_of`'s rows on the device and write them into `pages`."""
    rows = jnp.stack(rows)
    leaves, treedef = jax.tree.flatten(pool)
    out, offset = [], 0
    for a in leaves:
        shape, width = a.shape[1:], a.dtype.itemsize
        size = math.prod(shape) * width
        part = rows[:, offset:offset + size].reshape((rows.shape[0],) + shape + ((width,) if width > 1 else ()))
        bits = to_bits(a)
        out.append(from_bits(bits.at[pages].set(jax.lax.bitcast_convert_type(part, bits.dtype)), a.dtype))
        offset += size
    return jax.tree.unflatten(treedef, out)


def _padded(ids) -> np.ndarray:
    """Page ids as int32, padded to a power of two by repeating the first (a page copied or
    written twice gets the same value twice), so copies and swaps compile once per bucket."""
    ids = list(ids)
    return np.asarray(ids + ids[:1] * (bucket(len(ids)) - len(ids)), np.int32)


@dataclasses.dataclass(frozen=True)
class _Uploaded:
    """Page data on its way to the device, padded to its bucket (ModelRunner.upload_pages,
    or upload_rows: then `arrays` is a tuple of page rows)."""

    arrays: object
    rows: bool = False


class ModelRunner:
    """Owns params and the KV page pool; executes rows."""

    def __init__(self, config: model.ModelConfig, params: dict, num_pages: int, page_size: int,
                 max_pages_per_seq: int, max_num_seqs: int, dtype=jnp.float32,
                 kv_cache_dtype: str = "auto", draft: Drafter | None = None, lora: LoRAManager | None = None,
                 mesh=None, window_replay: str = EXACT_REPLAY, num_scheduler_steps: int = 1):
        """mesh: a tensor-parallel mesh (model.make_mesh) that `params` are sharded over
        (model.shard_params, whose config this takes); the pool is split by KV heads.
        window_replay (CSA2 models): how many tokens restore_state replays, `replay_len`.
        num_scheduler_steps: decode steps a call runs when every row is a plain decode row
        (`multi_step`); the engine must hold num_scheduler_steps - 1 lookahead slots."""
        if window_replay not in WINDOW_REPLAYS:
            raise ValueError(f"window_replay must be one of {WINDOW_REPLAYS}, got {window_replay!r}")
        if not isinstance(num_scheduler_steps, int) or num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an int >= 1, got {num_scheduler_steps!r}")
        if num_scheduler_steps > 1 and (draft is not None or mesh is not None or paged_csa2.is_csa2(config)):
            raise ValueError("num_scheduler_steps > 1 is not supported with speculative decoding, sharding "
                             "or CSA2 models yet")
        self.window_replay, self.num_scheduler_steps = window_replay, num_scheduler_steps
        if lora is not None and draft is not None:
            raise ValueError("LoRA adapters are not supported with speculative decoding yet")
        if mesh is not None and (lora is not None or draft is not None):
            raise ValueError("LoRA adapters and speculative decoding are not sharded yet: "
                             "use them with tensor_parallel_size=1")
        self.config, self.params, self.draft, self.lora, self.mesh = config, params, draft, lora, mesh
        self.page_size, self.num_pages = page_size, num_pages
        self.max_pages_per_seq, self.max_num_seqs = max_pages_per_seq, max_num_seqs
        self.mask_words = -(-config.vocab_size // 32)
        self.csa2 = paged_csa2.is_csa2(config)
        # per-sequence state outside the pages (CSA2's window rings): one slot per running sequence
        self.state = None
        if self.csa2:
            if draft is not None or lora is not None or mesh is not None:
                raise ValueError(f"{config.name} (CSA2 attention) is served without speculative decoding, "
                                 "LoRA adapters or sharding yet")
            pages, self.state = paged_csa2.init_pool(config, num_pages, page_size, max_num_seqs, kv_cache_dtype)
            self.pool = {"target": pages}
        else:
            self.pool = {"target": model.init_kv_pool(config, num_pages, page_size, dtype, kv_cache_dtype,
                                                      mesh=mesh)}
        if draft is not None:
            self.pool["draft"] = model.init_kv_pool(draft.config.layer_config, num_pages, page_size, dtype,
                                                    kv_cache_dtype)
        self._read_rows = None  # read_rows' jitted gather (its outputs in host_memory)

    def execute(self, rows: list[Row]) -> list[RowResult | None]:
        """Compute every row in one packed call; returns a result for rows with `sample`
        (and for prompt chunks that carry prompt logprobs), else None."""
        if not rows:
            return []
        if self.multi_step(rows):
            batch = self.step_batch(rows)
            tokens, self.pool = _decode_steps(self.params, self.config, self.page_size, self.pool, batch,
                                              self.num_scheduler_steps)
            tokens = np.asarray(tokens)
            return [RowResult(tuple(tokens[:, i].tolist())) for i in range(len(rows))]
        want_logprobs = any(_wants_logprobs(r) and r.sample for r in rows)
        want_prompt_logprobs = any(_prompt_targets(r) for r in rows)
        if self.draft is not None:
            batch = self.step_batch(rows)
            *out, self.pool = _spec_step(self.params, self.config, self.page_size, self.draft.params,
                                         self.draft.config, self.draft.spec, self.pool, batch, want_logprobs,
                                         want_prompt_logprobs)
        else:
            lora_slot = self.lora.slots_for({r.lora for r in rows if r.lora}) if self.lora else None
            batch = self.step_batch(rows, lora_slot)
            *out, pool = _step(self.params, self.config, self.page_size, self._step_pool(), batch, want_logprobs,
                               want_prompt_logprobs, self.lora.stacks if self.lora else None, self.mesh)
            self._keep(pool)
        return self._results(rows, np.asarray(batch.cu_q_lens)[:-1], *jax.tree.map(np.asarray, out))

    def multi_step(self, rows: list[Row]) -> bool:
        """Whether `execute` runs num_scheduler_steps decode steps for these rows in one call
        (vLLM's multi-step scheduling: one dispatch and one host round trip for several
        tokens): every row a plain decode row, one token sampled with nothing that the host
        changes from token to token (no logprobs, penalties, logit bias, bad words,
        min_tokens still pending, structured output, LoRA adapter). Each row then gets its
        next num_scheduler_steps tokens, sampled exactly as single steps would sample them;
        the engine keeps those before a stop."""
        return self.num_scheduler_steps > 1 and all(
            len(r.tokens) == 1 and r.sample and r.tree is None and r.token_mask is None and r.adjust is None
            and not r.params.bad_words and not r.lora and not _wants_logprobs(r) and not _prompt_targets(r)
            for r in rows)

    def replay_len(self, cached: int) -> int:
        """Tokens before position `cached` that restore_state replays to rebuild a CSA2
        sequence's window rings: "bounded" the window (DeepSeek's bounded replay: the
        first layer exact, deeper ones approximate), "exact" the receptive field
        num_layers * (W - 1) + 1 (model/deepseek/replay.py), both at most `cached`."""
        w = self.config.window
        return min(cached, w if self.window_replay == BOUNDED_REPLAY else self.config.num_layers * (w - 1) + 1)

    def restore_state(self, rows: list[Row]) -> None:
        """Rebuild the state slots of CSA2 rows whose pages already hold their global rows
        (a prefix-cache hit, a fork): each row replays its tokens with the pages frozen."""
        if rows:
            batch = self.step_batch(rows)
            *_, pool = _step(self.params, self.config, self.page_size, self._step_pool(), batch, False, False,
                             None, self.mesh, frozen=True)
            self._keep(pool)

    def _step_pool(self) -> dict:
        """What `_step` takes and returns (donated): the pages, and the state slots of a CSA2 model."""
        return self.pool if self.state is None else {**self.pool, "state": self.state}

    def _keep(self, pool: dict) -> None:
        """Take back what `_step` returned: `_step_pool`'s parts."""
        self.state = pool.pop("state", None)
        self.pool = pool

    def _sampling_arrays(self, rows: list[Row], b: int) -> list[np.ndarray]:
        """seeds, counters, temperature, top_k, top_p, min_p for `rows` padded to b."""
        seeds, counters = np.zeros((b, 2), np.uint32), np.zeros(b, np.uint32)
        temp, top_p, min_p = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.float32)
        top_k = np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            p = r.params
            seeds[i], counters[i] = (r.seed & 0xFFFFFFFF, (r.seed >> 32) & 0xFFFFFFFF), r.counter
            temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        return [seeds, counters, temp, top_k, top_p, min_p]

    def _mask_arrays(self, rows: list[Row], b: int, trees: bool = False) -> np.ndarray:
        """token_masks int32 [b, words] for `rows` padded to b (structured outputs; zero for
        unconstrained rows); with trees, the verify rows' masks per node [b, n, words]
        (TreeBatch.node_masks) instead."""
        per_row = (self.draft.spec.num_tokens,) if trees else ()
        masks = np.zeros((b, *per_row, self.mask_words), np.int32)
        for i, r in enumerate(rows):
            if r.token_mask is not None and (r.tree is not None) == trees:
                masks[i] = r.token_mask
        return masks

    def _adjust_arrays(self, rows: list[Row], b: int) -> list[np.ndarray]:
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
        return [ids, counts, seen, bias, penalties]

    def _tables(self, rows: list[Row], b: int) -> np.ndarray:
        """Block tables [b, width]: max_pages_per_seq wide (attention reads only the live
        pages), or for a CSA2 model `table_width` (its step gathers every page of the table)."""
        width = self.table_width([r.start + self._q_len(r) for r in rows]) if self.csa2 else self.max_pages_per_seq
        tables = np.zeros((b, width), np.int32)
        for i, r in enumerate(rows):
            n = min(width, len(r.block_table))
            tables[i, :n] = r.block_table[:n]
        return tables

    def _table_widths(self) -> list[int]:
        """Every width table_width gives."""
        return sorted({min(1 << k, self.max_pages_per_seq) for k in range(bucket(self.max_pages_per_seq).bit_length())})

    def table_width(self, kv_lens: list[int]) -> int:
        """A CSA2 step's block table width: the pages of its longest row, to a power of two
        (at most max_pages_per_seq), so its cost follows the live context with few shapes."""
        pages = max(-(-n // self.page_size) for n in kv_lens)
        return min(bucket(pages), self.max_pages_per_seq)

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check a LoRA adapter (ValueError: no LoRA in this runner, a bad adapter)."""
        if self.lora is None:
            raise ValueError("a LoRA request needs an engine with LoRA enabled (LLM(enable_lora=True))")
        self.lora.add(request)

    def _q_len(self, row: Row) -> int:
        """The packed tokens a row owns: its new tokens, or its draft tree's nodes."""
        return len(row.tokens) if row.tree is None else self.draft.spec.num_tokens

    def step_batch(self, rows: list[Row], lora_slot: dict[int, int] | None = None) -> StepBatch:
        """Pack rows into a StepBatch of the shape `shape` gives them (with a draft, a
        TreeBatch too). lora_slot: device slot of each LoRA adapter id the rows use."""
        lens = [self._q_len(r) for r in rows]
        if self.csa2 and (len({r.slot for r in rows}) != len(rows)
                          or not all(0 <= r.slot < self.max_num_seqs for r in rows)):
            raise ValueError(f"rows of a CSA2 model need distinct state slots in [0, {self.max_num_seqs}), "
                             f"got {[r.slot for r in rows]}")
        n, s, max_q_len, max_chunks = self.shape(lens, sum(r.tree is not None for r in rows))
        tokens, positions = np.zeros(n, np.int32), np.full(n, -1, np.int32)
        cu_q_lens, kv_lens = np.zeros(s + 1, np.int32), np.zeros(s, np.int32)
        targets, lora_slots = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
        for i, (r, q_len) in enumerate(zip(rows, lens)):
            start, end = cu_q_lens[i], cu_q_lens[i] + q_len
            tokens[start:end] = r.tokens if r.tree is None else r.tree.tokens
            positions[start:end] = np.arange(r.start, r.start + q_len)  # a tree's nodes: their slots
            kv_lens[i] = r.start + q_len
            cu_q_lens[i + 1:] = end
            if r.tree is None:
                following = _prompt_targets(r)
                targets[start:start + len(following)] = following
            if r.lora:
                lora_slots[start:end] = lora_slot[r.lora]
        tree = None
        if self.draft is not None:
            width = self.draft.spec.num_tokens
            start, next_known = np.full(s, -1, np.int32), np.full(s, -1, np.int32)
            parents, scores = np.tile(np.arange(width, dtype=np.int32) - 1, (s, 1)), np.zeros((s, width), np.float32)
            for i, r in enumerate(rows):
                if r.tree is not None:
                    start[i], parents[i], scores[i] = r.start, r.tree.parents, r.tree.scores
                elif not r.sample and r.next_token is not None:
                    next_known[i] = r.next_token
            node_masks = self._mask_arrays(rows, s, trees=True)
            tree = TreeBatch(start, parents, scores, node_masks, next_known)
        seeds, counters, temperature, top_k, top_p, min_p = self._sampling_arrays(rows, s)
        token_masks = self._mask_arrays(rows, s)
        constrained = np.asarray([r.token_mask is not None for r in rows] + [False] * (s - len(rows)))
        # numpy fields, which the jitted step's C++ dispatch transfers: an asarray per field
        # cost about 1 ms a step (21 Python dispatches), a twentieth of a batch-1 decode step
        # on this project's CPU.
        return StepBatch(tokens, positions, cu_q_lens, kv_lens, self._tables(rows, s),
                         np.maximum(cu_q_lens[1:] - 1, 0), seeds, counters, temperature,
                         top_k, top_p, min_p, targets, token_masks, constrained,
                         *self._adjust_arrays(rows, s), lora_slots,
                         np.asarray([r.slot for r in rows] + [-1] * (s - len(rows)), np.int32), max_q_len=max_q_len,
                         max_chunks=max_chunks, tree=tree)

    def shape(self, lens: list[int], trees: int = 0) -> StepShape:
        """The StepShape of a packed step whose rows own `lens` tokens each (a verify row:
        its tree's n nodes), `trees` of them verify rows.

        Without chunks (rows of one token, or verify rows): S = rows to a power of two and
        N = S (S * n with a draft). With a chunk: N = tokens to a power of two (at least
        MIN_CHUNK_TOKENS), S = max_num_seqs to a power of two, max_q_len = N (a bound: the
        XLA path tiles chunks 16 tokens at a time whatever it is), max_chunks 1 or S. So
        the shapes are few (`buckets`), at the price of spare rows (sampled for nothing)
        and spare chunk tiles in some steps."""
        chunks = sum(k > 1 for k in lens) - trees
        if chunks == 0:
            s = bucket(len(lens))
            if self.draft is None:
                return StepShape(s, s, 1, 0)
            return StepShape(s * self.draft.spec.num_tokens, s, self.draft.spec.num_tokens, s)
        n = bucket(sum(lens), MIN_CHUNK_TOKENS)
        s = bucket(max(len(lens), self.max_num_seqs))
        return StepShape(n, s, n, 1 if chunks + trees == 1 else s)

    def buckets(self, max_num_batched_tokens: int) -> dict[StepShape, tuple[list[int], int]]:
        """Every StepShape `shape` gives a step of at most max_num_seqs rows and
        max_num_batched_tokens tokens, each with the (lens, trees) of one such step (its
        first `trees` rows verify rows)."""
        width = 1 if self.draft is None else self.draft.spec.num_tokens
        rows = {self.shape([width] * k, k if width > 1 else 0): ([width] * k, k if width > 1 else 0)
                for k in range(1, self.max_num_seqs + 1)}
        chunked = {}
        for n in range(MIN_CHUNK_TOKENS.bit_length() - 1,
                       max(bucket(max_num_batched_tokens), MIN_CHUNK_TOKENS).bit_length()):
            examples = [([1 << n], 0)]  # one chunk
            if self.max_num_seqs > 1:
                examples.append(([2, (1 << n) - 2], 0))  # several chunks (or a chunk and verify rows)
            chunked.update((self.shape(*e), e) for e in examples)
        return {**dict(sorted(rows.items())), **dict(sorted(chunked.items()))}

    def precompile(self, max_num_batched_tokens: int, swap: bool = False,
                   progress: bool = True) -> list[tuple[StepShape, float]]:
        """Compile every step shape this runner can meet (`buckets`, ahead of time: nothing
        runs), then the page copies of copy-on-write for up to max_num_seqs pairs and, with
        swap, the page reads and writes of swapping for up to every page; returns each step
        bucket with its seconds (a CSA2 model's: each at every block table width). Steps
        asking for logprobs, prompt logprobs or penalties, and a CSA2 model's state
        restores (restore_state), are variants compiled on first use."""
        times = []
        shapes = self.buckets(max_num_batched_tokens)
        bar = tqdm.tqdm(shapes.items(), desc="compiling steps", unit="shape", disable=not progress)
        for shape, (lens, trees) in bar:
            tree = None if self.draft is None else DraftTree(
                np.zeros(self.draft.spec.num_tokens, np.int32), np.arange(self.draft.spec.num_tokens) - 1,
                np.zeros(self.draft.spec.num_tokens, np.float32))
            # a CSA2 step also has a shape per block table width: rows as long as each width holds
            widths = [w for w in self._table_widths() if max(lens) <= w * self.page_size] if self.csa2 else [1]
            for width in widths:
                kv_len = width * self.page_size if self.csa2 else 0
                batch = self.step_batch([Row(tuple([0] * (1 if i < trees else k)), max(kv_len - k, 0), (0,) * width,
                                             sample=True, tree=tree if i < trees else None, slot=i)
                                         for i, k in enumerate(lens)], {})
                start = time.perf_counter()  # compiled ahead of time: the first real call reuses it
                if self.draft is None:
                    _step.lower(self.params, self.config, self.page_size, self._step_pool(), batch, False, False,
                                self.lora.stacks if self.lora else None, self.mesh).compile()
                    if self.num_scheduler_steps > 1 and shape.max_q_len == 1:  # its multi-step call too
                        _decode_steps.lower(self.params, self.config, self.page_size, self.pool, batch,
                                            self.num_scheduler_steps).compile()
                else:
                    _spec_step.lower(self.params, self.config, self.page_size, self.draft.params,
                                     self.draft.config, self.draft.spec, self.pool, batch, False, False).compile()
                times.append((shape, time.perf_counter() - start))
                if progress:
                    kind = ("verify" if trees else "decode" if shape.max_q_len == 1
                            else "one chunk" if shape.max_chunks == 1 else "several chunks")
                    pages = f", {width} pages" if self.csa2 else ""
                    bar.write(f"  step of {shape.tokens} tokens, {shape.rows} rows{pages}, {kind}: "
                              f"{times[-1][1]:.1f} s")
        for k in range(bucket(self.max_num_seqs).bit_length()):  # pairs (0 -> 0): a no-op copy
            self.copy_pages([(0, 0)] * (1 << k))
        for k in range(bucket(self.num_pages).bit_length() if swap else 0):
            self.write_pages([0] * (1 << k), self.read_pages([0] * (1 << k)))
        return times

    def _results(self, rows: list[Row], starts, sampled, extra, prompt_extra, verified=None,
                 trees=None) -> list[RowResult | None]:
        """Row results: sampled rows always; a prompt chunk only when it carries prompt
        logprobs (row i's token j is packed token starts[i] + j). A verify row emits its
        accepted drafts and the bonus token (verified, from `_spec_step`); with a draft
        every sampled row also carries its next tree."""
        out: list[RowResult | None] = []
        for i, r in enumerate(rows):
            tree = _draft_tree(trees, i) if trees is not None else None
            if r.tree is not None:
                accepted, count, bonus, node_extra = verified
                entries = None
                if _wants_logprobs(r):
                    entries = tuple(_logprob_entry(node_extra, i, j) for j in range(count[i] + 1))
                out.append(RowResult((*accepted[i, :count[i]].tolist(), int(bonus[i])), entries, tree))
                continue
            prompt = None
            if prompt_extra and (targets := _prompt_targets(r)):
                prompt = tuple(_logprob_entry(prompt_extra, starts[i] + j) for j in range(len(targets)))
            if not r.sample:
                out.append(None if prompt is None else RowResult((), prompt_logprobs=prompt))
                continue
            entries = (_logprob_entry(extra, i),) if _wants_logprobs(r) and extra else None
            out.append(RowResult((int(sampled[i]),), entries, tree, prompt))
        return out

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: page src -> page dst in every layer."""
        if pairs:
            src, dst = (jnp.asarray(_padded(x)) for x in zip(*pairs))
            self.pool = _copy_pages(self.pool, src, dst)

    def read_pages(self, pages: list[int], wait: bool = True):
        """Host copy of `pages` in every layer (swap out, tier copies); wait=False starts
        the copy and returns a function that waits for it (later writes to the pool do
        not change what it returns)."""
        data = _read_pages(self.pool, jnp.asarray(_padded(pages)))
        fetch = lambda: jax.tree.map(lambda a: np.asarray(a)[:len(pages)], data)
        if wait:
            return fetch()
        for leaf in jax.tree.leaves(data):
            leaf.copy_to_host_async()
        return fetch

    def upload_pages(self, data) -> _Uploaded:
        """Start moving host page data ([n, ...] leaves) to the device, padded to its bucket
        as write_pages pads the pages; safe on another thread (the pool is not touched)."""
        n = len(jax.tree.leaves(data)[0])
        pad = bucket(n) - n
        return _Uploaded(jax.device_put(jax.tree.map(
            lambda d: np.concatenate([d, np.repeat(d[:1], pad, axis=0)]), data)))

    def write_pages(self, pages: list[int], data) -> None:
        """Put page data into `pages` (swap in, tier loads): host data, or upload_pages' or
        upload_rows' result."""
        if not isinstance(data, _Uploaded):
            data = self.upload_pages(data)
        write = _write_rows if data.rows else _write_pages
        self.pool = write(self.pool, jnp.asarray(_padded(pages)), data.arrays)

    def take_pages(self, pages: list[int]):
        """A device copy of `pages` in every layer (leaves [bucket(n), ...], page-first,
        padded by repeating the first page), for another engine (serving/kv_transfer.py):
        later writes to the pool do not change it."""
        return _read_pages(self.pool, jnp.asarray(_padded(pages)))

    def page_specs(self, num_pages: int):
        """What take_pages returns for num_pages pages, as ShapeDtypeStructs placed like
        this pool (a receiver pulls into these)."""
        leaves, treedef = jax.tree.flatten(self.pool)
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct((bucket(num_pages),) + a.shape[1:], a.dtype,
                                                                 sharding=a.sharding) for a in leaves])

    def put_pages(self, pages: list[int], data, start: int = 0) -> None:
        """Write rows [start, start + len(pages)) of device page data (take_pages' form)
        into `pages`."""
        rows = jnp.asarray(_padded(range(start, start + len(pages))))
        self.pool = _write_pages(self.pool, jnp.asarray(_padded(pages)), jax.tree.map(lambda a: a[rows], data))

    @functools.cached_property
    def host_memory(self) -> jax.sharding.Sharding | None:
        """Where page rows can live in host memory the device copies to directly: the
        backend's `pinned_host` memory kind, or None (no such memory kind, or a pool split
        over a mesh, whose rows would be gathered from several devices)."""
        device = jax.tree.leaves(self.pool)[0].sharding
        if self.mesh is not None or not isinstance(device, jax.sharding.SingleDeviceSharding):
            return None
        (dev,) = device.device_set
        if "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
            return None
        return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    def read_rows(self, pages: list[int]) -> list[jax.Array]:
        """`pages` as page-first rows in host_memory (serving.kv_tiers.PageCodec's rows, one
        array a page), packed on the device and copied down asynchronously: later writes
        to the pool do not change them."""
        if self._read_rows is None:
            self._read_rows = jax.jit(_rows_of, out_shardings=self.host_memory)
        return list(self._read_rows(self.pool, jnp.asarray(_padded(pages)))[:len(pages)])

    def upload_rows(self, rows: Sequence[jax.Array]) -> _Uploaded:
        """Start moving read_rows' rows (from host_memory) to the device, padded to their
        bucket, for write_pages; safe on another thread (the pool is not touched)."""
        rows = list(rows) + [rows[0]] * (bucket(len(rows)) - len(rows))
        return _Uploaded(tuple(jax.device_put(rows, jax.tree.leaves(self.pool)[0].sharding)), rows=True)

    def num_compilations(self) -> int:
        return _step._cache_size() + _spec_step._cache_size()
