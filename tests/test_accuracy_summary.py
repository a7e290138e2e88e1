"""scripts/accuracy_summary.py: runs merged by prompt, Wilson intervals in the cells, paired
tests in the comparison lines, weak tasks apart, commit groups and --allow-mixed, old files
rescored from their answers, summary.json; checked against values computed by hand."""

import json

import pytest

from scripts.accuracy_summary import main

NEEDLE = [{"length": 100, "depth": d, "seed": 0, "answer": "1679215"} for d in (0.0, 0.5)] + \
    [{"length": 200, "depth": 0.5, "seed": 0, "answer": "1679215"}]


def _result(rows, items=NEEDLE, qa=False, commit="aaaa", scoring="first_number"):
    res = {"task": "needle", "question_agnostic": qa, "items": items, "rows": rows}
    if scoring is not None:
        res["scoring"] = scoring
    if commit is not None:
        res["commit"] = commit
        res["provenance"] = {"commit": commit, "dirty": False}
    return res


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def _run(tmp_path, *results, capsys, flags=(), status=0):
    paths = [_write(tmp_path / f"r{i}.json", r) for i, r in enumerate(results)]
    out = tmp_path / "out" / "tables.md"
    out.parent.mkdir(exist_ok=True)
    assert main([*paths, "--markdown", str(out), *flags]) == status
    if status:
        return capsys.readouterr().err, None
    return out.read_text(), json.loads((out.parent / "summary.json").read_text())


def _line(text, length, method, bench="Needle"):
    section = text.split(f"## {bench}, {length} tokens")[1].split("## ")[0]
    return next(ln for ln in section.splitlines() if ln.startswith(f"| {method} |"))


def _cell(summary, **where):
    return next(c for c in summary["cells"] if all(c[k] == v for k, v in where.items()))


def test_cells_carry_wilson_intervals_and_runs_merge_by_prompt(tmp_path, capsys):
    first = _result([
        {"method": "full", "budget": None, "scores": [1.0, 1.0, 1.0]},
        {"method": "exact_topk", "budget": 128, "scores": [1.0, 0.0, 0.0]},
        {"method": "rocketkv", "budget": 128, "scores": [1.0, 1.0, 1.0]}])
    # a second run: another method on the same prompts, listed in another order
    second = _result([{"method": "quest", "budget": 128, "scores": [1.0, 0.0, 0.0]}],
                     items=[NEEDLE[2], NEEDLE[1], NEEDLE[0]])
    text, summary = _run(tmp_path, first, second, capsys=capsys)
    assert "## Needle, 100 tokens (2 prompts)" in text and "Commit: aaaa." in text
    # Wilson 2/2: centre (1 + z^2/4) / (1 + z^2/2) = .67119, half .32881 -> [34.2, 100]
    assert _line(text, 100, "full") == "| full | 100.0 [34.2, 100.0] n=2 |"
    # 1/2: centre .5, half z / (1 + z^2/2) * sqrt(1/8 + z^2/16) = .40542 -> [9.5, 90.5]
    assert _line(text, 100, "exact_topk") == "| exact_topk | 50.0 [9.5, 90.5] n=2 |"
    # quest's scores follow its own item order: 0.0 and 0.0 at 100 tokens, 1.0 at 200
    assert _line(text, 100, "quest") == "| quest | 0.0 [0.0, 65.8] n=2 |"
    assert _line(text, 200, "quest") == "| quest | 100.0 [20.7, 100.0] n=1 |"
    c = _cell(summary, task="needle", length=100, method="rocketkv", budget=128,
              mode="standard")
    assert (c["n"], c["score"], c["commit"], c["interval"]) == (2, 100.0, "aaaa", "wilson")
    assert c["ci_low"] == pytest.approx(34.238, abs=1e-3) and c["ci_high"] == 100.0
    assert _cell(summary, length=100, method="full")["budget"] is None
    # the claim lines: paired over the prompts, McNemar, no difference stated at n = 2
    # Tango's interval of one discordant prompt in 2: [-48.6, +90.5]; the MDD of differences
    # 1 and 0 (sd .707): 2.80 x .707 / sqrt(2) = 1.40, over the 100 points a score can move
    assert ("- rocketkv@128 vs exact_topk@128 (n = 2): +50.0 points [-48.6, +90.5], p = 1, "
            "Holm 1 (mcnemar; 1 better, 0 worse): no detectable difference (MDD over 100 "
            "points at n = 2)") in text
    pooled = _cell(summary, task="needle", length="pooled", method="quest", budget=128)
    assert pooled["n"] == 3 and pooled["score"] == pytest.approx(50.0)  # mean of 0 and 1


