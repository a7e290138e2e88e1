"""scripts/bench.py: the CPU smoke sweep writes complete rows and the four charts."""

import json

import pytest
import torch
import transformers

from rocketkv.cli.common import device_fault, release_device
from rocketkv.engine.measure import float_weight_bytes
from rocketkv.evals import peers
from rocketkv.evals.peers import hf_model
from rocketkv.model import ModelArgs, rope_inv_freq
from scripts.bench import main

KEYS = ("device", "torch_version", "model", "dtype", "method", "budget", "context",
        "batch_size", "decode_ms_median", "decode_ms_p10", "decode_ms_p90", "tokens_per_s",
        "prefill_s", "peak_memory_bytes", "kv_cache_bytes", "kv_bytes_per_step",
        "weight_bytes", "bandwidth_gbps", "roofline_ms")


def test_cpu_sweep(tmp_path, capsys):
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "96", "160",
               "--budgets", "48", "96", "--max-new-tokens", "6", "--batch-sizes", "1", "2",
               "--methods", "full", "gptfast_dense", "rocketkv", "snapkv",
               "--out", str(tmp_path), "--compare-context", "160"])
    assert rc == 1  # the snapkv rows below its smallest budget failed; the rest are written
    printed = capsys.readouterr()
    assert "error: 4 of 24 configurations failed" in printed.err
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * (2 + 2 * 2)  # batch x context x (2 dense + 2 methods x 2 budgets)
    ok = [r for r in rows if "error" not in r]
    errors = [r for r in rows if "error" in r]
    assert errors and all("smallest valid budget" in r["error"] for r in errors)
    assert all(r["method"] == "snapkv" for r in errors)
    for r in ok:
        for key in KEYS:
            assert key in r, key
        assert r["roofline_ms"] == (r["weight_bytes_per_step"] + r["kv_bytes_per_step"]) / (
            r["bandwidth_gbps"] * 1e9) * 1e3
        assert r["device"] == "cpu" and r["decode_ms_p10"] <= r["decode_ms_median"]
    # the dense baseline holds a max_seq x max_seq mask; rocketkv stores less than full
    row = {(r["method"], r["budget"], r["context"], r["batch_size"]): r for r in ok}
    assert row[("gptfast_dense", None, 160, 1)]["kv_cache_bytes"] == \
        row[("full", None, 160, 1)]["kv_cache_bytes"] + 166 * 166
    assert row[("rocketkv", 48, 160, 1)]["kv_cache_bytes"] < \
        row[("full", None, 160, 1)]["kv_cache_bytes"]
    assert len(list((tmp_path / "cpu").glob("bench-*.png"))) == 4
    assert "measured copy bandwidth" in printed.out


def test_bad_arguments(capsys):
    assert main(["--device", "cpu", "--model", "stories260K", "--methods", "magic"]) == 2
    err = capsys.readouterr().err
    assert "unknown methods" in err
    assert "note: --model is deprecated; use --checkpoint" in err  # the old spelling works


def test_a_row_that_cannot_fit_is_refused_before_allocating(tmp_path, monkeypatch, capsys):
    """The memory pre-check: a row whose caches do not fit in the free memory (patched
    small) is an error row, not an allocator traceback; rows that fit run; exit 1."""
    # full: 2 x 5 layers x 4 KV heads x 8 dims x 4 B = 1280 B a token (+ one layer's prompt
    # K/V in prefill): 87 KiB at 64 + 4 tokens, 600 KiB at 400 + 4
    from rocketkv.engine import measure
    from rocketkv.evals import sweep as bench

    free = 300 * 2 ** 10
    monkeypatch.setattr(measure, "available_bytes", lambda device: free)
    # (the check before the load, float weights + the smallest row, would refuse the run)
    monkeypatch.setattr(bench, "check_memory", lambda *a: None)
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "64", "400",
               "--methods", "full", "--max-new-tokens", "4", "--out", str(tmp_path), "--no-plots",
               "--no-progress"])
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    rows = {r["context"]: r for r in json.loads(out.read_text())}
    assert rc == 1 and "error" not in rows[64]
    assert "needs about" in rows[400]["error"] and "GiB free" in rows[400]["error"]
    assert "1 of 2 configurations failed" in capsys.readouterr().err


