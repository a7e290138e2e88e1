"""Command-line helpers every entry point shares: dtypes, one-line usage errors, whole-file JSON
writes, early checks of paths and numbers, the device choice, prompt files, and the one flag
vocabulary of the scripts.

Every script names weights ``--checkpoint``, a model shape ``--config``, prompt tokens
``--context``, generated tokens ``--max-new-tokens``, a time limit in seconds ``--time-limit``,
methods ``--methods``, budgets ``--budgets``, an output directory ``--out``, a single output
file ``--json``, a quick run ``--limit`` and a quiet one ``--no-progress``; ``--device``
defaults to cuda if available, else cpu (``flags.VOCABULARY``, docs/flags.md). Spellings a
script used before stay for one release as hidden aliases (``deprecated_alias``) that say
which flag to use instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rocketkv import kernels
from rocketkv.engine.device import DTYPES, resolve_device  # noqa: F401  (re-exported)
from rocketkv.engine.report import write_stdout  # noqa: F401  (re-exported)
from rocketkv.flags import (  # noqa: F401  (the parser's half, torch-free: re-exported)
    DTYPE_NAMES,
    OneLineParser,
    add_kernels_option,
    deprecated_alias,
    layer_list,
)
from rocketkv.model import ConfigError


def apply_kernels_option(args: argparse.Namespace) -> None:
    """Set the kernel mode ``--kernels`` names (nothing when it was not given); ``on`` keeps
    ``set_mode("force")`` where it was set (``ROCKETKV_KERNELS=force``: the interpreter on
    CPU), runs the dense kernels wherever the others run and makes a failed self-check an
    error (``kernels.set_strict``); ``auto`` leaves the dense kernels to the GPU's tuned
    table (``kernels.set_dense(None)``)."""
    choice = getattr(args, "kernels", None)
    if choice:
        forced = choice == "on" and kernels.mode() == "force"
        kernels.set_mode("off" if choice == "off" else "force" if forced else "auto")
        kernels.set_dense(None if choice == "auto" else choice == "on")
        kernels.set_strict(choice == "on")


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` whole: a temporary file beside it, then
    ``os.replace``; on failure the temporary file is removed.

    Raises:
        ConfigError: the file cannot be written (the OS's reason).
    """
    tmp = Path(f"{path}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None


def check_json_path(path: str | None, flag: str = "--json") -> None:
    """Fail before a run whose JSON destination cannot be written: a missing directory, a
    directory in the file's place, or no write permission (a read-only filesystem included).

    Raises:
        ConfigError: naming the problem.
    """
    if not path:
        return
    dest = Path(path)
    parent = dest.resolve().parent
    if dest.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name")
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (dest.exists()
                                                    and not os.access(dest, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable (permissions or a read-only "
                          "filesystem)")


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    """ConfigError naming the first of ``flags`` (argparse dests) set to a value <= 0."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")


def read_prompt(path: str) -> str:
    """The text of prompt file ``path`` (``-``: stdin), without the newline that ends a text
    file.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, or holds only white space.
    """
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompt file {path}: {e}") from None
    if not text.strip():
        raise ConfigError(f"prompt file {path} is empty")
    return text.removesuffix("\n").removesuffix("\r")  # the newline that ends a text file


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command a result records: ``python scripts/SCRIPT.py`` and the arguments as given
    (``argv``, or the process's own when None)."""
    return " ".join([f"python scripts/{script}", *(sys.argv[1:] if argv is None else argv)])


def row_error(e: BaseException) -> str:
    """A failed benchmark row's ``error``: the first line of a ``ConfigError`` or an
    out-of-memory error (expected outcomes: a configuration refused, or too large); for any
    other exception (a kernel that fails to compile or to capture on a GPU) its type and first
    line, with the whole traceback printed to stderr for the log, so the run goes on to its
    other rows (a CUDA error, ``device_fault``, prints no traceback: it is asynchronous)."""
    first = (str(e).splitlines() or [""])[0]
    if isinstance(e, (ConfigError, torch.OutOfMemoryError)):
        return first
    if not device_fault(e):  # a CUDA error is asynchronous: its stack is not where it arose
        traceback.print_exception(e, file=sys.stderr)
    return f"{type(e).__name__}: {first}"


# Messages of CUDA errors: the runtime's own ("CUDA error: an illegal memory access was
# encountered", torch.AcceleratorError from torch 2.8, RuntimeError before) and those of a
# Triton launch ("Triton Error [CUDA]: ...").
device_fault = kernels.cuda_error  # a CUDA error: the device may be unusable after it


def release_device(device: torch.device) -> Exception | None:
    """After a failed row: wait for ``device``'s queued work and give the allocator's free
    blocks back (``torch.cuda.synchronize``, ``torch.cuda.empty_cache``); nothing on CPU.
    Never raises: returns the exception a broken device raised (an asynchronous error of the
    row surfaces here), else None."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 (the caller's error handler must not raise)
        return e
    return None


def fault_line(fault: tuple[str, BaseException], rows: Sequence[dict[str, Any]], path) -> str:
    """The one stderr line of a run a CUDA error ended (``device_fault``): the failing row's
    label and error, the rows measured and those not run, and where they are saved."""
    label, e = fault
    first = (str(e).splitlines() or [""])[0]
    done = sum("error" not in r for r in rows)
    rest = sum(str(r.get("error", "")).startswith("skipped: not run after") for r in rows)
    return (f"error: {label}: {type(e).__name__}: {first}; the device is unusable after it, so "
            f"the run stopped (rows measured: {done}, not run: {rest}; saved in {path})")


def rows_exit_status(rows: Sequence[dict[str, Any]], what: str = "configurations") -> int:
    """A script's exit status from its result rows: 1, with one ``error:`` line on stderr, when
    any requested row failed (it has an ``error``; rows a ``--time-limit`` skipped do not
    count), else 0. The rows that ran are written either way."""
    failed = [r for r in rows if "error" in r and not str(r["error"]).startswith("skipped:")]
    if not failed:
        return 0
    print(f"error: {len(failed)} of {len(rows)} {what} failed (their rows say why)",
          file=sys.stderr)
    return 1