def test_a_difference_is_stated_only_where_the_holm_adjusted_test_finds_it(tmp_path, capsys):
    """A length's comparisons are one family: their exact p values are Holm-adjusted together
    and the claim follows the adjusted one; otherwise the line gives the minimum detectable
    difference (or equivalence, where the two one-sided tests show it)."""
    items = [{"length": 100, "depth": i / 10, "seed": i, "answer": "1679215"} for i in range(10)]
    res = _result([{"method": "full", "budget": None, "scores": [1.0] * 10},
                   {"method": "rocketkv", "budget": 64, "scores": [1.0] * 10},
                   {"method": "quest", "budget": 64, "scores": [0.0] * 10},
                   {"method": "sparq", "budget": 64, "scores": [0.0] * 6 + [1.0] * 4}],
                  items=items)
    text, summary = _run(tmp_path, res, capsys=capsys)
    # quest: 10 discordant pairs one way, p = 2 / 2^10 = .00195; Holm x 3 = .00586: stated
    assert "rocketkv@64 vs quest@64 (n = 10): +100.0 points" in text
    assert "p = 0.00195, Holm 0.00586 (mcnemar; 10 better, 0 worse): rocketkv higher" in text
    # sparq: 6 of 6, p = 2 / 64 = .03125 < .05, but Holm: max(.00586, 2 x .03125) = .0625;
    # MDD = (1.960 + 0.842) sd / sqrt(10), sd of six 1s and four 0s = .5164: 45.7 points
    assert ("p = 0.0312, Holm 0.0625 (mcnemar; 6 better, 0 worse): no detectable difference "
            "(MDD 46 points at n = 10)") in text
    # full: no discordant pair, p = 1; 10 prompts are too few for equivalence at 5 points
    assert "p = 1, Holm 1 (mcnemar; 0 better, 0 worse): no detectable difference" in text
    comp = next(x for x in summary["comparisons"] if x["b"] == "sparq" and x["length"] == 100)
    assert comp["p"] == pytest.approx(2 / 64) and comp["p_holm"] == pytest.approx(2 / 32)
    assert comp["mdd"] == pytest.approx(45.75, abs=0.05) and comp["equivalent"] is False
    assert summary["equivalence_margin"] == 5.0


def test_question_agnostic_columns_only_where_a_run_has_that_mode(tmp_path, capsys):
    std = _result([{"method": "full", "budget": None, "scores": [1.0, 1.0, 1.0]},
                   {"method": "quest", "budget": 128, "scores": [1.0, 0.0, 1.0]}])
    qa = _result([{"method": "full", "budget": None, "scores": [1.0, 0.0, 1.0]},
                  {"method": "quest", "budget": 128, "scores": [0.0, 0.0, 1.0]}], qa=True)
    text, summary = _run(tmp_path, std, qa, capsys=capsys)
    section = text.split("## Needle, 100 tokens")[1]
    assert "| method | 128 | q-agnostic 128 |" in section
    assert _line(text, 100, "quest") == \
        "| quest | 50.0 [9.5, 90.5] n=2 | 0.0 [0.0, 65.8] n=2 |"
    assert _cell(summary, length=100, method="quest", mode="question_agnostic")["score"] == 0.0