def test_time_limit_skips_the_rest_and_saves(tmp_path, monkeypatch):
    """Skipped rows are saved; every row records the command and the commit (here named by
    ``ROCKETKV_COMMIT``, as for the GPU machine's copy of the tree, whose .git is stale)."""
    monkeypatch.setenv("ROCKETKV_COMMIT", "0123abc")
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "96",
                 "--methods", "full", "rocketkv", "--budgets", "48", "--max-new-tokens", "4",
                 "--time-limit", "0", "--out", str(tmp_path)]) == 0
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["error"].startswith("skipped") for r in rows)
    assert all(r["command"].startswith("python scripts/bench.py --device cpu") for r in rows)
    assert all(r["commit"] == "0123abc" and r["dirty"] is None for r in rows)


def test_weight_modes_in_one_run(tmp_path, capsys):
    """--weights float int8: every configuration once per mode, rows labelled, the int8 rows
    reading a quarter of the float32 linear weights per step, and chart (e) drawn."""
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "96",
               "--methods", "full", "rocketkv", "--budgets", "48", "--max-new-tokens", "4",
               "--weights", "float", "int8", "--out", str(tmp_path)])
    assert rc == 0
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    rows = json.loads(out.read_text())
    assert [(r["weights"], r["method"]) for r in rows] == [
        ("float", "full"), ("float", "rocketkv"), ("int8", "full"), ("int8", "rocketkv")]
    assert all("error" not in r for r in rows)
    assert rows[2]["weight_bytes_per_step"] < rows[0]["weight_bytes_per_step"] / 2
    assert len(list((tmp_path / "cpu").glob("bench-*e_weights.png"))) == 1
    assert "| int8 | 1 | 96 | rocketkv | 48 |" in capsys.readouterr().out
    assert main(["--device", "cpu", "--config", "stories260K", "--weights", "int4-g32"]) == 2
    assert "does not divide the input width 172" in capsys.readouterr().err
    assert main(["--device", "cpu", "--config", "stories260K", "--weights", "int5"]) == 2


def test_context_labels_and_threads(capsys):
    from scripts.bench import context_label

    assert [context_label(c) for c in (512, 1536, 16384, 32768, 131008, 131072)] == \
        ["512", "1.5K", "16K", "32K", "128K", "128K"]
    assert main(["--device", "cpu", "--config", "stories260K", "--threads", "0"]) == 2
    assert "--threads must be positive" in capsys.readouterr().err


def test_one_compile_regime_per_sweep(tmp_path, monkeypatch):
    """static: every row compiles its own graph (the compile cache is reset per row, though
    StreamingLLM's shapes do not change with the context: without the reset one graph would
    serve both); dynamic: every row asks for the symbolic-shape step (compiling it here would
    take a minute, so those rows run eagerly). A counting backend stands in for inductor."""
    from torch._dynamo.testing import CompileCounter

    from rocketkv.evals import sweep as bench

    counter = CompileCounter()
    real, asked = bench.generate, []

    def fake(*a, step, **kw):
        asked.append(step.compile_dynamic)
        if step.compile_dynamic:
            step = step.replace(compile=False)
        return real(*a, step=step.replace(backend=counter), **kw)

    monkeypatch.setattr(bench, "generate", fake)
    for regime, graphs in (("static", 2), ("dynamic", 0)):
        counter.clear()
        asked.clear()
        out = tmp_path / regime
        assert main(["--device", "cpu", "--config", "stories260K", "--context", "160", "256",
                     "--methods", "streamingllm", "--budgets", "32", "--max-new-tokens", "5",
                     "--compile", "--compile-regime", regime, "--out", str(out),
                     "--no-plots"]) == 0
        rows = json.loads(next((out / "cpu").glob("bench-*.json")).read_text())
        assert counter.frame_count == graphs
        assert asked == [True if regime == "dynamic" else None] * 2
        if regime == "static":
            assert [r["compile_regime"] for r in rows] == ["static"] * 2


def _row(method, budget, context, ms):
    return {"model": "m", "dtype": "bfloat16", "device": "gpu", "batch_size": 1,
            "method": method, "budget": budget, "context": context, "decode_ms_median": ms,
            "roofline_ms": ms / 2, "peak_memory_bytes": {"decode": ms, "total": ms}}


