"""One document, many questions: the prefill saved by reusing the document, the memory it costs,
and whether the answers stay those of a single run, for question-aware and question-agnostic
reuse (``rocketkv.evals.document_reuse``).

    python scripts/document_reuse.py --methods full rocketkv snapkv_pp --budgets 256 \\
        --json results/serve/document-reuse.json --md results/serve/document-reuse.md

Without ``--document`` the document is the README's (3000 tokens of essays with one made-up
fact) and the questions its question and three more (``--questions FILE``: one a line). Exit
status 0 when every question-aware answer equals its single run, 1 otherwise, 2 on bad input
(one ``error:`` line, before the model loads).

Needle mode: does question-aware reuse (the document prefilled once, the question asked after
it) find the needle on every prompt where a single run of document + question does?

    python scripts/document_reuse.py --checkpoint Qwen2.5-Coder-0.5B-Instruct.gguf \\
        --needle-prompts 20 --context 4096 --methods full rocketkv --budgets 256 \\
        --max-new-tokens 16 --json needle-reuse.json --md needle-reuse.md

``--needle-prompts N`` answers the first N prompts of ``scripts/eval_needle.py``'s grid at one
context length (``--context``, tokens of the whole prompt; ``--depths`` depths from 0 to 1,
ceil(N / depths) needles, seed 0, the eval split, the essays' haystack) both ways and scores
them as eval_needle does; the table gives per method and budget the prompts each way found,
those the single run found and reuse missed, the answers equal token for token and each way's
prefill seconds. Exit status 0 when for every configuration reuse misses at most one prompt
the single run found, 1 otherwise (or when a configuration fails), 2 on bad input (one
``error:`` line; ``--needle-prompts`` with ``--document`` or ``--questions`` included).
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
    p.add_argument("--needle-prompts", type=int, default=None, metavar="N",
                   help="needle mode: N needle prompts, each answered by a single run and by "
                        "question-aware reuse (default: the README document's questions)")
    p.add_argument("--context", type=int, default=4096, metavar="TOKENS",
                   help="needle mode: tokens per prompt (default 4096)")
    p.add_argument("--depths", type=int, default=10,
                   help="needle mode: needle depths from 0 to 1 (default 10)")
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
