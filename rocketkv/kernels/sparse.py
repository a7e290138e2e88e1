"""Triton kernels of the sparse decode step: token write, selection and sparse attention.

These kernels replace the about 30 small PyTorch kernels per layer of a selecting method's
decode step (RocketKV @256 on the H200: ``results/NVIDIA-H200/profile-131008.md``) and the
dense decode attention:

``write_token`` (``torch.ops.rocketkv.write_token``)
    The new token's key and value into the static cache at its slot, and in the same pass
    the auxiliary keys a selector keeps: the min/max summary of the token's page (Quest,
    hybrid, RocketKV; a new page restarts from the token) or its column of the dim-major key
    copy (SparQ). One program per (sequence, KV head).

``paged_select`` (``torch.ops.rocketkv.paged_select``)
    Scores every page (or token: pages of one slot) of one (sequence, KV head) and picks the
    budget's ``k`` tokens, page-first, in one program:

    * ``MODE_SOFTMAX`` (hybrid attention, RocketKV Alg. 2 steps 1-3; SparQ; Exact-TopK): the
      top-``r`` dims of the group-summed |q| (ranked in the kernel, ties to the lower dim),
      the summary row each reads (the max row where the group-summed q is >= 0, else the min
      row), logits s_gp = q_g[dims] . row[dims, p] / T_g with SparQ's temperature T_g =
      sqrt(D sum_dims |q_g| / sum |q_g|), a softmax over the valid tokens (each page counted
      once per written slot: log(count) in the normalizer, two passes with an online
      log-sum-exp), summed over the query group. With r = D on K^T this is the exact
      group-summed attention of Exact-TopK (T_g = sqrt(D)).
    * ``MODE_BOUND`` (Quest): sum_i max(q_i kmax_i, q_i kmin_i) summed over the group, one
      GEMV over the summary; the newest page always ranks first.

    Then the k tokens: the largest threshold tau of the page scores whose pages hold at least
    k valid tokens (a bisection on the scores' order-preserving int32 keys, each page
    weighted by its written slots, its bounds snapping to the keys: at most 32 steps);
    pages above tau give all their written slots, pages at tau their first slots in page
    order until k are taken. That is the set of the reference's
    page-first top-k (``compression.selection.top_pages_to_tokens``), ties aside, without a
    sort. The chosen pages are written compacted, with how many of their first slots to read:
    at most M = min(P, ceil(k / page_size) + 1) pages (k for pages of one slot).

The split selection (``paged_select`` / ``select_attend`` with ``splits`` > 1)
    The same scores and choice over more pages than one program should scan
    (``selection_splits``: past ``SPLIT_PAGES``), in three kernels over (sequence x KV head,
    split): each split's per-head (max, sum) of the exp-logits; each split's scores, by the
    merged log-sum-exp, and its own k tokens, chosen in registers; one program per KV head
    choosing k among the splits' candidates (a superset of the global choice) and, for
    ``select_attend``, attending over them.

``attend_pages`` (``torch.ops.rocketkv.attend_pages``)
    Exact attention of a query group over the chosen pages' slots, an online softmax in
    float32, the query group's G heads padded to 16 rows for ``tl.dot``; split over the page
    list into ``splits`` programs per KV head with a log-sum-exp merge (flash-decoding) when
    the selection is large, one program writing the output directly when it is not.

``select_attend`` (``torch.ops.rocketkv.select_attend``)
    ``paged_select`` and ``attend_pages`` in one program per (sequence, KV head), the page
    list passed between the two phases through memory behind a barrier: what runs when the
    selection attends in one program (k <= ``SPLIT_TOKENS``, the paper's budgets).

``attend_prefix`` (``torch.ops.rocketkv.attend_prefix``)
    The dense decode attention (Full-KV, and the methods that attend to everything they
    keep): the written prefix of the static buffers, the slot written last read on the
    device, each KV head once for its query group, split over the sequence with the same
    merge; splits past the written prefix read nothing.

Each kernel is a ``torch.library.triton_op``, so ``torch.compile`` traces it into the decode
graph and CUDA graphs capture it. The PyTorch functions in ``compression/`` stay as the CPU
path and as the reference the tests compare every kernel with (on CPU under
``TRITON_INTERPRET=1``, which must be set before this module is imported; on CUDA at real
shapes with ``pytest -m cuda``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from rocketkv.kernels import AUX_NONE

MODE_SOFTMAX = 0  # hybrid / SparQ / Exact-TopK scores
MODE_BOUND = 1  # Quest page bounds

SCORE_BLOCK = 64  # pages scored per loop iteration of paged_select
SELECT_REGISTER_PAGES = 8192  # up to this many pages the choice of k runs in registers (at
# most 32 bisection steps, each one block reduction; compiles for sm_90, 0-28 bytes spilled
# at 8192); more pages:
# passes over the scores, which the selectors leave to the PyTorch path (kernels.selection_fits)
SELECT_BLOCK = 1024  # scores per loop iteration of those passes
SPLIT_PAGES = 2048  # pages one program scores and chooses over: more pages split the selection
# The selection runs B x H_kv programs per layer: at batch 1 and 8 KV heads, 8 of an H200's 132
# SMs read every page summary while the rest idle (RocketKV @256 at 32K: 740-1,171 pages, 57 us
# a layer on 2026-11-27). So a step splits the pages further, until the programs fill the GPU's
# SMs once (``selection_splits``: the power of two >= SMs / (B x H_kv)), each split keeping at
# least MIN_SPLIT_PAGES pages: below that a split's fixed costs (its log-sum-exp pass, its
# candidate list, the last choice over them) outweigh the pages it scores. A tuned table may
# set it (a large value keeps B x H_kv programs).
MIN_SPLIT_PAGES = 64  # one SCORE_BLOCK loop iteration a split at the least
# over programs of about this many pages each, then choose among their candidates (untuned:
# RocketKV's pages stay in one program up to 128K, hybrid's and SparQ's one-token pages split)
SELECT_CANDIDATES = 8192  # at most this many candidates (splits x their page lists) reach the
# last choice, held in registers like SELECT_REGISTER_PAGES
NUM_WARPS = 8  # per program of paged_select and attend_pages: their (D x 64) float32 tiles
# stay in registers (untuned: the GPU checklist measures the kernels)
ATTEND_TOKENS = 64  # slots attend_pages loads per loop iteration
SPLIT_TOKENS = 512  # selections up to this many tokens attend in one program per KV head;
# larger ones split the page list over programs of about this many tokens each (untuned:
# the GPU checklist measures it)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def wrap(kernel):
    """``torch.library.wrap_triton(kernel)``, which a ``triton_op`` launches through so
    ``torch.compile`` traces the launch; under ``TRITON_INTERPRET=1`` (``triton.jit`` then
    gives an ``InterpretedFunction``) the kernel itself, as torch 2.13 returns it. torch 2.11
    and 2.12 refuse to wrap an interpreted kernel (RuntimeError), which would fail every
    interpreter test there; a GPU never interprets."""
    if isinstance(kernel, InterpretedFunction):
        return kernel
    return torch.library.wrap_triton(kernel)


def _dot_mode(x: Tensor) -> str:
    """How the kernels' ``tl.dot`` reads operands loaded from ``x`` (``_dot``): "native" for
    bfloat16/float16 on a GPU (the tensor cores' bf16 path with float32 accumulation, as the
    PyTorch reference's bf16 matmuls), "ieee" for float32 (full precision), "tf32" for
    16-bit data in Triton's interpreter, whose bf16 dots are not to be trusted: there both
    operands are widened to float32 (tf32 would hold every bf16 value exactly)."""
    if x.dtype == torch.float32:
        return "ieee"
    return "tf32" if triton.knobs.runtime.interpret else "native"


@triton.jit
def _summary_update(a, d, k, mask, page, first, s_ar, s_ac, D):
    """Column ``page`` of a page summary at rows ``d`` (max) and ``D + d`` (min) takes in the
    stored keys ``k``, or restarts from them on the page's first slot (``first``); compared
    in float32 (exact; the interpreter compares bfloat16 by raw bits). Used by
    ``write_token`` and by ``kernels.dense.qkv_store``."""
    kf = k.to(tl.float32)
    mx = tl.load(a + d * s_ar + page * s_ac, mask=mask).to(tl.float32)
    mn = tl.load(a + (d + D) * s_ar + page * s_ac, mask=mask).to(tl.float32)
    mx = tl.where(first, kf, tl.maximum(mx, kf))
    mn = tl.where(first, kf, tl.minimum(mn, kf))
    tl.store(a + d * s_ar + page * s_ac, mx.to(k.dtype), mask=mask)
    tl.store(a + (d + D) * s_ar + page * s_ac, mn.to(k.dtype), mask=mask)


@triton.jit
def _write_token_kernel(k_cache, v_cache, aux, k_new, v_new, slot_ptr,
                        s_cb, s_ch, s_cs, s_kb, s_kh, s_vb, s_vh, s_ab, s_ah, s_ar, s_ac,
                        H_kv, D, PAGE_SIZE,
                        AUX: tl.constexpr, D_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H_kv).to(tl.int64)  # offsets in int64: batches of long caches pass 2^31
    h = pid % H_kv
    d = tl.arange(0, D_BLOCK)
    dm = d < D
    slot = tl.load(slot_ptr).to(tl.int64)
    kv = tl.load(k_new + b * s_kb + h * s_kh + d, mask=dm)
    vv = tl.load(v_new + b * s_vb + h * s_vh + d, mask=dm)
    base = b * s_cb + h * s_ch + slot * s_cs
    tl.store(k_cache + base + d, kv, mask=dm)
    tl.store(v_cache + base + d, vv, mask=dm)
    a = aux + b * s_ab + h * s_ah
    if AUX == 1:  # page summary: rows 0..D-1 max, D..2D-1 min, column = page
        _summary_update(a, d, kv, dm, slot // PAGE_SIZE, (slot % PAGE_SIZE) == 0, s_ar, s_ac,
                        D)
    if AUX == 2:  # dim-major copy: column = slot
        tl.store(a + d * s_ar + slot * s_ac, kv, mask=dm)


@torch.library.triton_op("rocketkv::write_token", mutates_args={"k_cache", "v_cache", "aux"})
def write_token(k_cache: Tensor, v_cache: Tensor, aux: Tensor, k: Tensor, v: Tensor,
                slot: Tensor, aux_kind: int, page_size: int) -> None:
    """Write one decoded token and update the selector's auxiliary keys, in one kernel.

    Args:
        k_cache, v_cache: (B, H_kv, S, D) static buffers (last dim contiguous), written at
            ``slot``.
        aux: ``AUX_SUMMARY``: the page summary (B, H_kv, 2 D, P) (``page_summary`` layout),
            its column ``slot // page_size`` updated (max/min, restarted on a page's first
            slot); ``AUX_DIM_MAJOR``: the transposed keys (B, H_kv, D, S), column ``slot``
            written; ``AUX_NONE``: not touched (any tensor that aliases neither cache).
        k, v: (B, H_kv, 1, D) the new token's key (rotated) and value in the cache's dtype,
            last dim contiguous.
        slot: (1,) int64 device tensor.
    """
    B, Hkv, _, D = k_cache.shape
    sa = aux.stride() if aux_kind != AUX_NONE else (0, 0, 0, 0)
    wrap(_write_token_kernel)[(B * Hkv,)](
        k_cache, v_cache, aux, k, v, slot,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), sa[0], sa[1], sa[2], sa[3], Hkv, D, page_size,
        AUX=aux_kind, D_BLOCK=_pow2(D))


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """a @ b, float32 result: ``a`` float32 (queries, probabilities), ``b`` as loaded from
    the cache (``_dot_mode``: "native" casts ``a`` to b's 16-bit dtype)."""
    if DOT == "native":
        return tl.dot(a.to(b.dtype), b)
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=DOT)


