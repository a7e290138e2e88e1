"""Our engine against Hugging Face transformers: prefill time and decode ms/token of the same
checkpoint on the same prompt ids, in the same process on the same machine.

    python scripts/compare_hf.py --prompt-file prompt.txt --threads 2 --json compare_hf.json \\
        --checkpoint ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/compare_hf.py --checkpoint DIR --random --context 2048 7168

What it runs and records, the rows and the exit status: ``rocketkv/evals/compare_hf.py``'s
docstring.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, GGUF_WEIGHTS, OneLineParser

DEFAULT_CONTEXTS = (2048, 7168)


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="a GGUF file or a Hugging Face directory (config.json + safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", metavar="FILE",
                     help="prompt text, tokenized with our tokenizer, repeated/cut to each context")
    src.add_argument("--random", action="store_true", help="random prompt token ids (--seed)")
    p.add_argument("--tokenizer", help="tokenizer for --prompt-file (default: the checkpoint's)")
    p.add_argument("--context", nargs="+", type=int, default=list(DEFAULT_CONTEXTS),
                   metavar="N", help="prompt lengths in tokens (default 2048 7168)")
    p.add_argument("--methods", nargs="+", default=["full", "rocketkv"], metavar="METHOD",
                   help="our KV cache methods (python -m rocketkv.compression lists them; default: "
                        "full rocketkv)")
    p.add_argument("--budgets", nargs="+", type=int, default=[256], metavar="N",
                   help="token budgets of the compressing methods (default 256)")
    p.add_argument("--decode-steps", type=int, default=32,
                   help="timed decode steps per run (default 32)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="decode steps run before the timed ones, left out (default 2)")
    p.add_argument("--check-tokens", type=int, default=8,
                   help="greedy tokens recorded and compared between the engines (default 8)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each engine per configuration, the one with the lowest decode "
                        "median kept (default 1; more damp other processes' interference)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random ids (default 0)")
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="both engines' dtype (default float32)")
    p.add_argument("--compile", action="store_true",
                   help="compile our decode step (the warm-up steps cover compilation)")
    p.add_argument("--gguf-weights", choices=GGUF_WEIGHTS, default="float",
                   help="our weights of a GGUF (default float: dequantized, as transformers "
                        "loads them, so the greedy tokens are compared; quantized modes keep "
                        "its blocks, what a CPU user of ours runs: docs/quantization.md)")
    p.add_argument("--json", metavar="PATH",
                   help="rows JSON (default ./<device>/compare_hf-<timestamp>.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.compare_hf import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
