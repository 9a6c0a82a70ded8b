"""Training text every machine has, tokenized by the target, and the draft vocabulary.

Two kinds of sequences, each [N, seq_len] int32 with a bool loss mask:
- text: the standard library's documentation (pydoc_data.topics) and sources,
  concatenated (EOS between documents) and cut into full windows;
- chat: questions about that material answered by the target itself (greedy), one
  conversation per row padded with EOS, the loss only on the answer — so the draft
  learns what the target really says.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import model

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class ByteTokenizer:
    """UTF-8 bytes as token ids, EOS = 256: lets a tiny random target train on real text."""

    vocab_size = 257
    eos_token_id = 256
    bos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _stdlib_sources(seed: int) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        paths += [os.path.join(directory, f) for f in sorted(files) if f.endswith(".py")]
    np.random.default_rng(seed).shuffle(paths)
    return paths


def corpus_texts(seed: int = 0) -> Iterator[str]:
    """pydoc's topic documentation, then standard-library sources in a seeded order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]
    for path in _stdlib_sources(seed):
        try:
            with open(path, encoding="utf-8") as f:
                yield f.read()
        except (OSError, UnicodeDecodeError):
            continue


def pack_text(tokenizer, num_tokens: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """About `num_tokens` tokens of corpus text as int32 [N, seq_len] windows."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    stream: list[int] = []
    for text in corpus_texts(seed):
        stream += tokenizer.encode(text, add_special_tokens=False) + [eos]
        if len(stream) >= num_tokens:
            break
    stream = stream[:num_tokens]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"corpus gave {len(stream)} tokens, fewer than one window of {seq_len}")
    return np.asarray(stream[:n * seq_len], np.int32).reshape(n, seq_len)


_QUESTIONS = ("Explain {} in Python, with a short example.",
              "What is {} used for in Python?",
              "Write a short tutorial about {} in Python.",
              "Summarize the Python documentation on {}.")


def chat_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Questions about pydoc topics and standard-library modules."""
    from pydoc_data.topics import topics

    modules = sorted({os.path.splitext(os.path.basename(p))[0] for p in _stdlib_sources(seed)}
                     - {"__init__", "__main__"})
    subjects = [f"'{t}'" for t in sorted(topics)] + [f"the {m} module" for m in modules]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(subjects), size=num_prompts, replace=num_prompts > len(subjects))
    return [_QUESTIONS[rng.integers(len(_QUESTIONS))].format(subjects[i]) for i in picks]


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _greedy_step(params, config, tokens, positions, cache, last_index):
    logits, cache = model.forward(params, config, tokens, positions, cache, last_index)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache


def greedy_answers(params: dict, config, prompts: Sequence[Sequence[int]], max_tokens: int,
                   width: int | None = None) -> np.ndarray:
    """The target's greedy continuation of each prompt (padded to `width`): int32 [B, max_tokens]."""
    batch, width = len(prompts), width or max(len(p) for p in prompts)
    tokens = np.zeros((batch, width), np.int32)
    positions = np.full((batch, width), -1, np.int32)  # padding: not written, sees nothing
    for i, p in enumerate(prompts):
        tokens[i, :len(p)], positions[i, :len(p)] = p, np.arange(len(p))
    lens = np.array([len(p) for p in prompts], np.int32)
    cache = model.init_cache(config, batch, width + max_tokens)
    nxt, cache = _greedy_step(params, config, jnp.asarray(tokens), jnp.asarray(positions), cache,
                              jnp.asarray(lens - 1))
    out = [nxt]
    for step in range(1, max_tokens):
        nxt, cache = _greedy_step(params, config, nxt[:, None], jnp.asarray(lens + step - 1)[:, None],
                                  cache, jnp.zeros(batch, jnp.int32))
        out.append(nxt)
    return np.stack([np.asarray(o) for o in out], axis=1)


def regenerate_chats(params: dict, config, tokenizer, prompts: Sequence[str], max_tokens: int,
                     seq_len: int, batch_size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """The target's greedy answers to `prompts` through its chat template.

    Returns (tokens int32 [N, seq_len], loss_mask bool [N, seq_len]) with the mask on
    the answer (up to and including its EOS); rows are padded with EOS.
    """
    eos = tokenizer.eos_token_id
    rows, masks = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                  add_special_tokens=False)[-(seq_len // 4):]
                 for p in prompts[start:start + batch_size]]
        # Fixed batch size and prompt width: a short last batch would compile a new shape.
        padded = chunk + [chunk[0]] * (batch_size - len(chunk))
        answers = greedy_answers(params, config, padded, max_tokens, seq_len // 4)
        for ids, answer in zip(chunk, answers):
            answer = list(answer)
            if eos in answer:
                answer = answer[:answer.index(eos) + 1]
            seq = (ids + answer)[:seq_len]
            row = np.full(seq_len, eos, np.int32)
            row[:len(seq)] = seq
            mask = np.zeros(seq_len, bool)
            mask[len(ids):len(seq)] = True
            rows.append(row)
            masks.append(mask)
    return np.stack(rows), np.stack(masks)


def select_draft_vocab(tokens: np.ndarray, loss_mask: np.ndarray, size: int,
                       vocab_size: int) -> np.ndarray:
    """The `size` most frequent target ids among the tokens to predict (ties and unseen
    ids filled by lowest id), sorted."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = np.bincount(tokens[loss_mask].ravel(), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    return np.sort(order[:size]).astype(np.int32)
