"""Runs the model for one engine step: padded buckets, one jitted function, pool donated.

A step's rows are split into prefill chunks ([B, T] with T > 1) and decode rows
([B, 1]); each group is padded to power-of-two buckets so a warm engine never
recompiles. The KV pool (one page pool per layer) lives here and is donated to
every call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import model
from model.kv_cache import KVCache
from serving.params import MAX_LOGPROBS
from serving.sampling import row_keys, sample


@dataclasses.dataclass
class Row:
    """One sequence's work this step."""

    tokens: list[int]  # the new tokens to compute
    start: int  # position of tokens[0]
    block_table: list[int]
    sample: bool  # the chunk reaches the end of the sequence: sample a token
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    counter: int = 0  # tokens generated so far (the per-step key)
    logprobs: bool = False


@dataclasses.dataclass
class RowResult:
    token: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config", "page_size", "want_logprobs"),
                   donate_argnames=("pool",))
def _step(params, config, page_size, pool, block_tables, tokens, positions, last_index, seeds,
          counters, temperature, top_k, top_p, min_p, want_logprobs):
    cache = KVCache(pool, block_tables, page_size)
    logits, cache = model.forward(params, config, tokens, positions, cache, last_index)
    next_tokens = sample(logits, row_keys(seeds, counters), temperature, top_k, top_p, min_p)
    extra = ()
    if want_logprobs:
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        top_vals, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        chosen = jnp.take_along_axis(logprobs, next_tokens[:, None], axis=-1)[:, 0]
        extra = (chosen, top_vals, top_ids)
    return next_tokens, extra, cache.layers


@functools.partial(jax.jit, donate_argnames=("pool",))
def _copy_pages(pool, src, dst):
    return jax.tree.map(lambda a: a.at[dst].set(a[src]), pool)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write_pages(pool, pages, data):
    return jax.tree.map(lambda a, d: a.at[pages].set(d), pool, data)


class ModelRunner:
    """Owns params and the KV page pool; executes rows."""

    def __init__(self, config: model.ModelConfig, params: dict, num_pages: int, page_size: int,
                 max_pages_per_seq: int, max_num_seqs: int, dtype=jnp.float32,
                 kv_cache_dtype: str = "auto"):
        self.config, self.params = config, params
        self.page_size, self.num_pages = page_size, num_pages
        self.max_pages_per_seq, self.max_num_seqs = max_pages_per_seq, max_num_seqs
        cache = model.init_paged_cache(config, num_pages, page_size, dtype,
                                       jnp.zeros((1, max_pages_per_seq), jnp.int32), kv_cache_dtype)
        self.pool = cache.layers

    def execute(self, rows: list[Row]) -> list[RowResult | None]:
        """Compute every row; returns a result for rows with `sample`, else None."""
        results: list[RowResult | None] = [None] * len(rows)
        prefill = [i for i, r in enumerate(rows) if len(r.tokens) > 1]
        decode = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        for group in (prefill, decode):
            for i, res in zip(group, self._run_group([rows[i] for i in group])):
                results[i] = res
        return results

    def _run_group(self, rows: list[Row]) -> list[RowResult | None]:
        if not rows:
            return []
        b = bucket(len(rows))
        t = bucket(max(len(r.tokens) for r in rows), minimum=1 if all(len(r.tokens) == 1 for r in rows) else 16)
        tokens = np.zeros((b, t), np.int32)
        positions = np.full((b, t), -1, np.int32)
        tables = np.zeros((b, self.max_pages_per_seq), np.int32)
        last = np.zeros(b, np.int32)
        seeds = np.zeros(b, np.uint32)
        counters = np.zeros(b, np.uint32)
        temp, top_p, min_p = np.zeros(b, np.float32), np.ones(b, np.float32), np.zeros(b, np.float32)
        top_k = np.zeros(b, np.int32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            tokens[i, :n] = r.tokens
            positions[i, :n] = np.arange(r.start, r.start + n)
            tables[i, :len(r.block_table)] = r.block_table
            last[i] = n - 1
            seeds[i], counters[i] = r.seed & 0xFFFFFFFF, r.counter
            temp[i], top_k[i], top_p[i], min_p[i] = r.temperature, r.top_k, r.top_p, r.min_p
        want_logprobs = any(r.logprobs and r.sample for r in rows)
        next_tokens, extra, self.pool = _step(
            self.params, self.config, self.page_size, self.pool, jnp.asarray(tables),
            jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(last), jnp.asarray(seeds),
            jnp.asarray(counters), jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p),
            jnp.asarray(min_p), want_logprobs)
        next_tokens = np.asarray(next_tokens)
        extra = [np.asarray(e) for e in extra]
        out: list[RowResult | None] = []
        for i, r in enumerate(rows):
            if not r.sample:
                out.append(None)
                continue
            res = RowResult(int(next_tokens[i]))
            if r.logprobs and extra:
                chosen, top_vals, top_ids = extra
                res.logprob = float(chosen[i])
                res.top_logprobs = {int(k): float(v) for k, v in zip(top_ids[i], top_vals[i])}
            out.append(res)
        return out

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: page src -> page dst in every layer."""
        if pairs:
            src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*pairs))
            self.pool = _copy_pages(self.pool, src, dst)

    def read_pages(self, pages: list[int]):
        """Host copy of `pages` in every layer (swap out)."""
        idx = np.asarray(pages, np.int32)
        return jax.tree.map(lambda a: np.asarray(a[idx]), self.pool)

    def write_pages(self, pages: list[int], data) -> None:
        """Put host data back into `pages` (swap in)."""
        self.pool = _write_pages(self.pool, jnp.asarray(pages, jnp.int32), data)

    def num_compilations(self) -> int:
        return _step._cache_size()
