"""The load test of the OpenAI-compatible server (``rocketkv/evals/load_test.py``,
``scripts/load_test.py``), small: stories260K served on 127.0.0.1, two clients of the ``openai``
client at once, a full and a compressed KV cache."""

import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, shared_file

import rocketkv
from rocketkv import api
from rocketkv.data import TINYSTORIES_TEXTS
from rocketkv.evals import load_test
from rocketkv.evals.load_test import (
    RequestSpec,
    percentile,
    plan_requests,
    run_load,
    single_runs,
    start_server,
    summarize,
)
from rocketkv.serve.app import ServeDefaults
from scripts.load_test import main

CONFIGS = [("full", None), ("rocketkv", 64)]
MAX = 8


@pytest.fixture(scope="module")
def engine(stories_model, stories_dir):
    from rocketkv.formats.tokenizer import load_tokenizer

    return rocketkv.Engine(stories_model, load_tokenizer(str(stories_dir)))


@pytest.fixture(scope="module")
def prompts(engine):
    """Three chat prompts of plain story text, about 100 to 300 tokens through stories260K's
    fallback template (it has no chat template of its own): beyond the budget of 64, and
    each answered differently by rocketkv@64 and the full cache (checked by
    ``test_a_wrong_cache_is_seen_as_a_mismatch``)."""
    text = " ".join(shared_file(TINYSTORIES_TEXTS[0]).read_text().split())
    out = [[{"role": "user", "content": text[i * 500:i * 500 + n]}]
           for i, n in ((0, 180), (3, 500), (4, 600))]
    lengths = [len(engine.encode(p)) for p in out]
    assert all(64 + MAX < n < 400 for n in lengths), lengths
    return out


@pytest.fixture(scope="module")
def server(engine):
    url, stop = start_server(engine, ServeDefaults(max_new_tokens=MAX))
    yield url
    stop()


def test_the_plan_is_deterministic_and_mixes_prompts_and_configs():
    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(3)]
    configs = [("full", None), ("rocketkv", 64)]
    plan = plan_requests(prompts, configs, 3, 4, seed=7, max_tokens=5)
    assert plan == plan_requests(prompts, configs, 3, 4, seed=7, max_tokens=5)
    assert [len(specs) for specs in plan] == [4, 4, 4]
    assert all(s.client == c and s.index == i and s.max_tokens == 5
               for c, specs in enumerate(plan) for i, s in enumerate(specs))
    assert all(s.messages == prompts[s.prompt_id] for specs in plan for s in specs)
    # 12 requests: each (prompt, config) pair twice; each round (request i of every client)
    # holds every prompt once and both configs
    pairs = [(s.prompt_id, s.method, s.budget) for specs in plan for s in specs]
    assert sorted(set(pairs)) == sorted((p, m, b) for p in range(3) for m, b in configs)
    assert all(pairs.count(x) == 2 for x in set(pairs))
    for i in range(4):
        round_ = [specs[i] for specs in plan]
        assert sorted(s.prompt_id for s in round_) == [0, 1, 2]
        assert {s.method for s in round_} == {"full", "rocketkv"}
    # one client sends the same mix: 3 requests, every prompt once
    (alone,) = plan_requests(prompts, configs, 1, 3, seed=7, max_tokens=5)
    assert sorted(s.prompt_id for s in alone) == [0, 1, 2]
    others = {tuple((s.prompt_id, s.method) for s in specs)
              for seed in range(8) for specs in plan_requests(prompts, configs, 1, 6, seed)}
    assert len(others) > 1  # the seed shuffles
    with pytest.raises(rocketkv.ConfigError, match="clients must be positive"):
        plan_requests(prompts, configs, 0, 1, seed=0)


def test_percentiles_are_nearest_rank():
    assert percentile(list(range(1, 101)), 50) == 50
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([30, 10, 20], 50) == 20 and percentile([30, 10, 20], 99) == 30
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None


def _record(**fields):
    base = {"client": 0, "index": 0, "prompt_id": 0, "method": "full", "budget": None,
            "max_tokens": 4, "text": "a b", "completion_tokens": 4, "prompt_tokens": 9,
            "finish_reason": "length", "ok": True, "error": None, "t_send_s": 0.0,
            "ttft_ms": 100.0, "inter_token_ms": [10.0, 20.0, 30.0], "t_end_s": 1.0}
    return {**base, **fields}


