"""Needle in a haystack under KV-cache compression: context lengths x depths, every method and
budget, one heatmap per method and budget (RocketKV paper Fig. 12).

    python scripts/eval_needle.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out results/accuracy [--context 1024 2048 4096 8000] [--depths 10] [--needles 5] \\
        [--methods ...] [--budgets 128 256 512] [--modes standard question_agnostic] \\
        [--limit N]

Prompts and scoring are ``evals/needle.py``'s (deterministic under ``--seed``): a haystack of
whole sentences of ``--text`` (default the Paul Graham essays of the data directory,
``evals/data.py``), every prompt of a context length exactly that long, the needle at the
sentence boundary nearest each depth, the question after the document in the chat template;
``--split dev`` draws the development prompts. Every prompt draws its own fact (no two prompts
of a grid share a key or number); ``--variant paraphrase`` asks a question sharing no content
word with the needle. An answer is right when the first number it states is the needle's
(whole numbers: "167921525" is not 1679215); the old substring score is kept in the rows as
``scores_substring``/``score_substring``. ``--needle``/``--question``/``--answer``/
``--answer-prefix`` replace the fact; a free-text answer is scored by ROUGE-1 recall of the
expected answer's words. The JSON records ``commit`` and ``provenance``
(``evals/provenance.py``).

Modes (``--modes``, default both, sharing each document's prefill): ``standard`` (the question
in the prompt) and ``question_agnostic`` (the document compressed first, the question appended
as the next chunk); see ``evals/harness.py``.

Outputs in ``--out``, per mode: ``needle.json``/``needle_qa.json`` (every prompt's answer and
score, the grid, the run's settings), ``.md`` (accuracy per method and budget) and ``.png``
(heatmaps: depth x length, accuracy averaged over the needles of each cell).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.cli.common import OneLineParser, rows_exit_status
from rocketkv.compression import given_options
from rocketkv.evals.harness import (
    add_common_args,
    check_common,
    check_runs,
    evaluate_items,
    load,
    resume_options,
    run_configurations,
)
from rocketkv.evals.needle import (
    VARIANTS,
    Haystack,
    add_needle_args,
    build_items,
    depth_grid,
    score_answer,
    substring_score,
)
from rocketkv.evals.prompts import read_texts
from rocketkv.evals.reports import (
    accuracy_table,
    add_substring_scores,
    needle_heatmaps,
    report_modes,
)
from rocketkv.model import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, "accuracy")
    add_needle_args(p)
    p.add_argument("--variant", choices=VARIANTS, default="standard",
                   help="paraphrase: a needle whose question shares no content word with it "
                        "(harder for methods that keep what the question's words attend to)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = ["scripts/eval_needle.py", *(sys.argv[1:] if argv is None else argv)]
    t0 = time.perf_counter()
    try:
        check_common(args)
        for flag in ("depths", "needles", "max_new_tokens"):
            if getattr(args, flag) <= 0:
                raise ConfigError(f"--{flag.replace('_', '-')} must be positive")
        custom = [args.needle, args.question, args.answer]
        if any(x is not None for x in custom) and not all(x is not None for x in custom):
            raise ConfigError("--needle, --question and --answer go together")
        texts = read_texts(args.text)
        check_runs(args, args.context, args.max_new_tokens)  # before the weights load
        model, tok, device = load(args)
        fact = None if args.needle is None else {
            "needle": args.needle, "question": args.question, "answer": args.answer,
            "answer_prefix": args.answer_prefix}
        depths = depth_grid(args.depths)
        items = build_items(tok, Haystack(tok, texts), args.context, depths, args.needles,
                            args.seed, args.split, fact, args.variant)
        if args.limit:
            items = items[:args.limit]
        configs, budgets = run_configurations(args)
        rouge = fact is not None
        got = evaluate_items(model, tok, items, configs, args.max_new_tokens,
                             lambda a, it, capped=None: score_answer(a, it, rouge),
                             modes=args.modes,
                             options=given_options(args), batch_size=args.batch_size,
                             progress=not args.no_progress,
                             **resume_options(args, "needle", model, device))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = report_modes(args, got, model, "needle", {
        "lengths": sorted({it.meta["length"] for it in items}), "depths": depths,
        "needles": args.needles, "budgets": budgets, "max_new_tokens": args.max_new_tokens,
        "scoring": "rouge1_recall" if rouge else "first_number", "variant": args.variant,
        "items": [{k: v for k, v in it.meta.items() if k != "group"} | {"tokens": it.tokens}
                  for it in items]}, t0,
        lambda rows: accuracy_table(rows, budgets), needle_heatmaps,
        rows_of=lambda rows: rows if rouge else add_substring_scores(rows, items,
                                                                     substring_score))
    return rows_exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
