"""The dense decode kernels (kernels/dense.py) against cuBLAS at a model's projection shapes,
over a grid of launch configurations: which one reads the weights fastest.

    python scripts/bench_dense.py                        # CUDA: llama-3.1-8b, bf16, batch 1, 16
    python scripts/bench_dense.py --grid full --json results/NVIDIA-H100/bench_dense.json
    TRITON_INTERPRET=1 python scripts/bench_dense.py --device cpu --checkpoint stories260K \\
        --grid none --iters 1                            # a smoke run (CPU times mean nothing)

What it times, the rows, the tuned table and the quantized weights:
``rocketkv/evals/dense_bench.py``'s docstring.
"""

from __future__ import annotations

import sys

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.cli.common import OneLineParser
from rocketkv.evals.dense_bench import GRIDS, run
from rocketkv.flags import DTYPE_NAMES, add_config_option, add_device_option
from rocketkv.model import CONFIGS


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    add_config_option(p, choices=list(CONFIGS),
                      help="named model shape, random weights (default llama-3.1-8b)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--grid", choices=list(GRIDS), default="quick",
                   help="launch configurations tried beside the default (quick: 8, full: 72)")
    p.add_argument("--iters", type=int, default=20, help="timed replays per row")
    p.add_argument("--reps", type=int, default=20, help="launches per CUDA graph")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int)
    add_device_option(p)
    p.add_argument("--dtype", choices=DTYPE_NAMES)
    p.add_argument("--weights", nargs="+", default=["float"],
                   help="weight modes: float, int8, int4-g<G> (G = 32, 64, 128, 256)")
    p.add_argument("--json", metavar="PATH", help="rows (default ./<device>/"
                                                  "bench_dense-<time>.json)")
    p.add_argument("--tuned", metavar="PATH", help="also write each launch's fastest "
                   "configuration here, a table for rocketkv/kernels/tuned/")
    return p


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
