"""kvfold's OpenAI-compatible HTTP server (FastAPI on uvicorn); docs/server.md is the manual.

    python -m serving.server --model default --port 8000      # or: kvfold serve --model ...

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events
when "stream": true), GET /v1/models, /health and /metrics (Prometheus). One engine
thread steps the model (serving.async_llm.AsyncLLM); a client that disconnects aborts
its requests. Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
400 for a bad request (the engine never sees it), 401 without the API key, 413 for a
body over the size cap, 429 (with Retry-After) when the waiting queue is full, 503 when
the engine thread has died.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import secrets
import sys
import time

import httpx
import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from model import compile_cache
from model.weights import WEIGHTS_DTYPES
from serving import openai_protocol as protocol
from serving.async_llm import AsyncLLM, EngineDead, Overloaded, Stream
from serving.kv_transfer import DEFAULT_PULL_TIMEOUT_S, WAITING, KVHandle, KVReceiver, KVSender
from serving.kv_tiers import HOST_MEMORIES, PREFETCH_POLICIES, STORAGE_BACKENDS, WRITE_POLICIES, TierConfig
from serving.metrics import ServerMetrics
from serving.params import LoRARequest, SamplingParams

DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_MAX_WAITING_TOKENS = 2**18
DEFAULT_MAX_REQUEST_BODY_BYTES = 2**20
API_KEY_ENV = "KVFOLD_API_KEY"
KV_ROLES = (None, "prefill", "decode")  # a disaggregated pair's sides (serving/router.py), or neither
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class APIError(Exception):
    """An error answered with OpenAI's body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | int | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers
        self.code = status if code is None else code

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, self.type, self.code, self.param),
                            status_code=self.status, headers=self.headers)


def _bad_request(e: ValueError, fields: tuple[str, ...]) -> APIError:
    """A ValueError from parsing, SamplingParams or the LLM, naming its field when it starts with one."""
    message = str(e)
    first = message.split(" ", 1)[0]
    return APIError(400, message, param=first if first in fields else None)


async def expire_offers(sender, period_s: float | None = None) -> None:
    """Drop a prefill instance's offered copies whose time-to-live has passed, every
    period_s (default: a quarter of the TTL, at most 5 s), also while no request comes."""
    period = min(sender.ttl_s / 4, 5.0) if period_s is None else period_s
    while True:
        await asyncio.sleep(period)
        sender.expire()


