"""generate.py on the real stories260K checkpoint and on tiny random models."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, SHARED, sigint_default

from rocketkv.cli import generate as generate_cli
from rocketkv.compression import build_caches
from rocketkv.engine import checks as run_steps
from rocketkv.engine.generate import CacheRequest, Sampling, StepConfig, generate, sample
from rocketkv.engine.measure import percentile
from rocketkv.engine.report import GenerateResult
from rocketkv.formats.checkpoint import random_model
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError, ModelArgs

# llama2.c doc/stories260K.md: greedy decoding from BOS with the full cache begins with this
PUBLISHED = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
             "in the park. One day, she saw a big, red ball. She wanted to play with it, but it "
             "was too high.")


def test_stories260K_greedy_reproduces_published_output_from_bos(stories_model, stories_dir):
    tok = load_tokenizer(stories_dir)
    r = generate(stories_model, [tok.bos_id], max_new_tokens=255, stop_ids=tok.stop_ids)
    assert tok.decode(r["token_ids"][0]).startswith(PUBLISHED)


def test_stories260K_greedy_continues_once_upon_a_time(stories_model, stories_dir):
    tok = load_tokenizer(stories_dir)
    prompt = tok.encode("Once upon a time")
    assert prompt == [1, 403, 407, 261, 378]
    r = generate(stories_model, prompt, max_new_tokens=60, stop_ids=tok.stop_ids)
    text = tok.decode(r["token_ids"][0])
    assert text.startswith(PUBLISHED[len("Once upon a time"):])
    assert r["new_tokens"] == 60 and r["decode_steps"] == 59


def test_cached_decode_equals_recomputing_the_sequence(stories_model):
    model = stories_model
    prompt = torch.tensor([[1, 403, 407, 261, 378]])
    r = generate(model, prompt, max_new_tokens=40)
    seq = prompt[0].tolist() + r["token_ids"][0]
    # without a cache's history: prefill the whole prefix afresh for every position
    for t in range(prompt.shape[1], len(seq)):
        model.setup_caches(build_caches("full", model.args, batch_size=1, prompt_len=t,
                                        max_new_tokens=1, budget=None, dtype=torch.float32,
                                        device="cpu"), t + 1)
        logits = model.prefill(torch.tensor([seq[:t]]))
        assert int(logits.argmax()) == seq[t], f"position {t}"
    # and the logits themselves: step-by-step decode vs one prefill of the whole sequence
    model.setup_caches(build_caches("full", model.args, batch_size=1, prompt_len=5,
                                    max_new_tokens=len(seq), budget=None,
                                    dtype=torch.float32, device="cpu"), len(seq) + 5)
    with torch.no_grad():
        model.prefill(prompt)
        for t in range(5, len(seq) - 1):
            step = model(torch.tensor([[seq[t]]]), torch.tensor([t]))
        full = build_caches("full", model.args, batch_size=1, prompt_len=len(seq) - 1,
                            max_new_tokens=1, budget=None, dtype=torch.float32, device="cpu")
        model.setup_caches(full, len(seq))
        ref = model.prefill(torch.tensor([seq[:-1]]))
    assert (step - ref).abs().max() < 1e-4


def test_generate_can_be_called_repeatedly(stories_model):
    a = generate(stories_model, [1, 403, 407], max_new_tokens=20)
    b = generate(stories_model, [1, 403, 407, 261, 378, 13], max_new_tokens=10)
    c = generate(stories_model, [1, 403, 407], max_new_tokens=20)
    assert a["token_ids"] == c["token_ids"] and len(b["token_ids"][0]) == 10


def test_decode_step_compiles_once_without_graph_breaks(stories_model):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    eager = generate(stories_model, [1, 403, 407, 261], max_new_tokens=24)
    prefills = []
    real_prefill = stories_model.prefill
    stories_model.prefill = lambda tokens, **kw: prefills.append(1) or real_prefill(tokens, **kw)
    try:
        for _ in range(2):
            r = generate(stories_model, [1, 403, 407, 261], max_new_tokens=24,
                         step=StepConfig(compile=True, backend=counter))
            assert r["token_ids"] == eager["token_ids"]
    finally:
        del stories_model.prefill
    assert counter.frame_count == 1  # fullgraph=True would raise on a graph break
    assert len(prefills) == 2  # one prefill per run: the warm-up is the first decode steps
    # 23 decode steps: 3 warm-up steps (compile_s), 20 measured
    assert r["compiled"] and r["compile_s"] is not None and r["warmup_steps"] == 3
    assert r["decode_steps"] == len(r["decode_ms"]) == 20 and r["new_tokens"] == 24


def test_batch_rows_decode_like_single_sequences(stories_model):
    prompts = torch.tensor([[1, 403, 407, 261, 378], [1, 403, 407, 261, 300]])
    both = generate(stories_model, prompts, max_new_tokens=15)
    for row, p in zip(both["token_ids"], prompts):
        assert generate(stories_model, p, max_new_tokens=15)["token_ids"][0] == row


def test_sampling_is_seeded(stories_model):
    def draw(seed):
        return generate(stories_model, [1, 403], max_new_tokens=30,
                        sampling=Sampling(1.0, top_k=50, top_p=0.9, seed=seed))
    a, b, c = draw(3), draw(3), draw(4)
    assert a["token_ids"] == b["token_ids"] != c["token_ids"]


def test_sample_respects_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    drawn = sample(logits, temperature=1.0, top_k=2)
    assert set(drawn.flatten().tolist()) == {0, 1}
    p = torch.softmax(logits[0], 0)  # 0.636, 0.234, ...: top-p 0.7 keeps tokens 0 and 1
    assert p[0] < 0.7 < p[0] + p[1]
    assert set(sample(logits, temperature=1.0, top_p=0.7).flatten().tolist()) == {0, 1}
    assert set(sample(logits, temperature=1.0, top_p=0.5).flatten().tolist()) == {0}
    assert sample(logits[:1], temperature=0.0).item() == 0


def test_stops_at_eos_and_at_context_end(stories_model):
    r = generate(stories_model, [1, 403], max_new_tokens=400, stop_ids=[13])  # 13 = newline
    assert r["stop_reason"] == "eos" and r["token_ids"][0][-1] == 13
    assert 13 not in r["token_ids"][0][:-1]
    r = generate(stories_model, [1] * 500, max_new_tokens=50)
    assert r["stop_reason"] == "context_length" and r["new_tokens"] == 12  # 512-token context


def test_stop_checks_every_n_steps_equal_checking_every_step(stories_model):
    """Reading the stop flag every 4 steps returns what checking every step returns (tokens,
    stop reason, the conversation's position); batch rows stopping at different steps."""
    prompts = torch.tensor([[1, 403, 407], [1, 403, 300]])
    for stop in ([426], [432, 291]):
        each = generate(stories_model, prompts, max_new_tokens=60, stop_ids=stop)
        assert each["stop_reason"] == "eos"
        for every in (4, 7):
            r = generate(stories_model, prompts, max_new_tokens=60, stop_ids=stop,
                         step=StepConfig(stop_check_every=every))
            assert r["token_ids"] == each["token_ids"]
            assert r["stop_reason"] == each["stop_reason"]
            assert r["conversation"] == each["conversation"]
    with pytest.raises(ConfigError, match="stop_check_every"):
        generate(stories_model, [1, 403], step=StepConfig(stop_check_every=0))


def test_decoding_reads_nothing_back_without_stop_tokens(stories_model):
    """No host sync per decode step unless stop tokens exist: the device-to-host reads
    (``_local_scalar_dense``: ``bool()``, ``int()``, ``.item()``) of a run do not grow with
    its length; with a stop token they grow by one per step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    def reads(steps, **kw):
        Reads.n = 0
        with Reads():
            generate(stories_model, [1, 403, 407], max_new_tokens=steps, **kw)
        return Reads.n

    assert reads(4) == reads(14)
    assert reads(14, stop_ids=[9999 % 512]) - reads(4, stop_ids=[9999 % 512]) == 10


def test_generate_rejects_bad_prompts(stories_model):
    with pytest.raises(ConfigError, match="empty"):
        generate(stories_model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ConfigError, match="context"):
        generate(stories_model, [1] * 512)
    with pytest.raises(ConfigError, match="token ids"):
        generate(stories_model, [1, 9999])


def test_figures_are_consistent(stories_model):
    r = generate(stories_model, [1, 403, 407], max_new_tokens=12)
    assert len(r["decode_ms"]) == r["decode_steps"] == 11
    assert r["tokens_per_s"] == pytest.approx(11 / (sum(r["decode_ms"]) / 1e3))
    assert r["decode_ms_p10"] <= r["decode_ms_median"] <= r["decode_ms_p90"]
    args = stories_model.args
    max_seq = 3 + 12
    assert r["kv_cache_bytes"] == 2 * args.n_layers * args.n_kv_heads * max_seq * args.head_dim * 4
    assert r["weight_bytes"] == sum(p.numel() * 4 for p in stories_model.parameters())
    assert r["bandwidth_gbps"] == pytest.approx(
        (r["weight_bytes_per_step"] + r["kv_bytes_per_step"]) / r["decode_ms_median"] / 1e6)


def test_percentile():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([5.0], 90) == 5.0 and percentile([], 50) is None


def test_random_model_at_a_named_shape():
    args = ModelArgs.from_name("stories260K")
    m = random_model(args, "cpu", torch.bfloat16)
    assert m.output.weight is m.tok_embeddings.weight
    r = generate(m, torch.randint(0, 512, (2, 33)), max_new_tokens=5)
    assert r["dtype"] == "bfloat16" and len(r["token_ids"]) == 2


# ---- the CLI ---------------------------------------------------------------------------------

def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, input=stdin, timeout=300)


def test_cli_end_to_end_json(stories_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time\n")
    out = tmp_path / "run.json"
    p = run_cli("--checkpoint", stories_dir, "--prompt", prompt, "--max-new-tokens", 40,
                "--json", out)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(PUBLISHED[len("Once upon a time"):][:60])
    r = json.loads(out.read_text())
    assert p.stdout == r["text"][0] + "\n"  # stdout carries the text alone; the report: stderr
    assert "prompt tokens 5  generated 40" in p.stderr and r["load_s"] > 0
    assert {"commit", "dirty", "torch", "command"} <= set(r["provenance"])  # the code behind it
    for key in ("method", "budget", "method_params", "prompt_token_ids", "token_ids", "text",
                "prefill_s", "decode_ms", "decode_ms_median", "tokens_per_s",
                "peak_memory_bytes", "kv_cache_bytes", "kv_bytes_per_step", "weight_bytes",
                "device", "dtype", "torch_version", "compiled", "bandwidth_gbps"):
        assert key in r, key
    assert r["method"] == "full" and r["device"] == "cpu" and r["compiled"] is False
    assert r["prompt_token_ids"] == [[1, 403, 407, 261, 378]]
    assert len(r["token_ids"][0]) == 40 and len(r["decode_ms"]) == 39
    assert r["text"][0].startswith(", there was a little girl named Lily.")
    assert set(r["peak_memory_bytes"]) == {"prefill", "decode", "total"}
    assert r["peak_memory_bytes"]["total"] >= max(r["peak_memory_bytes"]["prefill"],
                                                  r["peak_memory_bytes"]["decode"]) > 0
    assert r["kv_bytes_per_step"] == r["kv_cache_bytes"] > 0
    # the record: generate's result (its fields in order), then the keys the API's Result
    # adds (the CLI runs on rocketkv.Engine), then the provenance
    names = [f.name for f in dataclasses.fields(GenerateResult)]
    assert list(r) == names + ["text", "checkpoint", "model", "load_s", "world_size",
                               "interrupted", "provenance"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_closed_stdout_ends_quietly_with_the_json_written(stories_dir, tmp_path, stream):
    """`generate.py ... | head -c 10`: the reader is gone before the text is written (the
    pipe's read end is closed at once). Exit 0, no BrokenPipeError traceback, the report on
    stderr and the --json file written (it used to end in a 21-line traceback, JSON lost)."""
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "generate.py"), "--checkpoint", str(stories_dir),
         "--prompt-text", "Once upon a time", "--max-new-tokens", "12", "--json", str(out),
         *([] if stream else ["--no-stream"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert "prompt tokens 5  generated 12" in err
    assert json.loads(out.read_text())["new_tokens"] == 12


def test_prefill_progress_on_a_log_file_is_plain_lines(capsys, monkeypatch):
    """stderr not a terminal (a log file): prefill progress is plain lines, at most one per
    interval, never tqdm's carriage returns; none for a short prompt or --no-progress."""
    from rocketkv.engine import report as g

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert g.prefill_bar(4, g.PROGRESS_TOKENS - 1, False) is None
    assert g.prefill_bar(4, 9000, True) is None
    bar = g.prefill_bar(4, 9000, False)
    bar.every = 0.0
    for _ in range(4):
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [f"prefill 9000 tokens: layer {i}/4, 0 s" for i in (1, 2, 3)]
    slow = g.prefill_bar(4, 9000, False)  # the default interval: nothing within a second
    slow.update()
    assert capsys.readouterr().err == ""


def test_cli_prints_the_load_line_when_the_load_ends_and_notes_ignored_sampling_flags(
        stories_dir):
    p = run_cli("--checkpoint", stories_dir, "--prompt-text", "Once upon a time",
                "--max-new-tokens", 3, "--top-k", 5)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    loads = [i for i, ln in enumerate(lines) if ln.startswith("load (weights and tokenizer)")]
    assert len(loads) == 1 and loads[0] < lines.index(next(ln for ln in lines
                                                           if ln.startswith("method full")))
    assert sum(ln.startswith("note: --top-k and --top-p") for ln in lines) == 1
    p = run_cli("--checkpoint", stories_dir, "--prompt-text", "Once upon a time",
                "--max-new-tokens", 3, "--top-k", 5, "--temperature", 0.7)
    assert p.returncode == 0 and "note: --top-k" not in p.stderr


def test_cli_stdin_chat_batch_and_random_prompt(stories_dir):
    p = run_cli("--checkpoint", stories_dir, "--prompt", "-", "--chat", "--batch-size", 2,
                "--max-new-tokens", 5, stdin="Tell me a story")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()  # every sequence of the batch, each under its header
    assert lines[0] == "==> sequence 0 <==" and "==> sequence 1 <==" in lines
    first, second = p.stdout.split("==> sequence 1 <==\n")
    assert first.removeprefix("==> sequence 0 <==\n") == second  # the same prompt, greedy
    p = run_cli("--checkpoint", "random:stories260K", "--random-prompt", 64,
                "--max-new-tokens", 4, "--temperature", 0.8, "--top-k", 20)
    assert p.returncode == 0, p.stderr
    assert "prompt tokens 64" in p.stderr


def test_cli_rocketkv_json_has_every_derived_parameter(stories_dir, tmp_path):
    prompt = tmp_path / "story.txt"
    prompt.write_text((SHARED / "text" / "tinystories_sample_cs336.txt").read_text()[:900])
    out = tmp_path / "rocket.json"
    p = run_cli("--checkpoint", stories_dir, "--prompt", prompt, "--method", "rocketkv",
                "--budget", 64, "--rocket-split", "adaptive", "--max-new-tokens", 8,
                "--json", out)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    params = r["method_params"]
    for key in ("split", "alpha", "c1", "c2", "keep", "kernel_size", "window", "page_size", "r",
                "k", "capacity", "prompt_tokens_kept"):
        assert key in params, key
    assert params["split"] == "adaptive" and r["budget"] == 64
    assert r["kv_cache_bytes"] < 2 * 5 * 4 * (r["prompt_tokens"] + 8) * 8 * 4  # < full cache
    assert "rocketkv" in p.stderr and "c2" in p.stderr


@pytest.fixture(scope="module")
def bad_inputs(stories_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_text("  \n")
    (d / "ok.txt").write_text("Once upon a time")
    (d / "long.txt").write_text("Once upon a time " * 300)
    (d / "no_weights").mkdir()
    (d / "no_weights" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 512}))
    (d / "gpt2").mkdir()
    (d / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                        "architectures": ["GPT2LMHeadModel"]}))
    (d / "corrupt").mkdir()
    (d / "corrupt" / "config.json").write_text("{not json")
    (d / "broken_tokenizer.json").write_text('{"version": "1.0", "model": ')
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"[UNK]": 0, "Once": 1, "upon": 2, "a": 3, "time": 4},
                                       unk_token="[UNK]"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(d / "no_template.json"))  # a tokenizer.json without a chat template
    (d / "truncated").mkdir()
    for f in stories_dir.iterdir():
        (d / "truncated" / f.name).write_bytes(f.read_bytes()[:100] if f.suffix ==
                                               ".safetensors" else f.read_bytes())
    return d


