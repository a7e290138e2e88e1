"""RULER-style synthetic tasks under KV-cache compression: per-task and average accuracy for
every method and budget (RocketKV paper Tables 4-19, on tasks our code generates).

    python scripts/eval_ruler.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out results/accuracy [--tasks ...] [--lengths 4096] [--samples 5] \\
        [--methods ...] [--budgets 128 256 512] [--modes ...] [--limit N]

Samples (``scripts/ruler_tasks.py``; deterministic under ``--seed``): for every task and context
length, ``--samples`` samples drawn with seeds ``seed .. seed + samples - 1`` (``--split dev``:
from ``seed + 10000``, the development set for choosing defaults). The context gets
``length - (template + question)`` tokens, so a prompt holds about ``length`` tokens; the
samples of one task and length are padded with newline tokens to one length and decoded
together (``eval_common.pad_to_equal``). Each task decodes its own ``max_new_tokens``.

Scoring: RULER's string_match_all (the fraction of expected strings in the answer,
case-insensitive), averaged per task; the average row is the mean over tasks.

Modes (``--modes``, default both): as in ``scripts/eval_needle.py``.

Outputs in ``--out``, per mode: ``ruler[_qa].json`` (every answer and score), ``ruler[_qa].md``
(per-task and average accuracy per method and budget) and ``ruler[_qa].png`` (average
accuracy vs budget, one line per method).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from compression import UNBUDGETED  # noqa: E402
from generate import OneLineParser  # noqa: E402
from model import ConfigError  # noqa: E402
from scripts.eval_common import (  # noqa: E402
    DEV_SEED_OFFSET,
    Item,
    add_common_args,
    chat_pieces,
    check_common,
    configurations,
    evaluate_items,
    load,
    method_options,
    report_modes,
    resume_options,
    string_match_all,
)
from scripts.ruler_tasks import DEFAULT_ESSAYS, TASKS, load_essays, make_sample  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

DEFAULT_LENGTHS = (4096,)


def build_items(tok: Tokenizer, essays: str, tasks: Sequence[str], lengths: Sequence[int],
                samples: int, seed: int, split: str = "eval") -> list[Item]:
    """Every sample of every task and length, as chat items grouped by (task, length)."""
    def count(text: str) -> int:
        return len(tok.encode(text, bos=False))

    items = []
    base = seed + (DEV_SEED_OFFSET if split == "dev" else 0)
    for length in lengths:
        for task in tasks:
            for j in range(samples):
                # the template and question take their share of the prompt first
                probe = make_sample(task, 512, lambda t: len(t) // 4, base + j, essays)
                head, tail = chat_pieces(tok, probe.question, probe.answer_prefix)
                room = length - len(head) - len(tail) - 8  # keys differ by a few tokens
                try:
                    s = make_sample(task, room, count, base + j, essays)
                except ValueError as e:
                    raise ConfigError(f"{task} at {length} tokens: {e}") from None
                head, tail = chat_pieces(tok, s.question, s.answer_prefix)
                items.append(Item(head + tok.encode(s.context, bos=False), tail, s.outputs, {
                    "task": task, "length": length, "seed": base + j, "depth": s.depth,
                    "outputs": list(s.outputs), "max_new_tokens": s.max_new_tokens,
                    "group": (task, length)}, len(head)))
    return items


def task_rows(rows: Sequence[dict[str, Any]], items: Sequence[Item],
              tasks: Sequence[str]) -> list[dict[str, Any]]:
    """Per row: ``per_task`` {task: mean score over its items that ran, None if none ran} and
    ``score`` = the mean over tasks, None unless every task ran (an average over fewer tasks
    would not compare with the other rows)."""
    for r in rows:
        if "error" in r:
            continue
        per = {}
        for t in tasks:
            s = [x for x, it in zip(r["scores"], items) if it.meta["task"] == t and x is not None]
            per[t] = sum(s) / len(s) if s else None
        r["per_task"] = per
        vals = [v for v in per.values() if v is not None]
        r["score"] = sum(vals) / len(vals) if len(vals) == len(per) else None
    return list(rows)


def ruler_table(rows: Sequence[dict[str, Any]], tasks: Sequence[str]) -> str:
    """Markdown: one line per (method, budget), one column per task, then the average (%)."""
    lines = ["| method | budget | " + " | ".join(tasks) + " | average |",
             "|---|---" + "|---" * (len(tasks) + 1) + "|"]
    for r in rows:
        budget = "-" if r["budget"] is None else str(r["budget"])
        if "error" in r:
            cells = ["n/a"] * (len(tasks) + 1)
        else:
            cells = ["n/a" if r["per_task"][t] is None else f"{100 * r['per_task'][t]:.1f}"
                     for t in tasks] + ["n/a" if r["score"] is None else f"{100 * r['score']:.1f}"]
        lines.append(f"| {r['method']} | {budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Average accuracy vs budget, one line per method (methods without a budget: dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in result["rows"] if r.get("score") is not None]
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        if m in UNBUDGETED:
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


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, "results/accuracy")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS),
                   metavar="TASK", help=f"default: all ({' '.join(TASKS)})")
    p.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_LENGTHS),
                   help="prompt lengths in tokens (default 4096)")
    p.add_argument("--samples", type=int, default=5, help="samples per task and length")
    p.add_argument("--split", choices=["eval", "dev"], default="eval")
    p.add_argument("--essays", default=str(DEFAULT_ESSAYS), help="essay haystack directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_common(args)
        if args.samples <= 0:
            raise ConfigError("--samples must be positive")
        if not Path(args.essays).exists():
            raise ConfigError(f"essay haystack not found: {args.essays}")
        model, tok, device = load(args)
        too_long = [n for n in args.lengths if n + 96 > model.args.max_seq_len]
        if too_long:
            raise ConfigError(f"--lengths {too_long[0]} + the longest answer (96 tokens) exceed "
                              f"the model's context ({model.args.max_seq_len} tokens)")
        tasks = list(dict.fromkeys(args.tasks))
        items = build_items(tok, load_essays(args.essays), tasks, args.lengths, args.samples,
                            args.seed, args.split)
        if args.limit:
            items = items[:args.limit]
            tasks = [t for t in tasks if any(it.meta["task"] == t for it in items)]
        budgets = list(dict.fromkeys(args.budgets))
        configs = configurations(list(dict.fromkeys(args.methods)), budgets)
        got = evaluate_items(model, tok, items, configs, 24,
                             lambda a, it: string_match_all(a, it.outputs), modes=args.modes,
                             options=method_options(args), batch_size=args.batch_size,
                             progress=not args.no_progress,
                             **resume_options(args, "ruler", model, device))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report_modes(args, got, model, "ruler", {
        "tasks": tasks, "lengths": list(args.lengths), "samples": args.samples,
        "budgets": budgets,
        "items": [{k: v for k, v in it.meta.items() if k != "group"} | {"tokens": it.tokens}
                  for it in items]}, t0,
        lambda rows: ruler_table(rows, tasks), plot,
        rows_of=lambda rows: task_rows(rows, items, tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
