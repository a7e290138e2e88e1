"""Attention math shared by every cache: causal prefill attention (blockwise, CPU flash), the
column sums SnapKV-style scoring needs, decode attention over a prefix (FlexAttention when
compiled on CUDA) and over gathered tokens' probabilities."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor

from rocketkv import kernels

_PREFILL_MEMO: ContextVar[dict | None] = ContextVar("prefill_memo", default=None)


@contextmanager
def prefill_memo(memo: dict) -> Iterator[None]:
    """Within the block, ``current_prefill_memo()`` returns ``memo``.

    Caches built from one recorded prefill (``prefill.prefill_once``) store the same prompt
    K/V, so work that depends only on the prefill (the SnapKV family's observation-window
    votes, ``compression.snapkv.window_votes``) needs doing once per layer, not once per
    method and budget: ``KVCache.store_recorded_prompt`` runs ``store_prompt`` inside this
    block with the prefill's per-layer memo, which lives as long as the prefill.
    """
    token = _PREFILL_MEMO.set(memo)
    try:
        yield
    finally:
        _PREFILL_MEMO.reset(token)


def current_prefill_memo() -> dict | None:
    """The memo of the enclosing ``prefill_memo`` block, or None outside one."""
    return _PREFILL_MEMO.get()


def causal_attention(q: Tensor, k: Tensor, v: Tensor, start: int = 0) -> Tensor:
    """Causal attention of a block of prompt queries without repeating K/V.

    Args:
        q: (B, H, Tq, D) queries at positions ``start .. start + Tq - 1``.
        k, v: (B, H_kv, start + Tq, D) keys and values at positions ``0 .. start + Tq - 1``;
            H a multiple of H_kv.
        start: position of the first query (0: the whole prompt at once).
    Returns:
        (B, H, Tq, D), dtype of q: query i attends to keys ``<= start + i``. On the CPU,
        SDPA's CPU flash kernel without any mask (``_cpu_flash_causal``: the keys before
        ``start`` unmasked, the chunk's own causally, merged by log-sum-exp). Elsewhere
        ``start == 0`` is SDPA's own causal mask; otherwise the causal diagonal is aligned to
        the bottom right (``torch.nn.attention.bias.causal_lower_right``), which runs flash
        attention on CUDA. Where flash cannot run, an explicit boolean mask is used, with the
        query rows split so that the mask (and any score matrix a fallback kernel makes)
        stays under 2^26 elements. No T x T mask ever exists.
    Raises:
        ValueError: ``k`` does not hold exactly ``start + Tq`` positions.
    """
    B, H, Tq, D = q.shape
    S = k.shape[2]
    if S != start + Tq:
        raise ValueError(f"{Tq} queries from position {start} need {start + Tq} keys, got {S}")
    gqa = H != k.shape[1]
    if _cpu_flash_prefill(q):
        return _cpu_flash_causal(q, k, v, start)
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if _flash_available(q, k, v, gqa):
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Tq, S),
                                              enable_gqa=gqa)
    out = torch.empty_like(q)
    rows = max(1, MASK_ELEMENTS // (S * H * B))
    keys = torch.arange(S, device=q.device)
    for r in range(0, Tq, rows):
        e = min(r + rows, Tq)
        pos = torch.arange(start + r, start + e, device=q.device)
        mask = keys[None, :] <= pos[:, None]  # (rows, S)
        out[:, :, r:e] = F.scaled_dot_product_attention(q[:, :, r:e], k, v, attn_mask=mask,
                                                        enable_gqa=gqa)
    return out


def _cpu_flash_prefill(q: Tensor) -> bool:
    """Whether prefill attention on ``q``'s device runs SDPA's CPU flash kernel
    (``_cpu_flash_causal``)."""
    return q.device.type == "cpu" and CPU_FLASH_PREFILL and hasattr(torch.ops.aten, _CPU_FLASH)


MASK_ELEMENTS = 1 << 26  # bound on (rows x keys x heads) per fallback block in causal_attention
CPU_FLASH_PREFILL = True  # False: CPU prefill keeps SDPA with explicit masks (for comparisons)


def _grouped(t: Tensor, G: int) -> Tensor:
    """K or V (B, H_kv, S, D) as (B * H_kv, G, S, D), each KV head repeated G times by a
    stride-0 view (no copy): query head h of (B * H_kv, G) reads KV head h // G."""
    B, Hkv, S, D = t.shape
    return t.reshape(B * Hkv, 1, S, D).expand(B * Hkv, G, S, D)


