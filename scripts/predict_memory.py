"""Predict the peak device memory of a run without a GPU: the model on the meta device.

    python scripts/predict_memory.py       # llama-3.1-8b bf16, 128K: full vs rocketkv at 256
    python scripts/predict_memory.py --config mistral-7b-v0.2 --context 32704 \\
        --methods full snapkv_pp --budgets 256 1024 --json out.json

How the model on the meta device gives the figures, and what they leave out:
``rocketkv/engine/memory_model.py``'s docstring.
"""

from __future__ import annotations

import sys

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, OneLineParser, add_config_option, deprecated_alias


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_config_option(p)
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"])
    p.add_argument("--budgets", nargs="+", type=int, default=[256])
    p.add_argument("--context", nargs="+", type=int, default=[131072 - 64], metavar="N")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    p.add_argument("--tp", nargs="+", type=int, default=[1], metavar="N",
                   help="tensor-parallel ranks (tp.py): the figures are per rank, and the table "
                        "says whether they fit on N H100s")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    deprecated_alias(p, "--new-tokens", "--max-new-tokens")
    return p


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.memory_prediction import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
