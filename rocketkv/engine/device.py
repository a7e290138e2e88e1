"""The device and dtype a run uses: ``--device`` and ``--dtype`` as torch objects, for the
command lines and the API alike."""

from __future__ import annotations

import torch

from rocketkv.errors import ConfigError
from rocketkv.flags import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # flags.DTYPE_NAMES, in order


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but CUDA is not available on this machine")
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"unsupported device {name!r} (cuda or cpu)")
    return device
