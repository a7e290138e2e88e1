"""The accuracy scripts' reports: markdown tables, figures, and the JSON + markdown + PNG files
of a result.

* The harness (needle, RULER-style): ``report_modes`` writes ``TASK[_qa].json/.md/.png`` per
  mode with ``write_outputs``; ``accuracy_table`` and ``needle_heatmaps`` for the needle,
  ``ruler_table`` and ``ruler_plot`` for RULER.
* Fidelity (``scripts/eval_accuracy.py``): ``fidelity_table``, ``fidelity_report``,
  ``fidelity_plot``; quantized weights (``scripts/eval_quantized.py``): ``quantization_table``,
  ``quantization_plot``; kept tokens (``scripts/kept_tokens.py``): ``kept_table``.

matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rocketkv.cli.common import write_json
from rocketkv.compression import METHODS, given_options
from rocketkv.engine.provenance import provenance
from rocketkv.evals.stats import bootstrap_interval, cell_stats
from rocketkv.formats.checkpoint import resolve_checkpoint
from rocketkv.model import Transformer

# --------------------------------------------------------------------------------------------
# Files


def write_outputs(out_dir: str | Path, name: str, result: dict[str, Any], table: str,
                  figure: Callable[[Path], None] | None) -> list[Path]:
    """``NAME.json``, ``NAME.md`` and (when ``figure``) ``NAME.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    write_json(paths[0], result)
    paths[1].write_text(table + "\n")
    if figure is not None:
        png = out / f"{name}.png"
        figure(png)
        paths.append(png)
    return paths


def report_modes(args: argparse.Namespace, got: dict[str, Any], model: Transformer,
                 task: str, fields: dict[str, Any], t0: float,
                 table: Callable[[list[dict[str, Any]]], str],
                 figure: Callable[[dict[str, Any], Path], None],
                 rows_of: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = list
                 ) -> list[dict[str, Any]]:
    """Per mode of ``got`` (``evaluate_items``): the result dict (rows, the run's settings,
    ``commit`` and ``provenance`` (``evals.provenance.provenance``: commit, dirty tree,
    library versions, the checkpoint's sha256 and quantization types, the command),
    ``item_commits`` (per item, the {"commit", "dirty"} of the run that answered it: a run
    resumed at a later commit names both; None for an item not run, or resumed from a batch saved
    without it), ``run_fingerprint`` (``evaluate_items``' ``fingerprint``: a rerun of the
    same complete run is refused) and ``fields``), its table on stdout, and
    ``TASK[_qa].json/.md/.png`` in ``args.out``.
    Returns every mode's rows (for the exit status)."""
    every = []
    prov = provenance(resolve_checkpoint(args.checkpoint), getattr(args, "argv", None))
    for mode in args.modes:
        result = {"task": task, "mode": mode, "commit": prov["commit"], "provenance": prov,
                  "question_agnostic": mode == "question_agnostic",
                  "rows": rows_of(got["modes"][mode]["rows"]), "model": model.args.name,
                  "checkpoint": args.checkpoint, "split": args.split, "seed": args.seed,
                  "method_options": given_options(args), **fields,
                  "eval_s": got["eval_s"], "runtime_s": time.perf_counter() - t0,
                  "batches": got.get("batches"), "batches_resumed": got.get("batches_resumed"),
                  "unfinished": got.get("unfinished", 0),
                  "run_fingerprint": got.get("fingerprint"),
                  "item_commits": got.get("item_tags"),
                  "modes_run_together": list(args.modes), "torch_version": torch.__version__,
                  "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                  "device": next(model.parameters()).device.type,
                  "threads": torch.get_num_threads(), "workers": got.get("workers", 1)}
        name = f"{task}_qa" if mode == "question_agnostic" else task
        text = table(result["rows"])
        every += result["rows"]
        print(f"{name}:\n{text}")
        paths = write_outputs(args.out, name, result, text, lambda p, r=result: figure(r, p))
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    if got.get("unfinished"):
        print(f"note: {got['unfinished']} prompts not run (--time-limit): the results cover the "
              "others, and the same command runs the rest (the finished batches are kept in "
              f"{got['partial']})", file=sys.stderr)
    elif got.get("partial"):  # every result is written: the saved batches have served
        Path(got["partial"]).unlink(missing_ok=True)
    return every


# --------------------------------------------------------------------------------------------
# Needle and RULER-style tasks


