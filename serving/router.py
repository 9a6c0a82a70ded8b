"""Disaggregated prefill and decode behind one OpenAI endpoint (DistServe, Mooncake).

    python -m serving.router --prefill-instances 1 --decode-instances 1 --port 8000 \
        [server flags for every instance, e.g. --model default --max-model-len 2048]
    python -m serving.router --instances http://a:8001,http://b:8002 --port 8000

The first form starts each instance as its own `python -m serving.server --kv-role ...`
process on 127.0.0.1 (flags the router does not know are passed to every instance); the
second fronts instances started elsewhere, asking each its role (GET /kv/role).

For each /v1/completions or /v1/chat/completions request the router asks a prefill
instance to run the prompt (POST /kv/prefill), which keeps a copy of the prompt's pages
and answers with an offer; it then sends the request, with the offer as
`kv_transfer_params`, to the decode instance with the fewest requests in flight, which
pulls the pages (serving/kv_transfer.py) and decodes; its answer (streamed or not) goes
back to the client unchanged. A prefill instance that fails or cannot be reached only
costs the decode instance the prompt's compute; a request the prefill instance rejects
as bad (a 4xx other than 429) is answered with that error.

Of several prefill instances, a request goes to the one whose prefix cache holds the
longest prefix of its prompt (Mooncake's Conductor: `PrefixIndex`, kept from each
instance's block stored / removed events, GET /kv/events, read before each choice; the
router tokenizes prompts with the instances' tokenizer); with no prefix held anywhere,
instances take requests in turn.

With a cost model (`--cost FILE`, the JSON `python -m serving.placement --cost FILE`
writes), the router dispatches as Mooncake's Conductor does (serving/placement.py's
`Conductor`): the prefill instance with the lowest predicted TTFT (the prefill work it has
queued, the prefill of the part of the prompt it does not cache, the transfer, the decode
instance's first step), the decode instance with the shortest predicted decode step; and
with --ttft-slo / --tpot-slo it answers 429 at once when the prediction breaks one (early
rejection), before any instance spends work on the request. When another prefill
instance holds a longer prefix of the prompt and pulling it predicts the lower TTFT (the
holder is busy, the chosen instance is not), the router asks the holder to offer it
(POST /kv/offer) and the chosen instance pulls it before it runs the rest of the prompt
(Mooncake's remote prefix reuse; app.state.counts["prefix_pulled"]).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from serving.kv_tiers import chain
from serving.placement import Conductor, Rejection

ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
DEFAULT_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_S = 900.0  # an instance loads and compiles its model before /health answers


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error" if status >= 500 else
                                   "invalid_request_error", "param": None, "code": code}}, status_code=status)


class PrefixIndex:
    """Which prefill instance caches which pages (Mooncake's Conductor), kept from each
    instance's block stored / removed events (GET /kv/events)."""

    def __init__(self, urls: list[str]):
        self.keys = {u: set() for u in urls}
        self.after = {u: 0 for u in urls}
        self.root: dict[str, tuple[bytes, int]] = {}  # url -> (its chain's root, page size)

    def apply(self, url: str, update: dict) -> None:
        """One /kv/events answer of instance `url`."""
        self.root[url] = (bytes.fromhex(update["root"]), int(update["page_size"]))
        if update.get("reset"):
            self.keys[url] = {bytes.fromhex(k) for k in update["keys"]}
        for _, kind, keys in update.get("events", []):
            (self.keys[url].update if kind == "stored" else self.keys[url].difference_update)(
                bytes.fromhex(k) for k in keys)
        self.after[url] = int(update["next"])

    def matched_pages(self, url: str, ids: list[int]) -> int:
        """Pages of the prompt `ids` instance `url` holds (from its first page on, as an
        admission would reuse them)."""
        if url not in self.root:
            return 0
        root, page_size = self.root[url]
        n = 0
        for key in chain(root, ids[:len(ids) - 1], page_size):
            if key not in self.keys[url]:
                break
            n += 1
        return n


def _prompt_ids(tokenizer, kind: str, body: dict) -> list[int] | None:
    """The prompt's token ids as an instance would see them, or None (not one plain prompt,
    or text without a tokenizer)."""
    if tokenizer is None and (kind == "chat" or isinstance(body.get("prompt"), str)):
        return None
    try:
        if kind == "chat":
            return list(tokenizer.apply_chat_template(body["messages"], tokenize=True))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
    except Exception:  # noqa: BLE001 (the instance reports a bad request; routing just goes in turn)
        return None
    return None


def create_router(prefill: list[str], decode: list[str], client: httpx.AsyncClient | None = None,
                  tokenizer=None, cost=None, ttft_slo: float | None = None, tpot_slo: float | None = None,
                  transfer_s_per_page: float = 0.0) -> FastAPI:
    """The router app over prefill and decode instance base URLs (`serving.server` apps
    with kv_role "prefill" / "decode"). client: how instances are reached (default: a new
    httpx.AsyncClient). tokenizer (a model.Tokenizer): with it, a request goes to the
    prefill instance that caches the longest prefix of its prompt (`PrefixIndex`), in
    turn among equals; without it, prefill instances take requests in turn (prompts given
    as token ids need no tokenizer).

    cost (a serving.simulator.CostModel of one instance's steps): dispatch by predicted
    TTFT and decode step time instead (`Conductor`, app.state.conductor); ttft_slo /
    tpot_slo (seconds, need cost): reject a request whose prediction breaks one with 429
    before any instance sees it. transfer_s_per_page: what the prediction charges for
    moving a page from a prefill to a decode instance. A prompt the router cannot count
    (several prompts, or text without a tokenizer) is dispatched as without a cost model.
    app.state.counts: requests by how their prefill went."""
    if not decode:
        raise ValueError("the router needs at least one decode instance")
    if cost is None and (ttft_slo is not None or tpot_slo is not None):
        raise ValueError("rejecting by SLO predicts with a cost model: pass cost (--cost)")
    for url in prefill + decode:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"instance URLs must be http(s)://host:port, got {url!r}")
    prefill, decode = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
    http = client if client is not None else httpx.AsyncClient(timeout=DEFAULT_TIMEOUT_S)
    turns = itertools.cycle(prefill) if prefill else None
    in_flight = collections.Counter({u: 0 for u in decode})
    counts = collections.Counter()
    index = PrefixIndex(prefill)
    conductor = None
    if cost is not None and prefill:
        conductor = Conductor(cost, prefill, decode, page_size=16, transfer_s_per_page=transfer_s_per_page,
                              ttft_slo=ttft_slo, tpot_slo=tpot_slo)
    tickets = itertools.count()

    app = FastAPI(title="kvfold router")
    app.state.counts, app.state.in_flight, app.state.index = counts, in_flight, index
    app.state.conductor = conductor

    async def refresh(url: str) -> None:
        try:
            r = await http.get(f"{url}/kv/events", params={"after": index.after[url]})
            if r.status_code == 200:
                update = r.json()
                if update["next"] < index.after[url]:  # the instance restarted: read it whole
                    index.after[url], index.keys[url] = 0, set()
                    update = (await http.get(f"{url}/kv/events", params={"after": 0})).json()
                index.apply(url, update)
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # an instance that does not answer keeps its last index

    async def choose(kind: str, body: dict):
        """(prefill URL, decode URL or None: by load, Conductor ticket or None, (holder URL,
        prompt ids) of a prefix to pull first or None), or a 429."""
        if conductor is None and (tokenizer is None or len(prefill) == 1):
            return next(turns), None, None, None
        ids = await asyncio.to_thread(_prompt_ids, tokenizer, kind, body)
        if ids is None:
            return next(turns), None, None, None
        await asyncio.gather(*(refresh(u) for u in prefill))
        matched = {u: index.matched_pages(u, ids) for u in prefill}
        if conductor is None:
            best = max(matched.values())
            if best > 0:
                counts["prefix_routed"] += 1
            return next(u for u in turns if matched[u] == best), None, None, None  # in turn among the best
        conductor.page_size = next(iter(index.root.values()), (None, conductor.page_size))[1]
        ticket = next(tickets)
        decision = conductor.admit(ticket, time.monotonic(), len(ids), matched)
        if isinstance(decision, Rejection):
            counts["rejected_early"] += 1
            return (_error(429, f"the router rejects the request: {decision.reason}", "slo_unreachable"),
                    None, None, None)
        if matched[decision.prefill] > 0:
            counts["prefix_routed"] += 1
        pull = None if decision.source is None else (decision.source, ids)
        return decision.prefill, decision.decode, ticket, pull

    async def offer_of(pull, headers: dict) -> dict | None:
        """The holder's offer of its cached prefix of the prompt (kv_transfer_params for the
        chosen prefill instance), or None (nothing cached there now, or it failed: the
        chosen instance computes the prompt)."""
        holder, ids = pull
        try:
            r = await http.post(f"{holder}/kv/offer", json={"prompt_token_ids": ids}, headers=headers)
            params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            params = None
        counts["prefix_pulled" if params else "pull_unavailable"] += 1
        return None if params is None else {**params, "control": holder}

    async def prefill_on(url: str, kind: str, body: dict, headers: dict, pull=None):
        """The offer for `body` from the prefill instance at url (which first pulls the
        prefix `pull` names, if any); a JSONResponse to answer the client with (the request
        is bad); or None (prefill failed: decode computes it)."""
        outer = {"kind": kind, "request": body}
        if pull is not None and (offer := await offer_of(pull, headers)) is not None:
            outer["kv_transfer_params"] = offer
        try:
            r = await http.post(f"{url}/kv/prefill", json=outer, headers=headers)
        except httpx.HTTPError:
            counts["prefill_unreachable"] += 1
            return None
        if r.status_code == 200:
            params = r.json().get("kv_transfer_params")
            counts["prefilled" if params else "nothing_cached"] += 1
            return None if params is None else {**params, "control": url}
        if 400 <= r.status_code < 500 and r.status_code != 429:
            try:
                return JSONResponse(r.json(), status_code=r.status_code)
            except ValueError:
                return _error(r.status_code, r.text, "prefill_rejected")
        counts["prefill_failed"] += 1
        return None

    async def route(request: Request, path: str):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON", "bad_json")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "bad_json")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        if "kv_transfer_params" in body:
            return _error(400, "kv_transfer_params is the router's to set", "bad_request")
        params = target = ticket = None
        if turns is not None:
            chosen, target, ticket, pull = await choose(ROUTES[path], body)
            if isinstance(chosen, Response):
                return chosen
            try:
                params = await prefill_on(chosen, ROUTES[path], body, headers, pull)
            except BaseException:  # cancelled, or failed past what prefill_on answers: the request ends here
                if ticket is not None:
                    conductor.finished(ticket, time.monotonic())
                raise
            if ticket is not None:
                conductor.prefill_done(ticket, time.monotonic())
        if isinstance(params, Response):
            if ticket is not None:
                conductor.finished(ticket, time.monotonic())
            return params
        if params is not None:
            body = {**body, "kv_transfer_params": params}
        if target is None:
            target = min(decode, key=lambda u: in_flight[u])
        in_flight[target] += 1

        def leave():
            in_flight[target] -= 1
            if ticket is not None:
                conductor.finished(ticket, time.monotonic())
        try:
            upstream = await http.send(http.build_request("POST", f"{target}{path}", json=body, headers=headers),
                                       stream=True)
        except httpx.HTTPError as e:
            leave()
            return _error(502, f"decode instance {target} is unreachable: {e}", "bad_gateway")

        async def done():
            await upstream.aclose()
            leave()
        keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")}
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=keep,
                                 background=BackgroundTask(done))

    def endpoint(path: str):
        async def forward(request: Request):
            return await route(request, path)
        return forward

    for path in ROUTES:
        app.add_api_route(path, endpoint(path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        r = await http.get(f"{decode[0]}/v1/models", headers=headers)
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/health")
    async def health():
        down = []
        for url in prefill + decode:
            try:
                if (await http.get(f"{url}/health")).status_code != 200:
                    down.append(url)
            except httpx.HTTPError:
                down.append(url)
        if down:
            return _error(503, f"instances not healthy: {down}", "instance_down")
        return {"prefill": prefill, "decode": decode}

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover(urls: list[str], timeout_s: float = 10.0) -> tuple[list[str], list[str]]:
    """(prefill, decode) URLs among running instances, by their GET /kv/role."""
    roles = {"prefill": [], "decode": []}
    for url in urls:
        try:
            role = httpx.get(f"{url.rstrip('/')}/kv/role", timeout=timeout_s).json().get("role")
        except (httpx.HTTPError, ValueError) as e:
            raise ValueError(f"instance {url} does not answer GET /kv/role: {e}") from None
        if role not in roles:
            raise ValueError(f"instance {url} has no prefill or decode role (--kv-role), it says {role!r}")
        roles[role].append(url)
    return roles["prefill"], roles["decode"]


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def spawn(num_prefill: int, num_decode: int, server_flags: list[str], timeout_s: float = STARTUP_TIMEOUT_S):
    """Start the instances as `serving.server` processes on 127.0.0.1 and wait until each
    answers /health; yields (prefill URLs, decode URLs); stops them on exit.

    SIGTERM stops them too: meanwhile (in the main thread) it raises SystemExit, so this
    exits. uvicorn shuts down gracefully on SIGTERM and then raises it again, which with
    Python's default action would end the process with the instances still running."""
    procs, urls = [], {"prefill": [], "decode": []}
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        for role, n in (("prefill", num_prefill), ("decode", num_decode)):
            for _ in range(n):
                port = _free_port()
                procs.append(subprocess.Popen([sys.executable, "-m", "serving.server", *server_flags,
                                               "--kv-role", role, "--host", "127.0.0.1", "--port", str(port)],
                                              env=env))
                urls[role].append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for proc, url in zip(procs, urls["prefill"] + urls["decode"]):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"instance {url} exited with {proc.returncode} while starting")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"instance {url} did not become healthy within {timeout_s} s")
                time.sleep(0.5)
        yield urls["prefill"], urls["decode"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _instance_model(server_flags: list[str]) -> str:
    """The --model the instances are started with (the server's default: "default")."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default="default")
    return parser.parse_known_args(server_flags)[0].model


def main(argv: list[str] | None = None) -> None:
    """`python -m serving.router [flags] [server flags for the instances]`."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-instances", type=int, default=1)
    parser.add_argument("--decode-instances", type=int, default=1)
    parser.add_argument("--instances", default=None, help="URL,...: front running instances instead")
    parser.add_argument("--tokenizer", default=None,
                        help="the instances' model (as --model names it), for routing a prompt to the prefill "
                             "instance that caches its prefix (default: the instances' --model)")
    parser.add_argument("--cost", default=None,
                        help="a cost model JSON file (python -m serving.placement --cost FILE writes one): dispatch "
                             "by predicted TTFT and decode step time (Mooncake's Conductor)")
    parser.add_argument("--ttft-slo", type=float, default=None, help="seconds: 429 at once above it (needs --cost)")
    parser.add_argument("--tpot-slo", type=float, default=None, help="seconds: 429 at once above it (needs --cost)")
    parser.add_argument("--transfer-ms-per-page", type=float, default=5.3,
                        help="the predicted KV transfer per page (default: bench disagg on a 2-core CPU)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, server_flags = parser.parse_known_args(argv)
    if args.instances is None and (args.prefill_instances < 0 or args.decode_instances < 1):
        sys.exit("kvfold router: --prefill-instances must be >= 0 and --decode-instances >= 1")
    if args.transfer_ms_per_page < 0:
        sys.exit("kvfold router: --transfer-ms-per-page must be >= 0")
    if any(slo is not None and not slo > 0 for slo in (args.ttft_slo, args.tpot_slo)):
        sys.exit("kvfold router: --ttft-slo and --tpot-slo must be > 0 seconds")
    if args.cost is None and (args.ttft_slo is not None or args.tpot_slo is not None):
        sys.exit("kvfold router: --ttft-slo and --tpot-slo reject by a predicted time: they need --cost")
    cost = None
    if args.cost is not None:
        from serving.simulator import CostModel

        try:
            cost = CostModel.load(args.cost)
        except ValueError as e:
            sys.exit(f"kvfold router: {e}")
    if args.instances is not None and server_flags:
        sys.exit(f"kvfold router: {server_flags} are instance flags; --instances fronts running instances")
    with contextlib.ExitStack() as stack:
        try:
            if args.instances is not None:
                prefill, decode = discover([u for u in args.instances.split(",") if u])
            else:
                prefill, decode = stack.enter_context(spawn(args.prefill_instances, args.decode_instances,
                                                            server_flags))
            name = args.tokenizer
            if name is None and args.instances is None:
                name = _instance_model(server_flags)
            tokenizer = None
            if name is not None and (len(prefill) > 1 or cost is not None):
                import model

                tokenizer = model.load_tokenizer(name)
            app = create_router(prefill, decode, tokenizer=tokenizer, cost=cost, ttft_slo=args.ttft_slo,
                                tpot_slo=args.tpot_slo, transfer_s_per_page=args.transfer_ms_per_page / 1e3)
        except (ValueError, RuntimeError) as e:
            sys.exit(f"kvfold router: {e}")
        uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()


__all__ = ["PrefixIndex", "create_router", "discover", "spawn"]
