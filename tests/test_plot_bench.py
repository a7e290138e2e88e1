"""scripts/plot_bench.py: bench charts from several result files, one compile regime."""

import json
from pathlib import Path

from scripts.plot_bench import main

H200 = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "results" /
                               "NVIDIA-H200").glob("bench-20261122-*.json"))  # 2026-11-22


def test_charts_from_the_committed_h200_runs(tmp_path, capsys):
    """The H200's twelve runs hold a dynamic-regime row beside the static ones: the regime
    must be chosen; the static rows of every run give the four charts."""
    assert len(H200) == 12
    assert main([*H200, "--prefix", str(tmp_path / "h200")]) == 2
    assert capsys.readouterr().err.strip() == ("error: the rows hold the regimes dynamic, "
                                               "static: choose one with --regime")
    assert main([*H200, "--prefix", str(tmp_path / "h200"), "--regime", "static"]) == 0
    drawn = capsys.readouterr().out.split()
    assert [Path(p).name for p in drawn] == [f"h200-{c}.png" for c in (
        "a_speedup", "b_memory", "c_latency", "d_methods")]
    assert all(Path(p).stat().st_size > 10_000 for p in drawn)


def test_rows_of_two_runs_merge_and_bad_input_is_one_line(tmp_path, capsys):
    """Two runs of the graphs regime (the paper's grid in two calls) draw as one; a missing
    regime, weights mode or directory is one error line."""
    rows = [json.loads(Path(f).read_text()) for f in H200]
    ok = [dict(r, compile_regime="graphs", compiled=False) for run in rows for r in run
          if "error" not in r and r.get("compile_regime") == "static"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([r for r in ok if r["context"] <= 65536]))
    b.write_text(json.dumps([r for r in ok if r["context"] > 65536]))
    assert main([str(a), str(b), "--prefix", str(tmp_path / "grid")]) == 0
    assert len(capsys.readouterr().out.split()) == 4
    for argv, message in (
            (["--regime", "static"], "no measured float row of regime static (present: "
                                     "graphs)"),
            (["--weights", "int4-g128"], "no measured int4-g128 row of regime graphs"),
    ):
        assert main([str(a), str(b), "--prefix", str(tmp_path / "g"), *argv]) == 2
        assert capsys.readouterr().err.strip().startswith(f"error: {message}")
    assert main([str(a), "--prefix", str(tmp_path / "no" / "g")]) == 2
    assert "no directory" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json"), "--prefix", str(tmp_path / "g")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_configuration_measured_with_several_kernel_settings_draws_the_default():
    """``bench.py --kernels on`` rows beside ``sparse`` ones: the chart takes the rows of
    what ``--kernels auto`` runs on that GPU (``check_targets.engine_rows``): here, no tuned
    table timing the dense kernels faster, the sparse rows (a row of a configuration
    measured no other way stays)."""
    from scripts.plot_bench import select

    base = {"device": "NVIDIA H100", "model": "llama-3.1-8b", "dtype": "bfloat16",
            "method": "full", "budget": None, "batch_size": 1, "compile_regime": "graphs",
            "decode_ms_median": 9.0}
    every = dict(base, context=32768, fused_kernels=True, dense_kernels=True)
    sparse = dict(base, context=32768, fused_kernels=True, dense_kernels=False,
                  decode_ms_median=11.0)
    only = dict(base, context=131008, fused_kernels=True, dense_kernels=False)
    rows, regime = select([sparse, every, only], None, "float")
    assert regime == "graphs" and rows == [sparse, only]
    rows, _ = select([every, only], None, "float")
    assert rows == [every, only]  # the most kernels where the default's rows are absent