def add_substring_scores(rows: Sequence[dict[str, Any]], items: Sequence[Any],
                         substring: Callable[[str, Any], float]) -> list[dict[str, Any]]:
    """Each row that ran gets ``scores_substring`` (the old substring score of each answer
    scored in ``scores``, None elsewhere) and ``score_substring`` (their mean), for comparison
    with the boundary-aware ``scores``."""
    for r in rows:
        if "error" in r:
            continue
        r["scores_substring"] = [None if s is None else substring(a, it)
                                 for s, a, it in zip(r["scores"], r["answers"], items)]
        ran = [x for x in r["scores_substring"] if x is not None]
        r["score_substring"] = sum(ran) / len(ran) if ran else None
    return list(rows)


def accuracy_table(rows: Sequence[dict[str, Any]], budgets: Sequence[int],
                   label: str = "accuracy (%)") -> str:
    """Markdown table: one line per method, one column per budget (``-`` for no budget)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["budget"]): r for r in rows}
    head = f"| method ({label}) | " + " | ".join(str(b) for b in budgets) + " |"
    lines = [head, "|---" * (len(budgets) + 1) + "|"]
    for m in methods:
        if not METHODS[m].budgeted:
            r = by[(m, None)]
            cells = [_cell(r)] * len(budgets)
        else:
            cells = [_cell(by[(m, b)]) if (m, b) in by else "" for b in budgets]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interval(values: Sequence[float], strata: Sequence[Any] | None = None) -> str:
    """`` [lo, hi]`` (%): the 95% interval of ``evals.stats.cell_stats`` (Wilson for
    pass/fail scores, seeded bootstrap otherwise)."""
    c = cell_stats(values, strata=strata)
    return f" [{100 * c['ci_low']:.1f}, {100 * c['ci_high']:.1f}]"


def _cell(row: dict[str, Any]) -> str:
    """``n/a`` for an error (or nothing run), the score (%) with its 95% interval, and
    ``(ran/all)`` when some items failed or were not run."""
    if "error" in row or row["score"] is None:
        return "n/a"
    part = f" ({row['items_run']}/{len(row['scores'])})" if "items_run" in row else ""
    ran = [x for x in row["scores"] if x is not None]
    return f"{100 * row['score']:.1f}{_interval(ran)}{part}"


def needle_heatmaps(result: dict[str, Any], path: Path) -> None:
    """One depth x length heatmap per (method, budget): accuracy averaged over needles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("score") is not None]
    lengths, depths = result["lengths"], result["depths"]
    items = result["items"]
    cols = max(1, len(result["budgets"]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(methods), cols, figsize=(3.2 * cols, 2.6 * len(methods)),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for r in rows:
        mi = methods.index(r["method"])
        bi = 0 if r["budget"] is None else result["budgets"].index(r["budget"])
        grid = torch.zeros(len(depths), len(lengths))
        count = torch.zeros(len(depths), len(lengths))
        for it, s in zip(items, r["scores"]):
            if s is None:  # the method rejected this item's budget
                continue
            di, li = depths.index(it["depth"]), lengths.index(it["length"])
            grid[di, li] += s
            count[di, li] += 1
        acc = torch.where(count > 0, grid / count.clamp(min=1), float("nan"))  # NaN: blank
        ax = axes[mi, bi]
        ax.axis("on")
        ax.imshow(acc.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{x // 1024}K" if x % 1024 == 0 else str(x)
                                            for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        budget = "" if r["budget"] is None else f" @{r['budget']}"
        ax.set_title(f"{r['method']}{budget}: {100 * r['score']:.0f}%", fontsize=8)
    mode = "question-agnostic" if result["question_agnostic"] else "question in the prompt"
    fig.suptitle(f"needle in a haystack, {result['model']} ({mode}); x: context, y: depth",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ruler_table(rows: Sequence[dict[str, Any]], tasks: Sequence[str],
                items: Sequence[Any] | None = None) -> str:
    """Markdown: one line per (method, budget), one column per task, then the average (%).
    With ``items`` (their ``meta["task"]``), each cell adds its 95% interval
    (``evals.stats.cell_stats``: Wilson for pass/fail tasks, bootstrap otherwise; the
    average's bootstrap is stratified by task)."""
    lines = ["| method | budget | " + " | ".join(tasks) + " | average |",
             "|---|---" + "|---" * (len(tasks) + 1) + "|"]
    for r in rows:
        budget = "-" if r["budget"] is None else str(r["budget"])
        if "error" in r:
            cells = ["n/a"] * (len(tasks) + 1)
        else:
            cells = []
            for t in tasks:
                v = r["per_task"][t]
                text = "n/a" if v is None else f"{100 * v:.1f}"
                if v is not None and items is not None:
                    text += _interval([x for x, it in zip(r["scores"], items)
                                       if it.meta["task"] == t and x is not None])
                cells.append(text)
            text = "n/a" if r["score"] is None else f"{100 * r['score']:.1f}"
            if r["score"] is not None and items is not None:
                ran = [(x, it.meta["task"]) for x, it in zip(r["scores"], items)
                       if x is not None]
                text += _interval([x for x, _ in ran], [t for _, t in ran])
            cells.append(text)
        lines.append(f"| {r['method']} | {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ruler_plot(result: dict[str, Any], path: Path) -> None:
    """Average accuracy vs budget, one line per method (methods without a budget: dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in result["rows"] if r.get("score") is not None]
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        if not METHODS[m].budgeted:
            ax.axhline(100 * mine[0]["score"], ls="--", color="k", label=m)
        else:
            ax.plot([r["budget"] for r in mine], [100 * r["score"] for r in mine], "o-", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("average accuracy (%)")
    mode = "question-agnostic" if result["question_agnostic"] else "question in the prompt"
    ax.set_title(f"RULER-style tasks, {result['model']}, {result['lengths']} tokens ({mode})",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Fidelity


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def format_params(params: dict[str, Any]) -> str:
    """``key=value`` pairs (floats to 3 significant digits), method and budget left out."""
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items()
                     if k not in ("method", "budget"))


FIDELITY_CI = {"teacher_forced_top1": "teacher_forced_top1_per_prompt",
               "kl_divergence": "kl_per_token", "attention_recall": "attention_recall_per_prompt"}


def add_fidelity_intervals(rows: Sequence[dict[str, Any]]) -> None:
    """Each row that ran gets ``<measure>_ci`` = [low, high], the 95% percentile bootstrap
    interval over prompts (``evals.stats.bootstrap_interval``, seeded) of teacher-forced top-1,
    KL divergence (each prompt's mean over its tokens; the prompts have equal token counts, so
    their mean is the row's) and attention recall; None with fewer than 2 prompts."""
    for r in rows:
        if "error" in r:
            continue
        for key, per in FIDELITY_CI.items():
            vals = r.get(per)
            if not vals or any(v is None for v in vals) or len(vals) < 2:
                r[f"{key}_ci"] = None
                continue
            if key == "kl_divergence":
                vals = [sum(v) / len(v) for v in vals]
            r[f"{key}_ci"] = list(bootstrap_interval(vals))


def _with_ci(row: dict[str, Any], key: str, fmt: str) -> str:
    ci = row.get(f"{key}_ci")
    text = format(row[key], fmt)
    return text if not ci else f"{text} [{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def fidelity_table(result: dict[str, Any]) -> str:
    """Markdown table of one prompt length's ``result["rows"]``; top-1, KL and attention
    recall carry their 95% bootstrap interval over prompts when the rows have one
    (``add_fidelity_intervals``)."""
    m = result["max_new_tokens"]
    lines = [f"| method | budget | match prefix (of {m}) | teacher-forced top-1 | perplexity "
             "| KL (nats) | attention recall | attention mass | KV bytes | KV bytes/step "
             "| params |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        budget = "-" if r["budget"] is None else str(r["budget"])
        if "error" in r:
            msg = r["error"].replace("|", "\\|")
            cells = ["n/a"] * 8 + [f"n/a: {msg}"]
        else:
            rec = r["attention_recall"]
            cells = [f"{r['match_prefix']:.2f}", _with_ci(r, "teacher_forced_top1", ".3f"),
                     f"{r['perplexity']:.3f}", _with_ci(r, "kl_divergence", ".4f"),
                     "-" if rec is None else _with_ci(r, "attention_recall", ".3f"),
                     "-" if rec is None else f"{r['attention_mass']:.3f}",
                     f"{r['kv_cache_bytes']:,}", f"{r['kv_bytes_per_step']:,}",
                     format_params(r["method_params"]).replace("|", "\\|")]
        lines.append("| " + " | ".join([r["method"], budget, *cells]) + " |")
    return "\n".join(lines)


def fidelity_report(result: dict[str, Any]) -> str:
    """``fidelity.md``: the settings, then one table per prompt length."""
    runs = result["runs"]
    head = [f"# Fidelity: {result['model']}", "",
            f"checkpoint `{result['checkpoint']}`; text {', '.join(result['text_files'])}; "
            f"{runs[0]['num_prompts']} prompts per length, m = {result['max_new_tokens']} "
            f"tokens, seed {result['seed']}; runtime {result['runtime_s']:.0f} s "
            f"({result['threads']} threads, torch {result['torch_version']}).", "",
            "match prefix: leading greedy tokens equal to full's; top-1: teacher-forced on "
            "full's greedy continuation; perplexity and KL(full || method) (nats, mean per "
            "token): teacher-forced on the real continuation; attention recall: mass of exact "
            "attention on the tokens read / mass of Exact-TopK's with as many, mean over decode "
            "steps, layers and KV heads; attention mass: the raw covered mass. Definitions: "
            "`evals/fidelity.py`."]
    for r in runs:
        head += ["", f"## {r['prompt_tokens']} prompt tokens", ""]
        if r.get("unfinished"):
            head += [f"Incomplete: {r['prompts_run']} of {r['num_prompts']} prompts ran "
                     "(--time-limit); the same command runs the rest.", ""]
        head.append(fidelity_table(r))
    return "\n".join(head)


def fidelity_plot(result: dict[str, Any], path: str | Path) -> None:
    """``fidelity.png``: perplexity and KL divergence (log axes) and attention recall against the
    budget (log2 axis), one line per method (colour) and prompt length (line style); full's
    perplexity is a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = result["runs"]
    methods = [m for m in result["methods"] if METHODS[m].budgeted]
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    styles = ["-", "--", ":", "-."]
    panels = [("perplexity", "perplexity (real continuation)"),
              ("kl_divergence", "KL(full || method), nats/token"),
              ("attention_recall", "attention recall vs Exact-TopK")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, (key, title) in zip(axes, panels):
        for j, run in enumerate(runs):
            style = styles[j % len(styles)]
            for method in methods:
                pts = [(r["budget"], r[key]) for r in run["rows"]
                       if r["method"] == method and "error" not in r and r.get(key) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, marker="o", color=colors[method],
                            label=f"{method} T={run['prompt_tokens']}")
            full = next((r for r in run["rows"] if r["method"] == "full" and "error" not in r),
                        None)
            if key == "perplexity" and full is not None:
                ax.axhline(full["perplexity"], color="black", linestyle=style, linewidth=1,
                           label=f"full T={run['prompt_tokens']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["budgets"], [str(b) for b in result["budgets"]])
        ax.minorticks_off()
        ax.set_xlabel("token budget")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0)))
    axes[0].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(f"{result['model']}: fidelity vs budget ({runs[0]['num_prompts']} prompts, "
                 f"m = {result['max_new_tokens']})")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Quantized weights and kept tokens


def quantization_table(rows: Sequence[dict], m: int) -> str:
    """Markdown: one line per (weights, classifier, method, budget) row of
    ``evals.fidelity.run_variant`` (m: the greedy tokens compared)."""
    lines = ["| weights | classifier | method | budget | KL vs float (nats) | top-1 vs float | "
             f"perplexity | greedy match (of {m}) | weights read/step MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['weights']} | {r['classifier']} | {r['method']} | "
                     f"{r['budget'] or '-'} | {r['kl_vs_float']:.4f} | "
                     f"{r['top1_vs_float']:.3f} | {r['perplexity']:.3f} | "
                     f"{r['match_prefix']:.1f} | {r['weight_bytes_per_step'] / 2**20:.1f} |")
    return "\n".join(lines)


def quantization_plot(rows: Sequence[dict], path: Path) -> None:
    """``quantization.png``: KL divergence against the float full cache (symlog axis) and the
    continuation's perplexity, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['weights']}\ncls {r['classifier']}\n{r['method']}"
              + (f"@{r['budget']}" if r["budget"] else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(rows) * 0.9), 4.5))
    for ax, key, name in ((axes[0], "kl_vs_float", "KL vs float full (nats)"),
                          (axes[1], "perplexity", "perplexity of the real continuation")):
        ax.bar(range(len(rows)), [r[key] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60)
        ax.set_ylabel(name)
        if key == "kl_vs_float":
            ax.set_yscale("symlog", linthresh=1e-3)
    fig.suptitle(f"{rows[0]['model']}: quantized weights x KV methods "
                 f"({rows[0]['prompt_tokens']} prompt tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kept_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per (method, budget), the shares of the needle's, the sinks', the
    recent and all prompt positions kept (%); ``n/a`` for an error row."""
    lines = ["| method | budget | needle | sinks | recent | overall |", "|---" * 6 + "|"]
    for r in rows:
        cells = ["n/a"] * 4 if "error" in r else \
            [f"{r[k]:.1f}" for k in ("needle", "sinks", "recent", "overall")]
        lines.append(f"| {r['method']} | {r['budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