BAD = [
    ("missing checkpoint", ["--checkpoint", "{d}/nope", "--prompt", "{d}/ok.txt"],
     "checkpoint not found"),
    ("unreadable config", ["--checkpoint", "{d}/corrupt", "--prompt", "{d}/ok.txt"],
     "cannot read"),
    ("unreadable weights", ["--checkpoint", "{d}/truncated", "--prompt", "{d}/ok.txt"],
     "cannot read weights"),
    ("config without weights", ["--checkpoint", "{d}/no_weights", "--random-prompt", "8"],
     "config without weights"),
    ("unsupported architecture", ["--checkpoint", "{d}/gpt2", "--random-prompt", "8"],
     "unsupported architecture"),
    ("empty prompt", ["--checkpoint", "{s}", "--prompt", "{d}/empty.txt"], "is empty"),
    ("missing prompt file", ["--checkpoint", "{s}", "--prompt", "{d}/none.txt"],
     "cannot read prompt"),
    ("prompt too long", ["--checkpoint", "{s}", "--prompt", "{d}/long.txt"], "context"),
    ("budget <= 0", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--budget", "0"],
     "--budget must be a positive"),
    ("unknown method", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--method", "magic"],
     "invalid choice"),
    ("budget below a method's minimum", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt",
                                         "--method", "snapkv", "--budget", "20",
                                         "--max-new-tokens", "32"], "smallest valid budget"),
    ("cuda without cuda", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--device",
                           "cuda"], "CUDA is not available"),
    ("unknown named config", ["--checkpoint", "random:llama-9", "--random-prompt", "8"],
     "unknown model config"),
    ("tokenizer.json that does not parse", ["--checkpoint", "{s}", "--tokenizer",
                                            "{d}/broken_tokenizer.json", "--prompt",
                                            "{d}/ok.txt"], "cannot parse"),
    ("--chat without a template", ["--checkpoint", "{s}", "--tokenizer", "{d}/no_template.json",
                                   "--prompt", "{d}/ok.txt", "--chat"], "no chat template"),
    ("--system without --chat", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--system",
                                 "be brief"], "--system needs --chat"),
    ("json into a missing directory", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt",
                                       "--json", "{d}/no/dir/out.json"], "does not exist"),
    ("json onto a directory", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--json",
                               "{d}"], "is a directory"),
    ("temperature nan", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--temperature",
                         "nan"], "finite number"),
    ("temperature inf", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--temperature",
                         "inf"], "finite number"),
    ("page size 0", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--method", "quest",
                     "--budget", "64", "--page-size", "0"], "--page-size must be positive"),
    ("another method's option", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--method",
                                 "quest", "--budget", "64", "--rocket-split", "sqrt"],
     "--rocket-split does not apply to method quest"),
    ("budget with full", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--budget", "64"],
     "takes no --budget"),
    ("empty prompt text", ["--checkpoint", "{s}", "-p", "  "], "--prompt-text is empty"),
    ("prompt text and file", ["--checkpoint", "{s}", "-p", "hi", "--prompt", "{d}/ok.txt"],
     "not allowed with"),
    ("chat on random ids", ["--checkpoint", "{s}", "--random-prompt", "8", "--chat"],
     "--chat needs a text"),
    ("cuda graphs on cpu", ["--checkpoint", "{s}", "--prompt", "{d}/ok.txt", "--device", "cpu",
                            "--cuda-graphs"], "--cuda-graphs needs a CUDA device"),
]

