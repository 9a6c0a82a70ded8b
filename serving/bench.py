"""Benchmarks that print tables: ours against a peer measured in the same run.

    python -m serving.bench decode     [--batch-sizes 1 16] [--new-tokens 64] [--weights-dtype float32 gguf w8a8]
                                       [--num-scheduler-steps 1 8] [--kv-cache-dtype auto]
    python -m serving.bench offline    [--num-prompts 16] [--new-tokens 64] [--kv-cache-dtype auto]
    python -m serving.bench prefill    [--prompt-lens 512 2048] [--kv-cache-dtype auto]
    python -m serving.bench trace PATH [--num-requests 1500] [--tiers] [--plot FILE.png]
    python -m serving.bench tiers PATH [--num-requests 48] [--kv-blocks 96] [--host-pages 64]
    python -m serving.bench context    [--batch 16] [--contexts 256 1024 4096] [--plot FILE.png]
    python -m serving.bench kv-dtypes  [--batch 16] [--context 2048] [--shared-prompt]
    python -m serving.bench scheduler  [--running 256 1024]
    python -m serving.bench speculative --draft DIR [--batch-sizes 1 8] [--new-tokens 64] [--repeats 2]
                                       [--plot FILE.png]
    python -m serving.bench fuzz       [--examples 1000] [--seed 0]
    python -m serving.bench serve      [--rates 2 8 inf] [--num-prompts 32] [--model default]
    python -m serving.bench structured [--batch-sizes 1 8] [--max-tokens 160]
    python -m serving.bench lora       [--adapters 1 4] [--batch 16] [--rank 16]
    python -m serving.bench sharding   [--tp 1 3] [--dp 1 2] [--ep 1] [--batch 4] [--new-tokens 16]
    python -m serving.bench deepseek   [--batch-sizes 1 8] [--shared-prefix 96] [--requests 8]

decode / offline: greedy generation throughput on the default model (generated tokens
per second, prefill included, after a warm-up run that compiles), against
transformers' `generate` on the same GGUF weights when transformers is installed.
decode runs each --weights-dtype (model.load's: float32, gguf to keep the file's blocks,
int8, w8a8, int4, fp8, q8_0, ...) with its resident weight bytes, and llama.cpp at batch 1
on the same GGUF when llama-cpp-python is installed, and each --num-scheduler-steps
(LLM's: decode steps per jitted call). Its decode columns (prefill excluded) are the better
of two timed runs on both sides. Every subcommand that loads a model takes
--weights-dtype.
prefill: prompt tokens/s of one prompt at a time (its time to the first token, in chunks of
max_num_batched_tokens), against transformers' forward over the same prompt on the same
GGUF weights (every position's hidden state, the last one's logits); best of two runs each.
trace: replays a Mooncake-format trace through the scheduler and radix cache in the
simulator with a cost model fitted from this engine's measured steps; --tiers adds
replays over host and disk tiers, each page moved costing what this engine measured.
tiers: replays the first requests of a Mooncake-format trace on the real engine in
arrival order, --concurrency clients in a closed loop, with a device pool too small for
the trace's prefixes: prompt tokens served by tier, seconds spent copying between tiers,
TTFT p50 / p90 and wall time for
the device alone, with a host tier, with a small host tier over a disk tier (in a
temporary directory), and with a pool large enough for every prefix (the optimum).
context: decode tokens/s (prefill excluded) as the live context grows at the default
max_model_len, and one context under max_model_len 512 against the default: a step
reads the pages the sequences hold, so the two should match.
kv-dtypes: decode tokens/s at one long context for each kv_cache_dtype against float32
(a prompt per row, so a step reads distinct pages; --shared-prompt: one for all rows).
scheduler: microseconds per `schedule` call with N running requests.
speculative: EAGLE-3 tree speculation against plain decoding on the same engine and
prompts: tokens/s both ways (the best of --repeats runs of each, in turns), mean accepted
length tau, acceptance by draft position, and whether the greedy outputs are identical in
every run (they must be).
fuzz: random valid and invalid requests on a tiny model over the default tokenizer
(serving/fuzz.py); counts of inputs run, rejected cleanly, and of crashes, hangs, leaks,
baseline changes and invalid inputs accepted (each must be 0). No peer: a correctness run.
serve: the OpenAI server (serving/server.py) started in process on a free port, loaded by
streamed completions at each request rate (Gamma arrivals, burstiness 1 = Poisson; inf
sends all at once) through the openai client, after unmeasured rounds of the same load
that compile the step shapes: TTFT and TPOT p50 / p99, output tokens/s, requests/s and
the share answered 429 by the admission caps. No peer.
structured: a JSON-schema workload (book records, greedy) with jump-forward against the
same engine without it: output tokens/s both ways, the share of tokens taken forced
(without sampling), whether the outputs are identical and all valid against the schema.
lora: a batch spread round-robin over N random PEFT adapters (every projection, rank
--rank) served at once by one multi-LoRA engine (S-LoRA), against what a stack without
multi-LoRA does: one adapter's requests at a time on its merged weights (swapped with
update_weights, nothing recompiles), and against the base model alone on the same batch;
greedy, generated tokens/s after a warm-up, and whether the outputs equal the merged
ones (float32 sums in another order may flip a near tie).
sharding: tensor and data parallelism (model/sharding.py, serving/data_parallel.py) for
each --tp with each --dp: compile time, tokens/s against the first layout (one device),
per-device weight and KV pool bytes measured from the arrays' shards against the arithmetic
of the split, and whether greedy output equals the first layout's. On CPU the devices are simulated and share its cores: a check that nothing is
replicated by mistake, not a speed-up.
deepseek: DeepSeek-V4.1's tiny preset (random weights) through the engine: decode tok/s
against a plain model.forward greedy loop on the same weights; a shared-prefix workload
without prefix caching and with it under each window replay (hit rate, tok/s, greedy
tokens equal to the uncached run); the replays' logit error; KV bytes allocated against
the budget (tiny and Flash); and the Flash plan's engine step lowered for TPU: Pallas
calls per layer kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import time

import numpy as np

from model.weights import WEIGHTS_DTYPES
from serving import scheduler as sched
from serving.kv_tiers import WRITE_POLICIES, TierConfig, host_rows_memory
from serving.params import SamplingParams

BLOCK_SIZE = 16  # LLM's default page size
PROMPT = "Write a short story about a robot who learns to paint."
TOPICS = ["the ocean", "a city at night", "learning to cook", "the history of tea", "mountain climbing",
          "a friendly robot", "the moon landing", "winter mornings", "a busy market", "old libraries",
          "jazz music", "desert plants", "a train journey", "honey bees", "paper airplanes", "lighthouses"]


def _device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform} ({d.device_kind})"


def _time_ours(llm, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, params)  # compile
    start = time.perf_counter()
    out = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in out)
    return len(prompts) * new_tokens / elapsed


def _time_transformers(gguf_path: str, prompts: list[list[int]], new_tokens: int) -> float | None:
    hf = _transformers_model(gguf_path)
    if hf is None:
        return None
    import torch

    width = max(len(p) for p in prompts)
    pad = hf.config.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  attention_mask=mask, pad_token_id=pad)
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / elapsed


def _table(title: str, rows: list[tuple[str, float, float | None]]) -> None:
    print(f"\n{title}")
    print("| batch | kvfold tok/s | transformers tok/s | ratio |")
    print("|------:|-------------:|-------------------:|------:|")
    for label, ours, peer in rows:
        peer_s = f"{peer:.1f}" if peer else "not installed"
        ratio = f"{ours / peer:.2f}x" if peer else "-"
        print(f"| {label} | {ours:.1f} | {peer_s} | {ratio} |")


def _weights(args) -> str | None:
    """--weights-dtype of a subcommand that takes one (model.load's weights_dtype)."""
    value = getattr(args, "weights_dtype", None)
    return value[0] if isinstance(value, list) else value


def _llm(args, max_num_seqs: int, weights_dtype: str | None = None, num_scheduler_steps: int = 1):
    from serving.llm import LLM

    # No prefix caching: the timed run would hit the warm-up's prompts, run prefill
    # chunks of other shapes (compiling inside the timing) and skip work the peer does.
    return LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(512, 64 * max_num_seqs), enable_prefix_caching=False,
               weights_dtype=weights_dtype, num_scheduler_steps=num_scheduler_steps,
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def _time_llama_cpp(gguf_path: str, prompt: list[int], new_tokens: int) -> float | None:
    """llama.cpp (llama-cpp-python) greedy decode tokens/s at batch 1 on the same GGUF, its
    own format, all CPU threads; prompt evaluated first and not timed (n_batch=1: its
    batched prompt path crashes on some CPUs)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    llm = llama_cpp.Llama(gguf_path, n_ctx=len(prompt) + new_tokens + 8, n_batch=1,
                          n_threads=os.cpu_count(), verbose=False)
    best = 0.0
    for _ in range(2):  # the first run warms the caches
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(new_tokens):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        best = max(best, new_tokens / (time.perf_counter() - start))
    return best


def _prompt_ids(tok, text: str) -> list[int]:
    """`text` as a user turn of the model's chat template, or plain when it has none (a base
    model such as Gemma 3 270M)."""
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    return tok.encode(text)


def bench_decode(args) -> None:
    import jax

    import model

    path = model.source_path(args.model)
    file_mb = os.path.getsize(path) / 1e6
    peers: dict[int, float | None] = {}
    llama = None
    print(f"\ndecode: {args.model} ({file_mb:.1f} MB file), {args.new_tokens} new tokens, greedy, "
          f"kv_cache_dtype {args.kv_cache_dtype}, "
          f"{_device()}; kvfold and transformers (float32 weights) include the one-step prefill; "
          "llama.cpp (its own GGUF blocks, batch 1) is timed after its prompt, and so is kvfold's decode column")
    print("| weights | steps per call | batch | resident weights MB | kvfold tok/s | transformers tok/s | ratio "
          "| kvfold decode tok/s | llama.cpp tok/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for weights, steps, batch in itertools.product(args.weights_dtype, args.num_scheduler_steps, args.batch_sizes):
        llm = _llm(args, batch, weights, steps)
        resident = sum(int(a.nbytes) for a in jax.tree.leaves(llm.runner.params)) / 1e6
        tok = llm.get_tokenizer()
        ids = _prompt_ids(tok, PROMPT)
        ours = _time_ours(llm, [ids] * batch, args.new_tokens)
        decode = _decode_rate(llm, ids, batch, args.new_tokens)
        del llm
        if batch not in peers:
            peers[batch] = (_time_transformers(path, [ids] * batch, args.new_tokens)
                            if path.endswith(".gguf") else None)
        if batch == 1 and llama is None and path.endswith(".gguf"):
            llama = _time_llama_cpp(path, ids, args.new_tokens)
        peer, lcpp = peers[batch], llama if batch == 1 else None
        print(f"| {weights} | {steps} | {batch} | {resident:.1f} | {ours:.1f} | "
              f"{f'{peer:.1f}' if peer else 'not installed'} | {f'{ours / peer:.2f}x' if peer else '-'} | "
              f"{decode:.1f} | {f'{lcpp:.1f}' if lcpp else '-'} | {f'{decode / lcpp:.2f}x' if lcpp else '-'} |",
              flush=True)


def bench_offline(args) -> None:
    import model

    path = model.source_path(args.model)
    llm = _llm(args, args.num_prompts, _weights(args))
    tok = llm.get_tokenizer()
    prompts = [_prompt_ids(tok, f"Write a paragraph about {t}.") for t in (TOPICS * 8)[:args.num_prompts]]
    ours = _time_ours(llm, prompts, args.new_tokens)
    peer = _time_transformers(path, prompts, args.new_tokens) if path.endswith(".gguf") else None
    _table(f"offline: {args.num_prompts} different chat prompts ({min(map(len, prompts))}-"
           f"{max(map(len, prompts))} tokens), {args.new_tokens} new tokens each, greedy, {_device()}",
           [(str(args.num_prompts), ours, peer)])


def bench_prefill(args) -> None:
    import model
    from serving.llm import LLM

    path = model.source_path(args.model)
    peer = _transformers_model(path) if path.endswith(".gguf") else None
    chunk = 512  # LLM's default max_num_batched_tokens
    llm = LLM(args.model, max_model_len=max(args.prompt_lens) + 16, max_num_seqs=1, enable_prefix_caching=False,
              max_num_batched_tokens=chunk, weights_dtype=_weights(args), kv_cache_dtype=args.kv_cache_dtype)
    vocab = llm.config.vocab_size
    first = SamplingParams(temperature=0, max_tokens=1)
    rows = []
    for length in args.prompt_lens:
        prompts = [_random_prompt(vocab, length, seed) for seed in range(3)]
        llm.generate([{"prompt_token_ids": prompts[0]}], first)  # compiles this length's chunks
        ours = []
        for prompt in prompts[1:]:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], first)
            ours.append(length / (time.perf_counter() - start))
        rows.append((length, max(ours), _transformers_prefill(peer, prompts) if peer else None))
    print(f"\nprefill: one random prompt at a time, {args.model} ({args.weights_dtype} weights; transformers: "
          f"float32), chunks of {chunk} tokens, kv_cache_dtype {args.kv_cache_dtype}, {_device()}; prompt tokens/s, "
          "best of two")
    print("| prompt tokens | kvfold tok/s | transformers tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for length, ours, theirs in rows:  # no peer: transformers not installed, or not a GGUF model
        print(f"| {length} | {ours:.1f} | {f'{theirs:.1f}' if theirs else 'n/a'} | "
              f"{f'{ours / theirs:.2f}x' if theirs else '-'} |", flush=True)


def _transformers_model(gguf_path: str):
    """transformers' model of a GGUF file in float32, or None when transformers is not installed."""
    if importlib.util.find_spec("transformers") is None:
        return None
    import torch
    import transformers

    folder, name = os.path.split(gguf_path)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _transformers_prefill(hf, prompts: list[list[int]]) -> float:
    """transformers' prompt tokens/s over prompts[1:] (prompts[0] warms up): its decoder
    over every position, the head over the last (as a first token needs); the best run."""
    import torch

    best = 0.0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state
            hf.lm_head(hidden[:, -1]).argmax(-1)
            if i:
                best = max(best, len(prompt) / (time.perf_counter() - start))
    return best


