"""scripts/bench_step.py: one layer's decode step per method, at a small shape on CPU."""

import json

from scripts.bench_step import main


def test_rows_counts_and_bytes(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--context", "300",
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
    # one top-k for the oracle and Quest (pages), two for SparQ and hybrid (dims, then
    # tokens or pages), none for the full cache
    assert [rows[m]["topk_ops"] for m in ("full", "exact_topk", "quest", "sparq", "hybrid")] \
        == [0, 1, 1, 2, 2]
    assert rows["full"]["bytes_read_per_step"] == rows["full"]["kv_cache_bytes"]
    assert rows["rocketkv"]["method_params"]["budget"] == 64
    assert "| rocketkv | 64 | 300 |" in capsys.readouterr().out


def test_refuses_methods_whose_layers_differ(capsys):
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--methods", "omnikv"]) == 2
    assert "its layers differ" in capsys.readouterr().err
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--steps", "0"]) == 2
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--split-pages", "512"]) == 2
    assert "--split-pages sets the fused selection's split" in capsys.readouterr().err


def test_old_flag_spellings_still_work_with_a_note(capsys):
    """--model and --out (a file) are --checkpoint and --json, with a deprecation note."""
    assert main(["--device", "cpu", "--model", "stories260K", "--steps", "0",
                 "--out", "rows.json"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["note: --model is deprecated; use --checkpoint",
                       "note: --out is deprecated; use --json"]
    assert "--steps must be positive" in err[2]
