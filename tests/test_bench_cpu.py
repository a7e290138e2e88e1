"""scripts/bench_cpu.py: llama-bench's JSON read, the whole alternating run against a fake
``llama-bench`` on PATH on a tiny GGUF (both peers' rows, the order, the load averages, the
ratios), ours alone on a non-GGUF checkpoint or without llama-bench, and bad input."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from test_gguf import write_gguf

from rocketkv.formats.checkpoint import default_gguf_weights
from rocketkv.model import ConfigError
from scripts.bench_cpu import (
    LLAMA_NOT_FOUND,
    SHARED,
    format_table,
    llama_info,
    main,
    parse_llama_bench,
    plan_contexts,
    summarize,
)

# llama-bench -o json's output, recorded from the build of llama-cpp-python 0.3.36's vendored
# llama.cpp (tools/build_llama_cpp.sh): `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2
# -p 0 -n 8 -d 64 -r 1 -o json` on a loaded 2-core machine; a log line put before the list, as
# some builds print one
SAMPLE = """load_backend: loaded CPU backend
[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 8,
    "n_depth": 64,
    "test_time": "2026-11-26T23:30:27Z",
    "avg_ns": 411776324,
    "stddev_ns": 0,
    "avg_ts": 19.428023,
    "stddev_ts": 0.000000,
    "samples_ns": [ 411776324 ],
    "samples_ts": [ 19.428 ]
  }
]
"""


FAKE = """#!{python}
# a stand-in for llama.cpp's llama-bench: logs its arguments, prints as -o json does one test
# per -p and -n that is not 0 (prompt at 1000 tokens/s, generation at 50)
import json, os, sys
a = sys.argv[1:]
v = {{k: int(a[a.index(k) + 1]) for k in ("-p", "-n", "-d", "-t")}}
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(" ".join(a) + "\\n")
tests = [{{"build_commit": "fake123", "build_number": 42, "cpu_info": "fake cpu",
          "n_threads": v["-t"], "n_prompt": p, "n_gen": n, "n_depth": v["-d"],
          "avg_ns": int((p + n) / ts * 1e9), "avg_ts": ts, "samples_ts": [ts]}}
         for p, n, ts in ((v["-p"], 0, 1000.0), (0, v["-n"], 50.0)) if p + n]
print("log line", file=sys.stderr)
print(json.dumps(tests, indent=2))
"""


def test_parse_a_recorded_llama_bench_json():
    (t,) = parse_llama_bench(SAMPLE)
    assert (t["n_prompt"], t["n_gen"], t["n_depth"], t["avg_ts"]) == (0, 8, 64, 19.428023)
    assert (t["build_commit"], t["build_number"], t["n_threads"]) == ("0c1e570", 1, 2)
    assert llama_info(t)["model_type"] == "llama 256M Q4_1"
    with pytest.raises(ConfigError, match="no JSON list"):
        parse_llama_bench("error: failed to load model")


def tiny_gguf(path):
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-6)
    return write_gguf(path, transformers.LlamaForCausalLM(cfg).eval(),
                      gguf.GGMLQuantizationType.Q4_0)


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """A fake llama-bench first on PATH; the file its calls are logged to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "llama-bench"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return log


