"""Fidelity (evals/fidelity.py, metrics.py, probes.py) and scripts/eval_accuracy.py on the real
stories260K checkpoint (2 prompts, T = 200, m = 16), and a quick CLI run on SmolLM2."""

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ESSAYS, ROOT, SMOLLM2_GGUF, shared_file

import rocketkv.evals.fidelity_run as ea
from rocketkv.compression import build_caches
from rocketkv.compression.selection import TopKSelector
from rocketkv.data import RULER_ESSAYS, TINYSTORIES_TEXTS
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.engine.prefill import prefill_once
from rocketkv.evals.fidelity import (
    STORY_SEPARATOR,
    attach_caches,
    bos_prefix,
    build_from_prefill,
    build_prompt_set,
    evaluate,
    read_documents,
    seeded_pick,
    spread_pick,
    teacher_forced_logprobs,
)
from rocketkv.evals.metrics import matching_prefix, selection_masses, token_nlls
from rocketkv.evals.probes import RecallProbe
from rocketkv.evals.prompts import text_files
from rocketkv.evals.reports import fidelity_table
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError
from scripts.eval_accuracy import main

T, M = 200, 16
METHODS = ["full", "rocketkv", "snapkv"]
BUDGETS = [64, 256]  # 256 >= T + M: nothing to compress
SELECTING = ["full", "exact_topk", "quest", "sparq", "hybrid", "snapkv_pp"]
TIGHT = [32, 64]  # snapkv_pp needs t - m > 32: an error row at 32


@pytest.fixture(scope="module")
def texts():
    return [shared_file(p) for p in TINYSTORIES_TEXTS]


@pytest.fixture(scope="module")
def prompts(stories_dir, texts):
    return build_prompt_set(load_tokenizer(stories_dir), texts, T, M, 2)


@pytest.fixture(scope="module")
def result(stories_model, prompts):
    return evaluate(stories_model, prompts, METHODS, BUDGETS, M)


@pytest.fixture(scope="module")
def rows(result):
    return {(r["method"], r["budget"]): r for r in result["rows"]}


@pytest.fixture(scope="module")
def rows2(stories_model, prompts):
    """The selecting methods at tight budgets on the same prompts."""
    res = evaluate(stories_model, prompts, SELECTING, TIGHT, M)
    return {(r["method"], r["budget"]): r for r in res["rows"]}


def full_caches(model, prompt_len, new_tokens):
    caches = build_caches("full", model.args, batch_size=1, prompt_len=prompt_len,
                          max_new_tokens=new_tokens, budget=None, dtype=torch.float32,
                          device="cpu")
    model.setup_caches(caches, prompt_len + new_tokens)


# ---- the prompt set ---------------------------------------------------------------------------

