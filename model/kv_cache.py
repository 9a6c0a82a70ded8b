"""The KV cache: per-layer page pools plus the block tables that map sequences to pages.

Every attention layer stores K and V in pages of `page_size` positions:
k_pages, v_pages [num_pages, page_size, num_kv_heads, head_dim]. Sequence b's logical
page i is physical page block_tables[b, i], so position p lives in slot
block_tables[b, p // page_size] * page_size + p % page_size. A plain batch cache is
the special case of consecutive pages per sequence; the serving engine hands in its
own pool and block tables. One layout, one attention path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

DEFAULT_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What a layer kind needs to size its cache."""

    batch_size: int
    num_pages: int
    page_size: int
    kv_cache_dtype: str = "auto"  # storage format of attention pages (model/kv_formats.py)


@dataclasses.dataclass
class KVCache:
    """layers: one pytree per layer (page pools); block_tables: int32 [batch, pages_per_seq]."""

    layers: list
    block_tables: jax.Array
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.block_tables.shape[0]

    @property
    def capacity(self) -> int:
        """Positions each sequence can hold."""
        return self.block_tables.shape[1] * self.page_size


jax.tree_util.register_dataclass(KVCache, data_fields=["layers", "block_tables"],
                                 meta_fields=["page_size"])


def contiguous_block_tables(batch_size: int, pages_per_seq: int) -> jax.Array:
    """Sequence b owns pages [b * pages_per_seq, (b + 1) * pages_per_seq)."""
    return jnp.arange(batch_size * pages_per_seq, dtype=jnp.int32).reshape(batch_size, pages_per_seq)


def slot_mapping(positions: jax.Array, block_tables: jax.Array, page_size: int,
                 num_pages: int) -> jax.Array:
    """Flat slot of each token's K/V, int32 [B, T].

    Padding (position < 0), positions past the block table and block table entries
    outside [0, num_pages) map past the pool, where writes are dropped: a bad entry
    (a -1 would otherwise wrap to the last page) never writes into another sequence's page.
    """
    pages_per_seq = block_tables.shape[1]
    valid = (positions >= 0) & (positions < pages_per_seq * page_size)
    logical = jnp.clip(positions // page_size, 0, pages_per_seq - 1)
    page = jnp.take_along_axis(block_tables, logical, axis=1)
    valid &= (page >= 0) & (page < num_pages)
    return jnp.where(valid, page * page_size + positions % page_size, num_pages * page_size)


def write_pages(pages: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new [B, T, ...] into pages [N, page_size, ...] at flat slots [B, T].

    The trailing axes are anything ([H, D] for float K/V, [H] for a per-row scale).
    Slots past the pool (padding) are dropped.
    """
    n, page_size, *rest = pages.shape
    flat = pages.reshape(n * page_size, *rest)
    flat = scatter_rows(flat, slots.reshape(-1), new.reshape(-1, *rest))
    return flat.reshape(pages.shape)


def scatter_rows(pool: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    """pool.at[index].set(rows) with out-of-range indices dropped, in place when donated.

    pool [N, ...], index int [U], rows [U, ...]. XLA:CPU expands a scatter of a single
    row (a batch-1 decode step) into a dynamic-update-slice, and its fusion pass then
    duplicates that update into every reader of the new pool (the attention gather):
    the old pool must outlive the in-place update, so copy insertion copies the whole
    pool, a step cost that grows with the pool, not the batch. A second row, always
    dropped, keeps it a real scatter, done in place and never duplicated.

    Not for bfloat16 and fp8 pools: XLA:CPU computes their scatters in a wider float,
    converting the whole pool there and back, which costs more than the one copy.
    """
    rows = rows.astype(pool.dtype)
    if index.shape[0] == 1 and not _scatter_upcasts(pool.dtype):
        index = jnp.concatenate([index, jnp.full((1,), pool.shape[0], index.dtype)])
        rows = jnp.concatenate([rows, rows])
    return pool.at[index].set(rows, mode="drop")


def take_rows(pool: jax.Array, index: jax.Array) -> jax.Array:
    """pool[index] for int index of any shape (in range), kept a gather. XLA:CPU turns a
    gather of a single row into a dynamic-slice, which its fusion pass duplicates into the
    readers of the slice; when the same step writes the pool in place (scatter_rows), those
    readers of the old pool make copy insertion copy it whole. A second index, sliced off,
    keeps it a gather."""
    if index.size != 1:
        return pool[index]
    two = jnp.concatenate([index.reshape(1), index.reshape(1)])
    return pool[two][:1].reshape(index.shape + pool.shape[1:])


def _scatter_upcasts(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype) not in (
        jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Each sequence's pages in order: pages [N, rows, ...] -> [B, pages_per_seq * rows, ...]."""
    b, p = block_tables.shape
    _, rows, *rest = pages.shape
    return take_rows(pages, block_tables).reshape(b, p * rows, *rest)