def _cpu_flash_causal(q: Tensor, k: Tensor, v: Tensor, start: int,
                      with_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``causal_attention`` on the CPU by SDPA's CPU flash kernel (``_CPU_FLASH``), which
    takes no bottom-right causal mask and no GQA: K/V enter as stride-0 views per query head
    (``_grouped``), and a chunk at ``start > 0`` is two passes, (a) every query to the keys
    before ``start`` without a mask and (b) the chunk's queries to its own keys, causal
    (top-left), each returning its output and log-sum-exp, merged in float32:
    ``o = o_a exp(l_a - l) + o_b exp(l_b - l)`` with ``l = logaddexp(l_a, l_b)``. Neither a
    mask nor a score matrix exists; (B, H, Tq, D) float32 temporaries at most.
    Shapes as ``causal_attention``; ``with_lse`` also returns each query's log-sum-exp of its
    scaled scores, (B * H_kv, G, Tq) float32 (what ``_column_sums_by_lse`` needs)."""
    flash = getattr(torch.ops.aten, _CPU_FLASH)
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.reshape(B * Hkv, G, Tq, D)
    kg, vg = _grouped(k, G), _grouped(v, G)
    o_b, l_b = flash(qg, kg[:, :, start:], vg[:, :, start:], 0.0, True)[:2]
    if start == 0:
        out = o_b.reshape(B, H, Tq, D)
        return (out, l_b) if with_lse else out
    o_a, l_a = flash(qg, kg[:, :, :start], vg[:, :, :start], 0.0, False)[:2]
    lse = torch.logaddexp(l_a, l_b)  # (B * H_kv, G, Tq) float32
    w_a = (l_a - lse).exp_().unsqueeze(-1)
    w_b = (l_b - lse).exp_().unsqueeze(-1)
    out = o_a.float().mul_(w_a).add_(o_b.float().mul_(w_b)).to(q.dtype).reshape(B, H, Tq, D)
    return (out, lse) if with_lse else out


def attention_and_column_sums(q: Tensor, k: Tensor, v: Tensor,
                              start: int = 0) -> tuple[Tensor, Tensor]:
    """``(causal_attention(q, k, v, start), attention_column_sums(q, k, start))`` for a
    prefill that needs both (H2O's eviction scores, a recorded prefill). On the CPU the
    attention pass's log-sum-exp serves the column sums, which then cost one flash pass instead
    of two (py-spy on a 16K-token recorded prefill of Qwen2.5-0.5B: the column sums 63% of its
    time, the attention 23%; 4K tokens, 14 query and 2 KV heads, bfloat16, one thread: 1.42 s
    against 2.07 s for the two calls). Shapes as the two functions; the sums are
    (B, H_kv, start + Tq) float32."""
    if _cpu_flash_prefill(q):
        out, lse = _cpu_flash_causal(q, k, v, start, with_lse=True)
        B, H, _, _ = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        sums = _column_sums_by_lse(q, k, start, lse).view(B, Hkv, H // Hkv, S).sum(dim=2)
        return out, sums
    return causal_attention(q, k, v, start), attention_column_sums(q, k, start)


def attention_column_sums(q: Tensor, k: Tensor, start: int = 0,
                          per_query_head: bool = False) -> Tensor:
    """Accumulated attention of a block of prompt queries on each key (H2O's scores; SnapKV's
    observation-window votes with ``per_query_head``).

    Args:
        q: (B, H, Tq, D) queries at positions ``start .. start + Tq - 1``.
        k: (B, H_kv, start + Tq, D) keys at positions ``0 .. start + Tq - 1``.
        per_query_head: keep one sum per query head instead of summing over the group.
    Returns:
        (B, H_kv, start + Tq) float32 (or (B, H, start + Tq) with ``per_query_head``): for each
        key, the sum over the block's queries (and the group's query heads) of their causal
        softmax weights on it. Never T x T: on the CPU two flash-attention passes
        (``_column_sums_by_lse``); elsewhere one KV head and a few query rows at a time (at
        most ``MASK_ELEMENTS`` scores at once), a block of rows scoring only the keys up to its
        last query.
    """
    B, H, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if S != start + Tq:
        raise ValueError(f"{Tq} queries from position {start} need {start + Tq} keys, got {S}")
    G = H // Hkv
    if q.device.type == "cpu" and hasattr(torch.ops.aten, _CPU_FLASH):
        sums = _column_sums_by_lse(q, k, start)  # (B, H, S)
        return sums if per_query_head else sums.view(B, Hkv, G, S).sum(dim=2)
    out = torch.zeros(B, Hkv, G, S, dtype=torch.float32, device=q.device)
    rows = max(1, MASK_ELEMENTS // (S * G * B))
    blocks = range(0, Tq, rows)
    if q.device.type == "meta":  # shapes only (scripts/predict_memory.py): the peak's block
        blocks = [max(0, Tq - rows)]
    for h in range(1 if q.device.type == "meta" else Hkv):
        for r in blocks:
            e = min(r + rows, Tq)
            n = start + e  # the keys the block's last query sees: later ones are skipped
            s = torch.matmul(q[:, h * G:(h + 1) * G, r:e], k[:, h, None, :n].transpose(-1, -2))
            s = s.float().mul_(1 / math.sqrt(D))  # (B, G, e - r, n)
            # only the block's own keys (its diagonal square) can lie in a query's future
            future = torch.ones(e - r, e - r, dtype=torch.bool, device=q.device).triu_(1)
            s[..., start + r:].masked_fill_(future, float("-inf"))
            out[:, h, :, :n] += s.softmax(dim=-1).sum(dim=2)
    return out.view(B, H, S) if per_query_head else out.sum(dim=2)


_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"  # returns the log-sum-exp too


def _column_sums_by_lse(q: Tensor, k: Tensor, start: int, lse: Tensor | None = None
                        ) -> Tensor:
    """``attention_column_sums`` per query head, (B, H, S) float32, from two passes of the CPU
    flash-attention kernel (one when the attention's ``lse`` is given), each the cost of the
    prompt's causal attention, no score matrix stored (about 5x faster than row blocks on a
    2-core CPU at 8K tokens, and in bfloat16 more exact: the kernel keeps the scores in
    float32).

    1. Each query's log-sum-exp ``l_i`` over the keys it sees (keys before ``start`` all,
       then causal); given as ``lse`` ((B * H_kv, G, Tq) float32) when the attention pass
       has computed it (``attention_and_column_sums``).
    2. The sum over queries i of ``p_ij = exp(s q_i.k_j - l_i)`` is ``exp`` of the log-sum-exp
       of the transposed problem: key j as the query, the queries i >= j - start as its keys,
       each with the bias ``-l_i``, carried in the dot product by two extra coordinates
       (``-l_i / s`` split into a high and a low part in the input dtype, against 1s on the
       key side). Reversing both sequences makes "i >= j - start" the kernel's top-left causal
       mask.
    """
    flash = getattr(torch.ops.aten, _CPU_FLASH)
    B, H, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = 1 / math.sqrt(D)
    # K/V per query head as stride-0 views of the KV heads (``_grouped``), the values zeros
    # (only the log-sum-exp is used) laid out as the keys: no (B, H, S, D) tensor exists.
    # (Zeros of one row expanded to every dim, stride 0 throughout, made the kernel 12x slower
    # in bfloat16 and 2.7x in float32 on this CPU, torch 2.13: 4.9 against 0.42 s for 2 x 7
    # query heads of 1024 queries on 4096 keys, one thread.)
    qg = q.reshape(B * Hkv, G, Tq, D)
    if lse is None:
        keys = _grouped(k, G)  # (B * H_kv, G, S, D)
        zeros = _grouped(k.new_zeros(B, Hkv, S, D), G)
        lse = flash(qg, keys[:, :, start:], zeros[:, :, start:], 0.0, True, scale=scale)[1]
        if start:
            prefix = flash(qg, keys[:, :, :start], zeros[:, :, :start], 0.0, False,
                           scale=scale)[1]
            lse = torch.logaddexp(prefix, lse)
    bias = -lse.float().reshape(B, H, Tq) / scale
    hi = bias.to(q.dtype)
    lo = (bias - hi.float()).to(q.dtype)
    rows = torch.cat([k, k.new_ones(B, Hkv, S, 2)], dim=-1).flip(2)  # (B, H_kv, S, D + 2)
    cols = torch.cat([q, hi[..., None], lo[..., None]], dim=-1).flip(2)  # (B, H, Tq, D + 2)
    cols = cols.reshape(B * Hkv, G, Tq, D + 2)
    rows = _grouped(rows, G)
    zeros = _grouped(cols.new_zeros(B, Hkv, Tq, D + 2), G)
    # the transposed problem's first Tq rows are its causal square; every later row sees all
    # Tq columns: unmasked, in blocks of LSE_ROWS rows, so that the kernel's unused output
    # (rows x (D + 2) per query head) stays block-sized
    lse_t = [flash(rows[:, :, :Tq], cols, zeros, 0.0, True, scale=scale)[1]]
    for r in range(Tq, S, LSE_ROWS):
        lse_t.append(flash(rows[:, :, r:r + LSE_ROWS], cols, zeros, 0.0, False, scale=scale)[1])
    return torch.cat(lse_t, dim=2).float().reshape(B, H, S).flip(2).exp()


LSE_ROWS = 4096  # rows (keys) per block of _column_sums_by_lse's transposed pass


def _flash_available(q: Tensor, k: Tensor, v: Tensor, gqa: bool) -> bool:
    """Whether SDPA's flash kernel takes these inputs (CUDA only; meta tensors, which carry
    shapes only, follow the CUDA path for ``scripts/predict_memory.py``)."""
    if q.device.type == "meta":
        return True
    if q.device.type != "cuda":
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, gqa)
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Grouped-query attention of a few queries over cached keys, K/V never repeated.

    Args:
        q: (B, H, Tq, D) queries.
        k, v: (B, H_kv, S, D) keys and values; query head h reads KV head h // (H / H_kv).
        mask: bool, broadcastable to (B, H_kv, G * Tq, S) with G = H / H_kv (rows ordered
            query head within the group, then query token); False masks a key out.
    Returns:
        (B, H, Tq, D) in the dtype of v. Scores and softmax in float32.
    """
    B, H, Tq, D = q.shape
    probs = attention_probs(q, k, mask).to(v.dtype)  # (B, H_kv, G*Tq, S)
    return torch.matmul(probs, v).reshape(B, H, Tq, D)