def test_the_summary_counts_lost_requests_and_mismatches():
    refs = {(0, "full", None, 4): {"text": "a b", "error": None},
            (1, "rocketkv", 64, 4): {"text": "x", "error": None}}
    records = [_record(),
               _record(index=1, prompt_id=1, method="rocketkv", budget=64, text="y",
                       ttft_ms=300.0, inter_token_ms=[40.0]),
               _record(index=2, ok=False, error=load_test.SKIPPED, text=None,
                       completion_tokens=None, ttft_ms=None, inter_token_ms=[]),
               _record(index=3, ok=False, error="APIConnectionError: refused"),
               _record(index=4, prompt_id=2)]  # no single run of prompt 2
    s = summarize(records, refs, wall_s=2.0)
    assert (s["requests"], s["ok"], s["lost"], s["skipped"]) == (5, 3, 2, 1)
    assert s["same_as_single"] == 1
    assert [(m["index"], m["reference"]) for m in s["mismatches"]] == [(1, "x"), (4, None)]
    assert s["mismatches"][1]["reference_error"] == "no single run"
    assert s["completion_tokens"] == 12 and s["tokens_per_s"] == 6.0
    assert (s["ttft_ms_p50"], s["ttft_ms_p99"]) == (100.0, 300.0)
    assert (s["inter_token_ms_p50"], s["inter_token_ms_p99"]) == (20.0, 40.0)
    assert s["per_config"] == {"full": {"requests": 4, "ok": 2, "same": 1},
                               "rocketkv@64": {"requests": 1, "ok": 1, "same": 0}}


