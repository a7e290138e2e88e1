"""Write a weight-only int8 or int4 checkpoint.

    python quantize.py --checkpoint CKPT --mode int8 [--out DIR]
    python quantize.py --checkpoint CKPT --mode int4 --groupsize 32|64|128|256 [--out DIR]

The same command as ``rocketkv quantize`` (installed); the code is ``rocketkv/cli/quantize.py``.
"""


from rocketkv.cli.quantize_flags import build_parser

if __name__ == "__main__":  # --help and usage errors before torch loads
    ARGS = build_parser().parse_args()

from rocketkv.cli.quantize import entry  # noqa: E402

if __name__ == "__main__":
    entry(ARGS)