FLEX_BLOCK = 128  # tokens per key block of the compiled decode attention (FlexAttention)
FLEX_DECODE = True  # False: compiled CUDA decode keeps the masked formula (for comparisons)


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None,
                     last: Tensor | None = None, offset: Tensor | None = None) -> Tensor:
    """Decode attention of q over the written prefix of static K/V buffers.

    Args:
        q: (B, H, 1, D); k, v: (B, H_kv, S, D) static buffers; valid: (S,) bool device
            tensor, True on the written prefix (slots 0 .. last; shapes never depend on it:
            one compiled graph), or None: built from ``last`` (``written_slots``) only where
            the PyTorch path needs it, so a step through the kernels launches nothing for it;
            last: (1,) int64 device tensor, that last slot, when the caller has it (with
            ``offset``, (1,) int64: the slot is last - offset, which the kernel subtracts).
    Returns:
        (B, H, 1, D) in the dtype of v.
    Raises:
        ValueError: neither ``valid`` nor ``last`` given.

    Where the fused kernels run (CUDA, ``kernels.enabled``) and ``last`` is given, this is
    ``kernels.sparse.attend_prefix``: a split-K Triton kernel of ours that reads only slots
    0..last, each KV head once for its group, with no separate last block. Otherwise:

    Eager, and on CPU, this is ``attend`` masked by ``valid``. Compiled on CUDA (the timed
    decode step), it is ``flex_prefix_attention``: FlexAttention's decoding kernel reads only
    the key blocks written so far and splits the sequence over thread blocks (flash-decoding),
    reading K/V once per KV head for its query group (GQA), where matmul-softmax-matmul is a
    GEMM of G rows over S keys. Needs head_dim >= 16 (the kernel's tile); smaller heads keep
    the formula. On CPU inductor's flex kernel measured 2.3x slower than the compiled formula
    at 32K (``results/cpu/bench_step-32k-compiled*.json``), so CPU keeps the formula (and it
    has no log-sum-exp output). On the H200 at 128K the flex kernel read a layer's 512 MiB of
    K/V at 1.40x its bandwidth floor, and one layer's step took 0.349 ms against the formula's
    0.456 ms (``results/NVIDIA-H200/``). ``FLEX_DECODE = False`` keeps the formula on CUDA.
    """
    if last is not None and kernels.enabled(q, "prefix"):
        return kernels.prefix_attention(q, k, v, last, offset)
    if valid is None:
        if last is None:
            raise ValueError("prefix_attention needs valid or last")
        valid = written_slots(k.shape[2], last, offset)
    if FLEX_DECODE and torch.compiler.is_compiling() and q.device.type == "cuda" and \
            q.shape[-1] >= 16:
        return flex_prefix_attention(q, k, v, valid.sum(dim=0, keepdim=True) - 1)
    return attend(q, k, v, valid)


