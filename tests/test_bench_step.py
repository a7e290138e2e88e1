"""scripts/bench_step.py: one layer's decode step per method, at a small shape on CPU."""

import json

import pytest

from scripts.bench_step import main


def test_rows_counts_and_bytes(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "300",
                 "--methods", "full", "exact_topk", "quest", "sparq", "hybrid", "rocketkv",
                 "h2o", "--budgets", "64", "--steps", "2", "--warmup", "1",
                 "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"full", "exact_topk", "quest", "sparq", "hybrid", "rocketkv", "h2o"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["steps"] == 2 and r["step_ms_p10"] <= r["step_ms_p90"]
        assert r["bytes_read_per_step"] >= r["ideal_bytes_per_step"] > 0
        assert r["aten_ops"] > 0 and r["device"] == "cpu" and r["cuda_kernels"] is None
        assert r["fused_kernels"] is False and r["split_pages"] is None  # CPU: PyTorch path
    # one top-k for the oracle and Quest (pages), two for SparQ and hybrid (the dims' sort,
    # then the tokens' or pages' top-k), none for the full cache
    assert [rows[m]["topk_ops"] for m in ("full", "exact_topk", "quest", "sparq", "hybrid")] \
        == [0, 1, 1, 2, 2]
    assert rows["full"]["bytes_read_per_step"] == rows["full"]["kv_cache_bytes"]
    assert rows["rocketkv"]["method_params"]["budget"] == 64
    assert "| rocketkv | 64 | 300 |" in capsys.readouterr().out


def test_refuses_methods_whose_layers_differ(capsys):
    assert main(["--device", "cpu", "--config", "stories260K", "--methods", "omnikv"]) == 2
    assert "its layers differ" in capsys.readouterr().err
    assert main(["--device", "cpu", "--config", "stories260K", "--steps", "0"]) == 2
    assert main(["--device", "cpu", "--config", "stories260K", "--split-pages", "512"]) == 2
    assert "--knob and --split-pages set the fused kernels' launch constants" in \
        capsys.readouterr().err


def test_old_flag_spellings_still_work_with_a_note(capsys):
    """--model and --out (a file) are --config and --json, with a deprecation note."""
    assert main(["--device", "cpu", "--model", "stories260K", "--steps", "0",
                 "--out", "rows.json"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["note: --model is deprecated; use --config",
                       "note: --out is deprecated; use --json"]
    assert "--steps must be positive" in err[2]


def test_knobs_repeat_each_configuration_and_reach_the_kernels(tmp_path, capsys, monkeypatch):
    """``--knob NAME=V1,V2`` (Triton's interpreter): one row per combination, each recording
    the constants as they ran and launching with them (Full-KV's split over the sequence),
    the module's constants restored afterwards; bad knobs are one error line."""
    from rocketkv import kernels

    previous = kernels.set_mode("force")
    try:
        module = kernels.ops()
        before = {n: getattr(module, n) for n in ("PREFIX_SPLIT", "PREFIX_PROGRAMS")}
        seen, splits = [], module.prefix_splits

        def spy(*a):
            seen.append(splits(*a))
            return seen[-1]

        monkeypatch.setattr(module, "prefix_splits", spy)
        out = tmp_path / "step.json"
        # qwen2.5-0.5b's layer: 2 KV heads of 64 dims (the kernels need 16 at least)
        assert main(["--device", "cpu", "--config", "qwen2.5-0.5b", "--context", "300",
                     "--methods", "full", "--steps", "1", "--warmup", "0", "--knob",
                     "PREFIX_SPLIT=64", "--knob", "PREFIX_PROGRAMS=2,16", "--json",
                     str(out), "--tuned", str(tmp_path / "tuned.json")]) == 0
        rows = json.loads(out.read_text())
        tuned = json.loads((tmp_path / "tuned.json").read_text())
        totals = [r["step_ms_median"] for r in rows]  # one configuration, two settings
        assert [t["step_ms_total"] for t in tuned["settings"]] == totals
        assert [t["relative"] for t in tuned["settings"]] == [t / min(totals) for t in totals]
        fastest = 2 if totals[0] <= totals[1] else 16
        assert tuned["constants"] == {"sparse": {"PREFIX_SPLIT": 64,
                                                 "PREFIX_PROGRAMS": fastest}}
        assert tuned["device"] == "cpu" and tuned["rows"] == str(out)
        assert [(r["knobs"]["PREFIX_SPLIT"], r["knobs"]["PREFIX_PROGRAMS"]) for r in rows] == \
            [(64, 2), (64, 16)]
        assert all(r["fused_kernels"] and "error" not in r for r in rows)
        # 2 programs in all: one split a KV head; 16: 364 slots // 64 = 5, a power of two: 8
        assert seen[0] == 1 and seen[-1] == 8
        assert {n: getattr(module, n) for n in before} == before
    finally:
        kernels.set_mode(previous)
    table = capsys.readouterr().out  # the knob that varied is the last column
    assert "| roofline ms | PREFIX_PROGRAMS |" in table and table.count(" | 16 |") == 1
    for knob, message in (("SPLITS=2", "'SPLITS' is not one of SPLIT_PAGES"),
                          ("ATTEND_TOKENS=48", "ATTEND_TOKENS must be a power of two of at "
                                               "least 16, got 48"),
                          ("NUM_WARPS=4,x", "values must be integers")):
        with pytest.raises(SystemExit) as stop:  # argparse's own exit, one line
            main(["--device", "cpu", "--config", "stories260K", "--knob", knob])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and "\n" not in err
        assert err.startswith("error: argument --knob") and message in err, err
    assert main(["--device", "cpu", "--config", "stories260K", "--knob", "NUM_WARPS=4",
                 "--knob", "NUM_WARPS=8"]) == 2
    assert "--knob NUM_WARPS given twice" in capsys.readouterr().err
    assert main(["--device", "cpu", "--config", "stories260K", "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err
    assert main(["--device", "cpu", "--config", "stories260K", "--tuned", "t.json"]) == 2
    assert "--tuned chooses among --knob settings" in capsys.readouterr().err
    previous = kernels.set_mode("force")
    try:  # an unwritable table is refused before the run
        assert main(["--device", "cpu", "--config", "qwen2.5-0.5b", "--knob",
                     "PREFIX_PROGRAMS=2", "--tuned", "/nonexistent/dir/t.json"]) == 2
    finally:
        kernels.set_mode(previous)
    assert "--tuned: directory /nonexistent/dir does not exist" in capsys.readouterr().err


def test_the_tuned_setting_weighs_each_configuration_alike():
    """``best_setting``: a setting 20% slower on a slow configuration but twice as fast on a
    quick one wins (the sum of step times would pick the other); a setting with a failed row
    is never chosen."""
    from scripts.bench_step import best_setting

    def row(setting, method, ms):
        return {"setting": setting, "method": method, "budget": 256, "context": 32768,
                "step_ms_median": ms}

    rows = [row(0, "exact_topk", 10.0), row(0, "rocketkv", 1.0),
            row(1, "exact_topk", 12.0), row(1, "rocketkv", 0.5),
            row(2, "exact_topk", 1.0), dict(row(2, "rocketkv", 0.1), error="out of memory")]
    settings = [{"SPLIT_PAGES": 1024}, {"SPLIT_PAGES": 2048}, {"SPLIT_PAGES": 4096}]
    best, totals = best_setting(rows, settings)
    assert best == {"SPLIT_PAGES": 2048}
    assert [t["step_ms_total"] for t in totals] == [11.0, 12.5, None]
    assert [t["relative"] for t in totals][:2] == [(1.0 + 2.0) / 2, (1.2 + 1.0) / 2]


def test_a_cuda_error_ends_the_run_with_the_rows_saved(tmp_path, monkeypatch, capsys):
    """A sticky CUDA error (every later CUDA call raises, ``empty_cache`` included) in the 2nd
    of 3 rows: the 1st stays as measured, the 2nd records the error, the 3rd is listed as not
    run, exit status 1 with one stderr line naming the row (no traceback)."""
    import torch

    from rocketkv.evals import layer_step as bs

    one, calls = bs.run_one, []

    def faulty(args, method, budget, context, *a, **kw):
        calls.append(context)
        if len(calls) == 2:
            def broken(*_):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            monkeypatch.setattr(torch.cuda, "empty_cache", broken)
            monkeypatch.setattr(torch.cuda, "synchronize", broken)
            broken()
        return one(args, method, budget, context, *a, **kw)

    monkeypatch.setattr(bs, "run_one", faulty)
    out = tmp_path / "step.json"
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "48", "64", "80",
               "--methods", "full", "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert rc == 1 and calls == [48, 64]
    rows = json.loads(out.read_text())
    assert [r["context"] for r in rows] == [48, 64, 80]
    assert "error" not in rows[0] and rows[0]["step_ms_median"] > 0
    assert rows[1]["error"] == "RuntimeError: CUDA error: an illegal memory access was " \
        "encountered"
    assert rows[2]["error"].startswith("skipped:") and "full at 64 tokens" in rows[2]["error"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: full at 64 tokens: RuntimeError")
    assert "not run: 1" in err[0] and str(out) in err[0]


def test_rows_go_to_the_current_directory_by_default(tmp_path, monkeypatch):
    """No ``--json``: the rows land under the current directory, not the repository's
    ``results/``."""
    monkeypatch.chdir(tmp_path)
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "48",
                 "--methods", "full", "--steps", "1", "--warmup", "0"]) == 0
    assert len(list((tmp_path / "cpu").glob("bench_step-*.json"))) == 1
    assert not (tmp_path / "results").exists()
