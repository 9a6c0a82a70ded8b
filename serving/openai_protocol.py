"""OpenAI request bodies in, `SamplingParams` out; `RequestOutput` deltas in, OpenAI JSON out.

Fields follow the OpenAI API and vLLM's extras (`top_k`, `min_p`, `ignore_eos`,
`stop_token_ids`, `structured_outputs`, `repetition_penalty`, `min_tokens`, `bad_words`),
as top-level body fields. Every field is checked here or by `SamplingParams` (a ValueError
naming it); a field neither knows is an error, and so is a known field set to something
kvfold does not do (`echo`, `suffix`, tools).
JSON null means "not given", as in vLLM's request models.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Callable

from serving.llm import check_messages
from serving.params import (MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, check_bool, check_int,
                            check_text)

COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                 "stream_options", "user", "top_k", "min_p", "ignore_eos", "stop_token_ids",
                 "response_format", "structured_outputs", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "best_of", "min_tokens", "bad_words")
COMPLETION_FIELDS = COMMON_FIELDS + ("prompt", "logprobs", "echo", "suffix")
CHAT_FIELDS = COMMON_FIELDS + ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools",
                               "tool_choice")
STRUCTURED_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsParams))
# Known fields that must keep their neutral value: kvfold does not implement them.
NEUTRAL = {"echo": (False,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",)}


@dataclasses.dataclass(frozen=True)
class Request:
    """A parsed body: what to add to the engine and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list  # LLM prompts (text, or {"prompt_token_ids": [...]})
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top logprobs per token; chat: top_logprobs (logprobs=true)


def _given(body: dict) -> dict:
    return {k: v for k, v in body.items() if v is not None}


def _check_fields(body, allowed: tuple[str, ...], what: str) -> dict:
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} for {what}; known: {sorted(allowed)}")
    body = _given(body)
    for name, neutral in NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise ValueError(f"{name} is not supported by kvfold (only {neutral[0]!r} is accepted), "
                             f"got {body[name]!r:.80}")
    return body


def _structured(body: dict) -> StructuredOutputsParams | None:
    """`response_format` (OpenAI) or `structured_outputs` (vLLM) as StructuredOutputsParams."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    result = None
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text" and set(fmt) == {"type"}:
            result = None
        elif kind == "json_object" and set(fmt) == {"type"}:
            result = StructuredOutputsParams(json_object=True)
        elif kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
            spec = fmt["json_schema"]
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict) \
                    or set(spec) - {"name", "description", "schema", "strict"}:
                raise ValueError("response_format json_schema must be {'name': ..., 'schema': {...}, "
                                 f"'strict': ...}} with the schema a JSON object, got {spec!r:.120}")
            result = StructuredOutputsParams(json=spec["schema"])
        else:
            raise ValueError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                             "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}, "
                             f"got {fmt!r:.120}")
    if so is not None:
        if not isinstance(so, dict) or set(so) - set(STRUCTURED_KEYS):
            raise ValueError(f"structured_outputs must be an object with one of {list(STRUCTURED_KEYS)}, "
                             f"got {so!r:.120}")
        if result is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        result = StructuredOutputsParams(**so)
    return result


def _sampling(body: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    if body.get("best_of", body.get("n", 1)) != body.get("n", 1):
        raise ValueError("best_of is not supported by kvfold (only best_of == n is accepted), "
                         f"got {body['best_of']!r}")
    kwargs = {k: body[k] for k in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                   "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "min_tokens", "bad_words") if k in body}
    if "logit_bias" in body:  # JSON object keys are strings: {"50256": -100}
        bias = body["logit_bias"]
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
            raise ValueError(f"logit_bias must map token ids (as strings) to biases, got {bias!r:.80}")
        kwargs["logit_bias"] = {int(k): v for k, v in bias.items()}
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=_structured(body),
                          **kwargs)


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = check_bool("stream", body.get("stream", False))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ValueError("stream_options can only be given with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ValueError(f"stream_options must be {{'include_usage': bool}}, got {options!r:.80}")
    return stream, check_bool("stream_options.include_usage", options.get("include_usage", False))


def _model(body: dict, served: str | tuple[str, ...]) -> str:
    """The model a body names: `served` is the server's name, or its names (the base
    model's first, then its LoRA adapters'); no model field means the first."""
    names = (served,) if isinstance(served, str) else tuple(served)
    model = body.get("model", names[0])
    if model not in names:
        raise LookupError(f"the model {model!r} does not exist; this server serves "
                          f"{', '.join(repr(n) for n in names)}")
    return model


def completion_request(body, served_model: str | tuple[str, ...]) -> Request:
    """A /v1/completions body; ValueError (or LookupError for the model) names what is wrong."""
    body = _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    model = _model(body, served_model)
    if "prompt" not in body:
        raise ValueError("prompt is required")
    prompts = _prompts(body["prompt"])
    logprobs = body.get("logprobs")
    max_tokens = body.get("max_tokens", 16)  # OpenAI's completions default
    stream, include_usage = _stream_options(body)
    params = _sampling(body, max_tokens, logprobs)
    return Request("completion", model, prompts, params, stream, include_usage, params.logprobs)


def _prompts(prompt) -> list:
    """OpenAI's prompt forms: a string, a list of strings, a token list, a list of token lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of "
                         f"token id lists (non-empty), got {json.dumps(prompt)[:80]}")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    if any(isinstance(p, (list, str, dict)) for p in prompt):
        raise ValueError("prompt must not mix strings, token ids and token id lists")
    return [{"prompt_token_ids": prompt}]