def _decode_rate(llm, prompt: list, batch: int, new_tokens: int) -> float:
    """Decode tokens/s of `batch` rows (prefill excluded): copies of `prompt` (token ids), or
    row i from prompt[i] when `prompt` is a list of `batch` prompts.

    Each distinct prompt first fills the prefix cache (one prefill each, not `batch`);
    a warm-up batch then compiles the decode steps the run meets;
    each timed batch starts from the cached prefixes and is timed from its first token on.
    The better of two timed batches, as llama.cpp's column is the better of its two runs.
    """
    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt] * batch
    if len(prompts) != batch:
        raise ValueError(f"{len(prompts)} prompts for a batch of {batch}")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    distinct = list({tuple(p): p for p in prompts}.values())
    llm.generate([{"prompt_token_ids": p} for p in distinct], SamplingParams(temperature=0, max_tokens=1))
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    engine = llm.engine
    best = 0.0
    for run in range(2):
        ids = [f"bench-{run}-{i}" for i in range(batch)]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, params)
        while any(not engine.seqs[f"{rid}#0"].output.tokens for rid in ids):
            engine.step()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        elapsed = time.perf_counter() - start
        done = sum(len(engine.seqs[f"{rid}#0"].output.tokens) - 1 for rid in ids)
        for rid in ids:
            engine.release(rid)
        assert done == batch * (new_tokens - 1)
        best = max(best, done / elapsed)
    return best


def _random_prompt(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, vocab_size, length).tolist()


def _rates_table(label: str, rows: list[tuple[str, float]]) -> None:
    """Decode tok/s per row and its ratio to the first row."""
    print(f"| {label} | decode tok/s | vs {rows[0][0]} |")
    print("|---|---:|---:|")
    for name, rate in rows:
        print(f"| {name} | {rate:.1f} | {rate / rows[0][1]:.2f}x |", flush=True)


