"""Does an answer depend on --max-new-tokens? Every method answers one prompt with a short and a
long ``--max-new-tokens`` (greedy); the first tokens must be the same.

    python scripts/answer_length.py --short 64 --long 5000 \\
        --json results/answer-length/smollm2-readme-prompt.json

Without ``--prompt`` the prompt is the README's document question: ``scripts/make_prompt.py``
over the Paul Graham essays at 3000 tokens counted by the checkpoint's tokenizer (one made-up
fact in the middle, a question about it at the end), through the chat template (``--chat``, the
default for an instruct checkpoint). Rows (``rocketkv.evals.answer_length.compare``): per
method and budget, both answers' token ids, the index of the first difference (none: the same)
and the long run's parameters as of its last step (``--json``). Exit status 1 when an answer
differs, 2 on bad input (one ``error:`` line, before the model loads).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, OneLineParser

ALL = ["full", "exact_topk", "snapkv", "snapkv_pp", "quest", "sparq", "hybrid", "rocketkv",
       "streamingllm", "h2o", "duoattention", "keydiff", "omnikv"]


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None,
                   help="model (default: the SmolLM2-135M-Instruct GGUF, as generate.py)")
    p.add_argument("--prompt", default=None,
                   help="a prompt file (default: the README's 3000-token document question)")
    p.add_argument("--methods", nargs="+", default=ALL,
                   help="methods, METHOD or METHOD@B1,B2 (default: every method)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256],
                   help="token budgets of the budgeted methods (default 256)")
    p.add_argument("--short", type=int, default=64, help="new tokens of the short run (64)")
    p.add_argument("--long", type=int, default=5000, help="new tokens of the long run (5000)")
    p.add_argument("--chat", action=__import__("argparse").BooleanOptionalAction, default=None,
                   help="the prompt as a user turn of the chat template (default: when the "
                   "checkpoint has one)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="activation dtype (default: generate.py's for the device)")
    p.add_argument("--step", choices=("eager", "default"), default="eager",
                   help="the decode step of both runs: eager (default: they differ only in "
                   "what they ask for), or generate.py's default (on a CPU a run of 1,024 "
                   "steps or more is compiled, whose arithmetic differs in the last bits)")
    p.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.answer_length import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
