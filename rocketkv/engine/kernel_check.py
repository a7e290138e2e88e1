"""First-use self-check of the fused kernels: each family runs once, on small synthetic inputs,
against the PyTorch path, before the first decode step on a device.

    python -m rocketkv.engine.kernel_check [--device D] [--dtype T] [--head-dim N] [--group G]

No kernel of ``kernels/`` had run on a GPU when this was written: they were checked in
Triton's interpreter and compiled for sm_90. (Their first GPU run, on an H200 on 2026-11-27,
passed this check for every family; two kernels then failed to compile inside a compiled
float32 step, which this check, run eagerly, does not see: ``step.FallbackStep`` covers that
case.) A kernel that fails to compile or launch on the
GPU at hand, or returns wrong numbers there, would otherwise end a run in a traceback or, worse,
in plausible wrong tokens. ``ensure(model)`` (``generate`` calls it) runs every family the
run's decode steps launch (``families``), at the run's head dim D, query group G (query heads
per KV head), dtype and weight format, with two KV heads and batch 1:

* ``prefix``: a ``FullKVCache`` of 64 prompt tokens decodes one step (``attend_prefix``); on
  a GPU ``PREFIX_SPLITS`` x ``PREFIX_SPLIT`` tokens, so that the attention runs split over
  programs and merged, as at real lengths;
* ``sparse`` and ``write``: a ``CompressedKVCache`` with a fresh selector of the run's class,
  page size, r and k (so the kernels' compile-time constants are the run's) holding
  ``max(64, 2 k + 2 page size) + 1`` prompt tokens decodes one step, with only that family's
  kernels on (``kernels.only``); on a GPU at least 8 x ``MIN_SPLIT_PAGES`` pages, so that the
  selection runs split over programs as a real run's does (``selection_splits``);
* ``dense``: ``qkv_store`` (norm, q/k/v, RoPE, the K/V write) and ``linear`` with a residual,
  with the norm and SwiGLU, and with the norm alone (the LM head), over an input width of
  ``max(64, groupsize)``, in the run's weight format (float, int8, int4 with its groupsize;
  ``quantized.py``'s quantizers).

The reference is the PyTorch path run in float64 on the same inputs (rounded to the run's dtype
first): the caches' own code with the kernels off, or the formulas (``quantized.py``'s
dequantization, ``model.apply_rope``). A case fails on any exception, a non-finite output, a
token write or page summary that differs from the reference's at all (copies, minima and maxima
are exact), or an output whose largest error relative to the reference's largest magnitude
(``max |out - ref| / max |ref|``) exceeds ``TOLERANCE`` for the dtype: 1e-4 in float32 (the
kernels' float32 dots are "ieee"; about 800 float32 units of roundoff), 1e-2 in float16 (about
20 units of its 2^-11 roundoff) and 3e-2 in bfloat16 (about 8 units of its 2^-8 roundoff: the
kernels round attention weights and normed activations to bfloat16 for the tensor cores, as the
PyTorch path's bfloat16 matmuls do). An all-zero or shuffled output has an error near 1. A
selection that differs from the reference only by a near-tie would fail a first input; a case
fails only if a second, independent input fails too. Where the reference itself cannot run (a
fault of the check's setup, not of a kernel) the family is left on, the outcome noted
(``Outcome.note``; ``SKIP`` on the command line).

A failed family is switched off on the device for the rest of the process
(``kernels.switch_off``) with one ``warning:`` line on stderr naming the device, the family and
the reason; the run goes on through the PyTorch path. With ``kernels.set_strict(True)``
(``--kernels on``) it raises ``kernels.KernelCheckError`` instead, as it does after a sticky
CUDA error (an illegal address), which leaves the process no GPU to fall back on. Outcomes
are cached per process by (device, dtype, head dim, group, variant: weight format or
selector, family).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rocketkv import kernels
from rocketkv.cache import CompressedKVCache, FullKVCache, Selector
from rocketkv.compression import build_caches
from rocketkv.flags import DTYPE_NAMES
from rocketkv.model import ModelArgs, apply_rope
from rocketkv.quantized import dequantize_int4, kernel_dtype, quantize_int4, quantize_int8

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
KV_HEADS = 2  # KV heads of the synthetic inputs (not 1: Triton specializes integers equal to 1)
PROMPT = 64  # prompt tokens of the prefix case (and the least of the selectors')
PREFIX_SPLITS = 32  # on a GPU, the prefix case's splits (real runs: 32-64 at 32K-128K)


@dataclass
class Outcome:
    """One family's self-check: ``error`` the largest relative error over its outputs (None
    when it raised), ``reason`` why it failed (None: it passed), ``seconds`` its time;
    ``note`` why it was not checked (the reference itself failed: the family stays on)."""

    family: str
    variant: str
    error: float | None
    seconds: float
    reason: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


_outcomes: dict[tuple, Outcome] = {}


class Mismatch(Exception):
    """A kernel's output or write differs from the reference beyond the tolerance."""