@triton.jit
def _last_slot(last_ptr, off_ptr, HAS_OFFSET: tl.constexpr):
    """The slot written last: ``*last_ptr``, less ``*off_ptr`` (a compressed cache's slot
    offset, applied here rather than by a launch of its own) with ``HAS_OFFSET``; int64."""
    last = tl.load(last_ptr).to(tl.int64)
    if HAS_OFFSET:
        last -= tl.load(off_ptr).to(tl.int64)
    return last


@triton.jit
def _order_key(x):
    """fp32 -> int32 whose signed order is the floats' order (NaN above +inf)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _paged_select_kernel(q_ptr, rows_ptr, last_ptr, off_ptr, scores_ptr, pages_ptr, take_ptr,
                         s_qb, s_qh, s_rb, s_rh, s_rr, s_rp,
                         H_kv, G, D, P, R, K, M, PAGE_SIZE,
                         MODE: tl.constexpr, TWO_BOUNDS: tl.constexpr, HAS_OFFSET: tl.constexpr,
                         DOT: tl.constexpr, G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
                         BLOCK: tl.constexpr, PR: tl.constexpr, SEL: tl.constexpr):
    _select(tl.program_id(0), q_ptr, rows_ptr, last_ptr, off_ptr, scores_ptr, pages_ptr,
            take_ptr, s_qb, s_qh, s_rb, s_rh, s_rr, s_rp, H_kv, G, D, P, R, K, M, PAGE_SIZE,
            MODE, TWO_BOUNDS, HAS_OFFSET, DOT, G_BLOCK, D_BLOCK, BLOCK, PR, SEL)


@triton.jit
def _page_counts(p, end, last, PAGE_SIZE):
    """Written slots of pages ``p``: clamp(last + 1 - p * PAGE_SIZE, 0, PAGE_SIZE), 0 at or
    past ``end``."""
    cnt = tl.minimum(tl.maximum(last + 1 - p * PAGE_SIZE, 0), PAGE_SIZE)
    return tl.where(p < end, cnt, 0)


@triton.jit
def _softmax_terms(qf, G, D, R, TWO_BOUNDS: tl.constexpr, G_BLOCK: tl.constexpr,
                   D_BLOCK: tl.constexpr):
    """``MODE_SOFTMAX``'s terms of a query group ``qf`` (G_BLOCK, D_BLOCK) float32: the top-R
    dims of the group-summed |q| (rank = dims ahead of it, ties to the lower dim), the row
    each reads (the min row D + d where the group-summed q is negative, with ``TWO_BOUNDS``),
    the queries zeroed outside the dims, and 1 / SparQ's temperature per head (0 on padding
    rows). Returns (sel, row, qs, inv_t)."""
    g = tl.arange(0, G_BLOCK)
    d = tl.arange(0, D_BLOCK)
    gm = g < G
    dm = d < D
    a = tl.sum(tl.abs(qf), axis=0)  # (D_BLOCK,)
    a_i = tl.where(dm, a, -1.0)
    ahead = (a_i[None, :] > a_i[:, None]) | ((a_i[None, :] == a_i[:, None])
                                             & (d[None, :] < d[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    sel = (rank < R) & dm
    row = d
    if TWO_BOUNDS:
        row = tl.where(tl.sum(qf, axis=0) < 0, d + D, d)
    qs = tl.where(sel[None, :], qf, 0.0)  # (G_BLOCK, D_BLOCK), zero outside the dims
    qsum = tl.sum(tl.abs(qf), axis=1)
    qsel = tl.sum(tl.where(sel[None, :], tl.abs(qf), 0.0), axis=1)
    qsum = tl.where(gm, qsum, 1.0)  # padding rows: no 0 / 0
    inv_t = tl.where(gm, 1.0 / tl.sqrt(D * qsel / qsum), 0.0)  # SparQ temperature
    return sel, row, qs, inv_t


@triton.jit
def _logits(rows, row, sel, qs, inv_t, p, ok, s_rr, s_rp, DOT: tl.constexpr):
    """Logits (G_BLOCK, BLOCK) of pages ``p`` (read where ``ok``): q_g[dims] . row[dims, p]
    / T_g."""
    kr = tl.load(rows + row[:, None] * s_rr + p[None, :] * s_rp,
                 mask=sel[:, None] & ok[None, :], other=0.0)  # (D_BLOCK, BLOCK)
    return _dot(qs, kr, DOT) * inv_t[:, None]


@triton.jit
def _lse_range(rows, row, sel, qs, inv_t, last, p_begin, p_end, logits_ptr, s_lg, s_rr, s_rp,
               G, PAGE_SIZE, STORE: tl.constexpr, DOT: tl.constexpr, G_BLOCK: tl.constexpr,
               BLOCK: tl.constexpr):
    """Pass 1 of ``MODE_SOFTMAX`` over pages [p_begin, p_end): the online (max, sum) of the
    group's exp-logits over the valid tokens, each page counted once per written slot
    (log(count) added). With ``STORE`` the logits go to ``logits_ptr`` (G rows of stride
    ``s_lg``, column = page) for pass 2 to read instead of the rows."""
    g = tl.arange(0, G_BLOCK)
    offs = tl.arange(0, BLOCK)
    m_run = tl.full((G_BLOCK,), -1.0e30, tl.float32)
    l_run = tl.zeros((G_BLOCK,), tl.float32)
    for p0 in range(p_begin, p_end, BLOCK):
        p = p0 + offs
        cnt = _page_counts(p, p_end, last, PAGE_SIZE)
        ok = cnt > 0
        s = _logits(rows, row, sel, qs, inv_t, p, ok, s_rr, s_rp, DOT)
        if STORE:
            tl.store(logits_ptr + g[:, None] * s_lg + p[None, :], s,
                     mask=(g < G)[:, None] & ok[None, :])
        logn = tl.log(tl.maximum(cnt, 1).to(tl.float32))
        s = tl.where(ok[None, :], s + logn[None, :], float("-inf"))
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        l_run = l_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m_run = m_new
    return m_run, l_run


@triton.jit
def _softmax_scores(rows, row, sel, qs, inv_t, lse, last, p_begin, p_end, scores_ptr,
                    logits_ptr, s_lg, s_rr, s_rp, G, PAGE_SIZE, LOAD: tl.constexpr,
                    DOT: tl.constexpr, G_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 2 of ``MODE_SOFTMAX``: each page's token probability exp(logit - lse) summed over
    the group (-inf for pages without a written slot) to ``scores_ptr`` (column = page), for
    pages [p_begin, p_end); the logits recomputed, or with ``LOAD`` read from pass 1's."""
    g = tl.arange(0, G_BLOCK)
    gm = g < G
    offs = tl.arange(0, BLOCK)
    for p0 in range(p_begin, p_end, BLOCK):
        p = p0 + offs
        ok = _page_counts(p, p_end, last, PAGE_SIZE) > 0
        if LOAD:
            s = tl.load(logits_ptr + g[:, None] * s_lg + p[None, :],
                        mask=gm[:, None] & ok[None, :], other=0.0)
        else:
            s = _logits(rows, row, sel, qs, inv_t, p, ok, s_rr, s_rp, DOT)
        prob = tl.where(gm[:, None], tl.exp(s - lse[:, None]), 0.0)
        score = tl.where(ok, tl.sum(prob, axis=0), float("-inf"))
        tl.store(scores_ptr + p, score, mask=p < p_end)


