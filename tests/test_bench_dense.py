"""scripts/bench_dense.py: the dense kernels against F.linear over launch configurations, a
smoke run at stories260K's shape on CPU (Triton's interpreter; the times mean nothing)."""

import importlib
import json

import pytest

import kernels
from scripts.bench_dense import GRIDS, main

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason=f"triton: {kernels.missing()}")
DENSE = importlib.import_module("kernels.dense") if kernels.ops() is not None else None


def test_rows_per_shape_and_configuration(tmp_path, monkeypatch):
    """A reference row and one row per configuration for each projection, the default
    configuration marked, every row's bytes and bandwidth share; the module's launch rule
    is back to its defaults afterwards."""
    dense = DENSE
    monkeypatch.setitem(GRIDS, "one", [(64, 8, 64, 2)])
    before = (dense.TARGET_PROGRAMS, dense.MAX_BLOCK_N, dense.K_BLOCK_GEMV, dense.NUM_WARPS)
    out = tmp_path / "dense.json"
    assert main(["--device", "cpu", "--checkpoint", "stories260K", "--batch-sizes", "1",
                 "--grid", "one", "--iters", "1", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    names = ["qkv_store", "wo+residual", "w13+swiglu", "w2+residual", "lm_head"]
    assert [r["shape"] for r in rows] == [n for n in names for _ in range(3)]
    for i in range(0, len(rows), 3):
        ref, default, other = rows[i:i + 3]
        assert ref["kernel"] == "F.linear" and "error" not in default and "error" not in other
        assert default["default"] and not other["default"]
        assert other["config"] == {"TARGET_PROGRAMS": 64, "MAX_BLOCK_N": 8, "K_BLOCK": 64,
                                   "NUM_WARPS": 2}
        assert ref["weight_bytes"] == ref["weight_rows"] * ref["K"] * 4  # float32 on CPU
        assert default["vs_reference"] == pytest.approx(default["us_median"] /
                                                        ref["us_median"])
    assert (dense.TARGET_PROGRAMS, dense.MAX_BLOCK_N, dense.K_BLOCK_GEMV,
            dense.NUM_WARPS) == before


def test_bad_counts_are_refused_in_one_line(capsys):
    assert main(["--device", "cpu", "--iters", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --iters must be positive"