# --------------------------------------------------------------------------------------------
# What a run launches


def weight_format(layer: nn.Module) -> str | None:
    """The dense kernels' weight format of a linear ``layer``: ``"float"``, ``"int8"``,
    ``"int4/G"`` (groupsize G), or None for a layer they do not read."""
    if type(layer) is nn.Linear:
        return "float" if layer.weight.is_floating_point() else None
    get = getattr(layer, "kernel_weight", None)
    found = get() if callable(get) else None
    if found is None:
        return None
    weight, _, groupsize = found
    if weight.dtype == torch.int8:
        return "int8"
    if weight.dtype == torch.uint8:
        return f"int4/{groupsize}"
    return "float" if weight.is_floating_point() else None


def families(model: nn.Module) -> dict[str, list]:
    """The kernel families ``model``'s decode steps may launch on its caches (``setup_caches``
    done), each with its variants: ``prefix`` [None]; ``sparse`` and ``write`` the selectors
    (one per distinct class and parameters) that override ``Selector.attend`` /
    ``store_token`` (``write``: paged ones, page size > 1); ``dense`` the weight formats of
    the model's linears, where some cache allows the dense kernels (``dense_kernels``)."""
    out: dict[str, list] = {"prefix": [None]}
    seen = set()
    for cache in model.caches:
        sel = getattr(cache, "selector", None)  # OmniKV's is its context rule's name
        if not isinstance(sel, Selector) or _describe(sel) in seen:
            continue
        seen.add(_describe(sel))
        if type(sel).attend is not Selector.attend:
            out.setdefault("sparse", []).append(sel)
        if type(sel).store_token is not Selector.store_token and sel.page_size > 1:
            out.setdefault("write", []).append(sel)
    if any(getattr(c, "dense_kernels", False) for c in model.caches):
        formats = sorted({f for m in model.modules() if (f := weight_format(m)) is not None})
        if formats:
            out["dense"] = formats
    return out


def _describe(sel) -> str:
    """A selector's class and parameters (its variant in the cache key and the report)."""
    params = {k: v for k, v in vars(sel).items()
              if not k.startswith("_") and k != "training"
              and isinstance(v, (int, float, bool, str))}
    return f"{type(sel).__name__}({', '.join(f'{k}={v}' for k, v in sorted(params.items()))})"


# --------------------------------------------------------------------------------------------
# The checks


def _args(head_dim: int, group: int):
    H = group * KV_HEADS
    return ModelArgs(dim=H * head_dim, n_layers=1, n_heads=H, n_kv_heads=KV_HEADS,
                     head_dim=head_dim, intermediate_size=8, vocab_size=16, max_seq_len=1 << 20)


def _fresh(sel):
    """A new selector of ``sel``'s class and parameters: its own dicts of buffers, parameters
    and submodules, so that the cache's ``allocate`` registers new ones (every selector's
    per-cache state) without touching the run's."""
    new = copy.copy(sel)
    for name in ("_parameters", "_buffers", "_modules"):
        if name in vars(new):
            setattr(new, name, dict(getattr(sel, name)))
    if "_non_persistent_buffers_set" in vars(new):
        new._non_persistent_buffers_set = set(sel._non_persistent_buffers_set)
    return new


class NotChecked(Exception):
    """The PyTorch reference itself could not run: the family is left as it is."""


