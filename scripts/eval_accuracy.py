"""Fidelity of KV-cache compression on a real checkpoint: agreement with the full cache,
perplexity of held-out text, KL divergence of next-token distributions, attention recall of the
selected tokens against Exact-TopK, and the bytes each method stores and reads.

    python scripts/eval_accuracy.py \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --context 2048 --budgets 128 256 512 --num-prompts 4 --out results/accuracy
    python scripts/eval_accuracy.py --checkpoint checkpoints/stories260K --context 400 \\
        --text ../shared/data/text/tinystories_*.txt --budgets 64 128 256 --json e.json

Quick run: ``--limit 1`` (at most one prompt per prompt length). SmolLM2 (8K context) takes
``--context`` up to 8160 with ``--max-new-tokens 32`` (several values: one table each,
e.g. ``2048 4096``); the recorded run (``results/accuracy``) is the command above, 2048 being
the default. stories260K (512-token context) needs ``--context`` <= 480 and
TinyStories ``--text``.

Definitions, intervals, outputs and runs in pieces: ``rocketkv/evals/fidelity_run.py``'s
docstring.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.cli.common import OneLineParser, deprecated_alias
from rocketkv.compression import METHODS
from rocketkv.data import ESSAYS
from rocketkv.evals.fidelity import DEFAULT_TEXTS
from rocketkv.evals.fidelity_run import run
from rocketkv.evals.harness import DEFAULT_BUDGETS, DEFAULT_METHODS
from rocketkv.flags import DTYPE_NAMES, add_time_limit_option

DEFAULT_PROMPT_TOKENS = (2048,)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint (GGUF file, HF or converted directory, short name)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--text", nargs="+", default=[str(t) for t in DEFAULT_TEXTS],
                   metavar="PATH", help="text files, directories of *.txt files or .json "
                   'files with a "text" field (RULER_PaulGrahamEssays.json: 16K- and 32K-token '
                   f"windows) for the prompt set (default: {ESSAYS})")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   choices=list(METHODS), metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (default: {' '.join(DEFAULT_METHODS)})")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS),
                   metavar="N", help="token budgets (default "
                   f"{' '.join(map(str, DEFAULT_BUDGETS))})")
    p.add_argument("--max-new-tokens", type=int, default=32, help="m (default 32)")
    p.add_argument("--context", nargs="+", type=int, default=list(DEFAULT_PROMPT_TOKENS),
                   metavar="T", help="prompt lengths T, BOS prefix included; one table each "
                   "(default 2048, for SmolLM2; stories260K needs <= 480)")
    p.add_argument("--num-prompts", type=int, default=4, help="N per prompt length (default 4)")
    p.add_argument("--limit", type=int, help="quick run: at most this many prompts per length")
    p.add_argument("--seed", type=int, default=0,
                   help="0 (default): evenly spread windows; other: a seeded random choice")
    p.add_argument("--out", metavar="DIR",
                   help="write fidelity.json, fidelity.md and fidelity.png to DIR")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="the model's weights and activations (default float32)")
    add_time_limit_option(
        p, "start no prompt after this many seconds of evaluation (needs --out): the tables "
           "cover the prompts finished (the JSON's 'unfinished' counts the rest) and the same "
           "command later runs only the rest, from the prompts kept in "
           "DIR/fidelity_T.partial.jsonl")
    p.add_argument("--restart", action="store_true",
                   help="discard the saved prompts of another run (other prompts, settings or "
                   "engine code) in --out's fidelity_T.partial.jsonl instead of stopping")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    deprecated_alias(p, "--prompt-tokens", "--context")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
