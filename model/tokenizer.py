"""Tokenizers built from GGUF metadata (byte-level BPE, or Gemma's SentencePiece BPE) as
transformers builds them, or read from a HF tokenizer.json.

Chat templates are the model's own Jinja templates, rendered the way transformers
renders them (sandboxed, trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import (AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

# GPT-2's split pattern; llama.cpp's pre-tokenizer names map onto it (plus digit rules).
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # their "llama" vocabularies are Gemma's BPE


def _gguf_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def split(pattern: str):
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated")

    if pre in ("smollm", "starcoder", "refact", "default", "gpt-2", "gpt2"):
        steps = [split(_GPT2_PATTERN), byte_level]
        if pre in ("smollm", "starcoder", "refact"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        return pre_tokenizers.Sequence(steps)
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([split(_LLAMA3_PATTERN), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([split(_QWEN2_PATTERN), byte_level])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: smollm, starcoder, "
                     "refact, gpt2, llama-bpe, qwen2")


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None,
                 bos_token_id: int | None, eos_token_id: int | None):
        self._tok = tokenizer  # its post-processor adds BOS where the model wants one
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_str(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False):
        """Render `messages` ([{"role", "content"}]) with the model's chat template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; use a plain prompt")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        text = _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.token_to_str(self.bos_token_id),
            eos_token=self.token_to_str(self.eos_token_id))
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer() -> Tokenizer:
    """One token per byte (id = the byte's value, 256 tokens), no chat template, no BOS / EOS:
    the tokenizer of the random-weight presets (model.load("deepseek-v4.1-tiny"))."""
    # GPT-2's printable stand-in of each byte, which the byte-level pre-tokenizer emits
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, None, None, None)


def _merges_by_position(tokens: list[str]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens: earlier tokens first, longer left pieces first.

    Gemma GGUFs store no merges. transformers recovers them from the vocabulary
    (`generate_merges`) ranked by token position, because Gemma's scores do not follow
    its merge order; this is the same list."""
    vocab = set(tokens)
    return [(left, right) for t in tokens for k in range(len(t) - 1, 0, -1)
            if (left := t[:k]) in vocab and (right := t[k:]) in vocab]


def _gemma_bpe(tokens: list[str], unk: str) -> HFTokenizer:
    """transformers' GemmaTokenizer pipeline: spaces become "▁", BPE falls back to <0xNN> bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_by_position(tokens), unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _add_gguf_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special, user-defined ones plain added tokens (as transformers
    adds them): both are matched whole, but only special ones are skipped when decoding.
    A user-defined token the vocabulary spells differently (Gemma's runs of spaces) is not added."""
    vocab = tok.get_vocab()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED and t in vocab])


def _bos_eos_processor(tokens: list[str], bos: int | None, eos: int | None):
    """transformers' template: BOS before and / or EOS after each sequence (None: neither)."""
    if bos is None and eos is None:
        return None

    def sequence(name: str, type_id: int) -> str:
        first = [tokens[bos]] if bos is not None else []
        last = [tokens[eos]] if eos is not None else []
        return " ".join(f"{part}:{type_id}" for part in first + [f"${name}"] + last)

    return processors.TemplateProcessing(single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
                                         special_tokens=[(tokens[i], i) for i in (bos, eos) if i is not None])


def tokenizer_from_gguf(reader) -> Tokenizer:
    from model.gguf_loader import field

    kind = field(reader, "tokenizer.ggml.model")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, field(reader, "tokenizer.ggml.merges"),
                              field(reader, "tokenizer.ggml.pre", "default"))
        add_bos = field(reader, "tokenizer.ggml.add_bos_token", False)
    elif kind == "llama" and field(reader, "general.architecture") in _GEMMA_ARCHITECTURES:
        # Gemma stores its runs of spaces as real spaces but looks them up as "▁▁..."
        spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        unk = field(reader, "tokenizer.ggml.unknown_token_id")
        tok = _gemma_bpe(spelled, "<unk>" if unk is None else spelled[unk])
        add_bos = field(reader, "tokenizer.ggml.add_bos_token", True)  # llama.cpp's SentencePiece default
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2 (byte-level BPE), "
                         f"llama (SentencePiece BPE) for architectures {', '.join(_GEMMA_ARCHITECTURES)}")
    _add_gguf_tokens(tok, tokens, field(reader, "tokenizer.ggml.token_type"))
    bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
    tok.post_processor = _bos_eos_processor(tokens, bos if add_bos else None,
                                            eos if field(reader, "tokenizer.ggml.add_eos_token", False) else None)
    return Tokenizer(tok, field(reader, "tokenizer.chat_template"), bos, eos)


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
        raise ValueError(f"{path} has no tokenizer.json")
    tok = HFTokenizer.from_file(tok_file)
    cfg: dict = {}
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()

    def token_id(name: str) -> int | None:
        value = cfg.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return tok.token_to_id(value) if value else None

    eos = token_id("eos_token")
    if eos is None and os.path.exists(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
    return Tokenizer(tok, template, token_id("bos_token"), eos)
