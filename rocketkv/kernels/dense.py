"""Triton kernels of the dense part of the decode step: the projections with what surrounds
them fused in, so that a layer is five or six kernels with the sparse ones.

A decode layer of the PyTorch path runs, around the attention: RMSNorm, the q/k/v matmul
(cuBLAS), bias and RoPE, the token's K/V write (and a selector's auxiliary keys), the output
matmul, the residual add and the second RMSNorm, the gate/up matmul, SiLU and product, the
down matmul and the second residual add; 10-15 kernels with cuBLAS's split-K reductions
(``results/NVIDIA-H200/profile-131008.md``). Here they are three kinds of launch of one GEMV
kernel (batch rows x weight rows), each reading the weight once:

``qkv_store`` (``torch.ops.rocketkv.qkv_store``)
    RMSNorm of the hidden state, the q/k/v projection (bias included, Qwen2), RoPE on q and
    k, and the token's key and value written into the cache at its slot with the selector's
    auxiliary keys updated (the page min/max summary, or SparQ's dim-major key column; the
    ``write_token`` formats). Returns the rotated queries. A program computes a block of
    even weight rows and the odd rows beside them: RoPE rotates adjacent pairs.

``linear`` (``torch.ops.rocketkv.linear``)
    ``[RMSNorm] x @ W^T``, with the residual added (output projection, down projection) or
    with SwiGLU (``silu(x @ W1^T) * (x @ W3^T)`` from the gate/up weight ``w13``: W1's rows
    then W3's, a program reading the same rows of each), or plain (the LM head after the final
    norm).

The norm is folded into the product: a program accumulates sum_k x_k^2 beside
sum_k (x_k g_k) W_nk over the same loads of x and scales by rsqrt(mean x^2 + eps) at the end
(RMSNorm, Zhang & Sennrich 2019: y = x / rms(x) * g). Rounding differs from the PyTorch path
(which rounds the normed x, each projection and each elementwise result to the model dtype)
by rounding once at the end: outputs agree within the dtype's tolerance, not bit for bit.

Quantized weights (``quantized.py``'s formats, ``quant_kind``) are read as they are stored
and dequantized in registers: int8 (N, K) rows, the product scaled by each row's scale at the
end; int4 nibbles (N, K / 2), a K block within one group of G features giving
scale sum_k x_k (q_nk - 8) + zero sum_k x_k (even features in the high nibble).

One batch row uses a multiply-and-sum per block (a GEMV); several use ``tl.dot`` on blocks of
16 rows. Block sizes follow a rule (``launch_config``) from four knobs: the module's constants,
or, on a GPU that ``rocketkv/kernels/tuned/*.json`` names, the knobs measured fastest there for that
launch (``launch_knobs``: per epilogue, weight format, one or several batch rows, K and N).
``scripts/bench_dense.py --tuned PATH`` times a grid of them against cuBLAS on a GPU and
writes such a file; ``--kernels sparse`` keeps the PyTorch projections for the whole-step
comparison. Registered with
``torch.library.triton_op`` as the sparse kernels are; tested against the PyTorch modules in
Triton's interpreter on CPU (``tests/test_dense_kernels.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rocketkv.kernels import AUX_NONE, tuning
from rocketkv.kernels.sparse import _dot_mode, _last_slot, _pow2, _summary_update, wrap

EPI_PLAIN = 0  # store x @ W^T
EPI_RESIDUAL = 1  # store residual + x @ W^T
EPI_SWIGLU = 2  # store silu(x @ W1^T) * (x @ W3^T)
EPI_QKV = 3  # RoPE on q and k; q stored, k and v written into the cache
QUANT_NONE = 0  # float weights
QUANT_INT8 = 1  # int8 (N, K), scales (N,): W = q * scale (quantized.Int8Linear)
QUANT_INT4 = 2  # nibbles uint8 (N, K / 2), scales and zeros (K / G, N, 2): W = (q - 8) scale
# + zero per group of G input features (quantized.Int4Linear, its "nibbles" layout)

TARGET_PROGRAMS = 512  # programs a launch aims at (about 4 per SM of an H100/H200), untuned
MAX_BLOCK_N = 32  # weight rows per program and row set, at most
K_BLOCK_GEMV = 256  # columns per loop iteration, one batch row
K_BLOCK_DOT = 64  # columns per loop iteration, tl.dot over batch rows
NUM_WARPS = 4  # per program (scripts/bench_dense.py times the alternatives on a GPU)

KNOBS = tuning.LAUNCH_KNOBS  # a launch's config: TARGET_PROGRAMS, MAX_BLOCK_N, K_BLOCK, NUM_WARPS
EPI_NAMES = {EPI_PLAIN: "plain", EPI_RESIDUAL: "residual", EPI_SWIGLU: "swiglu", EPI_QKV: "qkv"}
QUANT_NAMES = {QUANT_NONE: "float", QUANT_INT8: "int8", QUANT_INT4: "int4"}


def launch_key(epi: int, quant: int, M: int, K: int, n: int) -> str:
    """The name of a launch in a tuned table: epilogue, weight format, one batch row or
    several, input features K and output rows n (e.g. ``swiglu/int4/M=1/K=4096/n=28672``)."""
    return f"{EPI_NAMES[epi]}/{QUANT_NAMES[quant]}/M={1 if M == 1 else 'many'}/K={K}/n={n}"


def tuned_table(device: torch.device) -> dict[str, dict[str, int]]:
    """Launch key -> knobs measured on ``device``'s GPU (``kernels.tuning.table``); {} off
    CUDA or for a GPU no table names.

    Raises:
        ValueError: a table that is not valid (``kernels.tuning.read_table``)."""
    return tuning.table(device).launches


def launch_knobs(device: torch.device, epi: int, quant: int, M: int, K: int, n: int
                 ) -> dict[str, int] | None:
    """The tuned knobs of this launch on ``device`` (``tuned_table``), or None: the module's
    constants."""
    return tuned_table(device).get(launch_key(epi, quant, M, K, n))


@triton.jit
def _accumulate(x, w, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """(BLOCK_M, BLOCK_K) float32 x times (BLOCK_N, BLOCK_K) weights, transposed: float32
    (BLOCK_M, BLOCK_N)."""
    if BLOCK_M == 1:
        return tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    elif DOT == "native":
        return tl.dot(x.to(w.dtype), tl.trans(w))
    else:
        return tl.dot(x, tl.trans(w.to(tl.float32)), input_precision=DOT)


@triton.jit
def _int_weights(w, act, DOT: tl.constexpr):
    """Integer weight values (int8, or int4 less 8), exact in any float dtype, as
    ``_accumulate`` takes them: in the activation dtype ``act`` for the tensor cores
    ("native"), else float32 (the interpreter's casts to bfloat16 are not to be trusted)."""
    if DOT == "native":
        return w.to(act)
    else:
        return w.to(tl.float32)


@triton.jit
def _int4_x(x_ptr, m, mm, k0, K, s_xm, norm_ptr, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """A K block of x for int4 weights (within one group): its even and odd input features
    (BLOCK_M, BLOCK_K / 2) float32, times the norm's weight when ``NORM``; their sum per
    row; sum_k x_k^2 of the block (un-normed, for RMSNorm); and the byte columns ``j`` of
    the block with their mask. Loaded once for both row sets of a two-set epilogue."""
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    jm = j < K // 2
    xm = mm[:, None] & jm[None, :]
    xe = tl.load(x_ptr + m[:, None] * s_xm + 2 * j[None, :], mask=xm, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + m[:, None] * s_xm + 2 * j[None, :] + 1, mask=xm,
                 other=0.0).to(tl.float32)
    ss = tl.sum(xe * xe + xo * xo, axis=1)
    if NORM:
        xe = xe * tl.load(norm_ptr + 2 * j, mask=jm, other=0.0).to(tl.float32)[None, :]
        xo = xo * tl.load(norm_ptr + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)[None, :]
    return xe, xo, tl.sum(xe + xo, axis=1), ss, j, jm


@triton.jit
def _int4_dot(xe, xo, xsum, j, jm, w_ptr, sz_ptr, row, n, nm, k0, GROUP, s_sg, act,
              BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """One K block (``_int4_x``'s) of int4 weight rows ``row`` (byte offsets) / ``n`` (output
    rows): scale sum_k x_k (q_nk - 8) + zero sum_k x_k, (BLOCK_M, BLOCK_N) float32. Even
    input features sit in the high nibble, odd ones in the low."""
    b = tl.load(w_ptr + row[:, None] + j[None, :], mask=nm[:, None] & jm[None, :],
                other=8 * 16 + 8).to(tl.int32)
    part = _accumulate(xe, _int_weights((b >> 4) - 8, act, DOT), BLOCK_M, DOT) + \
        _accumulate(xo, _int_weights((b & 15) - 8, act, DOT), BLOCK_M, DOT)
    g = (k0 // GROUP).to(tl.int64) * s_sg + 2 * n.to(tl.int64)
    scale = tl.load(sz_ptr + g, mask=nm, other=0.0).to(tl.float32)
    zero = tl.load(sz_ptr + g + 1, mask=nm, other=0.0).to(tl.float32)
    return part * scale[None, :] + xsum[:, None] * zero[None, :]


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, bias_ptr, res_ptr,
                   rope_ptr, pos_ptr, off_ptr, kc_ptr, vc_ptr, aux_ptr, sz_ptr,
                   M, N, K, eps, s_xm, s_wn, s_om, s_rm,
                   s_cb, s_ch, s_cs, s_ab, s_ah, s_ar, s_ac, QN, KN, D, PAGE_SIZE, GROUP, s_sg,
                   NORM: tl.constexpr, BIAS: tl.constexpr, EPI: tl.constexpr,
                   AUX: tl.constexpr, HAS_OFFSET: tl.constexpr, QUANT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = m < M
    u = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # the program's output units
    # and its weight rows: set a, and set b for the two-set epilogues
    if EPI == 3:  # RoPE pairs: even rows and the odd rows beside them (N rows, N / 2 pairs)
        na = 2 * u
        nb = na + 1
        ma = u < N // 2
    elif EPI == 2:  # gate rows n and up rows N + n
        na = u
        nb = u + N
        ma = u < N
    else:
        na = u
        nb = u
        ma = u < N
    row_a = na.to(tl.int64) * s_wn  # weight offsets in int64 (headroom: vocab x dim is 2^30)
    row_b = nb.to(tl.int64) * s_wn
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if QUANT == 2:  # int4: a block lies in one group (BLOCK_K divides GROUP)
            xe, xo, xsum, ss_k, j, jm = _int4_x(x_ptr, m, mm, k0, K, s_xm, norm_ptr, NORM,
                                                BLOCK_K)
            ss += ss_k
            act = x_ptr.dtype.element_ty
            acc_a += _int4_dot(xe, xo, xsum, j, jm, w_ptr, sz_ptr, row_a, na, ma, k0, GROUP,
                               s_sg, act, BLOCK_M, DOT)
            if EPI >= 2:  # the second row set reads the same x
                acc_b += _int4_dot(xe, xo, xsum, j, jm, w_ptr, sz_ptr, row_b, nb, ma, k0,
                                   GROUP, s_sg, act, BLOCK_M, DOT)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K
            x = tl.load(x_ptr + m[:, None] * s_xm + kk[None, :],
                        mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
            if NORM:
                ss += tl.sum(x * x, axis=1)
                g = tl.load(norm_ptr + kk, mask=km, other=0.0).to(tl.float32)
                x = x * g[None, :]
            wa = tl.load(w_ptr + row_a[:, None] + kk[None, :], mask=ma[:, None] & km[None, :],
                         other=0)
            if QUANT == 1:
                wa = _int_weights(wa, x_ptr.dtype.element_ty, DOT)
            acc_a += _accumulate(x, wa, BLOCK_M, DOT)
            if EPI >= 2:
                wb = tl.load(w_ptr + row_b[:, None] + kk[None, :],
                             mask=ma[:, None] & km[None, :], other=0)
                if QUANT == 1:
                    wb = _int_weights(wb, x_ptr.dtype.element_ty, DOT)
                acc_b += _accumulate(x, wb, BLOCK_M, DOT)
    if QUANT == 1:  # int8: W = q * scale, per output row
        acc_a = acc_a * tl.load(sz_ptr + na, mask=ma, other=0.0).to(tl.float32)[None, :]
        acc_b = acc_b * tl.load(sz_ptr + nb, mask=ma, other=0.0).to(tl.float32)[None, :]
    if NORM:  # RMSNorm's 1 / rms(x), applied to the sums
        rs = (1.0 / tl.sqrt(ss / K + eps)).to(tl.float32)  # eps: fp32, fp64 or a float
        acc_a = acc_a * rs[:, None]
        acc_b = acc_b * rs[:, None]
    if BIAS:
        acc_a += tl.load(bias_ptr + na, mask=ma, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(bias_ptr + nb, mask=ma, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    if EPI == 0:
        tl.store(out_ptr + m[:, None] * s_om + na[None, :], acc_a.to(out_ty),
                 mask=mm[:, None] & ma[None, :])
    if EPI == 1:
        r = tl.load(res_ptr + m[:, None] * s_rm + na[None, :], mask=mm[:, None] & ma[None, :],
                    other=0.0).to(tl.float32)
        tl.store(out_ptr + m[:, None] * s_om + na[None, :], (acc_a + r).to(out_ty),
                 mask=mm[:, None] & ma[None, :])
    if EPI == 2:
        y = acc_a * tl.sigmoid(acc_a) * acc_b
        tl.store(out_ptr + m[:, None] * s_om + na[None, :], y.to(out_ty),
                 mask=mm[:, None] & ma[None, :])
    if EPI == 3:
        # rows: q (QN), then k (KN), then v (KN); QN and KN are whole heads of D rows, and a
        # program's rows lie in one head (2 BLOCK_N divides D)
        is_q = na < QN
        is_k = (na >= QN) & (na < QN + KN)
        is_v = na >= QN + KN
        d = na % D  # even dim within the head
        cos = tl.load(rope_ptr + d, mask=ma, other=1.0).to(tl.float32)  # rope (D / 2, 2):
        sin = tl.load(rope_ptr + d + 1, mask=ma, other=0.0).to(tl.float32)  # pair d // 2
        cos = tl.where(is_v, 1.0, cos)[None, :]
        sin = tl.where(is_v, 0.0, sin)[None, :]
        ya = acc_a * cos - acc_b * sin
        yb = acc_b * cos + acc_a * sin
        qm = mm[:, None] & (ma & is_q)[None, :]
        tl.store(out_ptr + m[:, None] * s_om + na[None, :], ya.to(out_ty), mask=qm)
        tl.store(out_ptr + m[:, None] * s_om + nb[None, :], yb.to(out_ty), mask=qm)
        rel = na - QN - tl.where(is_v, KN, 0)
        h = rel // D
        slot = _last_slot(pos_ptr, off_ptr, HAS_OFFSET)
        m64 = m.to(tl.int64)[:, None]  # a batch of 128K-token caches passes 2^31 elements
        dst = m64 * s_cb + h[None, :] * s_ch + slot * s_cs + d[None, :]
        km_ = mm[:, None] & (ma & is_k)[None, :]
        vm_ = mm[:, None] & (ma & is_v)[None, :]
        ka = ya.to(kc_ptr.dtype.element_ty)  # the stored key or value (cache dtype)
        kb = yb.to(kc_ptr.dtype.element_ty)
        tl.store(kc_ptr + dst, ka, mask=km_)
        tl.store(kc_ptr + dst + 1, kb, mask=km_)
        tl.store(vc_ptr + dst, ka, mask=vm_)
        tl.store(vc_ptr + dst + 1, kb, mask=vm_)
        a = aux_ptr + m64 * s_ab + h[None, :] * s_ah
        if AUX == 1:  # AUX_SUMMARY (B, H_kv, 2 D, pages): rows 0..D-1 max, D..2D-1 min
            page = slot // PAGE_SIZE
            first = (slot % PAGE_SIZE) == 0
            _summary_update(a, d[None, :], ka, km_, page, first, s_ar, s_ac, D)
            _summary_update(a, d[None, :] + 1, kb, km_, page, first, s_ar, s_ac, D)
        if AUX == 2:  # AUX_DIM_MAJOR: the dim-major key copy (B, H_kv, D, S): column slot
            tl.store(a + d[None, :] * s_ar + slot * s_ac, ka, mask=km_)
            tl.store(a + (d[None, :] + 1) * s_ar + slot * s_ac, kb, mask=km_)


def _block_n(units: int, limit: int, programs: int) -> int:
    """Weight rows per program and row set: the power of two that keeps about ``programs``
    programs over ``units`` output rows (RoPE pairs for ``qkv_store``), from 1 to ``limit``."""
    return min(1 << max(0, (units // programs).bit_length() - 1), limit)


def launch_config(epi: int, M: int, K: int, n: int, head_dim: int = 2,
                  knobs: dict[str, int] | None = None) -> tuple[int, int, int, tuple[int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, grid) of a launch over ``M`` batch rows, ``K`` input
    features and ``n`` output rows (for ``EPI_QKV`` the weight's rows, taken in RoPE pairs
    that must not cross a head of ``head_dim``), from ``knobs`` (``KNOBS``; its ``K_BLOCK``
    for whichever of the GEMV and the ``tl.dot`` path runs) or the module's constants."""
    units = n // 2 if epi == EPI_QKV else n
    programs = knobs["TARGET_PROGRAMS"] if knobs else TARGET_PROGRAMS
    limit = knobs["MAX_BLOCK_N"] if knobs else MAX_BLOCK_N
    if epi == EPI_QKV:  # a program's pairs lie in one head: the largest power of two
        limit = min(limit, (head_dim // 2) & -(head_dim // 2))  # dividing D / 2
    if M > 1 and min(limit, _pow2(units)) >= 16 and K >= 16:  # tl.dot over blocks of rows
        k_block = knobs["K_BLOCK"] if knobs else K_BLOCK_DOT
        block_m, block_k = min(64, max(16, _pow2(M))), min(k_block, _pow2(K))
        block_n = max(16, _block_n(units, limit, programs))
    else:  # one batch row per program: a GEMV
        k_block = knobs["K_BLOCK"] if knobs else K_BLOCK_GEMV
        block_m, block_k = 1, min(k_block, _pow2(K))
        block_n = _block_n(units, limit, programs)
    return block_m, block_n, block_k, (triton.cdiv(units, block_n), triton.cdiv(M, block_m))


def _launch(x2: Tensor, weight: Tensor, out: Tensor, *, norm: Tensor | None, eps: float,
            bias: Tensor | None, residual: Tensor | None, epi: int, n: int,
            rope: Tensor | None = None, pos: Tensor | None = None,
            offset: Tensor | None = None,
            k_cache: Tensor | None = None, v_cache: Tensor | None = None,
            aux: Tensor | None = None, aux_kind: int = AUX_NONE, qn: int = 0, kn: int = 0,
            head_dim: int = 2, page_size: int = 1, scales: Tensor | None = None,
            groupsize: int = 0) -> None:
    """One ``_linear_kernel`` launch: ``n`` output rows of ``x2`` (M, K) (for ``EPI_QKV`` the
    weight's rows, which the program takes in RoPE pairs); ``weight`` float, or int8 /
    int4 nibbles with ``scales`` (``quant_kind``)."""
    quant = quant_kind(weight, scales, groupsize)
    M, K = x2.shape  # int(): under a dynamic-shape compile the blocks (constexprs) specialize
    M, K, n = int(M), int(K), int(n)
    knobs = launch_knobs(x2.device, epi, quant, M, K, n)
    block_m, block_n, block_k, grid = launch_config(epi, M, K, n, head_dim, knobs)
    if quant == QUANT_INT4:  # a K block within one group
        block_k = min(block_k, groupsize)
    sc = k_cache.stride() if k_cache is not None else (0, 0, 0, 0)
    sa = aux.stride() if aux is not None and aux_kind != AUX_NONE else (0, 0, 0, 0)
    dummy = out  # pointer arguments an epilogue does not read
    wrap(_linear_kernel)[grid](
        x2, weight, out, norm if norm is not None else dummy,
        bias if bias is not None else dummy, residual if residual is not None else dummy,
        rope if rope is not None else dummy, pos if pos is not None else dummy,
        offset if offset is not None else dummy,
        k_cache if k_cache is not None else dummy, v_cache if v_cache is not None else dummy,
        aux if aux is not None and aux_kind != AUX_NONE else dummy,
        scales if scales is not None else dummy,
        M, n, K, eps, x2.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        sc[0], sc[1], sc[2], sa[0], sa[1], sa[2], sa[3], qn, kn, head_dim, page_size,
        max(groupsize, 1), scales.stride(0) if quant == QUANT_INT4 else 0,
        NORM=norm is not None, BIAS=bias is not None, EPI=epi, AUX=aux_kind,
        HAS_OFFSET=offset is not None, QUANT=quant, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        DOT=_dot_mode(weight if quant == QUANT_NONE else x2),
        num_warps=knobs["NUM_WARPS"] if knobs else NUM_WARPS)


def quant_kind(weight: Tensor, scales: Tensor | None, groupsize: int) -> int:
    """The weight format of a launch, from its dtype: float (``QUANT_NONE``), int8
    (``QUANT_INT8``: ``scales`` (N,)) or uint8 nibbles (``QUANT_INT4``: ``scales`` the
    (K / groupsize, N, 2) scales and zeros, contiguous).

    Raises:
        ValueError: int weights without scales, or int4 without a group size."""
    if weight.is_floating_point():
        return QUANT_NONE
    if scales is None:
        raise ValueError(f"{weight.dtype} weights need their scales")
    if weight.dtype == torch.int8:
        return QUANT_INT8
    if weight.dtype == torch.uint8 and groupsize > 0 and scales.is_contiguous():
        return QUANT_INT4
    raise ValueError(f"no dense kernel for {weight.dtype} weights (groupsize {groupsize})")


def _rows(x: Tensor) -> Tensor:
    """(..., K) -> (rows, K) with the last dim contiguous (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@torch.library.triton_op("rocketkv::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, norm_weight: Tensor | None, eps: float,
           residual: Tensor | None, swiglu: bool, scales: Tensor | None = None,
           groupsize: int = 0) -> Tensor:
    """``[RMSNorm] x @ W^T`` with an optional residual add or SwiGLU, in one kernel.

    Args:
        x: (..., K) activations (model dtype).
        weight: (N, K) weights, rows contiguous; with ``swiglu`` (2 N, K): the gate rows
            then the up rows (``FeedForward.w13``). Quantized (``quant_kind``): int8 (N, K)
            with ``scales`` (N,), or int4 nibbles uint8 (N, K / 2) with ``scales`` the
            (K / groupsize, N, 2) scales and zeros (``quantized.py``'s formats; dequantized
            in registers, the products in float32).
        norm_weight: (K,) RMSNorm gain applied to x first (with ``eps``), or None.
        residual: (..., N) added to the product, or None.
        swiglu: return silu(x @ W1^T) * (x @ W3^T).
    Returns:
        (..., N) in x's dtype (the products and the norm in float32, rounded once).
    """
    x2 = _rows(x)
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    res = _rows(residual) if residual is not None else None
    epi = EPI_SWIGLU if swiglu else EPI_RESIDUAL if residual is not None else EPI_PLAIN
    _launch(x2, weight, out, norm=norm_weight, eps=eps, bias=None, residual=res, epi=epi, n=n,
            scales=scales, groupsize=groupsize)
    return out.view(*x.shape[:-1], n)


@torch.library.triton_op("rocketkv::qkv_store", mutates_args={"k_cache", "v_cache", "aux"})
def qkv_store(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor, bias: Tensor | None,
              rope: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
              offset: Tensor | None, aux: Tensor, aux_kind: int, page_size: int,
              n_heads: int, scales: Tensor | None = None, groupsize: int = 0) -> Tensor:
    """RMSNorm, the q/k/v projection, RoPE and the token's K/V write, in one kernel.

    Args:
        x: (B, 1, dim) hidden states of one decode step (un-normed).
        norm_weight: (dim,) the attention norm's gain; ``eps`` its epsilon.
        weight: ((H + 2 H_kv) D, dim) ``Attention.wqkv``'s weight (q rows, k rows, v rows);
            ``bias`` the same rows' bias or None; quantized with ``scales`` and
            ``groupsize`` as in ``linear``.
        rope: (1, D / 2, 2) float32 cos and sin of the step's position (``precompute_rope``).
        k_cache, v_cache, pos, offset, aux, aux_kind, page_size: a ``cache.TokenStore``:
            the (B, H_kv, S, D) static buffers (last dim contiguous) written at slot
            ``pos - offset`` ((1,) int64 device tensors; ``offset`` None: 0), and the
            selector's auxiliary keys as in ``write_token`` (``AUX_SUMMARY``,
            ``AUX_DIM_MAJOR`` or ``AUX_NONE``).
        n_heads: query heads H (H_kv and D are the cache's).
    Returns:
        q (B, H, 1, D) rotated, in x's dtype.
    """
    B, Hkv, _, D = k_cache.shape
    x2 = _rows(x)
    qn, kn = n_heads * D, Hkv * D
    q = torch.empty(B, qn, dtype=x.dtype, device=x.device)
    _launch(x2, weight, q, norm=norm_weight, eps=eps, bias=bias, residual=None, epi=EPI_QKV,
            n=weight.shape[0], rope=rope, pos=pos, offset=offset, k_cache=k_cache,
            v_cache=v_cache, aux=aux, aux_kind=aux_kind, qn=qn, kn=kn, head_dim=D,
            page_size=page_size, scales=scales, groupsize=groupsize)
    return q.view(B, n_heads, 1, D)

