"""The scripts' command lines without the engine: the parser whose usage errors are one line,
deprecated flag spellings, ``--kernels``, and the choices flags offer (dtype names, weight
modes and group sizes).

Nothing here imports torch or a module of the engine, so a script builds and parses its
arguments before loading them: ``--help`` and a usage error come back in a fraction of a
second instead of the seconds ``import torch`` takes. ``cli/common.py`` re-exports these
names beside the helpers that need torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Any

from rocketkv.method_tables import METHOD_OPTIONS, METHOD_TABLE

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype (cli.DTYPES maps them to torch's)
MODES = ("int8", "int4")  # quantize.py --mode (quantized.py)
CLASSIFIER_CHOICES = ("int8", "same", "float")  # --classifier
GROUPSIZES = (32, 64, 128, 256)  # int4's input features per scale/zero group


# --gguf-weights (gguf_quantized.py, docs/quantization.md)
GGUF_WEIGHTS = ("float", "quantized", "quantized-int8-classifier", "quantized-w8a8")
PROGRESS_TOKENS = 512  # prompts from this many tokens show a prefill progress bar
# One name a model: a short name of --checkpoint (the Hugging Face repository of the instruct
# model our users mean by it: checkpoint.resolve_checkpoint, scripts/download.py) is also the
# name of its shape in model.CONFIGS (random:NAME, --config NAME).
KNOWN_CHECKPOINTS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b-v0.2": "mistralai/Mistral-7B-Instruct-v0.2",
    "longchat-7b-v1.5-32k": "lmsys/longchat-7b-v1.5-32k",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
}
# Older spellings of those names, still accepted (with a note on stderr) for one release.
MODEL_ALIASES = {"llama3.1-8b": "llama-3.1-8b", "longchat-7b": "longchat-7b-v1.5-32k"}


def model_name(name: str) -> str:
    """``name`` in its one spelling: an old spelling (``MODEL_ALIASES``) becomes the current
    one, after a ``note:`` line on stderr; any other name is returned as it is."""
    if name in MODEL_ALIASES:
        print(f"note: the model name {name!r} is deprecated; use {MODEL_ALIASES[name]!r}",
              file=sys.stderr)
        return MODEL_ALIASES[name]
    return name


def method_epilog() -> str:
    """``--help``'s list of methods, one line each (``compression.help_epilog``'s text)."""
    width = max(len(name) for name, _ in METHOD_TABLE) + 2
    return "methods:\n" + "\n".join(f"  {name:<{width}}{text}" for name, text in METHOD_TABLE)


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one ``error: ...`` line and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, then the check of required options that have a deprecated spelling
        (``deprecated_alias``: argparse would not count the old spelling as giving them)."""
        namespace, rest = super().parse_known_args(args, namespace)
        missing = [a for a in getattr(self, "_required_aliased", ())
                   if getattr(namespace, a.dest, None) is None]
        if missing:
            self.error("the following arguments are required: "
                       + ", ".join(a.option_strings[0] for a in missing))
        return namespace, rest


def add_kernels_option(p: argparse.ArgumentParser) -> None:
    """``--kernels {auto,on,sparse,off}``: the fused Triton kernels of the decode step
    (``kernels/``) on CUDA: the attention and selection kernels behind the first-use
    self-check, and the dense projection kernels only on a GPU whose tuned table timed them
    faster than cuBLAS (auto, the default: a family that raises or returns wrong numbers on
    this GPU is switched off with one ``warning:`` line, ``rocketkv/engine/kernel_check.py``);
    all of them, with a self-check failure an error (on: for kernel development); the sparse
    ones only
    (sparse: the projections through PyTorch and cuBLAS); or none (off: the PyTorch path
    everywhere, the comparison the kernels are measured against). ``ROCKETKV_KERNELS=0`` is
    the same as off, ``ROCKETKV_KERNELS=sparse`` as sparse."""
    p.add_argument("--kernels", choices=["auto", "on", "sparse", "off"], default=None,
                   help="fused Triton kernels of the decode step on CUDA: the attention and "
                        "selection kernels, each family self-checked on first use and switched "
                        "off if it fails, and the dense projections where a tuned table timed "
                        "them faster than cuBLAS (auto, default); all, a failed self-check an "
                        "error (on); the attention and selection only (sparse); none (off)")


# The flag vocabulary: one spelling and one unit per concept in every entry point.
# Old spellings stay for one release as ``deprecated_alias``es; tests/test_flags.py walks every
# script's parser and fails on another spelling of these concepts. docs/flags.md lists them.
VOCABULARY = {
    "--checkpoint": "the weights: a checkpoint path (GGUF file, Hugging Face or converted "
                    "directory, quantize.py directory), a short name of "
                    "checkpoint.KNOWN_CHECKPOINTS, or random:CONFIG (random weights at a "
                    "named shape): whatever checkpoint.resolve_checkpoint takes",
    "--config": "a named model shape of model.CONFIGS (scripts that need no weights, or "
                "random ones)",
    "--context": "prompt length in tokens; a list where the script sweeps lengths",
    "--max-new-tokens": "tokens generated after the prompt",
    "--time-limit": "seconds (metavar SECONDS)",
    "--out": "a folder the script writes its files into (metavar DIR)",
    "--json": "one JSON file (metavar PATH)",
    "--device": "default: cuda if available, else cpu (cli.resolve_device(None))",
}


