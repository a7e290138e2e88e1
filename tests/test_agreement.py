"""scripts/agreement.py: two runs of the same prompts compared prompt by prompt."""

import json

from rocketkv.evals.agreement import agreement
from scripts.agreement import main


def result(commit, answers, scores, items=None, mode="standard"):
    items = items or [{"task": "vt", "length": 4096, "sample": i, "seed": 10 + i}
                      for i in range(len(answers))]
    return {"commit": commit, "mode": mode, "items": items,
            "rows": [{"method": "rocketkv", "budget": 256, "answers": answers, "scores": scores},
                     {"method": "full", "budget": None, "answers": answers, "scores": scores}]}


def test_prompts_are_matched_by_what_names_them_not_by_position():
    a = result("a" * 40, ["x", "y", "z"], [1.0, 0.0, 1.0])
    b = result("b" * 40, ["z", "y2", "x"], [1.0, 0.5, 1.0], items=list(reversed(a["items"])))
    rows = {r["method"]: r for r in agreement(a, b)}
    r = rows["rocketkv"]
    assert (r["n"], r["same_answers"], r["same_scores"]) == (3, 2, 2)
    assert r["differ"] == [{"prompt": {"task": "vt", "length": 4096, "sample": 1, "seed": 11},
                            "a": 0.0, "b": 0.5}]
    assert round(r["score_a"], 1) == 66.7 and round(r["score_b"], 1) == 83.3


def test_only_shared_prompts_and_configurations_count(tmp_path, capsys):
    a = result("a" * 40, ["x", "y"], [1.0, 0.0])
    b = result("b" * 40, ["x"], [1.0], items=a["items"][:1], mode="question_agnostic")
    assert agreement(a, b) == []  # another mode: no shared configuration
    b["mode"] = "standard"
    assert [r["n"] for r in agreement(a, b)] == [1, 1]
    for name, res in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(res))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "| rocketkv | 256 | standard | 1 | 1 | 1 | 100.0 | 100.0 |" in out
    assert "@aaaaaaa" in out and "@bbbbbbb" in out
    b["items"] = [{"task": "cwe", "length": 4096, "sample": 0, "seed": 1}]
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    assert capsys.readouterr().err.startswith("error: the two result files share no prompt")