def written_slots(length: int, last: Tensor, offset: Tensor | None = None) -> Tensor:
    """(length,) bool: True on slots 0 .. last - offset (``last`` (1,) int64 device tensor, a
    token's position; ``offset`` (1,) or () int64, the positions before slot 0, None: 0). The
    PyTorch path's mask of a static buffer's written prefix: the kernels read ``last`` and
    ``offset`` instead, so callers build it only where the PyTorch path runs."""
    slot = last if offset is None else last - offset
    return torch.arange(length, device=last.device) <= slot


def flex_prefix_attention(q: Tensor, k: Tensor, v: Tensor, last: Tensor) -> Tensor:
    """``prefix_attention`` through FlexAttention (call it inside ``torch.compile``; eager
    FlexAttention is a slow reference). Same arguments and result, with ``last`` the (1,) slot
    written last.

    The key blocks of ``FLEX_BLOCK`` tokens before the one holding ``last`` are wholly written:
    FlexAttention's decoding kernel reads them (a block mask built on the device, no mask
    function) and returns their log-sum-exp. The block holding ``last`` is gathered (one block)
    and attended exactly, masked at ``last``; the two partial softmaxes are merged by their
    log-sum-exps (flash-decoding's split-KV combine). Blocks after it are never read. No mask
    function reads a tensor computed in the graph: torch 2.11's CUDA flex decoding lowering
    fails on one ("convert FlexibleLayout to FixedLayout first"). Eager FlexAttention ignores
    the block indices, so eagerly (tests) a mask function masks the slots of the same blocks."""
    import inspect

    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    n_blocks = -(-S // FLEX_BLOCK)
    block = torch.div(last, FLEX_BLOCK, rounding_mode="floor")  # (1,) the block holding last
    num = block.to(torch.int32).view(1, 1, 1)  # blocks 0 .. block - 1 are wholly written
    idx = torch.arange(n_blocks, dtype=torch.int32, device=q.device).view(1, 1, 1, -1)
    kw = {"seq_lengths": (1, S)}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        kw["compute_q_blocks"] = False  # the backward pass's indices: never needed here
    if not torch.compiler.is_compiling():  # eager flex ignores the block indices: mask by slot
        limit = block * FLEX_BLOCK
        kw["mask_mod"] = lambda b, h, q_idx, kv_idx: kv_idx < limit[0]
    mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=FLEX_BLOCK, **kw)
    try:  # torch >= 2.9 asks for the log-sum-exp this way (return_lse is deprecated)
        from torch.nn.attention.flex_attention import AuxRequest

        head, aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=G > 1,
                                   return_aux=AuxRequest(lse=True))
        lse_head = aux.lse
    except ImportError:
        head, lse_head = flex_attention(q, k, v, block_mask=mask, enable_gqa=G > 1,
                                        return_lse=True)
    # the block holding last, exactly: (B, H_kv, G, FLEX_BLOCK) scores in float32
    slots = block * FLEX_BLOCK + torch.arange(FLEX_BLOCK, device=q.device)
    written = slots <= last  # before the clamp: a short last block's repeats stay masked
    slots = slots.clamp(max=S - 1)
    kt = k.index_select(2, slots).float()
    vt = torch.where(written[:, None], v.index_select(2, slots).float(), 0.0)
    s = torch.matmul(q.view(B, Hkv, G, D).float(), kt.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~written, float("-inf"))
    lse_tail = s.logsumexp(dim=-1)  # (B, H_kv, G): finite, last is in the block
    tail = torch.matmul((s - lse_tail[..., None]).exp(), vt)  # (B, H_kv, G, D)
    lse_head = lse_head.view(B, Hkv, G).float()
    top = torch.maximum(lse_head, lse_tail)
    w_head = (lse_head - top).exp()  # 0 when no block is whole (lse -inf)
    w_tail = (lse_tail - top).exp()
    head = torch.where(w_head[..., None] > 0, head.view(B, Hkv, G, D).float(), 0.0)
    out = (head * w_head[..., None] + tail * w_tail[..., None]) / (w_head + w_tail)[..., None]
    return out.view(B, H, 1, D).to(v.dtype)


def attention_probs(q: Tensor, k: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax weights of ``attend``: (B, H_kv, G * Tq, S) float32, rows ordered query head
    within the group, then query token (q (B, H, Tq, D), k (B, H_kv, S, D), ``mask`` as in
    ``attend``). Methods that accumulate attention (H2O) read them."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, (H // Hkv) * Tq, D)  # (B, H_kv, G*Tq, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)