# the errors that need the prompt's length but no weights: reported before the weights load
BEFORE_LOADING = ("budget below a method's minimum", "page size 0", "another method's option",
                  "budget with full", "prompt too long", "empty prompt text",
                  "cuda graphs on cpu")


# run as a real process (exit status, and everything on stderr, warnings included); the
# others call main() in the test's process (the same code path, without a torch import each)
IN_A_PROCESS = ("unknown method", "prompt too long", "budget below a method's minimum",
                "unreadable weights")


@pytest.mark.parametrize("case,argv,message", BAD, ids=[b[0] for b in BAD])
def test_cli_bad_input_one_clear_line(bad_inputs, stories_dir, case, argv, message, capsys):

    if case == "cuda without cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = [a.format(d=bad_inputs, s=stories_dir) for a in argv]
    if case in IN_A_PROCESS:
        p = run_cli(*argv)
        rc, err = p.returncode, p.stderr
    else:
        try:
            rc = generate_cli.main(argv)
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        err = capsys.readouterr().err
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0]
    assert "Traceback" not in err
    assert not list(bad_inputs.glob("**/*.json.tmp"))


@pytest.mark.parametrize("case", BEFORE_LOADING)
def test_method_and_prompt_errors_come_before_the_weights_load(bad_inputs, stories_dir, case,
                                                                monkeypatch, capsys):
    from rocketkv.cli import generate as generate_cli

    def load(*a, **kw):
        raise AssertionError("the weights were loaded before the error")

    monkeypatch.setattr(run_steps, "load_model", load)
    argv = next(b[1] for b in BAD if b[0] == case)
    rc = generate_cli.main([a.format(d=bad_inputs, s=stories_dir) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "weights were loaded" not in err, err


def test_inline_prompt_text_equals_the_prompt_file(stories_dir, tmp_path, capsys):

    (tmp_path / "p.txt").write_text("Once upon a time\n")
    assert generate_cli.main(["--checkpoint", str(stories_dir), "--prompt", str(tmp_path / "p.txt"),
                   "--max-new-tokens", "12", "--no-stream"]) == 0
    from_file = capsys.readouterr().out
    assert generate_cli.main(["--checkpoint", str(stories_dir), "-p", "Once upon a time",
                   "--max-new-tokens", "12", "--no-stream"]) == 0
    assert capsys.readouterr().out == from_file and from_file.startswith(", there was")


def test_compiled_step_is_reused_across_contexts_and_budgets():
    """A sweep compiles each method structure a few times (static at first, then with the
    sizes that changed made symbolic: cache lengths, page counts, k, r, page_size;
    ``DYNAMO_CONFIG``; a third time where the second specialized an integer again: hybrid
    attention's r in a contiguity check), never once per configuration: the last contexts
    compile nothing. The structures here: full,
    gptfast_dense, rocketkv with one-token pages (no min/max buffers) and with pages. The
    model is stories260K's shape with 2 layers instead of 5 (tracing time grows with the
    layers; the recompiles do not)."""
    from dataclasses import replace

    from torch._dynamo.testing import CompileCounter

    stories_model = random_model(replace(ModelArgs.from_name("stories260K"), n_layers=2),
                                 "cpu", torch.float32)
    torch._dynamo.reset()
    counter = CompileCounter()
    configs = [("full", None), ("gptfast_dense", None), ("rocketkv", 48), ("rocketkv", 96)]
    gen = torch.Generator().manual_seed(0)
    frames = []
    for context in (96, 160, 224, 288, 352, 416):
        prompt = torch.randint(3, 500, (context,), generator=gen).tolist()
        for method, budget in configs:
            r = generate(stories_model, prompt, CacheRequest(method, budget), max_new_tokens=6,
                         step=StepConfig(compile=True, backend=counter))
            if context == 416:  # the reused graphs decode exactly as the eager step does
                eager = generate(stories_model, prompt, CacheRequest(method, budget),
                                 max_new_tokens=6)
                assert r["token_ids"] == eager["token_ids"]
        frames.append(counter.frame_count)
    assert frames[-1] == frames[-2] <= 3 * 4, frames


def test_cli_says_once_when_max_new_tokens_exceeds_the_context(stories_dir):
    p = run_cli("--checkpoint", str(stories_dir), "--random-prompt", "500",
                "--max-new-tokens", "40")
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "exceeds the 12 tokens" in notes[0]
    assert "generated 12 (context_length)" in p.stderr


def test_the_result_is_a_dataclass_whose_fields_are_the_json_keys_in_order(stories_model):
    """generate returns a report.GenerateResult dataclass: its fields are the JSON record's
    keys in order (``to_dict()``, what --json writes, a JSON round trip), built whole (no
    field left None to be filled later); reading by key (the dict it was) agrees with the
    attributes, and nothing can be written into it."""

    r = generate(stories_model, [1, 2, 3, 4], max_new_tokens=3)
    assert isinstance(r, GenerateResult) and dataclasses.is_dataclass(r)
    names = [f.name for f in dataclasses.fields(GenerateResult)]
    record = r.to_dict()
    assert type(record) is dict and list(record) == names and list(r) == names
    assert json.loads(json.dumps(record)) == record
    assert record is not r.to_dict()  # a new dict each time: callers add their keys to it
    assert all(r[k] is getattr(r, k) is record[k] for k in names)
    assert r.conversation == {"start": 0, "position": 6, "room": 0}  # 4 + 3 positions
    assert r.prefill_shared is False and r.compiled is False
    assert r.peak_memory_kind is not None
    assert "tokens_per_s" in r and "text" not in r and r.get("text") is None
    assert len(r) == len(names) and dict(r) == record
    with pytest.raises(KeyError):
        r["text"]
    with pytest.raises(TypeError):
        r["x"] = 1
    with pytest.raises(TypeError):
        r["tokens_per_s"] = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.tokens_per_s = 1.0
    with pytest.raises(TypeError):  # not a dict: a JSON writer takes r.to_dict()
        json.dumps(r)


def test_report_warns_when_step_times_spread(stories_model):
    from rocketkv.engine.report import format_report

    r = generate(stories_model, [1, 2, 3, 4], max_new_tokens=8)
    calm = format_report(r)
    assert "warning: step times vary" not in calm or \
        r["decode_ms_p90"] / r["decode_ms_p10"] > 4
    noisy = format_report(dict(r, decode_ms_p10=1.0, decode_ms_p90=50.0))
    assert "warning: step times vary 50.0x (p90/p10)" in noisy


def test_json_destination_without_write_access_fails_before_the_run(tmp_path, monkeypatch):
    """A read-only filesystem or directory: os.access reports no write access (patched here,
    since root writes through permissions)."""
    from rocketkv.cli import common as cli

    real = os.access
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False if mode & os.W_OK
                        else real(path, mode))
    with pytest.raises(cli.ConfigError, match="not writable"):
        cli.check_json_path(str(tmp_path / "out.json"))
    monkeypatch.setattr(cli.os, "access", real)
    cli.check_json_path(str(tmp_path / "out.json"))  # writable: no error


def test_a_run_that_cannot_fit_is_refused_before_allocating(monkeypatch, capsys):
    """The float weights + KV estimate equals what a model allocates; a run above the free
    memory is one error line (random:llama-3.1-8b in float32 on a small CPU, simulated)."""
    from rocketkv.engine import measure
    from rocketkv.formats.checkpoint import random_model
    from rocketkv.model import ModelArgs

    args = ModelArgs.from_name("stories260K")  # tied classifier
    assert measure.float_weight_bytes(args, torch.float32) == \
        measure.weight_bytes(random_model(args, "cpu", torch.float32))
    untied = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                       vocab_size=100)
    assert measure.float_weight_bytes(untied, torch.bfloat16) == \
        measure.weight_bytes(random_model(untied, "cpu", torch.bfloat16))
    big = ModelArgs.from_name("llama-3.1-8b")
    assert abs(measure.float_weight_bytes(big, torch.bfloat16) / 1e9 - 16.06) < 0.01  # 8.03B params
    qwen = ModelArgs.from_name("qwen2.5-0.5b")  # q/k/v biases, tied classifier
    assert measure.float_weight_bytes(qwen, torch.float32) == 494_032_768 * 4
    monkeypatch.setattr(measure, "available_bytes", lambda device: 24 * 2**30)
    rc = generate_cli.main(["--checkpoint", "random:llama-3.1-8b", "--device", "cpu",
                            "--random-prompt", "1024", "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: this run needs at least 30.") and \
        "cpu has 24.0 GiB free" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_keeps_what_was_generated(tmp_path, sig, code):
    """A real SIGINT (Ctrl-C) or SIGTERM (what `timeout` and job schedulers send) to a
    streaming generation: the text streamed so far is printed, the report follows on stderr,
    the JSON is written and marked interrupted, exit 130 or 143, no traceback."""
    import select
    import signal

    from conftest import SMOLLM2_GGUF, shared_file

    prompt = tmp_path / "p.txt"
    prompt.write_text("Write a very long story about a lighthouse keeper.")
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "generate.py"), "--checkpoint",
         str(shared_file(SMOLLM2_GGUF)), "--chat", "--prompt", str(prompt), "--ignore-eos",
         "--max-new-tokens", "4000", "--no-compile",  # decoding is interrupted, not a compile
         "--json", str(out),
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, preexec_fn=sigint_default)
    streamed = b""
    deadline = time.time() + 120
    while len(streamed) < 20 and time.time() < deadline:  # wait for streamed text
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            streamed += os.read(proc.stdout.fileno(), 4096)
    assert len(streamed) >= 20, "no streamed text"
    proc.send_signal(getattr(signal, sig))
    rest, err = proc.communicate(timeout=120)
    stdout = (streamed + rest).decode()
    assert proc.returncode == code, err.decode()
    assert b"Traceback" not in err
    assert "(interrupted)" in err.decode() and "(interrupted)" not in stdout
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["stop_reason"] == "interrupted"
    assert 0 < data["new_tokens"] < 4000
    assert data["text"][0].strip()[:10] in stdout