def test_commits_are_not_mixed_unless_asked(tmp_path, capsys):
    a = _result([{"method": "full", "budget": None, "scores": [1.0, 1.0, 0.0]}], commit="aaaa")
    b = _result([{"method": "quest", "budget": 128, "scores": [1.0, 0.0, 0.0]}], commit="bbbb")
    err, _ = _run(tmp_path, a, b, capsys=capsys, status=2)
    assert err.startswith("error: ") and err.count("\n") == 1 and "--allow-mixed" in err
    text, summary = _run(tmp_path, a, b, capsys=capsys, flags=["--allow-mixed"])
    assert _line(text, 100, "quest") == "| quest | 50.0 [9.5, 90.5] n=2 @bbbb |"
    assert summary["mixed"] and summary["commits"] == ["aaaa", "bbbb"]
    # a file without a commit is a group of its own, even beside another such file
    old = _result([{"method": "full", "budget": None, "scores": [1.0, 1.0, 0.0],
                    "answers": [" 1679215", " 1679215", " 7"]}], commit=None, scoring=None)
    _run(tmp_path, old, capsys=capsys)  # alone: summarised
    err, _ = _run(tmp_path, old, dict(old), capsys=capsys, status=2)
    assert "commit unknown" in err
    # a run resumed at a later commit: each prompt counts under the commit that answered it
    resumed = _result([{"method": "quest", "budget": 128, "scores": [1.0, 0.0, 0.0]}],
                      commit="bbbb")
    resumed["item_commits"] = [{"commit": "aaaa", "dirty": False}, None,
                               {"commit": "bbbb", "dirty": True}]
    err, _ = _run(tmp_path, resumed, capsys=capsys, status=2)
    assert "aaaa, bbbb, bbbb+dirty" in err
    text, summary = _run(tmp_path, resumed, capsys=capsys, flags=["--allow-mixed"])
    assert _line(text, 100, "quest") == "| quest | 50.0 [9.5, 90.5] n=2 @aaaa+bbbb |"
    assert "n=3 @aaaa+bbbb+bbbb+dirty |" in text  # pooled over the lengths
    assert [f["commit"] for f in summary["files"]] == ["aaaa", "bbbb", "bbbb+dirty"]
    # a dirty tree is not its commit
    dirty = _result(a["rows"], commit="aaaa")
    dirty["provenance"]["dirty"] = True
    err, _ = _run(tmp_path, a, dirty, capsys=capsys, status=2)
    assert "aaaa+dirty" in err


def test_files_of_other_checkpoints_or_dtypes_are_never_merged(tmp_path, capsys):
    def run(sha, dtype):
        res = _result([{"method": "full", "budget": None, "scores": [1.0, 1.0, 0.0]}])
        res["provenance"]["checkpoint"] = {"sha256": sha}
        res["model"], res["dtype"] = "Tiny", dtype
        return res

    a, b, c = run("1d96" * 16, "bfloat16"), run("f00d" * 16, "bfloat16"), \
        run("1d96" * 16, "float32")
    for other, what in ((b, "checkpoints (1d961d961d96: "), (c, "dtypes (bfloat16: ")):
        for flags in ((), ("--allow-mixed",)):
            err, _ = _run(tmp_path, a, other, capsys=capsys, flags=flags, status=2)
            assert err.startswith("error: the files come from different " + what)
            assert err.count("\n") == 1
    text, summary = _run(tmp_path, a, dict(a), capsys=capsys)
    assert "Model: Tiny, sha256 1d961d961d96, bfloat16 activations." in text
    assert summary["model"] == {"name": "Tiny", "sha256": "1d96" * 16, "dtype": "bfloat16"}
    # files that record neither (written before provenance) merge as before
    _run(tmp_path, a, _result(a["rows"]), capsys=capsys)


def test_files_scored_by_substring_are_rescored_from_their_answers(tmp_path, capsys):
    old = _result([{"method": "hybrid", "budget": 128, "scores": [1.0, 1.0, 1.0],
                    "answers": [" 167921525", " 1679215.", " 1679215"]}],
                  commit=None, scoring="exact")
    text, summary = _run(tmp_path, old, capsys=capsys)
    # the garbled answer fails on whole numbers; the old score stays as "sub"
    assert _line(text, 100, "hybrid") == "| hybrid | 50.0 [9.5, 90.5] n=2 sub 100.0 |"
    c = _cell(summary, length=100, method="hybrid")
    assert c["score_substring"] == 100.0 and c["commit"] == "unknown"
    assert summary["files"][0]["rescored"] is True


def test_ruler_tasks_where_full_fails_are_reported_apart(tmp_path, capsys):
    items = [{"task": t, "length": 100, "seed": j, "outputs": o}
             for t, o in (("vt", ["ABCDE"]), ("niah_single_noise", ["1234567"]))
             for j in range(2)]
    res = {"task": "ruler", "question_agnostic": False, "items": items, "commit": "cccc",
           "scoring": "boundary_f1", "rows": [
               {"method": "full", "budget": None, "scores": [1.0, 1.0, 0.0, 0.0]},
               {"method": "rocketkv", "budget": 64, "scores": [0.5, 1.0, 1.0, 1.0]}]}
    text, summary = _run(tmp_path, res, capsys=capsys)
    assert "reported apart: niah_single_noise (full 0.0)" in text
    assert summary["weak"] == [{"bench": "ruler", "task": "niah_single_noise", "length": 100,
                                "full_score": 0.0}]
    pooled = _cell(summary, bench="ruler", task="pooled", length=100, method="rocketkv")
    assert pooled["n"] == 2 and pooled["score"] == 75.0 and pooled["interval"] == "bootstrap"
    assert _cell(summary, task="niah_single_noise", method="rocketkv")["score"] == 100.0
    # the comparison at this length pools vt alone: 2 prompts, sign-flip on (-.5, 0)
    assert "rocketkv@64 vs full (n = 2): -25.0 points" in text