def test_charts_draw_a_line_only_for_series_at_several_contexts(tmp_path, monkeypatch):
    """A sweep joined with an every-method row at one context: charts (a)-(c) leave out the
    one-point series (chart (d) holds them); a one-context run keeps every series."""
    from rocketkv.evals import sweep as bench

    legends = {}

    def save(fig, prefix, name):
        legends[name] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        import matplotlib.pyplot as plt
        plt.close(fig)
        return tmp_path / name

    monkeypatch.setattr(bench, "_save", save)
    rows = [_row("full", None, 16, 4.0), _row("full", None, 32, 6.0),
            _row("rocketkv", 8, 16, 2.0), _row("rocketkv", 8, 32, 2.5),
            _row("snapkv", 8, 32, 1.5)]
    bench.plot(rows, tmp_path / "b", 32)
    assert legends["a_speedup"] == ["rocketkv t=8 vs full"]
    assert not any("snapkv" in label for label in legends["b_memory"] + legends["c_latency"])
    assert "rocketkv t=8" in legends["c_latency"] and "full" in legends["c_latency"]
    bench.plot([r for r in rows if r["context"] == 32], tmp_path / "b", 32)
    assert legends["a_speedup"] == ["rocketkv t=8 vs full", "snapkv t=8 vs full"]


def test_transformers_peer_rows_beside_ours(tmp_path):
    """``--methods transformers``: Hugging Face transformers at the model's shape with its
    static cache, in the same run, with the fields of our rows and its version; its static
    cache holds context + new tokens for every layer. The peer's rows come after all of
    ours, whatever the order asked (our weights are freed for them)."""
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "64", "48",
               "--methods", "transformers", "full", "--max-new-tokens", "6", "--out", str(tmp_path),
               "--no-plots", "--no-progress"])
    assert rc == 0
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    every = json.loads(out.read_text())
    assert [(r["method"], r["context"]) for r in every] == [
        ("full", 64), ("full", 48), ("transformers", 64), ("transformers", 48)]
    assert all("error" not in r for r in every)
    rows = {r["method"]: r for r in every if r["context"] == 64}
    peer, ours = rows["transformers"], rows["full"]
    for key in KEYS:
        assert key in peer, key
    assert peer["transformers_version"] == transformers.__version__
    assert peer["decode_steps"] == 5 and peer["decode_ms_median"] > 0  # 6 tokens: 5 steps
    assert peer["kv_cache_bytes"] == 2 * 5 * 4 * (64 + 6) * 8 * 4  # layers, heads, slots, D, fp32
    assert peer["weight_bytes"] == ours["weight_bytes"]  # the same shape
    assert peer["compiled"] is False  # CPU: generate compiles on CUDA only


def test_transformers_peer_config_matches_our_shapes():
    """The peer's config gives transformers models of exactly our parameter count, Llama 3.1's
    scaled RoPE frequencies and Qwen2's q/k/v biases."""
    small = dict(n_layers=1, vocab_size=300, dim=256, n_heads=4, n_kv_heads=2,
                 intermediate_size=320, name="small")
    for name in ("llama-3.1-8b", "qwen2.5-0.5b", "longchat-7b-v1.5-32k"):
        args = ModelArgs(**{**ModelArgs.from_name(name).to_dict(), **small})
        hf = hf_model(args, torch.device("cpu"), torch.float32)
        n = sum(p.numel() for p in hf.parameters())
        assert n * 4 == float_weight_bytes(args, torch.float32), name
        inv = hf.model.rotary_emb.inv_freq.float()
        assert torch.allclose(inv, rope_inv_freq(args).float(), rtol=1e-6), name
        assert (type(hf).__name__ == "Qwen2ForCausalLM") == args.qkv_bias


def test_the_peer_prefills_long_prompts_in_equal_chunks(monkeypatch):
    """Past ``CHUNK_FROM`` tokens transformers prefills in chunks (the largest divisor of the
    prompt up to ``PREFILL_CHUNK``, so every chunk has one compiled shape): its forward sees
    the chunks, and the row records the size; shorter prompts prefill in one forward."""
    assert [peers.prefill_chunk(c) for c in (32768, 65536, 98304, 131008)] == \
        [None, 8192, 8192, 8188]  # 131008 = 16 x 8188
    assert peers.prefill_chunk(40009) == 8192  # a prime: no divisor near the chunk size
    monkeypatch.setattr(peers, "CHUNK_FROM", 32)
    monkeypatch.setattr(peers, "PREFILL_CHUNK", 16)
    build, lengths = peers.hf_model, []

    def counted(*a, **kw):
        model = build(*a, **kw)
        model.model.register_forward_pre_hook(
            lambda _, args, kwargs: lengths.append((kwargs.get("input_ids") if kwargs.get(
                "input_ids") is not None else args[0]).shape[1]), with_kwargs=True)
        return model

    monkeypatch.setattr(peers, "hf_model", counted)
    args = ModelArgs.from_name("stories260K")
    for context, chunks in ((64, [16] * 4), (24, [24])):
        lengths.clear()
        row = peers.run_transformers(args, 1, context, 4, device=torch.device("cpu"),
                                     dtype=torch.float32, compile=False)
        assert lengths[:len(chunks)] == chunks and set(lengths[len(chunks):]) == {1}
        assert row["method_params"]["prefill_chunk_size"] == (16 if context > 32 else None)
        assert row["method_params"]["prefill_compiled"] is False  # compile=False
        assert row["decode_steps"] == 3