def test_a_run_that_replaces_the_caches_resets_its_memory_peak_after_freeing_the_old_ones():
    """A bench runs its rows in one process: a row's peak must not count the caches the
    previous row left (H200: rocketkv@256 at 128K after full reported full's 31 GiB). The
    meter is reset only once every old cache is released, and not when the caches are
    reused (their buffers are this run's)."""
    from rocketkv.engine import session as g

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     intermediate_size=16, vocab_size=64, max_seq_len=256)
    model = random_model(args, "cpu", torch.float32)
    resets = []

    class Meter:
        cuda = False

        def reset(self):
            resets.append([layer.attention.kv_cache for layer in model.layers])

    spec = g.CacheSpec(method="full", budget=None, batch_size=1, prompt_len=8, new_tokens=4,
                       dtype=torch.float32, device=torch.device("cpu"))
    g.prepare_caches(model, spec, Meter())
    old = list(model.caches)
    g.prepare_caches(model, spec.replace(method="streamingllm", budget=8), Meter())
    assert len(resets) == 2 and all(c is None for caches in resets for c in caches)
    assert all(a is not b for a, b in zip(old, model.caches))
    g.prepare_caches(model, spec.replace(method="streamingllm", budget=8), Meter())  # reused
    assert len(resets) == 2


def test_prefill_reports_each_layer_and_the_cli_bar_shows_only_on_a_terminal(stories_model,
                                                                             monkeypatch):
    """The tqdm bar only on a terminal; elsewhere plain lines (the test above)."""
    import io

    from rocketkv.engine import report as g

    seen = []
    generate(stories_model, list(range(1, 40)), CacheRequest(reserve_tokens=8), max_new_tokens=2,
             on_prefill_layer=seen.append)
    assert seen == list(range(stories_model.args.n_layers))
    seen.clear()  # a continuation's chunk is prefilled layer by layer too
    generate(stories_model, [5, 6], continue_conversation=True, max_new_tokens=1,
             on_prefill_layer=seen.append)
    assert seen == list(range(stories_model.args.n_layers))
    monkeypatch.setattr(g.sys, "stderr", io.StringIO())  # not a terminal
    assert isinstance(g.prefill_bar(5, 4096, disabled=False), g.PlainProgress)
    tty = io.StringIO()
    tty.isatty = lambda: True
    monkeypatch.setattr(g.sys, "stderr", tty)
    assert g.prefill_bar(5, 4096, disabled=True) is None
    assert g.prefill_bar(5, g.PROGRESS_TOKENS - 1, disabled=False) is None
    bar = g.prefill_bar(5, 4096, disabled=False)
    for i in range(5):
        g.bar_step(bar)(i)
    assert bar.n == 5 and "prefill 4096 tokens" in tty.getvalue()
    bar.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (the GPU machine)")
