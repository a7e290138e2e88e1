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
    """``--kernels {auto,on,sparse,off}``: the fused Triton kernels of the decode step
    (``kernels/``) on CUDA: all of them behind the first-use self-check (auto, the default:
    a family that raises or returns wrong numbers on this GPU is switched off with one
    ``warning:`` line, ``kernels/check.py``), the same with a self-check failure an error
    (on: for kernel development), the sparse ones only (sparse: the projections through
    PyTorch and cuBLAS), or none (off: the PyTorch path everywhere, the comparison the kernels
    are measured against). ``ROCKETKV_KERNELS=0`` is the same as off,
    ``ROCKETKV_KERNELS=sparse`` as sparse."""
    p.add_argument("--kernels", choices=["auto", "on", "sparse", "off"], default=None,
                   help="fused Triton kernels of the decode step on CUDA: all, each family "
                        "self-checked on first use and switched off if it fails (auto, "
                        "default), all with a failed self-check an error (on), the attention "
                        "and selection only (sparse), or none (off)")


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


def layer_list(text: str) -> list[int]:
    """``--filter-layers 2,8,18`` -> [2, 8, 18] (argparse type; a bad list is a usage error)."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got "
                                         f"{text!r}") from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


# Every method option's flag as ``compression.add_method_options`` adds it (``registry.Option``:
# name, argparse type or None for a switch, choices, metavar, help), for parsers built before
# torch loads; tests/test_entry_points.py fails, printing the current list, when the registry
# differs. What each option does and which methods read it: docs/methods.md.
METHOD_OPTIONS: tuple[tuple[str, Any, tuple | None, str | None, str], ...] = (
    ("kernel_size", int, None, None,
     "SnapKV/SnapKV++/RocketKV pooling kernel (odd; default 7 for snapkv, 63/511 by prompt "
     "length for snapkv_pp and rocketkv)"),
    ("pooling", str, ("avg", "max"), None,
     "snapkv pooling (default avg)"),
    ("window", int, None, None,
     "observation window in tokens (default 32)"),
    ("page_size", int, None, None,
     "quest page size (default max(16, tokens / (budget / 2)))"),
    ("sparq_reallocate", None, None, None,
     "sparq: mix in the mean value by the unselected probability mass"),
    ("sparq_strided_keys", None, None, None,
     "sparq: no dim-major copy of K (storage 1x instead of 1.5x the full cache); the r dims "
     "are then a strided read of every key row"),
    ("rocket_split", str, ("sqrt", "adaptive"), None,
     "RocketKV budget split between stages (default sqrt: paper v1)"),
    ("sink_size", int, None, None,
     "streamingllm: attention sinks kept (default 4)"),
    ("heavy_ratio", float, None, None,
     "h2o: share of the budget for heavy hitters (default 0.5)"),
    ("duo_patterns", str, None, "PATH",
     "duoattention: head gates, a TSV (layers x KV heads) or a directory with "
     "full_attention_heads.tsv; needed above a 640-token budget (default: the one in patterns/"
     " made for the model, if any)"),
    ("duo_threshold", float, None, None,
     "duoattention: gates above this retrieve (the pattern's own split, DuoAttention deploys "
     "0.5); default: the budget sets the share"),
    ("block_size", int, None, None,
     "keydiff: prompt tokens per prefill block (default 128); cache memory stays within budget"
     " + block"),
    ("filter_layers", layer_list, None, "L1,L2,...",
     "omnikv: filter layers (default: the paper's 2,8,18 for 32 layers, scaled to other "
     "depths)"),
    ("omnikv_selector", str, ("last", "uniform", "exponential"), None,
     "omnikv: context selector over its observation window (default last)"),
    ("offload", None, None, None,
     "omnikv: keep the sparse layers' K/V in host memory (runs eagerly)"),
    ("skip_layers", int, None, None,
     "leave the first N layers uncompressed (the paper: 2 for LongChat)"),
)


def add_method_flags(parser: argparse._ActionsContainer) -> None:
    """Every method option as a CLI flag (default None), as ``compression.add_method_options``
    adds it, without importing the methods (``METHOD_OPTIONS``)."""
    for name, type_, choices, metavar, help_ in METHOD_OPTIONS:
        flag = "--" + name.replace("_", "-")
        if type_ is None:
            parser.add_argument(flag, action="store_true", help=help_)
            continue
        kw: dict[str, Any] = {"type": type_, "help": help_}
        if choices is not None:
            kw["choices"] = list(choices)
        if metavar is not None:
            kw["metavar"] = metavar
        parser.add_argument(flag, **kw)
