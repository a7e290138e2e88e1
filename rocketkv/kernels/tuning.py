"""Launch settings measured per GPU: the tables under ``rocketkv/kernels/tuned/``.

A table is a JSON file a benchmark wrote on a GPU (``scripts/bench_dense.py --tuned``,
``scripts/bench_step.py --tuned``), committed from a real run:

    {"device": "<torch.cuda.get_device_name>",
     "launches": [{"key": "<kernels.dense.launch_key>", "config": {<LAUNCH_KNOBS>}}, ...],
     "constants": {"sparse": {"SPLIT_PAGES": 4096, ...}, "dense": {...}}, ...}

``launches`` gives one dense launch its knobs (``kernels.dense.launch_knobs``); ``constants``
replaces module constants of ``kernels.sparse`` / ``kernels.dense`` (``CONSTANTS``) for the
whole process, once, when the kernels first run on a CUDA device of that name
(``apply_constants``, called by ``kernels.in_use`` and ``kernels.enabled``). Both keys are
optional; other keys (the times behind a choice, the rows file) are for the reader. Files
naming another GPU are ignored, and later files (by name) override earlier ones. Nothing here
runs off CUDA: the interpreter and the CPU path keep the modules' own constants.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

TUNED_DIR = Path(__file__).with_name("tuned")
LAUNCH_KNOBS = ("TARGET_PROGRAMS", "MAX_BLOCK_N", "K_BLOCK", "NUM_WARPS")  # a launch's config
POW2 = {"MAX_BLOCK_N": 1, "K_BLOCK": 16, "NUM_WARPS": 1}  # powers of two, at least this
CONSTANTS = {  # module -> constant -> the smallest power of two it must be (None: any >= 1)
    "sparse": {"SPLIT_PAGES": None, "MIN_SPLIT_PAGES": None, "PREFIX_SPLIT": None,
               "PREFIX_PROGRAMS": None, "PREFIX_WARPS": 1, "ATTEND_TOKENS": 16,
               "SPLIT_TOKENS": None, "SCORE_BLOCK": 16, "NUM_WARPS": 1},
    "dense": {"TARGET_PROGRAMS": None, "MAX_BLOCK_N": 1, "K_BLOCK_GEMV": 16, "K_BLOCK_DOT": 16,
              "NUM_WARPS": 1},
}


@dataclass
class Table:
    """A GPU's merged tables: launch key -> knobs, and module -> constant -> value."""

    launches: dict[str, dict[str, int]] = field(default_factory=dict)
    constants: dict[str, dict[str, int]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # the files merged, in order
    times: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (ours, ref) us

    @property
    def dense_faster(self) -> bool:
        """Whether the dense kernels, with the tuned knobs, beat the reference (cuBLAS, or
        torch's quantized matmuls) over the launches the tables timed: the sum of their
        ``us`` under the sum of their ``reference_us``. False without such times: the dense
        kernels then stay off by default (``kernels.dense_in_use``)."""
        if not self.times:
            return False
        return sum(t[0] for t in self.times.values()) < sum(t[1] for t in self.times.values())


_tables: dict[str, Table] = {}  # GPU name -> its merged table
_applied: set[str] = set()  # GPU names whose constants this process has set
_names: dict[torch.device, str] = {}  # device -> its GPU's name, asked once (the decode
# step asks for the table at every launch where it runs eagerly)


def gpu_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name(device)``, looked up once per device."""
    if device not in _names:
        _names[device] = torch.cuda.get_device_name(device)
    return _names[device]


def table_device(device: torch.device) -> str:
    """The ``device`` a table measured on ``device`` records: its GPU's name, which the
    kernels look tables up by; off CUDA the device type (such a table never applies)."""
    return gpu_name(device) if device.type == "cuda" else device.type


def value_error(name: str, value, low: int | None) -> str | None:
    """Why ``value`` cannot be ``name`` (a positive integer; a power of two of at least
    ``low`` when ``low`` is given), or None."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return f"{name} must be a positive integer, got {value!r}"
    if low is not None and (value < low or value & (value - 1)):
        return f"{name} must be a power of two of at least {low}, got {value}"
    return None


def read_table(path: Path, gpu: str) -> Table | None:
    """One file's table if it names ``gpu``, else None.

    Raises:
        ValueError: not a table (bad JSON, missing fields), an unknown constant, or a value
            ``value_error`` refuses; the message names the file."""
    try:
        data = json.loads(path.read_text())
        if data.get("device") != gpu:
            return None
        launches = {e["key"]: {k: e["config"][k] for k in LAUNCH_KNOBS}
                    for e in data.get("launches", [])}
        times = {e["key"]: (float(e["us"]), float(e["reference_us"]))
                 for e in data.get("launches", []) if "us" in e and "reference_us" in e}
        constants = {m: dict(c) for m, c in data.get("constants", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a tuned launch table ({type(e).__name__}: {e})") from None
    for key, config in launches.items():
        for name, value in config.items():
            if (why := value_error(name, value, POW2.get(name))) is not None:
                raise ValueError(f"{path}: {key}: {why}")
    for module, values in constants.items():
        if module not in CONSTANTS:
            raise ValueError(f"{path}: constants of {module!r}: only "
                             f"{', '.join(CONSTANTS)} take them")
        for name, value in values.items():
            if name not in CONSTANTS[module]:
                raise ValueError(f"{path}: {module}.{name} is not a tuned constant (one of "
                                 f"{', '.join(CONSTANTS[module])})")
            if (why := value_error(name, value, CONSTANTS[module][name])) is not None:
                raise ValueError(f"{path}: {module}.{why}")
    return Table(launches, constants, times=times)


def table_for(gpu: str) -> Table:
    """The merged table of the GPU named ``gpu`` (``torch.cuda.get_device_name``): every
    ``TUNED_DIR/*.json`` naming it, in file-name order, a later entry over an earlier one
    (no GPU needed: ``tools/check_targets.py`` asks it of a result row's device). Read once
    per name.

    Raises:
        ValueError: a file ``read_table`` refuses."""
    if gpu not in _tables:
        merged = Table()
        for path in sorted(TUNED_DIR.glob("*.json")):
            t = read_table(path, gpu)
            if t is not None:
                merged.files.append(path.name)
                merged.launches.update(t.launches)
                merged.times.update(t.times)
                for module, values in t.constants.items():
                    merged.constants.setdefault(module, {}).update(values)
        _tables[gpu] = merged
    return _tables[gpu]


def table(device: torch.device) -> Table:
    """``device``'s GPU's table: every ``TUNED_DIR/*.json`` naming it
    (``torch.cuda.get_device_name``) merged in file-name order, a later entry over an
    earlier one; empty off CUDA. Read once per GPU name.

    Raises:
        ValueError: a file ``read_table`` refuses."""
    if device.type != "cuda":
        return Table()
    return table_for(gpu_name(device))


def apply_constants(device: torch.device, modules: dict[str, ModuleType]) -> None:
    """Set ``modules``' constants (``{"sparse": kernels.sparse, "dense": kernels.dense}``) to
    ``device``'s table, once per process and GPU name (a later call changes nothing, so a
    benchmark's own settings stay). Nothing off CUDA.

    Raises:
        ValueError: a file ``read_table`` refuses."""
    if device.type != "cuda":
        return
    gpu = gpu_name(device)
    if gpu in _applied:
        return
    _applied.add(gpu)
    for module, values in table(device).constants.items():
        for name, value in values.items():
            setattr(modules[module], name, value)


def describe(device: torch.device) -> dict | None:
    """What the kernels on ``device`` run with from the tables, for a result row: the files,
    the constants and how many launches have knobs; None where no table applies (off CUDA,
    or a GPU no file names)."""
    t = table(device)
    if not t.files:
        return None
    return {"files": t.files, "constants": t.constants, "launches": len(t.launches),
            "dense_faster": t.dense_faster}
