"""What each KV cache format costs in bytes and in quality, on the default model.

    python -m model.kv_eval [--tokens 512] [--formats fp8,kivi-int2] [--plot FILE.png]

It lives in model/ (not quant/) because it runs the model: quant imports nothing of ours.
One row per kv_cache_dtype (model/kv_formats.py), all from one batched prefill per format
(every query reads the cache after the chunk's write, so it sees the stored codes):

- B/token: page-pool bytes one token takes over all layers, K and V, every kv head;
  B/seq: fixed bytes per sequence outside the pages (KIVI's exact newest page).
- ppl, dppl: perplexity of the first `tokens` tokens of Python's own documentation
  (pydoc_data.topics, shipped with CPython; its text changes a little between Python
  versions) and its difference to the float32 cache.
- attn err: ||o_q - o|| / ||o|| of each layer's attention sublayer output (after wo) with
  the float model's own inputs, so errors do not compound; mean over layers.
- needle: share of haystacks (the same documentation, `tokens` long, with "The secret
  number is NNNN." at depths 10/50/90%) whose number the model greedily reproduces after
  the prompt and the answer prefix "The secret number is".

The formats LLM centers (model/key_centers.py CENTERED_FORMATS) run here centered too:
their pages hold keys minus each layer's mean key, taken over other topics of the same
documentation, and those in BASIS_FORMATS hold them in the key bases fitted there
(TurboQuant's balanced, nvfp4's with the sink token's key alone moved).

--plot FILE.png also draws the table (matplotlib): dppl and B/token per kv_cache_dtype as bars.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import compile_cache
from model.config import SLIDING_ATTENTION, ModelConfig
from model.context import ForwardContext
from model.kv_cache import slot_mapping
from model.key_centers import applies, basis_kind, documentation_text, for_kv_cache
from model.kv_formats import KV_CACHE_DTYPES, bytes_per_token, recent_bytes_per_seq
from model.layers import attention_block, rms_norm
from model.rope import rope_tables
from model.tokenizer import Tokenizer
from model.weights import WEIGHTS_DTYPES
from model.transformer import forward_hidden, init_cache, lm_head

BASELINE = "float32"
DEFAULT_FORMATS = ("float32", "bfloat16", "fp8", "int8", "nvfp4", "kivi-int4", "kivi-int2",
                   "turboquant-3.5", "turboquant-2.5")
NEEDLES = ((0.1, 4817), (0.5, 2963), (0.9, 7351))  # (depth, number)
_QUESTION = "\n\nWhat is the secret number mentioned in the text above?"
_ANSWER_PREFIX = "The secret number is"


def documentation_ids(tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of pydoc_data.topics, topics in sorted order."""
    text = documentation_text()
    # Tokenizing all ~465k characters takes seconds; a prefix does, bar its cut last words.
    for size in (8 * num_tokens + 256, len(text)):
        ids = tokenizer.encode(text[:size], add_special_tokens=False)
        if len(ids) >= num_tokens + 16 or size >= len(text):
            break
    if len(ids) < num_tokens:
        raise ValueError(f"the documentation has {len(ids)} tokens, asked for {num_tokens}")
    return ids[:num_tokens]


