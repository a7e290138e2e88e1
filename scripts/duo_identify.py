"""DuoAttention's retrieval-head identification for any model: one gate per KV head, learned.

    python scripts/duo_identify.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out rocketkv/patterns/SmolLM2-135M-Instruct [--steps 80] [--context 512 1024] \\
        [--sink 32 --recent 64] [--text FILE_OR_DIR]

The optimization, the data and the output: ``rocketkv/evals/duo_identify.py``'s docstring.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.data import TEXT  # (paths only: no torch)
from rocketkv.flags import OneLineParser, add_device_option, deprecated_alias

DEFAULT_TEXT = TEXT / "tinystories_valid_excerpt_30KB.txt"


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint (GGUF file, HF or converted directory, short name)")
    p.add_argument("--tokenizer", help="tokenizer file (default: the checkpoint's)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="writes full_attention_heads.tsv and config.json here")
    p.add_argument("--text", default=str(DEFAULT_TEXT), metavar="PATH",
                   help="haystack: a text file or a directory of *.txt (default: TinyStories "
                        "text, disjoint from the accuracy harness's essays)")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps (default 80)")
    p.add_argument("--context", nargs=2, type=int, default=[512, 1024], metavar=("MIN", "MAX"),
                   help="sequence lengths drawn uniformly in [MIN, MAX] (default 512 1024)")
    p.add_argument("--sink", type=int, default=32, help="streaming sinks (default 32)")
    p.add_argument("--recent", type=int, default=64, help="streaming recent window (64)")
    p.add_argument("--passkeys", type=int, default=4, help="pass keys per sequence (default 4)")
    p.add_argument("--digits", type=int, default=8, help="digits per pass key (default 8)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam's (default 0.05; paper 0.02)")
    p.add_argument("--reg-weight", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    add_device_option(p)
    p.add_argument("--threads", type=int, help="CPU threads for torch")
    p.add_argument("--no-progress", action="store_true")
    deprecated_alias(p, "--lengths", "--context")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

from rocketkv.evals.duo_identify import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(ARGS))
