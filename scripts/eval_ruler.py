"""RULER-style synthetic tasks under KV-cache compression: per-task and average accuracy for
every method and budget (RocketKV paper Tables 4-19, on tasks our code generates).

    python scripts/eval_ruler.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out results/accuracy [--tasks ...] [--context 4096] [--samples 5] \\
        [--methods ...] [--budgets 128 256 512] [--modes ...] [--limit N]

Samples (``evals/ruler.py``; deterministic under ``--seed``): for every task and context
length, ``--samples`` samples drawn with seeds ``seed .. seed + samples - 1`` (``--split dev``:
from ``seed + 10000``, the development set for choosing defaults). The context gets
``length - (template + question)`` tokens, so a prompt holds about ``length`` tokens; the
samples of one task and length are padded with newline tokens to one length and decoded
together (``evals.harness.pad_to_equal``). Each task decodes its own ``max_new_tokens``.

Samples are independent: each (task, length, sample) draws its own keys, values and words
from a hashed seed, and no two prompts of a grid share a fact (``evals.ruler.build_items``).

Scoring (``evals.ruler.score_item``, ``score_task``): pass/fail on the first value stated for
the one-answer tasks (niah_single_*, niah_multikey), F1 of the distinct values stated for the
list tasks (niah_multiquery's values each under its own key), whole numbers and words on
boundaries; an answer that ran into its token cap (recorded per answer) has its last value,
which the cap may have cut, counted neither right nor wrong (a one-answer task left with no
complete value has no score and is left out of the means); averaged per task, the average row
being the mean over tasks. RULER's substring string_match_all is kept in the rows
(``scores_substring``, ``per_task_substring``) for comparison. The JSON records ``commit``
and ``provenance``, and ``scoring``: ``boundary_f1_capped`` (these rules; files of earlier
runs say ``boundary_f1``: no cap or key rule).

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

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.cli.common import OneLineParser, deprecated_alias, rows_exit_status
from rocketkv.compression import given_options
from rocketkv.data import ESSAYS
from rocketkv.evals.harness import (
    add_common_args,
    check_common,
    check_runs,
    evaluate_items,
    load,
    resume_options,
    run_configurations,
)
from rocketkv.evals.metrics import string_match_all
from rocketkv.evals.reports import add_substring_scores, report_modes, ruler_plot, ruler_table
from rocketkv.evals.ruler import (
    PASS_FAIL_TASKS,
    TASKS,
    build_items,
    load_essays,
    score_item,
    task_rows,
)
from rocketkv.model import ConfigError

DEFAULT_LENGTHS = (4096,)
SCORING = "boundary_f1_capped"  # the rules score_item applies (the JSON's "scoring")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, "accuracy")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS),
                   metavar="TASK", help=f"default: all ({' '.join(TASKS)})")
    p.add_argument("--context", nargs="+", type=int, default=list(DEFAULT_LENGTHS),
                   metavar="N", help="prompt lengths in tokens (default 4096)")
    deprecated_alias(p, "--lengths", "--context")
    p.add_argument("--samples", type=int, default=5, help="samples per task and length")
    p.add_argument("--split", choices=["eval", "dev"], default="eval")
    p.add_argument("--essays", default=str(ESSAYS), help="essay haystack directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = ["scripts/eval_ruler.py", *(sys.argv[1:] if argv is None else argv)]
    t0 = time.perf_counter()
    try:
        check_common(args)
        if args.samples <= 0:
            raise ConfigError("--samples must be positive")
        if not Path(args.essays).exists():
            raise ConfigError(f"essay haystack not found: {args.essays}")
        check_runs(args, args.context, 96)  # the longest answer; before the weights load
        model, tok, device = load(args)
        tasks = list(dict.fromkeys(args.tasks))
        items = build_items(tok, load_essays(args.essays), tasks, args.context, args.samples,
                            args.seed, args.split)
        if args.limit:
            items = items[:args.limit]
            tasks = [t for t in tasks if any(it.meta["task"] == t for it in items)]
        configs, budgets = run_configurations(args)
        got = evaluate_items(model, tok, items, configs, 24,
                             score_item,
                             modes=args.modes,
                             options=given_options(args), batch_size=args.batch_size,
                             progress=not args.no_progress,
                             **resume_options(args, "ruler", model, device))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = report_modes(args, got, model, "ruler", {
        "tasks": tasks, "lengths": list(args.context), "samples": args.samples,
        "budgets": budgets, "scoring": SCORING,
        "pass_fail_tasks": [t for t in tasks if t in PASS_FAIL_TASKS],
        "items": [{k: v for k, v in it.meta.items() if k != "group"} | {"tokens": it.tokens}
                  for it in items]}, t0,
        lambda rows: ruler_table(rows, tasks, items), ruler_plot,
        rows_of=lambda rows: task_rows(add_substring_scores(
            rows, items, lambda a, it: string_match_all(a, it.outputs)), items, tasks))
    return rows_exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
