"""An OpenAI-compatible HTTP server around one ``Engine`` (``create_app``).

Endpoints: ``GET /v1/models`` (the one model), ``POST /v1/chat/completions`` and ``POST
/v1/completions`` (whole, or streamed as server-sent events with ``"stream": true``),
``GET /health`` and ``GET /metrics`` (Prometheus text).

With ``create_app(max_batch=N)`` (``serve.py --max-batch``, default 8) up to N requests decode
together (continuous batching, ``engine.batch``): each keeps its own method, budget and caches,
joins the batch when its prefill is done (a new prompt's prefill runs a few layers at a time
between decode steps, so running requests keep decoding) and leaves it when it ends. With
``max_batch`` 1 requests run one at a time on one worker thread, in the order they came. Either
way the others wait in a queue (the ``rocketkv_queue_length`` gauge counts them;
``create_app(max_queue=N)`` refuses a request that finds N waiting with HTTP 503). A request
whose client goes away while it waits is skipped; a running one stops at its next token. With
the engine's ``prefix_cache`` (``serve.py --prefix-cache-mib``), a request whose prompt starts
with a kept one prefills only the rest.

A request's fields as the OpenAI API defines them: ``messages`` (chat) or ``prompt``
(completions: plain text, no chat template), ``max_tokens`` (chat also
``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``stream``; and ``top_k``.
Extra fields choose the KV cache of the request: ``method``, ``budget`` and the method's options
by their names (``page_size``, ``rocket_split``...: ``docs/methods.md``); a request that names
no method gets the server's (``ServeDefaults``), its budget and options included. ``stop``
strings, ``n`` other than 1, ``logprobs`` and tools are refused (HTTP 400): not supported yet.
Other fields are ignored. ``temperature`` defaults to 1 and ``seed`` to none (a random one), as
the OpenAI API's; ``temperature`` 0 is greedy.

Bad input (JSON that does not parse, a field of the wrong type, an unknown method, a bad budget,
a prompt too long for the model) is refused with HTTP 400 and an OpenAI-style body (``{"error":
{"message": ..., "type": "invalid_request_error", ...}}``), the message the engine's
``ConfigError`` one line, before anything is generated (a streamed request's response starts
only once its settings passed the engine's checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from rocketkv.api import Engine, Result
from rocketkv.engine.batch import KVCapacityError
from rocketkv.method_tables import METHOD_OPTIONS
from rocketkv.model import ConfigError

__all__ = ["ServeDefaults", "create_app", "model_id"]

OPTION_NAMES = tuple(row[0] for row in METHOD_OPTIONS)
ROLES = {"system", "user", "assistant", "developer", "tool"}
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
FINISH = {"eos": "stop", "max_new_tokens": "length", "context_length": "length",
          "reserve": "length", "interrupted": "stop"}


@dataclass
class ServeDefaults:
    """The settings of a request that does not give them (``serve.py``'s command line):
    ``budget`` and ``method_options`` apply only to a request that uses ``method``."""

    method: str = "full"
    budget: int | None = None
    max_new_tokens: int = 256
    method_options: dict[str, Any] = field(default_factory=dict)


class BadRequest(Exception):
    """Bad input, answered with HTTP 400 and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Busy(Exception):
    """The queue is full (``create_app(max_queue=...)``): HTTP 503 with ``Retry-After``."""


class _Cancelled(Exception):
    """Raised in the worker from ``on_token`` when the client of a stream went away."""


def _stop_when(cancelled: threading.Event | None) -> Callable[[Any], None]:
    """An ``on_token`` that ends the request (``_Cancelled``) at its next token once
    ``cancelled`` is set (the client went away)."""
    def on_token(_tokens: Any) -> None:
        if cancelled is not None and cancelled.is_set():
            raise _Cancelled
    return on_token


def model_id(engine: Engine) -> str:
    """The model's id: the checkpoint's file or folder name (``.gguf`` dropped), else the
    model's config name."""
    if engine.checkpoint:
        name = Path(engine.checkpoint.rstrip("/")).name
        return name.removesuffix(".gguf") or engine.checkpoint
    return engine.model.args.name


def _error(status: int, message: str, *, kind: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status)


class _Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rocketkv_requests", "HTTP requests answered",
                                ["endpoint", "method", "status"], registry=r)
        self.prompt_tokens = Counter("rocketkv_prompt_tokens", "prompt tokens prefilled",
                                     ["method"], registry=r)
        self.generated_tokens = Counter("rocketkv_generated_tokens", "tokens generated",
                                        ["method"], registry=r)
        self.latency = Histogram("rocketkv_request_seconds",
                                 "seconds from a generation's start in the worker to its end",
                                 ["method"], registry=r)
        self.queue_length = Gauge("rocketkv_queue_length",
                                  "requests waiting for the engine", registry=r)
        self.running = Gauge("rocketkv_running", "requests being generated (one at a time "
                             "without --max-batch)", registry=r)
        self.abandoned = Counter("rocketkv_abandoned", "requests whose client went away "
                                 "before they started: skipped", registry=r)
        self.refused = Counter("rocketkv_refused", "requests refused with 503: the queue was "
                               "full (--max-queue)", registry=r)
        self.prefix_reused = Counter("rocketkv_prefix_tokens_reused",
                                     "prompt tokens not prefilled again: a kept prompt's "
                                     "(--prefix-cache-mib)", ["method"], registry=r)
        # decode steps (not prefill): their tokens over their seconds is the server's decode
        # throughput, which batching multiplies (a load test reads them before and after)
        self.decode_steps = Gauge("rocketkv_decode_steps", "decode steps run (a batched step "
                                  "counts once)", registry=r)
        self.decode_tokens = Gauge("rocketkv_decode_tokens", "tokens the decode steps made "
                                   "(a batched step makes one per request)", registry=r)
        self.decode_seconds = Gauge("rocketkv_decode_seconds", "seconds the decode steps "
                                    "took", registry=r)
        self.kv_bytes = Gauge("rocketkv_kv_bytes_held", "bytes the running requests' KV "
                              "caches hold (with --max-batch above 1)", registry=r)
        self.prefix_bytes = Gauge("rocketkv_prefix_cache_bytes",
                                  "bytes of the prompts kept uncompressed between requests",
                                  registry=r)