def _pyplot():
    """matplotlib's pyplot on the headless Agg backend (for --plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_plot(parser, path: str | None) -> None:
    """Fail before a long run, not after it: --plot needs matplotlib, a file type it
    writes and an existing folder."""
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in FigureCanvasBase.get_supported_filetypes():
        parser.error(f"--plot {path}: give a file ending in one of "
                     f"{sorted(FigureCanvasBase.get_supported_filetypes())}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        parser.error(f"--plot {path}: its folder does not exist")


def _plot_context(path: str, title: str, max_model_len: int, sweep: list[tuple[int, float]],
                  short: tuple[int, int, float]) -> None:
    """Decode tok/s against live tokens (the sweep at max_model_len), and the same-work
    point under the short max_model_len (live tokens, max_model_len, tok/s)."""
    import textwrap

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = zip(*sweep)
    ax.plot(xs, ys, "o-", label=f"max_model_len {max_model_len} (default)")
    live, mml, rate = short
    ax.plot([live], [rate], "s", markersize=9, markerfacecolor="none", label=f"max_model_len {mml}")
    for x, y in sweep:
        ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("live tokens per sequence (prompt + generated)")
    ax.set_ylabel("decode tokens/s (prefill excluded)")
    ax.set_ylim(0, max(max(ys), rate) * 1.15)
    ax.set_title(textwrap.fill(title, 80), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def bench_context(args) -> None:
    """Decode cost follows the live context: a sweep at the default max_model_len, and one
    context under max_model_len 512 against the default (the same work, two pool widths)."""
    from serving.llm import LLM

    llm = LLM(args.model, weights_dtype=_weights(args), enable_prefix_caching=True, max_num_seqs=args.batch)
    vocab = llm.config.vocab_size
    title = (f"context sweep: {args.model}, batch {args.batch}, {args.new_tokens} new tokens, "
             f"max_model_len {llm.max_model_len}, greedy, float32, {_device()}")
    print(f"\n{title}")
    sweep = [(live, _decode_rate(llm, _random_prompt(vocab, live - args.new_tokens), args.batch, args.new_tokens))
             for live in args.contexts]
    _rates_table("live tokens", [(str(live), rate) for live, rate in sweep])
    live = min(args.contexts)
    short = LLM(args.model, weights_dtype=_weights(args), max_model_len=max(512, live), max_num_seqs=args.batch)
    prompt = _random_prompt(vocab, live - args.new_tokens, seed=1)
    print(f"\nsame work ({live} live tokens) under two max_model_len, batch {args.batch}")
    same = [(str(one.max_model_len), _decode_rate(one, prompt, args.batch, args.new_tokens)) for one in (short, llm)]
    _rates_table("max_model_len", same)
    if args.plot:
        _plot_context(args.plot, title, llm.max_model_len, sweep, (live, short.max_model_len, same[0][1]))


def bench_kv_dtypes(args) -> None:
    """Decode tokens/s per kv_cache_dtype at one long live context, against the first listed.

    Every row has its own prompt, so a step reads batch x context positions of distinct
    pages, the bytes a low-bit pool saves; --shared-prompt gives every row the same one (the
    prefix cache then shares its pages, which a step reads batch times, mostly from cache)."""
    from serving.llm import LLM

    print(f"\nKV formats: {args.model}, batch {args.batch}, {args.context} live tokens "
          f"({'one prompt shared by every row' if args.shared_prompt else 'a prompt per row'}), "
          f"{args.new_tokens} new tokens, greedy, float32 weights, {_device()}")
    rows = []
    max_model_len = args.context + args.new_tokens
    # a pool that holds every row at full length, whatever the format's bytes: the default
    # 1 GiB budget holds fewer float32 rows of 2,048 tokens than a batch of 16 needs
    num_kv_blocks = args.batch * -(-max_model_len // BLOCK_SIZE)
    for fmt in args.kv_cache_dtypes:
        llm = LLM(args.model, weights_dtype=_weights(args), max_model_len=max_model_len, max_num_seqs=args.batch,
                  kv_cache_dtype=fmt, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks)
        length = args.context - args.new_tokens
        prompts = [_random_prompt(llm.config.vocab_size, length, seed=0 if args.shared_prompt else i)
                   for i in range(args.batch)]
        rows.append((fmt, _decode_rate(llm, prompts, args.batch, args.new_tokens)))
        del llm
    _rates_table("kv_cache_dtype", rows)


def _plot_speculative(path: str, title: str, rows: list, depth: int) -> None:
    """Acceptance by draft position (1..depth) as grouped bars, one bar per batch size: the
    share of verified trees that accepted at least that many draft tokens (0 past the
    deepest acceptance)."""
    import textwrap

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * depth + 3), 4.5))
    width = 0.8 / len(rows)
    for i, (batch, plain_tps, spec_tps, stats, _) in enumerate(rows):
        accept = list(stats["acceptance_by_position"])[:depth]
        accept += [0.0] * (depth - len(accept))
        xs = np.arange(1, depth + 1) + (i - (len(rows) - 1) / 2) * width
        bars = ax.bar(xs, accept, width, label=f"batch {batch}: tau {stats['tau']:.2f}, "
                                               f"{spec_tps / plain_tps:.2f}x plain tok/s")
        ax.bar_label(bars, [f"{a:.2f}" for a in accept], padding=2, fontsize=8)
    ax.set_xticks(range(1, depth + 1))
    ax.set_xlabel("draft position (tokens past the last accepted one)")
    ax.set_ylabel("share of verified trees accepting it")
    ax.set_ylim(0, 1.2)
    ax.set_title(textwrap.fill(title, 70), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def bench_speculative(args) -> None:
    import model
    from serving.llm import LLM

    config, params = model.load(args.model, weights_dtype=_weights(args))
    tok = model.load_tokenizer(args.model)
    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens,
            "depth": args.depth, "top_k": args.top_k}
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": _prompt_ids(tok, f"Write a paragraph about {t}.")}
                   for t in (TOPICS * 8)[:batch]]
        kw = dict(max_model_len=512, max_num_seqs=batch, max_num_batched_tokens=max(512, 64 * batch),
                  enable_prefix_caching=False)  # see _llm
        llms = {name: LLM.from_loaded(config, params, tok, **kw, **extra)
                for name, extra in (("plain", {}), ("eagle3", {"speculative_config": spec}))}
        for llm in llms.values():
            llm.generate(prompts, greedy)  # compile every shape this run meets
        tps, ids = {}, {}
        for _ in range(args.repeats):  # the two alternate, the best run of each kept: timings drift
            for name, llm in llms.items():
                llm.engine.accepted_counts.clear()
                start = time.perf_counter()
                out = llm.generate(prompts, greedy)
                tps[name] = max(tps.get(name, 0.0), batch * args.new_tokens / (time.perf_counter() - start))
                ids.setdefault(name, []).append([o.outputs[0].token_ids for o in out])
        stats = llms["eagle3"].engine.speculative_stats()  # greedy: every run accepts the same
        del llms
        same = all(run == ids["plain"][0] for runs in ids.values() for run in runs)
        rows.append((batch, tps["plain"], tps["eagle3"], stats, same))
    print(f"\nspeculative: {args.model}, draft {args.draft}, tree depth {args.depth} top-k {args.top_k} "
          f"{args.num_speculative_tokens} draft tokens, {args.new_tokens} new tokens, greedy, best of "
          f"{args.repeats} alternating runs, {_device()}")
    # step cost: one speculative step (draft + tree verify) in plain decode steps, i.e. the
    # tau at which speculation breaks even on this machine.
    print("| batch | plain tok/s | EAGLE-3 tok/s | speedup | tau | step cost | acceptance by position "
          "| identical |")
    print("|------:|------------:|--------------:|--------:|----:|----------:|:-----------------------"
          "|:---------:|")
    for batch, plain_tps, spec_tps, stats, same in rows:
        accept = " ".join(f"{a:.2f}" for a in stats["acceptance_by_position"])
        print(f"| {batch} | {plain_tps:.1f} | {spec_tps:.1f} | {spec_tps / plain_tps:.2f}x | "
              f"{stats['tau']:.2f} | {stats['tau'] * plain_tps / spec_tps:.2f} | {accept} | "
              f"{'yes' if same else 'NO'} |")
    if args.plot:
        _plot_speculative(args.plot, f"EAGLE-3 acceptance by draft position: {args.model}, draft "
                          f"{args.draft}, tree depth {args.depth} top-k {args.top_k} "
                          f"{args.num_speculative_tokens} draft tokens, greedy", rows, args.depth)


BOOK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "string", "maxLength": 30},
        "publication_year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genre": {"enum": ["fiction", "non-fiction", "poetry", "science", "history", "biography"]},
        "number_of_pages": {"type": "integer", "minimum": 1, "maximum": 5000},
        "is_available_in_library": {"type": "boolean"},
        "average_rating": {"type": "number"},
    },
    "required": ["title", "author", "publication_year", "genre", "number_of_pages",
                 "is_available_in_library", "average_rating"],
    "additionalProperties": False,
}


def bench_structured(args) -> None:
    import model
    from serving.llm import LLM
    from serving.params import StructuredOutputsParams

    config, params = model.load(args.model, weights_dtype=_weights(args))
    tok = model.load_tokenizer(args.model)
    so = StructuredOutputsParams(json=BOOK_SCHEMA)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    rows = []
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": _prompt_ids(tok, f"Describe a well-known book about {t} as a JSON record.")}
                   for t in (TOPICS * 8)[:batch]]
        kw = dict(max_model_len=512, max_num_seqs=batch, max_num_batched_tokens=max(512, 64 * batch),
                  enable_prefix_caching=False)  # see _llm
        result = {}
        for jump in (False, True):
            llm = LLM.from_loaded(config, params, tok, **kw, jump_forward=jump)
            sampled, execute = [0], llm.runner.execute

            def counting(step_rows, execute=execute, sampled=sampled):
                sampled[0] += sum(r.sample for r in step_rows)
                return execute(step_rows)
            llm.runner.execute = counting
            llm.generate(prompts, greedy)  # compile every shape this run meets
            sampled[0] = 0
            start = time.perf_counter()
            out = llm.generate(prompts, greedy)
            elapsed = time.perf_counter() - start
            ids = [o.outputs[0].token_ids for o in out]
            texts = [o.outputs[0].text for o in out]
            result[jump] = (ids, texts, sum(map(len, ids)) / elapsed, sampled[0])
            del llm
        (plain_ids, texts, plain_tps, _), (jump_ids, _, jump_tps, jump_sampled) = result[False], result[True]
        total = sum(map(len, jump_ids))
        valid = sum(_valid_json(t, BOOK_SCHEMA) for t in texts)
        rows.append((batch, plain_tps, jump_tps, 1 - jump_sampled / max(total, 1), plain_ids == jump_ids,
                     f"{valid}/{len(texts)}"))
    print(f"\nstructured outputs: {args.model}, JSON schema (7 keys), up to {args.max_tokens} tokens, greedy, "
          f"{_device()}")
    print("| batch | no jump-forward tok/s | jump-forward tok/s | ratio | tokens forced | identical | valid |")
    print("|------:|----------------------:|-------------------:|------:|--------------:|:---------:|------:|")
    for batch, plain_tps, jump_tps, forced, same, valid in rows:
        print(f"| {batch} | {plain_tps:.1f} | {jump_tps:.1f} | {jump_tps / plain_tps:.2f}x | {forced:.0%} | "
              f"{'yes' if same else 'NO'} | {valid} |")


def _forward_loop_rate(config, params, prompt: list[int], batch: int, new_tokens: int, max_len: int) -> float:
    """Decode tokens/s of a plain model.forward greedy loop over `batch` copies of `prompt`
    (contiguous caches, one jitted call per token; prefill excluded, a first run compiles)."""
    import jax
    import jax.numpy as jnp

    import model

    def run():
        cache = model.init_cache(config, batch, max_len)
        tokens = jnp.asarray([prompt] * batch)
        logits, cache = model.forward(params, config, tokens, jnp.broadcast_to(jnp.arange(len(prompt)), tokens.shape),
                                      cache)
        nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None]
        jax.block_until_ready(nxt)
        start = time.perf_counter()
        for i in range(new_tokens - 1):
            pos = jnp.full((batch, 1), len(prompt) + i, jnp.int32)
            logits, cache = model.forward(params, config, nxt, pos, cache)
            nxt = jnp.argmax(logits[:, -1], axis=-1)[:, None]
        jax.block_until_ready(nxt)
        return batch * (new_tokens - 1) / (time.perf_counter() - start)
    run()
    return run()


def _truncated(config, num_layers: int):
    """A DeepSeek config's first num_layers layers (a plan's prefix is a plan)."""
    from model.deepseek.config import layer_plan

    keep = lambda layers: tuple(i for i in layers if i < num_layers)
    ratios = config.compress_ratios[:num_layers]
    plan = dict(kv_sources=keep(config.kv_sources), index_sources=keep(config.index_sources),
                candidate_sources=keep(config.candidate_sources))
    return dataclasses.replace(config, compress_ratios=ratios, moe_layers=keep(config.moe_layers),
                               layer_kinds=layer_plan(ratios, *plan.values()), **plan)


def flash_pallas_calls(lens: tuple[int, ...], num_layers: int | None = None) -> dict[str, int]:
    """Pallas calls (by kernel: "sparse_attention", "indexer", "all") in one engine step of
    the Flash plan lowered for TPU from abstract arrays (its first num_layers layers): rows
    of `lens` new tokens (tests/serving/test_deepseek_engine.py checks them too)."""
    import jax
    import jax.numpy as jnp

    import model
    from model.deepseek import paged, preset
    from pallas_kernels.lowering import export_tpu, kernel_calls
    from serving.engine import Row
    from serving.runner import ModelRunner, _step

    config = preset("deepseek-v4.1-flash")
    config = config if num_layers is None else _truncated(config, num_layers)
    params = jax.eval_shape(lambda k: model.init_params(config, k, jnp.bfloat16), jax.random.key(0))
    pages, state = jax.eval_shape(lambda: paged.init_pool(config, 64, 16, len(lens)))
    runner = ModelRunner.__new__(ModelRunner)  # its batch packing only: a Flash pool does not fit here
    runner.__dict__.update(config=config, draft=None, lora=None, csa2=True, max_num_seqs=len(lens),
                           max_pages_per_seq=64, page_size=16, mask_words=-(-config.vocab_size // 32))
    start = 0 if max(lens) > 1 else 300
    batch = runner.step_batch([Row((0,) * n, start, tuple(range(32)), sample=True, slot=i) for i, n in enumerate(lens)])
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), batch)
    mlir = export_tpu(lambda p, pool, b: _step(p, config, 16, pool, b, False, False), params,
                      {"target": pages, "state": state}, specs)
    return {name: kernel_calls(mlir, marker) for name, marker in
            (("sparse_attention", "kvfold_sparse_attention"), ("indexer", "kvfold_indexer_scores"),
             ("all", "tpu_custom_call"))}


def bench_deepseek(args) -> None:
    """DeepSeek-V4.1 (CSA2) in the engine: the tiny preset's speed, prefix reuse and bytes,
    and the Flash plan's lowered step."""
    import jax

    from model.deepseek import paged, preset
    from model.deepseek.config import window_bytes_per_sequence
    from model.deepseek.replay import replay_error
    from serving.llm import LLM

    name = "deepseek-v4.1-tiny"
    engine = dict(seed=0, max_model_len=args.max_model_len, max_num_seqs=max(max(args.batch_sizes), args.requests),
                  max_num_batched_tokens=512, num_kv_blocks=args.kv_blocks)
    llm = LLM(name, **engine)
    config, params = llm.config, llm.runner.params
    prompt = _random_prompt(config.vocab_size, args.prompt_len)
    print(f"\n{name} (random weights, seed 0) through the engine, {_device()}: decode tok/s after a "
          f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens, greedy, prefill excluded; peer: a plain "
          "jitted model.forward greedy loop on the same weights (contiguous caches)")
    print("| batch | engine tok/s | forward loop tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        ours = _decode_rate(llm, prompt, batch, args.new_tokens)
        peer = _forward_loop_rate(config, params, prompt, batch, args.new_tokens, args.max_model_len)
        print(f"| {batch} | {ours:.1f} | {peer:.1f} | {ours / peer:.2f}x |", flush=True)

    rng = np.random.default_rng(1)

    def workload():  # requests sharing one prefix, each with its own suffix
        shared = rng.integers(0, config.vocab_size, args.shared_prefix).tolist()
        return [shared + rng.integers(0, config.vocab_size, 16).tolist() for _ in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    warm, timed = workload(), workload()
    print(f"\nshared-prefix workload: {args.requests} requests, a {args.shared_prefix}-token shared prefix + 16 "
          "tokens each, 16 new tokens, greedy, the first request alone, then the others together; after an unmeasured run of another such "
          "workload (compiles); same tokens = greedy output equal to the engine without prefix caching")
    print("| prefix caching | window replay | hit rate | tok/s | vs no caching | same tokens |")
    print("|---|---|---:|---:|---:|---:|")
    results = {}
    for caching, replay in ((False, "exact"), (True, "exact"), (True, "bounded")):
        run = LLM(name, enable_prefix_caching=caching, window_replay=replay, **engine)
        for prompts in (warm, timed):
            start = time.perf_counter()  # the first request alone, then the others together
            outs = [*run.generate([{"prompt_token_ids": prompts[0]}], sp),
                    *run.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp)]
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        hit = sum(o.num_cached_tokens for o in outs) / sum(len(p) for p in timed)
        tokens = [o.outputs[0].token_ids for o in outs]
        results[caching, replay] = rate, tokens
        base_rate, base = results[False, "exact"]
        same = sum(a == b for a, b in zip(tokens, base)) / len(base)
        print(f"| {'on' if caching else 'off'} | {replay if caching else '-'} | {hit:.1%} | {rate:.1f} | "
              f"{rate / base_rate:.2f}x | {same:.0%} |", flush=True)

    tokens = jax.random.randint(jax.random.key(3), (1, args.shared_prefix + 16), 0, config.vocab_size)
    exact_len = config.num_layers * (config.window - 1) + 1
    bounded = replay_error(params, config, tokens, args.shared_prefix)
    exact = replay_error(params, config, tokens, args.shared_prefix, exact_len)
    print(f"\nwindow replay after a {args.shared_prefix}-token prefix hit: max |logit error| over the next 16 tokens "
          f"against the full forward (model.deepseek.replay.replay_error; the engine's restore computes the "
          f"same); max |logit| {bounded['max_abs_logit']:.3f}")
    print("| replay | tokens replayed | max abs logit error |")
    print("|---|---:|---:|")
    print(f"| none (empty windows) | 0 | {bounded['no_replay']:.2e} |")
    print(f"| bounded | {config.window} | {bounded['replay']:.2e} |")
    print(f"| exact (receptive field) | {exact_len} | {exact['replay']:.2e} |")

    flash = preset("deepseek-v4.1-flash")
    flash_pages, flash_state = jax.eval_shape(lambda: paged.init_pool(flash, 8, 16, 1))
    print("\nKV bytes allocated (from the pool's arrays; Flash from abstract arrays) against model.kv_budget's "
          "figure")
    print("| model | global B/token allocated | budget B/token | state B/sequence | of it, FP8 window |")
    print("|---|---:|---:|---:|---:|")
    for label, cfg, pages, state in ((name, config, llm.runner.pool["target"], llm.runner.state),
                                     (flash.name, flash, flash_pages, flash_state)):
        got = paged.global_bytes_per_token(pages, llm.runner.page_size if cfg is config else 16)
        print(f"| {label} | {float(got):g} | {cfg.kv_bytes_per_token:g} | {paged.state_bytes_per_slot(state)} | "
              f"{window_bytes_per_sequence(cfg)} |")

    print("\nThe Flash plan's engine step lowered for TPU (jax.export, abstract arrays): Pallas calls per layer "
          "kind, measured as the calls a plan truncated after a layer of that kind adds")
    print("| layer kind | layers | sparse attention calls / layer | indexer calls / layer |")
    print("|---|---:|---:|---:|")
    decode = (1, 1, 1, 1)
    for kind in dict.fromkeys(flash.layer_kinds):
        i = flash.layer_kinds.index(kind)
        before = flash_pallas_calls(decode, i) if i else {"sparse_attention": 0, "indexer": 0}
        after = flash_pallas_calls(decode, i + 1)
        print(f"| {kind} | {flash.layer_kinds.count(kind)} | {after['sparse_attention'] - before['sparse_attention']} "
              f"| {after['indexer'] - before['indexer']} |", flush=True)
    for label, lens in (("decode step, 4 rows", decode),
                        ("step of one 128-token chunk (CED) and 3 decode rows, run apart", (128, 1, 1, 1))):
        calls = flash_pallas_calls(lens)
        print(f"whole {label}: {calls['all']} Pallas calls ({calls['sparse_attention']} sparse attention, "
              f"{calls['indexer']} indexer) for {flash.num_layers} layers, {len(flash.index_sources)} index sources")


def _random_adapters(config, num: int, rank: int, root: str, seed: int = 0) -> list[str]:
    """`num` random PEFT adapters on every projection of `config`, written under root."""
    from model import lora

    rng = np.random.default_rng(seed)
    paths = []
    for k in range(num):
        weights = {}
        for layer in range(config.num_layers):
            for name, (d_in, d_out) in lora.projection_shapes(config).items():
                weights[(layer, name)] = (rng.normal(0, d_in ** -0.5, (rank, d_in)),
                                          rng.normal(0, 0.02, (d_out, rank)))
        paths.append(os.path.join(root, f"adapter{k}"))
        lora.save_peft_adapter(paths[-1], weights, rank, 2 * rank)
    return paths


def _shard_bytes(tree) -> int:
    """Bytes the first device holds of a pytree of (sharded) arrays."""
    import jax

    device = jax.devices()[0]
    return sum(shard.data.nbytes for a in jax.tree.leaves(tree) for shard in a.addressable_shards
               if shard.device == device)


def _expected_bytes(config, tp: int, num_pages: int, page_size: int, itemsize: int) -> tuple[int, int]:
    """(weight, KV pool) bytes one device should hold at tensor parallel size tp, from the
    architecture alone (Megatron split: heads and MLP columns / rows 1/tp each, the vocabulary
    1/tp when tp divides it, KV heads repeated up to tp, norms replicated; a MoE layer's E
    experts 1/tp whatever ep is, E / ep whole experts of 1 / (tp / ep) of their hidden units,
    its router replicated); biases and sinks are not counted."""
    h, hd, kv = config.hidden_size, config.head_dim, max(config.num_kv_heads, tp)
    attention = (2 * h * config.num_heads * hd + 2 * h * kv * hd) // tp
    attention += (4 if config.sandwich_norm else 2) * h + (2 * hd if config.qk_norm else 0)
    dense = 3 * h * config.intermediate_size // tp
    experts = 0
    if config.moe_layers:
        width = config.moe_intermediate_size or config.intermediate_size
        experts = 3 * h * width * (config.num_experts + config.num_shared_experts) // tp + h * config.num_experts
    mlps = (config.num_layers - len(config.moe_layers)) * dense + len(config.moe_layers) * experts
    vocab = config.vocab_size // tp if config.vocab_size % tp == 0 else config.vocab_size
    tables = 1 if config.tie_word_embeddings else 2
    weights = (config.num_layers * attention + mlps + tables * vocab * h + h) * itemsize
    pool = config.num_layers * 2 * num_pages * page_size * (kv // tp) * hd * itemsize
    return weights, pool


def bench_sharding(args) -> None:
    """Each (--tp, --dp) layout on this machine's devices (simulated CPU devices share its
    cores: the times check that nothing is replicated by mistake, they are not speed)."""
    import jax

    import model
    from serving.llm import LLM

    config, params = model.load(args.model, weights_dtype=args.weights_dtype)
    try:
        tok = model.load_tokenizer(args.model)
    except ValueError:  # a checkpoint without a tokenizer (a test fixture): token ids only
        tok = model.load_tokenizer("default")
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % min(1000, config.vocab_size - 1)
                                     for j in range(args.prompt_len)]} for i in range(args.batch)]
    sampling = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rows, outputs = [], {}
    layouts = [(tp, dp, ep) for dp in args.dp for tp in args.tp for ep in args.ep if tp % ep == 0]
    for tp, dp, ep in layouts:
        llm = LLM.from_loaded(config, params, tok, max_model_len=args.prompt_len + args.new_tokens,
                              max_num_seqs=args.batch, enable_prefix_caching=False, num_kv_blocks=args.kv_blocks,
                              tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel_size=ep,
                              weights_dtype=args.weights_dtype)
        start = time.perf_counter()
        llm.generate(prompts, sampling)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate(prompts, sampling)
        second = time.perf_counter() - start
        outputs[tp, dp, ep] = [o.outputs[0].token_ids for o in out]
        runner = llm.runner  # rank 0's; every rank holds the same
        itemsize = jax.tree.leaves(runner.params)[0].dtype.itemsize
        weights, pool = _shard_bytes(runner.params), _shard_bytes(runner.pool)
        want_w, want_p = _expected_bytes(llm.config, tp, runner.num_pages, runner.page_size, itemsize)
        rows.append((tp, dp, ep, first - second, args.batch * args.new_tokens / second, weights, want_w,
                     pool, want_p))
        del llm, runner
    base = rows[0][4]
    print(f"\nsharding: {args.model}, batch {args.batch} x {args.prompt_len} prompt tokens, "
          f"{args.new_tokens} new tokens (greedy, prefill included), {len(jax.devices())} x {_device()}; "
          "compile = first run - second run; per-device bytes on device 0 against the arithmetic")
    print("| tp | dp | ep | compile s | tok/s | vs first | weights MB / device | expected | KV pool MB / device "
          "| expected | greedy = first |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for tp, dp, ep, compile_s, tok_s, weights, want_w, pool, want_p in rows:
        same = "yes" if outputs[tp, dp, ep] == outputs[layouts[0]] else "NO"
        print(f"| {tp} | {dp} | {ep} | {compile_s:.1f} | {tok_s:.1f} | {tok_s / base:.2f}x | {weights / 1e6:.3f} | "
              f"{want_w / 1e6:.3f} | {pool / 1e6:.3f} | {want_p / 1e6:.3f} | {same} |")


def bench_lora(args) -> None:
    import tempfile

    import jax

    import model
    from model import lora
    from serving.llm import LLM
    from serving.params import LoRARequest

    config, params = model.load(args.model, weights_dtype=_weights(args))
    tok = model.load_tokenizer(args.model)
    prompts = [{"prompt_token_ids": _prompt_ids(tok, f"Write a few sentences about {t}.")}
               for t in (TOPICS * 8)[:args.batch]]
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    kw = dict(max_model_len=512, max_num_seqs=args.batch, max_num_batched_tokens=max(512, 64 * args.batch),
              enable_prefix_caching=False)  # see _llm

    def timed(llm, batch, **extra):
        llm.generate(batch, greedy, **extra)  # compile every shape this run meets
        start = time.perf_counter()
        out = llm.generate(batch, greedy, **extra)
        return [o.outputs[0].token_ids for o in out], time.perf_counter() - start

    plain = LLM.from_loaded(config, params, tok, **kw)
    _, base_s = timed(plain, prompts)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for num in args.adapters:
            paths = _random_adapters(config, num, args.rank, os.path.join(root, str(num)))
            requests = [LoRARequest(f"adapter{k}", k + 1, p) for k, p in enumerate(paths)]
            which = [requests[i % num] for i in range(len(prompts))]
            multi = LLM.from_loaded(config, params, tok, **kw, enable_lora=True, max_loras=num,
                                    max_lora_rank=args.rank)
            ours_ids, ours_s = timed(multi, prompts, lora_request=which)
            del multi
            merged_ids, merged_s = [None] * len(prompts), 0.0
            for k, req in enumerate(requests):  # one adapter at a time, merged weights
                plain.update_weights(lora.merge(params, lora.load_peft_adapter(req.lora_path, config)))
                group = list(range(k, len(prompts), num))
                ids, seconds = timed(plain, [prompts[i] for i in group])
                merged_s += seconds
                for i, out in zip(group, ids):
                    merged_ids[i] = out
            plain.update_weights(params)
            tokens = len(prompts) * args.new_tokens
            rows.append((num, tokens / ours_s, tokens / merged_s, tokens / base_s, ours_ids == merged_ids))
            jax.clear_caches()
    print(f"\nmulti-LoRA: {args.model}, batch {args.batch} spread over N adapters (rank {args.rank}, every "
          f"projection), {args.new_tokens} new tokens, greedy, float32, {_device()}")
    print("| adapters | multi-LoRA tok/s | merged, one adapter at a time tok/s | ratio | base model tok/s "
          "| multi-LoRA / base | identical |")
    print("|---------:|-----------------:|------------------------------------:|------:|----------------:"
          "|------------------:|:---------:|")
    for num, ours, merged, base, same in rows:
        print(f"| {num} | {ours:.1f} | {merged:.1f} | {ours / merged:.2f}x | {base:.1f} | {ours / base:.2f}x | "
              f"{'yes' if same else 'no'} |")


def _valid_json(text: str, schema: dict) -> bool:
    """Whether text parses and holds the schema's required keys with their types (a check
    without the jsonschema package, which only the tests install)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    types = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}
    props = schema["properties"]
    return isinstance(value, dict) and set(value) == set(schema["required"]) and all(
        isinstance(value[k], types[p["type"]]) if "type" in p else value[k] in p["enum"] for k, p in props.items())


# -- trace replay -------------------------------------------------------------------


def load_trace(path: str, num_requests: int, block_tokens: int, max_prompt: int,
               output_scale: float, page_size: int = 16) -> tuple[list, float, int]:
    """Mooncake records -> (SimRequests, the unbounded-cache hit-rate optimum, the working
    set in pages). Each hash id becomes a deterministic block of `block_tokens` token ids
    (a PRNG seeded by the id), so equal ids share prefixes. The working set counts the
    distinct full `page_size`-token pages of all prompts: a page is named by the chain of
    block ids up to its last token and its end, as the prefix cache keys it."""
    from serving.simulator import SimRequest

    records = []
    with open(path) as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
            if len(records) >= num_requests:
                break
    if not records:
        raise ValueError(f"{path} has no requests")
    scale = block_tokens / 512
    requests, seen, reusable, total_blocks, pages = [], set(), 0, 0, set()
    for r in records:
        n_in = max(1, min(max_prompt, int(r["input_length"] * scale)))
        blocks = r["hash_ids"][:-(-n_in // block_tokens)]
        chains = [hash(tuple(blocks[:k + 1])) for k in range(len(blocks))]
        pages.update((chains[(end - 1) // block_tokens], end) for end in range(page_size, n_in + 1, page_size))
        tokens: list[int] = []
        for h in blocks:
            tokens += np.random.default_rng(h).integers(3, 32000, block_tokens).tolist()
        tokens = tokens[:n_in]
        full = len(tokens) // block_tokens
        for h in blocks[:full]:  # the unbounded-cache optimum: blocks seen before
            total_blocks += 1
            reusable += h in seen
            seen.add(h)
        out = max(1, int(r["output_length"] * output_scale))
        requests.append(SimRequest(r["timestamp"] / 1000.0, tuple(tokens), out))
    return requests, reusable / max(total_blocks, 1), len(pages)


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def _plot_trace(path: str, title: str, results: list[tuple[str, int, object]]) -> None:
    """TTFT and TPOT p50 / p90 / p99 per (order, KV pages) of the trace replay: grouped
    bars labelled with their values, one panel per metric."""
    plt = _pyplot()
    labels = [f"{order}\n{pages} pages" for order, pages, _ in results]
    qs, colors = (50, 90, 99), ("tab:blue", "tab:orange", "tab:red")
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(results) + 3), 4.8))
    for ax, (metric, name) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"))):
        x = np.arange(len(results))
        width = 0.8 / len(qs)
        for k, (q, color) in enumerate(zip(qs, colors)):
            ys = [_pct(getattr(res, metric), q) for *_, res in results]
            bars = ax.bar(x + (k - 1) * width, ys, width, label=f"p{q}", color=color)
            ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)
        ax.set_xticks(x, labels)
        ax.set_ylabel(f"{name} (s)")
        ax.set_title(f"{name} percentiles")
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def _closed_loop(engine, prompts, params, concurrency: int, tag: str):
    """Replay requests in order as `concurrency` clients would: the next request is added
    when one finishes. Returns per request its tokens, its cached prompt tokens (at first
    admission) and its TTFT (seconds from being added to the step that sampled its first
    token)."""
    n = len(prompts)
    pending, live = list(range(n))[::-1], {}
    added, ttft, tokens, cached = [0.0] * n, [None] * n, [None] * n, [0] * n
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.pop()
            rid = f"{tag}-{i}"
            engine.add_request(rid, prompts[i]["prompt_token_ids"], params[i])
            live[rid], added[i] = i, time.perf_counter()
        engine.step()
        now = time.perf_counter()
        for rid, i in list(live.items()):
            out = engine.seqs[engine.requests[rid].seq_ids[0]].output
            if ttft[i] is None and out.tokens:
                ttft[i] = now - added[i]
            if engine.request_finished(rid):
                tokens[i], cached[i] = list(out.tokens), engine.requests[rid].num_cached_tokens
                engine.release(rid)
                del live[rid]
    if engine.tiers is not None:
        engine.tiers.flush()
    return tokens, cached, np.asarray(ttft, float)


def bench_tiers(args) -> None:
    import tempfile

    from serving.llm import LLM
    from serving.params import SamplingParams

    requests, optimum, _ = load_trace(args.path, args.num_requests, args.block_tokens, args.max_model_len - 64,
                                      args.output_scale)
    prompts = [{"prompt_token_ids": list(r.prompt)} for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    total = sum(len(r.prompt) for r in requests)
    print(f"tiers: {len(requests)} requests of {args.path} in arrival order, {args.concurrency} clients in a "
          f"closed loop; "
          f"prompts scaled to {args.block_tokens} tokens per 512-token block (mean {total / len(requests):.0f}), "
          f"outputs x{args.output_scale}; device pool {args.kv_blocks} pages of 16 tokens; "
          f"unbounded-cache hit-rate optimum {optimum:.3f}; {_device()}")
    print("(hit: prompt tokens the cache served at requests' first admission; device / host / disk: tokens "
          "served by each tier at every admission, re-admissions after preemption included; both per prompt token)")
    print("| cache | hit | device | host | disk | tier copies (pages, s) | TTFT p50 / p90 (s) | wall s | tokens/s | "
          "identical |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|:-:|")
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        page_bytes, warmed = None, set()
        setups = [("device only", dict(num_kv_blocks=args.kv_blocks)),
                  ("device + host (2x device)", dict(num_kv_blocks=args.kv_blocks, enable_hierarchical_cache=True,
                                         hicache_write_policy=args.write_policy)),
                  ("device + small host + disk", dict(num_kv_blocks=args.kv_blocks, enable_hierarchical_cache=True,
                                                      hicache_write_policy=args.write_policy,
                                                      disk_cache_dir=tmp)),
                  ("unbounded device", dict(num_kv_blocks=args.kv_blocks * 16))]
        for name, kw in setups:
            if "disk_cache_dir" in kw:
                kw["host_cache_bytes"] = args.host_pages * page_bytes
            llm = LLM(args.model, weights_dtype=_weights(args), max_model_len=args.max_model_len,
                      max_num_seqs=args.concurrency, max_num_batched_tokens=512, **kw)
            if llm.engine.tiers is not None and page_bytes is None:
                page_bytes = llm.engine.tiers.codec.page_nbytes  # sizes for the next setups
            if kw["num_kv_blocks"] not in warmed:  # an unmeasured replay compiles every step shape it uses
                warmed.add(kw["num_kv_blocks"])
                _closed_loop(llm.engine, prompts, params, args.concurrency, "warm")
                llm.engine.kv.flush_prefix_cache()
                llm.engine.kv.hits.clear()
            start = time.perf_counter()
            got, cached, ttft = _closed_loop(llm.engine, prompts, params, args.concurrency, "run")
            wall = time.perf_counter() - start
            reference = got if reference is None else reference
            hits, tiers = llm.engine.kv.hits, llm.engine.tiers
            generated = sum(len(g) for g in got)
            copies = f"{tiers.pages_moved}, {tiers.copy_s:.2f}" if tiers is not None else "-"
            print(f"| {name} | {sum(cached) / total:.3f} | "
                  f"{hits['device'] / total:.3f} | {hits['host'] / total:.3f} | {hits['disk'] / total:.3f} | "
                  f"{copies} | {_pct(ttft, 50):.3f} / {_pct(ttft, 90):.3f} | {wall:.1f} | "
                  f"{(total + generated) / wall:.0f} | {'yes' if got == reference else 'NO'} |")
            del llm


def bench_trace(args) -> None:
    from serving.llm import LLM
    import tempfile

    from serving.simulator import (decode_layout, fit_cost_model, measure_engine_steps, measure_tier_cost,
                                   prefill_layout, simulate)

    if not os.path.exists(args.path):
        raise SystemExit(f"trace {args.path} does not exist")
    llm = LLM(args.model, weights_dtype=_weights(args), max_model_len=2048, max_num_seqs=16, num_kv_blocks=256)
    # Held-out steps, never fitted, timed in the same rounds as the fitted ones: shapes
    # between and beside the fitted ones, on and off the runner's power-of-two buckets.
    held_prefill = [(128, 0), (48, 0), (200, 0), (96, 640)]
    held_decode = [(2, 1024), (8, 512), (8, 300), (8, 1500), (12, 700)]
    fit_prefill, fit_decode = prefill_layout(llm.max_model_len), decode_layout(llm.max_model_len)
    start = time.perf_counter()
    prefill, decode = measure_engine_steps(llm, fit_prefill + held_prefill, fit_decode + held_decode)
    held_prefill, held_decode = prefill[len(fit_prefill):], decode[len(fit_decode):]
    prefill, decode = prefill[:len(fit_prefill)], decode[:len(fit_decode)]
    cost = fit_cost_model(prefill, decode)
    print(f"cost model fitted on {_device()} from {len(prefill)} prefill and {len(decode)} decode steps "
          f"(these and {len(held_prefill) + len(held_decode)} held-out steps measured in "
          f"{time.perf_counter() - start:.0f} s):")
    a, b, c, d = cost.prefill
    print(f"  prefill: {a * 1e3:.2f} ms + {b * 1e3:.3f} ms/padded token + {c * 1e6:.3f} us per token x context "
          f"+ {d * 1e3:.3f} ms/padded token with several chunks")
    a, b, c = cost.decode
    print(f"  decode:  {a * 1e3:.2f} ms + {b * 1e6:.2f} us/context token + {c * 1e3:.2f} ms/padded row")
    print("held-out steps (not in the fit): measured vs predicted")
    print("| step | measured ms | predicted ms | error |")
    print("|---|---:|---:|---:|")
    for lens, ends, t in held_prefill:
        p = cost.prefill_time(lens, ends)
        print(f"| prefill {lens[0]} tokens at {ends[0] - lens[0]} | {t * 1e3:.1f} | {p * 1e3:.1f} | "
              f"{p / t - 1:+.1%} |")
    for contexts, t in held_decode:
        p = cost.decode_time(contexts)
        print(f"| decode {len(contexts)} x context {contexts[0]} | {t * 1e3:.1f} | {p * 1e3:.1f} | "
              f"{p / t - 1:+.1%} |")
    tier_cost = None
    if args.tiers:
        forms = ["numpy"] + (["pinned_host"] if llm.runner.host_memory is not None else [])
        with tempfile.TemporaryDirectory() as tmp:
            costs = {form: measure_tier_cost(llm, tmp, host_memory=form) for form in forms}
        # the simulation charges what the engine keeps by default ("auto")
        chosen = "numpy" if host_rows_memory("auto", llm.runner.host_memory) is None else "pinned_host"
        tier_cost = costs[chosen]
        print(f"tier copies on {_device()}, ms per {llm.runner.page_size}-token page of this model, by host row "
              f"form (disk reads: files just written, the OS page cache serves them; ratio: numpy / pinned_host; "
              f"the engine's default here, used below: {chosen}):")
        print("| copy | " + " | ".join(forms) + (" | ratio |" if len(forms) > 1 else " |"))
        print("|---|" + "---:|" * (len(forms) + (len(forms) > 1)))
        for name, field in (("device -> host", "copy_down_s"), ("host -> device", "load_host_s"),
                            ("disk -> device", "load_disk_s")):
            values = [getattr(costs[form], field) for form in forms]
            ratio = f" {values[0] / values[1]:.2f}x |" if len(values) > 1 else ""
            print(f"| {name} | " + " | ".join(f"{v * 1e3:.3f}" for v in values) + " |" + ratio)
    requests, optimum, working_set = load_trace(args.path, args.num_requests, args.block_tokens,
                                                args.max_model_len - 64, args.output_scale)
    # A device pool of a tenth of the working set by default with --tiers, as the tiers' aim is stated.
    cache_pages = args.cache_pages or ([working_set // 10] if args.tiers else [2048, 16384])
    # Stretch arrivals so the offered load is `load` of what one engine can serve.
    work = sum(cost.step_time_for_prefill(len(r.prompt)) + r.output_len * cost.decode_per_token(8)
               for r in requests)
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    stretch = work / (args.load * span) if span > 0 else 1.0
    t0 = min(r.arrival_s for r in requests)
    requests = [type(r)((r.arrival_s - t0) * stretch, r.prompt, r.output_len) for r in requests]
    results = []
    print(f"trace: {len(requests)} requests of {args.path}; prompts scaled to {args.block_tokens} tokens "
          f"per 512-token block (mean {np.mean([len(r.prompt) for r in requests]):.0f} tokens), outputs "
          f"x{args.output_scale} (mean {np.mean([r.output_len for r in requests]):.0f}); arrivals "
          f"stretched x{stretch:.1f} for offered load {args.load:.0%}; SLOs: TTFT <= {args.ttft_slo} s, "
          f"TPOT <= {args.tpot_slo} s; unbounded-cache hit-rate optimum {optimum:.3f}; working set "
          f"{working_set} distinct 16-token prompt pages")
    print("(by tier: tokens served by each tier at every admission, re-admissions after preemption included, "
          "per prompt token; I/O share: simulated time spent moving pages between tiers)")
    print("| order | KV pages | hit rate | of optimum | by tier: device / host / disk | I/O share | "
          "TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (s) | out tok/s | req/s | goodput req/s | preemptions |")
    print("|---|---:|---:|---:|---|---:|---|---|---:|---:|---:|---:|")
    config = sched.SchedulerConfig(page_size=16, max_num_seqs=32, max_num_batched_tokens=1024)
    unbounded = working_set + config.max_num_seqs * -(-args.max_model_len // config.page_size)
    for pages in cache_pages:
        # without tiers under each policy; with --tiers, longest-prefix-first over a host tier
        # twice the pool (SGLang's default), then over half the pool and an unbounded disk, and
        # a device pool that holds the whole working set beside a full batch (nothing evicted)
        # (label, order, (host pages, disk bytes) or None, device pages)
        setups = [(order, order, None, pages) for order in (sched.FCFS, sched.LPM)]
        if args.tiers:
            setups += [("lpm + host 2x", sched.LPM, (2 * pages, None), pages),
                       ("lpm + host x/2 + disk", sched.LPM, (pages // 2, 1 << 40), pages),
                       ("lpm, unbounded device", sched.LPM, None, unbounded)]
        for label, order, tier, pool in setups:
            config = dataclasses.replace(config, order=order)
            with tempfile.TemporaryDirectory() as tmp:
                tiers = None if tier is None else TierConfig(
                    host_cache_bytes=8 * tier[0], disk_cache_dir=tmp if tier[1] else None,
                    disk_cache_bytes=tier[1] or TierConfig.disk_cache_bytes, write_policy=args.write_policy)
                res = simulate(requests, config, pool, args.max_model_len, cost, tiers=tiers,
                               tier_cost=tier_cost if tier else None)
            results.append((label, pool, res))
            hit = res.cached_tokens / res.prompt_tokens
            by_tier = " / ".join(f"{res.hits.get(t, 0) / res.prompt_tokens:.3f}" for t in ("device", "host", "disk"))
            ok = (res.ttft_s <= args.ttft_slo) & (res.request_tpot_s <= args.tpot_slo)
            print(f"| {label} | {pool} | {hit:.3f} | {hit / optimum if optimum else 0:.2f} | {by_tier} | "
                  f"{res.io_s / res.makespan_s:.1%} | "
                  f"{_pct(res.ttft_s, 50):.2f} / {_pct(res.ttft_s, 90):.2f} / {_pct(res.ttft_s, 99):.2f} | "
                  f"{_pct(res.tpot_s, 50):.3f} / {_pct(res.tpot_s, 90):.3f} / {_pct(res.tpot_s, 99):.3f} | "
                  f"{res.output_tokens / res.makespan_s:.1f} | {len(res.ttft_s) / res.makespan_s:.3f} | "
                  f"{ok.sum() / res.makespan_s:.3f} | {res.num_preemptions} |")
    if args.plot:
        _plot_trace(args.plot, f"trace replay (simulated): {len(requests)} requests of "
                    f"{os.path.basename(args.path)}, offered load {args.load:.0%}, cost model fitted on "
                    f"{_device()}", results)


def bench_scheduler(args) -> None:
    print("| running requests | waiting | us per schedule() |")
    print("|---:|---:|---:|")
    for n in args.running:
        running = tuple(sched.Seq(f"r{i}", tuple(range(200)), 400, float(i), num_computed_tokens=199,
                                  started=0) for i in range(n))
        kv = sched.KVView(10**6, {s.seq_id: 13 for s in running})
        waiting = tuple(sched.Seq(f"w{i}", tuple(range(300)), 400, float(n + i)) for i in range(64))
        state = sched.SchedulerState(waiting=waiting, running=running)
        config = sched.SchedulerConfig(page_size=16, max_num_seqs=n, max_num_batched_tokens=2 * n)
        calls = max(20, 20000 // n)
        start = time.perf_counter()
        for _ in range(calls):
            sched.schedule(state, config, kv)
        print(f"| {n} | 64 | {(time.perf_counter() - start) / calls * 1e6:.0f} |")


def bench_fuzz(args) -> None:
    """serving/fuzz.py's properties over many examples: counts by outcome."""
    import collections

    import tqdm

    from model import load_tokenizer
    from serving import fuzz

    rng = np.random.default_rng(args.seed)
    engines = fuzz.make_engines(load_tokenizer("default"))
    totals: collections.Counter = collections.Counter()
    start = time.perf_counter()
    for i in tqdm.trange(args.examples, desc="examples", mininterval=30):
        llm, baseline = engines[i % len(engines)]
        totals += fuzz.run_example(llm, baseline, fuzz.random_actions(rng))
        totals["examples"] += 1
    elapsed = time.perf_counter() - start
    print(f"{args.examples} examples (seed {args.seed}) in {elapsed:.0f} s on {_device()}")
    print("| outcome | count |")
    print("|---|---:|")
    for key in ("examples", "inputs", "ran", "rejected cleanly", *fuzz.FAILURES):
        print(f"| {key} | {totals[key]} |")
    for key, n in sorted(totals.items()):
        if key.startswith("crash:"):
            print(f"| {key} | {n} |")


def _arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """Send times (s): gaps ~ Gamma(burstiness, 1 / (rate * burstiness)); rate inf: all at 0."""
    if np.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), n))


