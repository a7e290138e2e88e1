"""One document, many questions: the prefill saved by reusing the document, the memory it costs,
and whether the answers stay those of a single run, for question-aware and question-agnostic
reuse (``rocketkv.evals.document_reuse``).

    python scripts/document_reuse.py --methods full rocketkv snapkv_pp --budgets 256 \\
        --json results/serve/document-reuse.json --md results/serve/document-reuse.md

Without ``--document`` the document is the README's (3000 tokens of essays with one made-up
fact) and the questions its question and three more (``--questions FILE``: one a line). Exit
status 0 when every question-aware answer equals its single run, 1 otherwise, 2 on bad input
(one ``error:`` line, before the model loads).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, GGUF_WEIGHTS, OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None,
                   help="model (default: the SmolLM2-135M-Instruct GGUF, as generate.py)")
    p.add_argument("--document", default=None,
                   help="a document file (default: the README's 3000-token document)")
    p.add_argument("--questions", default=None, help="a file of questions, one a line")
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv", "snapkv_pp"],
                   help="methods, METHOD or METHOD@B1,B2 (default: full rocketkv snapkv_pp)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256],
                   help="token budgets of the budgeted methods (default 256)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="generated tokens at most per answer (default 32)")
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS, default=None,
                   help="a GGUF's weights as float or kept quantized (default: generate.py's)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="activation dtype (default: generate.py's for the device)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure here")
    p.add_argument("--md", metavar="PATH", default=None, help="write the table here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.document_reuse import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
