"""A load test of the OpenAI-compatible server (``rocketkv/serve/app.py``) through the ``openai``
client: several clients, each a thread with its own ``openai.OpenAI`` client, send streamed chat
requests one after another, mixing KV-cache configurations (``method``, ``budget``) and prompts;
then each distinct request is sent alone, non-streamed, as the reference answer.

What it measures, per request: the time to the first token (TTFT: from sending the request to
the first non-empty content chunk), the inter-token latencies (between successive content
chunks), the completion tokens (the stream's usage chunk); per run: requests answered and lost,
answers equal to their single run (greedy, so any difference is a bug: a request's answer must
not depend on what else the server was doing), aggregate completion tokens per second over the
run's wall time, TTFT and inter-token latency percentiles.

The server decodes up to ``--max-batch`` requests together (continuous batching): N clients'
requests share each decode step, so the aggregate tokens/s grows with N until the batch's step
time does; with ``--max-batch 1`` they queue behind each other and the aggregate stays about
one client's.

``scripts/load_test.py`` runs it (``run``) and writes ``load-test.json`` and ``load-test.md``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import torch
import uvicorn

from rocketkv import api
from rocketkv.cli.common import check_positive, command_line, write_json
from rocketkv.compression import METHODS
from rocketkv.data import ESSAYS
from rocketkv.engine.provenance import load_average, provenance
from rocketkv.evals.prompts import build_document, chars_per_4, join_sentences, read_texts
from rocketkv.model import ConfigError
from rocketkv.serve.app import ServeDefaults, create_app, model_id

Messages = list[dict[str, str]]

START_TIMEOUT_S = 30.0  # start_server's wait for uvicorn
JOIN_GRACE_S = 10.0  # run_load's wait past the deadline for the client threads
QUESTION = "Summarize the text above in one sentence."
PROMPT_TOKENS = (320, 1500)  # the default prompts' shortest and longest, in tokens
SKIPPED = "skipped: not started before the deadline"
UNFINISHED = "unfinished at the deadline"


@dataclass(frozen=True)
class RequestSpec:
    """One request of a load test's plan: sent by client ``client`` as its ``index``-th
    request; ``messages`` is prompt ``prompt_id`` (an index into the prompts), ``budget`` in
    tokens (None for a method without one), ``max_tokens`` the most completion tokens."""

    client: int
    index: int
    prompt_id: int
    messages: Messages
    method: str
    budget: int | None
    max_tokens: int

    @property
    def key(self) -> tuple[int, str, int | None, int]:
        """What identifies the answer: (prompt_id, method, budget, max_tokens)."""
        return (self.prompt_id, self.method, self.budget, self.max_tokens)


def config_label(method: str, budget: int | None) -> str:
    """``METHOD`` or ``METHOD@BUDGET``."""
    return method if budget is None else f"{method}@{budget}"


def parse_configs(specs: Sequence[str]) -> list[tuple[str, int | None]]:
    """``--configs``: each ``METHOD`` (a method without a budget: ``full``) or
    ``METHOD@BUDGET`` (budget a positive number of tokens); repeats dropped.

    Raises:
        ConfigError: an unknown method, a budgeted method without a budget, a budget given to
            a method that takes none, a budget that is not a positive integer, no configs.
    """
    out: list[tuple[str, int | None]] = []
    for spec in specs:
        name, at, rest = spec.partition("@")
        if name not in METHODS:
            raise ConfigError(f"--configs: unknown method {name!r} (choose from "
                              f"{', '.join(METHODS)}; METHOD@BUDGET gives its budget)")
        budget: int | None = None
        if at:
            if not METHODS[name].budgeted:
                raise ConfigError(f"--configs {spec}: {name} takes no budget")
            try:
                budget = int(rest)
            except ValueError:
                budget = 0
            if budget <= 0:
                raise ConfigError(f"--configs {spec}: the budget must be a positive number of "
                                  "tokens (e.g. rocketkv@256)")
        elif METHODS[name].budgeted:
            raise ConfigError(f"--configs {spec}: {name} needs a budget: {name}@TOKENS")
        if (name, budget) not in out:
            out.append((name, budget))
    if not out:
        raise ConfigError("--configs: give at least one METHOD or METHOD@BUDGET")
    return out


# ---- the plan


def plan_requests(prompts: Sequence[Messages], configs: Sequence[tuple[str, int | None]],
                  clients: int, requests_per_client: int, seed: int, *,
                  max_tokens: int = 32) -> list[list[RequestSpec]]:
    """Each client's requests, in the order it sends them, dealt round-robin from one sequence
    of (prompt, config) pairs: request ``i`` of client ``c`` is pair ``i * clients + c``.

    Pair ``k = q * P + r`` (P prompts, C configs, q taken mod C) is prompt ``r`` with config
    ``(r + q) mod C``, both in an order shuffled with ``seed``: any P consecutive pairs hold
    every prompt once and mixed configs, and any P * C consecutive pairs every (prompt,
    config) once. So the requests in flight at once mix prompts and configs, and a plan of
    ``clients=1`` (the single-client baseline) sends the same mix as a plan of more clients
    (exactly so when both send a multiple of P requests). Deterministic: the same arguments
    give the same plan.

    Args:
        prompts: chat messages per prompt (a prompt's id is its index).
        configs: (method, budget in tokens or None) pairs.
        clients, requests_per_client: positive counts.
        max_tokens: completion tokens at most, per request.
    Raises:
        ConfigError: no prompts or configs, or a count that is not positive.
    """
    if not prompts or not configs:
        raise ConfigError("a plan needs at least one prompt and one config")
    for name, n in (("clients", clients), ("requests per client", requests_per_client),
                    ("max_tokens", max_tokens)):
        if n <= 0:
            raise ConfigError(f"{name} must be positive, got {n}")
    rng = random.Random(seed)
    prompt_order = rng.sample(range(len(prompts)), len(prompts))
    config_order = rng.sample(range(len(configs)), len(configs))

    def pair(k: int) -> tuple[int, int]:
        q, r = divmod(k, len(prompts))
        return prompt_order[r], config_order[(r + q) % len(configs)]

    plan = []
    for c in range(clients):
        specs = []
        for i in range(requests_per_client):
            p, k = pair(i * clients + c)
            method, budget = configs[k]
            specs.append(RequestSpec(client=c, index=i, prompt_id=p,
                                     messages=[dict(m) for m in prompts[p]], method=method,
                                     budget=budget, max_tokens=max_tokens))
        plan.append(specs)
    return plan


# ---- the server


def start_server(engine, defaults=None, max_batch: int = 1) -> tuple[str, Callable[[], None]]:
    """Serve ``engine`` (``create_app(engine, defaults, max_batch=max_batch)``) with uvicorn in
    a daemon thread on 127.0.0.1, on a free port the system picks, log level warning.

    Returns:
        (the base URL, ``http://127.0.0.1:PORT/v1``; a function that stops the server and
        waits for its thread, at most 30 s and then 10 s more after forcing the exit).
    Raises:
        RuntimeError: the server did not start within 30 s (``START_TIMEOUT_S``), or its
            thread ended first (a port that cannot be bound).
    """
    config = uvicorn.Config(create_app(engine, defaults, max_batch=max_batch),
                            host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="rocketkv-load-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server stopped before it started (see its log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start within {START_TIMEOUT_S:g} s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        if thread.is_alive():  # a connection that does not close: stop waiting for it
            server.force_exit = True
            thread.join(timeout=10)

    return f"http://127.0.0.1:{port}/v1", stop


def _client(base_url: str, timeout_s: float):
    """An ``openai.OpenAI`` client of its own (no retries, no proxy: ``trust_env=False``)."""
    http = httpx.Client(trust_env=False, timeout=max(timeout_s, 0.001))
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)


def _error_line(e: BaseException) -> str:
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def server_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model ``GET /v1/models`` lists.

    Raises:
        ConfigError: the server cannot be reached, or answers with no model.
    """
    try:
        with _client(base_url, timeout_s) as client:
            models = client.models.list().data
    except Exception as e:  # noqa: BLE001 (openai's and httpx's errors, said in one line)
        raise ConfigError(f"cannot list the models of {base_url}: {_error_line(e)}") from None
    if not models:
        raise ConfigError(f"{base_url} serves no model")
    return models[0].id


def warm_up(base_url: str, spec: RequestSpec, *, model: str = "rocketkv",
            timeout_s: float = 300.0) -> dict[str, Any]:
    """One request left out of the numbers, before them: ``spec`` with 2 new tokens,
    non-streamed (the server's and the engine's first-call costs). Never raises.

    Returns:
        {"seconds": its wall time, "error": None or one line}.
    """
    t = time.perf_counter()
    error = None
    try:
        with _client(base_url, timeout_s) as client:
            client.chat.completions.create(
                model=model, messages=spec.messages, max_tokens=min(spec.max_tokens, 2),
                temperature=0, extra_body=_extra_body(spec.method, spec.budget))
    except Exception as e:  # noqa: BLE001 (said in the report; the run goes on)
        error = _error_line(e)
    return {"seconds": round(time.perf_counter() - t, 3), "error": error}


DECODE_COUNTERS = ("rocketkv_decode_steps", "rocketkv_decode_tokens", "rocketkv_decode_seconds")


def decode_counters(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's decode-step counters (``/metrics``: steps, the tokens they made, their
    seconds), or None when it has none (another server) or does not answer."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        with httpx.Client(trust_env=False, timeout=timeout_s) as http:
            text = http.get(f"{root}/metrics").text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in DECODE_COUNTERS:
            values[name.removeprefix("rocketkv_decode_")] = float(value)
    return values if len(values) == len(DECODE_COUNTERS) else None


def _extra_body(method: str, budget: int | None) -> dict[str, Any]:
    return {"method": method} if budget is None else {"method": method, "budget": budget}


# ---- the load


def _blank_record(spec: RequestSpec) -> dict[str, Any]:
    return {"client": spec.client, "index": spec.index, "prompt_id": spec.prompt_id,
            "method": spec.method, "budget": spec.budget, "max_tokens": spec.max_tokens,
            "text": None, "completion_tokens": None, "prompt_tokens": None,
            "finish_reason": None, "ok": False, "error": SKIPPED, "t_send_s": None,
            "ttft_ms": None, "inter_token_ms": [], "t_end_s": None}


def _send(client, spec: RequestSpec, model: str, record: dict[str, Any], t0: float,
          deadline: float, lock: threading.Lock) -> None:
    """One streamed request; fills ``record`` (under ``lock``) as it goes."""
    now = time.perf_counter()
    with lock:
        record.update(t_send_s=now - t0, error=UNFINISHED)
    pieces: list[str] = []
    last: float | None = None
    usage = finish = None
    try:
        stream = client.chat.completions.create(
            model=model, messages=spec.messages, max_tokens=spec.max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body=_extra_body(spec.method, spec.budget),
            timeout=max(deadline - now, 0.001))
        with contextlib.closing(stream):
            for chunk in stream:
                t = time.perf_counter()
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta is not None and choice.delta.content:
                        pieces.append(choice.delta.content)
                        with lock:
                            if last is None:
                                record["ttft_ms"] = (t - now) * 1000
                            else:
                                record["inter_token_ms"].append((t - last) * 1000)
                        last = t
                    if choice.finish_reason is not None:
                        finish = choice.finish_reason
                if t > deadline:
                    raise TimeoutError("the deadline passed during the answer")
        error = None
        if finish is None:
            error = "the stream ended without a finish_reason"
        elif usage is None:
            error = "the stream had no usage chunk (stream_options include_usage)"
    except Exception as e:  # noqa: BLE001 (any failure is this request's error, said in a line)
        error = _error_line(e)
    with lock:
        record.update(text="".join(pieces), finish_reason=finish, ok=error is None,
                      error=error, t_end_s=time.perf_counter() - t0,
                      completion_tokens=None if usage is None else usage.completion_tokens,
                      prompt_tokens=None if usage is None else usage.prompt_tokens)


def run_load(base_url: str, plan: Sequence[Sequence[RequestSpec]], timeout_s: float, *,
             model: str = "rocketkv") -> list[dict[str, Any]]:
    """Send ``plan``: one thread per client, each with its own ``openai.OpenAI`` client,
    sending its requests one after another, streamed (``include_usage``), temperature 0, the
    KV cache as extra fields ``method`` and ``budget``. All clients start together.

    ``timeout_s`` (seconds) bounds the whole run: a request not sent by then is recorded as
    skipped (``error`` ``"skipped: ..."``), one still streaming is cut off (an error), and the
    client's HTTP timeout is the time left, so nothing hangs: the call returns within
    ``timeout_s`` plus about 10 s (``JOIN_GRACE_S``) whatever the server does.

    Args:
        base_url: the server's ``.../v1``.
        plan: each client's requests (``plan_requests``).
        model: the request's ``model`` field (this project's server ignores it).
    Returns:
        one record per request, by client then index: client, index, prompt_id, method,
        budget, max_tokens, text (the streamed pieces joined), completion_tokens and
        prompt_tokens (the usage chunk's), finish_reason, ok (bool), error (None or one line),
        t_send_s and t_end_s (seconds from the run's start), ttft_ms (from sending to the first
        non-empty content chunk, milliseconds) and inter_token_ms (the milliseconds between
        successive content chunks; a chunk holds one token, or a few where a character spans
        tokens).
    """
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    records = [[_blank_record(s) for s in specs] for specs in plan]
    locks = [threading.Lock() for _ in plan]
    start = threading.Barrier(len(plan) + 1) if plan else None

    def client_thread(c: int) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait(timeout=30)
        try:
            client = _client(base_url, deadline - time.perf_counter())
        except Exception as e:  # noqa: BLE001
            with locks[c]:
                for r in records[c]:
                    r["error"] = _error_line(e)
            return
        with client:
            for spec, record in zip(plan[c], records[c]):
                if time.perf_counter() >= deadline:
                    break  # this and the rest stay skipped
                _send(client, spec, model, record, t0, deadline, locks[c])

    threads = [threading.Thread(target=client_thread, args=(c,), daemon=True,
                                name=f"rocketkv-load-test-client-{c}") for c in range(len(plan))]
    for t in threads:
        t.start()
    if start is not None:
        with contextlib.suppress(threading.BrokenBarrierError):
            start.wait(timeout=30)
    for t in threads:
        t.join(timeout=max(deadline - time.perf_counter(), 0) + JOIN_GRACE_S)
    out = []
    for c in range(len(plan)):
        with locks[c]:
            out += copy.deepcopy(records[c])
    return out


def single_runs(base_url: str, plan: Sequence[Sequence[RequestSpec]], *,
                timeout_s: float = 1800.0, model: str = "rocketkv"
                ) -> dict[tuple[int, str, int | None, int], dict[str, Any]]:
    """The reference answers: each distinct (prompt, method, budget, max_tokens) of ``plan``
    sent alone, one after another, non-streamed, temperature 0. ``timeout_s`` (seconds) bounds
    them all; one not sent by then is left out.

    Returns:
        {``RequestSpec.key``: {"prompt_id", "method", "budget", "max_tokens", "text",
        "completion_tokens", "error" (None or one line), "seconds"}}, in the plan's order.
    """
    deadline = time.perf_counter() + timeout_s
    distinct: dict[tuple, RequestSpec] = {}
    for specs in plan:
        for s in specs:
            distinct.setdefault(s.key, s)
    out: dict[tuple, dict[str, Any]] = {}
    with _client(base_url, timeout_s) as client:
        for key, s in distinct.items():
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            row: dict[str, Any] = {"prompt_id": s.prompt_id, "method": s.method,
                                   "budget": s.budget, "max_tokens": s.max_tokens,
                                   "text": None, "completion_tokens": None, "error": None}
            t = time.perf_counter()
            try:
                r = client.chat.completions.create(
                    model=model, messages=s.messages, max_tokens=s.max_tokens, temperature=0,
                    extra_body=_extra_body(s.method, s.budget), timeout=left)
                row["text"] = r.choices[0].message.content or ""
                row["completion_tokens"] = r.usage.completion_tokens if r.usage else None
            except Exception as e:  # noqa: BLE001 (the reference's error, said in one line)
                row["error"] = _error_line(e)
            row["seconds"] = round(time.perf_counter() - t, 3)
            out[key] = row
    return out


# ---- the numbers


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile (0 < p <= 100) of ``values``: the smallest value
    with at least p% of them at or below it (sorted[ceil(p/100 * n) - 1]); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)), 1) - 1]


