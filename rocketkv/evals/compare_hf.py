"""Our engine against Hugging Face transformers: prefill time and decode ms/token of the same
checkpoint on the same prompt ids, in the same process on the same machine. The library behind
``scripts/compare_hf.py`` (its command line).

The checkpoint is a GGUF file (transformers loads it with ``from_pretrained(dir,
gguf_file=name)``, dequantized; ours through ``checkpoint.load_model``) or a Hugging Face
directory (``config.json`` + safetensors). Both run in ``--dtype`` (default float32) on
``--device`` (default cuda if available, else cpu) and on ``--threads`` CPU threads.

Prompt: ``--prompt-file`` text tokenized with our tokenizer (``encode(text)``, BOS first; the
checkpoint's, or ``--tokenizer``), repeated (without BOS) and cut to each context length; or
``--random`` token ids (``--seed``). Every context uses the leading ids of the same sequence.

For each context and each of our methods x budgets (``full`` takes no budget):

* ours: ``generate.generate`` with no stop tokens and ``max_new_tokens = warm-up + decode steps
  + 1``: ``prefill_s`` (prefill and the first token's argmax) and the median of the per-step
  times after the ``--warmup-steps`` first decode steps (``--compile`` compiles our step; the
  warm-up then covers compilation).
* transformers (once per context; its cache is the dense ``DynamicCache``, there is nothing
  to compress): under ``torch.no_grad``, a forward of the prompt with ``use_cache=True`` and
  ``logits_to_keep=1`` plus the argmax (prefill), then single-token forwards with
  ``past_key_values``, greedy; each timed with ``time.perf_counter`` (synchronized on CUDA);
  the same warm-up steps are left out of the median.
* ``hf_over_ours_prefill`` and ``hf_over_ours_decode``: transformers' time / ours (above 1:
  ours is faster).
* ``ours_tokens`` / ``hf_tokens``: the first ``--check-tokens`` greedy tokens (the prefill's
  and the decode steps'); ``tokens_match`` compares them for the uncompressed methods on the
  same weights (null for the others, which are not expected to match exactly: the compressing
  methods, and ours on quantized GGUF blocks, ``--gguf-weights``).
* Every row records the commit and dirty flag of this checkout (``commit``, ``dirty``).

Each engine runs one short untimed warm-up generation first. With ``--repeats R`` each engine
runs R times per configuration and the run with the lowest decode median is kept (as
``scripts/bench.py`` does); ``load_average_1min`` in each row tells how busy the machine was
(other processes on the same cores slow multi-threaded CPU runs a lot). Rows (device, CPU
model, torch and transformers versions, threads, command, every figure) go to ``--json``
(default ``./<device>/compare_hf-<timestamp>.json`` under the current directory), rewritten
after every row, and a markdown table to stdout; progress (tqdm) to stderr. On CPU these are
CPU figures: ``device`` says so in every row. Bad input (missing checkpoint, unknown method,
context plus decode steps beyond the model's context, non-positive numbers, unreadable prompt
file) prints one ``error: ...`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rocketkv.cli.common import (
    DTYPES,
    check_json_path,
    check_positive,
    command_line,
    read_prompt,
    resolve_device,
    rows_exit_status,
    write_json,
)
from rocketkv.compression import METHODS, check_methods
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.measure import device_name, percentile, sync
from rocketkv.engine.provenance import commit_fields, cpu_model, load_average
from rocketkv.evals.bench import results_dir
from rocketkv.evals.harness import configurations
from rocketkv.formats.checkpoint import load_model, resolve_checkpoint
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError, Transformer

# --------------------------------------------------------------------------------------------
# The two engines


def load_hf(checkpoint: str, device: torch.device, dtype: torch.dtype):
    """The transformers model of ``checkpoint`` (GGUF file or HF directory), eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = Path(checkpoint)
    try:
        if path.is_file():
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as e:  # noqa: BLE001  (any loader failure is one error line)
        msg = str(e).strip().splitlines()
        raise ConfigError(f"transformers cannot load {checkpoint}: "
                          f"{msg[0] if msg else type(e).__name__}") from None
    return hf.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def hf_generate(hf, ids: Sequence[int], steps: int, warmup: int,
                device: torch.device) -> dict[str, Any]:
    """Greedy prefill + ``warmup + steps`` decode steps with transformers' cache; times in
    seconds (prefill) and ms (decode steps after the warm-up)."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf(input_ids=x, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    sync(device)
    prefill_s = time.perf_counter() - t0
    past = out.past_key_values
    tokens = [int(tok)]
    ms = []
    for _ in range(warmup + steps):
        sync(device)
        t = time.perf_counter()
        out = hf(input_ids=tok, past_key_values=past, use_cache=True)
        tok = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        sync(device)
        ms.append((time.perf_counter() - t) * 1e3)
        past = out.past_key_values
        tokens.append(int(tok))
    del out, past
    return {"prefill_s": prefill_s, "decode_ms": ms[warmup:], "tokens": tokens}


def best_of(repeats: int, run) -> dict[str, Any]:
    """The result of ``run()`` with the lowest decode median over ``repeats`` calls."""
    results = [run() for _ in range(repeats)]
    return min(results, key=lambda r: percentile(r["decode_ms"], 50) or 0.0)


def ours_generate(model: Transformer, ids: Sequence[int], method: str, budget: int | None,
                  steps: int, warmup: int, compile: bool) -> dict[str, Any]:
    """``generate.generate`` ignoring EOS for ``warmup + steps`` decode steps; the warm-up
    steps' times are left out of ``decode_ms``."""
    r = generate(model, list(ids), CacheRequest(method, budget), max_new_tokens=warmup + steps + 1,
                 stop_ids=(), step=StepConfig(compile=compile, warmup_steps=warmup))
    ms = r["decode_ms"] if compile else r["decode_ms"][warmup:]
    return {"prefill_s": r["prefill_s"], "decode_ms": ms, "tokens": r["token_ids"][0],
            "method_params": r["method_params"], "kv_cache_bytes": r["kv_cache_bytes"],
            "kv_bytes_per_step": r["kv_bytes_per_step"]}


