"""Predict the GPU decode step without a GPU: each kernel's time from the bytes it moves and its
launches, fitted to a measured profile, checked against it, and predicted for H100, H200 and B200.

    python scripts/predict_step.py      # llama-3.1-8b bf16: full vs rocketkv @256, 16K-128K
    python scripts/predict_step.py --devices B200 --context 131008 --budget 1024 \\
        --json step.json --md step.md

The model, its fit and what it cannot see: ``rocketkv/evals/step_model.py``'s docstring. The
default profile is ``results/NVIDIA-H200/profile-32768.json`` (2026-11-27, every kernel on; the
131008 profile ran the PyTorch path and cannot fit it); the hold-out is the same session's
``bench.py`` rows. Every figure is predicted, never measured. Exit status 1 when a kernel
family with at least 1% of the profiled step is predicted more than 25% off, 2 on bad input
(one ``error:`` line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser

ROOT = Path(__file__).resolve().parent.parent
DEVICE_KEYS = ("H100", "H200", "B200")  # step_model.DEVICES (checked there too)


def _batched(text: str) -> tuple[int, int]:
    """``B@N``: batch B at context N."""
    try:
        b, n = (int(x) for x in text.split("@"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCH@CONTEXT, got {text!r}") from None
    if b <= 0 or n <= 0:
        raise argparse.ArgumentTypeError(f"batch and context must be positive: {text!r}")
    return b, n


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=str(ROOT / "results/NVIDIA-H200/profile-32768.json"),
                   metavar="PATH", help="scripts/profile_step.py JSON to fit (default: the "
                   "2026-11-27 H200 profile at 32K)")
    p.add_argument("--bench", nargs="*", metavar="PATH",
                   default=[str(ROOT / "results/NVIDIA-H200/bench-20261127-071354.json")],
                   help="bench.py JSON files whose every-kernel rows on the profiled GPU are "
                   "the hold-out (default: the profile's session; none: --bench alone)")
    p.add_argument("--devices", nargs="+", choices=DEVICE_KEYS, default=list(DEVICE_KEYS))
    p.add_argument("--context", nargs="+", type=int, metavar="N",
                   default=[16384, 32768, 65536, 131008], help="prompt tokens (batch 1)")
    p.add_argument("--batched", nargs="*", type=_batched, default=[(16, 32768)],
                   metavar="B@N", help="extra rows of batch B at context N (default 16@32768)")
    p.add_argument("--budget", type=int, default=256, help="rocketkv's token budget (256)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens a run generates (64; the step is taken halfway)")
    p.add_argument("--json", metavar="PATH", help="write the fit, check and rows here")
    p.add_argument("--md", metavar="PATH", help="write the report as Markdown here")
    return p


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.step_model import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