# ---- requests


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (``{"type": "text", "text":
    ...}``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}: only text content parts are supported",
                                 "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts", "messages")


def _messages(data: dict[str, Any]) -> list[dict[str, str]]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role of "
                             f"{', '.join(sorted(ROLES))}", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text_content(m.get("content"),
                                                           f"messages[{i}]")})
    return out


def _prompt(data: dict[str, Any]) -> str | list[int]:
    """A completion's prompt: a string, a list of one string, or a list of token ids."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return prompt
    raise BadRequest("prompt must be a string or a list of token ids (one prompt per "
                     "request)", "prompt")


def _settings(data: dict[str, Any], defaults: ServeDefaults, *, chat: bool) -> dict[str, Any]:
    """``Engine.generate``'s keyword arguments for the request ``data`` (their values checked
    by the engine)."""
    stop = data.get("stop")
    if stop not in (None, [], ""):
        raise BadRequest("stop strings are not supported yet; the answer ends at the model's "
                         "end of turn or at max_tokens", "stop")
    if data.get("n", 1) not in (1, None):
        raise BadRequest("n must be 1: one answer per request", "n")
    if data.get("logprobs") not in (None, False) or data.get("echo") not in (None, False):
        raise BadRequest("logprobs and echo are not supported", "logprobs")
    if data.get("tools") or data.get("functions"):
        raise BadRequest("tools are not supported", "tools")
    max_tokens = data.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    method = data.get("method")
    kwargs: dict[str, Any] = {}
    if method is None or method == defaults.method:
        kwargs.update(method=defaults.method, budget=defaults.budget,
                      **defaults.method_options)
    else:
        kwargs["method"] = method
    if not isinstance(kwargs["method"], str):
        raise BadRequest(f"method must be a string, got {method!r}", "method")
    if data.get("budget") is not None:
        kwargs["budget"] = data["budget"]
    kwargs.update({name: data[name] for name in OPTION_NAMES if data.get(name) is not None})
    temperature = data.get("temperature")
    kwargs.update(max_new_tokens=defaults.max_new_tokens if max_tokens is None else max_tokens,
                  temperature=1.0 if temperature is None else temperature,
                  top_p=data.get("top_p"), top_k=data.get("top_k"), seed=data.get("seed"))
    return kwargs


def _max_tokens_field(data: dict[str, Any], chat: bool) -> str:
    if chat and data.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


# ---- the app


class _CountRequests:
    """ASGI middleware: every ``/v1/`` response counted by path, KV method and status
    (``rocketkv_requests``). Plain ASGI, not ``BaseHTTPMiddleware``, which hides a client's
    disconnect from ``Request.is_disconnected``."""

    def __init__(self, app: Any, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def sent(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            method = (scope.get("state") or {}).get("kv_method") or ""
            self.metrics.requests.labels(scope["path"], method, str(status["code"])).inc()


def create_app(engine: Engine, defaults: ServeDefaults | None = None, *,
               model_name: str | None = None, max_queue: int | None = None,
               max_batch: int = 1, max_kv_mib: float | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` (see the module's docstring); ``defaults``: the
    settings of a request that sets none. ``max_batch`` 1: requests run one at a time on one
    worker thread (each as ``Engine.generate`` runs it, compiled when that pays); above 1: up
    to ``max_batch`` requests decode together (continuous batching, ``Engine.submit``; the
    app starts the engine's batcher and stops it at shutdown, after the running requests).
    ``max_kv_mib``: with batching, the MiB the running requests' KV caches may hold together (a
    request waits until it fits; one that could not fit alone gets HTTP 503 at once).
    Run the app with one uvicorn worker process (``serve.py``). ``max_queue``: a completion
    request that finds this many requests waiting is refused at once with HTTP 503 and
    ``Retry-After: 1`` (``rocketkv_refused`` counts them); None: no limit.

    Raises:
        ConfigError: ``max_queue`` negative, ``max_batch`` not positive, ``max_kv_mib`` not
            positive or given without batching.
    """
    if max_queue is not None and max_queue < 0:
        raise ConfigError(f"--max-queue must not be negative, got {max_queue}")
    if max_batch < 1:
        raise ConfigError(f"--max-batch must be positive, got {max_batch}")
    if max_kv_mib is not None and (max_kv_mib <= 0 or max_batch == 1):
        raise ConfigError(f"--max-kv-mib must be positive, got {max_kv_mib:g}"
                          if max_kv_mib <= 0 else
                          "--max-kv-mib applies to batching (--max-batch above 1)")
    defaults = defaults or ServeDefaults()
    model = model_name or model_id(engine)
    metrics = _Metrics()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocketkv-engine")
    state = {"waiting": 0}
    lock = threading.Lock()

    batched = max_batch > 1
    if batched:
        batcher = engine.start_batching(
            max_batch, max_kv_bytes=None if max_kv_mib is None else int(max_kv_mib * 2**20))
        metrics.queue_length.set_function(lambda: batcher.waiting)
        metrics.running.set_function(lambda: batcher.running)
        metrics.decode_steps.set_function(lambda: batcher.decoder.steps)
        metrics.decode_tokens.set_function(lambda: batcher.decoder.step_tokens)
        metrics.decode_seconds.set_function(lambda: batcher.decoder.step_s)
        metrics.kv_bytes.set_function(lambda: batcher.decoder.kv_bytes_held())

    def waiting() -> int:
        return batcher.waiting if batched else state["waiting"]

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.shutdown(wait=False, cancel_futures=True)
        if batched:  # uvicorn has answered the open requests by now
            await asyncio.get_running_loop().run_in_executor(None, engine.close_batching)

    app = FastAPI(title="rocketkv", description="OpenAI-compatible API"
                  + (f" (up to {max_batch} requests decoded together)" if batched
                     else " (one request at a time)"), lifespan=lifespan)
    app.state.engine, app.state.defaults, app.state.model = engine, defaults, model
    app.state.batcher = batcher if batched else None
    app.state.metrics = metrics

    def _queued(fn: Callable[[], Result]) -> Callable[[], Result]:
        """``fn`` counted in the queue until the worker starts it, then as running.

        Raises:
            Busy: ``max_queue`` requests are waiting already.
        """
        with lock:
            if max_queue is not None and state["waiting"] >= max_queue:
                metrics.refused.inc()
                raise Busy(f"the server is busy: {state['waiting']} requests are waiting "
                           f"(--max-queue {max_queue}); try again later")
            state["waiting"] += 1
            metrics.queue_length.set(state["waiting"])

        def run() -> Result:
            with lock:
                state["waiting"] -= 1
                metrics.queue_length.set(state["waiting"])
            metrics.running.inc()
            try:
                return fn()
            finally:
                metrics.running.dec()
        return run

    def _generate(prompt: Any, kwargs: dict[str, Any], *, chat: bool | None,
                  on_text: Callable[[str], Any] | None = None,
                  cancelled: threading.Event | None = None) -> Result:
        if cancelled is not None and cancelled.is_set():  # gone while it waited: skipped
            metrics.abandoned.inc()
            raise _Cancelled
        t0 = time.perf_counter()
        result = engine.generate(prompt, chat=chat, on_text=on_text,
                                 on_token=_stop_when(cancelled),
                                 **kwargs)
        _count(kwargs["method"], result, time.perf_counter() - t0)
        steps = len(result.metrics["decode_ms"])  # batch 1: a token per step
        metrics.decode_steps.inc(steps)
        metrics.decode_tokens.inc(steps * result.metrics["batch_size"])
        metrics.decode_seconds.inc(sum(result.metrics["decode_ms"]) / 1e3)
        return result

    def _count(method: str, result: Result, seconds: float) -> None:
        metrics.latency.labels(method).observe(seconds)
        metrics.prompt_tokens.labels(method).inc(result.metrics["prompt_tokens"])
        metrics.generated_tokens.labels(method).inc(len(result.tokens))
        metrics.prefix_reused.labels(method).inc(result.metrics.get("prefix_tokens_reused", 0))
        if engine.prefix_cache is not None:
            metrics.prefix_bytes.set(engine.prefix_cache.nbytes())

    def _submit(prompt: Any, kwargs: dict[str, Any], *, chat: bool | None,
                on_text: Callable[[str], Any] | None = None,
                cancelled: threading.Event | None = None) -> asyncio.Future:
        """The request given to the engine's batcher (``Engine.submit``): an asyncio future
        of its ``Result``.

        Raises:
            Busy: ``max_queue`` requests are waiting already.
            ConfigError: the engine refused the settings (nothing queued).
        """
        if max_queue is not None and batcher.waiting >= max_queue:
            metrics.refused.inc()
            raise Busy(f"the server is busy: {batcher.waiting} requests are waiting "
                       f"(--max-queue {max_queue}); try again later")
        done = engine.submit(prompt, chat=chat, on_text=on_text,
                             on_token=_stop_when(cancelled), **kwargs)

        def counted(f: Any) -> None:
            if not f.cancelled() and f.exception() is None:
                r = f.result()
                _count(kwargs["method"], r, r.metrics["prefill_s"]
                       + sum(r.metrics["decode_ms"]) / 1e3)
        done.add_done_callback(counted)
        return asyncio.wrap_future(done)

    async def _unless_disconnected(request: Request, waitable: Any,
                                   cancelled: threading.Event) -> Any:
        """``waitable``'s result; meanwhile the client's connection is checked every
        ``DISCONNECT_POLL_S``: once it is gone ``cancelled`` is set (the worker skips the
        request or stops at its next token: the job itself is left to run, so the queue's
        count stays right) and ``_Cancelled`` is raised."""
        task = asyncio.ensure_future(waitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                cancelled.set()
                if not isinstance(waitable, asyncio.Future):  # an events.get(): not the job
                    task.cancel()
                elif batched and waitable.cancel():  # withdrawn before the batch took it
                    metrics.abandoned.inc()
                raise _Cancelled

    def _usage(result: Result) -> dict[str, int]:
        prompt_tokens = int(result.metrics["prompt_tokens"])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.tokens),
                "total_tokens": prompt_tokens + len(result.tokens)}

    def _config_error(e: ConfigError, data: dict[str, Any], chat: bool) -> BadRequest:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        message = re.sub(r"\bmax_new_tokens\b", _max_tokens_field(data, chat), message)
        return BadRequest(message)

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, e: BadRequest) -> JSONResponse:
        return _error(400, str(e), param=e.param)

    @app.exception_handler(_Cancelled)
    async def gone(_request: Request, _e: _Cancelled) -> JSONResponse:
        # the client closed the connection: nobody reads this (nginx's 499 in the metrics)
        return _error(499, "the client closed the request", kind="client_closed_request")

    @app.exception_handler(KVCapacityError)
    async def too_large(_request: Request, e: KVCapacityError) -> JSONResponse:
        return _error(503, str(e), kind="server_error")

    @app.exception_handler(Busy)
    async def busy(_request: Request, e: Busy) -> JSONResponse:
        response = _error(503, str(e), kind="server_error")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, str(e).splitlines()[0])

    @app.exception_handler(Exception)
    async def failed(_request: Request, e: Exception) -> JSONResponse:
        return _error(500, str(e).splitlines()[0] if str(e) else type(e).__name__,
                      kind="server_error")

    app.add_middleware(_CountRequests, metrics=metrics)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model, "queue_length": waiting()}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry),
                                 media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                            "owned_by": "rocketkv"}]}

    async def _complete(request: Request, chat: bool):
        data = _json_object(await request.body())
        if chat:
            prompt: Any = _messages(data)
        else:
            prompt = _prompt(data)
        kwargs = _settings(data, defaults, chat=chat)
        request.state.kv_method = kwargs["method"]
        stream = bool(data.get("stream"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        text_chat = None if chat else False  # a completion's prompt is plain text
        loop = asyncio.get_running_loop()

        cancelled = threading.Event()  # set when the client goes away: the worker skips the
        # request if it has not started, or stops at the next token

        if not stream:
            try:
                if batched:
                    future = _submit(prompt, kwargs, chat=text_chat, cancelled=cancelled)
                else:
                    future = loop.run_in_executor(worker, _queued(
                        lambda: _generate(prompt, kwargs, chat=text_chat,
                                          cancelled=cancelled)))
                future.add_done_callback(lambda f: f.cancelled() or f.exception())  # no warning
                result = await _unless_disconnected(request, future, cancelled)
            except KVCapacityError:
                raise
            except ConfigError as e:
                raise _config_error(e, data, chat) from None
            finish = FINISH.get(result.stop_reason, "stop")
            if chat:
                choice = {"index": 0, "message": {"role": "assistant",
                                                  "content": result.text or ""},
                          "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": result.text or "", "logprobs": None,
                          "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice], "usage": _usage(result)}

        # streamed: the worker's events through an asyncio queue; the response starts once
        # the first event shows that the settings passed the engine's checks
        events: asyncio.Queue = asyncio.Queue()

        def put(event: tuple) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        def job() -> Result:
            try:
                result = _generate(prompt, kwargs, chat=text_chat,
                                   on_text=lambda piece: put(("text", piece)),
                                   cancelled=cancelled)
            except BaseException as e:  # handed to the request's task, then re-raised
                put(("error", e))
                raise
            put(("done", result))
            return result

        if batched:
            try:
                future = _submit(prompt, kwargs, chat=text_chat,
                                 on_text=lambda piece: put(("text", piece)),
                                 cancelled=cancelled)
            except KVCapacityError:
                raise
            except ConfigError as e:
                raise _config_error(e, data, chat) from None

            def ended(f: asyncio.Future) -> None:
                if f.cancelled():
                    return
                e = f.exception()
                events.put_nowait(("error", e) if e is not None else ("done", f.result()))
            future.add_done_callback(ended)
        else:
            future = loop.run_in_executor(worker, _queued(job))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # no warning
        first = await _unless_disconnected(request, events.get(), cancelled)
        if first[0] == "error":
            if isinstance(first[1], ConfigError):
                raise _config_error(first[1], data, chat)
            raise first[1]
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool((data.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                    ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": finish}
            body = {"id": rid, "object": chunk_obj, "created": created, "model": model,
                    "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def sse() -> AsyncIterator[str]:
            event = first
            try:
                if chat:
                    yield chunk(None, None, role=True)
                while True:
                    if event[0] == "text":
                        if event[1]:
                            yield chunk(event[1], None)
                    elif event[0] == "done":
                        result = event[1]
                        yield chunk(None, FINISH.get(result.stop_reason, "stop"))
                        if include_usage:
                            body = {"id": rid, "object": chunk_obj, "created": created,
                                    "model": model, "choices": [], "usage": _usage(result)}
                            yield f"data: {json.dumps(body)}\n\n"
                        break
                    else:  # an error after the response started: said in the stream
                        e = event[1]
                        body = {"error": {"message": str(e).splitlines()[0] if str(e)
                                          else type(e).__name__, "type": "server_error",
                                          "param": None, "code": None}}
                        yield f"data: {json.dumps(body)}\n\n"
                        break
                    event = await events.get()
                yield "data: [DONE]\n\n"
            finally:
                cancelled.set()  # the client went away: the worker stops at the next token

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, chat=False)

    return app
