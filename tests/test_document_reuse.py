"""``scripts/document_reuse.py``: question-aware reuse answers as single runs do; the table and
the files; the needle mode's counts; bad input before the model loads."""

import json

import pytest
from conftest import ESSAYS, SMOLLM2_GGUF, shared_file

import rocketkv
from rocketkv.evals import document_reuse
from rocketkv.formats.tokenizer import load_tokenizer
from scripts.document_reuse import main

DOC = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
       "park with her dog Max. ") * 12
QUESTIONS = ["Who was Lily?", "Where did she play?"]


def test_question_aware_answers_are_the_single_runs(stories_model, stories_dir):
    engine = rocketkv.Engine(stories_model, load_tokenizer(stories_dir))
    row = document_reuse.compare(engine, DOC, QUESTIONS, "snapkv_pp", 64, 8)
    aware, agnostic = row["question_aware"], row["question_agnostic"]
    assert aware["question_aware"] and not agnostic["question_aware"]
    assert aware["same_as_single"] == [True, True]
    assert agnostic["note"] is not None  # SnapKV++ evicted part of the document before
    assert aware["texts"] == row["single"]["texts"]
    # held: the document's whole K/V (float32) against SnapKV++'s compressed cache
    a = stories_model.args
    kv = 2 * a.n_layers * a.n_kv_heads * row["document_tokens"] * a.head_dim * 4
    assert kv <= aware["held_bytes"] < 2 * kv and 0 < agnostic["held_bytes"] < 2 * kv
    assert aware["document_prefill_s"] > 0 and len(aware["question_prefill_s"]) == 2
    assert aware["prefill_saved_s"] == pytest.approx(row["single"]["prefill_s"]
                                                     - aware["prefill_s"])
    text = document_reuse.table([row], QUESTIONS)
    assert "| snapkv_pp | 64 | question_aware |" in text and "2 of 2 |" in text


def test_the_script_writes_its_files(stories_dir, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOC)
    (tmp_path / "q.txt").write_text("\n".join(QUESTIONS) + "\n")
    rc = main(["--checkpoint", str(stories_dir), "--document", str(tmp_path / "doc.txt"),
               "--questions", str(tmp_path / "q.txt"), "--methods", "full", "rocketkv",
               "--budgets", "64", "--max-new-tokens", "4", "--json", str(tmp_path / "r.json"),
               "--md", str(tmp_path / "r.md")])
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert [(x["method"], x["budget"]) for x in r["rows"]] == [("full", None), ("rocketkv", 64)]
    assert r["questions"] == QUESTIONS and r["provenance"]["commit"]
    assert "| rocketkv | 64 | question_aware |" in (tmp_path / "r.md").read_text()
    assert "question_agnostic" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--methods", "nope"], "nope"),
    (["--json", "/proc/x/r.json"], "/proc/x"),
    (["--needle-prompts", "0"], "--needle-prompts must be positive"),
    (["--needle-prompts", "2", "--context", "0"], "--context must be positive"),
    (["--needle-prompts", "2", "--depths", "0"], "--depths must be at least 1"),
    (["--needle-prompts", "2", "--document", "doc.txt"], "--document or --questions"),
    (["--needle-prompts", "2", "--questions", "q.txt"], "--document or --questions"),
])
def test_bad_input_is_one_line_before_the_load(argv, message, monkeypatch, capsys):
    def no_load(*a, **kw):
        raise AssertionError("loaded before the error")

    monkeypatch.setattr(document_reuse.api, "load", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_needle_mode_full_reuse_answers_as_the_single_runs(tmp_path, capsys):
    """Full attention, float weights: question-aware reuse computes the single run's answer
    (the question prefilled as its own chunk), so it finds the needle wherever the single run
    does, token for token."""
    shared_file(ESSAYS)
    rc = main(["--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--gguf-weights", "float",
               "--needle-prompts", "2", "--context", "512", "--depths", "3", "--methods",
               "full", "--max-new-tokens", "6", "--json", str(tmp_path / "n.json"),
               "--md", str(tmp_path / "n.md")])
    r = json.loads((tmp_path / "n.json").read_text())
    assert r["mode"] == "needle" and r["context"] == 512 and r["needle_prompts"] == 2
    assert r["depths"] == [0.0, 0.5, 1.0] and r["weights"] == "float"
    assert r["provenance"]["commit"] and "--needle-prompts" in r["command"]
    (row,) = r["rows"]
    assert (row["method"], row["budget"], row["n"]) == ("full", None, 2)
    assert [p["depth"] for p in row["prompts"]] == [0.0, 0.5]
    assert all(p["length"] == 512 and p["answer"].isdigit() for p in row["prompts"])
    single = sum(p["single_score"] for p in row["prompts"])
    reuse = sum(p["reuse_score"] for p in row["prompts"])
    assert (row["found_single"], row["found_reuse"]) == (single, reuse)
    assert 0 <= row["found_by_single_not_reuse"] <= row["found_single"] <= row["n"]
    assert row["found_reuse"] <= row["n"]
    assert row["same_tokens"] == 2 and row["found_by_single_not_reuse"] == 0
    assert all(p["single_text"] == p["reuse_text"] for p in row["prompts"])
    assert row["within_one"] and rc == 0
    assert row["prefill_s"]["single"] > 0 and row["prefill_s"]["reuse"] > 0
    md = (tmp_path / "n.md").read_text()
    assert "| full | - | 2 |" in md and "2 of 2 |" in md and md in capsys.readouterr().out
