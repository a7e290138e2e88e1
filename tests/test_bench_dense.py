"""scripts/bench_dense.py: the dense kernels against F.linear over launch configurations, a
smoke run at stories260K's shape on CPU (Triton's interpreter; the times mean nothing)."""

import importlib
import json

import pytest

import kernels
from model import CONFIGS
from scripts.bench_dense import GRIDS, main

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason=f"triton: {kernels.missing()}")
DENSE = importlib.import_module("kernels.dense") if kernels.ops() is not None else None


def test_rows_per_shape_and_configuration(tmp_path, monkeypatch):
    """A reference row and one row per configuration for each projection, the default
    configuration marked, every row's bytes and bandwidth share; the module's launch rule
    is back to its defaults afterwards."""
    dense = DENSE
    monkeypatch.setitem(GRIDS, "one", [(64, 8, 64, 2)])
    monkeypatch.setattr(dense, "TARGET_PROGRAMS", 16)  # the default row: few programs
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


def test_quantized_weights_rows(tmp_path, monkeypatch):
    """``--weights int8 int4-g32``: each projection's reference row is the quantized layer
    without our kernels, our rows read the quantized bytes (scales and zeros included), and
    every launch runs (a stories260K-like shape whose widths take groups of 32)."""
    monkeypatch.setitem(CONFIGS, "tiny-q", dict(CONFIGS["stories260K"], intermediate_size=128,
                                                vocab_size=256))
    monkeypatch.setattr(DENSE, "TARGET_PROGRAMS", 4)  # fewer, larger programs: interpreted
    out = tmp_path / "dense.json"
    assert main(["--device", "cpu", "--checkpoint", "tiny-q", "--batch-sizes", "1",
                 "--grid", "none", "--weights", "int8", "int4-g32", "--iters", "1", "--reps",
                 "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["weights"], r["kernel"]) for r in rows[:2]] == [("int8", "torch int8"),
                                                               ("int8", "ours")]
    assert all("error" not in r for r in rows) and len(rows) == 2 * 5 * 2
    head = {r["weights"]: r for r in rows if r["shape"] == "lm_head" and r["kernel"] == "ours"}
    dim, vocab = 64, 256  # int8: a byte a weight and a float32 scale a row (CPU: bfloat16)
    assert head["int8"]["weight_bytes"] == vocab * dim + vocab * 2
    assert head["int4-g32"]["weight_bytes"] == vocab * dim // 2 + (dim // 32) * vocab * 2 * 4


def test_unknown_weights_are_refused_in_one_line(capsys):
    assert main(["--device", "cpu", "--weights", "int3"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --weights: 'int3' is not float")
