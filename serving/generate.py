"""Generate text with a model: a batched prefill + decode loop, and the CLI.

    python -m serving.generate "What is the capital of France?"

The prompt goes through the model's chat template unless --raw. Decoding is greedy
unless --temperature > 0. Tokens stream to the terminal as they come.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import model
from serving.sampling import sample


# Compiled steps persist across runs: a second `generate` skips XLA compilation.
COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kvfold", "jax")


def _bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n (and >= minimum): static shapes, few compilations."""
    return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _prefill_and_sample(params, config, tokens, positions, cache, last_index, key, temperature,
                        top_k, top_p):
    logits, cache = model.forward(params, config, tokens, positions, cache, last_index)
    return sample(logits, key, temperature, top_k, top_p), cache


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _decode_and_sample(params, config, tokens, positions, cache, key, temperature, top_k, top_p):
    logits, cache = model.forward(params, config, tokens[:, None], positions[:, None], cache,
                                  jnp.zeros(tokens.shape, jnp.int32))
    return sample(logits, key, temperature, top_k, top_p), cache


def validate_sampling(max_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class Generator:
    """A loaded model plus its tokenizer, generating for a batch of prompts."""

    def __init__(self, config: model.ModelConfig, params: dict, tokenizer: model.Tokenizer,
                 dtype=jnp.float32):
        self.config, self.params, self.tokenizer, self.dtype = config, params, tokenizer, dtype

    @classmethod
    def load(cls, source: str = "default", dtype=jnp.float32) -> "Generator":
        """Load `source` ('default', a .gguf file or a HF directory) and its tokenizer."""
        config, params = model.load(source, dtype)
        return cls(config, params, model.load_tokenizer(source), dtype)

    def prompt_ids(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of `prompt`, through the chat template unless `raw`."""
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        if raw:
            return self.tokenizer.encode(prompt)
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompts: Sequence[Sequence[int]], max_tokens: int = 256,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               ignore_eos: bool = False) -> Iterator[np.ndarray]:
        """Yield the next token of every prompt (int [B]) per step.

        A sequence that has emitted EOS keeps being yielded as EOS (the caller
        trims); the loop ends when all have finished or after `max_tokens` steps.
        """
        validate_sampling(max_tokens, temperature, top_k, top_p)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        lens = np.array([len(p) for p in prompts], np.int32)
        context = self.config.max_position_embeddings
        if lens.max() + max_tokens > context:
            raise ValueError(f"prompt ({lens.max()} tokens) + max_tokens ({max_tokens}) exceeds the "
                             f"model's context of {context} tokens")
        batch = len(prompts)
        max_len = min(_bucket(int(lens.max()) + max_tokens), context)
        width = min(_bucket(int(lens.max())), max_len)
        tokens = np.zeros((batch, width), np.int32)
        positions = np.full((batch, width), -1, np.int32)  # negative: padding, not written
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
            positions[i, :len(p)] = np.arange(len(p))
        cache = model.init_cache(self.config, batch, max_len, self.dtype)
        temp = jnp.full((batch,), temperature, jnp.float32)
        k = jnp.full((batch,), top_k, jnp.int32)
        p = jnp.full((batch,), top_p, jnp.float32)
        key = jax.random.key(seed)
        key, sub = jax.random.split(key)
        nxt, cache = _prefill_and_sample(self.params, self.config, jnp.asarray(tokens),
                                         jnp.asarray(positions), cache, jnp.asarray(lens - 1),
                                         sub, temp, k, p)
        eos = self.tokenizer.eos_token_id
        done = np.zeros(batch, bool)
        pos = lens.copy()
        for step in range(max_tokens):
            out = np.asarray(nxt)
            out = np.where(done, eos if eos is not None else out, out)
            yield out
            if not ignore_eos and eos is not None:
                done |= out == eos
            if done.all() or step == max_tokens - 1:
                return
            key, sub = jax.random.split(key)
            write_pos = np.where(done, -1, pos).astype(np.int32)
            nxt, cache = _decode_and_sample(self.params, self.config, jnp.asarray(out),
                                            jnp.asarray(write_pos), cache, sub, temp, k, p)
            pos += 1

    def generate(self, prompt_ids: Sequence[int], **kwargs) -> list[int]:
        """Generated ids of one prompt, without the final EOS."""
        eos = self.tokenizer.eos_token_id
        out: list[int] = []
        for step in self.stream([prompt_ids], **kwargs):
            if step[0] == eos and not kwargs.get("ignore_eos"):
                break
            out.append(int(step[0]))
        return out


def stream_text(generator: Generator, ids: Sequence[int], **kwargs) -> Iterator[str]:
    """Yield decoded text pieces of one generation as tokens arrive."""
    tokens: list[int] = []
    shown = ""
    eos = generator.tokenizer.eos_token_id
    for step in generator.stream([ids], **kwargs):
        if step[0] == eos and not kwargs.get("ignore_eos"):
            break
        tokens.append(int(step[0]))
        text = generator.tokenizer.decode(tokens)
        if text.endswith("\ufffd"):  # a multi-byte character still incomplete
            continue
        yield text[len(shown):]
        shown = text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M-Instruct), a .gguf file or a HF directory")
    parser.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        validate_sampling(args.max_tokens, args.temperature, args.top_k, args.top_p)
        jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
        generator = Generator.load(args.model)
        ids = generator.prompt_ids(args.prompt, raw=args.raw)
        pieces = stream_text(generator, ids, max_tokens=args.max_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except ValueError as e:
        parser.error(str(e))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
