"""The OpenAI-compatible server (``rocketkv/serve/app.py``): in process through FastAPI's
TestClient, and through the ``openai`` client against a real uvicorn server on 127.0.0.1."""

import contextlib
import json
import threading
import time
import warnings

import httpx
import openai
import pytest
import uvicorn
from conftest import SMOLLM2_GGUF, shared_file
from fastapi.testclient import TestClient

import rocketkv
from rocketkv.serve.app import ServeDefaults, create_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG = ("The quick brown fox jumps over the lazy dog near the river bank. " * 12
        + "Which animal jumps?")
MAX = 12


@pytest.fixture(scope="module")
def engine():
    return rocketkv.load(shared_file(SMOLLM2_GGUF))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ServeDefaults(max_new_tokens=MAX))) as c:
        yield c


def chat(client, **fields):
    body = {"model": "m", "messages": QUESTION, "max_tokens": MAX, "temperature": 0, **fields}
    return client.post("/v1/chat/completions", json=body)


def sse(text: str) -> list:
    """The chunks of a server-sent event stream, which ends with ``data: [DONE]``."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_a_chat_completion_has_the_openai_shape_and_is_engine_generate(client, engine):
    r = chat(client)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "SmolLM2-135M-Instruct.Q4_1" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    direct = engine.generate(QUESTION, max_new_tokens=MAX, temperature=0)
    assert choice["message"]["content"] == direct.text
    usage = body["usage"]
    assert usage["prompt_tokens"] == direct.metrics["prompt_tokens"]
    assert usage["completion_tokens"] == len(direct.tokens)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert choice["finish_reason"] == ("stop" if direct.stop_reason == "eos" else "length")


def test_a_streamed_chat_completion_is_the_whole_one_in_pieces(client):
    whole = chat(client).json()["choices"][0]["message"]["content"]
    r = chat(client, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole


def test_a_completion_is_plain_text_generation(client, engine):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "text_completion"
    (choice,) = out["choices"]
    direct = engine.generate("The capital of France is", chat=False, max_new_tokens=8,
                             temperature=0)
    assert choice["text"] == direct.text and choice["index"] == 0
    assert choice["finish_reason"] in ("stop", "length")
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse(streamed.text)) == direct.text


def test_a_request_chooses_its_kv_cache(client, engine):
    """``method``, ``budget`` and a method option as extra fields: the answer is the engine's
    with the same cache."""
    prompt = [{"role": "user", "content": LONG}]
    r = chat(client, messages=prompt, method="rocketkv", budget=64, max_tokens=8)
    assert r.status_code == 200, r.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the budget compresses: no "no compression" warning
        direct = engine.generate(prompt, method="rocketkv", budget=64, max_new_tokens=8,
                                 temperature=0)
    assert r.json()["choices"][0]["message"]["content"] == direct.text
    r = chat(client, method="quest", budget=32, page_size=8, max_tokens=4)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, words", [
    ("{not json", "not valid JSON"),
    ({"messages": QUESTION, "method": "nope"}, "unknown method 'nope'"),
    ({"messages": QUESTION, "method": "rocketkv", "budget": -3}, "budget"),
    ({"messages": QUESTION, "method": "rocketkv", "budget": "many"}, "budget"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens must be"),
    ({"messages": QUESTION, "temperature": "hot"}, "temperature"),
    ({"messages": QUESTION, "stop": ["\n"]}, "stop strings are not supported"),
    ({"messages": "hi"}, "messages must be"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": QUESTION, "method": "full", "page_size": 8}, "page_size"),
    ({"messages": [{"role": "user", "content": "hello " * 9000}]}, "context"),
    ({"messages": [{"role": "user", "content": "hello " * 9000}], "stream": True}, "context"),
])
def test_bad_input_is_a_400_with_the_message(client, body, words):
    content = body if isinstance(body, str) else json.dumps(body)
    r = client.post("/v1/chat/completions", content=content)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert words in error["message"] and "\n" not in error["message"]


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert client.get("/health").json()["status"] == "ok"
    chat(client, max_tokens=2)
    text = client.get("/metrics").text
    assert 'rocketkv_requests_total{endpoint="/v1/chat/completions",method="full",' \
           'status="200"}' in text
    assert 'rocketkv_generated_tokens_total{method="full"}' in text
    assert "rocketkv_queue_length 0.0" in text and "rocketkv_running 0.0" in text


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn on 127.0.0.1 (a free port the system picks) in a thread; its base
    URL. Stopped at the end."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(engine):
    with serving(create_app(engine, ServeDefaults(max_new_tokens=MAX))) as url:
        yield url


@pytest.fixture
def api(server):
    http = httpx.Client(trust_env=False, timeout=60)  # loopback: no proxy
    with openai.OpenAI(base_url=server, api_key="unused", max_retries=0,
                       http_client=http) as c:
        yield c


def test_the_openai_client_talks_to_the_server(api, engine):
    (model,) = api.models.list().data
    assert model.id == "SmolLM2-135M-Instruct.Q4_1"
    whole = api.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=MAX,
                                        temperature=0)
    text = whole.choices[0].message.content
    assert text == engine.generate(QUESTION, max_new_tokens=MAX, temperature=0).text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = api.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=MAX,
                                         temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == text
    done = api.completions.create(model=model.id, prompt="The capital of France is",
                                  max_tokens=6, temperature=0)
    assert done.choices[0].text == engine.generate(
        "The capital of France is", chat=False, max_new_tokens=6, temperature=0).text
    compressed = api.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": LONG}], max_tokens=8,
        temperature=0, extra_body={"method": "rocketkv", "budget": 64})
    assert compressed.choices[0].message.content == engine.generate(
        [{"role": "user", "content": LONG}], method="rocketkv", budget=64, max_new_tokens=8,
        temperature=0).text


def test_the_openai_client_sees_a_400(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="m", messages=QUESTION, max_tokens=4,
                                    extra_body={"method": "nope"})
    assert e.value.status_code == 400
    assert "unknown method 'nope'" in e.value.message


def test_requests_at_once_wait_their_turn(server, engine):
    """Three chat requests sent together to a server without batching (``max_batch`` 1) run
    one at a time: each is answered in full, with the greedy answer a request alone gets."""
    expected = engine.generate(QUESTION, max_new_tokens=MAX, temperature=0).text
    answers, errors = [], []

    def ask() -> None:
        try:
            with httpx.Client(trust_env=False, timeout=60) as http:
                r = http.post(f"{server}/chat/completions",
                              json={"messages": QUESTION, "max_tokens": MAX, "temperature": 0})
            answers.append(r.json()["choices"][0]["message"]["content"])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and answers == [expected] * 3


def test_a_full_queue_is_refused_with_503(engine, monkeypatch):
    """With ``max_queue=1``: one request running (held by a gate), one waiting, the third is
    refused at once with 503 and Retry-After; once the gate opens, the two answer in full."""
    gate, started = threading.Event(), threading.Event()
    real = engine.generate

    def held(*a, **kw):
        started.set()
        assert gate.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(engine, "generate", held)
    app = create_app(engine, ServeDefaults(max_new_tokens=4), max_queue=1)
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0}
    with TestClient(app) as client:
        answers = []

        def ask():
            answers.append(client.post("/v1/chat/completions", json=body))

        first = threading.Thread(target=ask)
        first.start()
        assert started.wait(60)  # running in the worker
        second = threading.Thread(target=ask)
        second.start()
        deadline = time.monotonic() + 30
        while client.get("/health").json()["queue_length"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        refused = client.post("/v1/chat/completions", json=body)
        gate.set()
        first.join(60)
        second.join(60)
        metrics = client.get("/metrics").text
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "server_error" and "1 requests are waiting" in error["message"]
    assert [a.status_code for a in answers] == [200, 200]
    assert "rocketkv_refused_total 1.0" in metrics
    with pytest.raises(rocketkv.ConfigError, match="--max-queue must not be negative"):
        create_app(engine, max_queue=-1)


def test_a_client_that_goes_away_frees_its_place(engine, monkeypatch):
    """A request whose client disconnects while it waits is skipped, not generated: the next
    one runs right after the one that held the engine."""
    gate, started = threading.Event(), threading.Event()
    real, calls = engine.generate, []

    def held(*a, **kw):
        calls.append(kw.get("max_new_tokens"))
        started.set()
        assert gate.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(engine, "generate", held)
    with serving(create_app(engine, ServeDefaults(max_new_tokens=4))) as url:
        results = []

        def ask(max_tokens, timeout):
            body = {"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0}
            try:
                with httpx.Client(trust_env=False, timeout=timeout) as http:
                    results.append(http.post(f"{url}/chat/completions", json=body).status_code)
            except httpx.TimeoutException:
                results.append("gone")

        first = threading.Thread(target=ask, args=(4, 60))
        first.start()
        assert started.wait(60)
        ask(5, 0.5)  # waits behind the first, gives up after half a second
        time.sleep(4 * 0.25)  # the server notices within a poll or two
        gate.set()
        first.join(60)
        ask(6, 60)
        with httpx.Client(trust_env=False, timeout=10) as http:
            metrics = http.get(f"{url[:-3]}/metrics").text
    assert results == ["gone", 200, 200]
    assert calls == [4, 6]  # the request that went away was never generated
    assert "rocketkv_abandoned_total 1.0" in metrics
    assert "rocketkv_queue_length 0.0" in metrics  # its place given back


def test_sigterm_finishes_the_running_request_then_exits(stories_dir):
    """``serve.py`` under SIGTERM (what a job scheduler or ``docker stop`` sends): the request
    being generated is answered in full, then the process exits (uvicorn's graceful
    shutdown)."""
    import signal
    import socket
    import subprocess
    import sys

    from conftest import ROOT

    with socket.socket() as s:  # a free port for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--checkpoint",
                             str(stories_dir), "--device", "cpu", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # up once /health answers
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            try:
                if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        answer = {}

        def ask():
            body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                    "stop": None}
            with httpx.Client(trust_env=False, timeout=120) as http:
                answer["r"] = http.post(f"{url}/v1/completions", json=body)

        thread = threading.Thread(target=ask)
        thread.start()
        while "rocketkv_running 1.0" not in httpx.get(f"{url}/metrics", timeout=5,
                                                       trust_env=False).text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        thread.join(120)
        # uvicorn drains, then raises the signal again: the status says SIGTERM ended it
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = answer["r"]
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] > 100  # answered in full, not cut off


BATCHED = [{}, {"method": "rocketkv", "budget": 64}, {"method": "snapkv_pp", "budget": 64},
           {"method": "streamingllm", "budget": 32}]  # the server's default: full


def test_batched_requests_decode_together_and_answer_as_alone(engine):
    """``max_batch=4``: four requests with four KV caches sent at once share decode steps, and
    each (whole or streamed) is the greedy answer ``Engine.generate`` gives it alone."""
    messages = [{"role": "user", "content": LONG}]
    expected = [engine.generate(messages, max_new_tokens=MAX, temperature=0, **fields)
                for fields in BATCHED]
    app = create_app(engine, ServeDefaults(max_new_tokens=MAX), max_batch=4)
    batcher = app.state.batcher
    with serving(app) as url:
        answers, errors = {}, []

        def ask(i: int, stream: bool) -> None:
            http = httpx.Client(trust_env=False, timeout=120)
            try:
                with openai.OpenAI(base_url=url, api_key="unused", max_retries=0,
                                   http_client=http) as api:
                    fields = dict(model="m", messages=messages, max_tokens=MAX, temperature=0,
                                  extra_body=BATCHED[i])
                    if stream:
                        chunks = api.chat.completions.create(stream=True, **fields)
                        answers[i] = "".join(c.choices[0].delta.content or ""
                                             for c in chunks if c.choices)
                    else:
                        answers[i] = api.chat.completions.create(**fields).choices[0] \
                            .message.content
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(i, i % 2 == 1)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors
    assert [answers[i] for i in range(4)] == [r.text for r in expected]
    assert batcher.decoder.steps < batcher.decoder.step_tokens  # steps were shared
    assert engine._batcher is None  # stopped with the server: generate works again
    assert engine.generate(QUESTION, max_new_tokens=2, temperature=0).tokens


def test_a_batched_stream_whose_client_goes_away_leaves_the_batch(engine, monkeypatch):
    """A streamed request whose client closes the connection after a few chunks ends at its
    next token (its future holds the cancellation), and the batch serves the next one."""
    from rocketkv.serve.app import _Cancelled

    futures, submit_run = [], engine.submit_run

    def spy(*a, **kw):
        futures.append(submit_run(*a, **kw))
        return futures[-1]

    monkeypatch.setattr(engine, "submit_run", spy)
    app = create_app(engine, ServeDefaults(max_new_tokens=MAX), max_batch=2)
    batcher = app.state.batcher
    with serving(app) as url:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(trust_env=False, timeout=60) as http:
            with http.stream("POST", f"{url}/chat/completions", json=body) as r:
                for n, _line in enumerate(r.iter_lines()):
                    if n >= 4:
                        break  # the client goes away after a few tokens
        assert isinstance(futures[0].exception(timeout=30), _Cancelled)
        assert batcher.running == 0
        with httpx.Client(trust_env=False, timeout=60) as http:
            r = http.post(f"{url}/chat/completions", json={**body, "stream": False,
                                                            "max_tokens": 4})
    assert r.status_code == 200 and futures[1].result().tokens


def test_a_request_whose_kv_cache_cannot_fit_gets_503(engine):
    """``max_kv_mib``: a request whose cache alone exceeds it is refused at once with 503 and
    a message naming the sizes; a smaller one is answered."""
    app = create_app(engine, ServeDefaults(max_new_tokens=MAX), max_batch=2, max_kv_mib=8)
    with TestClient(app) as client:
        big = chat(client, max_tokens=2000)
        small = chat(client, max_tokens=4, method="rocketkv", budget=64)
    assert big.status_code == 503
    assert "MiB, more than the 8.0 MiB" in big.json()["error"]["message"]
    assert small.status_code == 200
    with pytest.raises(rocketkv.ConfigError, match="applies to batching"):
        create_app(engine, max_kv_mib=1)
