"""SWA bounded replay: window KV never goes to the persistent tier; it is rebuilt on resume.

The persistent / prefix-cache tier keeps each layer's "global" rows only (NVFP4 KV rows
and MXFP4 index keys of the KV sources). After a prefix hit of C tokens the window rings
(and the ratio-2 compressor's pending token) are rebuilt by running every layer over
tokens [max(0, C - W), C) with the global rows frozen: KV sources read the restored rows
instead of writing replayed ones.

It is an approximation: layer l's window row at position q depends on layer l-1's output
at q, which (through its own window) depends on positions back to q - l (W - 1). The
replay starts at C - W with empty rings, so every layer after the first sees truncated
windows for the replayed positions. `python -m model.deepseek.replay` measures the
resulting logit error against the full forward on the tiny preset.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from model.deepseek.ced import context
from model.deepseek.config import DeepSeekConfig, preset
from model.deepseek.layers import FROZEN_GLOBAL
from model.kv_cache import KVCache
from model.transformer import LAYER_KINDS


def persistent_part(cache: KVCache) -> KVCache:
    """What the persistent tier gives back: a copy of every global row, every local state empty."""
    layers = [{"global": jax.tree.map(jnp.copy, layer["global"]), "local": jax.tree.map(jnp.zeros_like, layer["local"])}
              for layer in cache.layers]
    return KVCache(layers, jnp.copy(cache.block_tables), cache.page_size)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def replay_window(params: dict, config: DeepSeekConfig, tokens, positions, cache: KVCache) -> KVCache:
    """Rebuild local state by running every layer over the tokens before the resume point.

    tokens, positions: int32 [B, n], the prompt's tokens at positions C - n .. C - 1 (bounded
    replay: n = min(C, W)); cache: global rows restored, local empty (donated).
    """
    x = params["embed"][tokens]
    ctx = context(config, positions, cache, shared={FROZEN_GLOBAL: True})
    layers = list(cache.layers)
    for i, kind in enumerate(config.layer_kinds):
        x, layers[i], ctx = LAYER_KINDS[kind].apply(params["layers"][i], config, x, layers[i], ctx)
    return KVCache(layers, cache.block_tables, cache.page_size)


def resume(params, config: DeepSeekConfig, prompt, prefix_len: int, cache: KVCache,
           replay_len: int | None = None) -> KVCache:
    """Replay for a prefix hit of `prefix_len` tokens of prompt int32 [B, >= C].

    replay_len: tokens to replay, default the window (bounded replay). Replaying
    num_layers * (W - 1) + 1 tokens (the receptive field) or the whole prefix is exact.
    """
    if not 0 < prefix_len <= prompt.shape[1]:
        raise ValueError(f"prefix_len must be in [1, {prompt.shape[1]}], got {prefix_len}")
    start = max(0, prefix_len - (config.window if replay_len is None else replay_len))
    b = prompt.shape[0]
    positions = jnp.broadcast_to(jnp.arange(start, prefix_len, dtype=jnp.int32), (b, prefix_len - start))
    return replay_window(params, config, prompt[:, start:prefix_len], positions, cache)


def decode_logits(params, config, tokens, start: int, cache: KVCache):
    """Logits f32 [B, n, V] of tokens [B, n] decoded one at a time from position `start`."""
    import model

    out = []
    for i in range(tokens.shape[1]):
        pos = jnp.full((tokens.shape[0], 1), start + i, jnp.int32)
        logits, cache = model.forward(params, config, tokens[:, i:i + 1], pos, cache)
        out.append(logits)
    return jnp.concatenate(out, axis=1), cache


def replay_error(params, config: DeepSeekConfig, tokens, prefix_len: int, replay_len: int | None = None
                 ) -> dict:
    """Max |logit difference| on the tokens after a prefix hit at `prefix_len`, vs the full forward.

    tokens int32 [B, T]. Compares (prefill C, keep the global rows, replay, decode the rest)
    with one forward over all T tokens; also the same without replay (empty windows).
    """
    import model
    from model.deepseek.ced import ced_prefill

    b, t = tokens.shape
    full, _ = model.forward(params, config, tokens, jnp.broadcast_to(jnp.arange(t), (b, t)),
                            model.init_cache(config, b, t))
    _, cache = ced_prefill(params, config, tokens[:, :prefix_len],
                           jnp.broadcast_to(jnp.arange(prefix_len), (b, prefix_len)),
                           model.init_cache(config, b, t))
    restored = persistent_part(cache)
    no_replay, _ = decode_logits(params, config, tokens[:, prefix_len:], prefix_len, restored)
    replayed, _ = decode_logits(params, config, tokens[:, prefix_len:], prefix_len,
                                resume(params, config, tokens, prefix_len, persistent_part(cache), replay_len))
    want = np.asarray(full[:, prefix_len:])
    per_position = np.abs(np.asarray(replayed) - want).max(axis=(0, 2))
    return {"max_abs_logit": float(np.abs(want).max()), "replay": float(per_position.max()),
            "replay_per_position": per_position,
            "no_replay": float(np.abs(np.asarray(no_replay) - want).max())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="measure SWA bounded replay's logit error")
    parser.add_argument("--preset", default="deepseek-v4.1-tiny")
    parser.add_argument("--prefix-len", type=int, default=40)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    import model

    config = preset(args.preset)
    init = jax.jit(model.init_params, static_argnums=0)
    print(f"{config.name}: prefix {args.prefix_len}, window {config.window}, decode {args.decode}")
    for seed in range(args.seeds):
        params = init(config, jax.random.key(seed))
        tokens = jax.random.randint(jax.random.key(100 + seed), (1, args.prefix_len + args.decode), 0,
                                    config.vocab_size)
        r = replay_error(params, config, tokens, args.prefix_len)
        exact = replay_error(params, config, tokens, args.prefix_len,
                             config.num_layers * (config.window - 1) + 1)["replay"]
        print(f"  seed {seed}: max|logit| {r['max_abs_logit']:.4f}  replay error {r['replay']:.2e}  "
              f"without replay {r['no_replay']:.2e}  receptive-field replay {exact:.2e}")


if __name__ == "__main__":
    main()