def _key(record: dict[str, Any]) -> tuple[int, str, int | None, int]:
    return (record["prompt_id"], record["method"], record["budget"], record["max_tokens"])


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def summarize(records: Sequence[dict[str, Any]],
              references: dict[tuple[int, str, int | None, int], dict[str, Any]],
              wall_s: float, decode: tuple[dict[str, float], dict[str, float]] | None = None
              ) -> dict[str, Any]:
    """A run's numbers from its ``run_load`` records and the ``single_runs`` references;
    ``decode``: the server's ``decode_counters`` before and after the run.

    Percentiles are nearest-rank (``percentile``): p50 and p99 of the TTFTs of the answered
    requests and of all their inter-token latencies, in milliseconds (None when there are
    none).

    Args:
        wall_s: the run's wall time, seconds (from its start to its last answer).
    Returns:
        {"requests", "ok", "lost" (an error, or skipped), "skipped", "same_as_single" (ok
        answers whose text is their single run's), "mismatches" (the ok requests that differ,
        or whose single run is missing or failed: client, index, prompt_id, config, text,
        reference), "completion_tokens" (of the ok requests), "wall_s", "tokens_per_s"
        (completion tokens / wall_s), "ttft_ms_p50", "ttft_ms_p99", "inter_token_ms_p50",
        "inter_token_ms_p99", "per_config" ({METHOD[@BUDGET]: {"requests", "ok", "same"}}),
        "decode_steps", "decode_tokens", "decode_s", "decode_tokens_per_s" (the decode steps'
        tokens over their seconds: the server's decode throughput, prefill left out),
        "mean_batch" (decode tokens per step); these None without ``decode``}.
    """
    ok = [r for r in records if r["ok"]]
    mismatches = []
    same = 0
    per_config: dict[str, dict[str, int]] = {}
    for r in records:
        row = per_config.setdefault(config_label(r["method"], r["budget"]),
                                    {"requests": 0, "ok": 0, "same": 0})
        row["requests"] += 1
        if not r["ok"]:
            continue
        row["ok"] += 1
        ref = references.get(_key(r))
        if ref is not None and ref.get("error") is None and ref.get("text") == r["text"]:
            same += 1
            row["same"] += 1
        else:
            mismatches.append({
                "client": r["client"], "index": r["index"], "prompt_id": r["prompt_id"],
                "config": config_label(r["method"], r["budget"]), "text": r["text"],
                "reference": None if ref is None else ref.get("text"),
                "reference_error": "no single run" if ref is None else ref.get("error")})
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    itl = [x for r in ok for x in r["inter_token_ms"]]
    return {"requests": len(records), "ok": len(ok), "lost": len(records) - len(ok),
            "skipped": sum(str(r["error"]).startswith("skipped:") for r in records),
            "same_as_single": same, "mismatches": mismatches, "completion_tokens": tokens,
            "wall_s": round(wall_s, 3),
            "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
            "ttft_ms_p50": _ms(percentile(ttft, 50)), "ttft_ms_p99": _ms(percentile(ttft, 99)),
            "inter_token_ms_p50": _ms(percentile(itl, 50)),
            "inter_token_ms_p99": _ms(percentile(itl, 99)), "per_config": per_config,
            **_decode_figures(decode)}