@pytest.mark.parametrize("method,budget", [("full", None), ("rocketkv", 64), ("hybrid", 64),
                                           ("quest", 64), ("sparq", 64), ("exact_topk", 64),
                                           ("h2o", 64)])
def test_cuda_graph_of_the_eager_step_gives_the_eager_tokens(method, budget):
    """--cuda-graphs (GraphStep): the eager step captured once and replayed gives the tokens of
    the eager loop, with 2 warm-up steps apart, every kernel on (head dim 64 in bfloat16: the
    kernels never run under head dim 16, so stories260K's 8 would test the PyTorch path; the
    selections over 600 tokens; the CPU twin, a traced step replayed, is test_dense_kernels'
    test_a_replayed_step_decodes_as_the_eager_one)."""
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512,
                     vocab_size=1000, max_seq_len=1024)
    model = random_model(args, "cuda", torch.bfloat16)
    prompt = torch.randint(3, 1000, (1, 600), generator=torch.Generator().manual_seed(0))
    from rocketkv import kernels

    # the dense kernels too: by default they run only on a GPU whose tuned table timed them
    # faster than cuBLAS, so on an untuned GPU this test asserted a default that was not
    previous = kernels.set_dense(True)
    try:
        runs = [generate(model, prompt, CacheRequest(method, budget), max_new_tokens=12,
                         step=StepConfig(compile=False, cuda_graphs=g)) for g in (False, True)]
    finally:
        kernels.set_dense(previous)
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[1]["cuda_graphs"] and runs[1]["warmup_steps"] == 2
    assert runs[1]["fused_kernels"] and runs[1]["dense_kernels"]