def test_a_row_that_fails_is_its_error_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """An unexpected exception in a row (ours, or inside transformers) ends that row as its
    type and first line, with the traceback on stderr for the log; the other rows run and the
    exit status says a row failed."""
    from rocketkv.evals import sweep as bench

    def broken(*a, **kw):
        raise RuntimeError("Dynamo failed to run FX node\nmore text")

    monkeypatch.setattr(bench, "run_transformers", broken)
    one = bench.run_one

    def ours(model, batch, context, method, *a, **kw):
        if method == "snapkv":
            raise IndexError("index 7 is out of bounds")
        return one(model, batch, context, method, *a, **kw)

    monkeypatch.setattr(bench, "run_one", ours)
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "64",
                 "--methods", "snapkv", "full", "transformers", "--budgets", "70",
                 "--max-new-tokens", "6", "--out", str(tmp_path), "--no-plots",
                 "--no-progress"]) == 1
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert "error" not in rows["full"]
    assert rows["snapkv"]["error"] == "IndexError: index 7 is out of bounds"
    assert rows["transformers"]["error"] == "RuntimeError: Dynamo failed to run FX node"
    err = capsys.readouterr().err
    assert "Traceback" in err and "more text" in err and "2 of 3 configurations failed" in err


def test_a_cuda_error_ends_the_sweep_with_the_rows_saved(tmp_path, monkeypatch, capsys):
    """A sticky CUDA error (an illegal address: every later CUDA call raises again, the
    allocator's ``empty_cache`` included) in the 2nd of 3 rows: the 1st row stays in the JSON
    as measured, the 2nd records the error, the 3rd is listed as not run, and the run ends with
    exit status 1 and one stderr line naming the failing row (no traceback, no second line)."""
    from rocketkv.evals import sweep as bench

    one, calls = bench.run_one, []

    def faulty(model, batch, context, *a, **kw):
        calls.append(context)
        if len(calls) == 2:
            def broken():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            monkeypatch.setattr(torch.cuda, "empty_cache", broken)
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: broken())
            broken()
        return one(model, batch, context, *a, **kw)

    monkeypatch.setattr(bench, "run_one", faulty)
    rc = main(["--device", "cpu", "--config", "stories260K", "--context", "48", "64", "80",
               "--methods", "full", "--max-new-tokens", "4", "--out", str(tmp_path), "--no-plots",
               "--no-progress"])
    assert rc == 1 and calls == [48, 64]  # the sweep stopped at the fault
    (out,) = list((tmp_path / "cpu").glob("bench-*.json"))
    rows = json.loads(out.read_text())
    assert [r["context"] for r in rows] == [48, 64, 80]
    assert "error" not in rows[0] and rows[0]["decode_ms_median"] > 0
    assert rows[1]["error"] == "RuntimeError: CUDA error: an illegal memory access was " \
        "encountered"
    assert rows[2]["error"].startswith("skipped:") and "full at 64 tokens" in rows[2]["error"]
    err = [x for x in capsys.readouterr().err.strip().splitlines()
           if not x.startswith("warning: ")]  # (a loaded machine's step-spread warning)
    assert len(err) == 1 and err[0].startswith("error: ") and "full at 64 tokens" in err[0]
    assert "illegal memory access" in err[0] and str(out) in err[0]