def test_prompt_set_follows_the_documented_rule(stories_dir, texts, prompts):
    tok = load_tokenizer(stories_dir)
    assert bos_prefix(tok) == [tok.bos_id]  # SentencePiece adds BOS
    width = T + M - 1
    docs = [s.strip() for s in texts[0].read_text().split(STORY_SEPARATOR) if s.strip()]
    docs.append(texts[1].read_text().strip())
    windows = [[tok.bos_id] + ids[s:s + width] for ids in (tok.encode(d, bos=False) for d in docs)
               for s in range(0, len(ids) - width + 1, width)]
    expected = [windows[0], windows[len(windows) // 2]]
    assert [p.prompt + p.continuation for p in prompts] == expected
    assert all(len(p.prompt) == T and len(p.continuation) == M for p in prompts)
    assert prompts == build_prompt_set(tok, texts, T, M, 2)  # deterministic
    assert spread_pick(list(range(10)), 4) == [0, 2, 5, 7]


def test_seed_picks_windows_deterministically(stories_dir, texts, prompts):
    tok = load_tokenizer(stories_dir)
    assert seeded_pick(list(range(10)), 4, 0) == spread_pick(list(range(10)), 4)
    a = seeded_pick(list(range(100)), 5, 7)
    assert a == seeded_pick(list(range(100)), 5, 7) == sorted(a) and len(set(a)) == 5
    assert a != seeded_pick(list(range(100)), 5, 8)
    seeded = build_prompt_set(tok, texts, T, M, 2, seed=3)
    assert seeded == build_prompt_set(tok, texts, T, M, 2, seed=3)


def test_text_directories_expand_to_sorted_txt_files(tmp_path):
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / name).write_text("x")
    assert text_files([tmp_path]) == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert text_files([tmp_path / "c.md"]) == [tmp_path / "c.md"]
    with pytest.raises(ConfigError, match="not found"):
        text_files([tmp_path / "missing.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*.txt"):
        text_files([tmp_path / "empty"])



def test_a_json_haystack_is_its_text_field_as_one_document(tmp_path, stories_dir):
    (tmp_path / "hay.json").write_text(json.dumps({"text": "One two.<|endoftext|>Three."}))
    (tmp_path / "a.txt").write_text("Four.")
    assert read_documents([tmp_path / "hay.json", tmp_path / "a.txt"]) == [
        ("hay.json", 0, "One two."), ("hay.json", 1, "Three."), ("a.txt", 0, "Four.")]
    (tmp_path / "bad.json").write_text(json.dumps({"essays": []}))
    with pytest.raises(ConfigError, match='no "text" string field'):
        read_documents([tmp_path / "bad.json"])
    # the RULER haystack makes 32K-token windows (none of the 49 essays alone does)
    tok = load_tokenizer(stories_dir)
    ruler = shared_file(RULER_ESSAYS)
    windows = build_prompt_set(tok, [ruler], 4096, 16, 3)
    assert [len(w.prompt) for w in windows] == [4096] * 3
    assert len({w.start for w in windows}) == 3 and {w.source for w in windows} == {ruler.name}

def test_too_few_windows_is_a_config_error(stories_dir, texts):
    from rocketkv.model import ConfigError

    with pytest.raises(ConfigError, match="windows"):
        build_prompt_set(load_tokenizer(stories_dir), texts, T, M, 10_000)


def test_matching_prefix():
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert matching_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert matching_prefix([5, 2], [6, 2]) == 0


# ---- the numbers ------------------------------------------------------------------------------

def test_reference_is_generate_greedy_output(stories_model, prompts, result):
    for p, ref in zip(prompts, result["reference_continuations"]):
        assert generate(stories_model, p.prompt, max_new_tokens=M)["token_ids"][0] == ref


def test_full_agrees_with_itself(rows):
    full = rows[("full", None)]
    assert full["match_prefix"] == M and full["match_prefix_per_prompt"] == [M, M]
    assert full["teacher_forced_top1"] == 1.0


def test_full_perplexity_matches_an_independent_decode_loop(stories_model, prompts, rows):
    model = stories_model
    full = rows[("full", None)]
    nlls = []
    with torch.no_grad():
        for p in prompts:
            full_caches(model, T, M)
            logits = model.prefill(torch.tensor([p.prompt]))
            for j, c in enumerate(p.continuation):
                nlls.append(float(-torch.log_softmax(logits[0].double(), 0)[c]))
                logits = model(torch.tensor([[c]]), torch.tensor([T + j]))
    assert full["perplexity"] == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-5)
    assert 1.0 < full["perplexity"] < 50  # a trained model on its own training distribution


@pytest.mark.parametrize("j", [0, 7, M - 1])
def test_full_nll_matches_a_prefill_of_the_prefix(stories_model, prompts, rows, j):
    model = stories_model
    for i, p in enumerate(prompts):
        seq = p.prompt + p.continuation[:j]
        full_caches(model, len(seq), 1)
        logits = model.prefill(torch.tensor([seq]))
        nll = float(-torch.log_softmax(logits[0].double(), 0)[p.continuation[j]])
        assert rows[("full", None)]["nll_per_token"][i][j] == pytest.approx(nll, abs=1e-4)


@pytest.mark.parametrize("method", ["rocketkv", "snapkv"])
def test_budget_covering_the_sequence_gives_full_numbers(rows, method):
    full, row = rows[("full", None)], rows[(method, 256)]
    assert row["method_params"]["compressed"] is False
    for key in ("match_prefix", "teacher_forced_top1", "perplexity", "nll_per_token",
                "kv_cache_bytes", "kv_bytes_per_step", "kl_divergence", "kl_per_token"):
        assert row[key] == full[key], key
    assert row["attention_recall"] == 1.0 and row["attention_mass"] == 1.0  # reads everything


def test_too_small_budget_gives_an_error_row(rows, result):
    row = rows[("snapkv", 64)]
    assert "smallest valid budget" in row["error"]
    assert "perplexity" not in row and "kv_cache_bytes" not in row
    line = next(s for s in fidelity_table(result).splitlines() if s.startswith("| snapkv | 64 |"))
    assert "n/a" in line and "smallest valid budget" in line


def test_compressed_row_is_plausible_and_smaller(rows):
    full, rocket = rows[("full", None)], rows[("rocketkv", 64)]
    assert "error" not in rocket and rocket["method_params"]["compressed"] is True
    for r in rows.values():
        if "error" not in r:
            assert r["kv_cache_bytes"] > 0 and r["kv_bytes_per_step"] > 0
    assert rocket["kv_cache_bytes"] < full["kv_cache_bytes"]
    assert rocket["kv_bytes_per_step"] < full["kv_bytes_per_step"]
    assert 0 <= rocket["match_prefix"] <= M and 0 < rocket["teacher_forced_top1"] <= 1
    assert rocket["teacher_forced_top1"] >= 1 / M  # the first token comes from full prefill
    assert math.isfinite(rocket["perplexity"]) and rocket["perplexity"] > 1


def test_table_has_one_line_per_row(result):
    lines = fidelity_table(result).splitlines()
    assert len(lines) == 2 + len(result["rows"]) == 2 + 1 + 2 * 2
    assert lines[2].startswith("| full | - | 16.00 | 1.000 |")


# ---- one prefill per prompt vs a prefill per configuration ------------------------------------

@pytest.mark.parametrize("method,budget", [("rocketkv", 64), ("quest", 32), ("keydiff", 64)])
def test_shared_prefill_equals_the_per_config_path(stories_model, prompts, result, rows, rows2,
                                                   method, budget):
    """The old path (each configuration prefills the prompt itself) gives the same numbers;
    KeyDiff, which prefills its own way, prefills once per pass as there."""
    model = stories_model
    if method == "keydiff":
        res = evaluate(model, prompts, [method], [budget], M)
        row = res["rows"][0]
        assert res["reference_continuations"] == result["reference_continuations"]
    else:
        row = rows[(method, budget)] if method == "rocketkv" else rows2[(method, budget)]
    prefix, top1, nlls, kls = [], [], [], []
    for p, ref in zip(prompts, result["reference_continuations"]):
        greedy = generate(model, p.prompt, CacheRequest(method, budget),
                          max_new_tokens=M)["token_ids"][0]
        prefix.append(matching_prefix(greedy, ref))
        attach_caches(model, method, budget, T, M)
        lp_ref = teacher_forced_logprobs(model, p.prompt, ref)
        top1.append(int((lp_ref.argmax(-1) == torch.tensor(ref)).sum()) / M)
        attach_caches(model, method, budget, T, M)
        lp = teacher_forced_logprobs(model, p.prompt, p.continuation)
        nlls.append(token_nlls(lp, p.continuation))
        attach_caches(model, "full", None, T, M)
        lp_full = teacher_forced_logprobs(model, p.prompt, p.continuation)
        kls.append((lp_full.exp() * (lp_full - lp)).sum(-1).tolist())
    assert row["match_prefix_per_prompt"] == prefix
    assert row["teacher_forced_top1_per_prompt"] == top1
    for got, want in zip(row["nll_per_token"], nlls):
        assert got == pytest.approx(want, abs=1e-5)
    for got, want in zip(row["kl_per_token"], kls):
        assert got == pytest.approx(want, abs=1e-5)


# ---- KL divergence ----------------------------------------------------------------------------

def test_kl_of_full_is_zero_and_positive_at_a_tight_budget(rows, rows2):
    full = rows2[("full", None)]
    assert full["kl_divergence"] == 0.0 and all(x == 0.0 for r in full["kl_per_token"] for x in r)
    assert full["attention_recall"] is None  # full selects nothing
    for key in (("quest", 32), ("sparq", 32), ("hybrid", 32), ("snapkv_pp", 64)):
        r = rows2[key]
        assert r["kl_divergence"] > 0, key
        assert all(len(x) == M and x[0] == 0.0 for x in r["kl_per_token"])  # row 0: prefill
        assert min(x for row in r["kl_per_token"] for x in row) >= -1e-6
    assert rows[("rocketkv", 64)]["kl_divergence"] > 0


# ---- attention recall -------------------------------------------------------------------------

def test_exact_topk_recall_is_one_and_others_lie_in_0_1(rows, rows2, stories_model):
    topk = rows2[("exact_topk", 32)]
    assert topk["attention_recall"] == pytest.approx(1.0, abs=1e-5)
    assert topk["selected_tokens"] == 32
    assert 0 < topk["attention_mass"] < 1  # 32 of 200+ tokens do not hold all the mass
    assert topk["attention_mass"] == pytest.approx(topk["oracle_mass"], abs=1e-5)
    assert len(topk["attention_recall_per_layer"]) == stories_model.args.n_layers
    others = [rows2[k] for k in (("quest", 32), ("sparq", 32), ("hybrid", 32),
                                 ("snapkv_pp", 64))] + [rows[("rocketkv", 64)]]
    for r in others:
        assert 0 < r["attention_recall"] <= 1 + 1e-6, r["method"]
        assert 0 < r["attention_mass"] <= r["oracle_mass"] + 1e-6 <= 1 + 2e-6
        assert len(r["attention_recall_per_prompt"]) == 2
    assert rows2[("quest", 32)]["attention_recall"] < 0.999  # not the oracle


def test_selection_masses_by_hand():
    # one KV head, G = 2 query heads, 4 positions
    p = torch.tensor([[[[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6]]]])
    shared = torch.tensor([True, True, False, False]).view(1, 1, 1, 4)
    covered, oracle, k = selection_masses(p, shared)
    # P = (0.6, 0.4, 0.3, 0.7): covered (0.6 + 0.4) / 2, oracle top-2 (0.7 + 0.6) / 2
    assert covered.item() == pytest.approx(0.5) and oracle.item() == pytest.approx(0.65)
    assert k.item() == 2
    per_head = torch.tensor([[True, False, False, False],
                             [False, False, False, True]]).view(1, 1, 2, 4)
    covered, oracle, k = selection_masses(p, per_head)
    assert covered.item() == pytest.approx(0.55) and oracle.item() == pytest.approx(0.55)
    assert k.item() == 1


def _reference_masses(raw, G):
    """Slow float64 reference for one probe record: per KV head and query head, softmax over
    every position, the mass on the selected ones, the oracle's top-k, and the attention output
    over the selected positions (what the method attended to)."""
    q, K, V, sel, out = (raw[k][0].double() if k != "selected" else raw[k][0]
                         for k in ("q", "k", "v", "selected", "out"))
    Hkv, S, D = K.shape
    covered, oracle, ks = [], [], []
    for h in range(Hkv):
        ps, cov, outs = [], [], []
        for g in range(G):
            head = h * G + g
            scores = torch.tensor([float(q[head, 0] @ K[h, i]) for i in range(S)]) / math.sqrt(D)
            p = torch.exp(scores - scores.max())
            p = p / p.sum()
            chosen = [i for i in range(S) if sel[h, g if sel.shape[1] > 1 else 0, i]]
            ps.append(p)
            cov.append(sum(float(p[i]) for i in chosen))
            w = torch.softmax(scores[chosen], 0)
            outs.append((w[:, None] * V[h, chosen]).sum(0))
            assert torch.allclose(outs[-1], out[head, 0].double(), atol=1e-5)
        if sel.shape[1] == 1:
            n = int(sel[h, 0].sum())
            P = sorted((sum(float(p[i]) for p in ps) for i in range(S)), reverse=True)
            covered.append(sum(cov) / G)
            oracle.append(sum(P[:n]) / G)
            ks.append(n)
        else:
            tops = [sum(sorted(p.tolist(), reverse=True)[:int(sel[h, g].sum())])
                    for g, p in enumerate(ps)]
            covered.append(sum(cov) / G)
            oracle.append(sum(tops) / G)
            ks.append(float(sel[h].sum()) / G)
    return covered, oracle, ks


@pytest.mark.parametrize("method,budget", [("quest", 32), ("sparq", 32), ("rocketkv", 64),
                                           ("snapkv", 128), ("streamingllm", 32), ("h2o", 32)])
def test_recall_matches_a_slow_reference(stories_model, prompts, method, budget):
    """Every step and layer of a teacher-forced pass: the probe's masses equal a float64 loop,
    and attention over the recorded selection reproduces the method's own attention output
    (snapkv 128: per-head masks; rocketkv: evicted prompt positions mapped back)."""
    model = stories_model
    p = prompts[0]
    pre = prefill_once(model, p.prompt, attention_sums=method == "h2o")
    build_from_prefill(model, pre, method, budget, M)
    if method in ("rocketkv", "snapkv"):
        assert model.caches[0].kept < T  # prompt positions come from the eviction
    probe = RecallProbe(pre, keep_raw=True)
    with probe.attached(model):
        teacher_forced_logprobs(model, p.prompt, p.continuation, pre.logits)
    if hasattr(model.caches[0], "selector"):
        assert "attend" not in vars(model.caches[0].selector)  # detached
    else:  # evicting within a capacity: the positions read, from read_positions
        assert "decode" not in vars(model.caches[0])
    n_layers, G = model.args.n_layers, model.args.group_size
    assert len(probe.records) == len(probe.raw) == (M - 1) * n_layers
    for raw in probe.raw[:: max(1, len(probe.raw) // 12)] + probe.raw[-2:]:
        covered, oracle, ks = _reference_masses(raw, G)
        _, got_cov, got_orc, got_k = raw["record"]
        assert got_cov[0].tolist() == pytest.approx(covered, abs=1e-5)
        assert got_orc[0].tolist() == pytest.approx(oracle, abs=1e-5)
        assert got_k[0].tolist() == pytest.approx(ks)
    if method == "snapkv":
        assert probe.raw[0]["selected"].shape[2] == G  # per query head


class RecentSelector(TopKSelector):
    """A selector ``evals/probes.py`` was never told about: the k most recent written slots."""

    def select(self, cache, q, valid):
        n = min(self.k, cache.length)
        last = valid.sum() - 1
        idx = (last - torch.arange(n, device=valid.device)).clamp(min=0)
        return idx.expand(cache.batch_size, cache.n_kv_heads, n)


def test_a_new_selector_gets_recall_figures(stories_model, prompts):
    """The probe records what any selector's ``select`` picks (no list of known selectors):
    a selector defined here gets records, and attention over them reproduces its output."""
    model, p = stories_model, prompts[0]
    pre = prefill_once(model, p.prompt)
    build_from_prefill(model, pre, "exact_topk", 32, M)
    for cache in model.caches:
        cache.selector = RecentSelector(16)
    probe = RecallProbe(pre, keep_raw=True)
    with probe.attached(model):
        teacher_forced_logprobs(model, p.prompt, p.continuation, pre.logits)
    n_layers = model.args.n_layers
    summary = probe.summary(n_layers)
    assert len(probe.records) == (M - 1) * n_layers and summary["selected_tokens"] == 16
    assert 0 < summary["attention_recall"] <= 1 + 1e-6
    for raw in probe.raw[::7]:
        covered, oracle, ks = _reference_masses(raw, model.args.group_size)
        assert raw["record"][1][0].tolist() == pytest.approx(covered, abs=1e-5)
        S = raw["selected"].shape[-1]
        assert raw["selected"][0, :, 0, :S - 16].sum() == 0  # only the 16 most recent
        assert raw["selected"][0, :, 0, S - 16:].all()



# ---- runs in pieces ---------------------------------------------------------------------------

def test_a_stopped_run_resumes_to_the_rows_of_one_that_never_stopped(stories_model, prompts,
                                                                      rows2, tmp_path):
    path = tmp_path / "fidelity_200.partial.jsonl"
    asked = []

    def stop():  # asked before each prompt: the first runs, the second does not start
        asked.append(1)
        return len(asked) > 1

    first = evaluate(stories_model, prompts, SELECTING, TIGHT, M, partial=path,
                     tag={"commit": "abc", "dirty": False}, stop=stop)
    assert (first["prompts_run"], first["unfinished"], len(asked)) == (1, 1, 2)
    quest = next(r for r in first["rows"] if r["method"] == "quest" and r["budget"] == 32)
    assert quest["teacher_forced_top1_per_prompt"] == \
        rows2[("quest", 32)]["teacher_forced_top1_per_prompt"][:1]
    assert len(path.read_text().splitlines()) == 2  # the header and the finished prompt
    second = evaluate(stories_model, prompts, SELECTING, TIGHT, M, partial=path,
                      tag={"commit": "def", "dirty": False})
    assert (second["prompts_run"], second["unfinished"]) == (2, 0)
    assert second["prompt_tags"] == [{"commit": "abc", "dirty": False},
                                     {"commit": "def", "dirty": False}]
    got = {(r["method"], r["budget"]): r for r in second["rows"]}
    assert got == rows2  # every number, the rejected budget's error row included
    assert "error" in got[("snapkv_pp", 32)]


def test_a_partial_file_of_other_settings_is_refused_unless_restart(stories_model, prompts,
                                                                    tmp_path):
    path = tmp_path / "p.jsonl"
    evaluate(stories_model, prompts[:1], ["full"], [64], M, partial=path)
    with pytest.raises(ConfigError, match="another run's"):
        evaluate(stories_model, prompts[:1], ["full", "quest"], [64], M, partial=path)
    res = evaluate(stories_model, prompts[:1], ["full", "quest"], [64], M, partial=path,
                   restart=True)
    assert res["prompts_run"] == 1 and [r["method"] for r in res["rows"]] == ["full", "quest"]


def test_cli_time_limit_keeps_the_finished_prompts_and_the_rerun_completes(
        stories_dir, texts, tmp_path, capsys):
    out = tmp_path / "fid"
    argv = ["--checkpoint", str(stories_dir), "--methods", "full", "quest", "--budgets", "64",
            "--num-prompts", "2", "--context", "100", "--max-new-tokens", "4",
            "--no-progress", "--text", *map(str, texts), "--out", str(out)]
    assert main([*argv, "--time-limit", "1e-9"]) == 0  # no prompt starts
    err = capsys.readouterr().err
    assert "2 prompts not run" in err and "nothing written" in err
    assert not (out / "fidelity.json").exists()
    assert (out / "fidelity_100.partial.jsonl").is_file()
    assert main(argv) == 0
    data = json.loads((out / "fidelity.json").read_text())
    assert data["unfinished"] == 0 and data["runs"][0]["prompts_run"] == 2
    assert data["runs"][0]["prompt_tags"][0]["commit"] == data["commit"]
    assert not (out / "fidelity_100.partial.jsonl").exists()
    assert "Incomplete" not in (out / "fidelity.md").read_text()
    # the same command once more: the run is complete, nothing runs or is rewritten
    written = (out / "fidelity.json").read_text()
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "already holds this run" in err
    assert (out / "fidelity.json").read_text() == written
    assert main([*argv, "--methods", "full"]) == 0  # another run: it runs
    assert main([*argv, "--methods", "full", "--restart"]) == 0


def test_cli_a_finished_length_keeps_its_file_while_another_is_unfinished(
        stories_dir, texts, tmp_path, capsys, monkeypatch):
    """Two lengths, the second stopped by the time limit: the first one's saved prompts stay
    beside the second's, so the same command runs only the second one's prompts."""
    ran, real = [], ea.evaluate

    def evaluate(model, ps, *a, stop=None, **k):
        T = len(ps[0].prompt)
        if T == 120 and limited[0]:
            stop = lambda: True  # noqa: E731  (the limit passes before this length)
        out = real(model, ps, *a, stop=stop, **k)
        ran.append((T, out["prompts_run"]))
        return out

    monkeypatch.setattr(ea, "evaluate", evaluate)
    out = tmp_path / "fid"
    argv = ["--checkpoint", str(stories_dir), "--methods", "full", "--budgets", "64",
            "--num-prompts", "2", "--context", "100", "120", "--max-new-tokens", "4",
            "--no-progress", "--text", *map(str, texts), "--out", str(out)]
    limited = [True]
    assert main(argv) == 0
    assert "2 prompts not run" in capsys.readouterr().err
    assert (out / "fidelity_100.partial.jsonl").is_file()
    assert (out / "fidelity_120.partial.jsonl").is_file()
    limited[0] = False
    calls = len(ran)
    assert main(argv) == 0
    assert "resuming: 2 of 2 prompts of 100 tokens" in capsys.readouterr().err
    data = json.loads((out / "fidelity.json").read_text())
    assert data["unfinished"] == 0 and [r["prompts_run"] for r in data["runs"]] == [2, 2]
    assert not list(out.glob("*.partial.jsonl"))
    assert ran[calls:] == [(100, 2), (120, 2)]

# ---- the CLI ----------------------------------------------------------------------------------

def test_cli_writes_json_and_prints_the_table(stories_dir, texts, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["--checkpoint", str(stories_dir), "--json", str(out), "--methods", "full",
               "quest", "--budgets", "64", "--num-prompts", "1", "--context", "100",
               "--max-new-tokens", "4", "--no-progress", "--text", *map(str, texts)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in data["rows"]] == [("full", None), ("quest", 64)]
    assert data["prompt_tokens"] == [100] and data["max_new_tokens"] == 4
    assert [r["prompt_tokens"] for r in data["rows"]] == [100, 100]
    assert not (tmp_path / "eval.json.tmp").exists()
    prov = data["provenance"]  # evals/provenance.py: the code, libraries and checkpoint
    assert data["commit"] == prov["commit"] and len(prov["checkpoint"]["sha256"]) == 64
    assert prov["argv"][0] == "scripts/eval_accuracy.py" and "--json" in prov["argv"]
    assert "| quest | 64 |" in capsys.readouterr().out


def test_cli_quick_run_on_smollm2_writes_the_three_files(tmp_path, capsys):
    gguf, essays = shared_file(SMOLLM2_GGUF), shared_file(ESSAYS)
    out = tmp_path / "fid"
    rc = main(["--checkpoint", str(gguf), "--text", str(essays), "--context", "256",
               "--num-prompts", "4", "--limit", "2", "--methods", "full", "quest",
               "--budgets", "128", "--max-new-tokens", "6", "--out", str(out),
               "--no-progress", "--threads", "1"])
    assert rc == 0
    data = json.loads((out / "fidelity.json").read_text())
    assert data["bos_prefix"] == [] and data["num_prompts"] == 2  # SmolLM2 adds no BOS
    tok = load_tokenizer(str(gguf))
    run = data["runs"][0]
    assert all(p["prompt_head"][0] != tok.bos_id for p in run["prompts"])
    assert all(p["prompt_tokens"] == 256 and p["continuation_tokens"] == 6
               for p in run["prompts"])
    full, quest = data["rows"]
    assert full["kl_divergence"] == 0.0 and full["match_prefix"] == 6
    assert 1 < full["perplexity"] < 1000
    assert quest["kl_divergence"] > 0 and 0 < quest["attention_recall"] <= 1 + 1e-6
    # 95% bootstrap intervals over the 2 prompts, around the row's mean
    lo, hi = quest["kl_divergence_ci"]
    assert lo <= quest["kl_divergence"] <= hi and full["kl_divergence_ci"] == [0.0, 0.0]
    assert quest["teacher_forced_top1_ci"][0] <= quest["teacher_forced_top1"]
    md = (out / "fidelity.md").read_text()
    assert "## 256 prompt tokens" in md and "| quest | 128 |" in md
    assert (out / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| quest | 128 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--budgets", "0"], "--budgets must be positive"),
    (["--context", "500"], "exceed the model's context"),
    (["--context", "100", "--num-prompts", "100000"], "windows"),
    (["--json", "/nonexistent/dir/out.json"], "does not exist"),
    (["--limit", "0"], "--limit must be positive"),
    (["--text", "/nonexistent/file.txt"], "text file not found"),
    (["--out", __file__], "is not a directory"),
    (["--time-limit", "60"], "--time-limit needs --out"),
])
def test_cli_bad_input_is_one_line_exit_2(stories_dir, texts, capsys, argv, message):
    assert main(["--checkpoint", str(stories_dir), "--no-progress", "--text",
                 *map(str, texts), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_cli_missing_checkpoint_as_a_script(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_accuracy.py"),
                        "--checkpoint", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: checkpoint not found") and r.stderr.count("\n") == 1