def needle_example(tokenizer: Tokenizer, num_tokens: int, depth: float, number: int
                   ) -> tuple[list[int], list[int]]:
    """(prompt, answer) token ids, together exactly `num_tokens` long.

    prompt: the chat-templated haystack with the needle sentence after `depth` of the
    documentation, the question, and the answer prefix; answer: the number's tokens.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)
    before, after = tokenizer.apply_chat_template([{"role": "user", "content": "\0"}]).split("\0")
    head, tail = enc(before), enc(_QUESTION + after + _ANSWER_PREFIX)
    needle, answer = enc(f"\n{_ANSWER_PREFIX} {number}.\n"), enc(f" {number}")
    body = num_tokens - len(head) - len(tail) - len(needle) - len(answer)
    if body <= 0:
        raise ValueError(f"num_tokens {num_tokens} leaves no room for a haystack")
    hay = documentation_ids(tokenizer, body)
    at = int(body * depth)
    return head + hay[:at] + needle + hay[at:] + tail, answer


@functools.partial(jax.jit, static_argnames=("config", "kv_cache_dtype", "answer_len"))
def _score(params, config: ModelConfig, tokens, kv_cache_dtype: str, answer_len: int):
    """Row 0: next-token NLL [T-1]; rows 1..: greedy tokens [B-1, answer_len] before the end;
    and the residual entering every layer of row 0 ([L, T, H])."""
    b, t = tokens.shape
    cache = init_cache(config, b, t, jnp.float32, None, kv_cache_dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _, residuals = forward_hidden(params, config, tokens, positions, cache,
                                          tuple(range(config.num_layers)))
    logp = jax.nn.log_softmax(lm_head(params, config, hidden[0, :-1]), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    greedy = jnp.argmax(lm_head(params, config, hidden[1:, t - 1 - answer_len:t - 1]), axis=-1)
    return nll, greedy, jnp.stack([r[0] for r in residuals])


def attention_outputs(params, config: ModelConfig, residuals, kv_cache_dtype: str) -> jax.Array:
    """Each layer's attention sublayer output [L, T, H] for its input residuals [L, T, H],
    through an empty cache of `kv_cache_dtype` (one sequence, positions 0..T-1)."""
    return jnp.stack([
        _attention_layer(layer, config, x, kv_cache_dtype,
                         config.sliding_window if kind == SLIDING_ATTENTION else None)
        for kind, layer, x in zip(config.layer_kinds, params["layers"], residuals)])


@functools.partial(jax.jit, static_argnames=("config", "kv_cache_dtype", "window"))
def _attention_layer(layer, config: ModelConfig, x, kv_cache_dtype: str, window: int | None):
    # One compiled program serves every layer of a kind (same shapes, params as arguments).
    t = x.shape[0]
    cache = init_cache(config, 1, t, jnp.float32, None, kv_cache_dtype)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    num_pages = jax.tree.leaves(cache.layers[0])[0].shape[0]
    ctx = ForwardContext(positions, rope_tables(config, positions, local=window is not None), cache.block_tables,
                         slot_mapping(positions, cache.block_tables, cache.page_size, num_pages),
                         cache.page_size)
    h = rms_norm(x[None], layer["attn_norm"], config.rms_norm_eps)
    out, _ = attention_block(layer, config, h, cache.layers[0], ctx, window)
    return out[0]


def relative_error(got, want) -> np.ndarray:
    """||got - want|| / ||want|| over the last two axes, float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want, axis=(-2, -1)) / np.linalg.norm(want, axis=(-2, -1))


