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


def default_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """A run's dtype (weights' activations and the KV cache): ``dtype`` (a ``torch.dtype`` or
    its name, ``flags.DTYPE_NAMES``) when given, else bfloat16 on CUDA and float32 on the
    CPU, for ``generate.py``, the API and the accuracy harness alike.

    Raises:
        ConfigError: an unknown dtype name.
    """
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return DTYPES[name]