@triton.jit
def _bound_scores(rows, qf, last, p_begin, p_end, scores_ptr, s_rr, s_rp, D, PAGE_SIZE,
                  TWO_BOUNDS: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """``MODE_BOUND`` (Quest): max(q_i, 0) kmax_i + min(q_i, 0) kmin_i summed over the dims,
    the group summed first, to ``scores_ptr`` for pages [p_begin, p_end); the newest page
    scores +inf, pages without a written slot -inf."""
    d = tl.arange(0, D_BLOCK)
    dm = d < D
    offs = tl.arange(0, BLOCK)
    if TWO_BOUNDS:
        qpos = tl.sum(tl.maximum(qf, 0.0), axis=0)
        qneg = tl.sum(tl.minimum(qf, 0.0), axis=0)
    else:
        qpos = tl.sum(qf, axis=0)
        qneg = tl.zeros((D_BLOCK,), tl.float32)
    newest = last // PAGE_SIZE
    for p0 in range(p_begin, p_end, BLOCK):
        p = p0 + offs
        ok = _page_counts(p, p_end, last, PAGE_SIZE) > 0
        lm = dm[:, None] & ok[None, :]
        kmax = tl.load(rows + d[:, None] * s_rr + p[None, :] * s_rp, mask=lm, other=0.0)
        qp = qpos.to(kmax.dtype).to(tl.float32)
        bound = tl.sum(qp[:, None] * kmax.to(tl.float32), axis=0)
        if TWO_BOUNDS:
            kmin = tl.load(rows + (d + D)[:, None] * s_rr + p[None, :] * s_rp, mask=lm,
                           other=0.0)
            qn = qneg.to(kmin.dtype).to(tl.float32)
            bound += tl.sum(qn[:, None] * kmin.to(tl.float32), axis=0)
        bound = tl.where(p == newest, float("inf"), bound)
        tl.store(scores_ptr + p, tl.where(ok, bound, float("-inf")), mask=p < p_end)


@triton.jit
def _select(pid, q_ptr, rows_ptr, last_ptr, off_ptr, scores_ptr, pages_ptr, take_ptr,
            s_qb, s_qh, s_rb, s_rh, s_rr, s_rp, H_kv, G, D, P, R, K, M, PAGE_SIZE,
            MODE: tl.constexpr, TWO_BOUNDS: tl.constexpr, HAS_OFFSET: tl.constexpr,
            DOT: tl.constexpr, G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
            BLOCK: tl.constexpr, PR: tl.constexpr, SEL: tl.constexpr):
    """``paged_select`` for program ``pid`` (one sequence and KV head): page scores to
    ``scores_ptr``, the chosen pages and their slot counts to ``pages_ptr``/``take_ptr``.
    BLOCK pages per scoring step; the choice over the scores runs in registers when ``PR``
    (a power of two >= P) is nonzero, else in passes of ``SEL`` pages. Returns each head's
    log-sum-exp of the logits over the valid tokens (G_BLOCK,) (``MODE_SOFTMAX``; 0 else)."""
    _, _, qf, rows, _ = _program_group(pid, q_ptr, rows_ptr, rows_ptr, s_qb, s_qh, s_rb, s_rh,
                                       H_kv, G, D, G_BLOCK, D_BLOCK)
    last = _last_slot(last_ptr, off_ptr, HAS_OFFSET).to(tl.int32)
    out = pid.to(tl.int64) * P
    if MODE == 0:  # two passes: the log-sum-exp over every valid token, then the scores
        sel, row, qs, inv_t = _softmax_terms(qf, G, D, R, TWO_BOUNDS, G_BLOCK, D_BLOCK)
        m_run, l_run = _lse_range(rows, row, sel, qs, inv_t, last, 0, P, scores_ptr, 0,
                                  s_rr, s_rp, G, PAGE_SIZE, False, DOT, G_BLOCK, BLOCK)
        lse = m_run + tl.log(l_run)
        _softmax_scores(rows, row, sel, qs, inv_t, lse, last, 0, P, scores_ptr + out,
                        scores_ptr, 0, s_rr, s_rp, G, PAGE_SIZE, False, DOT, G_BLOCK, BLOCK)
    else:
        lse = tl.zeros((G_BLOCK,), tl.float32)
        _bound_scores(rows, qf, last, 0, P, scores_ptr + out, s_rr, s_rp, D, PAGE_SIZE,
                      TWO_BOUNDS, D_BLOCK, BLOCK)
    tl.debug_barrier()  # the scores this program wrote are read back below
    # k tokens: the largest tau with at least k valid tokens in pages scoring >= tau; pages
    # above tau give all their slots, pages at tau their first slots in page order, up to k
    k_eff = tl.minimum(K, last + 1)
    dst = pid.to(tl.int64) * M
    if PR > 0:  # every page's key and count in registers: each step is one block reduction
        p = tl.arange(0, PR)
        key, cnt = _page_keys(scores_ptr + out, p, P, last, PAGE_SIZE)
        n_sel = _choose(key, cnt, p, k_eff, pages_ptr + dst, take_ptr + dst, M)
    else:  # more pages than registers hold: the same steps, each a pass over the scores
        lo = tl.full((), -2147483648, tl.int64)
        hi = tl.full((), 2147483647, tl.int64)
        offs_s = tl.arange(0, SEL)
        for _ in range(32):
            mid = (lo + hi + 1) // 2
            w = tl.zeros((), tl.int32)
            for p0 in range(0, P, SEL):
                key, cnt = _page_keys(scores_ptr + out, p0 + offs_s, P, last, PAGE_SIZE)
                w += tl.sum(tl.where(key >= mid, cnt, 0))
            big = w >= k_eff
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid - 1)
        room = k_eff  # slots left for pages at tau, less those taken by earlier blocks
        for p0 in range(0, P, SEL):
            key, cnt = _page_keys(scores_ptr + out, p0 + offs_s, P, last, PAGE_SIZE)
            room -= tl.sum(tl.where(key > lo, cnt, 0))
        n_sel = tl.zeros((), tl.int32)
        for p0 in range(0, P, SEL):
            p = p0 + offs_s
            key, cnt = _page_keys(scores_ptr + out, p, P, last, PAGE_SIZE)
            take, tied = _take(key, cnt, lo, room)
            chosen = (take > 0).to(tl.int32)
            pos = n_sel + tl.cumsum(chosen, axis=0) - chosen
            tl.store(pages_ptr + dst + pos, p, mask=chosen > 0)
            tl.store(take_ptr + dst + pos, take, mask=chosen > 0)
            room -= tied
            n_sel += tl.sum(chosen)
    _clear_tail(pages_ptr + dst, take_ptr + dst, n_sel, M, BLOCK)
    return lse


@triton.jit
def _page_keys(scores_ptr, p, end, last, PAGE_SIZE):
    """Pages ``p``'s order keys (int64; -inf's at or past ``end``) and written slots (0 at
    or past ``end``)."""
    cnt = _page_counts(p, end, last, PAGE_SIZE)
    key = _order_key(tl.load(scores_ptr + p, mask=p < end, other=float("-inf")))
    return key.to(tl.int64), cnt


@triton.jit
def _take(key, cnt, tau, room):
    """Slots each page gives to the k chosen: all of them above the threshold ``tau``; at
    ``tau``, in page order, while ``room`` (the k not taken above tau, nor at tau by earlier
    blocks) lasts. Returns the counts and the slots of these pages at tau."""
    eq = tl.where(key == tau, cnt, 0)
    at_tau = tl.minimum(tl.maximum(room - (tl.cumsum(eq, axis=0) - eq), 0), eq)
    return tl.where(key > tau, cnt, at_tau), tl.sum(eq)


@triton.jit
def _count_snap(c1, up1, dn1, c2, up2, dn2):
    """Combine of ``_choose``'s reduction: slots summed, the smallest key at or above the
    midpoint and the largest key below it."""
    return c1 + c2, tl.minimum(up1, up2), tl.maximum(dn1, dn2)