async def _streamed_completion(client, model: str, prompt: list[int], output_len: int, delay_s: float) -> dict:
    """One streamed completion sent after `delay_s`: its outcome, TTFT, TPOT and token count."""
    import asyncio

    import openai

    if delay_s > 0:
        await asyncio.sleep(delay_s)
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.RateLimitError:
        return {"outcome": "429"}
    except openai.APIError as e:
        return {"outcome": f"error: {e}"}
    end = time.perf_counter()
    ttft = (first or end) - start
    return {"outcome": "ok", "ttft": ttft, "tokens": tokens, "end": end,
            "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None}


async def _serve_load(url: str, args) -> list[tuple]:
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    rng = np.random.default_rng(args.seed)

    def prompts(n: int) -> list[list[int]]:  # distinct random prompts: no prefix-cache hits between them
        return [[int(t) for t in rng.integers(100, 30000, args.input_len)] for _ in range(n)]
    async def run(rate: float) -> list[dict]:
        sends = _arrivals(rng, args.num_prompts, rate, args.burstiness)
        return await asyncio.gather(*[_streamed_completion(client, model, p, args.output_len, t)
                                      for p, t in zip(prompts(args.num_prompts), sends)])
    # Unmeasured rounds of the same load: a step of a new shape (rows, tokens, prefill chunks
    # are bucketed) compiles once, seconds each on CPU, and would land in the measured TTFTs.
    for _ in range(args.warmup_rounds):
        for rate in args.rates:
            await run(rate)
    rows = []
    for rate in args.rates:
        start = time.perf_counter()
        results = await run(rate)
        ok = [r for r in results if r["outcome"] == "ok"]
        span = max((r["end"] for r in ok), default=start) - start
        ttft = np.array([r["ttft"] for r in ok])
        tpot = np.array([r["tpot"] for r in ok if r["tpot"] is not None])
        rejected = sum(r["outcome"] == "429" for r in results)
        errors = sorted({r["outcome"] for r in results} - {"ok", "429"})
        rows.append((rate, len(results), len(ok), rejected / len(results), errors, ttft, tpot,
                     sum(r["tokens"] for r in ok) / span if span else 0.0, len(ok) / span if span else 0.0))
    await client.close()
    return rows


def bench_serve(args) -> None:
    import asyncio

    from serving import server

    app = server.app_from_flags(["--model", args.model, "--max-model-len", str(args.max_model_len),
                                 "--max-num-seqs", str(args.max_num_seqs),
                                 "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                 "--max-waiting-requests", str(args.max_waiting_requests)]
                                + (["--weights-dtype", args.weights_dtype] if args.weights_dtype else []))
    http, thread, url = _uvicorn_thread(app)
    try:
        rows = asyncio.run(_serve_load(url, args))
    finally:
        http.should_exit = True
        thread.join()
    print(f"\nserve: {args.model} over HTTP (in process), {args.num_prompts} streamed completions per rate "
          f"(after {args.warmup_rounds} unmeasured round(s)), "
          f"{args.input_len} prompt tokens (random ids), {args.output_len} output tokens (ignore_eos), "
          f"burstiness {args.burstiness}, max_num_seqs {args.max_num_seqs}, max_waiting_requests "
          f"{args.max_waiting_requests}, {_device()}")
    print("| rate req/s | sent | done | 429 share | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | out tok/s | req/s |")
    print("|---:|---:|---:|---:|---|---|---:|---:|")
    for rate, sent, done, share_429, errors, ttft, tpot, tok_s, req_s in rows:
        print(f"| {rate:g} | {sent} | {done} | {share_429:.0%} | {_pct(ttft, 50):.3f} / {_pct(ttft, 99):.3f} | "
              f"{_pct(tpot, 50):.4f} / {_pct(tpot, 99):.4f} | {tok_s:.1f} | {req_s:.2f} |")
        if errors:
            print(f"  errors at rate {rate:g}: {errors}")


def _uvicorn_thread(app):
    """Serve `app` on a free 127.0.0.1 port from a thread: (server, thread, url)."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # log_config=None: uvicorn's default dictConfig would close every logging handler the
    # process already has (absl's, installed by orbax, holds sys.stderr: it gets closed).
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                         log_config=None))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    return http, thread, f"http://127.0.0.1:{port}"


async def _disagg_load(router_url: str, colocated_url: str, decode_url: str, args) -> dict:
    import openai
    import httpx

    clients = {"colocated": openai.AsyncOpenAI(base_url=f"{colocated_url}/v1", api_key="unused", max_retries=0,
                                               timeout=600),
               "disaggregated": openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0,
                                                   timeout=600)}
    model = (await clients["colocated"].models.list()).data[0].id
    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(100, 30000, args.input_len)] for _ in range(args.num_prompts + 1)]
    results = {name: [] for name in clients}
    async with httpx.AsyncClient() as http:
        for i, prompt in enumerate(prompts):  # one request at a time: TTFT without queueing
            if i == 1:  # the first round compiles every step shape both paths use
                before = (await http.get(f"{decode_url}/kv/stats")).json()
            for name, client in clients.items():
                r = await _streamed_completion(client, model, prompt, args.output_len, 0.0)
                if r["outcome"] != "ok":
                    raise SystemExit(f"{name} request failed: {r['outcome']}")
                if i:
                    results[name].append(r)
        after = (await http.get(f"{decode_url}/kv/stats")).json()
    for client in clients.values():
        await client.close()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in ("pages", "seconds")}
    return {"results": results, "transfers": after["transfers"], **moved}


def bench_disagg(args) -> None:
    """Disaggregated prefill / decode (serving/router.py: one prefill and one decode
    instance, each its own process, KV moved with jax.experimental.transfer) against one
    colocated instance (a third process), one request at a time."""
    import asyncio

    from serving.router import create_router, spawn

    flags = ["--model", args.model, "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "warning"]
    flags += ["--weights-dtype", args.weights_dtype] if args.weights_dtype else []
    with spawn(1, 1, flags) as (prefill, decode), spawn(0, 1, flags) as (_, colocated):
        http, thread, url = _uvicorn_thread(create_router(prefill, decode))
        try:
            out = asyncio.run(_disagg_load(url, colocated[0], decode[0], args))
        finally:
            http.should_exit = True
            thread.join()
    res = out["results"]
    print(f"disagg: {args.model}, {args.num_prompts} streamed completions one at a time (after one unmeasured), "
          f"{args.input_len} prompt tokens (random ids, no prefix shared), {args.output_len} output tokens; "
          f"three server processes on one machine ({_device()}), which the instances share")
    print("| setup | TTFT p50 / p90 (s) | TPOT p50 (s) | TTFT ratio (colocated / this) |")
    print("|---|---|---:|---:|")
    ttft = {name: np.array([r["ttft"] for r in rows]) for name, rows in res.items()}
    for name, rows in res.items():
        tpot = np.array([r["tpot"] for r in rows if r["tpot"] is not None])
        print(f"| {name} | {_pct(ttft[name], 50):.3f} / {_pct(ttft[name], 90):.3f} | {_pct(tpot, 50):.4f} | "
              f"{np.median(ttft['colocated']) / np.median(ttft[name]):.2f}x |")
    pages, seconds = out["pages"], out["seconds"]
    if pages:
        per_request = seconds / len(res["disaggregated"])
        print(f"KV transfer (handshake, pull over 127.0.0.1 and write into the decode pool): {pages} pages in "
              f"{seconds:.3f} s, {seconds / pages * 1e3:.3f} ms per page, "
              f"{per_request / np.mean(ttft['disaggregated']):.1%} of the disaggregated TTFT; "
              f"transfers by state: {out['transfers']}")
    else:
        print(f"no KV transfer completed: transfers by state {out['transfers']}")


def main(argv: list[str] | None = None) -> None:
    from serving.llm import SERVING_KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("decode", "offline"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="default")
        if name == "decode":
            p.add_argument("--weights-dtype", nargs="+", default=["float32"], choices=WEIGHTS_DTYPES,
                           help="one table row per choice (model.load's weights_dtype)")
        else:
            p.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES)
        p.add_argument("--new-tokens", type=int, default=64)
        p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
        p.add_argument("--kv-cache-dtype", default="auto", choices=SERVING_KV_CACHE_DTYPES,
                       help="LLM's kv_cache_dtype (llama.cpp keeps its cache in float16)")
        if name == "decode":
            p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
            p.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1],
                           help="one table row per choice (LLM's num_scheduler_steps: decode steps per call)")
        else:
            p.add_argument("--num-prompts", type=int, default=16)
    pf = sub.add_parser("prefill")
    pf.add_argument("--model", default="default")
    pf.add_argument("--weights-dtype", default="float32", choices=WEIGHTS_DTYPES,
                    help="model.load's weights_dtype (float32: the peer's)")
    pf.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    pf.add_argument("--kv-cache-dtype", default="auto", choices=SERVING_KV_CACHE_DTYPES, help="LLM's kv_cache_dtype")
    def trace_args(p, num_requests, block_tokens, output_scale, max_model_len):
        """The arguments of the subcommands that replay a Mooncake-format trace (load_trace)."""
        p.add_argument("path")
        p.add_argument("--model", default="default")
        p.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
        p.add_argument("--num-requests", type=int, default=num_requests)
        p.add_argument("--block-tokens", type=int, default=block_tokens, help="tokens per 512-token trace block")
        p.add_argument("--output-scale", type=float, default=output_scale)
        p.add_argument("--max-model-len", type=int, default=max_model_len)
        p.add_argument("--write-policy", default=TierConfig.write_policy, choices=WRITE_POLICIES,
                       help="the tiers' write policy")

    t = sub.add_parser("trace")
    trace_args(t, 1500, 32, 1 / 16, 4096)
    t.add_argument("--cache-pages", type=int, nargs="+",
                   help="device KV pages (default: 2048 and 16384; with --tiers, a tenth of the working set)")
    t.add_argument("--load", type=float, default=0.8)
    t.add_argument("--ttft-slo", type=float, default=30.0)
    t.add_argument("--tpot-slo", type=float, default=1.0)
    t.add_argument("--plot", metavar="FILE.png", help="also draw TTFT / TPOT percentiles per policy")
    t.add_argument("--tiers", action="store_true",
                   help="also replay with host and disk tiers under the prefix cache (tier copies measured here)")
    ti = sub.add_parser("tiers")
    trace_args(ti, 48, 16, 1 / 32, 1024)
    ti.add_argument("--concurrency", type=int, default=4, help="requests generated together, in arrival order")
    ti.add_argument("--kv-blocks", type=int, default=96, help="device KV pages (16 tokens each)")
    ti.add_argument("--host-pages", type=int, default=64,
                    help="host tier pages over the disk tier (the host-only setup gets its default, 2x the pool)")
    c = sub.add_parser("context")
    c.add_argument("--model", default="default")
    c.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    c.add_argument("--batch", type=int, default=16)
    c.add_argument("--new-tokens", type=int, default=32)
    c.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    c.add_argument("--plot", metavar="FILE.png", help="also draw decode tok/s against live tokens")
    k = sub.add_parser("kv-dtypes")
    k.add_argument("--model", default="default")
    k.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    k.add_argument("--batch", type=int, default=16)
    k.add_argument("--context", type=int, default=2048)
    k.add_argument("--new-tokens", type=int, default=32)
    k.add_argument("--kv-cache-dtypes", nargs="+",
                   default=["float32", "fp8", "int8", "nvfp4", "turboquant-3.5"])
    k.add_argument("--shared-prompt", action="store_true",
                   help="every row decodes after the same prompt (default: a prompt per row)")
    s = sub.add_parser("scheduler")
    s.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    fz = sub.add_parser("fuzz")
    fz.add_argument("--examples", type=int, default=1000)
    fz.add_argument("--seed", type=int, default=0)
    sp = sub.add_parser("speculative")
    sp.add_argument("--draft", required=True, help="an EAGLE-3 draft directory (training.train_eagle3)")
    sp.add_argument("--model", default="default")
    sp.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    sp.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    sp.add_argument("--new-tokens", type=int, default=64)
    sp.add_argument("--num-speculative-tokens", type=int, default=15)
    sp.add_argument("--depth", type=int, default=4)
    sp.add_argument("--top-k", type=int, default=4)
    sp.add_argument("--repeats", type=int, default=2, help="timed runs of each (the best is kept)")
    sp.add_argument("--plot", metavar="FILE.png", help="also draw acceptance by draft position")
    dg = sub.add_parser("disagg")
    dg.add_argument("--model", default="default")
    dg.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    dg.add_argument("--num-prompts", type=int, default=8)
    dg.add_argument("--input-len", type=int, default=512)
    dg.add_argument("--output-len", type=int, default=16)
    dg.add_argument("--max-model-len", type=int, default=1024)
    dg.add_argument("--seed", type=int, default=0)
    sv = sub.add_parser("serve")
    sv.add_argument("--model", default="default")
    sv.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    sv.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, float("inf")], help="requests/s")
    sv.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    sv.add_argument("--input-len", type=int, default=64)
    sv.add_argument("--output-len", type=int, default=32)
    sv.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (1: Poisson)")
    sv.add_argument("--max-model-len", type=int, default=512)
    sv.add_argument("--max-num-seqs", type=int, default=8)
    sv.add_argument("--max-num-batched-tokens", type=int, default=512)
    sv.add_argument("--max-waiting-requests", type=int, default=8)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured rounds over every rate first")
    st = sub.add_parser("structured")
    st.add_argument("--model", default="default")
    st.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    st.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    st.add_argument("--max-tokens", type=int, default=160)
    sh = sub.add_parser("sharding")
    sh.add_argument("--model", default="default")
    sh.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES,
                    help="model.load's weights_dtype (float32 or bfloat16: packed weights are not sharded)")
    sh.add_argument("--tp", type=int, nargs="+", default=[1, 3], help="tensor parallel sizes")
    sh.add_argument("--dp", type=int, nargs="+", default=[1], help="data parallel sizes (each --tp with each)")
    sh.add_argument("--ep", type=int, nargs="+", default=[1],
                    help="expert parallel sizes for a MoE model (each with each --tp it divides)")
    sh.add_argument("--batch", type=int, default=4)
    sh.add_argument("--prompt-len", type=int, default=64)
    sh.add_argument("--new-tokens", type=int, default=16)
    sh.add_argument("--kv-blocks", type=int, default=64, help="KV pages in the pool")
    ds = sub.add_parser("deepseek")
    ds.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ds.add_argument("--prompt-len", type=int, default=64)
    ds.add_argument("--new-tokens", type=int, default=64)
    ds.add_argument("--shared-prefix", type=int, default=96)
    ds.add_argument("--requests", type=int, default=8)
    ds.add_argument("--max-model-len", type=int, default=512)
    ds.add_argument("--kv-blocks", type=int, default=512, help="KV pages in the pool (16 positions each)")
    lo = sub.add_parser("lora")
    lo.add_argument("--model", default="default")
    lo.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES, help="model.load's weights_dtype")
    lo.add_argument("--adapters", type=int, nargs="+", default=[1, 4])
    lo.add_argument("--batch", type=int, default=16)
    lo.add_argument("--rank", type=int, default=16)
    lo.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.command in ("decode", "offline"):
        sizes = args.batch_sizes if args.command == "decode" else [args.num_prompts]
        if args.new_tokens <= 0 or any(b <= 0 for b in sizes):
            parser.error("--new-tokens and batch sizes must be > 0")
        (bench_decode if args.command == "decode" else bench_offline)(args)
    elif args.command == "prefill":
        if any(n <= 0 for n in args.prompt_lens):
            parser.error("--prompt-lens must be > 0")
        bench_prefill(args)
    elif args.command == "trace":
        _check_plot(parser, args.plot)
        bench_trace(args)
    elif args.command == "tiers":
        if min(args.num_requests, args.concurrency, args.kv_blocks, args.host_pages, args.block_tokens) <= 0:
            parser.error("--num-requests, --concurrency, --kv-blocks, --host-pages and --block-tokens must be > 0")
        if not os.path.exists(args.path):
            parser.error(f"trace {args.path} does not exist")
        bench_tiers(args)
    elif args.command in ("context", "kv-dtypes"):
        contexts = args.contexts if args.command == "context" else [args.context]
        if args.batch <= 0 or args.new_tokens < 2 or any(c <= args.new_tokens for c in contexts):
            parser.error("--batch must be > 0, --new-tokens >= 2 and every context > --new-tokens")
        if args.command == "context":
            _check_plot(parser, args.plot)
        (bench_context if args.command == "context" else bench_kv_dtypes)(args)
    elif args.command == "speculative":
        if args.new_tokens <= 0 or args.repeats <= 0 or any(b <= 0 for b in args.batch_sizes):
            parser.error("--new-tokens, --repeats and batch sizes must be > 0")
        _check_plot(parser, args.plot)
        bench_speculative(args)
    elif args.command == "disagg":
        if args.num_prompts <= 0 or args.input_len <= 0 or args.output_len <= 0 or \
                args.input_len + args.output_len > args.max_model_len:
            parser.error("--num-prompts, --input-len and --output-len must be > 0, and --input-len + "
                         "--output-len <= --max-model-len")
        bench_disagg(args)
    elif args.command == "serve":
        if (args.num_prompts <= 0 or args.input_len <= 0 or args.output_len <= 0 or args.burstiness <= 0
                or any(not r > 0 for r in args.rates) or args.input_len + args.output_len > args.max_model_len
                or args.warmup_rounds < 0):
            parser.error("--num-prompts, --input-len, --output-len, --burstiness and --rates must be > 0, "
                         "--warmup-rounds >= 0, and --input-len + --output-len <= --max-model-len")
        bench_serve(args)
    elif args.command == "structured":
        if args.max_tokens <= 0 or any(b <= 0 for b in args.batch_sizes):
            parser.error("--max-tokens and batch sizes must be > 0")
        bench_structured(args)
    elif args.command == "lora":
        if (args.batch <= 0 or args.rank <= 0 or args.new_tokens <= 0
                or any(not 0 < n <= min(args.batch, 31) for n in args.adapters)):
            parser.error("--batch, --rank and --new-tokens must be > 0, and --adapters in [1, min(batch, 31)]")
        bench_lora(args)
    elif args.command == "sharding":
        if min(args.tp + args.dp) < 1 or args.batch <= 0 or args.prompt_len <= 0 or args.new_tokens <= 0:
            parser.error("--tp, --dp, --batch, --prompt-len and --new-tokens must be > 0")
        import jax

        jax.config.update("jax_num_cpu_devices", max(args.tp) * max(args.dp))  # on CPU: simulate the devices
        bench_sharding(args)
    elif args.command == "deepseek":
        if (min(args.batch_sizes + [args.prompt_len, args.requests, args.kv_blocks]) <= 0 or args.new_tokens < 2
                or args.shared_prefix <= 0 or max(args.prompt_len, args.shared_prefix + 16) + args.new_tokens
                > args.max_model_len):
            parser.error("--batch-sizes, --prompt-len, --shared-prefix, --requests and --kv-blocks must be > 0, "
                         "--new-tokens >= 2, and every prompt + --new-tokens <= --max-model-len")
        bench_deepseek(args)
    elif args.command == "fuzz":
        if args.examples <= 0:
            parser.error("--examples must be > 0")
        bench_fuzz(args)
    else:
        bench_scheduler(args)


if __name__ == "__main__":
    main()