def evaluate(config: ModelConfig, params, tokenizer: Tokenizer, formats=DEFAULT_FORMATS,
             num_tokens: int = 512, needles=NEEDLES):
    """Yield one result dict per format (the baseline first), as each is measured."""
    for name in formats:
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {name!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    if not needles:
        raise ValueError("needles must hold at least one (depth, number) pair")
    examples = [needle_example(tokenizer, num_tokens, depth, number) for depth, number in needles]
    answer_len = len(examples[0][1])
    if any(len(answer) != answer_len for _, answer in examples):
        raise ValueError("every needle's answer must have the same number of tokens")
    tokens = jnp.asarray([documentation_ids(tokenizer, num_tokens)] + [p + a for p, a in examples],
                         jnp.int32)
    answers = np.asarray([a for _, a in examples])
    base, transformed = None, {}
    for name in (BASELINE,) + tuple(f for f in formats if f != BASELINE):
        start = time.perf_counter()
        run = params
        if applies(config, name):  # as LLM runs them: centered keys, some in a basis (model/key_centers.py)
            kind = basis_kind(name)
            transformed[kind] = transformed.get(kind) or for_kv_cache(params, config, tokenizer, name)
            run = transformed[kind]
        nll, greedy, residuals = _score(run, config, tokens, name, answer_len)
        if base is None:
            base_residuals = residuals
            base_attention = attention_outputs(params, config, residuals, BASELINE)
        attn = attention_outputs(run, config, base_residuals, name)
        ppl = float(np.exp(np.mean(np.asarray(nll, np.float64))))
        row = {"kv_cache_dtype": name, "bytes_per_token": bytes_per_token(name, config),
               "bytes_per_seq": recent_bytes_per_seq(name, config), "ppl": ppl,
               "attn_err": float(np.mean(relative_error(attn, base_attention))),
               "needle": float(np.mean(np.all(np.asarray(greedy) == answers, axis=-1))),
               "seconds": time.perf_counter() - start}
        base = base or row
        row["dppl"] = ppl - base["ppl"]
        if name in formats:
            yield row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.kv_eval", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512,
                        help="perplexity text and needle haystack length (default 512)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help=f"comma-separated kv_cache_dtypes (default all: {','.join(DEFAULT_FORMATS)})")
    parser.add_argument("--model", default="default", help="'default', a .gguf file or a HF directory")
    parser.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw dppl and B/token per kv_cache_dtype as bars (matplotlib)")
    args = parser.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    unknown = [f for f in formats if f not in KV_CACHE_DTYPES]
    if unknown:
        parser.error(f"unknown kv_cache_dtype {unknown}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    if args.tokens < 64:
        parser.error("--tokens must be >= 64")
    if args.plot:
        _check_plot(parser, args.plot)
    compile_cache.enable()
    from model.loader import load, load_tokenizer

    config, params = load(args.model, weights_dtype=args.weights_dtype)
    tokenizer = load_tokenizer(args.model)
    if args.tokens > config.max_position_embeddings:
        parser.error(f"--tokens must be <= the model's context {config.max_position_embeddings}")
    try:  # the needle prompts (chat template, question, answer) must fit in --tokens
        needle_example(tokenizer, args.tokens, 0.0, NEEDLES[0][1])
    except ValueError as e:
        parser.error(f"--tokens {args.tokens} is too short for the needle prompts: {e}")
    print(f"{config.num_layers} layers x {config.num_kv_heads} kv heads x {config.head_dim}; "
          f"{args.tokens} tokens of pydoc_data.topics; needles at depths "
          f"{', '.join(f'{d:.0%}' for d, _ in NEEDLES)} of a {args.tokens}-token prompt")
    print(f"{'kv_cache_dtype':<15} {'B/token':>8} {'x f32':>6} {'B/seq':>7} {'ppl':>8} {'dppl':>8} "
          f"{'attn err':>9} {'needle':>7} {'s':>5}")
    f32 = bytes_per_token(BASELINE, config)
    rows = []
    for r in evaluate(config, params, tokenizer, formats, args.tokens):
        print(f"{r['kv_cache_dtype']:<15} {r['bytes_per_token']:>8} {f32 / r['bytes_per_token']:>6.2f} "
              f"{r['bytes_per_seq']:>7} {r['ppl']:>8.3f} {r['dppl']:>+8.3f} {r['attn_err']:>9.4f} "
              f"{r['needle']:>7.2f} {r['seconds']:>5.0f}", flush=True)
        rows.append(r)
    if args.plot and rows:
        title = (f"KV cache formats on {args.model}: {args.tokens} tokens of pydoc_data.topics "
                 f"(float32 cache: ppl {rows[0]['ppl'] - rows[0]['dppl']:.3f})")
        plot_rows(args.plot, title, rows, f32)
        print(f"plot: {args.plot}")


def _check_plot(parser, path: str) -> None:
    """--plot fails before the run, not after it: matplotlib, a file type it writes, a folder."""
    import importlib.util
    import os

    if importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    from matplotlib.backend_bases import FigureCanvasBase

    types = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(path)[1].lstrip(".").lower() not in types:
        parser.error(f"--plot {path}: give a file ending in one of {sorted(types)}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"--plot {path}: its folder does not exist")


def plot_rows(path: str, title: str, rows: list[dict], f32_bytes: int) -> None:
    """The table as two bar charts over kv_cache_dtype: perplexity change against the
    float32 cache (labelled with the value and the needle share), and bytes per token
    (labelled with the compression against float32)."""
    import textwrap

    from matplotlib.figure import Figure  # a bare Figure: pyplot's backend is left as it is

    names = [r["kv_cache_dtype"] for r in rows]
    x = np.arange(len(rows))
    fig = Figure(figsize=(max(7.0, 0.9 * len(rows) + 2), 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    dppl = [r["dppl"] for r in rows]
    bars = top.bar(x, dppl, color=["tab:red" if d > 0 else "tab:green" for d in dppl])
    top.bar_label(bars, [f"{d:+.3f}\nneedle {r['needle']:.0%}" for d, r in zip(dppl, rows)],
                  padding=2, fontsize=8)
    top.axhline(0, color="black", linewidth=0.8)
    top.set_ylabel("perplexity change vs float32 cache")
    top.margins(y=0.3)
    top.grid(axis="y", alpha=0.3)
    nbytes = [r["bytes_per_token"] for r in rows]
    bars = bottom.bar(x, nbytes, color="tab:blue")
    bottom.bar_label(bars, [f"{b}\n({f32_bytes / b:.1f}x)" for b in nbytes], padding=2, fontsize=8)
    bottom.set_ylabel("KV bytes per token (all layers)")
    bottom.set_ylim(0, max(nbytes) * 1.3)
    bottom.grid(axis="y", alpha=0.3)
    bottom.set_xticks(x, names, rotation=30, ha="right")
    bottom.set_xlabel("kv_cache_dtype (x: compression vs float32)")
    top.set_title(textwrap.fill(title, 60) + "\nbar labels: perplexity change; share of needles found",
                  fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
