"""The scripts' command lines without the engine: the parser whose usage errors are one line,
deprecated flag spellings, ``--kernels``, and the choices flags offer (dtype names, weight
modes and group sizes).

Nothing here imports torch or a module of the engine, so a script builds and parses its
arguments before loading them: ``--help`` and a usage error come back in a fraction of a
second instead of the seconds ``import torch`` takes (issue 46). ``cli.py`` re-exports these
names beside the helpers that need torch.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype (cli.DTYPES maps them to torch's)
MODES = ("int8", "int4")  # quantize.py --mode (quantized.py)
CLASSIFIER_CHOICES = ("int8", "same", "float")  # --classifier
GROUPSIZES = (32, 64, 128, 256)  # int4's input features per scale/zero group


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one ``error: ...`` line and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def add_kernels_option(p: argparse.ArgumentParser) -> None:
    """``--kernels {auto,sparse,off}``: the fused Triton kernels of the decode step
    (``kernels/``) on CUDA: all of them (auto, the default), the sparse ones only (sparse: the
    projections through PyTorch and cuBLAS), or none (off: the PyTorch path everywhere, the
    comparison the kernels are measured against). ``ROCKETKV_KERNELS=0`` is the same as off,
    ``ROCKETKV_KERNELS=sparse`` as sparse."""
    p.add_argument("--kernels", choices=["auto", "sparse", "off"], default=None,
                   help="fused Triton kernels of the decode step on CUDA: all (auto, "
                        "default), the attention and selection only (sparse), or none (off)")


class _Deprecated(argparse.Action):
    """Stores into the new flag's destination after a one-line note on stderr."""

    def __init__(self, option_strings: list[str], dest: str, *, use: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.use = use

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"note: {option_string} is deprecated; use {self.use}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept ``old`` (e.g. ``--model``) as a hidden spelling of the option ``new`` (e.g.
    ``--checkpoint``), added to ``parser`` before: the same destination, type, choices and
    number of values, left out of ``--help``; using it prints ``note: OLD is deprecated; use
    NEW`` on stderr.

    Raises:
        ValueError: ``parser`` has no option ``new``.
    """
    action = next((a for a in parser._actions if new in a.option_strings), None)
    if action is None:
        raise ValueError(f"the parser has no option {new}")
    parser.add_argument(old, dest=action.dest, nargs=action.nargs, type=action.type,
                        choices=action.choices, metavar=action.metavar,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                        action=partial(_Deprecated, use=new))
