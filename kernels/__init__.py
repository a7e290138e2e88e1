"""Fused Triton kernels of the decode step, and the rule for when the engine runs them.

The kernels (``kernels/sparse.py``) replace a selecting method's PyTorch decode-step code
(selection, sparse attention, the token write with its page-summary update) on CUDA; the
PyTorch code stays the CPU path and the reference they are tested against. ``triton`` is an
optional dependency (it ships with CUDA builds of torch; the CPU test requirements pin it to
run the kernels in its interpreter), so the module is imported on first use: ``ops()``.

Switches, read when a decode step is traced or run:
    * ``ROCKETKV_KERNELS=0`` in the environment, or ``set_mode("off")``: never.
    * ``set_mode("auto")`` (the default): on CUDA tensors when triton imports.
    * ``set_mode("force")``: on any device (tests on CPU, with ``TRITON_INTERPRET=1`` set
      before the first ``ops()`` call).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch
from torch import Tensor

MODES = ("auto", "off", "force")
_mode = "off" if os.environ.get("ROCKETKV_KERNELS", "1") == "0" else "auto"
_ops: ModuleType | None = None
_missing: str | None = None


def set_mode(mode: str) -> str:
    """Set when the kernels run (``MODES``); returns the previous mode.

    Raises:
        ValueError: an unknown mode.
    """
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {', '.join(MODES)}, got {mode!r}")
    previous, _mode = _mode, mode
    return previous


def ops() -> ModuleType | None:
    """``kernels.sparse`` (registering the ``torch.ops.rocketkv`` kernels), or None when
    triton cannot be imported (the reason is in ``missing()``)."""
    global _ops, _missing
    if _ops is None and _missing is None:
        try:  # optional dependency, imported by name on first use (not an import cycle)
            _ops = importlib.import_module("kernels.sparse")
        except ImportError as e:
            _missing = str(e)
    return _ops


def missing() -> str | None:
    """Why the kernels cannot be imported, or None."""
    ops()
    return _missing


def enabled(x: Tensor) -> bool:
    """Whether a decode step on ``x``'s device runs the kernels: CUDA (or any device with
    ``set_mode("force")``), a head dim of at least 16 (``tl.dot``'s smallest tile) and
    triton importable."""
    if _mode == "off" or x.shape[-1] < 16:
        return False
    if _mode == "auto" and x.device.type != "cuda":
        return False
    return ops() is not None


def in_use(device: torch.device) -> bool:
    """Whether decode steps on ``device`` run the kernels (for a head dim of at least 16)."""
    return _mode != "off" and (_mode == "force" or device.type == "cuda") and ops() is not None


def sparse_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor | None,
                     last: Tensor, *, mode: int, two_bounds: bool, r: int, k: int,
                     page_size: int) -> Tensor:
    """Selection and exact attention over the chosen slots: ``paged_select`` then
    ``attend_pages`` (arguments as there; ``last`` (1,) int64 the slot written last; ``rows``
    None: the keys themselves, read as K^T, for pages of one slot). Returns (B, H, 1, D) in
    the cache's dtype."""
    by_token = rows is None
    pages, take = torch.ops.rocketkv.paged_select(q, k_cache if by_token else rows, last, mode,
                                                  two_bounds, r, k, page_size, by_token)
    return torch.ops.rocketkv.attend_pages(q, k_cache, v_cache, pages, take, page_size, k)


def prefix_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor) -> Tensor:
    """Decode attention over slots 0..last of static buffers (``attend_prefix``)."""
    return torch.ops.rocketkv.attend_prefix(q, k_cache, v_cache, last)