def create_app(llm, served_model_name: str = "default", api_key: str | None = None,
               max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
               max_waiting_tokens: int | None = DEFAULT_MAX_WAITING_TOKENS,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               lora_modules: dict[str, str] | None = None, kv_role: str | None = None,
               kv_client=None, kv_address: str = "127.0.0.1:0") -> FastAPI:
    """The app over `llm` (a serving.LLM). Its lifespan starts and stops the engine thread;
    in-process callers that skip lifespan events (httpx.ASGITransport) use
    `with app.state.engine:` instead. lora_modules: {name: PEFT directory} served as
    models of their own (a request's "model" picks one; vLLM's --lora-modules); the
    adapters are read and checked here, so a bad one stops the server from starting.

    kv_role: one side of a disaggregated pair (serving/router.py), or None. "prefill"
    adds POST /kv/prefill (run a request's prompt, offer its pages: serving/kv_transfer.py;
    with `kv_transfer_params` it first pulls another prefill instance's cached prefix),
    /kv/offer (offer a prompt's cached prefix without running it), /kv/serve and /kv/ack
    (the pull's handshake); "decode" takes `kv_transfer_params` (an offer and its sender's
    URL, "control") in /v1 bodies and pulls the pages before the request runs. kv_client:
    the httpx.AsyncClient an instance reaches senders with.
    kv_address: where this instance's KV transfer server listens (host:port; port 0 picks
    one), an address the other side can reach."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    if kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {list(KV_ROLES)}, got {kv_role!r}")
    loras: dict[str, LoRARequest] = {}  # served adapters by name (changed by load / unload)
    lora_ids = itertools.count(1)

    def add_lora(name, path) -> LoRARequest:
        if name == served_model_name or name in loras:
            raise ValueError(f"lora_name {name!r} is already served")
        request = LoRARequest(name, next(lora_ids), path)
        llm.add_lora(request)  # reads and checks the adapter
        loras[name] = request
        return request

    for name, path in (lora_modules or {}).items():
        add_lora(name, path)
    if not isinstance(max_request_body_bytes, int) or max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be a positive int, got {max_request_body_bytes!r}")
    metrics = ServerMetrics(lambda: engine.stats)
    engine = AsyncLLM(llm, max_waiting_requests, max_waiting_tokens, observer=metrics)
    tokenizer = llm.tokenizer
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        with engine:
            sender = getattr(app.state, "kv_sender", None)
            expiring = asyncio.create_task(expire_offers(sender)) if sender is not None else None
            try:
                yield
            finally:
                if expiring is not None:
                    expiring.cancel()

    app = FastAPI(title="kvfold", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.llm = engine, metrics, llm

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if e.status in (400, 401, 413, 429):
            metrics.rejected.labels(code=str(e.status)).inc()
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404
                        else "invalid_request_error").response()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_body_bytes:
            raise APIError(413, f"the request body has {length} bytes, more than the server's "
                           f"max_request_body_bytes={max_request_body_bytes}", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_body_bytes:
                raise APIError(413, f"the request body is over the server's max_request_body_bytes="
                               f"{max_request_body_bytes}", code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    def parse(fn, *args, fields: tuple[str, ...]):
        try:
            return fn(*args)
        except LookupError as e:
            raise APIError(400, str(e.args[0]), code="model_not_found", param="model") from None
        except ValueError as e:
            raise _bad_request(e, fields) from None

    async def add(prompts, params, lora, fields: tuple[str, ...], remote_kv=None) -> Stream:
        try:
            return await engine.add(prompts, params, lora, remote_kv)
        except ValueError as e:
            raise _bad_request(e, fields) from None
        except Overloaded as e:
            raise APIError(429, str(e), "rate_limit_error", "server_overloaded",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", "engine_dead") from None

    async def tokenized(req: protocol.Request, fields: tuple[str, ...]) -> dict:
        """A one-prompt request's prompt as the engine will see it: {"prompt", "prompt_token_ids"}
        (tokenized once: adding it does not tokenize again)."""
        if len(req.prompts) != 1:
            raise APIError(400, "disaggregated serving takes one prompt per request", param="prompt")
        try:
            ((text, ids, _, _),) = await asyncio.to_thread(llm._requests, req.prompts, req.params, None)
        except ValueError as e:
            raise _bad_request(e, fields) from None
        return {"prompt": text, "prompt_token_ids": list(ids)}

    async def serve(request: Request, req: protocol.Request, fields: tuple[str, ...], kv_params=None):
        prompts, remote = req.prompts, None
        if kv_params is not None:
            prompt = await tokenized(req, fields)
            prompts, remote = [prompt], await receive_kv(kv_params, prompt["prompt_token_ids"])
        stream = await add(prompts, req.params, loras.get(req.model), fields,
                           None if remote is None else [remote])
        responder = protocol.Responder(req, lambda t: tokenizer.decode([t]))
        if req.stream:
            return StreamingResponse(_events(engine, stream, responder, len(req.prompts)),
                                     media_type="text/event-stream")
        await _collect(engine, request, stream, responder)
        return JSONResponse(responder.response())

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def kv_params_of(body):
        """A decode instance's `kv_transfer_params`, taken out of the body (None without)."""
        if kv_role != "decode" or not isinstance(body, dict):
            return None
        return body.pop("kv_transfer_params", None)

    async def completion(body) -> protocol.Request:
        return parse(protocol.completion_request, body, (served_model_name, *loras),
                     fields=protocol.COMPLETION_FIELDS)

    async def chat(body) -> protocol.Request:
        fields = protocol.CHAT_FIELDS
        body, messages = parse(protocol.chat_messages, body, (served_model_name, *loras), fields=fields)
        try:
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=True)
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return parse(protocol.chat_request, body, ids, llm.max_model_len, fields=fields)

    @v1.post("/completions")
    async def completions(request: Request):
        body = await read_json(request)
        kv_params = kv_params_of(body)
        return await serve(request, await completion(body), protocol.COMPLETION_FIELDS, kv_params)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        kv_params = kv_params_of(body)
        return await serve(request, await chat(body), protocol.CHAT_FIELDS, kv_params)

    @v1.get("/models")
    async def models():
        base = {"id": served_model_name, "object": "model", "created": created, "owned_by": "kvfold",
                "root": served_model_name, "parent": None, "max_model_len": llm.max_model_len}
        adapters = [{**base, "id": name, "root": r.lora_path, "parent": served_model_name}
                    for name, r in loras.items()]
        return {"object": "list", "data": [base, *adapters]}

    if llm.runner.lora is not None:
        def lora_body(body, keys: tuple[str, ...]) -> dict:
            if not isinstance(body, dict) or set(body) != set(keys):
                raise APIError(400, f"the body must be a JSON object with exactly {list(keys)}")
            for key in keys:
                if not isinstance(body[key], str) or not body[key]:
                    raise APIError(400, f"{key} must be a non-empty string", param=key)
            return body

        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            """vLLM's runtime adapter loading: {"lora_name", "lora_path"}; the adapter is
            read and checked before it is served."""
            body = lora_body(await read_json(request), ("lora_name", "lora_path"))
            try:
                await asyncio.to_thread(add_lora, body["lora_name"], body["lora_path"])
            except ValueError as e:
                raise APIError(400, str(e)) from None
            return {"lora_name": body["lora_name"]}

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            """{"lora_name"}: stop serving an adapter (400 while its requests run)."""
            name = lora_body(await read_json(request), ("lora_name",))["lora_name"]
            if name not in loras:
                raise APIError(404, f"no LoRA adapter {name!r} is served", "not_found_error", param="lora_name")
            try:
                await asyncio.to_thread(llm.remove_lora, loras[name].lora_int_id)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            del loras[name]
            return {"lora_name": name}

    app.include_router(v1)
    kv = APIRouter(prefix="/kv", dependencies=[Depends(authorize)])

    @app.get("/kv/role")  # no API key, like /health: a router asks it
    async def kv_role_():
        return {"role": kv_role}

    @app.get("/kv/stats")  # no API key, like /metrics
    async def kv_stats():
        """Transfers by end state: on a prefill instance those it offered ("offered" too)
        and, as "pulled", those it pulled from other prefill instances; on a decode
        instance those it pulled. "pages" and "seconds": the pulled transfers' pages and
        time (handshake, pull, and the wait for the engine to write them into its pool)."""
        if kv_role is None:
            return {"role": kv_role}
        pulled = {"pages": receiver.pages, "seconds": receiver.seconds}
        if kv_role == "prefill":
            return {"role": kv_role, "transfers": dict(sender.counts), "pulled": dict(receiver.counts), **pulled}
        return {"role": kv_role, "transfers": dict(receiver.counts), **pulled}

    @app.get("/kv/events")  # no API key: chained page hashes only
    async def kv_events(after: int = 0):
        """The prefix cache's block stored / removed events after number `after` (a
        router's prefix index): {"root", "page_size", "next", "events": [[n, kind, [key hex]]]};
        when events after `after` were dropped, "reset": true and "keys": every cached
        page's key instead."""
        radix = llm.engine.kv.radix
        if radix is None or radix.events is None:
            raise APIError(404, "this instance records no prefix-cache events (a prefill instance does)",
                           "not_found_error")

        def read():  # on the engine thread, which changes the cache
            head = {"root": radix.root.hash.hex(), "page_size": radix.page_size, "next": radix.num_events}
            if radix.events and radix.events[0][0] > after + 1:
                return {**head, "reset": True, "keys": [k.hex() for n in radix.nodes(0) for k in
                                                        n.page_keys(radix.page_size)]}
            return {**head, "events": [[n, kind, [k.hex() for k in keys]] for n, kind, keys in radix.events
                                       if n > after]}
        try:
            return await engine.call(read)
        except EngineDead as e:
            raise APIError(503, str(e), "server_error", "engine_dead") from None

    if kv_role == "prefill":
        sender = app.state.kv_sender = KVSender(llm, kv_address)
        if llm.engine.kv.radix is not None:
            llm.engine.kv.radix.record_events()

        @kv.post("/prefill")
        async def kv_prefill(request: Request):
            """{"kind": "completion" | "chat", "request": an OpenAI body}: run the prompt and
            offer its pages; {"kv_transfer_params": a KVHandle's JSON or null (nothing
            cached), "prompt_token_ids"}."""
            body = await read_json(request)
            kind, inner = (body.get("kind"), body.get("request")) if isinstance(body, dict) else (None, None)
            if kind not in ("completion", "chat") or not isinstance(inner, dict):
                raise APIError(400, 'the body must be {"kind": "completion" | "chat", "request": {...}}')
            inner = {k: v for k, v in inner.items() if k not in ("stream", "stream_options")}
            req = await (completion if kind == "completion" else chat)(inner)
            fields = protocol.COMPLETION_FIELDS if kind == "completion" else protocol.CHAT_FIELDS
            prompt = await tokenized(req, fields)
            ids = prompt["prompt_token_ids"]
            pulled = body.get("kv_transfer_params")  # another prefill instance's cached prefix
            remote = None if pulled is None else await receive_kv(pulled, ids)
            stream = await add([prompt], SamplingParams(temperature=0, max_tokens=1), None, fields,
                               None if remote is None else [remote])
            try:
                async for _ in stream:
                    pass
            except EngineDead as e:
                raise APIError(503, str(e), "server_error", "engine_dead") from None
            handle = await engine.call(sender.offer, ids)
            return {"kv_transfer_params": None if handle is None else handle.to_json(), "prompt_token_ids": ids}

        @kv.post("/offer")
        async def kv_offer(request: Request):
            """{"prompt_token_ids"}: offer the pages cached here for a prompt's prefix (to
            another prefill instance, which the router sends the request to); no prompt
            runs. {"kv_transfer_params": a KVHandle's JSON or null (nothing cached)}."""
            body = await read_json(request)
            ids = body.get("prompt_token_ids") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not ids or \
                    not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise APIError(400, "prompt_token_ids must be a non-empty list of token ids",
                               param="prompt_token_ids")
            handle = await engine.call(sender.offer, ids)
            return {"kv_transfer_params": None if handle is None else handle.to_json()}

        def uuid_of(body) -> int:
            if not isinstance(body, dict) or isinstance(body.get("uuid"), bool) or \
                    not isinstance(body.get("uuid"), int):
                raise APIError(400, "the body must hold an integer uuid", param="uuid")
            return body["uuid"]

        @kv.post("/serve")
        async def kv_serve(request: Request):
            """{"uuid"}: the decode instance pulls it now (404: unknown, expired or served)."""
            try:
                sender.serve(uuid_of(await read_json(request)))
            except ValueError as e:
                raise APIError(404, str(e), "not_found_error", param="uuid") from None
            return {}

        @kv.post("/ack")
        async def kv_ack(request: Request):
            """{"uuid", "ok"}: the decode instance has the pages (or gave up): drop the copy."""
            body = await read_json(request)
            ok = body.get("ok", True) if isinstance(body, dict) else True
            if not isinstance(ok, bool):
                raise APIError(400, "ok must be a boolean", param="ok")
            try:
                sender.ack(uuid_of(body), ok)
            except ValueError as e:
                raise APIError(409, str(e), param="uuid") from None
            return {}

    async def receive_kv(params, ids: list[int]):
        """Start pulling a prefill instance's pages for `ids`: the RemoteKV the engine adopts
        them from (EngineCore.add_request's remote_kv), or None when the transfer failed
        before the pull (the prompt is computed here). A bad `kv_transfer_params` is a 400."""
        try:
            if not isinstance(params, dict) or not isinstance(params.get("control"), str):
                raise ValueError("it needs the sender's URL as control")
            handle = KVHandle.from_json({k: v for k, v in params.items() if k != "control"})
        except ValueError as e:
            raise APIError(400, f"kv_transfer_params: {e}", param="kv_transfer_params") from None
        control = params["control"].rstrip("/")

        async def ack(ok: bool) -> None:
            try:
                await kv_http.post(f"{control}/kv/ack", json={"uuid": handle.uuid, "ok": ok})
            except httpx.HTTPError:
                pass  # the sender's time-to-live drops its copy
        if receiver.begin(handle, ids).state != WAITING:
            return None
        try:
            (await kv_http.post(f"{control}/kv/serve", json={"uuid": handle.uuid})).raise_for_status()
        except httpx.HTTPError as e:
            receiver.fail(handle, e)
            await ack(False)
            return None
        remote = receiver.pull_later(handle, ids, pulls)

        async def acknowledge():  # once the bytes are here (or not), the sender's copy can go
            await asyncio.wait([asyncio.wrap_future(remote.future)])
            await ack(remote.future.exception() is None)
        background.add(task := asyncio.create_task(acknowledge()))
        task.add_done_callback(background.discard)
        return remote

    if kv_role is not None:  # a prefill instance pulls other prefill instances' prefixes
        receive_at = kv_address if kv_role == "decode" else f"{kv_address.rpartition(':')[0]}:0"
        receiver = app.state.kv_receiver = KVReceiver(llm, receive_at)
        kv_http = kv_client if kv_client is not None else httpx.AsyncClient(  # instances share the API key
            timeout=DEFAULT_PULL_TIMEOUT_S, headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        pulls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvfold-kv-pull")
        background = app.state.kv_acks = set()  # the acknowledgements under way (asyncio tasks)
    app.include_router(kv)

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, f"the engine thread is not running: {engine.error!r}", "server_error",
                           "engine_dead")
        return {}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _events(engine: AsyncLLM, stream: Stream, responder: protocol.Responder, num_prompts: int):
    """Server-sent events: a chunk per choice delta, a usage chunk when asked, then [DONE].
    Starlette cancels this generator when the client disconnects: the requests are aborted."""
    done = False
    try:
        if responder.request.kind == "chat":
            yield _sse(responder.role_chunk(num_prompts))
        async for deltas in stream:
            for choice in responder.add(deltas):
                yield _sse(responder.chunk([choice]))
        done = True
        if responder.request.include_usage:
            yield _sse(responder.chunk([], usage=True))
    except EngineDead as e:
        done = True
        yield _sse(protocol.error_body(str(e), "server_error", "engine_dead"))
    finally:
        if not done:
            engine.abort(stream)
    yield _sse("[DONE]")