def test_two_clients_get_the_answers_each_request_gets_alone(server, engine, prompts):
    plan = plan_requests(prompts, CONFIGS, 2, 2, seed=0, max_tokens=MAX)
    t = time.perf_counter()
    records = run_load(server, plan, timeout_s=120)
    wall = time.perf_counter() - t
    assert len(records) == 4
    assert all(r["ok"] and r["error"] is None for r in records), records
    assert {r["method"] for r in records} == {"full", "rocketkv"}
    for r in records:
        assert r["finish_reason"] in ("stop", "length") and r["text"]
        assert 0 < r["completion_tokens"] <= MAX and r["prompt_tokens"] > 64 + MAX
        assert 0 <= r["t_send_s"] < r["t_send_s"] + r["ttft_ms"] / 1000 <= r["t_end_s"] < wall
        assert all(x >= 0 for x in r["inter_token_ms"])
    assert sum(len(r["inter_token_ms"]) for r in records) >= len(records)
    # the two clients overlapped: each one's first request was sent before the other's ended
    first = [r for r in records if r["index"] == 0]
    assert max(r["t_send_s"] for r in first) < min(r["t_end_s"] for r in first)

    refs = single_runs(server, plan)
    assert set(refs) == {s.key for specs in plan for s in specs}
    for (prompt_id, method, budget, max_tokens), ref in refs.items():  # the engine's own
        direct = engine.generate(prompts[prompt_id], method=method, budget=budget,
                                 max_new_tokens=max_tokens, temperature=0)
        assert ref["error"] is None and ref["text"] == direct.text
        assert ref["completion_tokens"] == len(direct.tokens)

    s = summarize(records, refs, wall)
    assert s["ok"] + s["lost"] == s["requests"] == 4 and s["lost"] == 0
    assert s["same_as_single"] == 4 and s["mismatches"] == []
    assert s["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    assert s["tokens_per_s"] == pytest.approx(s["completion_tokens"] / wall, rel=1e-2)
    assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p99"]
    assert 0 <= s["inter_token_ms_p50"] <= s["inter_token_ms_p99"]
    assert sum(v["requests"] for v in s["per_config"].values()) == 4


def test_a_wrong_cache_is_seen_as_a_mismatch(server, prompts):
    """A record whose answer came from another cache than its single run's: listed."""
    plan = plan_requests(prompts, CONFIGS, 1, 2, seed=0, max_tokens=MAX)
    records = run_load(server, plan, timeout_s=120)
    refs = single_runs(server, plan)
    swapped = {}
    for p, method, budget, n in refs:
        other = "full" if method != "full" else "rocketkv"
        bud = None if other == "full" else 64
        text = single_runs(server, [[RequestSpec(0, 0, p, prompts[p], other, bud, n)]])
        swapped[(p, method, budget, n)] = next(iter(text.values()))
    s = summarize(records, swapped, 1.0)
    differ = sum(swapped[k]["text"] != refs[k]["text"] for k in refs)
    assert len(s["mismatches"]) == differ and differ > 0


def test_the_deadline_bounds_the_run():
    """A server that never answers (a socket that never accepts) and a deadline of 1 s: every
    request is lost, none hangs; a deadline already past sends nothing."""
    plan = plan_requests([[{"role": "user", "content": "hi"}]], CONFIGS, 2, 3, seed=0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        t = time.perf_counter()
        records = run_load(url, plan, timeout_s=1.0)
        assert time.perf_counter() - t < 1.0 + load_test.JOIN_GRACE_S
        assert len(records) == 6 and not any(r["ok"] for r in records)
        assert all(r["error"] for r in records)
        sent = [r for r in records if r["t_send_s"] is not None]
        assert sent and all(r["error"] != load_test.SKIPPED for r in sent)
        assert any(r["error"] == load_test.SKIPPED for r in records)
        skipped = run_load(url, plan, timeout_s=0)
    assert all(r["error"] == load_test.SKIPPED and r["t_send_s"] is None for r in skipped)
    s = summarize(skipped, {}, 1.0)
    assert (s["ok"], s["lost"], s["skipped"]) == (0, 6, 6)


def test_the_script_writes_its_files_and_exits_0(engine, monkeypatch, tmp_path, capsys):
    """A tiny run of the script's body (stories260K as the loaded model): exit 0, both files,
    the summaries, the ratio and the records."""
    import json

    monkeypatch.setattr(api, "load", lambda *a, **k: engine)
    out = tmp_path / "out"
    rc = main(["--clients", "2", "--requests", "1", "--prompts", "2", "--max-new-tokens",
               "4", "--configs", "full", "rocketkv@64", "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "2 clients: 2/2 ok, 0 lost, 2 same as single run" in printed.out
    report = json.loads((out / "load-test.json").read_text())
    assert report["settings"]["clients"] == 2 and report["settings"]["configs"] == [
        "full", "rocketkv@64"]
    tokens = report["settings"]["prompt_tokens"]
    assert len(tokens) == 2 and tokens[0] < tokens[1] < 512  # shrunk to the 512-token context
    one, many = report["summaries"]["1 client"], report["summaries"]["2 clients"]
    assert (one["requests"], many["requests"]) == (1, 2)
    assert one["lost"] == many["lost"] == 0 and many["same_as_single"] == 2
    assert report["tokens_per_s_ratio"] == pytest.approx(
        many["tokens_per_s"] / one["tokens_per_s"], rel=1e-2)
    assert len(report["records"]["2 clients"]) == 2 and report["warm_up"]["error"] is None
    assert set(report["load_average"]) == {"before", "after"}
    assert report["command"].startswith("python scripts/load_test.py --clients 2")
    assert "commit" in report["provenance"]
    table = (out / "load-test.md").read_text()
    assert "| 2 clients | 2 | 2 | 0 | 2 |" in table and "| 1 client | 1 | 1 | 0 | 1 |" in table


@pytest.mark.parametrize("argv, words", [
    (["--clients", "0"], "--clients must be positive"),
    (["--requests", "-1"], "--requests must be positive"),
    (["--out", "/proc/x"], "--out /proc/x"),
    (["--configs", "rocketkv"], "needs a budget"),
    (["--configs", "nope@3"], "unknown method 'nope'"),
    (["--time-limit", "0"], "--time-limit must be positive"),
    (["--url", "localhost:8000"], "http://"),
])
def test_bad_input_exits_2_before_the_model_loads(argv, words, monkeypatch, capsys, tmp_path):
    def no_load(*a, **k):
        pytest.fail("the model loaded")

    monkeypatch.setattr(rocketkv, "load", no_load)
    monkeypatch.setattr(api, "load", no_load)
    argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "o" / "load-test.json").exists()


def test_an_out_that_is_no_writable_folder_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the model loaded"))
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = [(a_file, "is not a folder"), (a_file / "sub", "cannot make the folder")]
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        cases.append((locked, "not writable"))
    for out, words in cases:
        assert main(["--out", str(out)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: --out") and words in err[0], err


def test_a_running_server_by_url_and_lost_requests_exit_1(server, monkeypatch, capsys,
                                                           tmp_path):
    """``--url``: no model loads here, the prompts are the essays counted as 4 characters a
    token; 320 of those are over stories260K's 512-token context, so the server refuses every
    request (HTTP 400): all lost, exit status 1 with one error line, the files written."""
    import json

    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the model loaded"))
    rc = main(["--url", server.removesuffix("/v1"), "--clients", "2", "--requests", "1",
               "--prompts", "1", "--max-new-tokens", "4", "--configs", "full",
               "--out", str(tmp_path)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 1
    assert err == [f"error: 3 requests lost, 0 answers differ from their single run (see "
                   f"{tmp_path / 'load-test.json'})"]
    report = json.loads((tmp_path / "load-test.json").read_text())
    assert report["settings"]["server"] == "given" and report["settings"]["model"]
    records = report["records"]["2 clients"]
    assert len(records) == 2 and all("BadRequestError" in r["error"] for r in records)
    assert "context" in records[0]["error"]
    assert report["summaries"]["2 clients"]["lost"] == 2
    assert report["references"][0]["error"].startswith("BadRequestError")


def test_usage_errors_come_before_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "scripts/load_test.py"),
                        "--clients", "many"], capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path)
    log = [x for x in p.stderr.splitlines() if x.startswith("import time:")]
    err = [x for x in p.stderr.splitlines() if not x.startswith("import time:")]
    assert p.returncode == 2 and err == ["error: argument --clients: invalid int value: 'many'"]
    assert log and not [x for x in log if x.split("|")[-1].strip() == "torch"]
