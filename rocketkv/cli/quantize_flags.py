"""``quantize.py``'s parser, torch-free: ``python quantize.py --help`` and its usage errors
come before torch and the engine load."""

from __future__ import annotations

from rocketkv.flags import CLASSIFIER_CHOICES, DTYPE_NAMES, GROUPSIZES, MODES, OneLineParser

DESCRIPTION = "Write a weight-only int8 or int4 checkpoint (the format: ``quantized.py``)."


def build_parser() -> OneLineParser:
    p = OneLineParser(description=DESCRIPTION)
    p.add_argument("--checkpoint", required=True,
                   help="HF directory, GGUF file, converted directory, short name or "
                        "random:NAME")
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES,
                   help="int4 only: input features per scale/zero group")
    p.add_argument("--out", metavar="DIR",
                   help="output directory (new or empty; default: ./<source name>-<mode>)")
    p.add_argument("--classifier", choices=CLASSIFIER_CHOICES, default="int8",
                   help="the classifier in int8 (default), in the layers' mode (same) or float")
    p.add_argument("--dtype", choices=DTYPE_NAMES,
                   help="dtype of the tensors kept in float (default: as stored; bfloat16 "
                        "for a GGUF source and random weights)")
    p.add_argument("--device", default="cpu", help="where to run the arithmetic (cpu, cuda)")
    p.add_argument("--no-progress", action="store_true")
    return p