async def _collect(engine: AsyncLLM, request: Request, stream: Stream, responder: protocol.Responder) -> None:
    """Read the stream to its end, aborting it if the client goes away meanwhile."""
    done = False
    try:
        while True:
            item = asyncio.ensure_future(stream.__anext__())
            while not (await asyncio.wait({item}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    item.cancel()
                    raise APIError(499, "the client disconnected", code="client_disconnected")
            try:
                responder.add(item.result())
            except StopAsyncIteration:
                done = True
                return
    except EngineDead as e:
        done = True
        raise APIError(503, str(e), "server_error", "engine_dead") from None
    finally:
        if not done:
            engine.abort(stream)


# -- command line ----------------------------------------------------------------------


def _parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags, in vLLM's spelling."""
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded SmolLM2-135M-Instruct), a .gguf file or a Hugging Face "
                             "checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer <key>' on /v1 routes (or set {API_KEY_ENV})")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequences per engine step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (auto: float32)")
    parser.add_argument("--weights-dtype", default=None, choices=WEIGHTS_DTYPES,
                        help="how the weights stay in memory: float32, bfloat16, gguf (a GGUF file's own "
                             "blocks), or a packed format (int8, w8a8, int4, fp8, q8_0, q4_0, q4_1)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="decode steps per jitted call while every row decodes (LLM(num_scheduler_steps=...))")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-hierarchical-cache", action="store_true",
                        help="keep evicted prefixes in host memory (and on disk): LLM(enable_hierarchical_cache=True)")
    parser.add_argument("--host-cache-bytes", type=int, default=None,
                        help="host tier size (default: twice the device KV pool)")
    parser.add_argument("--disk-cache-dir", default=None, help="disk tier directory (default: no disk tier)")
    parser.add_argument("--disk-cache-bytes", type=int, default=TierConfig.disk_cache_bytes,
                        help="disk tier bound, or the memory lent to the Mooncake store")
    parser.add_argument("--hicache-write-policy", default=TierConfig.write_policy, choices=WRITE_POLICIES)
    parser.add_argument("--hicache-storage-backend", default=TierConfig.storage_backend, choices=STORAGE_BACKENDS,
                        help="the tier under the host: files under --disk-cache-dir, or a Mooncake store")
    parser.add_argument("--hicache-storage-prefetch-policy", default=TierConfig.prefetch_policy,
                        choices=PREFETCH_POLICIES, help="how long a request waits for its prefix's prefetch from "
                        "the tier under the host: never, until done, or a timeout growing with its tokens")
    parser.add_argument("--hicache-host-memory", default=TierConfig.host_memory, choices=HOST_MEMORIES,
                        help="the host tier's rows: JAX pinned_host memory (auto: on accelerators that have it) "
                             "or numpy")
    parser.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                        help="the mooncake_master of --hicache-storage-backend mooncake")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="shard the model over this many devices (LLM(tensor_parallel_size=...))")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engines, each on its own tensor_parallel_size devices (LLM(data_parallel_size=...))")
    parser.add_argument("--expert-parallel-size", "-ep", type=int, default=1,
                        help="groups a MoE model's experts are split into whole, dividing tensor_parallel_size "
                             "(LLM(expert_parallel_size=...); 1 splits each expert tp ways)")
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, e.g. \'{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 15}\'')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (S-LoRA)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="PEFT adapter directories, each served as model NAME (needs --enable-lora)")
    parser.add_argument("--max-loras", type=int, default=1, help="adapters in one engine step")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests allowed to wait for the engine; more get 429")
    parser.add_argument("--max-waiting-tokens", type=int, default=DEFAULT_MAX_WAITING_TOKENS,
                        help="prompt tokens allowed to wait for the engine; more get 429")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="hosts serving one model together (one process each; serving/multihost.py)")
    parser.add_argument("--process-id", type=int, default=0, help="this host's rank: 0 serves HTTP")
    parser.add_argument("--coordinator-address", default=None,
                        help="HOST:PORT of process 0's coordinator (default: from the cluster, e.g. a TPU pod)")
    parser.add_argument("--precompile", action="store_true",
                        help="compile every step shape at start-up (LLM(precompile=True)): no compile stalls later")
    parser.add_argument("--compile-cache-dir", default=None,
                        help="where compiled steps persist ('off' disables; default $KVFOLD_COMPILE_CACHE "
                             "or ~/.cache/kvfold/jax)")
    parser.add_argument("--kv-role", default=None, choices=[r for r in KV_ROLES if r],
                        help="one side of disaggregated prefill / decode (python -m serving.router starts both)")
    parser.add_argument("--kv-transfer-address", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="where a --kv-role instance's KV transfer server listens (port 0: any free port)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def build(args: argparse.Namespace) -> FastAPI:
    """The LLM and app that `args` (the server's flags) describe; ValueError for a bad flag."""
    import jax.numpy as jnp

    from serving.llm import LLM

    if args.compile_cache_dir is not None:  # read when the LLM is built (model/compile_cache.py)
        os.environ[compile_cache.ENV] = args.compile_cache_dir
    speculative = None
    if args.speculative_config is not None:
        try:
            speculative = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    for name in ("port", "max_waiting_requests", "max_waiting_tokens", "max_request_body_bytes"):
        value = getattr(args, name)
        if value < (0 if name == "port" else 1) or (name == "port" and value > 65535):
            raise ValueError(f"--{name.replace('_', '-')} is out of range: {value}")
    lora_modules = {}
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in lora_modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        lora_modules[name] = path
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    dtype = jnp.float32 if args.dtype == "auto" else getattr(jnp, args.dtype)
    llm = LLM(args.model, max_model_len=args.max_model_len, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
              seed=args.seed, dtype=dtype, speculative_config=speculative, enable_lora=args.enable_lora,
              max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
              weights_dtype=args.weights_dtype, tensor_parallel_size=args.tensor_parallel_size,
              data_parallel_size=args.data_parallel_size, expert_parallel_size=args.expert_parallel_size,
              precompile=args.precompile, enable_hierarchical_cache=args.enable_hierarchical_cache,
              host_cache_bytes=args.host_cache_bytes, disk_cache_dir=args.disk_cache_dir,
              disk_cache_bytes=args.disk_cache_bytes, hicache_write_policy=args.hicache_write_policy,
              hicache_storage_backend=args.hicache_storage_backend, mooncake_master=args.mooncake_master,
              hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
              hicache_host_memory=args.hicache_host_memory, num_scheduler_steps=args.num_scheduler_steps)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return create_app(llm, args.served_model_name or args.model, api_key, args.max_waiting_requests,
                      args.max_waiting_tokens, args.max_request_body_bytes, lora_modules, args.kv_role,
                      kv_address=args.kv_transfer_address)


def app_from_flags(argv: list[str]) -> FastAPI:
    """The app that the server's command-line flags describe (for an in-process server)."""
    return build(_parser(argparse.ArgumentParser(prog="kvfold serve")).parse_args(argv))


def serve(args: argparse.Namespace) -> None:
    """Build and serve. With --num-processes N > 1 (one process per host, same flags but
    --process-id), every process joins the coordinator and builds the same sharded model;
    process 0 serves HTTP and broadcasts each engine step, the others run them
    (serving/multihost.py)."""
    import uvicorn

    from serving import multihost

    try:
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise ValueError(f"--process-id must be in [0, --num-processes={args.num_processes})")
        if args.num_processes > 1:  # no --coordinator-address: JAX reads the cluster's (TPU pods)
            multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
        app = build(args)
    except ValueError as e:
        sys.exit(f"kvfold serve: {e}")
    if args.process_id > 0:
        multihost.serve_worker(app.state.llm)
        return
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        if args.num_processes > 1:  # the engine thread has stopped with the server
            multihost.shutdown(app.state.llm)
        app.state.llm.close()  # the tiers' last copies land; a Mooncake client leaves its pool


def main(argv: list[str] | None = None) -> None:
    """`python -m serving.server [flags]`."""
    serve(_parser(argparse.ArgumentParser(description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args(argv))


def cli(argv: list[str] | None = None) -> None:
    """The `kvfold` console script: `kvfold serve [flags]`."""
    parser = argparse.ArgumentParser(prog="kvfold", description="kvfold, a JAX LLM inference stack")
    sub = parser.add_subparsers(dest="command", required=True)
    _parser(sub.add_parser("serve", help="the OpenAI-compatible HTTP server", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter))
    serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
