"""scripts/profile_step.py: the kernels (on CPU, operators) of a decode step, per method."""

import json

from scripts.profile_step import main


def test_profile_records_exactly_the_asked_steps(tmp_path, capsys):
    """The trace holds the asked decode steps and no other: every per-layer operator's calls
    divide evenly by the layers (stories260K: 5) at every step, the LM head's matrix product
    runs once per step, and the table is written per method."""
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--context", "200",
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
    assert "note: --model is deprecated; use --checkpoint" in err
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--compile-regime",
                 "graphs"]) == 2
    assert "--compile-regime graphs needs a CUDA device" in capsys.readouterr().err
