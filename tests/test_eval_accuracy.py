"""scripts/eval_accuracy.py on the real stories260K checkpoint (2 prompts, T = 200, m = 16)."""

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, shared_file

from generate import generate
from kv_cache import build_caches
from scripts.eval_accuracy import (
    DEFAULT_TEXTS,
    STORY_SEPARATOR,
    build_prompt_set,
    evaluate,
    format_table,
    main,
    matching_prefix,
    spread_pick,
)
from tokenizer import load_tokenizer

T, M = 200, 16
METHODS = ["full", "rocketkv", "snapkv"]
BUDGETS = [64, 256]  # 256 >= T + M: nothing to compress


@pytest.fixture(scope="module")
def texts():
    return [shared_file(p) for p in DEFAULT_TEXTS]


@pytest.fixture(scope="module")
def prompts(stories_dir, texts):
    return build_prompt_set(load_tokenizer(stories_dir), texts, T, M, 2)


@pytest.fixture(scope="module")
def result(stories_model, prompts):
    return evaluate(stories_model, prompts, METHODS, BUDGETS, M)


@pytest.fixture(scope="module")
def rows(result):
    return {(r["method"], r["budget"]): r for r in result["rows"]}


def full_caches(model, prompt_len, new_tokens):
    caches = build_caches("full", model.args, batch_size=1, prompt_len=prompt_len,
                          max_new_tokens=new_tokens, budget=None, dtype=torch.float32,
                          device="cpu")
    model.setup_caches(caches, prompt_len + new_tokens)
    model._cache_spec = None


# ---- the prompt set ---------------------------------------------------------------------------

def test_prompt_set_follows_the_documented_rule(stories_dir, texts, prompts):
    tok = load_tokenizer(stories_dir)
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


def test_too_few_windows_is_a_config_error(stories_dir, texts):
    from model import ConfigError

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
                "kv_cache_bytes", "kv_bytes_per_step"):
        assert row[key] == full[key], key


def test_too_small_budget_gives_an_error_row(rows, result):
    row = rows[("snapkv", 64)]
    assert "smallest valid budget" in row["error"]
    assert "perplexity" not in row and "kv_cache_bytes" not in row
    line = next(s for s in format_table(result).splitlines() if s.startswith("| snapkv | 64 |"))
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
    lines = format_table(result).splitlines()
    assert len(lines) == 2 + len(result["rows"]) == 2 + 1 + 2 * 2
    assert lines[2].startswith("| full | - | 16.00 | 1.000 |")


# ---- the CLI ----------------------------------------------------------------------------------

def test_cli_writes_json_and_prints_the_table(stories_dir, texts, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["--checkpoint", str(stories_dir), "--json", str(out), "--methods", "full",
               "quest", "--budgets", "64", "--num-prompts", "1", "--prompt-tokens", "100",
               "--max-new-tokens", "4", "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in data["rows"]] == [("full", None), ("quest", 64)]
    assert data["prompt_tokens"] == 100 and data["max_new_tokens"] == 4
    assert not (tmp_path / "eval.json.tmp").exists()
    assert "| quest | 64 |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--budgets", "0"], "--budgets must be positive"),
    (["--prompt-tokens", "500"], "exceed the model's context"),
    (["--num-prompts", "100000"], "windows"),
    (["--json", "/nonexistent/dir/out.json"], "does not exist"),
])
def test_cli_bad_input_is_one_line_exit_2(stories_dir, texts, capsys, argv, message):
    assert main(["--checkpoint", str(stories_dir), "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_cli_missing_checkpoint_as_a_script(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval_accuracy.py"),
                        "--checkpoint", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: checkpoint not found") and r.stderr.count("\n") == 1
