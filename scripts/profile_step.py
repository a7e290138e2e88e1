"""Where one decode step's time goes: the kernels of the compiled decode step by GPU time.

    python scripts/profile_step.py --context 131008 --methods full rocketkv --budgets 256 \
        --out results/NVIDIA-H200   # (default --out: the current directory)

What is recorded, the files and the exit status: ``rocketkv/evals/profile.py``'s docstring.
"""

from __future__ import annotations

import argparse
import sys

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import (
    DTYPE_NAMES,
    OneLineParser,
    add_config_option,
    add_device_option,
    add_kernels_option,
)


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_config_option(p, help="named model shape, random weights (default llama-3.1-8b)")
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"])
    p.add_argument("--budgets", nargs="+", type=int, default=[256])
    p.add_argument("--context", type=int, default=131072 - 64, metavar="N",
                   help="prompt tokens (default 131008)")
    p.add_argument("--steps", type=int, default=5, help="decode steps recorded")
    p.add_argument("--top", type=int, default=15, help="kernels per method in the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    add_device_option(p)
    p.add_argument("--dtype", choices=DTYPE_NAMES)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decode step (default: on for cuda)")
    p.add_argument("--compile-regime", choices=["static", "graphs"], default="static",
                   help="static: each configuration compiles its own graph (bench.py's "
                   "default); graphs: no torch.compile, the eager step captured in a CUDA graph "
                   "(CUDA only)")
    add_kernels_option(p)
    p.add_argument("--out", default=".", metavar="DIR",
                   help="directory for profile-<context>.{json,md} (default: the current one)")
    return p


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.profile import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
