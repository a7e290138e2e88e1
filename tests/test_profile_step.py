"""scripts/profile_step.py: the kernels (on CPU, operators) of a decode step, per method."""

import json

from scripts.profile_step import main


def test_profile_records_exactly_the_asked_steps(tmp_path, capsys):
    """The trace holds the asked decode steps and no other: every per-layer operator's calls
    divide evenly by the layers (stories260K: 5) at every step, the LM head's matrix product
    runs once per step, and the table is written per method."""
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "200",
                 "--methods", "full", "rocketkv", "--budgets", "64", "--steps", "3",
                 "--top", "4", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "profile-200.json").read_text())
    assert [(r["method"], r["budget"]) for r in data["results"]] == [("full", None),
                                                                    ("rocketkv", 64)]
    for r in data["results"]:
        assert r["activity"] == "cpu" and r["steps"] == 3 and r["compile_regime"] == "eager"
        ops = {k["name"]: k for k in r["kernels"]}
        assert not any(name.startswith("ProfilerStep") for name in ops)
        # five layers: rmsnorm's rsqrt twice per layer, plus the final norm, every step
        assert ops["aten::rsqrt"]["calls_per_step"] == 2 * 5 + 1
        assert abs(sum(k["us_per_step"] for k in r["kernels"]) - r["total_us_per_step"]) < 1e-6
    md = (tmp_path / "profile-200.md").read_text()
    assert "### full, context 200" in md and "### rocketkv @64, context 200" in md
    assert main(["--device", "cpu", "--model", "stories260K", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--steps must be positive" in err
    assert "note: --model is deprecated; use --config" in err
    assert main(["--device", "cpu", "--config", "stories260K", "--compile-regime",
                 "graphs"]) == 2
    assert "--compile-regime graphs needs a CUDA device" in capsys.readouterr().err


def test_each_method_is_saved_as_it_finishes(tmp_path, monkeypatch, capsys):
    """Three methods: the 1st profiles; the 2nd finds the 1st's row on disk (a run killed
    there keeps it) and fails with an ordinary error, which is its row, the run going on; the
    3rd hits a sticky CUDA error (test double), which ends the run: exit status 1, one stderr
    line naming the row, the JSON and the table holding every row so far, the 4th not run."""
    import rocketkv.evals.profile as ps

    one, seen = ps.profile_one, []

    def faulty(model, method, budget, *a, **kw):
        seen.append(method)
        if len(seen) == 1:
            return one(model, method, budget, *a, **kw)
        data = json.loads((tmp_path / "profile-64.json").read_text())
        assert [r["method"] for r in data["results"]] == seen[:-1]
        if len(seen) == 2:
            raise IndexError("index 7 is out of bounds")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ps, "profile_one", faulty)
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "64",
               "--methods", "full", "streamingllm", "snapkv", "quest", "--budgets", "32",
               "--steps", "1", "--top", "2", "--out", str(tmp_path)])
    assert rc == 1 and seen == ["full", "streamingllm", "snapkv"]
    rows = json.loads((tmp_path / "profile-64.json").read_text())["results"]
    assert [r["method"] for r in rows] == ["full", "streamingllm", "snapkv", "quest"]
    assert "error" not in rows[0] and rows[0]["kernels"]
    assert rows[1]["error"] == "IndexError: index 7 is out of bounds"
    assert rows[2]["error"].startswith("RuntimeError: CUDA error: an illegal memory access")
    assert rows[3]["error"].startswith("skipped:")
    md = (tmp_path / "profile-64.md").read_text()
    assert "### full, context 64" in md and "### snapkv @32, context 64: error: " in md
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: snapkv @32 at 64 tokens") and "illegal memory" in err[-1]
    assert not any("CUDA error" in line for line in err[:-1])  # that line alone for the fault