def _decode_figures(decode: tuple[dict[str, float], dict[str, float]] | None
                    ) -> dict[str, Any]:
    if decode is None or decode[0] is None or decode[1] is None:
        return {"decode_steps": None, "decode_tokens": None, "decode_s": None,
                "decode_tokens_per_s": None, "mean_batch": None}
    d = {k: decode[1][k] - decode[0][k] for k in decode[0]}
    return {"decode_steps": int(d["steps"]), "decode_tokens": int(d["tokens"]),
            "decode_s": round(d["seconds"], 3),
            "decode_tokens_per_s": round(d["tokens"] / d["seconds"], 3) if d["seconds"] > 0
            else None,
            "mean_batch": round(d["tokens"] / d["steps"], 3) if d["steps"] else None}


# ---- the script


def prompt_lengths(n: int, longest: int = PROMPT_TOKENS[1]) -> list[int]:
    """``n`` document lengths in tokens, evenly spaced from ``PROMPT_TOKENS[0]`` (320, above
    the default budgets of 256, so that every budgeted config compresses) to ``longest``;
    both ends shrink together when ``longest`` is smaller (a model with a short context)."""
    shortest = min(PROMPT_TOKENS[0], max(longest // 3, 1))
    if n == 1:
        return [shortest]
    return [shortest + (longest - shortest) * i // (n - 1) for i in range(n)]


def essay_prompts(n: int, count_tokens: Callable[[str], int], longest: int = PROMPT_TOKENS[1],
                  texts: Sequence[str] | None = None) -> list[Messages]:
    """``n`` chat prompts: a chunk of the Paul Graham essays (``rocketkv.data.ESSAYS``), the
    i-th starting at the i-th essay and ``prompt_lengths(n, longest)[i]`` tokens long
    (``count_tokens``), then ``QUESTION``, as one user message.

    Raises:
        ConfigError: the essays cannot be read (``prompts.read_texts``).
    """
    texts = list(texts) if texts is not None else read_texts([str(ESSAYS)])
    out = []
    for i, length in enumerate(prompt_lengths(n, longest)):
        start = i % len(texts)
        doc = join_sentences(build_document(texts[start:] + texts[:start], length,
                                            count_tokens))
        out.append([{"role": "user", "content": f"{doc}\n\n{QUESTION}"}])
    return out


def _check_out(path: str) -> Path:
    """``--out`` made (with its parents) and writable.

    Raises:
        ConfigError: it cannot be made, is not a folder, or cannot be written.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {path} is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot make the folder: {e.strerror or e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {path}: not writable (permissions or a read-only "
                          "filesystem)")
    return out


def _base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url}: give an http:// or https:// URL")
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _table(summaries: dict[str, dict[str, Any]], ratio: float | None,
           settings: dict[str, Any], decode_ratio: float | None = None) -> str:
    def cell(v: Any) -> str:
        return "–" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    tokens = settings["prompt_tokens"]
    tokens = ", ".join(map(str, tokens)) if isinstance(tokens, list) else tokens
    lines = [f"# Load test: {settings['model']}", "",
             f"{settings['clients']} clients x {settings['requests']} streamed chat requests, "
             f"configs {', '.join(settings['configs'])}, {settings['max_new_tokens']} new "
             f"tokens at most, temperature 0; prompts of {tokens} tokens. " + (
                 "Requests run one at a time on the server." if settings.get("max_batch") == 1
                 else f"The server decodes up to {settings.get('max_batch')} requests "
                 "together (continuous batching)."), "",
             "| run | requests | ok | lost | same as single run | completion tokens | "
             "wall s | tokens/s | decode tokens/s | mean batch | TTFT p50 ms | TTFT p99 ms | "
             "ITL p50 ms | ITL p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        lines.append("| " + " | ".join(cell(v) for v in (
            name, s["requests"], s["ok"], s["lost"], s["same_as_single"],
            s["completion_tokens"], s["wall_s"], s["tokens_per_s"],
            s.get("decode_tokens_per_s"), s.get("mean_batch"), s["ttft_ms_p50"],
            s["ttft_ms_p99"], s["inter_token_ms_p50"], s["inter_token_ms_p99"])) + " |")
    caveat = ("." if settings["same_prompt_mix"] else " (the single client sent another mix "
              "of prompts: --requests is not a multiple of --prompts).")
    lines += ["", f"Aggregate tokens/s over the single client's: {cell(ratio)}{caveat}",
              "", "tokens/s: completion tokens over the run's wall time (prefill included); "
              "decode tokens/s: the tokens the server's decode steps made over the seconds "
              "they took (its /metrics before and after the run; prefill left out). Decode "
              f"tokens/s over the single client's: {cell(decode_ratio)}.", ""]
    return "\n".join(lines)


def run(args, argv: Sequence[str] | None = None) -> int:
    """``scripts/load_test.py`` with its parsed arguments ``args``: the checks (positive
    counts, the configs, a writable ``--out`` folder) before the model loads; the engine and a
    server on 127.0.0.1 (or ``--url``'s); the prompts; one client (the single-client
    tokens/s), then ``--clients`` clients, then the single runs, all within ``--time-limit``
    seconds; ``load-test.json`` and ``load-test.md`` in ``--out``.

    Returns:
        the exit status: 0 when no request was lost and every answer equals its single run,
        1 otherwise (one ``error:`` line says how many), 2 on bad input (one ``error:`` line on
        stderr, before the model loads).
    """
    t_start = time.perf_counter()
    load_before = load_average()
    try:
        check_positive(args, "clients", "requests", "max_new_tokens", "prompts", "threads",
                       "max_batch")
        if args.time_limit is None or args.time_limit <= 0:
            raise ConfigError(f"--time-limit must be positive, got {args.time_limit}")
        configs = parse_configs(args.configs)
        url = None if args.url is None else _base_url(args.url)
        out = _check_out(args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    same_mix = args.requests % args.prompts == 0
    if not same_mix:
        print(f"note: --requests {args.requests} is not a multiple of --prompts "
              f"{args.prompts}: the single client sends another mix of prompts than the "
              "clients together, so the tokens/s ratio compares different work",
              file=sys.stderr)
    stop = None
    engine = None
    try:
        if url is None:
            if args.threads:
                torch.set_num_threads(args.threads)
            engine = api.load(args.checkpoint, device="cpu")
            model = model_id(engine)

            def count(text: str) -> int:
                return len(engine.tokenizer.encode(text, bos=False))

            longest = min(PROMPT_TOKENS[1],
                          engine.model.args.max_seq_len - args.max_new_tokens - 64)
            prompts = essay_prompts(args.prompts, count, longest)
        else:
            model = server_model(url)
            prompts = essay_prompts(args.prompts, chars_per_4)
        if engine is not None:
            url, stop = start_server(engine, ServeDefaults(max_new_tokens=args.max_new_tokens),
                                     max_batch=args.max_batch)
    except (ConfigError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1

    def left() -> float:
        return args.time_limit - (time.perf_counter() - t_start)

    try:
        runs: dict[str, tuple[list[dict[str, Any]], float]] = {}
        plans = {"1 client": plan_requests(prompts, configs, 1, args.requests, args.seed,
                                           max_tokens=args.max_new_tokens),
                 f"{args.clients} clients": plan_requests(
                     prompts, configs, args.clients, args.requests, args.seed,
                     max_tokens=args.max_new_tokens)}
        print("warm-up request...", flush=True)
        warm = warm_up(url, plans["1 client"][0][0], model=model,
                       timeout_s=max(min(left(), 300), 0.001))
        for name, plan in plans.items():
            print(f"{name}: {sum(map(len, plan))} requests...", flush=True)
            t = time.perf_counter()
            before = decode_counters(url)
            records = run_load(url, plan, left(), model=model)
            ends = [r["t_end_s"] for r in records if r["t_end_s"] is not None]
            runs[name] = (records, max(ends) if ends else time.perf_counter() - t,
                          (before, decode_counters(url)))
        print("single runs...", flush=True)
        references = single_runs(url, [s for p in plans.values() for s in p],
                                 timeout_s=max(left(), 0.001), model=model)
    finally:
        if stop is not None:
            stop()

    summaries = {name: summarize(records, references, wall, decode)
                 for name, (records, wall, decode) in runs.items()}
    one, many = summaries.values()
    ratio = (round(many["tokens_per_s"] / one["tokens_per_s"], 3)
             if one["tokens_per_s"] and many["tokens_per_s"] is not None else None)
    decode_ratio = (round(many["decode_tokens_per_s"] / one["decode_tokens_per_s"], 3)
                    if one["decode_tokens_per_s"] and many["decode_tokens_per_s"] is not None
                    else None)
    if engine is not None:  # the prompts as the server counts them (chat template included)
        prompt_tokens: Any = [len(engine.encode(p)) for p in prompts]
    else:
        prompt_tokens = "about " + ", ".join(map(str, prompt_lengths(args.prompts)))
    settings = {"model": model, "url": args.url, "server": "started" if args.url is None
                else "given", "clients": args.clients, "requests": args.requests,
                "configs": [config_label(m, b) for m, b in configs],
                "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
                "prompt_tokens": prompt_tokens,
                "same_prompt_mix": same_mix, "time_limit_s": args.time_limit,
                "seed": args.seed, "threads": args.threads,
                "max_batch": args.max_batch if args.url is None else None}
    report = {"command": command_line("load_test.py", argv), "settings": settings,
              "warm_up": warm, "summaries": summaries, "tokens_per_s_ratio": ratio,
              "decode_tokens_per_s_ratio": decode_ratio,
              "load_average": {"before": load_before, "after": load_average()},
              "provenance": provenance(None if engine is None else engine.checkpoint,
                                       None if argv is None
                                       else ["scripts/load_test.py", *argv]),
              "references": list(references.values()),
              "records": {name: records for name, (records, _, _) in runs.items()}}
    for name, s in summaries.items():
        print(f"{name}: {s['ok']}/{s['requests']} ok, {s['lost']} lost, "
              f"{s['same_as_single']} same as single run, {s['tokens_per_s']} tokens/s, "
              f"TTFT p50 {s['ttft_ms_p50']} ms, p99 {s['ttft_ms_p99']} ms, ITL p50 "
              f"{s['inter_token_ms_p50']} ms, p99 {s['inter_token_ms_p99']} ms", flush=True)
    print(f"aggregate tokens/s over the single client's: {ratio}; decode tokens/s: "
          f"{decode_ratio}", flush=True)
    try:
        write_json(out / "load-test.json", report)
        (out / "load-test.md").write_text(_table(summaries, ratio, settings, decode_ratio))
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    lost = sum(s["lost"] for s in summaries.values())
    differ = sum(len(s["mismatches"]) for s in summaries.values())
    if lost or differ:
        print(f"error: {lost} requests lost, {differ} answers differ from their single run "
              f"(see {out / 'load-test.json'})", file=sys.stderr)
        return 1
    return 0