def test_unfinished_rejected_and_partial_rows(tmp_path, capsys):
    res = _result([
        # the 200-token prompt was in an unfinished batch: nothing ran it
        {"method": "full", "budget": None, "scores": [1.0, 1.0, None], "items_run": 2},
        {"method": "snapkv", "budget": 128, "error": "budget too small"},
        {"method": "quest", "budget": 128, "scores": [1.0, None, None], "items_run": 1,
         "item_errors": {"1": "budget too small"}},
        {"method": "rocketkv", "budget": 128, "scores": [1.0, 1.0, None], "items_run": 2}])
    other = _result([{"method": "sparq", "budget": 128, "scores": [0.0, None, None],
                      "items_run": 1}])
    text, summary = _run(tmp_path, res, other, capsys=capsys)
    # the 200-token length: listed as not run, no table, no cell
    assert "## Needle, 200 tokens (not run)\n\nIncomplete: 1 of this length's 1 prompts " \
        "not run yet.\n" in text
    assert "## Needle, 100 tokens (2 prompts)\n" in text
    assert not [c for c in summary["cells"] if c["length"] == 200]
    assert summary["not_run"] == [{"bench": "needle", "task": "needle", "length": 200,
                                   "prompts": 1}]
    assert _line(text, 100, "snapkv") == "| snapkv | n/a |"
    assert _line(text, 100, "quest") == "| quest | n/a |"
    assert _line(text, 100, "sparq") == "| sparq | 0.0 [0.0, 79.3] n=1/2 |"
    assert _cell(summary, method="quest")["rejected"] is True
    assert "rocketkv@128 vs sparq@128 (n = 1)" in text


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    assert main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    _write(tmp_path / "bench.json", {"rows": []})
    assert main([str(tmp_path)]) == 2
    assert "no needle or RULER-style result file" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{")
    assert main([str(tmp_path / "broken.json")]) == 2
    assert "not a readable JSON file" in capsys.readouterr().err


def test_a_stopped_ruler_run_marks_its_length_incomplete(tmp_path, capsys):
    """Tasks of unfinished batches are counted under the length's heading and in summary.json,
    the pooled cells cover the tasks run, and a prompt another file answered is not missing."""
    items = [{"task": t, "length": 100, "seed": j, "outputs": ["1234567"]}
             for t in ("niah_single_noise", "niah_multikey", "niah_single_uuid")
             for j in range(2)]
    stopped = {"task": "ruler", "question_agnostic": False, "items": items, "commit": "cccc",
               "scoring": "boundary_f1", "unfinished": 4, "rows": [
                   {"method": "full", "budget": None, "scores": [1.0, 1.0] + [None] * 4},
                   {"method": "rocketkv", "budget": 64, "scores": [1.0, 0.0] + [None] * 4}]}
    # a second file answered the first multikey prompt
    more = {**stopped, "items": items[2:3], "unfinished": 0, "rows": [
        {"method": "full", "budget": None, "scores": [1.0]},
        {"method": "rocketkv", "budget": 64, "scores": [1.0]}]}
    text, summary = _run(tmp_path, stopped, more, capsys=capsys)
    assert "## RULER-style tasks, 100 tokens (3 prompts; incomplete)\n\nIncomplete: 3 of " \
        "this length's 6 prompts not run yet (niah_multikey 1, niah_single_uuid 2); the " \
        "cells cover the prompts run.\n" in text
    assert summary["not_run"] == [
        {"bench": "ruler", "task": "niah_multikey", "length": 100, "prompts": 1},
        {"bench": "ruler", "task": "niah_single_uuid", "length": 100, "prompts": 2}]
    pooled = _cell(summary, bench="ruler", task="pooled", length=100, method="rocketkv")
    # the mean of the task means over the tasks run: noise (1 + 0) / 2, multikey 1
    assert pooled["n"] == 3 and pooled["score"] == 75.0
    # pooled over lengths: a complete length beside the incomplete one pools alone, so there
    # is no pooled-over-lengths table, and the incomplete length's tasks weigh nothing there
    other = {**more, "items": [{**items[2], "length": 200}, {**items[3], "length": 200}],
             "rows": [{"method": "full", "budget": None, "scores": [1.0, 1.0]},
                      {"method": "rocketkv", "budget": 64, "scores": [0.0, 0.0]}]}
    full_other = {**other, "items": [{**it, "length": 300} for it in other["items"]]}
    text, summary = _run(tmp_path, stopped, more, other, full_other, capsys=capsys)
    assert "pooled over lengths (4 prompts; weak units left out; incomplete lengths left " \
        "out: 100 (3 prompts not run))" in text
    pooled = _cell(summary, bench="ruler", task="pooled", length="pooled", method="rocketkv")
    assert pooled["n"] == 4 and pooled["score"] == 0.0  # lengths 200 and 300 only
    # complete runs say nothing of the kind
    text, summary = _run(tmp_path, more, capsys=capsys)
    assert "incomplete" not in text.lower().replace("marked incomplete", "")
    assert summary["not_run"] == []


def test_the_paraphrased_needle_is_a_benchmark_of_its_own(tmp_path, capsys):
    """A paraphrase file (``variant``) at the same lengths as a standard needle file gets its
    own tables, cells and pooled comparisons: pooled with the standard needle, full's 2 of 3
    and 3 of 3 would read as 5 of 6."""
    standard = _result([{"method": "full", "budget": None, "scores": [1.0, 1.0, 1.0]},
                        {"method": "rocketkv", "budget": 128, "scores": [1.0, 1.0, 1.0]}])
    para_items = [{**it, "seed": 7 + i, "variant": "paraphrase"} for i, it in enumerate(NEEDLE)]
    paraphrase = {**_result([{"method": "full", "budget": None, "scores": [1.0, 0.0, 1.0]},
                             {"method": "rocketkv", "budget": 128, "scores": [0.0, 0.0, 1.0]}],
                            items=para_items), "variant": "paraphrase"}
    text, summary = _run(tmp_path, standard, paraphrase, capsys=capsys)
    heading = "Needle, paraphrased question (no content word shared with it)"
    assert f"## {heading}, 100 tokens (2 prompts)" in text
    assert _line(text, 100, "full") == "| full | 100.0 [34.2, 100.0] n=2 |"
    assert _line(text, 100, "full", bench=heading) == "| full | 50.0 [9.5, 90.5] n=2 |"
    assert _cell(summary, bench="needle", length="pooled", method="full")["n"] == 3
    pooled = _cell(summary, bench="needle_paraphrase", length="pooled", method="full")
    assert (pooled["n"], pooled["score"]) == (3, pytest.approx(75.0))  # 1/2 and 1/1
    assert {x["bench"] for x in summary["comparisons"]} == {"needle", "needle_paraphrase"}


def test_a_degenerate_cell_is_marked_and_claims_nothing(tmp_path, capsys):
    """A row the harness marked degenerate (``Params.degenerate``: SnapKV keeping fewer prompt
    tokens per query head than its window, DuoAttention without a retrieval head) shows so in
    its cell; its comparison is listed with no claim and leaves the Holm family, so the other
    comparisons are adjusted as if it were not there."""
    items = [{"length": 100, "depth": i / 10, "seed": i, "answer": "1679215"} for i in range(10)]
    why = "each query head keeps 4 prompt tokens beside its 32-token window"
    res = _result([{"method": "full", "budget": None, "scores": [1.0] * 10},
                   {"method": "rocketkv", "budget": 64, "scores": [1.0] * 10},
                   {"method": "quest", "budget": 64, "scores": [0.0] * 10},
                   {"method": "snapkv", "budget": 64, "scores": [0.0] * 10,
                    "degenerate": why}], items=items)
    text, summary = _run(tmp_path, res, capsys=capsys)
    assert _line(text, 100, "snapkv").endswith("n=10 (degenerate) |")
    assert f"snapkv degenerate at this budget ({why}): no claim" in text
    assert _cell(summary, length=100, method="snapkv", budget=64)["degenerate"] == why
    # quest: p = 2 / 2^10; Holm over quest and full only (x 2), not x 3
    quest = next(x for x in summary["comparisons"] if x["b"] == "quest" and x["length"] == 100)
    assert quest["p_holm"] == pytest.approx(2 * 2 / 2 ** 10)
    snap = next(x for x in summary["comparisons"] if x["b"] == "snapkv" and x["length"] == 100)
    assert snap["degenerate"] == why and snap["p_holm"] == snap["p"]
