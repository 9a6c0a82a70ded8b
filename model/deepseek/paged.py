"""CSA2 caches in the serving engine's page pool, and the forward pass over it.

The engine's pool for a DeepSeekConfig has two parts:

    pages (addressed by the block tables, like every other model's KV pages):
      layer i, a KV source of ratio r: cache.py's "global" rows with the sequence axis
        replaced by the page axis: {"kv": NVFP4 [P, page_size / r, ...], "index_keys":
        MXFP4 [P, page_size / r, ...]}. A page holds the compressed rows of its page_size
        positions: row j (positions [j r, (j + 1) r)) lives in page
        block_table[j r // page_size], slot (j r % page_size) / r. Other layers: {}
        (Reuse layers own no global rows).
    state (one slot per running sequence, outside the pages and the prefix cache):
      layer i: cache.py's "local" state, the FP8 window ring, window_end and the ratio-2
        compressor's pending token, [num_slots, ...].

So the pages hold exactly the model's global budget per token (config.kv_bytes_per_token,
890 B for the Flash plan) and the state the window per sequence. A page keeps the
position -> page map of every other layer: the KV manager's accounting, copy-on-write and
prefix matching see CSA2 pages as plain pages (a layout with page_size * r positions per
page would need a block table per ratio).

`forward_rows` runs the model's own layer code (model/deepseek/layers.py) on a row-padded
batch: it gathers each row's live pages into the contiguous row layout of cache.py, runs
the layers, and writes back only what the step produced (the rows its tokens complete,
and its state slots). Its result equals model.forward over the same tokens: the indexer's
top-k and candidate blocks do not depend on rows past those a query sees.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp

from model.context import ForwardContext
from model.deepseek.cache import init_layer_cache
from model.deepseek.config import DeepSeekConfig, parse_kind
from model.deepseek.layers import FROZEN_GLOBAL
from model.kv_cache import CacheLayout, gather_pages, scatter_rows, take_rows
from model.rope import rope_tables


def is_csa2(config) -> bool:
    return isinstance(config, DeepSeekConfig)


def check_page_size(config: DeepSeekConfig, page_size: int) -> None:
    """ValueError unless every compression ratio divides page_size (a page holds whole rows)."""
    for r in sorted(set(config.compress_ratios) - {0}):
        if page_size % r:
            raise ValueError(f"block_size {page_size} does not fit compression ratio {r} of {config.name}: "
                             f"a page must hold whole compressed rows (use a multiple of {r})")


def init_pool(config: DeepSeekConfig, num_pages: int, page_size: int, num_slots: int,
              kv_cache_dtype: str = "auto") -> tuple[list[dict], list[dict]]:
    """(pages, state): every layer's empty global pages [num_pages, page_size / r, ...]
    and local state [num_slots, ...] (module doc). kv_cache_dtype must be "auto": CSA2
    layers store fixed formats."""
    check_page_size(config, page_size)
    if num_pages <= 0 or num_slots <= 0:
        raise ValueError(f"num_pages and num_slots must be > 0, got {num_pages} and {num_slots}")
    # cache.py's layout with one "sequence" of page_size positions per page (or per slot)
    pages = CacheLayout(num_pages, num_pages, page_size, kv_cache_dtype)
    slots = CacheLayout(num_slots, num_slots, page_size, kv_cache_dtype)

    def build():
        return ([init_layer_cache(kind, config, pages, None)["global"] for kind in config.layer_kinds],
                [init_layer_cache(kind, config, slots, None)["local"] for kind in config.layer_kinds])
    return jax.jit(build)()  # only what is returned is allocated


def _nbytes(a) -> int:  # arrays or ShapeDtypeStructs (jax.eval_shape's)
    return math.prod(a.shape) * jnp.dtype(a.dtype).itemsize


def global_bytes_per_token(pages: list[dict], page_size: int) -> Fraction:
    """Bytes the allocated global pages hold per token position (all layers); pages may
    be ShapeDtypeStructs."""
    leaves = jax.tree.leaves(pages)
    num_pages = leaves[0].shape[0]
    return Fraction(sum(_nbytes(a) for a in leaves), num_pages * page_size)


def state_bytes_per_slot(state: list[dict]) -> int:
    """Bytes of local state one sequence slot holds (all layers)."""
    leaves = jax.tree.leaves(state)
    return sum(_nbytes(a) for a in leaves) // leaves[0].shape[0]


def _gather(pages: list[dict], state: list[dict], block_tables, slots) -> list[dict]:
    """cache.py's per-layer caches of the step's rows: their pages back to back, their state."""
    def slot(a):
        return take_rows(a, jnp.clip(slots, 0, a.shape[0] - 1))
    return [{"global": jax.tree.map(lambda a: gather_pages(a, block_tables), g), "local": jax.tree.map(slot, loc)}
            for g, loc in zip(pages, state)]


def _scatter(config: DeepSeekConfig, pages: list[dict], state: list[dict], layers: list[dict], positions,
             block_tables, slots, page_size: int) -> tuple[list[dict], list[dict]]:
    """Write back what the step changed: the rows its tokens completed, and its rows' state,
    in place when the pool is donated (kv_cache.scatter_rows: a one-row write stays a
    scatter; _gather's reads, through kv_cache.take_rows, stay gathers)."""
    num_slots = jax.tree.leaves(state)[0].shape[0]
    to_slot = jnp.where(slots >= 0, slots, num_slots)  # padding rows: dropped
    state = [jax.tree.map(lambda a, v: scatter_rows(a, to_slot, v), loc, layer["local"])
             for loc, layer in zip(state, layers)]
    out = []
    for kind, glob, layer in zip(config.layer_kinds, pages, layers):
        if not glob:
            out.append(glob)
            continue
        _, r = parse_kind(kind)
        per_page = page_size // r
        num_pages, width = jax.tree.leaves(glob)[0].shape[0], block_tables.shape[1]
        j = (positions + 1) // r - 1  # the row a token completes (when (p + 1) % r == 0)
        done = (positions >= 0) & ((positions + 1) % r == 0) & (j * r < width * page_size)
        page = jnp.take_along_axis(block_tables, jnp.clip(j * r // page_size, 0, width - 1), axis=1)
        flat = jnp.where(done, page * per_page + (j * r % page_size) // r, num_pages * per_page).reshape(-1)
        src = jnp.clip(j, 0, width * per_page - 1)

        def put(a, v):
            new = jnp.take_along_axis(v, src.reshape(src.shape + (1,) * (v.ndim - 2)), axis=1)
            table = a.reshape((num_pages * per_page,) + a.shape[2:])
            return scatter_rows(table, flat, new.reshape((-1,) + new.shape[2:])).reshape(a.shape)
        out.append(jax.tree.map(put, glob, layer["global"]))
    return out, state


def forward_rows(params: dict, config: DeepSeekConfig, tokens, positions, pages: list[dict], state: list[dict],
                 block_tables, slots, page_size: int, mesh=None, ced: bool = True, frozen: bool = False):
    """The model over a row-padded step on the paged pool (not jitted).

    tokens, positions: int32 [S, T], row s at positions p0, p0 + 1, ... then padding (< 0);
    block_tables: int32 [S, W], pages holding each row's positions [0, p_last] (W pages
    cover every position a row sees); slots: int32 [S], each row's state slot (-1 for a
    padding row). ced: run the layers the CED way (model/deepseek/ced.py: decoder layers
    only on each row's staircase tail, exact) and return only each row's last token.
    frozen: the rows' global rows are already in their pages (a prefix-cache hit, a fork):
    KV sources read them instead of writing them, and only the state is written (bounded
    replay, model/deepseek/replay.py).
    Returns (final-norm hidden: [S, H] with ced, else [S, T, H]; pages, state).
    """
    from model.deepseek.ced import ced_layers
    from model.transformer import _run_layers, embed

    layers = _gather(pages, state, block_tables, slots)
    if frozen:  # replay starts from empty rings (replay.persistent_part), whatever the slot held before
        layers = [dict(layer, local=jax.tree.map(jnp.zeros_like, layer["local"])) for layer in layers]
    ctx = ForwardContext(positions=positions, rope=rope_tables(config, positions), block_tables=block_tables,
                         slots=None, page_size=page_size, mesh=mesh, shared={FROZEN_GLOBAL: True} if frozen else {})
    x = embed(params, tokens, config)
    if ced and config.kv_sources:
        hidden, layers = ced_layers(params, config, x, layers, ctx)
    else:  # (a plan without KV sources has no decoder to cut)
        hidden, layers, _ = _run_layers(params, config, x, layers, ctx, ())
        if ced:
            last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
            hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    new_pages, state = _scatter(config, pages, state, layers, positions, block_tables, slots, page_size)
    return hidden, pages if frozen else new_pages, state
