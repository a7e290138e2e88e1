"""Fused Triton kernels of the decode step, and the rule for when the engine runs them.

The sparse kernels (``kernels/sparse.py``) replace a selecting method's PyTorch decode-step
code (selection, sparse attention, the token write with its page-summary update) and the
dense decode attention on CUDA; the dense kernels (``kernels/dense.py``) replace the
projections with the norms, RoPE, the token's K/V write, SwiGLU and the residual adds fused
into them. The PyTorch code stays the CPU path and the reference they are tested against.
``triton`` is an optional dependency (it ships with CUDA builds of torch; the CPU test
requirements pin it to run the kernels in its interpreter), so the modules are imported on
first use: ``ops()``.

Switches, read when a decode step is traced or run:
    * ``ROCKETKV_KERNELS=0`` in the environment, or ``set_mode("off")``: never.
    * ``set_mode("auto")`` (the default): on CUDA tensors when triton imports; the dense
      kernels only on a GPU whose tuned table (``rocketkv/kernels/tuned/``) timed them faster than
      cuBLAS (``tuning.Table.dense_faster``): untuned on the H200 they made the 8B decode
      step 31% slower (10.46 against 7.99 ms at 32K, results/NVIDIA-H200/README.md).
    * ``set_mode("force")``: on any device (tests on CPU, with ``TRITON_INTERPRET=1`` set
      before the first ``ops()`` call).
    * ``ROCKETKV_KERNELS=sparse``, or ``set_dense(False)``: the sparse kernels only, the
      projections through PyTorch (cuBLAS): what the dense kernels are measured against.
      ``set_dense(True)`` (``--kernels on``): the dense kernels wherever the others run.
    * ``ROCKETKV_KERNELS=force``: ``set_mode("force")`` from the start (kernel development on
      CPU, in the interpreter).

Families. The kernels form four families (``FAMILIES``), each switched off on its own for
the process on a device (``switch_off``) when the first-use self-check
(``rocketkv/engine/kernel_check.py``) finds it raising or wrong there: ``sparse`` (a
selector's selection and attention:
``sparse_attention``, gated by ``selection_fits``; SparQ's token write with it), ``write``
(a paged selector's token write with its page summary, ``write_token``), ``prefix`` (Full-KV
decode attention, ``prefix_attention``) and ``dense`` (the projections, ``dense_in_use``).
``family_on`` says whether one runs; ``report`` what ran, for a result's ``kernels`` entry.
With ``set_strict(True)`` (``--kernels on``) a failed self-check is an error instead.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from types import ModuleType

import torch
from torch import Tensor

from rocketkv.kernels import tuning

MODES = ("auto", "off", "force")
_env = os.environ.get("ROCKETKV_KERNELS", "1")
_mode = "off" if _env == "0" else "force" if _env == "force" else "auto"
FAMILIES = {  # name -> what it runs (the warnings and reports name it so)
    "sparse": "sparse selection and attention (select_attend, paged_select, attend_pages)",
    "write": "token write with its page summary (write_token)",
    "prefix": "Full-KV decode attention (attend_prefix)",
    "dense": "dense projections (linear, qkv_store)",
}
_failed: dict[tuple[str, str], tuple[str, str]] = {}  # (family, device) -> (found by, why)
_only: str | None = None  # the self-check runs one family at a time (``only``)
_strict = False
_dense: bool | None = False if os.environ.get("ROCKETKV_KERNELS") == "sparse" else None
AUX_NONE = 0  # a decoded token's write: no auxiliary keys
AUX_SUMMARY = 1  # ... and its page's column of the min/max summary (B, H_kv, 2 D, pages)
AUX_DIM_MAJOR = 2  # ... and its column of the transposed key copy (B, H_kv, D, S)
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


def mode() -> str:
    """The current mode (``MODES``)."""
    return _mode


def set_strict(on: bool) -> bool:
    """Whether a failed self-check is an error (``KernelCheckError``, ``--kernels on``) rather
    than a warning and the PyTorch path; returns the previous setting."""
    global _strict
    previous, _strict = _strict, bool(on)
    return previous


def strict() -> bool:
    """Whether a failed self-check is an error (``set_strict``)."""
    return _strict


class KernelCheckError(RuntimeError):
    """A kernel family failed its self-check with ``set_strict(True)`` (``--kernels on``)."""


_CUDA_ERRORS = ("CUDA error", "CUDA driver error", "Triton Error [CUDA]", "device-side assert",
                "cudaError")


def cuda_error(e: BaseException) -> bool:
    """Whether ``e`` is a CUDA error, after which the process's CUDA context may be unusable
    (an illegal address, a misaligned access or a device-side assert are sticky: every later
    CUDA call raises again, ``torch.cuda.empty_cache()`` included): ``torch.AcceleratorError``
    or a ``RuntimeError`` naming one. An out-of-memory error is not one (the allocator
    recovers); neither is a compile or Python error. (``cli.device_fault`` for the scripts.)"""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    if isinstance(e, getattr(torch, "AcceleratorError", ())):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _CUDA_ERRORS)


def fault(e: BaseException) -> str | None:
    """The one-line reason when ``e`` is a kernel's fault that escaped the self-check: a failed
    strict self-check (``KernelCheckError``), a Triton compile or launch error (an exception of
    a ``triton`` module), or a CUDA error (``cuda_error``); None for anything else."""
    for x in _chain(e):  # torch.compile raises its own error from the kernel's
        first = (str(x).strip().splitlines() or [""])[0]
        if isinstance(x, KernelCheckError):
            return first
        if _from_triton(x):
            return f"Triton {type(x).__name__}: {_line(x)}"
        if cuda_error(x):
            return first if first.startswith("CUDA error") else f"CUDA error: {first}"
    for x in _chain(e):  # Inductor's compile workers hand a Triton error back as text only
        if (reason := _triton_in_text(str(x))) is not None:
            return reason
    return None


# A Triton exception named at the start of a traceback's line (``triton.compiler.errors.
# CompilationError: at 7:15:``); its message ends where the traceback goes on
_TRITON_TEXT = re.compile(r"^triton\.[\w.]*\.(\w+): ", re.MULTILINE)
_MESSAGE_END = re.compile(r"^(?:The above exception was|During handling of|Traceback \(most)",
                          re.MULTILINE)


def _triton_in_text(text: str) -> str | None:
    """The one-line reason of the Triton error whose traceback ``text`` holds (the form in
    which Inductor's compile workers return it inside a ``SubprocException``), as ``fault``
    words a Triton exception: "Triton <Name>: <first line> ... <last line>" of the first one
    named (the root cause: later ones point at the calls that led to it); None when the text
    names none."""
    found = _TRITON_TEXT.search(text)
    if found is None:
        return None
    rest = text[found.end():]
    end = _MESSAGE_END.search(rest)
    lines = [ln.strip() for ln in rest[:end.start() if end else None].splitlines()
             if ln.strip() and ln.strip() != "^"]
    body = "" if not lines else lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"Triton {found.group(1)}: {body}"


def compile_fault(e: BaseException) -> str | None:
    """The one-line reason when ``e``, or an exception it was raised from, is a Triton error
    (a kernel that failed to compile, e.g. inside torch.compile's Inductor, which raises its
    own error from it) and none of them is a CUDA error: a fault the process recovers from
    by compiling the step again with the kernels off (``step.FallbackStep``); else None."""
    if any(cuda_error(x) for x in _chain(e)):
        return None
    reason = fault(e)
    return reason if reason is not None and reason.startswith("Triton ") else None


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from or during (``__cause__``, else
    ``__context__``), at most 16."""
    out: list[BaseException] = []
    while e is not None and len(out) < 16 and all(e is not x for x in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _from_triton(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] == "triton"


def _line(e: BaseException) -> str:
    """``e``'s message on one line: its first line, and its last where there are more (a
    Triton compile error's first line is the place, its last the reason)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _key(device: torch.device | str) -> str:
    """``device`` as the switches' key: ``type:index`` (no index: 0). No CUDA call: the
    switches are read inside the traced decode step."""
    if isinstance(device, str):
        device = torch.device(device)
    return f"{device.type}:{device.index or 0}"


def switch_off(family: str, device: torch.device | str, reason: str,
               by: str = "self-check") -> None:
    """Switch ``family`` (``FAMILIES``) off on ``device`` for the rest of the process: its
    decode steps run the PyTorch path; ``report`` gives "pytorch (<by>: <reason>)" (``by``:
    "self-check", ``rocketkv/engine/kernel_check.py``, or "compile", ``step.FallbackStep``).

    Raises:
        ValueError: an unknown family."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r} ({', '.join(FAMILIES)})")
    _failed.setdefault((family, _key(device)), (by, reason))


def failure(family: str, device: torch.device | str) -> str | None:
    """Why ``family`` was switched off on ``device`` (``switch_off``), or None."""
    return _failed.get((family, _key(device)), (None, None))[1]


def reset_failures() -> None:
    """Forget every ``switch_off`` (tests; the self-check's cache is ``kernel_check``'s)."""
    _failed.clear()


class only:
    """``with kernels.only("prefix"):`` every other family is off inside (the self-check
    runs one family at a time, the rest on the PyTorch path); ``only(None)``: every family
    off."""

    def __init__(self, family: str | None):
        self.family = family

    def __enter__(self):
        global _only
        self.previous, _only = _only, self.family or ""
        return self

    def __exit__(self, *exc):
        global _only
        _only = self.previous


def family_on(family: str, device: torch.device | str) -> bool:
    """Whether decode steps on ``device`` run the kernels of ``family`` (``FAMILIES``):
    where the kernels run (``in_use``; ``dense`` also needs ``set_dense(True)``), unless the
    self-check switched it off (``switch_off``)."""
    if _only is not None and family != _only:
        return False
    device = torch.device(device) if isinstance(device, str) else device
    if (family, _key(device)) in _failed:
        return False
    if not _available(device):
        return False
    return family != "dense" or _dense_wanted(device)


def _dense_wanted(device: torch.device) -> bool:
    """``set_dense``'s choice; by default (None) on with ``set_mode("force")`` (kernel
    development, the interpreter's tests) and on a GPU whose tuned tables timed the dense
    kernels faster than the reference (``tuning.Table.dense_faster``)."""
    if _dense is not None:
        return _dense
    return _mode == "force" or tuning.table(device).dense_faster


def report(device: torch.device | str, families=None, head_dim: int | None = None
           ) -> dict[str, str]:
    """What runs each family on ``device``, for a result's ``kernels`` entry: ``"fused"``,
    ``"pytorch (self-check: <reason>)"``, ``"pytorch (off)"`` (``set_mode("off")``,
    ``--kernels off``, or ``dense`` with ``--kernels sparse``), ``"pytorch (cuda only)"``
    (``auto`` on another device), ``"pytorch (head dim < 16)"``, ``"pytorch (no triton:
    <why>)"``, or ``"unused"`` for a family not in ``families`` (when given: those the run
    launches, ``kernel_check.families``)."""
    device = torch.device(device)
    out = {}
    for family in FAMILIES:
        why = failure(family, device)
        if families is not None and family not in families:
            out[family] = "unused"
        elif _mode == "off" or (family == "dense" and _dense is False):
            out[family] = "pytorch (off)"
        elif family == "dense" and _available(device) and not _dense_wanted(device):
            out[family] = "pytorch (cuBLAS: not timed faster on this GPU)"
        elif _mode == "auto" and device.type != "cuda":
            out[family] = "pytorch (cuda only)"
        elif head_dim is not None and head_dim < 16 and family != "dense":
            out[family] = "pytorch (head dim < 16)"
        elif missing() is not None:
            out[family] = f"pytorch (no triton: {missing()})"
        elif why is not None:
            out[family] = f"pytorch ({_failed[(family, _key(device))][0]}: {why})"
        else:
            out[family] = "fused"
    return out


def set_dense(on: bool | None) -> bool | None:
    """Whether the dense kernels run where the kernels run (``kernels/dense.py``): True, False,
    or None (the default: where a tuned table timed them faster, ``_dense_wanted``); returns
    the previous setting."""
    global _dense
    previous, _dense = _dense, None if on is None else bool(on)
    return previous


def ops() -> ModuleType | None:
    """``kernels.sparse``, once it and ``kernels.dense`` are imported (registering the
    ``torch.ops.rocketkv`` kernels), or None when triton cannot be imported (the reason is in
    ``missing()``)."""
    global _ops, _missing
    if _ops is None and _missing is None:
        try:  # optional dependency, imported by name on first use (not an import cycle)
            _ops = importlib.import_module("rocketkv.kernels.sparse")
            importlib.import_module("rocketkv.kernels.dense")
        except ImportError as e:
            _ops, _missing = None, str(e)
    return _ops


def missing() -> str | None:
    """Why the kernels cannot be imported, or None."""
    ops()
    return _missing


def enabled(x: Tensor, family: str | None = None) -> bool:
    """Whether a decode step on ``x``'s device runs the kernels of ``family`` (None: of any
    family but ``dense``): CUDA (or any device with ``set_mode("force")``), a head dim of at
    least 16 (``tl.dot``'s smallest tile), triton importable and the family not switched off
    (``family_on``). On a GPU a tuned table names, its constants are set first
    (``kernels.tuning.apply_constants``, once a process)."""
    if _mode == "off" or x.shape[-1] < 16:
        return False
    if _mode == "auto" and x.device.type != "cuda":
        return False
    return in_use(x.device, family)


_sms: dict[str, int] = {}  # device key -> its SMs (multiprocessors)


def _available(device: torch.device) -> bool:
    """The mode, the device and triton allow the kernels on ``device``; on a GPU a tuned
    table names, its constants are set first (once a process)."""
    if _mode == "off" or (_mode != "force" and device.type != "cuda") or ops() is None:
        return False
    tuning.apply_constants(device, {"sparse": _ops, "dense": sys.modules["rocketkv.kernels.dense"]})
    multiprocessors(device)  # recorded now, before a decode step is traced
    return True


def in_use(device: torch.device, family: str | None = None) -> bool:
    """Whether decode steps on ``device`` run the kernels of ``family`` (``family_on``; None:
    of any family but ``dense``) (for a head dim of at least 16); on a GPU a tuned table
    names, its constants are set first (once a process).

    Raises:
        ValueError: a tuned table that is not valid (``kernels.tuning.read_table``)."""
    if family is not None:
        return family_on(family, device)
    return any(family_on(f, device) for f in ("sparse", "write", "prefix"))


def dense_in_use(device: torch.device) -> bool:
    """Whether decode steps on ``device`` run the dense kernels: where the kernels run, by
    ``set_dense``'s choice (default: where a tuned table timed them faster than cuBLAS),
    unless the self-check switched them off (``family_on``)."""
    return family_on("dense", device)


def no_aux(like: Tensor) -> tuple[Tensor, int, int]:
    """A token write's ``(aux, aux_kind, page_size)`` (``cache.TokenStore``) without
    auxiliary keys: an empty tensor on ``like``'s device (aliasing no cache buffer),
    ``AUX_NONE``, 1."""
    return like.new_empty(0), AUX_NONE, 1


def qkv_store(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
              rope: Tensor, store: tuple, n_heads: int, scales: Tensor | None = None,
              groupsize: int = 0) -> Tensor:
    """RMSNorm, q/k/v projection, RoPE and the token's write into ``store`` (a
    ``cache.TokenStore``) in one kernel (``kernels.dense.qkv_store``; int8 or int4
    weights with ``scales``); returns q (B, H, 1, D)."""
    return torch.ops.rocketkv.qkv_store(x, norm_weight, eps, weight, bias, rope, *store, n_heads,
                                        scales, groupsize)


def linear(x: Tensor, weight: Tensor, norm_weight: Tensor | None = None, eps: float = 0.0,
           residual: Tensor | None = None, swiglu: bool = False, scales: Tensor | None = None,
           groupsize: int = 0) -> Tensor:
    """``[RMSNorm] x @ W^T`` with the residual added or SwiGLU, one kernel
    (``kernels.dense.linear``; int8 or int4 weights with ``scales``)."""
    return torch.ops.rocketkv.linear(x, weight, norm_weight, eps, residual, swiglu, scales,
                                     groupsize)


def selection_fits(n_pages: int, k: int, page_size: int) -> bool:
    """Whether a selector hands a cache of ``n_pages`` pages (tokens, for pages of one slot)
    and a selection of ``k`` tokens to the fused selection: when its choice of k runs in
    registers, in one program per KV head or split over several
    (``kernels.sparse.selection_splits``). Else the PyTorch path (``torch.topk`` over every
    token) runs: pages of one slot past about 8192 x 8192 / k tokens (Exact-TopK at budget
    4096 past 16K tokens, at 256 past 256K). Whether the ``sparse`` family runs at all is
    ``enabled(x, "sparse")``, which the selectors ask first."""
    return ops().selection_splits(n_pages, k, page_size) > 0


def sparse_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor | None,
                     last: Tensor, *, mode: int, two_bounds: bool, r: int, k: int,
                     page_size: int, offset: Tensor | None = None,
                     v_mean: Tensor | None = None) -> Tensor:
    """Selection and exact attention over the chosen slots: ``select_attend`` (one kernel,
    or three for a selection split over programs, ``selection_splits``) when the selection
    attends in one program per KV head, else ``paged_select`` then ``attend_pages``
    (arguments as there; ``last`` (1,) int64 the slot written last, less ``offset`` when
    given; ``rows`` None: the keys themselves, read as K^T, for pages of one slot). With
    ``v_mean`` SparQ's mean-value reallocation (``select_attend_reallocated``, which updates
    it, and attends in one program per KV head whatever k). Returns (B, H, 1, D) in the
    cache's dtype."""
    if v_mean is None and ops().attention_splits(k) > 1:
        return select_then_attend(q, k_cache, v_cache, rows, last, mode=mode,
                                  two_bounds=two_bounds, r=r, k=k, page_size=page_size,
                                  offset=offset)
    by_token = rows is None
    splits = _splits(k_cache, rows, k, page_size)
    if v_mean is not None:
        return torch.ops.rocketkv.select_attend_reallocated(
            q, k_cache if by_token else rows, k_cache, v_cache, last, v_mean, r, k, by_token,
            offset, splits)
    return torch.ops.rocketkv.select_attend(q, k_cache if by_token else rows, k_cache, v_cache,
                                            last, mode, two_bounds, r, k, page_size, by_token,
                                            offset, splits)


