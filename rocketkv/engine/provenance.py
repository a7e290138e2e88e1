"""Provenance of a result file: the code, the libraries, the checkpoint and the command that
produced it, so that results of different code are never merged unknowingly
(``scripts/accuracy_summary.py`` groups by ``commit``).

    from rocketkv.engine.provenance import provenance
    result["provenance"] = provenance(args.checkpoint)

``provenance`` returns a JSON-ready dict:

* ``commit``: ``git rev-parse HEAD`` of the repository holding this file (None outside a git
  checkout or without git), ``dirty``: whether ``git status --porcelain`` lists any tracked
  or untracked change (None when unknown; a dirty tree's results are not those of the commit);
* ``python``, ``torch``, ``transformers``, ``tokenizers`` and ``gguf`` (None when not
  installed) versions;
* ``cpu``: the processor's ``model`` name, its ``cores`` (``os.cpu_count``),
  ``native_bf16`` (``cpu_has_native_bf16``: bfloat16 sums run in another order where it is
  emulated, so a bfloat16 answer can differ, rarely, between machines) and ``isa``, the
  instruction-set extensions among ``ISA_FLAGS`` it has (VNNI decides int8 activations' bits);
* ``checkpoint``: the path, its ``sha256`` (of the file; of a directory, over its files' names
  and bytes in sorted order; None for ``random:`` configurations) and ``quantization``: for a
  GGUF file, the count of tensors per GGML type (e.g. {"Q4_K": 120, "F32": 121}) and the
  file's ``general.name``; for other checkpoints, the dtypes listed in ``config.json``
  (``torch_dtype``) when present;
* ``command``: ``sys.argv`` as run (``argv``), joined with shell quoting.

Hashing a 500 MB checkpoint reads it once (about a second); the digest is cached per path,
size and modification time within a process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rocketkv.errors import ConfigError
from rocketkv.formats.gguf_reader import gguf_field, is_gguf, open_gguf

ROOT = Path(__file__).resolve().parents[2]  # the checkout (git reads the commit there)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the repository holding this module; (None, None) when unknown.
    ``ROCKETKV_COMMIT`` in the environment names the commit instead, with ``dirty`` None
    (unknown): for a copy of the tree whose ``.git`` is absent or not this tree's, as the GPU
    machine's copy was on 2026-11-27 (``git rev-parse HEAD`` there named an older commit)."""
    if os.environ.get("ROCKETKV_COMMIT"):
        return os.environ["ROCKETKV_COMMIT"].strip(), None
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _git("status", "--porcelain")
    return commit.strip(), (None if status is None else bool(status.strip()))


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo's text, read once; "" where it cannot be read."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively: ``amx_bf16`` or ``avx512_bf16`` among the
    flags of ``cpuinfo`` (default: /proc/cpuinfo; False where it cannot be read). There the
    harness defaults to bfloat16, the RocketKV paper's dtype and the GPU's: on this project's
    2-core Xeon VM that ran the needle harness 1.5x faster than float32 and scored full,
    Exact-TopK, RocketKV, SnapKV++ and SparQ at 256 alike on 20 development prompts.
    Elsewhere bfloat16 is emulated, slower than float32: 2.7x slower for one 4K RULER prompt
    on a 2-core AVX2 EPYC VM (2026-11-29, 1,270 s against 461 s, one thread each)."""
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    return re.search(r"\b(amx_bf16|avx512_bf16)\b", cpuinfo) is not None


# instruction-set extensions a result depends on: vector width and FMA (speed), VNNI (8-bit
# int8 activations, quantized._reduce_range), bfloat16 and AMX (sums and speed)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8")


def cpu_fields(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model": the first ``model name`` of ``cpuinfo`` (default /proc/cpuinfo; else
    ``platform.processor()`` or ``platform.machine()``), "cores": ``os.cpu_count()``,
    "native_bf16": ``cpu_has_native_bf16(cpuinfo)``, "isa": the ``ISA_FLAGS`` among the
    first ``flags`` line, in that order}."""
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    model = m.group(1).strip() if m else platform.processor() or platform.machine()
    f = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    flags = set(f.group(1).split()) if f else set()
    return {"model": model, "cores": os.cpu_count(),
            "native_bf16": cpu_has_native_bf16(cpuinfo),
            "isa": [x for x in ISA_FLAGS if x in flags]}


def cpu_model() -> str:
    """The CPU's model name (``cpu_fields``)."""
    return cpu_fields()["model"]


def load_average() -> float | None:
    """The machine's 1-minute load average (other processes compete for the CPU); None where
    the system has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def commit_fields() -> dict[str, Any]:
    """``{"commit": ..., "dirty": ...}`` (``git_state``) for a result row or file header."""
    commit, dirty = git_state()
    return {"commit": commit, "dirty": dirty}


@functools.lru_cache(maxsize=8)
def _sha256_file(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_sha256(path: str | Path) -> str | None:
    """sha256 (hex) of a checkpoint file, or of a directory's files (relative name, NUL, the
    file's own sha256, in sorted order); None for a path that does not exist."""
    p = Path(path)
    if p.is_file():
        st = p.stat()
        return _sha256_file(p.resolve(), st.st_size, st.st_mtime_ns)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file()):
            st = f.stat()
            h.update(str(f.relative_to(p)).encode() + b"\0"
                     + _sha256_file(f.resolve(), st.st_size, st.st_mtime_ns).encode())
        return h.hexdigest()
    return None


def quantization(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint's weight types: for a GGUF file {"format": "gguf", "name":
    general.name, "tensor_types": {GGML type name: tensor count}}; for a directory with a
    ``config.json`` {"format": "config.json", "torch_dtype": ...}; None otherwise (or when
    the file cannot be read)."""
    p = Path(path)
    if is_gguf(p):
        try:
            reader = open_gguf(p)
        except ConfigError:
            return None
        types: dict[str, int] = {}
        for t in reader.tensors:
            name = getattr(t.tensor_type, "name", str(t.tensor_type))
            types[name] = types.get(name, 0) + 1
        return {"format": "gguf", "name": gguf_field(reader, "general.name", None),
                "tensor_types": dict(sorted(types.items()))}
    config = p / "config.json" if p.is_dir() else None
    if config is not None and config.is_file():
        try:
            dtype = json.loads(config.read_text()).get("torch_dtype")
        except (OSError, ValueError):
            dtype = None
        return {"format": "config.json", "torch_dtype": dtype}
    return None


def _version(package: str) -> str | None:
    """The installed distribution's version (without importing it), None when absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(checkpoint: str | Path | None = None,
               argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The run's provenance dict (see the module docstring); ``checkpoint`` as resolved
    (a path, or ``random:NAME``), ``argv`` default ``sys.argv``."""
    commit, dirty = git_state()
    argv = list(sys.argv if argv is None else argv)
    ck: dict[str, Any] | None = None
    if checkpoint is not None:
        ck = {"path": str(checkpoint), "sha256": checkpoint_sha256(checkpoint),
              "quantization": quantization(checkpoint)}
    return {"commit": commit, "dirty": dirty, "python": platform.python_version(),
            "torch": _version("torch"), "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"), "gguf": _version("gguf"),
            "cpu": cpu_fields(), "checkpoint": ck, "argv": argv, "command": shlex.join(argv)}
