"""scripts/bench_dense.py: the dense kernels against F.linear over launch configurations, a
smoke run at stories260K's shape on CPU (Triton's interpreter; the times mean nothing)."""

import importlib
import json

import pytest

from rocketkv import kernels
from rocketkv.evals.dense_bench import GRIDS
from rocketkv.kernels import tuning
from rocketkv.model import CONFIGS, ModelArgs
from scripts.bench_dense import main

pytestmark = pytest.mark.skipif(kernels.ops() is None, reason=f"triton: {kernels.missing()}")
DENSE = importlib.import_module("rocketkv.kernels.dense") if kernels.ops() is not None else None


def test_rows_per_shape_and_configuration(tmp_path, monkeypatch):
    """A reference row and one row per configuration for each projection, the default
    configuration marked, every row's bytes and bandwidth share, each timed launch given
    its row's knobs; the module's launch rule is back to its defaults afterwards; --tuned
    writes each launch's fastest knobs under its key, a table kernels.dense reads."""
    dense = DENSE
    monkeypatch.setitem(GRIDS, "one", [(64, 8, 64, 2)])
    monkeypatch.setattr(dense, "TARGET_PROGRAMS", 16)  # the default row: few programs
    before = (dense.TARGET_PROGRAMS, dense.MAX_BLOCK_N, dense.K_BLOCK_GEMV, dense.NUM_WARPS,
              dense.launch_knobs)
    launched = []
    config = dense.launch_config

    def spy(epi, M, K, n, head_dim=2, knobs=None):
        launched.append(knobs)
        return config(epi, M, K, n, head_dim, knobs)

    monkeypatch.setattr(dense, "launch_config", spy)
    out, table = tmp_path / "dense.json", tmp_path / "tuned.json"
    assert main(["--device", "cpu", "--config", "stories260K", "--batch-sizes", "1",
                 "--grid", "one", "--iters", "1", "--reps", "1", "--json", str(out),
                 "--tuned", str(table)]) == 0
    rows = json.loads(out.read_text())["results"]
    ours = [r for r in rows if r["kernel"] == "ours"]
    assert {json.dumps(r["config"], sort_keys=True) for r in ours} == {
        json.dumps(k, sort_keys=True) for k in launched if k is not None}
    tuned = json.loads(table.read_text())
    assert tuned["device"] == "cpu" and tuned["rows"] == str(out)
    a = ModelArgs.from_name("stories260K")
    qkv, dim, hidden = (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, a.dim, a.intermediate_size
    assert [e["key"] for e in tuned["launches"]] == [
        f"qkv/float/M=1/K={dim}/n={qkv}", f"residual/float/M=1/K={dim}/n={dim}",
        f"swiglu/float/M=1/K={dim}/n={hidden}", f"residual/float/M=1/K={hidden}/n={dim}",
        f"plain/float/M=1/K={dim}/n={a.vocab_size}"]
    for e in tuned["launches"]:
        mine = [r for r in ours if r["key"] == e["key"]]
        assert e["us"] == min(r["us_median"] for r in mine)
        assert e["config"] == next(r["config"] for r in mine if r["us_median"] == e["us"])
        assert e["default_us"] == next(r["us_median"] for r in mine if r["default"])
    assert tuning.read_table(table, "cpu").launches == {e["key"]: e["config"]
                                                        for e in tuned["launches"]}
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
            dense.NUM_WARPS, dense.launch_knobs) == before


def test_bad_counts_are_refused_in_one_line(capsys):
    assert main(["--device", "cpu", "--iters", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --iters must be positive"
    assert main(["--device", "cpu", "--tuned", "/nonexistent/dir/t.json"]) == 2
    assert "--tuned: directory /nonexistent/dir does not exist" in capsys.readouterr().err


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