def test_the_error_handler_cannot_raise(monkeypatch):
    """``release_device`` after a failed row on CUDA: a device whose every call raises (a
    sticky error) gives the exception back instead of raising it; ``device_fault`` tells a
    CUDA error from an out-of-memory one and from an ordinary failure."""

    def broken(*_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    monkeypatch.setattr(torch.cuda, "empty_cache", broken)
    e = release_device(torch.device("cuda"))
    assert isinstance(e, RuntimeError) and device_fault(e)
    assert release_device(torch.device("cpu")) is None
    assert device_fault(torch.AcceleratorError("CUDA error: misaligned address"))
    assert device_fault(RuntimeError("Triton Error [CUDA]: an illegal memory access"))
    assert not device_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not device_fault(RuntimeError("Dynamo failed to run FX node"))


def test_a_model_that_cannot_fit_is_refused_before_loading(monkeypatch, capsys):
    """Bare ``bench.py`` on a CPU (llama-3.1-8b's random float32 weights: 32 GB): one
    ``error:`` line naming what it needs and what is free, exit 2, and nothing loaded."""
    from rocketkv.engine import measure
    from rocketkv.evals import sweep as bench

    def loaded(*_):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(measure, "available_bytes", lambda device: 16 * 2 ** 30)
    monkeypatch.setattr(bench, "load_weights", loaded)
    assert main(["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # 8.03e9 parameters x 4 bytes; 32 layers x 2 x 8 KV heads x 128 x 4 B x (16384 + 64)
    assert len(err) == 1 and err[0].startswith("error: this run needs at least 33.9 GiB")
    assert "float32 weights 29.9 GiB + KV cache 4.0 GiB" in err[0]
    assert "cpu has 16.0 GiB free" in err[0]


def test_results_go_to_the_current_directory_by_default(tmp_path, monkeypatch):
    """No ``--out``: the JSON lands under the current directory (``./<device>/``), not the
    repository's ``results/``; an ``--out`` that is a file is refused before the load."""
    monkeypatch.chdir(tmp_path)
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "64",
                 "--methods", "full", "--time-limit", "0", "--no-progress"]) == 0
    assert len(list((tmp_path / "cpu").glob("bench-*.json"))) == 1
    assert not (tmp_path / "results").exists()
    (tmp_path / "f").write_text("")
    assert main(["--device", "cpu", "--config", "stories260K", "--out", "f"]) == 2


def test_noisy_rows_get_the_warning_of_generate(tmp_path, monkeypatch, capsys):
    """A row whose decode steps vary 50x (p90/p10) gets the warning ``generate.py``'s report
    gives a run as noisy, in its words, naming the row; a steady row gets none."""
    from rocketkv.engine.generate import format_report
    from rocketkv.evals import sweep as bench

    one, real, results = bench.run_one, bench.generate, []

    def noisy(model, batch, context, *a, **kw):
        row = one(model, batch, context, *a, **kw)
        return {**row, "decode_ms_p10": 1.0, "decode_ms_p90": 50.0 if context == 64 else 1.5}

    monkeypatch.setattr(bench, "run_one", noisy)
    monkeypatch.setattr(bench, "generate", lambda *a, **kw: results.append(real(*a, **kw))
                        or results[-1])
    assert main(["--device", "cpu", "--config", "stories260K", "--context", "48", "64",
                 "--methods", "full", "--max-new-tokens", "3", "--out", str(tmp_path), "--no-plots",
                 "--no-progress"]) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    report = format_report(dict(results[-1], decode_ms_p10=1.0, decode_ms_p90=50.0))
    (line,) = [x for x in report.splitlines() if x.startswith("warning:")]
    assert err == [line.replace("warning: ", "warning: full at 64 tokens, batch 1: ")]


def test_an_out_the_filesystem_refuses_is_one_line_before_loading(monkeypatch, capsys):
    """``--out /proc/x``: /proc passes os.access for root but takes no directory; one error
    line and exit 2 before anything loads (a traceback after the load before)."""
    import pathlib

    import pytest

    from rocketkv.evals import sweep as bench

    if not pathlib.Path("/proc/self").is_dir():
        pytest.skip("needs Linux's /proc")

    def loaded(*_):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(bench, "load_weights", loaded)
    assert main(["--device", "cpu", "--config", "stories260K", "--out", "/proc/rocketkv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out /proc/rocketkv: cannot create")


def test_a_gguf_loads_as_generate_loads_it(monkeypatch):
    """bench.py measures a GGUF file as ``generate.py`` runs it: on the CPU its blocks kept
    quantized as the default says (``checkpoint.default_gguf_weights``), where it measured the
    dequantized float weights; ``--weights int8`` quantizes the dequantized ones."""
    from conftest import SMOLLM2_GGUF, shared_file

    from rocketkv.evals import sweep as bench_script

    seen = []

    def record(ckpt, device, dtype, shard=(0, 1), gguf_weights="float"):
        seen.append(gguf_weights)
        raise KeyboardInterrupt  # no weights read

    monkeypatch.setattr(bench_script, "load_model", record)
    gguf = str(shared_file(SMOLLM2_GGUF))
    for spec in ("float", "int8"):
        with pytest.raises(KeyboardInterrupt):
            bench_script.load_weights(gguf, spec, torch.device("cpu"), torch.float32)
    from rocketkv.formats.checkpoint import default_gguf_weights

    assert seen == [default_gguf_weights(None, gguf, "cpu"), "float"]