@triton.jit
def _choose(key, cnt, page, k_eff, pages_ptr, take_ptr, limit):
    """The choice of ``k_eff`` slots among pages held in registers (order keys ``key``
    int64, ``cnt`` slots each, ids ``page``): tau, the largest order key whose pages
    (key >= tau) hold at least k_eff slots, by a bisection over the int32 key range whose
    bounds snap to the pages' keys (each step one block reduction giving the slots at or
    above the midpoint, the smallest key there and the largest key below it: tau is a key,
    so lo moves up to the first and hi down to the second), until lo = hi: at most 32
    steps, fewer where the keys are sparse in their range (each step at least halves it;
    a page without slots may bound the range, never end as tau). Pages above tau give all
    their slots, pages at tau their first slots in register order while the k last. The
    chosen pages and their counts are written in register order to ``pages_ptr``/
    ``take_ptr`` (at most ``limit``); returns how many."""
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    while lo < hi:  # invariant: slots(key >= lo) >= k_eff > slots(key > hi)
        mid = (lo + hi + 1) // 2
        at = key >= mid
        n, up, dn = tl.reduce((tl.where(at, cnt, 0), tl.where(at, key, hi),
                               tl.where(at, lo, key)), 0, _count_snap)
        big = n >= k_eff
        lo = tl.where(big, up, lo)  # tau >= mid, so at least the first key there
        hi = tl.where(big, hi, dn)  # tau < mid, so at most the last key below it
    above = tl.sum(tl.where(key > lo, cnt, 0))
    take, _ = _take(key, cnt, lo, k_eff - above)
    chosen = (take > 0).to(tl.int32)
    pos = tl.cumsum(chosen, axis=0) - chosen
    keep = (chosen > 0) & (pos < limit)
    tl.store(pages_ptr + pos, page, mask=keep)
    tl.store(take_ptr + pos, take, mask=keep)
    return tl.minimum(tl.sum(chosen), limit)


