"""scripts/accuracy_summary.py: runs merged by prompt, per-length means, unfinished prompts left
out, rejected budgets as n/a and the claim lines, checked against sums done by hand."""

import json

from scripts.accuracy_summary import main

NEEDLE = [{"length": 100, "depth": d, "seed": 0} for d in (0.0, 0.5)] + \
    [{"length": 200, "depth": 0.5, "seed": 0}]


def _result(rows, items=NEEDLE, qa=False):
    return {"task": "needle", "question_agnostic": qa, "items": items, "rows": rows}


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def _run(tmp_path, *results, capsys):
    paths = [_write(tmp_path / f"r{i}.json", r) for i, r in enumerate(results)]
    assert main(paths) == 0
    return capsys.readouterr().out


def _line(text, length, method):
    section = text.split(f", {length} tokens")[1].split("## ")[0]
    return next(ln for ln in section.splitlines() if ln.startswith(f"| {method} |"))


def test_runs_are_merged_by_prompt_and_averaged_per_length(tmp_path, capsys):
    first = _result([
        {"method": "full", "budget": None, "scores": [1.0, 1.0, 0.0]},
        {"method": "exact_topk", "budget": 128, "scores": [1.0, 0.0, 0.0]},
        {"method": "rocketkv", "budget": 128, "scores": [1.0, 0.5, 1.0]}])
    # a second run: another method on the same prompts, listed in another order
    second = _result([{"method": "quest", "budget": 128, "scores": [1.0, 0.0, 0.0]}],
                     items=[NEEDLE[2], NEEDLE[1], NEEDLE[0]])
    out = _run(tmp_path, first, second, capsys=capsys)
    assert "Needle, 100 tokens (2 prompts)" in out and "Needle, 200 tokens (1 prompts)" in out
    # full fills every budget's column; question-agnostic mode was not run
    assert _line(out, 100, "full") == "| full | 100.0 |  |"
    assert _line(out, 100, "rocketkv") == "| rocketkv | 75.0 |  |"
    assert _line(out, 200, "rocketkv") == "| rocketkv | 100.0 |  |"
    # quest's scores follow its own item order: 0.0 and 0.0 at 100 tokens, 1.0 at 200
    assert _line(out, 100, "quest") == "| quest | 0.0 |  |"
    assert _line(out, 200, "quest") == "| quest | 100.0 |  |"
    assert ("standard, budget 128: rocketkv 75.0; full 100.0 (-25.0); exact_topk 50.0 "
            "(+25.0); other methods at or above rocketkv: none") in out
    assert ("standard, budget 128: rocketkv 100.0; full 0.0 (+100.0); exact_topk 0.0 "
            "(+100.0); other methods at or above rocketkv: quest 100.0") in out


def test_unfinished_rejected_and_partial_rows(tmp_path, capsys):
    res = _result([
        # the 200-token prompt was in an unfinished batch: nothing ran it
        {"method": "full", "budget": None, "scores": [1.0, 1.0, None], "items_run": 2},
        {"method": "exact_topk", "budget": 128, "scores": [1.0, 1.0, None], "items_run": 2},
        {"method": "snapkv", "budget": 128, "error": "budget too small"},
        {"method": "quest", "budget": 128, "scores": [1.0, None, None], "items_run": 1,
         "item_errors": {"1": "budget too small"}},
        {"method": "rocketkv", "budget": 128, "scores": [1.0, 1.0, None], "items_run": 2}])
    other = _result([{"method": "sparq", "budget": 128, "scores": [0.0, None, None],
                      "items_run": 1}])
    out = _run(tmp_path, res, other, capsys=capsys)
    assert "200 tokens" not in out
    assert _line(out, 100, "snapkv") == "| snapkv | n/a |  |"
    assert _line(out, 100, "quest") == "| quest | n/a |  |"
    assert _line(out, 100, "sparq") == "| sparq | 0.0 (1/2) |  |"
    # the claim compares every method on the one prompt that all of them ran
    assert ("standard, budget 128: rocketkv 100.0; full 100.0 (+0.0); exact_topk 100.0 (+0.0);"
            " other methods at or above rocketkv: quest 100.0 (over the 1 of 2 prompts every"
            " method ran)") in out


def test_a_score_beats_an_earlier_or_later_rejection_of_the_same_prompt(tmp_path, capsys):
    full = _result([{"method": "full", "budget": None, "scores": [1.0, 0.0, 1.0]}])
    rejected = _result([
        {"method": "duoattention", "budget": 128, "error": "no head pattern"},
        {"method": "quest", "budget": 128, "scores": [None, None, None], "items_run": 0,
         "item_errors": {"0": "too small", "1": "too small", "2": "too small"}}])
    # a later run served the budget for the 100-token prompts only
    served = _result([{"method": "duoattention", "budget": 128, "scores": [1.0, 0.0, None],
                       "items_run": 2},
                      {"method": "quest", "budget": 128, "scores": [0.0, 1.0, None],
                       "items_run": 2}])
    for order in ((full, rejected, served), (full, served, rejected)):
        out = _run(tmp_path, *order, capsys=capsys)
        assert _line(out, 100, "duoattention") == "| duoattention | 50.0 |  |"
        assert _line(out, 100, "quest") == "| quest | 50.0 |  |"
        # the 200-token prompt was only ever rejected
        assert _line(out, 200, "duoattention") == "| duoattention | n/a |  |"
        assert _line(out, 200, "quest") == "| quest | n/a |  |"


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    _write(tmp_path / "bench.json", {"rows": []})
    assert main([str(tmp_path)]) == 2
    assert "no needle or RULER-style result file" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    assert main([str(tmp_path / "broken.json")]) == 2
    assert "not a readable JSON file" in capsys.readouterr().err
