"""Rescore stored RULER answers: a value cut by the token cap is neither right nor wrong, and
niah_multiquery counts a value only under its own key (``rocketkv.evals.rescore``).

    python scripts/rescore_ruler.py results/accuracy/M/ruler_4k/ruler.json \\
        results/accuracy/M/ruler_8k/ruler.json \\
        --tokenizer ~/.cache/rocketkv-data/Qwen2.5-Coder-0.5B-Instruct.gguf \\
        --json rescored.json --md rescored.md

An answer counts as stopped by its cap when its text, re-tokenized with ``--tokenizer`` (the
checkpoint that wrote it), holds at least the item's ``max_new_tokens - 1`` tokens (an
approximation: re-tokenized text may differ by a token from the generated one). Per file and
per method and budget: the file's score, the new one, each rule alone, the answers treated as
capped, the cut values dropped, the items scored None, and per task old -> new. The input
files are not written. Exit status 0, 2 on bad input (one ``error:`` line, before the
tokenizer loads).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="RULER_JSON",
                   help="result files of scripts/eval_ruler.py (ruler.json, ruler_qa.json)")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="the tokenizer of the checkpoint that wrote the answers (a GGUF, "
                        "tokenizer.json or checkpoint directory)")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure here")
    p.add_argument("--md", metavar="PATH", default=None, help="write the tables here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":  # --help and usage errors before the engine loads
    ARGS = build_parser().parse_args()

from rocketkv.evals.rescore import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
