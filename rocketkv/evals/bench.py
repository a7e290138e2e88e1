"""What the speed and memory scripts share: the default sweep (the RocketKV paper's Fig. 5),
the run's device, dtype and compile choice, the device's measured copy bandwidth (the
roofline's denominator) and where a device's results go.

Used by ``scripts/bench.py``, ``scripts/bench_step.py``, ``scripts/profile_step.py``,
``tools/check_targets.py`` (which judges a run against the default sweep) and
``scripts/compare_hf.py``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from rocketkv.cli.common import DTYPES, apply_kernels_option, resolve_device
from rocketkv.engine.measure import device_name
from rocketkv.engine.step import REGIMES  # noqa: F401 (a row's compile_regime in words: step.StepMode)
from rocketkv.model import ConfigError

# the default sweep: the paper's Fig. 5 (tools/check_targets.py times a run that covers it)
DEFAULT_METHODS = ("full", "gptfast_dense", "rocketkv")
DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096)
DEFAULT_CONTEXTS = (16384, 32768, 65536, 98304, 131072 - 64)


def measure_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device memory bandwidth in GB/s from copying ``nbytes`` (read + write counted; default
    1 GiB on CUDA, 128 MiB elsewhere)."""
    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else 1 << 27
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / sorted(times)[len(times) // 2] / 1e9


def resolve_run(args) -> tuple[torch.device, torch.dtype]:
    """Apply ``--threads``, resolve ``--device``, default ``--compile`` (on for CUDA) and
    ``--dtype`` (bf16 on CUDA, float32 elsewhere). Raises ConfigError on bad values."""
    if args.threads is not None:
        if args.threads <= 0:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    apply_kernels_option(args)
    args.compile = device.type == "cuda" if args.compile is None else args.compile
    return device, DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)


def results_dir(root: str | Path, device: torch.device) -> Path:
    """``root/<device name>``: the folder of a device's results (``results/NVIDIA-H200``,
    ``results/cpu``), characters other than letters, digits, ``.``, ``_`` and ``-`` replaced
    by ``-``. Not created here."""
    return Path(root) / re.sub(r"[^A-Za-z0-9._-]+", "-", device_name(device))
