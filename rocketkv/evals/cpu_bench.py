"""The CPU benchmark against llama.cpp (``scripts/bench_cpu.py`` is its command; its
docstring says what is measured and how): llama-bench driven and read, our runs timed on
the same GGUF, the two alternating per context, summarized, tabled and charted."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rocketkv.cli.common import (
    check_json_path,
    check_positive,
    row_error,
    rows_exit_status,
    write_json,
)
from rocketkv.compression import METHODS, needs_attention_sums
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.measure import percentile
from rocketkv.engine.prefill import PrefilledPrompt, prefill_once
from rocketkv.engine.provenance import cpu_model, load_average, provenance
from rocketkv.evals.harness import configurations
from rocketkv.formats.checkpoint import (
    check_creatable,
    checkpoint_args,
    default_gguf_weights,
    load_model,
    resolve_checkpoint,
)
from rocketkv.formats.gguf_reader import is_gguf
from rocketkv.model import ConfigError

DEFAULT_CONTEXTS = (0, 4096, 16384, 32768)
LLAMA_NOT_FOUND = "llama.cpp not found (build: tools/build_llama_cpp.sh)"
LLAMA = "llama.cpp"
OURS = "ours"


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (``/proc/cpuinfo``'s distinct
    (physical id, core id) pairs); ``os.cpu_count()`` where that cannot be read."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = None
    cores, cpu, phys = set(), None, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu, phys = int(value), "0"
                elif key == "physical id":
                    phys = value
                elif key == "core id" and (allowed is None or cpu in allowed):
                    cores.add((phys, value))
    except (OSError, ValueError):
        pass
    return len(cores) or len(allowed or ()) or os.cpu_count() or 1


# --------------------------------------------------------------------------------------------
# llama.cpp


def find_llama_bench(path: str | None) -> str | None:
    """The llama-bench executable: ``path`` (``--llama-bench``) or ``llama-bench`` on PATH;
    None when not given and not on PATH.

    Raises:
        ConfigError: ``path`` given but not an executable file.
    """
    if path is None:
        return shutil.which("llama-bench")
    p = Path(path)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise ConfigError(f"--llama-bench {path}: not an executable file "
                          "(build one with tools/build_llama_cpp.sh)")
    return str(p)


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """The tests of ``llama-bench -o json``'s output ``text`` (a JSON list, one object per
    test: ``n_prompt``, ``n_gen``, ``n_depth``, ``avg_ts`` tokens/s, ``avg_ns``,
    ``samples_ts``, ``build_commit``, ``build_number``, ``n_threads``, ...), whatever log
    lines come before the list.

    Raises:
        ConfigError: no JSON list of objects in ``text``.
    """
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        tests = None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise ConfigError("llama-bench printed no JSON list of tests")
    return tests


def llama_command(exe: str, gguf: str, threads: int, *, prompt: int = 0, gen: int = 0,
                  depth: int = 0, warmup: bool = True) -> list[str]:
    """One ``llama-bench`` run of one test: ``-p prompt -n gen -d depth``, 1 repetition,
    JSON output."""
    cmd = [exe, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-d", str(depth), "-r", "1", "-o", "json"]
    return cmd if warmup else [*cmd, "--no-warmup"]


def run_llama(cmd: list[str], tests: int = 1) -> list[dict[str, Any]]:
    """Run ``cmd`` (``llama_command``); the objects of its ``tests`` tests
    (``parse_llama_bench``).

    Raises:
        ConfigError: the process could not start, failed (its last stderr line), or printed
            another number of tests.
    """
    try:
        out = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ConfigError(f"llama-bench cannot run: {e.strerror or e}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise ConfigError(f"llama-bench failed (exit status {out.returncode}): {last}")
    found = parse_llama_bench(out.stdout)
    if len(found) != tests:
        raise ConfigError(f"llama-bench printed {len(found)} tests, expected {tests}")
    return found


LLAMA_KEYS = ("build_commit", "build_number", "cpu_info", "backends", "model_type",
              "model_size", "model_n_params", "n_threads", "n_batch", "n_ubatch", "type_k",
              "type_v", "flash_attn")


def llama_info(test: dict[str, Any]) -> dict[str, Any]:
    """What a llama-bench test says about the build, the machine and the settings."""
    return {k: test.get(k) for k in LLAMA_KEYS}


# --------------------------------------------------------------------------------------------
# Ours


def ours_run(model, ids: list[int], method: str, budget: int | None, steps: int, warmup: int,
             compile: bool, prefilled: PrefilledPrompt | None = None) -> dict[str, Any]:
    """One ``generate.generate`` of ``ids`` (a prefill, ``warmup`` + ``steps`` decode steps,
    no stop tokens): the figures of a row. With ``prefilled`` (``shared_prefill``) the caches
    are built from it: no prefill figure, ``build_s`` the seconds the build took (the method's
    prompt compression), unless the method prefills its own way (``prefill_shared`` False)."""
    r = generate(model, ids, CacheRequest(method, budget), max_new_tokens=warmup + steps + 1,
                 stop_ids=(), step=StepConfig(compile=compile, warmup_steps=warmup),
                 prefilled=prefilled)
    ms = r["decode_ms"] if r["compiled"] else r["decode_ms"][warmup:]
    context = len(ids) if len(ids) > 1 and not r["prefill_shared"] else 0
    return {
        "prefill_shared": r["prefill_shared"],
        "build_s": r["prefill_s"] if r["prefill_shared"] else None,
        "prefill_s": r["prefill_s"] if context else None,
        "prefill_tok_s": context / r["prefill_s"] if context and r["prefill_s"] else None,
        "decode_tok_s": len(ms) / (sum(ms) / 1e3) if ms and sum(ms) > 0 else None,
        "decode_ms_median": percentile(ms, 50), "decode_ms_p10": percentile(ms, 10),
        "decode_ms_p90": percentile(ms, 90), "decode_steps": len(ms),
        "compiled": r["compiled"], "method_params": r["method_params"],
        "kv_cache_bytes": r["kv_cache_bytes"], "kv_bytes_per_step": r["kv_bytes_per_step"],
        "weight_bytes_per_step": r["weight_bytes_per_step"],
        "peak_memory_bytes": r["peak_memory_bytes"],
    }


SHARED = "shared prefill"  # ours' prefill row (``method``) when the methods share one


def sharing(context: int, configs: Sequence[tuple[str, Any]]) -> bool:
    """Whether ours prefill a context once for the configurations: a prompt (context > 0) and
    two or more configurations whose caches are built from a shared prefill
    (``Method.shared_prefill``)."""
    return context > 0 and sum(METHODS[m].shared_prefill for m, _ in configs) >= 2


def shared_prefill(model, ids: list[int], configs: Sequence[tuple[str, Any]]
                   ) -> tuple[PrefilledPrompt, dict[str, Any]]:
    """One ``prefill.prefill_once`` of ``ids`` for the configurations (with H2O's attention
    sums when one needs them), timed: (the prefilled prompt, the row's figures: ``prefill_s``,
    ``prefill_tok_s``)."""
    pre = prefill_once(model, ids, attention_sums=needs_attention_sums(m for m, _ in configs))
    return pre, {"prefill_s": pre.prefill_s, "prefill_tok_s": len(ids) / pre.prefill_s}


# --------------------------------------------------------------------------------------------
# Summary, table, chart


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": percentile(values, 50), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (context, peer, method, budget, our GGUF weights, compiled), in the order first
    run: the runs' decode and prefill tokens/s as {median, min, max, n}, the load averages'
    {min, max}, the errors and notes; for ours the ratios of time per token ours / llama.cpp of the
    medians (None where either is missing)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["context"], r["engine"], r.get("method"), r.get("budget"),
                           r.get("weights"), bool(r.get("compile"))), []).append(r)
    out = []
    for (context, engine, method, budget, weights, compiled), rows in groups.items():
        ok = [r for r in rows if "error" not in r]
        loads = [r["load_average_1min"] for r in ok if r.get("load_average_1min") is not None]
        s = {"context": context, "engine": engine, "method": method, "budget": budget,
             "weights": weights, "weights_default": any(r.get("weights_default") for r in rows),
             "compile": compiled, "decode_tok_s": _spread([r["decode_tok_s"] for r in ok
                                      if r.get("decode_tok_s") is not None]),
             "prefill_tok_s": _spread([r["prefill_tok_s"] for r in ok
                                       if r.get("prefill_tok_s") is not None]),
             "load_average_1min": {"min": min(loads), "max": max(loads)} if loads else None}
        errors = list(dict.fromkeys(r["error"] for r in rows if "error" in r))
        if errors:
            s["errors"] = errors
        out.append(s)
    for s in out:
        if s["engine"] != OURS:
            continue
        peer = next((x for x in out if x["engine"] == LLAMA and x["context"] == s["context"]),
                    None)
        for what in ("decode", "prefill"):
            mine = (s[f"{what}_tok_s"] or {}).get("median")
            theirs = ((peer or {}).get(f"{what}_tok_s") or {}).get("median")
            # time per token is 1 / (tokens/s): ours/theirs = theirs tok/s / ours tok/s
            s[f"ours_over_llama_time_{what}"] = theirs / mine if mine and theirs else None
    return out


def context_label(tokens: int) -> str:
    """``4K`` for 4096, ``8125`` for a capped context, ``0``."""
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def peer_label(s: dict[str, Any]) -> str:
    """``llama.cpp``, or ``ours METHOD[ @BUDGET][ [default: WEIGHTS]][ compiled]`` for a
    summary row (``default:`` where the weights are ``generate.py``'s default)."""
    if s["engine"] == LLAMA:
        return LLAMA
    weights = s.get("weights")
    if weights and s.get("weights_default"):
        weights = f"default: {weights}"
    return (f"ours {s['method']}" + (f" @{s['budget']}" if s["budget"] is not None else "")
            + (f" [{weights}]" if weights else "") + (" compiled" if s.get("compile") else ""))


def _fmt(spread: dict[str, float] | None) -> str:
    if not spread:
        return "-"
    return f"{spread['median']:.1f} ({spread['min']:.1f}-{spread['max']:.1f})"


def format_table(summary: list[dict[str, Any]]) -> str:
    """The summary as a markdown table: tokens/s median (min-max), the time ratios."""
    lines = ["| context | peer | decode tok/s | prefill tok/s | ours/llama.cpp time decode | "
             "prefill | load 1 min |", "|" + "---|" * 7]
    for s in sorted(summary, key=lambda s: (s["context"], s["engine"] != LLAMA)):
        name = peer_label(s)
        ratios = [s.get(f"ours_over_llama_time_{w}") for w in ("decode", "prefill")]
        load = s["load_average_1min"]
        cells = [_fmt(s["decode_tok_s"]), _fmt(s["prefill_tok_s"]),
                 *("-" if x is None else f"{x:.2f}" for x in ratios),
                 f"{load['min']:.2f}-{load['max']:.2f}" if load else "-"]
        if s.get("errors") and not s["decode_tok_s"] and not s["prefill_tok_s"]:
            cells = ["; ".join(e.replace("|", "/") for e in s["errors"])] + [""] * 4
        lines.append(f"| {s['context']} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Decode (left) and prefill (right) tokens/s against context, one line per peer and
    method, a bar from the min to the max of the repeats; written to ``path`` (PNG). None when
    nothing was measured."""
    series: dict[str, list[dict[str, Any]]] = {}
    for s in summary:
        name = peer_label(s)
        series.setdefault(name, []).append(s)
    contexts = sorted({s["context"] for s in summary})
    if not any(s["decode_tok_s"] or s["prefill_tok_s"] for s in summary):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    pos = {c: i for i, c in enumerate(contexts)}
    for ax, what in zip(axes, ("decode", "prefill")):
        for name, rows in series.items():
            pts = sorted((s["context"], s[f"{what}_tok_s"]) for s in rows if s[f"{what}_tok_s"])
            if not pts:
                continue
            xs = [pos[c] for c, _ in pts]
            med = [v["median"] for _, v in pts]
            err = [[m - v["min"] for m, (_, v) in zip(med, pts)],
                   [v["max"] - m for m, (_, v) in zip(med, pts)]]
            ax.errorbar(xs, med, yerr=err, fmt="-o" if name == LLAMA else "--s", capsize=4,
                        label=name)
        ax.set_xticks(range(len(contexts)), [context_label(c) for c in contexts])
        ax.set(xlabel="context (tokens)", ylabel=f"{what} tokens/s (median, min-max)",
               yscale="log", title=f"{what}\n{title}")
        ax.yaxis.set_major_formatter(ScalarFormatter())  # 50, not 5 x 10^1
        if ax.get_legend_handles_labels()[0]:  # context 0 alone: no prefill line
            ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# The run


def check_args(args: argparse.Namespace) -> None:
    """ConfigError for values no run can use (nothing loaded yet)."""
    check_positive(args, "max_new_tokens", "repeats", "threads", "time_limit")
    if args.warmup_steps < 0:
        raise ConfigError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.context is not None and min(args.context) < 0:
        raise ConfigError(f"--context must not be negative, got {min(args.context)}")
    if min(args.budgets) <= 0:
        raise ConfigError(f"--budgets must be positive numbers of tokens, got "
                          f"{min(args.budgets)}")
    configurations(list(dict.fromkeys(args.methods)), list(dict.fromkeys(args.budgets)))
    args.checkpoint = resolve_checkpoint(args.checkpoint)
    if not Path(args.checkpoint).exists():
        raise ConfigError(f"checkpoint not found: {args.checkpoint}")
    args.llama_bench = find_llama_bench(args.llama_bench)
    check_json_path(args.json)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out}: not a directory")
    check_creatable(args.out, out)


def plan_contexts(requested: list[int] | None, max_seq_len: int, room: int) -> tuple[list[int],
                                                                                      list[str]]:
    """The contexts to run and the notes on the capped ones: ``requested`` (default
    ``DEFAULT_CONTEXTS``), each at most ``max_seq_len - room`` (a prompt, then ``room``
    generated positions), repeats dropped."""
    limit = max_seq_len - room
    if limit < 0:
        raise ConfigError(f"the model's context ({max_seq_len} tokens) has no room for "
                          f"{room} decode positions")
    notes, out = [], []
    for c in DEFAULT_CONTEXTS if requested is None else requested:
        if c > limit:
            if requested is not None or limit not in out:
                notes.append(f"note: context {c} capped to {limit} (the model's {max_seq_len} "
                             f"tokens less {room} decode positions)")
            c = limit
        if c not in out:
            out.append(c)
    return out, notes


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """The benchmark the parsed arguments ``args`` ask for; the exit status."""
    try:
        check_args(args)
        threads = args.threads or physical_cores()
        room = args.warmup_steps + args.max_new_tokens + 1
        contexts, notes = plan_contexts(args.context, checkpoint_args(args.checkpoint)
                                        .max_seq_len, room)
        gguf = is_gguf(args.checkpoint)
        for note in notes:
            print(note, file=sys.stderr)
        torch.set_num_threads(threads)
        default = default_gguf_weights(None, args.checkpoint, "cpu")
        weights_modes = list(dict.fromkeys(default if w == "default" else w
                                           for w in args.gguf_weights)) if gguf else ["float"]
        defaults = {w: w == default and "default" in args.gguf_weights for w in weights_modes}
        models = {w: load_model(args.checkpoint, "cpu", torch.float32, gguf_weights=w)
                  for w in weights_modes}
        model = models[weights_modes[0]]
        compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = Path(args.json) if args.json else Path(args.out) / "cpu" / \
        f"bench_cpu-{stamp}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    configs = configurations(list(dict.fromkeys(args.methods)),
                             list(dict.fromkeys(args.budgets)))
    if args.llama_bench is None:
        peer_skip = f"skipped: {LLAMA_NOT_FOUND}"
    elif not gguf:
        peer_skip = f"skipped: llama.cpp reads GGUF files; {args.checkpoint} is not one"
    else:
        peer_skip = None
    prov = provenance(args.checkpoint, None if argv is None else ["scripts/bench_cpu.py",
                                                                   *argv])
    prov.update(cpu_model=cpu_model(), threads=threads, torch_threads=torch.get_num_threads(),
                checkpoint_bytes=Path(args.checkpoint).stat().st_size
                if Path(args.checkpoint).is_file() else None, llama_bench=args.llama_bench,
                llama_cpp=None)
    settings = {"model": model.args.name, "max_seq_len": model.args.max_seq_len,
                "contexts": contexts, "context_notes": notes,
                "methods": [list(c) for c in configs], "repeats": args.repeats,
                "max_new_tokens": args.max_new_tokens, "warmup_steps": args.warmup_steps,
                "gguf_weights": weights_modes if gguf else None,
                "gguf_weights_default": default if gguf else None, "dtype": "float32",
                "compile": args.compile, "seed": args.seed, "prompt": "random token ids",
                "peer_skipped": peer_skip}
    runs: list[dict[str, Any]] = []
    state = {"interrupted": False}

    def save():
        write_json(json_path, {"provenance": prov, "settings": settings, "runs": runs,
                               "summary": summarize(runs), **state})

    start = time.perf_counter()

    def record(row: dict[str, Any]) -> None:
        row.update(order=len(runs), elapsed_s=round(time.perf_counter() - start, 1))
        load = row.get("load_average_1min")
        runs.append(row)
        save()
        what = row.get("error") or ", ".join(
            f"{k} {row[k]:.1f}" for k in ("decode_tok_s", "prefill_tok_s")
            if row.get(k) is not None)
        name = peer_label(row)
        print(f"[{row['elapsed_s']:.0f} s] context {row['context']}, repeat {row['repeat']}, "
              f"{name}{' ' + row['test'] if row.get('test') else ''}: {what} "
              f"(load {'-' if load is None else f'{load:.2f}'})", file=sys.stderr)

    def over_time() -> bool:
        return args.time_limit is not None and time.perf_counter() - start > args.time_limit

    vocab = model.args.vocab_size
    ids = torch.randint(0, vocab, (max(max(contexts), 1),),
                        generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps, warmup = args.max_new_tokens, args.warmup_steps
    try:
        save()
        # untimed warm-ups: page cache, allocator, llama.cpp's build
        if peer_skip is None:
            try:
                test = run_llama(llama_command(args.llama_bench, args.checkpoint, threads,
                                               prompt=16, gen=2), tests=2)[0]
                prov["llama_cpp"] = llama_info(test)
            except ConfigError as e:
                peer_skip = f"llama-bench warm-up failed: {e}"
                settings["peer_skipped"] = peer_skip
        for m in models.values():
            for compiled in compiles:
                for method, budget in configs:
                    ours_run(m, ids[:min(16, len(ids))], method, budget, 2, warmup, compiled)
        for context in contexts:
            if peer_skip is not None:
                record({"engine": LLAMA, "context": context, "repeat": None,
                        "error": peer_skip})
            for rep in range(1, args.repeats + 1):
                if peer_skip is None:
                    tests = [("decode", dict(gen=steps, depth=context))]
                    if context:
                        tests.insert(0, ("prefill", dict(prompt=context, warmup=False)))
                    for test_name, kw in tests:
                        row = {"engine": LLAMA, "context": context, "repeat": rep,
                               "test": test_name}
                        if over_time():
                            record({**row, "error": f"skipped: --time-limit "
                                                    f"{args.time_limit:g} s reached"})
                            continue
                        cmd = llama_command(args.llama_bench, args.checkpoint, threads, **kw)
                        row.update(load_average_1min=load_average(), command=cmd)
                        try:
                            (t,) = run_llama(cmd)
                            ts = t.get("avg_ts")
                            row.update({f"{test_name}_tok_s": ts, "time_s":
                                        (t.get("avg_ns") or 0) / 1e9,
                                        "n_prompt": t.get("n_prompt"), "n_gen": t.get("n_gen"),
                                        "n_depth": t.get("n_depth"),
                                        "n_threads": t.get("n_threads")})
                            prov["llama_cpp"] = prov["llama_cpp"] or llama_info(t)
                        except ConfigError as e:
                            row["error"] = str(e)
                        record(row)
                for weights, m in models.items():
                    pre = None
                    shared = [(SHARED, None, False)] if sharing(context, configs) else []
                    for method, budget, compiled in [*shared, *((mb, bb, c) for c in compiles
                                                                for mb, bb in configs)]:
                        row = {"engine": OURS, "context": context, "repeat": rep,
                               "method": method, "budget": budget,
                               "weights": weights if gguf else None,
                               "weights_default": defaults.get(weights, False),
                               "compile": compiled}
                        if over_time():
                            record({**row, "error": f"skipped: --time-limit "
                                                    f"{args.time_limit:g} s reached"})
                            continue
                        row["load_average_1min"] = load_average()
                        try:
                            if method == SHARED:
                                pre, figures = shared_prefill(m, ids[:context], configs)
                                row.update(figures, test="prefill")
                            else:
                                row.update(ours_run(m, ids[:max(context, 1)], method, budget,
                                                    steps, warmup, compiled, pre))
                        except Exception as e:  # noqa: BLE001 (a failed run is a row)
                            row["error"] = row_error(e)
                        record(row)
                    del pre
    except KeyboardInterrupt:
        state["interrupted"] = True
        print("interrupted: the runs so far are saved", file=sys.stderr)
    except ConfigError as e:  # the JSON cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 1
    save()

    summary = summarize(runs)
    print(format_table(summary))
    if not args.no_plots:
        png = plot(summary, json_path.with_name(json_path.stem + "-decode.png"),
                   f"{model.args.name}, {threads} threads, {cpu_model()}")
        if png:
            print(f"chart {png}")
    llama = prov["llama_cpp"] or {}
    print(f"{model.args.name}, {threads} threads, torch {torch.__version__}, llama.cpp "
          f"{llama.get('build_commit', '-')} ({llama.get('build_number', '-')}); "
          f"wrote {json_path}")
    if state["interrupted"]:
        return 130
    return rows_exit_status(runs, "runs")