def relative_error(out: Tensor, ref: Tensor) -> float:
    """``max |out - ref| / max |ref|`` in float64; inf for a non-finite output."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def _same(a: Tensor, b: Tensor, what: str) -> None:
    a, b = a.double(), b.double()
    if not ((a == b) | (a.isnan() & b.isnan())).all():
        raise Mismatch(f"{what} differs from the PyTorch path's")


def _decode_case(family: str, device, dtype, head_dim: int, group: int, sel, seed: int
                 ) -> float:
    """One decode step of a tiny cache with only ``family``'s kernels on, against the float64
    PyTorch path: the output's relative error; the written K/V and the selector's buffers of
    the cache dtype must equal the reference's."""
    args = _args(head_dim, group)
    gpu = kernels.multiprocessors(device) > 0
    if sel is None:
        # on a GPU, a prefix long enough that attend_prefix runs split and merged
        # (_merge_splits_kernel) as real runs' does (kernels.sparse.prefix_splits)
        T = PREFIX_SPLITS * kernels.ops().PREFIX_SPLIT + 1 if gpu else PROMPT
    else:
        page = sel.page_size
        # on a GPU, enough pages that the selection runs split over the SMs as real runs'
        # does (kernels.sparse.selection_splits; 2 KV heads: 8 splits of MIN_SPLIT_PAGES)
        pages = 8 * kernels.ops().MIN_SPLIT_PAGES if gpu else 0
        T = -(-max(PROMPT, 2 * getattr(sel, "k", 16) + 2 * page, pages * page) // page) \
            * page + 1
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, T + 1, head_dim, generator=g).to(dtype)
               for h in (args.n_heads, KV_HEADS, KV_HEADS))

    def cache(dt):
        if sel is None:
            c = FullKVCache(0, args, 1, dt, device, T + 1)
        else:
            c = CompressedKVCache(0, args, 1, dt, device, prompt_len=T, prompt_capacity=T,
                                  max_new_tokens=1, selector=_fresh(sel))
        with torch.no_grad():
            c.prefill(*(x[:, :, :T].to(device, dt) for x in (q, k, v)))
        return c

    pos = torch.tensor([T], device=device)
    step = [x[:, :, T:].to(device) for x in (q, k, v)]
    try:
        ref = cache(torch.float64)
        with torch.no_grad(), kernels.only(None):
            want = ref.decode(*(x.double() for x in step), pos)
    except Exception as e:  # the check's own setup, not a kernel
        raise NotChecked(f"the PyTorch reference failed: {_first_line(e)}") from e
    ker = cache(dtype)
    ker.k_cache[:, :, T:] = float("nan")  # a kernel reading past the written slots fails
    ker.v_cache[:, :, T:] = float("nan")
    with torch.no_grad(), kernels.only(family):
        got = ker.decode(*step, pos)
    if got.shape != want.shape:
        raise Mismatch(f"output of shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    slot = T  # the prompt is kept whole: slot offset 0
    _same(ker.k_cache[:, :, :slot + 1], ref.k_cache[:, :, :slot + 1], "the written keys")
    _same(ker.v_cache[:, :, :slot + 1], ref.v_cache[:, :, :slot + 1], "the written values")
    if sel is not None:
        want_bufs = dict(ref.selector.named_buffers())
        for name, buf in ker.selector.named_buffers():
            if buf.dtype == dtype and name in want_bufs:
                _same(buf, want_bufs[name], f"the selector's {name}")
    return relative_error(got, want)


def _weight(n: int, k: int, fmt: str, device, dtype, g) -> tuple[Tensor, Tensor | None, int,
                                                                  Tensor]:
    """A random (n, k) weight in ``fmt`` as the dense kernels read it (weight, scales,
    groupsize) and as the float64 matrix it stands for."""
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    if fmt == "float":
        w = w.to(dtype)
        return w.to(device), None, 0, w.double()
    sdt = kernel_dtype(torch.device(device), dtype)
    if fmt == "int8":
        q, s = quantize_int8(w)
        s = s.to(sdt)
        return q.to(device), s.to(device), 0, q.double() * s.double()[:, None]
    groupsize = int(fmt.split("/")[1])
    packed, sz = quantize_int4(w, groupsize)
    sz = sz.to(sdt)
    return (packed.to(device), sz.to(device), groupsize,
            dequantize_int4(packed, sz.double(), groupsize, torch.float64))


def _dense_case(device, dtype, head_dim: int, group: int, fmt: str, seed: int) -> float:
    """``qkv_store`` and three ``linear`` launches (residual, norm + SwiGLU, norm alone) in
    weight format ``fmt`` against float64 formulas: the largest relative error."""
    g = torch.Generator().manual_seed(seed)
    H, D = group * KV_HEADS, head_dim
    K = max(64, int(fmt.split("/")[1]) if "/" in fmt else 0)  # input width
    eps = 1e-5
    x = torch.randn(1, 1, K, generator=g).to(dtype)
    gain = (1 + 0.1 * torch.randn(K, generator=g)).to(dtype)
    x64, gain64 = x.double(), gain.double()
    xn = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * gain64
    errors = []
    # q/k/v with the norm, RoPE and the token's write at slot 3 of 8
    w, s, gs, wr = _weight((H + 2 * KV_HEADS) * D, K, fmt, device, dtype, g)
    angles = 3.0 * 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rope = torch.stack([angles.cos(), angles.sin()], -1)[None].float()  # (1, D/2, 2)
    kc = torch.full((1, KV_HEADS, 8, D), float("nan"), dtype=dtype, device=device)
    vc = torch.full_like(kc, float("nan"))
    store = (kc, vc, torch.tensor([3], device=device), None, *kernels.no_aux(kc))
    with torch.no_grad():
        q = kernels.qkv_store(x.to(device), gain.to(device), eps, w, None, rope.to(device),
                              store, H, s, gs)
    qr, kr, vr = (xn @ wr.T).split([H * D, KV_HEADS * D, KV_HEADS * D], -1)
    qr = apply_rope(qr.view(1, 1, H, D), rope.double()).transpose(1, 2)
    kr = apply_rope(kr.view(1, 1, KV_HEADS, D), rope.double()).transpose(1, 2)
    vr = vr.view(1, 1, KV_HEADS, D).transpose(1, 2)
    errors += [relative_error(q.cpu(), qr), relative_error(kc[:, :, 3:4].cpu(), kr),
               relative_error(vc[:, :, 3:4].cpu(), vr)]
    others = torch.cat([kc[:, :, :3], kc[:, :, 4:], vc[:, :, :3], vc[:, :, 4:]], 2)
    if not others.isnan().all():
        raise Mismatch("qkv_store wrote slots other than the token's")
    # the output projection with the residual; the MLP's gate/up with the norm and SwiGLU;
    # the LM head with the norm
    res = torch.randn(1, 1, K, generator=g).to(dtype)
    for n, norm, residual, swiglu in ((K, False, True, False), (2 * K, True, False, True),
                                      (48, True, False, False)):
        w, s, gs, wr = _weight(n, K, fmt, device, dtype, g)
        with torch.no_grad():
            out = kernels.linear(x.to(device), w, gain.to(device) if norm else None, eps,
                                 res.to(device) if residual else None, swiglu, s, gs)
        want = (xn if norm else x64) @ wr.T
        if residual:
            want = want + res.double()
        if swiglu:
            gate, up = want.chunk(2, -1)
            want = torch.nn.functional.silu(gate) * up
        errors.append(relative_error(out.cpu(), want))
    return max(errors)


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {text}" if not isinstance(e, Mismatch) else text
    return text if len(text) <= 200 else text[:197] + "..."


def check_family(family: str, device, dtype: torch.dtype, head_dim: int, group: int,
                 variant=None) -> Outcome:
    """Run one family's self-check (cached per process by device, dtype, head dim, group,
    variant and family): ``variant`` a selector (``sparse``, ``write``), a weight format
    (``dense``) or None (``prefix``). Runs the kernels whatever the device (the caller
    decides whether they would run there)."""
    device = torch.device(device)
    name = variant if isinstance(variant, str) or variant is None else _describe(variant)
    key = (kernels._key(device), dtype, head_dim, group, name, family)
    if key in _outcomes:
        return _outcomes[key]
    tol = TOLERANCE.get(dtype, 3e-2)
    t0 = time.perf_counter()
    error, reason, note = None, None, None
    try:
        for seed in (0, 1):  # fails only if two independent inputs fail
            if family == "dense":
                error = _dense_case(device, dtype, head_dim, group, variant, seed)
            else:
                error = _decode_case(family, device, dtype, head_dim, group, variant, seed)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if error <= tol:
                break
        else:
            reason = (f"max relative error {error:.2g} > {tol:g}" if math.isfinite(error)
                      else "non-finite output")
    except NotChecked as e:
        note = str(e)
    except Exception as e:  # any fault of a kernel is the finding, not a crash
        reason = _first_line(e)
    out = Outcome(family, name or "", error, time.perf_counter() - t0, reason, note)
    _outcomes[key] = out
    return out


def device_label(device: torch.device) -> str:
    """The GPU's name (``cuda:0 NVIDIA H100 ...``), or the device (``cpu (Triton
    interpreter)``)."""
    if device.type == "cuda":
        return f"{kernels._key(device)} {torch.cuda.get_device_name(device)}"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    return f"{device}" + (" (Triton interpreter)" if interp else "")


def _device_usable(device: torch.device) -> bool:
    """Whether ``device`` still runs work after a failed check: False after a sticky CUDA
    error (an illegal address), which no fallback survives."""
    if device.type != "cuda":
        return True
    try:
        torch.ones(1, device=device).add_(1).item()
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def _checks(model: nn.Module) -> Iterator[tuple[str, object]]:
    for family, variants in families(model).items():
        for variant in variants:
            yield family, variant


def ensure(model: nn.Module) -> dict[str, str]:
    """Self-check, on ``model``'s device, every kernel family its decode steps will launch
    (``families``) that is on there (``kernels.family_on``), before the first decode step;
    switch a failing family off (``kernels.switch_off``) with one ``warning:`` line on stderr.
    Returns ``kernels.report`` for the run.

    Raises:
        kernels.KernelCheckError: a family failed with ``kernels.set_strict(True)``.
    """
    device, dtype = model.device, model.dtype
    a = model.args
    head_dim, group = a.head_dim, a.n_heads // a.n_kv_heads
    used = families(model)
    for family, variant in _checks(model):
        # under head dim 16 only the dense kernels run (``kernels.enabled``)
        if (head_dim < 16 and family != "dense") or not kernels.family_on(family, device):
            continue
        out = check_family(family, device, dtype, head_dim, group, variant)
        if out.ok:
            continue
        what = f"{kernels.FAMILIES[family]}" + (f" [{out.variant}]" if out.variant else "")
        message = f"kernel self-check on {device_label(device)}: {what} failed: {out.reason}"
        if kernels.strict():
            raise kernels.KernelCheckError(message + " (--kernels on)")
        if not _device_usable(device):
            raise kernels.KernelCheckError(message + "; the CUDA context is lost (a sticky "
                                           "error): rerun with --kernels off")
        kernels.switch_off(family, device, out.reason)
        print(f"warning: {message}; switched off, the run goes on through the PyTorch path",
              file=sys.stderr)
    return kernels.report(device, used, head_dim)


# --------------------------------------------------------------------------------------------
# The command line


def _selectors(head_dim: int, group: int, device, dtype) -> list:
    """The selectors of the selecting methods (quest, rocketkv, sparq with and without
    ``--sparq-reallocate``, exact_topk) at a small budget, from the method registry."""
    args = _args(head_dim, group)
    out = []
    for method, options in (("quest", {}), ("rocketkv", {}), ("sparq", {}),
                            ("sparq", {"sparq_reallocate": True}), ("exact_topk", {})):
        caches = build_caches(method, args, batch_size=1, prompt_len=256, max_new_tokens=4,
                              budget=32, dtype=dtype, device=device, **options)
        out.append(caches[0].selector)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rocketkv.engine.kernel_check``: one line per family (PASS / FAIL, max error,
    time); exit status 1 when any fails, 2 for bad input."""
    p = argparse.ArgumentParser(prog="python -m rocketkv.engine.kernel_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda if available, else cpu (the kernels "
                   "then run in Triton's interpreter)")
    p.add_argument("--dtype", choices=DTYPE_NAMES,
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--head-dim", type=int, default=128, help="default 128 (llama-3.1-8b)")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head (default 4)")
    p.add_argument("--groupsize", type=int, default=128, help="the int4 groupsize checked")
    args = p.parse_args(argv)
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        print(f"error: unknown device {name!r}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    if args.head_dim < 16 or args.head_dim % 2 or args.group < 1:
        print("error: --head-dim must be even and at least 16, --group at least 1",
              file=sys.stderr)
        return 2
    if device.type == "cpu":  # before triton is imported (kernels.ops())
        os.environ["TRITON_INTERPRET"] = "1"
        kernels.set_mode("force")
    if kernels.ops() is None:
        print(f"error: the kernels need triton: {kernels.missing()}", file=sys.stderr)
        return 1
    if device.type == "cpu":  # the interpreter runs one program after another: fewer, larger
        # ones (launch configs are the GPU's)
        sys.modules["rocketkv.kernels.dense"].TARGET_PROGRAMS = 8
        warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy's, in the interpreter
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    checks = [("prefix", None)]
    for sel in _selectors(args.head_dim, args.group, device, dtype):
        checks.append(("sparse", sel))
        if sel.page_size > 1:
            checks.append(("write", sel))
    checks += [("dense", f) for f in ("float", "int8", f"int4/{args.groupsize}")]
    print(f"kernel self-check on {device_label(device)}: dtype "
          f"{str(dtype).removeprefix('torch.')}, head dim {args.head_dim}, group {args.group} "
          f"(tolerance {TOLERANCE[dtype]:g}, relative to the float64 reference's largest)")
    failed = 0
    for family, variant in checks:
        out = check_family(family, device, dtype, args.head_dim, args.group, variant)
        failed += not out.ok
        err = "-" if out.error is None else f"{out.error:.2e}"
        status = "FAIL" if not out.ok else "SKIP" if out.note else "PASS"
        print(f"{status}  {family:<6} {out.variant or '-':<48} max error {err:>9}  "
              f"{out.seconds:6.2f} s" + (f"  {out.reason or out.note}" if status != "PASS"
                                         else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
