"""``quantize.py``'s parser, torch-free: ``python quantize.py --help`` and its usage errors
come before torch and the engine load."""

from __future__ import annotations

from rocketkv.flags import CLASSIFIER_CHOICES, DTYPE_NAMES, GROUPSIZES, MODES, OneLineParser

DESCRIPTION = "Write a weight-only int8 or int4 checkpoint (the format: ``quantized.py``)."
SIZES = ", ".join(map(str, GROUPSIZES))


class QuantizeParser(OneLineParser):
    """``OneLineParser`` that also refuses, as a one-line usage error, ``--mode int4`` without
    ``--groupsize`` and ``--mode int8`` with one, when ``check_groups``; ``quantized.
    check_quantizable`` refuses them again, in the same words, for callers of
    ``quantize_checkpoint``."""

    check_groups = True

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        mode, groupsize = getattr(namespace, "mode", None), getattr(namespace, "groupsize", None)
        if self.check_groups and mode == "int4" and groupsize is None:
            self.error(f"--mode int4 needs --groupsize ({SIZES})")
        if self.check_groups and mode == "int8" and groupsize is not None:
            self.error("--groupsize applies to int4 only (int8 is per output channel)")
        return namespace, rest


def build_parser(check_groups: bool = True) -> OneLineParser:
    """The parser of ``python quantize.py`` and ``rocketkv quantize``. ``check_groups``
    False: ``--mode``/``--groupsize`` mismatches pass the parser and are refused by
    ``quantize_checkpoint`` (``cli.quantize.main``, run in a process that goes on, returns
    that exit status instead of exiting)."""
    p = QuantizeParser(description=DESCRIPTION)
    p.check_groups = check_groups
    p.add_argument("--checkpoint", required=True,
                   help="HF directory, GGUF file, converted directory, short name or "
                        "random:NAME")
    p.add_argument("--mode", required=True, choices=MODES,
                   help=f"int8: one scale per output channel; int4: one scale and zero per "
                        f"group of input features, needs --groupsize ({SIZES})")
    p.add_argument("--groupsize", type=int, choices=GROUPSIZES,
                   help=f"input features per scale/zero group: required with --mode int4 "
                        f"(one of {SIZES}; smaller is more accurate and larger), not taken by "
                        "int8")
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