class _Deprecated(argparse.Action):
    """Stores into the new flag's destination after a one-line note on stderr."""

    def __init__(self, option_strings: list[str], dest: str, *, use: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.use = use

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"note: {option_string} is deprecated; use {self.use}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, *,
                     type: Any = None, use: str | None = None) -> None:
    """Accept ``old`` (e.g. ``--model``) as a hidden spelling of the option ``new`` (e.g.
    ``--checkpoint``), added to ``parser`` before: the same destination, type, choices and
    number of values, left out of ``--help``; using it prints ``note: OLD is deprecated; use
    NEW`` on stderr. A required ``new`` may be given by either spelling (``OneLineParser``
    checks it after parsing). ``type`` replaces the new option's argparse type for the old
    spelling (a unit conversion: ``--time-limit-min`` gives minutes as seconds); ``use``
    replaces NEW in the note.

    Raises:
        ValueError: ``parser`` has no option ``new``.
    """
    action = next((a for a in parser._actions if new in a.option_strings), None)
    if action is None:
        raise ValueError(f"the parser has no option {new}")
    if action.required:  # given by either spelling: OneLineParser checks it after parsing
        if not isinstance(parser, OneLineParser):
            raise ValueError(f"a required {new} takes an alias in a OneLineParser only")
        action.required = False
        parser._required_aliased = [*getattr(parser, "_required_aliased", ()), action]
    group = next((g for g in parser._mutually_exclusive_groups if action in g._group_actions),
                 parser)  # an option of a mutually exclusive group: the old spelling too
    group.add_argument(old, dest=action.dest, nargs=action.nargs,
                        type=action.type if type is None else type,
                        choices=action.choices, metavar=action.metavar,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                        action=partial(_Deprecated, use=use or new))


def is_deprecated(action: argparse.Action) -> bool:
    """Whether ``action`` is an old spelling added by ``deprecated_alias``."""
    return isinstance(action, _Deprecated)


def _minutes(text: str) -> float:
    """``--time-limit-min`` (deprecated): minutes, stored as seconds."""
    try:
        return 60 * float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None


class _SecondsNow(argparse.Action):
    """``--time-limit`` of a script that took minutes before: stores the seconds and says, in
    one ``note:`` line, that the unit changed (so old minutes are not read as seconds
    unnoticed)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"note: {option_string} is in seconds now (it was minutes): stopping after "
              f"{values:g} s; --time-limit-min takes minutes for one more release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_time_limit_option(p: argparse.ArgumentParser, help: str, *,
                          was_minutes: bool = False) -> None:
    """``--time-limit SECONDS`` (float, default None: no limit) with ``help``.
    ``was_minutes``: the script took minutes before (the evals harness: eval_needle.py,
    eval_ruler.py, kept_tokens.py): every use prints a ``note:`` that the unit changed, and
    the deprecated ``--time-limit-min MINUTES`` still takes minutes (stored as seconds)."""
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   action=_SecondsNow if was_minutes else "store", help=help)
    if was_minutes:
        deprecated_alias(p, "--time-limit-min", "--time-limit", type=_minutes,
                         use="--time-limit SECONDS")


def add_device_option(p: argparse.ArgumentParser) -> None:
    """``--device`` (default None: cuda if available, else cpu; ``cli.resolve_device``)."""
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default: cuda if available, else cpu)")


def named_config(args: argparse.Namespace, configs: Any, default: str) -> str | None:
    """The shape of a script that takes ``--config NAME`` or ``--checkpoint`` (weights):
    ``args.config``; ``default`` when neither was given; None when ``--checkpoint`` names the
    weights. ``--checkpoint NAME`` with NAME a config of ``configs`` and no such path (the
    shape, in older releases) still means ``--config NAME`` for one release, with a ``note:``."""
    if args.config is not None:
        return args.config
    if args.checkpoint is None:
        return default
    if args.checkpoint in configs and not os.path.exists(args.checkpoint):
        print(f"note: --checkpoint {args.checkpoint} for a model shape is deprecated; use "
              f"--config {args.checkpoint} (or --checkpoint random:{args.checkpoint})",
              file=sys.stderr)
        return args.checkpoint
    return None


def add_config_option(p: argparse.ArgumentParser, default: str | None = "llama-3.1-8b", *,
                      checkpoint_alias: bool = True, **kwargs: Any) -> None:
    """``--config NAME``: a named model shape (``model.CONFIGS``; checked where the script
    loads it, or by ``choices`` given in ``kwargs``). ``checkpoint_alias``: the script took the
    shape as ``--checkpoint NAME`` (and ``--model NAME``) before: both stay as deprecated
    spellings for one release."""
    p.add_argument("--config", default=default, metavar="NAME",
                   help=kwargs.pop("help", None) or
                   f"named model shape (model.CONFIGS; default {default})", **kwargs)
    if checkpoint_alias:
        deprecated_alias(p, "--checkpoint", "--config")
        deprecated_alias(p, "--model", "--config")


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


def add_method_flags(parser: argparse._ActionsContainer) -> None:
    """Every method option as a CLI flag (default None), as ``compression.add_method_options``
    adds it, without importing the methods (``method_tables.METHOD_OPTIONS``, generated from
    the registry)."""
    types = {"int": int, "float": float, "str": str, "layer_list": layer_list}
    for name, type_name, choices, metavar, help_ in METHOD_OPTIONS:
        type_ = None if type_name is None else types[type_name]
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
