"""`dspark serve`'s HTTP layer: an OpenAI-compatible API (FastAPI + SSE) over one `EngineLoop`.

    app = create_app(loop, tokenizer=tok, model_name="dspark-default")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming with `"stream": true`),
GET /v1/models, GET /health (503 until the engine is compiled and warm), GET /metrics (Prometheus).
Each request becomes one engine request; its tokens reach the client as the rounds that made them are
read. A client that goes away is cancelled at once (its slot serves the next request; one log line).
Errors are OpenAI error objects: 400 naming the field, 413 for a body over `max_body_bytes` (refused
before it is read), 429 with Retry-After when every slot and the queue are full, 500 to the requests an
engine failure hit (the loop rebuilds the engine and serves on), 503 while warming up or shutting down.

Shutdown (`EngineLoop.begin_shutdown(grace)`, on SIGTERM in `dspark serve`): new requests get 503; the
accepted ones run on for the grace period; then every handler still waiting answers at once, without
waiting for the engine: a stream ends with an error event (code "shutting_down") and `data: [DONE]`, a
non-streamed request (running or queued) gets a 503, and the log gets one line per request cut.
Prompts are tokenized in a worker thread, with the GIL released, so a huge prompt does not stall the
event loop (GET /health, the other streams).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from dspark_jax.serve import openai_api as oa
from dspark_jax.serve.engine import Event, Request, RequestError
from dspark_jax.serve.loop import EngineLoop, QueueFull, ShuttingDown
from dspark_jax.serve.metrics import ServerMetrics
from dspark_jax.serve.request_check import choose_coupling

_POLL_S = 0.1  # how often a waiting handler checks that its client is still there and the grace is not over

log = logging.getLogger("dspark_jax.serve")


def error_response(err: oa.ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def too_large(limit: int, size: int | None = None) -> oa.ApiError:
    what = f"is {size} bytes" if size is not None else f"is over {limit} bytes"
    return oa.ApiError(413, f"the request body {what}; this server accepts at most {limit} bytes "
                       "(dspark serve --max-body-bytes)", code="request_too_large")


def declared_length(headers) -> int | None:
    """The Content-Length a request declares; None when it has none (a chunked body). uvicorn has refused
    a malformed one already (400); one that still fails to parse is left to the counting read."""
    value = headers.get("content-length")
    return int(value) if value is not None and value.strip().isdigit() else None


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes: from its
    Content-Length before a byte is read, else by counting while it streams in (nothing more is read)."""
    declared = declared_length(http.headers)
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(loop: EngineLoop, *, tokenizer=None, model_name: str = "dspark", default_max_tokens: int = 16,
               metrics: ServerMetrics | None = None, max_body_bytes: int = oa.DEFAULT_MAX_BODY_BYTES,
               coupling: str = "auto") -> FastAPI:
    """`coupling`: "auto" (a request with a `seed` gets the drafter-invariant coupling, one without the
    optimal one; serve.request_check.choose_coupling), or one coupling for every request."""
    choose_coupling(coupling, seeded=False)  # a bad setting is refused here, not at the first request
    app = FastAPI(title="dspark_jax", docs_url=None, redoc_url=None)
    metrics = metrics or ServerMetrics(loop)
    app.state.loop, app.state.metrics = loop, metrics
    created = oa.now()
    engine_cfg = loop.engine.config
    vocab = loop.engine.vocab

    @app.exception_handler(oa.ApiError)
    async def _api_error(_, err: oa.ApiError):
        if err.status in _OUTCOME_OF_STATUS:  # a refused request (an engine error is counted where it ends)
            metrics.request_done(_OUTCOME_OF_STATUS[err.status])
        return error_response(err, {"Retry-After": "1"} if err.status == 429 else None)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(http: HttpRequest, _):
        # The client left while sending its body: one line, not uvicorn's "Exception in ASGI application".
        log.warning("request %s %s cancelled: client disconnected while sending its body", http.method,
                    http.url.path)
        metrics.request_done("disconnected")
        return Response(status_code=499)  # nobody reads it; uvicorn drops what is sent to a closed connection

    async def read_json(http: HttpRequest) -> dict:
        raw = await read_body(http, max_body_bytes)
        try:  # on the event loop: the json module holds the GIL anyway, ~10 ms for the largest body
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise oa.ApiError(400, f"the request body is not valid JSON ({err})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise oa.ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def parse(body: dict, prompt: list[int]) -> oa.Params:
        oa.check_unsupported(body)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise oa.bad("model", "expected a string")
        if model is not None and model != model_name:  # OpenAI's answer to a model it does not serve
            raise oa.ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r} "
                              "(GET /v1/models)", param="model", code="model_not_found")
        return oa.parse_common(body, prompt, vocab=vocab, max_len=engine_cfg.max_len,
                               max_stop_tokens=engine_cfg.max_stop_tokens, default_max_tokens=default_max_tokens)

    def chat_tokens(messages) -> list[int]:
        return oa.parse_prompt(oa.chat_prompt(messages), tokenizer, vocab, name="messages")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body = await read_json(http)
        # A worker thread: tokenizing a multi-MB prompt takes seconds, which must not stall the event loop.
        prompt = await asyncio.to_thread(oa.parse_prompt, body.get("prompt"), tokenizer, vocab)
        return await serve(http, parse(body, prompt), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        body = await read_json(http)
        if tokenizer is None:
            raise oa.bad("messages", "this model has no tokenizer, so it cannot apply a chat template")
        prompt = await asyncio.to_thread(chat_tokens, body.get("messages"))
        if "max_completion_tokens" in body and "max_tokens" not in body:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        return await serve(http, parse(body, prompt), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dspark_jax"}]}

    @app.get("/health")
    async def health():
        if not loop.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok", "slots": engine_cfg.max_slots, "active": loop.active_slots,
                "queued": loop.queue_depth}

    @app.get("/metrics")
    async def prometheus():
        text, content_type = metrics.render()
        return PlainTextResponse(text, media_type=content_type)

    async def serve(http: HttpRequest, p: oa.Params, *, chat: bool):
        if not loop.ready.is_set():
            raise oa.ApiError(503, "the engine is still compiling; retry when GET /health says ok",
                              code="warming_up", type_="server_error")
        aloop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(4), "little")
        req = Request(p.prompt, max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                      seed=seed, stop_tokens=tuple(p.stop_tokens), id=p.user,
                      coupling=choose_coupling(coupling, seeded=p.seed is not None))
        try:
            ticket = loop.submit(req, lambda ev: aloop.call_soon_threadsafe(events.put_nowait, ev))
        except QueueFull as err:
            raise oa.ApiError(429, f"server busy: {err}", code="queue_full", type_="rate_limit_error") from None
        except ShuttingDown as err:
            raise oa.ApiError(503, str(err), code="shutting_down", type_="server_error") from None
        except RequestError as err:
            raise oa.ApiError(400, str(err), param=_API_PARAM.get(err.field, err.field),
                              code="invalid_value") from None
        metrics.prompt_tokens(len(p.prompt))
        run = _Completion(loop, ticket, events, p, tokenizer, metrics,
                          oa.new_id("chatcmpl" if chat else "cmpl"), model_name, chat)
        if p.stream:
            return StreamingResponse(run.sse(http), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await run.whole(http)

    return app


# The requests_total outcome of a request refused with an HTTP error.
_OUTCOME_OF_STATUS = {400: "invalid", 404: "not_found", 413: "too_large", 429: "rejected", 503: "unavailable"}

# What `_Completion._next` returns instead of an event: the client went away / the shutdown grace ran out.
_GONE, _CUT = "client disconnected", "shutdown grace over"

# The engine's Request field names that differ from the OpenAI parameter they come from.
_API_PARAM = {"stop_tokens": "stop"}


class _Completion:
    """One request's life in the HTTP layer: engine events -> text (cut at stop strings) -> the client."""

    def __init__(self, loop: EngineLoop, ticket, events: asyncio.Queue, p: oa.Params, tokenizer,
                 metrics: ServerMetrics, rid: str, model: str, chat: bool):
        self.loop, self.ticket, self.events, self.p = loop, ticket, events, p
        self.text = oa.TextStream(tokenizer, p.stop_strings)
        self.metrics, self.rid, self.model, self.chat = metrics, rid, model, chat
        self.created = oa.now()
        self.generated = 0
        self.finish: str | None = None
        self.result = None
        self._check_at = time.monotonic() + _POLL_S  # when _next next asks whether the client is there

    async def _next(self, http: HttpRequest) -> Event | str:
        """The next engine event; _GONE if the client went away, _CUT once the shutdown grace is over.
        Both are checked every _POLL_S even while events flow: a request that keeps producing tokens
        would otherwise run to its end for a client that left, or past the grace until uvicorn cuts the
        connection mid-body."""
        while True:
            if self.loop.grace_over:
                return _CUT
            now = time.monotonic()
            if now >= self._check_at:
                self._check_at = now + _POLL_S
                if await http.is_disconnected():
                    return _GONE
            try:
                return await asyncio.wait_for(self.events.get(), _POLL_S)
            except asyncio.TimeoutError:
                pass

    def _end_early(self, why: str, outcome: str) -> None:
        """The request ends before the engine finished it: free its slot, count it, log one line."""
        self.loop.cancel(self.ticket)
        self.metrics.request_done(outcome, generated=self.generated)
        log.warning("request %s %s after %d tokens", self.rid, why, self.generated)

    def _gone(self) -> None:
        # Past the grace, uvicorn itself closes what is left: not the client's doing.
        self._end_early("closed at shutdown" if self.loop.grace_over else "cancelled: client disconnected",
                        "disconnected")

    def _cut(self) -> oa.ApiError:
        self._end_early("cut: the shutdown grace ran out", "cut")
        return oa.ApiError(503, f"the server is shutting down: request {self.rid} was stopped after "
                           f"{self.generated} tokens", code="shutting_down", type_="server_error")

    def _take(self, ev: Event) -> str:
        """Tokens of an event -> new text; sets `finish` when the request is over."""
        tokens = list(ev.tokens)
        if not self.text.stopped:  # tokens after a stop string are not part of the completion
            self.generated += len(tokens)
        if ev.finish_reason == "stop" and tokens and tokens[-1] in self.p.stop_tokens:
            tokens = tokens[:-1]  # a stop token ends the text and is not part of it (as a stop string)
        delta = self.text.push(tokens, final=bool(ev.finish_reason))
        if self.text.stopped and not ev.finish_reason:  # a stop string: the engine need not go on
            self.loop.cancel(self.ticket)
            self.finish = "stop"
        elif ev.finish_reason:
            self.result = ev.result
            if ev.finish_reason == "error":
                self.finish = "error"
            elif self.finish is None:
                self.finish = "stop" if ev.finish_reason in ("stop", "cancelled") else "length"
            self.metrics.request_done(self.finish, generated=self.generated)
        return delta

    def _extra(self) -> dict:
        res = self.result
        rounds, accepted = (res.rounds, res.accepted) if res is not None else (0, 0)
        return {"usage": oa.usage(len(self.p.prompt), self.generated),
                "dspark": oa.dspark_stats(rounds, accepted, self.generated)}

    def _engine_error(self, ev: Event) -> oa.ApiError:
        return oa.ApiError(500, ev.error or "internal engine error", code="engine_error", type_="server_error")

    async def whole(self, http: HttpRequest):
        parts = []
        while True:
            ev = await self._next(http)
            if ev is _GONE:
                self._gone()
                return Response(status_code=499)  # nobody reads it
            if ev is _CUT:
                return error_response(self._cut())
            parts.append(self._take(ev))
            if ev.finish_reason:
                break
        if self.finish == "error":
            return error_response(self._engine_error(ev))
        return oa.completion_object(self.rid, self.model, self.created, chat=self.chat, chunk=False,
                                    text="".join(parts), finish=self.finish, extra=self._extra())

    def _chunk(self, text: str | None = None, delta: dict | None = None, finish: str | None = None,
               extra: dict | None = None) -> str:
        obj = oa.completion_object(self.rid, self.model, self.created, chat=self.chat, chunk=True, text=text,
                                   delta=delta, finish=finish, extra=extra)
        return f"data: {json.dumps(obj)}\n\n"

    async def sse(self, http: HttpRequest):
        done = False  # the request ended here (finished, failed or cut), not by the client leaving
        try:
            if self.chat:
                yield self._chunk(delta={"role": "assistant", "content": ""})
            while True:
                ev = await self._next(http)
                if ev is _GONE:
                    return
                if ev is _CUT:  # a last event the client can read, instead of a body cut off mid-stream
                    done = True
                    yield f"data: {json.dumps(self._cut().body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                delta = self._take(ev)
                if delta:
                    yield self._chunk(text=delta, delta={"content": delta})
                if ev.finish_reason:
                    break
            done = True
            if self.finish == "error":
                yield f"data: {json.dumps(self._engine_error(ev).body())}\n\n"
            else:
                yield self._chunk(text="", delta={}, finish=self.finish, extra=self._extra())
            yield "data: [DONE]\n\n"
        finally:
            # The client went away: starlette cancels this generator (or _next saw it); free the slot now.
            if not done:
                self._gone()


class ThreadedServer:
    """uvicorn serving `app` on a free 127.0.0.1 port in a daemon thread (tests, `bench serve --http`);
    the constructor returns once GET /health answers 200 (the engine loop is warm)."""

    def __init__(self, app, *, ready_timeout_s: float = 300.0):
        import httpx
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        # log_config=None: an embedded server leaves the host process's logging alone. uvicorn's default
        # dictConfig shuts down every existing handler, and absl's (installed by orbax) closes the stream
        # it was created with: under pytest, the capture file of an earlier test, so the run ends.
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server at {self.url} was not ready within {ready_timeout_s:.0f} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
