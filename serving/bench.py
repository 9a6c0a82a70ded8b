"""Benchmarks that print tables: ours against a peer measured in the same run.

    python -m serving.bench decode [--model default] [--batch-sizes 1 16] [--new-tokens 64]

`decode`: greedy generation throughput (generated tokens / s, prefill included, after
a warm-up run that compiles) on the default model, against transformers' `generate`
on the same GGUF weights when transformers is installed.
"""

from __future__ import annotations

import argparse
import time


from serving.generate import Generator

PROMPT = "Write a short story about a robot who learns to paint."


def time_ours(gen: Generator, batch: int, new_tokens: int) -> float:
    ids = gen.prompt_ids(PROMPT)
    prompts = [ids] * batch
    for _ in gen.stream(prompts, max_tokens=new_tokens, ignore_eos=True):  # compile
        pass
    start = time.perf_counter()
    steps = sum(1 for _ in gen.stream(prompts, max_tokens=new_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    assert steps == new_tokens
    return batch * new_tokens / elapsed


def time_transformers(source_path: str, ids: list[int], batch: int, new_tokens: int) -> float | None:
    import importlib.util
    import os

    if importlib.util.find_spec("transformers") is None:
        return None
    import torch

    folder, name = os.path.split(source_path)
    hf = _hf_model(folder, name)
    inputs = torch.tensor([ids] * batch)
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  attention_mask=torch.ones_like(inputs), pad_token_id=hf.config.eos_token_id)
    with torch.no_grad():
        hf.generate(inputs, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = hf.generate(inputs, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - len(ids) == new_tokens
    return batch * new_tokens / elapsed


_HF_CACHE: dict = {}


def _hf_model(folder: str, name: str):
    import torch
    import transformers

    if (folder, name) not in _HF_CACHE:
        _HF_CACHE[(folder, name)] = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32).eval()
    return _HF_CACHE[(folder, name)]


def bench_decode(args) -> None:
    import model

    gen = Generator.load(args.model)
    path = model.default_model_path() if args.model == "default" else args.model
    rows = []
    for batch in args.batch_sizes:
        ours = time_ours(gen, batch, args.new_tokens)
        peer = time_transformers(path, gen.prompt_ids(PROMPT), batch, args.new_tokens) \
            if path.endswith(".gguf") else None
        rows.append((batch, ours, peer))
    print(f"\ndecode: {args.model}, prompt {len(gen.prompt_ids(PROMPT))} tokens, "
          f"{args.new_tokens} new tokens, greedy, float32, {_device()}")
    print("| batch | kvfold tok/s | transformers tok/s | ratio |")
    print("|------:|-------------:|-------------------:|------:|")
    for batch, ours, peer in rows:
        peer_s = f"{peer:.1f}" if peer else "not installed"
        ratio = f"{ours / peer:.2f}x" if peer else "-"
        print(f"| {batch} | {ours:.1f} | {peer_s} | {ratio} |")


def _device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform} ({d.device_kind})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    decode = sub.add_parser("decode", help="generation tokens/s at several batch sizes")
    decode.add_argument("--model", default="default")
    decode.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    decode.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.command == "decode":
        if args.new_tokens <= 0 or any(b <= 0 for b in args.batch_sizes):
            parser.error("--new-tokens and --batch-sizes must be > 0")
        bench_decode(args)


if __name__ == "__main__":
    main()