def test_both_peers_alternate_on_one_gguf(tmp_path, fake_llama, capsys):
    model = tiny_gguf(tmp_path / "tiny-Q4_0.gguf")
    out = tmp_path / "r.json"
    rc = main(["--checkpoint", str(model), "--context", "0", "48", "--repeats", "2",
               "--max-new-tokens", "3", "--warmup-steps", "1", "--budgets", "32",
               "--threads", "1", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    # per context, per repeat: llama.cpp's prefill (not at 0) and decode, then ours: one
    # prefill the methods share (not at 0), each method's decode
    order = [(r["context"], r["repeat"], r["engine"], r.get("test") or r["method"])
             for r in runs]
    per_rep = {0: [("llama.cpp", "decode"), ("ours", "full"), ("ours", "rocketkv")],
               48: [("llama.cpp", "prefill"), ("llama.cpp", "decode"), ("ours", "prefill"),
                    ("ours", "full"), ("ours", "rocketkv")]}
    assert order == [(c, rep, *x) for c in (0, 48) for rep in (1, 2) for x in per_rep[c]]
    assert [r["order"] for r in runs] == list(range(len(runs)))
    assert all("error" not in r and isinstance(r["load_average_1min"], float) for r in runs)
    # llama-bench: the warm-up, then one test a run with -r 1, the threads given
    calls = fake_llama.read_text().splitlines()
    assert len(calls) == 1 + 2 * 1 + 2 * 2
    assert "-p 16 -n 2" in calls[0] and all("-t 1 " in c and "-r 1" in c for c in calls)
    assert "-p 48 -n 0 -d 0" in calls[3] and calls[3].endswith("--no-warmup")
    assert "-p 0 -n 3 -d 48" in calls[4]
    llama = [r for r in runs if r["engine"] == "llama.cpp"]
    assert {r.get("decode_tok_s") for r in llama if r["test"] == "decode"} == {50.0}
    assert {r.get("prefill_tok_s") for r in llama if r["test"] == "prefill"} == {1000.0}
    pre = [r for r in runs if r["engine"] == "ours" and r["method"] == SHARED]
    assert len(pre) == 2 and all(r["prefill_tok_s"] > 0 and r["context"] == 48 for r in pre)
    ours = [r for r in runs if r["engine"] == "ours" and r["method"] != SHARED]
    assert all(r["decode_steps"] == 3 and r["decode_tok_s"] > 0 for r in ours)
    assert all(r["prefill_tok_s"] is None for r in ours)  # the shared row has it
    # at 48 each method's caches are built from the shared prefill, which it did not time
    assert all(r["prefill_shared"] == (r["build_s"] is not None) == (r["context"] == 48)
               for r in ours)
    # the summary: medians and spread, ratios of time per token against llama.cpp's medians
    s = {(x["context"], x["engine"], x["method"]): x for x in doc["summary"]}
    full = s[(48, "ours", "full")]
    assert full["decode_tok_s"]["n"] == 2
    assert full["decode_tok_s"]["min"] <= full["decode_tok_s"]["median"] \
        <= full["decode_tok_s"]["max"]
    assert full["ours_over_llama_time_decode"] == pytest.approx(
        50.0 / full["decode_tok_s"]["median"])
    shared = s[(48, "ours", SHARED)]
    assert shared["decode_tok_s"] is None and shared["prefill_tok_s"]["n"] == 2
    assert shared["ours_over_llama_time_prefill"] == pytest.approx(
        1000.0 / shared["prefill_tok_s"]["median"])
    assert full["ours_over_llama_time_prefill"] is None
    assert s[(0, "ours", "rocketkv")]["ours_over_llama_time_prefill"] is None
    prov = doc["provenance"]
    assert prov["llama_cpp"]["build_commit"] == "fake123" and prov["threads"] == 1
    assert prov["checkpoint"]["sha256"] and prov["checkpoint_bytes"] == model.stat().st_size
    assert "commit" in prov and "dirty" in prov and prov["torch"] and prov["cpu_model"]
    # the default weights: what generate.py loads without --gguf-weights on this CPU
    default = default_gguf_weights(None, str(model), "cpu")
    assert doc["settings"]["gguf_weights"] == [default]
    assert doc["settings"]["gguf_weights_default"] == default
    assert {(r["weights"], r["weights_default"], r["compile"]) for r in ours} == \
        {(default, True, False)}
    assert f"| 48 | ours rocketkv @32 [default: {default}] |" in printed.out
    assert "fake123" in printed.out
    assert (tmp_path / "r-decode.png").stat().st_size > 0


def test_several_weights_modes_are_measured_in_turn(tmp_path, fake_llama, capsys):
    """--gguf-weights A B: one model each, every method on each within every repeat, their
    own summary rows (and ratios against llama.cpp) and table labels."""
    model = tiny_gguf(tmp_path / "tiny-Q4_0.gguf")
    out = tmp_path / "w.json"
    assert main(["--checkpoint", str(model), "--context", "0", "--repeats", "1",
                 "--max-new-tokens", "2", "--warmup-steps", "1", "--budgets", "32",
                 "--threads", "1", "--gguf-weights", "quantized", "float", "--no-plots",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ours = [(r["weights"], r["method"]) for r in doc["runs"] if r["engine"] == "ours"]
    assert ours == [("quantized", "full"), ("quantized", "rocketkv"), ("float", "full"),
                    ("float", "rocketkv")]
    summary = [x for x in doc["summary"] if x["engine"] == "ours"]
    assert [(x["weights"], x["method"]) for x in summary] == ours
    assert all(x["ours_over_llama_time_decode"] for x in summary)
    assert doc["settings"]["gguf_weights"] == ["quantized", "float"]
    printed = capsys.readouterr().out
    assert "| 0 | ours full [float] |" in printed and "| 0 | ours full [quantized] |" in printed


def test_compile_both_measures_each_mode_eager_then_compiled(tmp_path, fake_llama, capsys):
    """--compile both: per weights mode, the shared prefill once, then every method eager and
    compiled, each its own summary row and label."""
    model = tiny_gguf(tmp_path / "tiny-Q4_0.gguf")
    out = tmp_path / "c.json"
    assert main(["--checkpoint", str(model), "--context", "40", "--repeats", "1",
                 "--max-new-tokens", "2", "--warmup-steps", "1", "--budgets", "32",
                 "--threads", "1", "--gguf-weights", "quantized", "--compile", "both",
                 "--no-plots", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ours = [(r["method"], r["compile"]) for r in doc["runs"] if r["engine"] == "ours"]
    assert ours == [(SHARED, False), ("full", False), ("rocketkv", False), ("full", True),
                    ("rocketkv", True)]
    runs = [r for r in doc["runs"] if r["engine"] == "ours" and r["method"] != SHARED]
    assert [r["compiled"] for r in runs] == [False, False, True, True]
    assert all(r["prefill_shared"] for r in runs)
    printed = capsys.readouterr().out
    assert "| 40 | ours full [quantized] compiled |" in printed
    assert "| 40 | ours full [quantized] |" in printed


def test_ours_alone_without_llama_bench_or_gguf(tmp_path, stories_dir, fake_llama, monkeypatch,
                                                capsys):
    """A non-GGUF checkpoint: ours run, llama.cpp's rows say why not (the fake is never
    called); with no llama-bench on PATH they say it is not found."""
    args = ["--checkpoint", str(stories_dir), "--context", "40", "--repeats", "1",
            "--max-new-tokens", "2", "--methods", "full", "--threads", "1", "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    (path,) = (tmp_path / "a" / "cpu").glob("bench_cpu-*.json")
    doc = json.loads(path.read_text())
    assert not fake_llama.exists()
    peer = [r for r in doc["runs"] if r["engine"] == "llama.cpp"]
    assert len(peer) == 1 and "reads GGUF files" in peer[0]["error"]
    (ours,) = [r for r in doc["runs"] if r["engine"] == "ours"]
    assert ours["method"] == "full"  # one method: no shared prefill, it times its own
    assert ours["prefill_tok_s"] > 0 and ours["prefill_shared"] is False
    assert doc["settings"]["gguf_weights"] is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert main([*args, "--json", str(tmp_path / "b.json")]) == 0
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["runs"][0]["error"] == f"skipped: {LLAMA_NOT_FOUND}"
    assert LLAMA_NOT_FOUND in format_table(summarize(doc["runs"]))
    capsys.readouterr()


def test_time_limit_keeps_the_json(tmp_path, stories_dir):
    out = tmp_path / "t.json"
    assert main(["--checkpoint", str(stories_dir), "--context", "0", "16", "--repeats", "2",
                 "--max-new-tokens", "2", "--methods", "full", "--threads", "1",
                 "--time-limit", "1e-9", "--no-plots", "--json", str(out)]) == 0
    ours = [r for r in json.loads(out.read_text())["runs"] if r["engine"] == "ours"]
    assert len(ours) == 4 and all(r["error"].startswith("skipped: --time-limit") for r in ours)


def test_contexts_are_capped_to_the_model():
    assert plan_contexts(None, 8192, 35) == (
        [0, 4096, 8157], ["note: context 16384 capped to 8157 (the model's 8192 tokens less "
                          "35 decode positions)"])
    assert plan_contexts([0, 512, 600], 512, 12)[0] == [0, 500]


def exit_status(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's usage errors
        return e.code


@pytest.mark.parametrize("extra, message", [
    (["--llama-bench", "/nonexistent/llama-bench"], "not an executable file"),
    (["--context", "-1"], "--context must not be negative"),
    (["--methods", "magic"], "magic"),
    (["--repeats", "0"], "--repeats must be positive"),
    (["--budgets", "0"], "--budgets must be positive"),
    (["--gguf-weights", "int3"], "invalid choice"),
])
def test_bad_input_is_one_error_line(tmp_path, extra, message, capsys):
    ckpt = tmp_path / "m.gguf"
    ckpt.write_bytes(b"")
    assert exit_status(["--checkpoint", str(ckpt), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_missing_checkpoint(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "none.gguf")]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint not found")


def test_the_build_script_names_a_missing_tool(tmp_path):
    """tools/build_llama_cpp.sh without cmake on PATH: one error line, exit status 2, nothing
    downloaded."""
    empty = tmp_path / "empty"
    empty.mkdir()
    p = subprocess.run(["/bin/bash", str(ROOT / "tools" / "build_llama_cpp.sh"),
                        str(tmp_path / "llama")], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(empty), "PYTHON": sys.executable})
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "error: cmake not found (building llama.cpp needs python with pip, cmake and a C++ "
        "compiler)"]
    assert not (tmp_path / "llama").exists()
