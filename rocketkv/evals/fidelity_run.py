"""Fidelity of KV-cache compression on a real checkpoint: agreement with the full cache,
perplexity of held-out text, KL divergence of next-token distributions, attention recall of the
selected tokens against Exact-TopK, and the bytes each method stores and reads.
The run of ``scripts/eval_accuracy.py`` (its command line) over its prompt lengths, the
results' files and the resuming.

Definitions (``evals/fidelity.py``'s module docstring): the prompt set (non-overlapping windows
of the ``--text`` documents, T = ``--context`` prompt tokens and m = ``--max-new-tokens``
continuation tokens each, N = ``--num-prompts`` spread over the text under ``--seed 0``), one
prefill per prompt shared by every (method, budget), and every number: ``match_prefix``,
``teacher_forced_top1``, ``perplexity``, ``kl_divergence``, ``attention_recall`` (how the
positions read are obtained: ``evals/probes.py``), ``kv_cache_bytes``, ``kv_bytes_per_step``,
``method_params``.

Intervals: with 2 or more prompts per length, teacher-forced top-1, KL and attention recall
carry a 95% percentile bootstrap interval over prompts (``<measure>_ci`` in the rows, in
brackets in the tables; ``evals.reports.add_fidelity_intervals``).

Per-prompt values (``match_prefix_per_prompt``, ``teacher_forced_top1_per_prompt``,
``nll_per_token``, ``kl_per_token``, ``attention_recall_per_prompt``) are kept in the JSON, with
the prompts' token ids, the full cache's greedy continuations, ``prefill_s`` per prompt,
``eval_s`` (per prompt length) and ``runtime_s`` (the whole run, loading included), and the
run's ``commit`` and ``provenance`` (``evals/provenance.py``: dirty tree, torch and
transformers versions, the checkpoint's sha256 and quantization types, the command).

Outputs: the markdown tables go to stdout; ``--out DIR`` writes ``DIR/fidelity.json`` (every
number), ``DIR/fidelity.md`` (the tables) and ``DIR/fidelity.png`` (perplexity, KL divergence
and attention recall against the budget, one line per method and prompt length, full's
perplexity as a horizontal line); ``--json PATH`` writes the same JSON to PATH. The JSON has
``runs`` (one result per prompt length) and ``rows`` (every row of every run, each with its
``prompt_tokens``). The progress bar (tqdm, when installed) goes to stderr. Torch runs on
``--threads`` CPU threads (default 1), in ``--dtype`` (default float32).

Runs in pieces: with ``--out``, each finished prompt's numbers are kept in
``DIR/fidelity_T.partial.jsonl`` (tagged with the commit), so a killed run, or one stopped by
``--time-limit SECONDS`` (no prompt starts after it), continues with the same command and gives
the same numbers as a run that never stopped; the files are deleted once every prompt of
every length ran (not before: the same command then runs only the rest), and a file of other
prompts, settings or engine code stops the run (``--restart`` discards it). The same command
once more, with the run complete (each run's ``fingerprint`` in ``fidelity.json``), stops with
one error line before any prompt (``--restart`` runs it again). The JSON's ``unfinished``
counts the prompts not run, each run's ``prompts_run`` the ones its rows cover, and
``prompt_tags`` the commit that computed each.

Bad input: one ``error: ...`` line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from rocketkv.cli.common import check_positive, write_json
from rocketkv.engine.provenance import commit_fields, provenance
from rocketkv.evals.fidelity import (
    bos_prefix,
    build_prompt_set,
    evaluate,
    fidelity_fingerprint,
)
from rocketkv.evals.harness import (
    configurations,
    input_identity,
    progress_bar,
)
from rocketkv.evals.prompts import text_files
from rocketkv.evals.reports import (
    add_fidelity_intervals,
    fidelity_plot,
    fidelity_report,
    fidelity_table,
)
from rocketkv.formats.checkpoint import load_model, resolve_checkpoint
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError


def check_args(args: argparse.Namespace) -> None:
    """ConfigError for values no run can use."""
    check_positive(args, "max_new_tokens", "num_prompts", "threads", "limit", "time_limit")
    if args.time_limit is not None and not args.out:
        raise ConfigError("--time-limit needs --out: the finished prompts are kept there for "
                          "the next run")
    if args.seed < 0:
        raise ConfigError(f"--seed must not be negative, got {args.seed}")
    for name, values in (("context", args.context), ("budgets", args.budgets)):
        bad = [v for v in values if v <= 0]
        if bad:
            raise ConfigError(f"--{name} must be positive numbers of tokens, got {bad[0]}")
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"--json: directory {parent} does not exist")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")


def refuse_a_complete_run(out: Path, partials: Sequence[Path], fingerprints: Sequence[str]
                          ) -> None:
    """Raise ConfigError when ``out/fidelity.json`` holds this run complete: a run per prompt
    length whose ``fingerprint`` is this run's (``evals.fidelity.fidelity_fingerprint``:
    prompts, configurations, settings, engine code), nothing unfinished and no partial file
    left, so that the same command once more does not spend hours to rewrite the same
    numbers (``--restart`` runs it again)."""
    path = out / "fidelity.json"
    if any(p.is_file() for p in partials) or not path.is_file():
        return
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return
    if (isinstance(data, dict) and not data.get("unfinished")
            and [r.get("fingerprint") for r in data.get("runs", [])] == list(fingerprints)):
        raise ConfigError(f"{path} already holds this run, complete (the same prompts, "
                          "settings and engine code): nothing to run; --restart runs it "
                          "again (or another --out)")


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Evaluate as the parsed arguments ``args`` say (``argv``: the command recorded, the
    process's own when None); the exit status."""
    t0 = time.perf_counter()
    try:
        check_args(args)
        torch.set_num_threads(args.threads)
        torch.manual_seed(args.seed)
        checkpoint = resolve_checkpoint(args.checkpoint)
        text_files(args.text)
        dtype = getattr(torch, args.dtype)  # flags.DTYPE_NAMES are torch's names
        model = load_model(checkpoint, "cpu", dtype)
        tok = load_tokenizer(args.tokenizer or checkpoint)
        if tok.vocab_size > model.args.vocab_size:
            raise ConfigError(f"tokenizer has {tok.vocab_size} tokens, model only "
                              f"{model.args.vocab_size}")
        m = args.max_new_tokens
        lengths = list(dict.fromkeys(args.context))
        for T in lengths:
            if T + m > model.args.max_seq_len:
                raise ConfigError(f"--context {T} + --max-new-tokens {m} exceed the "
                                  f"model's context ({model.args.max_seq_len} tokens)")
        n = min(args.num_prompts, args.limit or args.num_prompts)
        prompt_sets = [build_prompt_set(tok, args.text, T, m, n, args.seed) for T in lengths]
        budgets = list(dict.fromkeys(args.budgets))
        methods = list(dict.fromkeys(args.methods))
        bar = None
        if not args.no_progress:
            bar = progress_bar(len(lengths) * n * (len(configurations(methods, budgets)) + 1))
        t_eval, limit = time.perf_counter(), args.time_limit
        resume = {"run_key": [input_identity(args.checkpoint), input_identity(args.tokenizer),
                              args.dtype, args.threads],
                  "tag": commit_fields(), "restart": args.restart,
                  "stop": None if limit is None else
                  (lambda: time.perf_counter() - t_eval > limit)}
        partials = [Path(args.out) / f"fidelity_{T}.partial.jsonl" if args.out else None
                    for T in lengths]
        if args.out and not args.restart:
            refuse_a_complete_run(Path(args.out), partials, [
                fidelity_fingerprint(ps, configurations(methods, budgets), m, resume["run_key"])
                for ps in prompt_sets])
        runs = [evaluate(model, ps, methods, budgets, m, bar=bar, partial=path, **resume)
                for ps, path in zip(prompt_sets, partials)]
        for run in runs:
            add_fidelity_intervals(run["rows"])
        if bar is not None:
            bar.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    unfinished = sum(r["unfinished"] for r in runs)
    if not unfinished:  # while some length is unfinished, the finished ones' files stay too:
        for path in partials:  # the same command then runs only the rest
            if path is not None:
                path.unlink(missing_ok=True)
    if unfinished:
        kept = ", ".join(str(path) for path in partials)
        print(f"note: {unfinished} prompts not run (--time-limit): the results cover the "
              "others, and the same command runs the rest (the finished prompts are kept in "
              f"{kept})", file=sys.stderr)
    runs = [r for r in runs if r["prompts_run"]]
    if not runs:
        print("note: no prompt finished: nothing written", file=sys.stderr)
        return 0
    prov = provenance(checkpoint, ["scripts/eval_accuracy.py",
                                   *(sys.argv[1:] if argv is None else argv)])
    result = {"model": model.args.name, "checkpoint": args.checkpoint,
              "commit": prov["commit"], "provenance": prov,
              "text_files": list(args.text), "prompt_tokens": lengths, "max_new_tokens": m,
              "num_prompts": n, "methods": methods, "budgets": budgets, "seed": args.seed,
              "threads": args.threads, "dtype": args.dtype, "bos_prefix": bos_prefix(tok),
              "unfinished": unfinished,
              "rows": [r for run in runs for r in run["rows"]], "runs": runs,
              "torch_version": torch.__version__, "runtime_s": time.perf_counter() - t0}
    print("\n\n".join(f"{r['prompt_tokens']} prompt tokens\n\n{fidelity_table(r)}" for r in runs))
    if args.json:
        write_json(args.json, result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "fidelity.json", result)
        (out / "fidelity.md").write_text(fidelity_report(result) + "\n")
        fidelity_plot(result, out / "fidelity.png")
    return 0