# --------------------------------------------------------------------------------------------
# Prompt ids


def prompt_ids(args: argparse.Namespace, model: Transformer, length: int) -> list[int]:
    """``length`` ids: the prompt file's tokens repeated and cut, or random ids."""
    vocab = model.args.vocab_size
    if args.random:
        gen = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab, (length,), generator=gen).tolist()
    text = read_prompt(args.prompt_file)
    tok = load_tokenizer(args.tokenizer or args.checkpoint)
    if tok.vocab_size > vocab:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, model only {vocab}")
    ids = tok.encode(text)
    body = tok.encode(text, bos=False)
    if not body:
        raise ConfigError(f"prompt file {args.prompt_file} encodes to no tokens")
    while len(ids) < length:
        ids += body
    return ids[:length]


# --------------------------------------------------------------------------------------------
# Report


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def make_row(base: dict[str, Any], context: int, method: str, budget: int | None,
             hf: dict[str, Any], ours: dict[str, Any], check: int) -> dict[str, Any]:
    hf_med, ours_med = percentile(hf["decode_ms"], 50), percentile(ours["decode_ms"], 50)
    # the same weights (ours dequantized as transformers' are) and no compression: the
    # greedy tokens should agree; other rows record them without a verdict
    exact = not METHODS[method].budgeted and base.get("ours_gguf_weights", "float") == "float"
    return {
        **base, "context": context, "method": method, "budget": budget,
        "ours_prefill_s": ours["prefill_s"], "hf_prefill_s": hf["prefill_s"],
        "hf_over_ours_prefill": _ratio(hf["prefill_s"], ours["prefill_s"]),
        "ours_decode_ms_median": ours_med, "hf_decode_ms_median": hf_med,
        "hf_over_ours_decode": _ratio(hf_med, ours_med),
        "ours_decode_ms": ours["decode_ms"], "hf_decode_ms": hf["decode_ms"],
        "ours_tokens": ours["tokens"][:check], "hf_tokens": hf["tokens"][:check],
        "tokens_match": (ours["tokens"][:check] == hf["tokens"][:check]) if exact else None,
        "method_params": ours["method_params"], "kv_cache_bytes": ours["kv_cache_bytes"],
        "kv_bytes_per_step": ours["kv_bytes_per_step"],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the rows."""
    lines = ["| device | context | method | budget | prefill s ours | prefill s HF | HF/ours "
             "| decode ms ours | decode ms HF | HF/ours | greedy tokens match |",
             "|" + "---|" * 11]

    def f(x, spec):
        return "n/a" if x is None else format(x, spec)

    for r in rows:
        budget = "-" if r["budget"] is None else str(r["budget"])
        head = f"| {r['device']} | {r['context']} | {r['method']} | {budget} |"
        if "error" in r:
            lines.append(head + f" error: {r['error'].replace('|', '/')} |" + " |" * 6)
            continue
        match = {True: "yes", False: "NO", None: "-"}[r["tokens_match"]]
        lines.append(
            head + f" {f(r['ours_prefill_s'], '.3f')} | {f(r['hf_prefill_s'], '.3f')} | "
            f"{f(r['hf_over_ours_prefill'], '.2f')} | {f(r['ours_decode_ms_median'], '.2f')} | "
            f"{f(r['hf_decode_ms_median'], '.2f')} | {f(r['hf_over_ours_decode'], '.2f')} | "
            f"{match} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The run


def check_args(args: argparse.Namespace) -> None:
    """ConfigError for values no run can use (before anything is loaded)."""
    check_positive(args, "decode_steps", "check_tokens", "threads", "repeats")
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if min(args.context) <= 0:
        raise ConfigError(f"--context must be positive, got {min(args.context)}")
    if min(args.budgets) <= 0:
        raise ConfigError(f"--budgets must be positive numbers of tokens, got "
                          f"{min(args.budgets)}")
    check_methods(args.methods)
    check_json_path(args.json)
    args.checkpoint = resolve_checkpoint(args.checkpoint)  # a short name: its local copy
    path = Path(args.checkpoint)
    if not path.exists():
        raise ConfigError(f"checkpoint not found: {path}")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ConfigError(f"checkpoint must be a .gguf file or a Hugging Face directory: {path}")
    if args.prompt_file is not None:
        read_prompt(args.prompt_file)


def run(args, argv=None) -> int:
    """Compare as the parsed arguments ``args`` say; the exit status."""
    try:
        check_args(args)
        device = resolve_device(args.device)
        dtype = DTYPES[args.dtype]
        if args.threads:
            torch.set_num_threads(args.threads)
        model = load_model(args.checkpoint, device, dtype, gguf_weights=args.gguf_weights)
        steps, warmup = args.decode_steps, args.warmup_steps
        limit = model.args.max_seq_len
        for c in args.context:
            if c + warmup + steps + 1 > limit:
                raise ConfigError(f"--context {c} + {warmup} warm-up + {steps} decode steps + 1 "
                                  f"exceed the model's context ({limit} tokens)")
        contexts = list(dict.fromkeys(args.context))
        ids = prompt_ids(args, model, max(contexts))
        hf = load_hf(args.checkpoint, device, dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import transformers
    from tqdm import tqdm

    dev = device_name(device)
    json_path = args.json
    if json_path is None:
        out_dir = results_dir(".", device)  # under the current directory, not results/
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"compare_hf-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    base = {
        "device": dev, "cpu_model": cpu_model(), "threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
        "command": command_line("compare_hf.py", argv),
        "checkpoint": args.checkpoint, "model": model.args.name,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt": "random" if args.random else args.prompt_file,
        "decode_steps": steps, "warmup_steps": warmup, "repeats": args.repeats,
        "ours_compiled": args.compile, "ours_gguf_weights": args.gguf_weights,
        **commit_fields(),
        "hf_attn_implementation": getattr(hf.config, "_attn_implementation", None),
    }
    configs = configurations(list(dict.fromkeys(args.methods)),
                             list(dict.fromkeys(args.budgets)))
    rows: list[dict[str, Any]] = []
    with tqdm(total=1 + len(contexts) * (1 + len(configs)), desc="compare_hf", unit="run",
              disable=args.no_progress) as bar:
        warm = ids[:min(16, len(ids))]  # one short untimed run each: allocator, kernels
        hf_generate(hf, warm, 2, 0, device)
        ours_generate(model, warm, "full", None, 2, warmup, args.compile)
        bar.update()
        for context in contexts:
            bar.set_postfix_str(f"{context} tokens: transformers")
            ref = best_of(args.repeats,
                          lambda c=context: hf_generate(hf, ids[:c], steps, warmup, device))
            bar.update()
            for method, budget in configs:
                bar.set_postfix_str(f"{context} tokens: {method} {budget or ''}".rstrip())
                try:
                    ours = best_of(args.repeats, lambda c=context, m=method, b=budget:
                                   ours_generate(model, ids[:c], m, b, steps, warmup,
                                                 args.compile))
                    row = make_row(base, context, method, budget, ref, ours, args.check_tokens)
                    row["load_average_1min"] = load_average()
                except (ConfigError, torch.OutOfMemoryError) as e:
                    row = {**base, "context": context, "method": method, "budget": budget,
                           "error": str(e).splitlines()[0]}
                rows.append(row)
                write_json(json_path, rows)
                bar.update()
    print(format_table(rows))
    mismatch = [r for r in rows if r.get("tokens_match") is False]
    if mismatch:
        print(f"warning: greedy tokens differ from transformers' in {len(mismatch)} "
              f"uncompressed run(s) (contexts {sorted({r['context'] for r in mismatch})})",
              file=sys.stderr)
    print(f"{dev} ({base['cpu_model']}), {base['threads']} threads, torch "
          f"{base['torch_version']}, transformers {base['transformers_version']}; "
          f"wrote {json_path}")
    return rows_exit_status(rows)

