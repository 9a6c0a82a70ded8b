"""Causal Encoder-Decoder (CED) prefill, and its FLOP ratio to the plain prefill.

Layers before the last KV source (Flash: 0-19) are the encoder and run over every prompt
token; so does the last KV source's compressor, the decoder's only global KV. Past it,
decoder layers own nothing but window KV, so they only run on each sequence's tail.

How long a tail is exact: the last token reads the last decoder layer's window, W rows;
each of those reads the previous layer's window, so the k-th decoder layer from the end
needs k (W - 1) + 1 rows of input. `staircase=True` (the default) runs decoder layer
L + i on the last (n_dec - i)(W - 1) + 1 rows and reproduces the full prefill's logits and
every global KV row. `staircase=False` runs every decoder layer on the last W rows only,
the literal "decoder over the last 128 tokens": cheaper by a rounding error for long
prompts, but across more than one decoder layer it truncates windows the way bounded
replay does, so it is an approximation (measured by `python -m model.deepseek.ced`).

    python -m model.deepseek.ced --preset deepseek-v4.1-tiny --prompt-len 512
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from model.context import ForwardContext
from model.deepseek.config import DeepSeekConfig, preset
from model.deepseek.layers import PER_QUERY, attention_and_mlp, compress_and_publish
from model.kv_cache import KVCache, slot_mapping
from model.layers import rms_norm
from model.rope import rope_tables
from model.transformer import LAYER_KINDS, forward, lm_head


def context(config, positions, cache: KVCache, shared: dict | None = None) -> ForwardContext:
    """The ForwardContext model.forward_hidden builds (CSA2 layers read positions and shared)."""
    num_pages = cache.block_tables.size
    return ForwardContext(positions=positions, rope=rope_tables(config, positions),
                          block_tables=cache.block_tables,
                          slots=slot_mapping(positions, cache.block_tables, cache.page_size, num_pages),
                          page_size=cache.page_size, shared=dict(shared or {}))


def decoder_rows(config: DeepSeekConfig, staircase: bool = True) -> list[int]:
    """Rows each decoder layer (last KV source onwards) runs on during CED prefill."""
    n_dec, w = config.num_layers - config.last_kv_source, config.window
    return [(n_dec - i) * (w - 1) + 1 if staircase else w for i in range(n_dec)]


def _tail(x, ctx: ForwardContext, rows: int):
    """Keep each sequence's last `rows` valid tokens of x [B, T, H] and of ctx's per-token state."""
    n_valid = jnp.sum(ctx.positions >= 0, axis=1)
    idx = jnp.maximum(n_valid - rows, 0)[:, None] + jnp.arange(rows)  # < T since rows <= T

    def take(a):
        return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)

    shared = {k: ({n: (take(a) if n in PER_QUERY and a is not None else a) for n, a in v.items()}
                  if isinstance(v, dict) else v) for k, v in ctx.shared.items()}
    ctx = dataclasses.replace(ctx, positions=take(ctx.positions), rope=tuple(take(a) for a in ctx.rope),
                              slots=None if ctx.slots is None else take(ctx.slots), shared=shared)
    return take(x), ctx


def _check(config, tokens, positions, cache):
    if not isinstance(config, DeepSeekConfig):
        raise ValueError(f"CED prefill needs a DeepSeekConfig, got {type(config).__name__}")
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"tokens and positions must both be [batch, seq], got {tokens.shape} and "
                         f"{positions.shape}")
    if len(cache.layers) != config.num_layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, config has {config.num_layers}")


@functools.partial(jax.jit, static_argnames=("config", "staircase"), donate_argnames=("cache",))
def ced_prefill(params: dict, config: DeepSeekConfig, tokens, positions, cache: KVCache,
                staircase: bool = True):
    """Prefill a prompt the CED way: (logits of each sequence's last token f32 [B, V], cache).

    tokens, positions: int32 [B, T], positions 0..n-1 then padding (< 0); cache: fresh
    (donated). Fills the same cache as model.forward over the whole prompt: every global
    row, and window rings holding each layer's last W positions.
    """
    _check(config, tokens, positions, cache)
    hidden, layers = ced_layers(params, config, params["embed"][tokens], list(cache.layers),
                                context(config, positions, cache), staircase)
    return lm_head(params, config, hidden), KVCache(layers, cache.block_tables, cache.page_size)


def ced_layers(params: dict, config: DeepSeekConfig, x, layers: list, ctx: ForwardContext, staircase: bool = True):
    """Every layer over x [B, T, H] the CED way: (final-norm hidden of each row's last
    valid token [B, H], new layer caches). The serving engine's prefill steps run this too
    (model.deepseek.paged.forward_rows)."""
    layers, last = list(layers), config.last_kv_source
    for i in range(last):
        kind = config.layer_kinds[i]
        x, layers[i], ctx = LAYER_KINDS[kind].apply(params["layers"][i], config, x, layers[i], ctx)
    kind = config.layer_kinds[last]
    layers[last], ctx = compress_and_publish(kind, params["layers"][last], config, x, layers[last], ctx)
    for i, rows in zip(range(last, config.num_layers), decoder_rows(config, staircase)):
        if rows < x.shape[1]:
            x, ctx = _tail(x, ctx, rows)
        kind = config.layer_kinds[i]
        if i == last:
            x, layers[i], ctx = attention_and_mlp(kind, params["layers"][i], config, x, layers[i], ctx)
        else:
            x, layers[i], ctx = LAYER_KINDS[kind].apply(params["layers"][i], config, x, layers[i], ctx)
    last_row = jnp.maximum(jnp.sum(ctx.positions >= 0, axis=1) - 1, 0)
    hidden = jnp.take_along_axis(x, last_row[:, None, None], axis=1)[:, 0]
    return rms_norm(hidden, params["final_norm"], config.rms_norm_eps), layers


def full_prefill(params, config, tokens, positions, cache):
    """The reference: model.forward over every token, logits at each sequence's last token."""
    last_row = jnp.sum(positions >= 0, axis=1) - 1
    return forward(params, config, tokens, positions, cache, logits_indices=last_row)


def prefill_flops(config: DeepSeekConfig, batch: int, prompt_len: int, staircase: bool = True
                  ) -> tuple[float, float]:
    """(full prefill FLOPs, CED prefill FLOPs) from XLA's cost analysis of the compiled steps.

    Only shapes are used (jax.eval_shape): no weights are materialized.
    """
    import model

    params = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
    cache = jax.eval_shape(lambda: model.init_cache(config, batch, prompt_len))
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)

    def flops(fn, **static):
        lowered = jax.jit(fn, static_argnames=("config",) + tuple(static)).lower(
            params, config, tokens, tokens, cache, **static)
        return float(lowered.compile().cost_analysis()["flops"])

    full = flops(lambda p, config, t, pos, c: full_prefill(p, config, t, pos, c)[0])
    ced = flops(lambda p, config, t, pos, c, staircase: ced_prefill(p, config, t, pos, c, staircase)[0],
                staircase=staircase)
    return full, ced


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="deepseek-v4.1-tiny")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        config = preset(args.preset)
    except ValueError as e:
        parser.error(str(e))
    print(f"{config.name}: prompt {args.prompt_len} tokens x batch {args.batch}, window {config.window}, "
          f"encoder layers 0-{config.last_kv_source - 1}, decoder {config.last_kv_source}-{config.num_layers - 1}")
    print(f"  staircase decoder rows: {decoder_rows(config)}")
    full, ced = prefill_flops(config, args.batch, args.prompt_len)
    print(f"  full prefill FLOPs {full:,.0f}   CED prefill FLOPs {ced:,.0f}   ratio {ced / full:.3f}")
    _, ced_w = prefill_flops(config, args.batch, args.prompt_len, staircase=False)
    print(f"  decoder on the last {config.window} rows only (approximate): {ced_w:,.0f}   "
          f"ratio {ced_w / full:.3f}")


if __name__ == "__main__":
    main()
