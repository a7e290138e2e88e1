"""scripts/predict_step.py: the step-time model fitted to the 2026-11-27 H200 profile
(``rocketkv/evals/step_model.py``), checked against it, and its predictions' behaviour."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from conftest import ROOT

from rocketkv.evals import step_model as sm
from rocketkv.kernels import sparse
from rocketkv.model import ModelArgs
from scripts.predict_step import main

PROFILE = ROOT / "results" / "NVIDIA-H200" / "profile-32768.json"
PYTORCH_PROFILE = ROOT / "results" / "NVIDIA-H200" / "profile-131008.json"
BENCH = ROOT / "results" / "NVIDIA-H200" / "bench-20261127-071354.json"
ARGS = ModelArgs.from_name("llama-3.1-8b")
CONTEXTS = [16384, 32768, 65536, 131008]

# The families the model misses by more than 25% on the profile, and why. None is gated
# (each is under 1% of the step; together 0.4%): the model gives every tiny kernel one fixed
# launch_us (their measured times are 0.9-3.1 us a call), and PyTorch's argmax over the
# 128256 logits runs in one block, compute- and latency-bound, not at a streaming rate.
EXPECTED_MISSES = {
    "torch argmax": "one block reducing the vocabulary: not bandwidth-bound (0.25x)",
    "torch embedding": "one launch_us for every tiny kernel; measured 2.9-3.1 us",
    "torch index": "one launch_us for every tiny kernel; measured 2.2-2.3 us",
    "torch memcpy": "one launch_us for every tiny kernel; measured 0.94 us a copy",
    "torch add": "one launch_us for every tiny kernel; measured 1.2-1.3 us",
}


@pytest.fixture(scope="module")
def profile():
    return sm.load_profile(PROFILE)


@pytest.fixture(scope="module")
def fitted(profile):
    return sm.fit(profile)


def test_the_fit_reproduces_every_profiled_family(profile, fitted):
    """Every family of at least 1% of the step within 25% of its measured us per step, with
    the profiled call counts; the step within 2% of the decode median; what misses is only
    what EXPECTED_MISSES documents."""
    rows = sm.check(profile, fitted)
    gated = {r["family"] for r in rows if r["gated"]}
    assert gated == {"_linear_kernel", "_attend_prefix_kernel", "_merge_splits_kernel",
                     "_select_attend_kernel"}
    for r in rows:
        assert r["measured_calls"] == r["predicted_calls"], r
        if r["gated"]:
            assert r["ok"] and abs(r["ratio"] - 1) <= 0.25, r
        elif r["family"] == "step":
            assert abs(r["ratio"] - 1) < 0.02, r
        elif abs(r["ratio"] - 1) > 0.25:
            assert r["family"] in EXPECTED_MISSES, r
    # the two _linear_kernel rows pool one fraction: both within 1%
    assert all(abs(r["ratio"] - 1) < 0.01 for r in rows if r["family"] == "_linear_kernel")


def test_the_three_number_fit_misses_the_dense_attention(profile):
    """The reason for the per-class fit: one fraction (the untuned GEMV's 0.36 of peak) and one
    per-program rate (the selection's) put Full-KV's attention and merge far off."""
    shared = sm.fit(profile, shared=True)
    ratios = {r["family"]: r["ratio"] for r in sm.check(profile, shared)
              if r["method"] == "full"}
    assert ratios["_attend_prefix_kernel"] > 2 and ratios["_merge_splits_kernel"] > 5
    assert sm._gated_misses(sm.check(profile, shared))


def test_the_fit_is_physical(fitted):
    """Fractions of peak at most 1; a program far below the device's bandwidth; the untuned
    GEMV below the attention kernel (README: 1.7 TB/s)."""
    assert 0 < fitted.fraction["gemv"] < fitted.fraction["stream"] <= 1
    assert 1600 < fitted.fraction["gemv"] * 4800 < 1800
    assert 0 < fitted.per_program_gbps["select"] < fitted.per_program_gbps["stream"] < 100
    assert 0.5 < fitted.launch_us < 3 and 0 < fitted.gap_us < 1
    assert fitted.selection_sms == 0  # the profiled selection: one program per KV head


def test_the_held_out_128k_steps_are_within_25_percent(fitted):
    """The 131008-token decode medians of the profile's session, which no parameter saw: full
    and rocketkv within 25%; rocketkv's under-predicted (the selection's time follows its page
    count, which the bytes model does not see: the module docstring)."""
    rows = {(r["method"], r["context"]): r for r in sm.holdout(sm.load_bench(BENCH), fitted)}
    assert set(rows) == {(m, c) for m in ("full", "rocketkv") for c in (32768, 131008)}
    assert all(abs(r["ratio"] - 1) <= 0.25 for r in rows.values())
    assert rows[("rocketkv", 131008)]["ratio"] < 1


@pytest.fixture(scope="module")
def rows(fitted):
    return sm.predictions(ARGS, fitted, list(sm.DEVICES), CONTEXTS, 256, [(16, 32768)])


def test_full_grows_with_the_context_and_rocketkv_barely(rows):
    for dev in sm.DEVICES.values():
        full = [r["predicted_step_ms"] for r in rows if r["device"] == dev.name
                and r["method"] == "full" and r["batch_size"] == 1]
        rocket = [r["predicted_step_ms"] for r in rows if r["device"] == dev.name
                  and r["method"] == "rocketkv" and r["batch_size"] == 1]
        assert len(full) == len(CONTEXTS) and full == sorted(full) and full[-1] > full[0] * 1.2
        assert max(rocket) - min(rocket) < 0.05 * min(rocket)


def test_the_split_count_is_selection_splits_for_the_devices_sms(rows):
    """Each rocketkv row's split is the real function's for its pages and the device's SMs;
    a split selection is three kernels a layer, one program per KV head one."""
    by_name = {d.name: d for d in sm.DEVICES.values()}
    for r in rows:
        if r["method"] != "rocketkv":
            continue
        s = r["selection"]
        dev = by_name[r["device"]]
        assert s["splits"] == sparse.selection_splits(
            s["pages"], s["k"], s["page_size"], r["batch_size"] * ARGS.n_kv_heads, dev.sms)
        assert s["programs"] == r["batch_size"] * ARGS.n_kv_heads * s["splits"]
        split_kernels = {"_split_lse_kernel", "_split_choose_kernel", "_split_merge_kernel"}
        if s["splits"] > 1:
            assert split_kernels <= set(r["kernels_us"])
            assert "_select_attend_kernel" not in r["kernels_us"]
        else:
            assert "_select_attend_kernel" in r["kernels_us"]
    h200 = sm.DEVICES["H200"]
    at = {r["context"]: r["selection"]["splits"] for r in rows
          if r["device"] == h200.name and r["method"] == "rocketkv" and r["batch_size"] == 1}
    assert at[32768] == 8 and at[131008] == 16  # 740 and 1171 pages over 132 SMs


def test_the_split_follows_the_sm_count(fitted):
    """Fewer SMs, fewer splits: none at all where the sequences x KV heads fill the GPU (or
    with no SM count, the profiled code), and more with more SMs."""
    splits = {}
    for sms in (0, 8, 33, 132, 528):
        dev = dataclasses.replace(sm.DEVICES["H200"], sms=sms)
        r = sm.predict("rocketkv", ARGS, fitted, dev, context=131008, budget=256)
        splits[sms] = r["selection"]["splits"]
    assert splits[0] == splits[8] == 1
    assert splits[33] < splits[132] <= splits[528]
    assert splits[33] == 8 and splits[132] == 16


def test_more_bandwidth_predicts_less_time(fitted):
    for method, budget in (("full", None), ("rocketkv", 256)):
        times = []
        for bw in (2000.0, 4800.0, 8000.0, 16000.0):
            dev = dataclasses.replace(sm.DEVICES["H200"], bandwidth_gbps=bw)
            times.append(sm.predict(method, ARGS, fitted, dev, context=65536,
                                    budget=budget)["predicted_step_ms"])
        assert times == sorted(times, reverse=True) and len(set(times)) == len(times)


def test_the_roofline_is_a_lower_bound(rows):
    for r in rows:
        assert 0 < r["roofline_ms"] < r["predicted_step_ms"], r
    # the roofline reads the weights and, for full, the whole written K/V: at 32K on the H200
    # 15.0 GB + 4.3 GB at 4.8 TB/s (README's 4.65 ms is the same bytes at the measured 4.16)
    full = next(r for r in rows if r["device"] == "H200" and r["method"] == "full"
                and r["context"] == 32768 and r["batch_size"] == 1)
    assert full["roofline_bytes"] / 1e9 == pytest.approx(15.01 + 4.30, abs=0.05)


def test_batch_16_reads_the_weights_once_and_the_kv_per_sequence(fitted):
    dev = sm.DEVICES["H200"]
    one = sm.predict("full", ARGS, fitted, dev, context=32768)
    many = sm.predict("full", ARGS, fitted, dev, context=32768, batch=16)
    kv = one["roofline_bytes"] - 15.01e9
    assert many["roofline_bytes"] == pytest.approx(15.01e9 + 16 * kv, rel=0.01)
    assert not sm.predict("full", ARGS, fitted, sm.DEVICES["H100"], context=32768,
                          batch=16)["fits_memory"]  # 85 GB on an 80 GB H100


def test_the_script_writes_its_report(tmp_path, capsys):
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    assert main(["--devices", "H200", "--context", "32768", "--batched",
                 "--json", str(out), "--md", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["predicted"] is True and "not measured" in doc["note"]
    assert [r["method"] for r in doc["predictions"]] == ["full", "rocketkv"]
    text = md.read_text()
    assert text.splitlines()[3].startswith("python scripts/predict_step.py")
    assert "predicted from the 2026-11-27 H200 profile, not measured" in text
    assert "Check against the profile" in capsys.readouterr().out


def test_a_gated_miss_exits_1(tmp_path, profile, capsys):
    """A profile whose rocketkv row took twice the GEMV time: the pooled fraction fits
    neither row, so both are off by about a third."""
    bad = copy.deepcopy(profile)
    row = next(r for r in bad["results"] if r["method"] == "rocketkv")
    lin = next(k for k in row["kernels"] if k["name"] == "_linear_kernel")
    lin["us_per_step"] *= 2
    path = tmp_path / "p.json"
    path.write_text(json.dumps(bad))
    assert main(["--profile", str(path), "--devices", "H200", "--context", "32768",
                 "--batched", "--bench"]) == 1
    assert "miss: _linear_kernel" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--profile", "no-such.json"], "cannot read"),
    (["--profile", str(PYTORCH_PROFILE)], "no _linear_kernel"),
    (["--context", "0"], "must be positive"),
    (["--context", "131072"], "positions"),
    (["--budget", "1"], "too small"),
    (["--json", "/no/such/dir/x.json"], "does not exist"),
])
def test_bad_input_exits_2_with_one_line(argv, says, capsys):
    assert main(["--devices", "H200", "--batched", "--bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


@pytest.mark.parametrize("argv", [["--batched", "16x32768"], ["--devices", "A100"],
                                  ["--context", "many"]])
def test_usage_errors_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