def select_then_attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor | None,
                       last: Tensor, *, mode: int, two_bounds: bool, r: int, k: int,
                       page_size: int, offset: Tensor | None = None) -> Tensor:
    """``sparse_attention`` as ``paged_select`` then ``attend_pages`` (split over programs):
    what runs for selections too large for one program per KV head."""
    by_token = rows is None
    pages, take = torch.ops.rocketkv.paged_select(q, k_cache if by_token else rows, last, mode,
                                                  two_bounds, r, k, page_size, by_token, offset,
                                                  _splits(k_cache, rows, k, page_size))
    return torch.ops.rocketkv.attend_pages(q, k_cache, v_cache, pages, take, page_size, k)


def _splits(k_cache: Tensor, rows: Tensor | None, k: int, page_size: int) -> int:
    """The selection's programs per KV head (``kernels.sparse.selection_splits``) over the
    pages of ``rows`` (the summary, (B, H_kv, rows, P)) or the tokens of ``k_cache``, for its
    B x H_kv programs on the device's SMs (none counted off CUDA)."""
    n_pages = k_cache.shape[2] if rows is None else rows.shape[3]
    B, Hkv = k_cache.shape[:2]
    return ops().selection_splits(n_pages, k, page_size, B * Hkv, multiprocessors(k_cache.device))


def multiprocessors(device: torch.device | str) -> int:
    """The SMs of a CUDA ``device``, asked once a process (``_available`` asks first, before a
    decode step is traced, so the traced step reads the recorded count); 0 elsewhere (the
    interpreter runs one program at a time)."""
    device = torch.device(device)
    if device.type == "cuda" and _key(device) not in _sms and torch.cuda.is_available():
        _sms[_key(device)] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sms.get(_key(device), 0)


def prefix_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor,
                     offset: Tensor | None = None) -> Tensor:
    """Decode attention over slots 0..last (less ``offset`` when given) of static buffers
    (``attend_prefix``)."""
    return torch.ops.rocketkv.attend_prefix(q, k_cache, v_cache, last, offset)