def chat_messages(body, served_model: str | tuple[str, ...]) -> tuple[dict, list[dict]]:
    """The checked body and its messages (content parts joined into one string) of a
    /v1/chat/completions body."""
    body = _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    body["model"] = _model(body, served_model)
    if "messages" not in body:
        raise ValueError("messages is required")
    messages = body["messages"]
    if isinstance(messages, list):
        messages = [_join_parts(i, m) for i, m in enumerate(messages)]
    check_messages(messages)
    return body, messages


def _join_parts(i: int, message):
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) != {"type", "text"}:
            raise ValueError(f"message {i} content parts must be {{'type': 'text', 'text': str}} (kvfold "
                             f"serves text models), got {part!r:.80}")
        texts.append(check_text(f"message {i} content text", part["text"]))
    return {**message, "content": "".join(texts)}


def chat_request(body: dict, prompt_ids: list[int], max_model_len: int) -> Request:
    """A checked chat body (chat_messages) over its templated prompt."""
    logprobs = check_bool("logprobs", body.get("logprobs", False))
    top = body.get("top_logprobs")
    if top is not None and not logprobs:
        raise ValueError("top_logprobs needs logprobs=true")
    top = check_int("top_logprobs", top, 0, MAX_LOGPROBS) if top is not None else 0
    given = [k for k in ("max_completion_tokens", "max_tokens") if k in body]
    # vLLM's default: whatever room the context leaves (the engine rejects a prompt that leaves none)
    max_tokens = body[given[0]] if given else max(max_model_len - len(prompt_ids), 1)
    stream, include_usage = _stream_options(body)
    params = _sampling(body, max_tokens, top if logprobs else None)
    return Request("chat", body["model"], [{"prompt_token_ids": prompt_ids}], params, stream,
                   include_usage, params.logprobs)


# -- responses -------------------------------------------------------------------------


def error_body(message: str, type_: str, code: int | str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Responder:
    """Turns one call's RequestOutput deltas into OpenAI chunks and the final response.

    Choice k is sample o.index of prompt i, k = i * n + o.index (OpenAI's order).
    """

    def __init__(self, request: Request, decode_token: Callable[[int], str]):
        self.request, self.decode_token = request, decode_token
        self.id = ("chatcmpl-" if request.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.choices: dict[int, dict] = {}  # k -> accumulated text, logprob parts, finish
        self._text_offset: dict[int, int] = {}

    def _choice(self, k: int) -> dict:
        return self.choices.setdefault(k, {"text": [], "logprobs": [], "finish_reason": None,
                                           "stop_reason": None})

    def add(self, deltas) -> list[dict]:
        """Take one batch of deltas; returns the chunk payloads of the choices that changed."""
        chunks = []
        for i, out in deltas:
            if i not in self._text_offset:
                self._text_offset[i] = 0
                self.prompt_tokens += len(out.prompt_token_ids)
            for o in out.outputs:
                k = i * self.request.params.n + o.index
                self.completion_tokens += len(o.token_ids)
                logprobs = self._logprobs(k, o) if self.request.logprobs is not None else None
                c = self._choice(k)
                c["text"].append(o.text)
                if logprobs is not None:
                    c["logprobs"].append(logprobs)
                c["finish_reason"], c["stop_reason"] = o.finish_reason, o.stop_reason
                if o.text or o.finish_reason or (logprobs is not None and o.token_ids):
                    chunks.append(self._chunk_choice(k, o.text, logprobs, o.finish_reason, o.stop_reason))
        return chunks

    def _logprobs(self, k: int, o) -> dict:
        entries = o.logprobs or []
        if self.request.kind == "chat":
            def item(token: int, logprob: float) -> dict:
                s = self.decode_token(token)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8", errors="replace"))}
            content = []
            for token, entry in zip(o.token_ids, entries):
                top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.request.logprobs]
                content.append({**item(token, entry[token]), "top_logprobs": [item(t, lp) for t, lp in top]})
            return {"content": content}
        tokens, offsets = [], []
        offset = self._text_offset.setdefault(k, 0)
        for token in o.token_ids:
            tokens.append(self.decode_token(token))
            offsets.append(offset)
            offset += len(tokens[-1])
        self._text_offset[k] = offset
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(o.token_ids, entries)],
                "top_logprobs": [{self.decode_token(t): lp for t, lp in e.items()} for e in entries],
                "text_offset": offsets}

    def _chunk_choice(self, k: int, text: str, logprobs, finish_reason, stop_reason) -> dict:
        if self.request.kind == "chat":
            return {"index": k, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chunk(self, choices: list[dict], usage: bool = False) -> dict:
        obj = "chat.completion.chunk" if self.request.kind == "chat" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.request.model,
                "choices": choices}
        if usage:
            body["usage"] = self.usage()
        return body

    def role_chunk(self, num_prompts: int) -> dict:
        """A chat stream's first chunk: each choice's role."""
        n = num_prompts * self.request.params.n
        return self.chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for k in range(n)])

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def response(self) -> dict:
        """The whole (non-streamed) response."""
        choices = []
        for k in sorted(self.choices):
            c = self.choices[k]
            text = "".join(c["text"])
            logprobs = _merge_logprobs(c["logprobs"]) if self.request.logprobs is not None else None
            if self.request.kind == "chat":
                choices.append({"index": k, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": c["finish_reason"]})
            else:
                choices.append({"index": k, "text": text, "logprobs": logprobs,
                                "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"]})
        obj = "chat.completion" if self.request.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model,
                "choices": choices, "usage": self.usage()}


def _merge_logprobs(parts: list[dict]) -> dict:
    """Concatenate the per-delta logprob objects of one choice."""
    merged: dict = {}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged or {"content": []}