@triton.jit
def _clear_tail(pages_ptr, take_ptr, n, M, BLOCK: tl.constexpr):
    """Entries n..M-1 of a page list: page 0, take 0 (they read nothing)."""
    for j0 in range(0, M, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tail = (j >= n) & (j < M)
        tl.store(pages_ptr + j, tl.zeros((BLOCK,), tl.int32), mask=tail)
        tl.store(take_ptr + j, tl.zeros((BLOCK,), tl.int32), mask=tail)


@triton.jit
def _split_program(q_ptr, rows_ptr, last_ptr, off_ptr, s_qb, s_qh, s_rb, s_rh, H_kv, G, D, P,
                   SPLIT_LEN, HAS_OFFSET: tl.constexpr, G_BLOCK: tl.constexpr,
                   D_BLOCK: tl.constexpr):
    """What program (pid, split) of the split selection serves: its query group (float32,
    zero-padded), its (sequence, KV head)'s rows, the slot written last and its pages
    [p_begin, p_end)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    _, _, qf, rows, _ = _program_group(pid, q_ptr, rows_ptr, rows_ptr, s_qb, s_qh, s_rb, s_rh,
                                       H_kv, G, D, G_BLOCK, D_BLOCK)
    last = _last_slot(last_ptr, off_ptr, HAS_OFFSET).to(tl.int32)
    p_begin = split * SPLIT_LEN
    return pid, split, qf, rows, last, p_begin, tl.minimum(p_begin + SPLIT_LEN, P)


@triton.jit
def _merged_lse(ml_ptr, pid, SPLITS: tl.constexpr, G_BLOCK: tl.constexpr):
    """Each head's log-sum-exp (G_BLOCK,) over every split, from the (max, sum) parts
    ``_split_lse_kernel`` wrote for program ``pid``."""
    g = tl.arange(0, G_BLOCK)
    parts = pid.to(tl.int64) * SPLITS * 2 * G_BLOCK
    top = tl.full((G_BLOCK,), -1.0e30, tl.float32)
    for sp in range(SPLITS):
        top = tl.maximum(top, tl.load(ml_ptr + parts + sp * 2 * G_BLOCK + g))
    total = tl.zeros((G_BLOCK,), tl.float32)
    for sp in range(SPLITS):  # a split without a valid token adds 0 (its sum is 0)
        m_sp = tl.load(ml_ptr + parts + sp * 2 * G_BLOCK + g)
        total += tl.load(ml_ptr + parts + sp * 2 * G_BLOCK + G_BLOCK + g) * tl.exp(m_sp - top)
    return top + tl.log(total)


@triton.jit
def _split_lse_kernel(q_ptr, rows_ptr, last_ptr, off_ptr, ml_ptr, logits_ptr,
                      s_qb, s_qh, s_rb, s_rh, s_rr, s_rp, H_kv, G, D, P, R, SPLIT_LEN,
                      PAGE_SIZE, SPLITS: tl.constexpr, TWO_BOUNDS: tl.constexpr,
                      HAS_OFFSET: tl.constexpr, STORE: tl.constexpr, DOT: tl.constexpr,
                      G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Split selection, kernel 1 (``MODE_SOFTMAX``): program (pid, split) writes pass 1's
    (max, sum) per query head over its split's pages, and with ``STORE`` their logits."""
    pid, split, qf, rows, last, p_begin, p_end = _split_program(
        q_ptr, rows_ptr, last_ptr, off_ptr, s_qb, s_qh, s_rb, s_rh, H_kv, G, D, P, SPLIT_LEN,
        HAS_OFFSET, G_BLOCK, D_BLOCK)
    sel, row, qs, inv_t = _softmax_terms(qf, G, D, R, TWO_BOUNDS, G_BLOCK, D_BLOCK)
    m_run, l_run = _lse_range(rows, row, sel, qs, inv_t, last, p_begin, p_end,
                              logits_ptr + pid.to(tl.int64) * G * P, P, s_rr, s_rp, G,
                              PAGE_SIZE, STORE, DOT, G_BLOCK, BLOCK)
    g = tl.arange(0, G_BLOCK)
    part = (pid.to(tl.int64) * SPLITS + split) * 2 * G_BLOCK
    tl.store(ml_ptr + part + g, m_run)
    tl.store(ml_ptr + part + G_BLOCK + g, l_run)


@triton.jit
def _split_choose_kernel(q_ptr, rows_ptr, last_ptr, off_ptr, ml_ptr, logits_ptr, scores_ptr,
                         cand_pages, cand_take, s_qb, s_qh, s_rb, s_rh, s_rr, s_rp,
                         H_kv, G, D, P, R, K, MS, SPLIT_LEN, PAGE_SIZE,
                         MODE: tl.constexpr, SPLITS: tl.constexpr, TWO_BOUNDS: tl.constexpr,
                         HAS_OFFSET: tl.constexpr, LOAD: tl.constexpr, DOT: tl.constexpr,
                         G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                         PR: tl.constexpr):
    """Split selection, kernel 2: program (pid, split) scores its split's pages (softmax: by
    each head's log-sum-exp, merged from kernel 1's (max, sum) of every split) and chooses
    the split's own k tokens in registers (``_choose``): its ``MS`` candidate entries."""
    pid, split, qf, rows, last, p_begin, p_end = _split_program(
        q_ptr, rows_ptr, last_ptr, off_ptr, s_qb, s_qh, s_rb, s_rh, H_kv, G, D, P, SPLIT_LEN,
        HAS_OFFSET, G_BLOCK, D_BLOCK)
    out = pid.to(tl.int64) * P
    if MODE == 0:
        sel, row, qs, inv_t = _softmax_terms(qf, G, D, R, TWO_BOUNDS, G_BLOCK, D_BLOCK)
        _softmax_scores(rows, row, sel, qs, inv_t, _merged_lse(ml_ptr, pid, SPLITS, G_BLOCK),
                        last, p_begin, p_end, scores_ptr + out,
                        logits_ptr + pid.to(tl.int64) * G * P, P, s_rr, s_rp, G, PAGE_SIZE,
                        LOAD, DOT, G_BLOCK, BLOCK)
    else:
        _bound_scores(rows, qf, last, p_begin, p_end, scores_ptr + out, s_rr, s_rp, D,
                      PAGE_SIZE, TWO_BOUNDS, D_BLOCK, BLOCK)
    tl.debug_barrier()  # the scores this program wrote are read back below
    p = p_begin + tl.arange(0, PR)
    key, cnt = _page_keys(scores_ptr + out, p, p_end, last, PAGE_SIZE)
    dst = (pid.to(tl.int64) * SPLITS + split) * MS
    n = _choose(key, cnt, p, tl.minimum(K, tl.sum(cnt)), cand_pages + dst, cand_take + dst, MS)
    _clear_tail(cand_pages + dst, cand_take + dst, n, MS, BLOCK)


@triton.jit
def _split_merge_kernel(q_ptr, k_cache, v_cache, last_ptr, off_ptr, scores_ptr, cand_pages,
                        cand_take, pages_ptr, take_ptr, out_ptr, ml_ptr, vm_ptr,
                        s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh,
                        H_kv, G, D, P, R, K, NC, M, PAGE_SIZE, scale,
                        SPLITS: tl.constexpr, HAS_OFFSET: tl.constexpr, ATTEND: tl.constexpr,
                        REALLOC: tl.constexpr, DOT: tl.constexpr, G_BLOCK: tl.constexpr,
                        D_BLOCK: tl.constexpr, BLOCK: tl.constexpr, CR: tl.constexpr,
                        CHUNK: tl.constexpr, PAGES_BLOCK: tl.constexpr):
    """Split selection, kernel 3: one program per (sequence, KV head) chooses the k tokens
    among the splits' ``NC`` candidates (their scores read back by page), in registers, as
    one program would over every page, and with ``ATTEND`` attends over them (as
    ``select_attend``)."""
    pid = tl.program_id(0)
    last = _last_slot(last_ptr, off_ptr, HAS_OFFSET)
    c = tl.arange(0, CR)
    src = pid.to(tl.int64) * NC
    page = tl.load(cand_pages + src + c, mask=c < NC, other=0)
    cnt = tl.load(cand_take + src + c, mask=c < NC, other=0)
    score = tl.load(scores_ptr + pid.to(tl.int64) * P + page, mask=cnt > 0,
                    other=float("-inf"))
    dst = pid.to(tl.int64) * M
    k_eff = tl.minimum(K, last + 1).to(tl.int32)
    n = _choose(_order_key(score).to(tl.int64), cnt, page, k_eff, pages_ptr + dst,
                take_ptr + dst, M)
    _clear_tail(pages_ptr + dst, take_ptr + dst, n, M, BLOCK)
    if ATTEND:
        tl.debug_barrier()  # the page list this program wrote is read back below
        lse = tl.zeros((G_BLOCK,), tl.float32)
        if REALLOC:
            lse = _merged_lse(ml_ptr, pid, SPLITS, G_BLOCK)
        _attend_realloc(pid, q_ptr, k_cache, v_cache, last_ptr, off_ptr, pages_ptr, take_ptr,
                        out_ptr, vm_ptr, lse, s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh, H_kv, G,
                        D, R, M, PAGE_SIZE, scale, HAS_OFFSET, REALLOC, DOT, G_BLOCK, D_BLOCK,
                        CHUNK, PAGES_BLOCK)


def register_pages(n_pages: int) -> int:
    """``PR`` of a selection over ``n_pages`` pages: the power of two >= n_pages when that is
    at most ``SELECT_REGISTER_PAGES`` (the choice runs in registers), else 0 (in passes)."""
    n = _pow2(int(n_pages))  # int(): a constexpr, specialized under a dynamic-shape compile
    return n if n <= SELECT_REGISTER_PAGES else 0


def selected_pages(k: int, page_size: int, n_pages: int, splits: int = 1) -> int:
    """M: entries of a page list of k tokens, at most ``n_pages``: k for pages of one slot;
    else ceil(k / page_size) + ``splits``: the partial newest page, and per split one page at
    the threshold its split took only in part (one program: that same one page)."""
    return min(n_pages, -(-k // page_size) + (splits if page_size > 1 else 0))


def selection_splits(n_pages: int, k: int, page_size: int, programs: int = 0,
                     sms: int = 0) -> int:
    """Programs per KV head that score and choose over ``n_pages`` pages (tokens, for pages
    of one slot): 1 up to ``SPLIT_PAGES`` pages (one program: ``paged_select``,
    ``select_attend``); above, the power of two that gives each about ``SPLIT_PAGES`` pages
    (the split selection). On a GPU of ``sms`` multiprocessors where the ``programs``
    (sequences x KV heads) leave SMs idle, more: up to the power of two >= sms / programs,
    each split at least ``MIN_SPLIT_PAGES`` pages (sms 0, the CPU and the interpreter: no
    such split). Fewer where their candidates (splits x ``selected_pages``) would pass
    ``SELECT_CANDIDATES``; 0 where no count fits in registers (the selectors then keep the
    PyTorch path: ``kernels.selection_fits``)."""
    P = int(n_pages)
    splits = _pow2(-(-P // SPLIT_PAGES)) if P > SPLIT_PAGES else 1
    if sms > 0 and 0 < programs < sms and P >= 2 * MIN_SPLIT_PAGES:
        fill = _pow2(-(-sms // programs))
        most = 1 << ((P // MIN_SPLIT_PAGES).bit_length() - 1)  # splits of >= MIN pages
        splits = max(splits, min(fill, most))
    if splits == 1:
        return 1 if register_pages(P) else 0
    while splits > 1:
        per = -(-P // splits)
        if not register_pages(per):  # fewer splits only lengthen them
            return 0
        if splits * selected_pages(k, page_size, per) <= SELECT_CANDIDATES:
            return splits
        splits //= 2
    return 1 if register_pages(P) else 0


def _selection_buffers(q: Tensor, rows: Tensor, k: int, page_size: int, by_token: bool,
                       splits: int = 1) -> tuple[int, int, int, int, int, Tensor, Tensor, Tensor]:
    """(H_kv, P, row stride, page stride, M, scores, pages, take) of a selection over
    ``rows`` (``paged_select``'s layouts): its shape, and scratch for the page scores
    (B, H_kv, P) float32 and the page list (B, H_kv, M) int32."""
    B = q.shape[0]
    Hkv, P = rows.shape[1], rows.shape[2 if by_token else 3]
    s_row, s_page = (rows.stride(3), rows.stride(2)) if by_token else \
        (rows.stride(2), rows.stride(3))
    M = selected_pages(k, page_size, P, splits)
    scores = torch.empty(B, Hkv, P, dtype=torch.float32, device=q.device)
    pages = torch.empty(B, Hkv, M, dtype=torch.int32, device=q.device)
    take = torch.empty(B, Hkv, M, dtype=torch.int32, device=q.device)
    return Hkv, P, s_row, s_page, M, scores, pages, take


def _split_selection(q: Tensor, rows: Tensor, last: Tensor, mode: int, two_bounds: bool,
                     r: int, k: int, page_size: int, by_token: bool, offset: Tensor | None,
                     splits: int, kv: tuple[Tensor, Tensor] | None = None,
                     v_mean: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The split selection: scoring and a first choice split over ``splits`` programs per KV
    head, the last choice among their candidates in one (``_split_lse_kernel``,
    ``_split_choose_kernel``, ``_split_merge_kernel``); with ``kv`` = (k_cache, v_cache) the
    last kernel also attends (with ``v_mean``, reallocating as
    ``select_attend_reallocated``). Returns (pages, take, output or None).

    The union of the splits' own page-first top-k holds the global one: a page the global
    choice takes has fewer than k tokens above it in its split too. Pass 2 recomputes the
    logits from the rows, or, where the r rows cost more bytes per page than writing and
    reading the G float32 logits (Exact-TopK), reads kernel 1's."""
    B, H, _, D = q.shape
    Hkv, P, s_row, s_page, M, scores, pages, take = _selection_buffers(q, rows, k, page_size,
                                                                       by_token, splits)
    G = H // Hkv
    G_BLOCK, D_BLOCK = max(16, _pow2(G)), _pow2(D)
    per = -(-P // splits)
    MS = selected_pages(k, page_size, per)
    cand_pages = torch.empty(B * Hkv * splits * MS, dtype=torch.int32, device=q.device)
    cand_take = torch.empty_like(cand_pages)
    off = offset if offset is not None else last
    strides = (q.stride(0), q.stride(1), rows.stride(0), rows.stride(1), s_row, s_page)
    store = mode == MODE_SOFTMAX and 2 * G * 4 < r * rows.element_size()
    logits = torch.empty(B * Hkv * G * P if store else 1, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * Hkv * splits * 2 * G_BLOCK if mode == MODE_SOFTMAX else 1,
                     dtype=torch.float32, device=q.device)
    if mode == MODE_SOFTMAX:
        wrap(_split_lse_kernel)[(B * Hkv, splits)](
            q, rows, last, off, ml, logits, *strides, Hkv, G, D, P, r, per, page_size,
            SPLITS=splits, TWO_BOUNDS=two_bounds, HAS_OFFSET=offset is not None, STORE=store,
            DOT=_dot_mode(rows), G_BLOCK=G_BLOCK, D_BLOCK=D_BLOCK, BLOCK=SCORE_BLOCK,
            num_warps=NUM_WARPS)
    wrap(_split_choose_kernel)[(B * Hkv, splits)](
        q, rows, last, off, ml, logits, scores, cand_pages, cand_take, *strides,
        Hkv, G, D, P, r, k, MS, per, page_size, MODE=mode, SPLITS=splits,
        TWO_BOUNDS=two_bounds, HAS_OFFSET=offset is not None, LOAD=store, DOT=_dot_mode(rows),
        G_BLOCK=G_BLOCK, D_BLOCK=D_BLOCK, BLOCK=SCORE_BLOCK, PR=_pow2(per),
        num_warps=NUM_WARPS)
    k_cache, v_cache = kv if kv is not None else (rows, rows)
    out = torch.empty(B, H, 1, D, dtype=v_cache.dtype, device=q.device) if kv is not None \
        else None
    chunk, pages_block = _attend_blocks(page_size)
    o = out if out is not None else scores
    wrap(_split_merge_kernel)[(B * Hkv,)](
        q, k_cache, v_cache, last, off, scores, cand_pages, cand_take, pages, take, o, ml,
        v_mean if v_mean is not None else ml, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), o.stride(0), o.stride(1), Hkv, G, D, P, r, k,
        splits * MS, M, page_size, 1.0 / math.sqrt(D), SPLITS=splits,
        HAS_OFFSET=offset is not None, ATTEND=kv is not None, REALLOC=v_mean is not None,
        DOT=_dot_mode(k_cache), G_BLOCK=G_BLOCK, D_BLOCK=D_BLOCK, BLOCK=SCORE_BLOCK,
        CR=_pow2(splits * MS), CHUNK=chunk, PAGES_BLOCK=pages_block, num_warps=NUM_WARPS)
    return pages, take, out


@torch.library.triton_op("rocketkv::paged_select", mutates_args=())
def paged_select(q: Tensor, rows: Tensor, last: Tensor, mode: int, two_bounds: bool, r: int,
                 k: int, page_size: int, by_token: bool = False,
                 offset: Tensor | None = None, splits: int = 1) -> tuple[Tensor, Tensor]:
    """Score the pages of every (sequence, KV head) and choose k tokens, page-first.

    Args:
        q: (B, H, 1, D) queries (last dim contiguous).
        rows: the per-dim rows scored, (B, H_kv, 2 D, P) page summary (max rows, then min
            rows) with ``two_bounds``, else (B, H_kv, D, P): SparQ's dim-major key copy; with
            ``by_token`` the keys themselves, (B, H_kv, S, D), read as K^T (pages of one
            slot: Exact-TopK, SparQ without its copy, hybrid at page size 1), so no
            transposed view reaches the compiled graph (which might copy it).
        last: (1,) int64 device tensor, the slot written last: slots 0..last are valid, so
            page p holds clamp(last + 1 - p * page_size, 0, page_size) written slots. With
            ``offset`` ((1,) int64 device tensor), ``last`` is the token's position and the
            slot is last - offset (a compressed cache's slots), computed in the kernel.
        mode: ``MODE_SOFTMAX`` (hybrid, SparQ, Exact-TopK with r = D) or ``MODE_BOUND``
            (Quest).
        r: dims read (``MODE_SOFTMAX``); k: tokens to choose (at most the valid ones).
        splits: programs per KV head (``selection_splits``): more than 1, the split
            selection (``_split_selection``, 2-3 kernels); else one program scores and
            chooses (in registers up to ``SELECT_REGISTER_PAGES`` pages, else in passes).
    Returns:
        pages (B, H_kv, M) int32 and take (B, H_kv, M) int32, M = ``selected_pages``: the
        chosen pages in ascending order, each with the count of its first slots to attend
        (entries past the chosen ones have take 0). The page scores are written to a
        (B, H_kv, P) float32 scratch buffer allocated here.
    """
    if splits > 1:
        pages, take, _ = _split_selection(q, rows, last, mode, two_bounds, r, k, page_size,
                                          by_token, offset, splits)
        return pages, take
    B, H, _, D = q.shape
    Hkv, P, s_row, s_page, M, scores, pages, take = _selection_buffers(q, rows, k, page_size,
                                                                       by_token)
    G = H // Hkv
    wrap(_paged_select_kernel)[(B * Hkv,)](
        q, rows, last, offset if offset is not None else last, scores, pages, take,
        q.stride(0), q.stride(1), rows.stride(0), rows.stride(1), s_row, s_page,
        Hkv, G, D, P, r, k, M, page_size,
        MODE=mode, TWO_BOUNDS=two_bounds, HAS_OFFSET=offset is not None, DOT=_dot_mode(rows),
        G_BLOCK=max(16, _pow2(G)), D_BLOCK=_pow2(D), BLOCK=SCORE_BLOCK,
        PR=register_pages(P), SEL=SELECT_BLOCK, num_warps=NUM_WARPS)
    return pages, take


@triton.jit
def _program_group(pid, q_ptr, k_cache, v_cache, s_qb, s_qh, s_cb, s_ch, H_kv, G, D,
                   G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    """What program ``pid`` of an attention kernel serves: its sequence b and KV head h, the
    query group (G_BLOCK, D_BLOCK) float32 zero-padded, and the head's K and V rows."""
    b = (pid // H_kv).to(tl.int64)  # offsets in int64: batches of long caches pass 2^31
    h = pid % H_kv
    g = tl.arange(0, G_BLOCK)
    d = tl.arange(0, D_BLOCK)
    q = tl.load(q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :],
                mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    return b, h, q, k_cache + b * s_cb + h * s_ch, v_cache + b * s_cb + h * s_ch


@triton.jit
def _attend_block(q, kb, vb, slot, ok, s_cs, D, scale, m_run, l_run, acc,
                  DOT: tl.constexpr, D_BLOCK: tl.constexpr):
    """One online-softmax step of a query group over the slots ``slot`` (where ``ok``):
    returns the updated running max, normalizer and unnormalized output (float32)."""
    d = tl.arange(0, D_BLOCK)
    km = ok[:, None] & (d < D)[None, :]
    kt = tl.load(kb + slot[:, None] * s_cs + d[None, :], mask=km, other=0.0)
    vt = tl.load(vb + slot[:, None] * s_cs + d[None, :], mask=km, other=0.0)
    s = (_dot(q, tl.trans(kt), DOT) * scale).to(tl.float32)  # scale: fp32, fp64 or a float
    s = tl.where(ok[None, :], s, float("-inf"))  # (G_BLOCK, slots)
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    alpha = tl.exp(m_run - m_new)
    p = tl.exp(s - m_new[:, None])
    l_run = l_run * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p, vt, DOT)
    return m_new, l_run, acc


@triton.jit
def _finish(m_run, l_run, acc, out_ptr, o_ptr, lse_ptr, pid, split, b, h, s_ob, s_oh, G, D,
            SPLITS: tl.constexpr, G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    """One split's result: the normalized output when it is the only split, else its partial
    output and log-sum-exp for ``_merge_splits_kernel`` (-inf: it held no slot)."""
    g = tl.arange(0, G_BLOCK)
    d = tl.arange(0, D_BLOCK)
    if SPLITS == 1:
        o = acc / l_run[:, None]
        tl.store(out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])
    else:
        part = (pid.to(tl.int64) * SPLITS + split) * G_BLOCK
        empty = l_run == 0
        tl.store(lse_ptr + part + g, tl.where(empty, float("-inf"), m_run + tl.log(l_run)))
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_run)[:, None])
        tl.store(o_ptr + (part + g)[:, None] * D_BLOCK + d[None, :], o)


@triton.jit
def _attend_pages_kernel(q_ptr, k_cache, v_cache, pages_ptr, take_ptr, o_ptr, lse_ptr, out_ptr,
                         s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh,
                         H_kv, G, D, M, PAGE_SIZE, PAGES_PER_SPLIT, scale,
                         SPLITS: tl.constexpr, DOT: tl.constexpr, G_BLOCK: tl.constexpr,
                         D_BLOCK: tl.constexpr, CHUNK: tl.constexpr, PAGES_BLOCK: tl.constexpr):
    _attend_chosen(tl.program_id(0), tl.program_id(1), q_ptr, k_cache, v_cache, pages_ptr,
                   take_ptr, o_ptr, lse_ptr, out_ptr, s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh,
                   H_kv, G, D, M, PAGE_SIZE, PAGES_PER_SPLIT, scale, SPLITS, DOT, G_BLOCK,
                   D_BLOCK, CHUNK, PAGES_BLOCK)


@triton.jit
def _selected_mass(qs, inv_t, lse, kb, slot, ok, s_cs, D, DOT: tl.constexpr,
                   D_BLOCK: tl.constexpr):
    """Each head's probability (G_BLOCK,) under the selection's softmax, summed over the
    slots ``slot`` (where ``ok``): exp(qs . k * inv_t - lse), the keys read again (they
    were just read for the attention)."""
    d = tl.arange(0, D_BLOCK)
    kt = tl.load(kb + slot[:, None] * s_cs + d[None, :], mask=ok[:, None] & (d < D)[None, :],
                 other=0.0)
    s = _dot(qs, tl.trans(kt), DOT) * inv_t[:, None]
    return tl.sum(tl.where(ok[None, :], tl.exp(s - lse[:, None]), 0.0), axis=1)


@triton.jit
def _running_mean(vm_ptr, vb, slot, s_cs, D, D_BLOCK: tl.constexpr):
    """SparQ's running mean of the values over slots 0..slot, float32 (D_BLOCK,), taking
    in the value just written at ``slot``: vm + (v - vm) / (slot + 1), stored back."""
    d = tl.arange(0, D_BLOCK)
    vm = tl.load(vm_ptr + d, mask=d < D, other=0.0)
    v = tl.load(vb + slot * s_cs + d, mask=d < D, other=0.0).to(tl.float32)
    vm = vm + (v - vm) / (slot + 1).to(tl.float32)
    tl.store(vm_ptr + d, vm, mask=d < D)
    return vm


@triton.jit
def _attend_chosen(pid, split, q_ptr, k_cache, v_cache, pages_ptr, take_ptr, o_ptr, lse_ptr,
                   out_ptr, s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh,
                   H_kv, G, D, M, PAGE_SIZE, PAGES_PER_SPLIT, scale,
                   SPLITS: tl.constexpr, DOT: tl.constexpr, G_BLOCK: tl.constexpr,
                   D_BLOCK: tl.constexpr, CHUNK: tl.constexpr, PAGES_BLOCK: tl.constexpr,
                   qs=None, inv_t=None, lse=None, vm=None, REALLOC: tl.constexpr = False):
    """``attend_pages`` for program ``pid``, split ``split``: exact attention of its query
    group over the slots of the page list at ``pages_ptr``/``take_ptr``. With ``REALLOC``
    (SparQ's mean-value reallocation, one split): alpha y + (1 - alpha) ``vm``, alpha each
    head's selected probability mass exp(qs . k / T - lse) (``qs``, ``inv_t`` = 1 / T from
    ``_softmax_terms``, ``lse`` the log-sum-exp of the selection's logits), summed over the
    chosen slots."""
    b, h, q, kb, vb = _program_group(pid, q_ptr, k_cache, v_cache, s_qb, s_qh, s_cb, s_ch,
                                     H_kv, G, D, G_BLOCK, D_BLOCK)
    lst = pid.to(tl.int64) * M
    TOK: tl.constexpr = PAGES_BLOCK * CHUNK
    t = tl.arange(0, TOK)
    j_in = t // CHUNK  # page of the block's slot, within the block's pages
    m_run = tl.full((G_BLOCK,), -1.0e30, tl.float32)
    l_run = tl.zeros((G_BLOCK,), tl.float32)
    acc = tl.zeros((G_BLOCK, D_BLOCK), tl.float32)
    mass = tl.zeros((G_BLOCK,), tl.float32)
    j_first = split * PAGES_PER_SPLIT
    j_end = tl.minimum(j_first + PAGES_PER_SPLIT, M)
    for j0 in range(j_first, j_end, PAGES_BLOCK):
        j = j0 + j_in
        jm = j < j_end
        page = tl.load(pages_ptr + lst + j, mask=jm, other=0).to(tl.int64)
        n = tl.load(take_ptr + lst + j, mask=jm, other=0)
        for c0 in range(0, PAGE_SIZE, CHUNK):  # once unless a page exceeds CHUNK slots
            off = c0 + t % CHUNK  # slot within its page
            slot = page * PAGE_SIZE + off
            ok = jm & (off < n)
            m_run, l_run, acc = _attend_block(q, kb, vb, slot, ok, s_cs, D, scale, m_run, l_run,
                                              acc, DOT, D_BLOCK)
            if REALLOC:
                mass += _selected_mass(qs, inv_t, lse, kb, slot, ok, s_cs, D, DOT, D_BLOCK)
    if REALLOC:  # acc / l_run becomes alpha y + (1 - alpha) vm
        acc = acc * mass[:, None] + ((1.0 - mass) * l_run)[:, None] * vm[None, :]
    _finish(m_run, l_run, acc, out_ptr, o_ptr, lse_ptr, pid, split, b, h, s_ob, s_oh, G, D,
            SPLITS, G_BLOCK, D_BLOCK)


@triton.jit
def _attend_prefix_kernel(q_ptr, k_cache, v_cache, last_ptr, off_ptr, o_ptr, lse_ptr, out_ptr,
                          s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh,
                          H_kv, G, D, SPLIT_LEN, scale,
                          SPLITS: tl.constexpr, HAS_OFFSET: tl.constexpr, DOT: tl.constexpr,
                          G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, TOK: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b, h, q, kb, vb = _program_group(pid, q_ptr, k_cache, v_cache, s_qb, s_qh, s_cb, s_ch,
                                     H_kv, G, D, G_BLOCK, D_BLOCK)
    n = _last_slot(last_ptr, off_ptr, HAS_OFFSET) + 1  # slots 0..last are written
    t = tl.arange(0, TOK)
    m_run = tl.full((G_BLOCK,), -1.0e30, tl.float32)
    l_run = tl.zeros((G_BLOCK,), tl.float32)
    acc = tl.zeros((G_BLOCK, D_BLOCK), tl.float32)
    first = split.to(tl.int64) * SPLIT_LEN
    end = tl.minimum(first + SPLIT_LEN, n)  # a split past the written prefix reads nothing
    for s0 in range(first, end, TOK):
        slot = s0 + t
        m_run, l_run, acc = _attend_block(q, kb, vb, slot, slot < end, s_cs, D, scale, m_run,
                                          l_run, acc, DOT, D_BLOCK)
    _finish(m_run, l_run, acc, out_ptr, o_ptr, lse_ptr, pid, split, b, h, s_ob, s_oh, G, D,
            SPLITS, G_BLOCK, D_BLOCK)


@triton.jit
def _merge_splits_kernel(o_ptr, lse_ptr, out_ptr, s_ob, s_oh, H_kv, G, D,
                         SPLITS: tl.constexpr, G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr):
    """Combine the splits' partial softmaxes by their log-sum-exps (one split at a time: the
    register tile stays (G_BLOCK, D_BLOCK) whatever SPLITS is)."""
    pid = tl.program_id(0)
    b = (pid // H_kv).to(tl.int64)  # int64 offsets, as in the other kernels
    h = pid % H_kv
    g = tl.arange(0, G_BLOCK)
    d = tl.arange(0, D_BLOCK)
    top = tl.full((G_BLOCK,), float("-inf"), tl.float32)
    for sp in range(SPLITS):  # the largest log-sum-exp: finite, some split holds a slot
        top = tl.maximum(top, tl.load(lse_ptr + (pid.to(tl.int64) * SPLITS + sp) * G_BLOCK + g))
    num = tl.zeros((G_BLOCK, D_BLOCK), tl.float32)
    den = tl.zeros((G_BLOCK,), tl.float32)
    for sp in range(SPLITS):
        part = (pid.to(tl.int64) * SPLITS + sp) * G_BLOCK
        w = tl.exp(tl.load(lse_ptr + part + g) - top)  # 0 for an empty split
        num += tl.load(o_ptr + (part + g)[:, None] * D_BLOCK + d[None, :]) * w[:, None]
        den += w
    tl.store(out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :],
             (num / den[:, None]).to(out_ptr.dtype.element_ty),
             mask=(g < G)[:, None] & (d < D)[None, :])


def _partials(programs: int, splits: int, g_block: int, d_block: int,
              device: torch.device) -> tuple[Tensor, Tensor]:
    """float32 scratch for the splits' partial outputs and log-sum-exps (1 element each when
    there is one split: its program writes the output itself)."""
    n = programs * splits * g_block if splits > 1 else 1
    return (torch.empty(n * (d_block if splits > 1 else 1), dtype=torch.float32, device=device),
            torch.empty(n, dtype=torch.float32, device=device))


def _attend_blocks(page_size: int) -> tuple[int, int]:
    """(CHUNK, PAGES_BLOCK) of the attention over chosen pages: slots of one page per
    iteration, and pages per iteration (``ATTEND_TOKENS`` slots in all)."""
    chunk = min(_pow2(page_size), ATTEND_TOKENS)
    return chunk, ATTEND_TOKENS // chunk


def attention_splits(k: int) -> int:
    """Programs per KV head ``attend_pages`` uses for a selection of ``k`` tokens."""
    return 1 if k <= SPLIT_TOKENS else min(64, _pow2(-(-k // SPLIT_TOKENS)))


@torch.library.triton_op("rocketkv::attend_pages", mutates_args=())
def attend_pages(q: Tensor, k_cache: Tensor, v_cache: Tensor, pages: Tensor, take: Tensor,
                 page_size: int, k: int) -> Tensor:
    """Exact attention of each query group over the slots ``paged_select`` chose.

    Args:
        q: (B, H, 1, D); k_cache, v_cache: (B, H_kv, S, D) (last dim contiguous).
        pages, take: (B, H_kv, M) int32 from ``paged_select`` (slots page * page_size + i,
            i < take, are attended).
        k: tokens chosen (sets the split over programs, ``attention_splits``).
    Returns:
        (B, H, 1, D) in v_cache's dtype: softmax(q K_sel^T / sqrt(D)) V_sel, float32 inside.
    """
    B, H, _, D = q.shape
    Hkv = k_cache.shape[1]
    G, M = H // Hkv, pages.shape[2]
    G_BLOCK, D_BLOCK = max(16, _pow2(G)), _pow2(D)
    chunk, pages_block = _attend_blocks(page_size)
    # int(): under a dynamic-shape compile the split count (a constexpr) is specialized
    splits = min(attention_splits(k), _pow2(-(-int(M) // pages_block)))
    per_split = -(-M // splits)
    out = torch.empty(B, H, 1, D, dtype=v_cache.dtype, device=q.device)
    o, lse = _partials(B * Hkv, splits, G_BLOCK, D_BLOCK, q.device)
    wrap(_attend_pages_kernel)[(B * Hkv, splits)](
        q, k_cache, v_cache, pages, take, o, lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), Hkv, G, D, M, page_size, per_split,
        1.0 / math.sqrt(D), SPLITS=splits, DOT=_dot_mode(k_cache), G_BLOCK=G_BLOCK,
        D_BLOCK=D_BLOCK,
        CHUNK=chunk, PAGES_BLOCK=pages_block, num_warps=NUM_WARPS)
    if splits > 1:
        wrap(_merge_splits_kernel)[(B * Hkv,)](
            o, lse, out, out.stride(0), out.stride(1), Hkv, G, D, SPLITS=splits,
            G_BLOCK=G_BLOCK, D_BLOCK=D_BLOCK)
    return out


@triton.jit
def _select_attend_kernel(q_ptr, rows_ptr, k_cache, v_cache, last_ptr, off_ptr, scores_ptr,
                          pages_ptr, take_ptr, out_ptr, vm_ptr,
                          s_qb, s_qh, s_rb, s_rh, s_rr, s_rp, s_cb, s_ch, s_cs, s_ob, s_oh,
                          H_kv, G, D, P, R, K, M, PAGE_SIZE, scale,
                          MODE: tl.constexpr, TWO_BOUNDS: tl.constexpr,
                          HAS_OFFSET: tl.constexpr, REALLOC: tl.constexpr,
                          DOT_S: tl.constexpr, DOT_A: tl.constexpr,
                          G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                          PR: tl.constexpr, SEL: tl.constexpr, CHUNK: tl.constexpr,
                          PAGES_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    lse = _select(pid, q_ptr, rows_ptr, last_ptr, off_ptr, scores_ptr, pages_ptr, take_ptr,
                  s_qb, s_qh, s_rb, s_rh, s_rr, s_rp, H_kv, G, D, P, R, K, M, PAGE_SIZE,
                  MODE, TWO_BOUNDS, HAS_OFFSET, DOT_S, G_BLOCK, D_BLOCK, BLOCK, PR, SEL)
    tl.debug_barrier()  # the page list this program wrote is read back below
    _attend_realloc(pid, q_ptr, k_cache, v_cache, last_ptr, off_ptr, pages_ptr, take_ptr,
                    out_ptr, vm_ptr, lse, s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh, H_kv, G, D,
                    R, M, PAGE_SIZE, scale, HAS_OFFSET, REALLOC, DOT_A, G_BLOCK, D_BLOCK, CHUNK,
                    PAGES_BLOCK)


@triton.jit
def _attend_realloc(pid, q_ptr, k_cache, v_cache, last_ptr, off_ptr, pages_ptr, take_ptr,
                    out_ptr, vm_ptr, lse, s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh, H_kv, G, D,
                    R, M, PAGE_SIZE, scale, HAS_OFFSET: tl.constexpr, REALLOC: tl.constexpr,
                    DOT: tl.constexpr, G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
                    CHUNK: tl.constexpr, PAGES_BLOCK: tl.constexpr):
    """The attention phase of a one-program selection (``select_attend``, the split
    selection's last kernel) over its page list, in one split; with ``REALLOC`` SparQ's
    mean-value reallocation (its running mean of values updated with the token written at
    the slot ``last`` first, as the reference's write does)."""
    qs = None
    inv_t = None
    vm = None
    if REALLOC:
        _, _, qf, _, vb = _program_group(pid, q_ptr, k_cache, v_cache, s_qb, s_qh, s_cb, s_ch,
                                         H_kv, G, D, G_BLOCK, D_BLOCK)
        _, _, qs, inv_t = _softmax_terms(qf, G, D, R, False, G_BLOCK, D_BLOCK)
        vm = _running_mean(vm_ptr + pid.to(tl.int64) * D, vb,
                           _last_slot(last_ptr, off_ptr, HAS_OFFSET), s_cs, D, D_BLOCK)
    _attend_chosen(pid, 0, q_ptr, k_cache, v_cache, pages_ptr, take_ptr, out_ptr, out_ptr,
                   out_ptr, s_qb, s_qh, s_cb, s_ch, s_cs, s_ob, s_oh, H_kv, G, D, M, PAGE_SIZE,
                   M, scale, 1, DOT, G_BLOCK, D_BLOCK, CHUNK, PAGES_BLOCK, qs, inv_t, lse, vm,
                   REALLOC)


@torch.library.triton_op("rocketkv::select_attend", mutates_args=())
def select_attend(q: Tensor, rows: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor,
                  mode: int, two_bounds: bool, r: int, k: int, page_size: int,
                  by_token: bool = False, offset: Tensor | None = None,
                  splits: int = 1) -> Tensor:
    """``paged_select`` then ``attend_pages`` in one kernel, one program per (sequence, KV
    head): for selections that attend in one program (``attention_splits(k) == 1``, the
    budgets the paper runs), the page list goes through a scratch buffer between the two
    phases of the same program. With ``splits`` > 1 the selection is split
    (``_split_selection``) and its last kernel attends. Arguments as there; returns
    (B, H, 1, D) in v_cache's dtype.
    """
    return _select_attend(q, rows, k_cache, v_cache, last, mode, two_bounds, r, k, page_size,
                          by_token, offset, splits)


@torch.library.triton_op("rocketkv::select_attend_reallocated", mutates_args={"v_mean"})
def select_attend_reallocated(q: Tensor, rows: Tensor, k_cache: Tensor, v_cache: Tensor,
                              last: Tensor, v_mean: Tensor, r: int, k: int,
                              by_token: bool = False, offset: Tensor | None = None,
                              splits: int = 1) -> Tensor:
    """SparQ with mean-value reallocation (Ribar et al. 2024, Alg. 1: y = alpha y_sel +
    (1 - alpha) mean V), as ``select_attend`` with ``MODE_SOFTMAX`` on pages of one slot:
    ``v_mean`` (B, H_kv, 1, D) float32 contiguous, the running mean of the values over the
    slots before ``last``, first takes in the value at ``last`` (updated in place); alpha is
    each query head's probability mass of the chosen tokens under the approximate softmax.
    One program per KV head attends whatever k (past ``SPLIT_TOKENS`` too: the mass and the
    mean are per head). Returns (B, H, 1, D) in v_cache's dtype."""
    return _select_attend(q, rows, k_cache, v_cache, last, MODE_SOFTMAX, False, r, k, 1,
                          by_token, offset, splits, v_mean)


def _select_attend(q: Tensor, rows: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor,
                   mode: int, two_bounds: bool, r: int, k: int, page_size: int,
                   by_token: bool, offset: Tensor | None, splits: int,
                   v_mean: Tensor | None = None) -> Tensor:
    """``select_attend`` (and with ``v_mean`` ``select_attend_reallocated``)."""
    if v_mean is not None and not v_mean.is_contiguous():
        raise ValueError("v_mean must be contiguous")
    if splits > 1:
        return _split_selection(q, rows, last, mode, two_bounds, r, k, page_size, by_token,
                                offset, splits, (k_cache, v_cache), v_mean)[2]
    B, H, _, D = q.shape
    Hkv, P, s_row, s_page, M, scores, pages, take = _selection_buffers(q, rows, k, page_size,
                                                                       by_token)
    G = H // Hkv
    chunk, pages_block = _attend_blocks(page_size)
    out = torch.empty(B, H, 1, D, dtype=v_cache.dtype, device=q.device)
    wrap(_select_attend_kernel)[(B * Hkv,)](
        q, rows, k_cache, v_cache, last, offset if offset is not None else last, scores, pages,
        take, out, v_mean if v_mean is not None else scores, q.stride(0), q.stride(1),
        rows.stride(0), rows.stride(1), s_row, s_page,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        Hkv, G, D, P, r, k, M, page_size, 1.0 / math.sqrt(D),
        MODE=mode, TWO_BOUNDS=two_bounds, HAS_OFFSET=offset is not None,
        REALLOC=v_mean is not None, DOT_S=_dot_mode(rows), DOT_A=_dot_mode(k_cache),
        G_BLOCK=max(16, _pow2(G)), D_BLOCK=_pow2(D), BLOCK=SCORE_BLOCK, PR=register_pages(P),
        SEL=SELECT_BLOCK, CHUNK=chunk, PAGES_BLOCK=pages_block, num_warps=NUM_WARPS)
    return out


PREFIX_SPLIT = 1024  # slots per program of attend_prefix, at least (untuned)
PREFIX_PROGRAMS = 512  # programs (sequences x KV heads x splits) attend_prefix aims at
PREFIX_WARPS = 8  # per program of attend_prefix (untuned)


def prefix_splits(batch_kv_heads: int, slots: int) -> int:
    """Programs per KV head ``attend_prefix`` uses over a buffer of ``slots`` slots: enough
    for about ``PREFIX_PROGRAMS`` programs in all, none shorter than ``PREFIX_SPLIT`` slots
    (a power of two, 1 to 256)."""
    by_length = max(1, slots // PREFIX_SPLIT)
    want = max(1, PREFIX_PROGRAMS // max(1, batch_kv_heads))
    return min(256, _pow2(min(by_length, want)))


@torch.library.triton_op("rocketkv::attend_prefix", mutates_args=())
def attend_prefix(q: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor,
                  offset: Tensor | None = None) -> Tensor:
    """Decode attention of each query group over the written prefix of static K/V buffers,
    split over the sequence (flash-decoding), each KV head read once for its group.

    Args:
        q: (B, H, 1, D); k_cache, v_cache: (B, H_kv, S, D) (last dim contiguous).
        last: (1,) int64 device tensor, the slot written last: slots 0..last are attended,
            the rest never read (the static shapes stay, so one graph serves every step);
            with ``offset`` ((1,) int64 device tensor) the slot is last - offset.
    Returns:
        (B, H, 1, D) in v_cache's dtype: softmax(q K^T / sqrt(D)) V over slots 0..last,
        float32 inside; the splits (``prefix_splits``) merged by their log-sum-exps.
    """
    B, H, _, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    G_BLOCK, D_BLOCK = max(16, _pow2(G)), _pow2(D)
    splits = prefix_splits(B * Hkv, int(S))  # a constexpr: specialized under dynamic shapes
    split_len = -(-S // splits)
    out = torch.empty(B, H, 1, D, dtype=v_cache.dtype, device=q.device)
    o, lse = _partials(B * Hkv, splits, G_BLOCK, D_BLOCK, q.device)
    wrap(_attend_prefix_kernel)[(B * Hkv, splits)](
        q, k_cache, v_cache, last, offset if offset is not None else last, o, lse, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), Hkv, G, D, split_len, 1.0 / math.sqrt(D),
        SPLITS=splits, HAS_OFFSET=offset is not None, DOT=_dot_mode(k_cache),
        G_BLOCK=G_BLOCK, D_BLOCK=D_BLOCK, TOK=ATTEND_TOKENS, num_warps=PREFIX_WARPS)
    if splits > 1:
        wrap(_merge_splits_kernel)[(B * Hkv,)](
            o, lse, out, out.stride(0), out.stride(1), Hkv, G, D, SPLITS=splits,
            G_BLOCK=G_BLOCK, D_BLOCK=D_BLOCK)
    return out
