"""KV cache interface and the full (uncompressed) cache.

Every attention layer owns one ``KVCache``. The model hands it q, k, v (keys already rotated at
their true positions) and gets the attention output back; the cache decides what to store, what
to read and how to attend. Compression methods (``compression/``) are subclasses.

The interface carries what the methods need without bending:

* Prefill runs layer by layer, and within a layer in prefill blocks of ``prefill_block``
  tokens (None, the default: the whole prompt is one block). ``store_prompt(k, v, q_obs,
  start)`` sees one block's K/V and its last ``obs_window`` queries before any of the block's
  queries attends, so a cache may evict right there (SnapKV family, one block); then the model
  asks ``prefill_attention(q, k, v, start)`` for chunks of the block's queries (exact causal
  attention by default; KeyDiff attends to its already-compressed cache plus the block and
  evicts after each block). A cache may offer ``prompt_buffers`` so the model writes the
  block's K/V straight into its storage. Whole-prompt queries, attention outputs and
  (T x T) scores never exist: at 128K tokens, prefill holds the hidden states and one layer's
  K/V beside the weights and caches.
* ``decode(q, k, v, input_pos)`` gets the new token at ``input_pos``, a device tensor, so the
  step has static shapes and compiles once; a cache may evict inside it within a fixed
  capacity (H2O, StreamingLLM) or update page summaries on write (Quest, RocketKV). A cache
  whose step is "write the token, then attend" also offers ``token_store(input_pos)`` (where
  the token goes, with a selector's auxiliary keys: ``Selector.token_aux``) and
  ``attend_stored(q, input_pos)``: with the dense kernels the q/k/v projection kernel writes
  the token there and the model calls ``attend_stored`` (``TransformerBlock.forward_fused``).
* Buffers are per-cache ``register_buffer`` tensors of any shape and device: different
  capacities per KV head (DuoAttention) or CPU-resident storage (OmniKV offload) are the
  subclass's choice. Caches are built together by a method's factory (``build_caches``), so
  a later layer's cache may hold a reference to an earlier layer's state (OmniKV filter layers).
* ``allocated_bytes()`` and ``bytes_read_per_step()`` report storage and per-step traffic.

Token budget (RocketKV paper Sec. 3.5): key+value pairs read per decode step, per layer, per
KV-head group, approximation traffic included. The full cache has no budget: it reads every
cached token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from rocketkv import kernels
from rocketkv.model import ConfigError, ModelArgs

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


class TokenStore(NamedTuple):
    """Where a decode step's fused projection kernel (``kernels.dense.qkv_store``) writes the
    new token's key and value, and which auxiliary keys it updates in the same pass
    (``kernels.sparse.write_token``'s formats).

    Attributes:
        k_cache, v_cache: (B, H_kv, S, D) buffers, last dim contiguous.
        pos, offset: (1,) int64 device tensors: the slot written is pos - offset (the
            token's position less a compressed cache's ``slot_offset``, subtracted in the
            kernel); offset None: the slot is pos.
        aux: the auxiliary keys (a page summary or a dim-major key copy), or an empty tensor.
        aux_kind: ``kernels.AUX_NONE``, ``AUX_SUMMARY`` or ``AUX_DIM_MAJOR``.
        page_size: tokens per page of ``AUX_SUMMARY``.
    """

    k_cache: Tensor
    v_cache: Tensor
    pos: Tensor
    offset: Tensor | None
    aux: Tensor
    aux_kind: int
    page_size: int


class KVCache(nn.Module):
    """One layer's cache. Subclasses implement ``prefill`` and ``decode``; a cache whose
    decode step is "write the token, then attend" also offers ``token_store`` and
    ``attend_stored``, so the fused projection kernel writes the token for it.

    Args:
        layer_idx: index of the layer this cache serves.
        args: the model's shapes (heads, KV heads, head_dim).
        batch_size: sequences decoded together (equal prompt lengths).
        dtype, device: of the stored K/V.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.layer_idx = layer_idx
        self.batch_size = batch_size
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.dtype, self.device = dtype, torch.device(device)

    obs_window = 0  # last prompt queries ``store_prompt`` needs (observation window)
    dense_kernels = True  # the decode step may run the dense kernels (``kernels/dense.py``)

    def _register_kv(self, slots: int, positions: bool = False) -> None:
        """Zeroed ``k_cache`` and ``v_cache`` buffers (B, H_kv, slots, D) in the cache's dtype
        and, with ``positions``, ``slot_pos`` (B, H_kv, slots) int64, the position each slot
        holds (-1: empty), for caches whose slots are not in position order."""
        shape = (self.batch_size, self.n_kv_heads, slots)
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(*shape, self.head_dim, dtype=self.dtype,
                                                   device=self.device), persistent=False)
        if positions:
            self.register_buffer("slot_pos", torch.full(shape, -1, dtype=torch.long,
                                                        device=self.device), persistent=False)

    prefill_block: int | None = None  # prompt tokens per prefill block (None: the whole
    # prompt at once); a cache with blocks sees ``store_prompt`` once per block

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor] | None:
        """Views (B, H_kv, end - start, D) of this cache's own storage where the model may
        write the K/V of the prefill block at positions ``start .. end - 1`` directly (saving
        a copy), or None: the model allocates them."""
        return None

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        """Store what the method keeps of one prefill block (it may evict here).

        Called once per block (once per layer unless ``prefill_block`` is set), after every key
        and value of the block exists and before any of its queries attends, so only one
        block's uncompressed K/V ever exists.

        Args:
            k, v: (B, H_kv, Tb, D), keys rotated at positions ``start .. start + Tb - 1``
                (possibly the views ``prompt_buffers`` returned); the whole prompt (start 0,
                Tb = T) for a cache without ``prefill_block``.
            q_obs: (B, H, min(obs_window, Tb), D), the block's last queries (rotated).
            start: position of the block's first token.
        """
        raise NotImplementedError

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Attention of the prompt queries at positions ``start ..`` (q (B, H, Tq, D)) over
        the prompt keys up to position ``start + Tq - 1``; k, v (B, H_kv, start + Tq - b, D)
        hold the current prefill block's keys from its first position b (b = 0 without
        ``prefill_block``: the whole prompt so far).

        Prefill attends to the whole uncompressed prompt for every method but KeyDiff
        (RocketKV App. A.3); the model calls this in query chunks, so no (T x T) scores and no
        whole-prompt query or output tensor exist. Returns (B, H, Tq, D).
        """
        return causal_attention(q, k, v, start)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One layer's whole prompt, given its q, k, v: per prefill block (the whole prompt
        without ``prefill_block``), ``store_prompt`` then ``prefill_attention``, as
        ``TransformerBlock.prefill`` calls them.

        Args:
            q: (B, H, T, D); k, v: (B, H_kv, T, D), rotated at positions 0..T-1.
        Returns:
            attention output (B, H, T, D).
        """
        T = k.shape[2]
        block = self.prefill_block or T
        out = []
        for b in range(0, T, block):
            e = min(b + block, T)
            kb, vb = k[:, :, b:e], v[:, :, b:e]
            bufs = self.prompt_buffers(b, e)
            if bufs is not None:
                bufs[0].copy_(kb)
                bufs[1].copy_(vb)
                kb, vb = bufs
            w = min(self.obs_window, e - b)
            self.store_prompt(kb, vb, q[:, :, e - w:e], b)
            out.append(self.prefill_attention(q[:, :, b:e], kb, vb, b))
        return torch.cat(out, dim=2)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """A later prompt chunk (a conversation's next turn): store its K/V after everything
        cached and let its queries attend, densely, to what the cache holds plus the chunk
        causally.

        The earlier prompt stays as the method left it (compressed, for an evicting method):
        the chunk's queries see only the kept tokens, which is the multi-turn setting of the
        RocketKV paper's SCBench results. Its tokens are stored like generated tokens (never
        evicted; the decode-time selection of the method scores them from the next step on).

        Args:
            q: (B, H, Tc, D); k, v: (B, H_kv, Tc, D), rotated at positions ``start ..
                start + Tc - 1``; ``start`` is the number of tokens fed so far.
        Returns:
            attention output (B, H, Tc, D).
        Raises:
            ValueError: the chunk does not fit in the cache's capacity.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot append a prompt chunk")

    needs_attention_sums = False  # True: storing a recorded prompt needs the column sums of
    # every prompt query's attention (H2O): ``prefill.prefill_once(attention_sums=True)``

    def store_recorded_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor,
                              attention_sums: Tensor | None, memo: dict) -> None:
        """Store a whole prompt recorded by a shared prefill (``prefill.prefill_once``), as
        ``store_prompt`` would have stored it during that prefill.

        Args:
            k, v: (B, H_kv, T, D), keys rotated at positions 0..T-1.
            q_obs: (B, H, w, D), the prompt's last w recorded queries (w = T when the prompt
                is shorter than the recorded window).
            attention_sums: (B, H_kv, T) float32 column sums of every prompt query's attention
                (``attention_column_sums``), or None when the prefill did not record them.
            memo: the prefill's dict for this layer, shared by every cache built from it
                (``prefill_memo``).
        Raises:
            ConfigError: the cache's observation window exceeds the recorded queries.
        """
        w_rec = q_obs.shape[2]
        if self.obs_window > w_rec and w_rec < k.shape[2]:
            raise ConfigError(f"the method's observation window ({self.obs_window} tokens) "
                              f"exceeds the {w_rec} queries recorded by prefill_once")
        w = min(self.obs_window, w_rec)  # the method's window; 0: no eviction
        with prefill_memo(memo):
            self.store_prompt(k, v, q_obs[:, :, w_rec - w:])

    compilable = True  # False: the decode step syncs with the host (OmniKV's offload) and runs
    # eagerly

    shared_prefill = True  # prefill attends to the whole uncompressed prompt, so every such
    # method's caches may be built from one prefill's K/V (``prefill.prefill_once``)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Store the new token's k, v and attend.

        Args:
            q: (B, H, 1, D); k, v: (B, H_kv, 1, D) rotated at ``input_pos``.
            input_pos: (1,) int64 device tensor, the token's absolute position.
        Returns:
            attention output (B, H, 1, D).
        """
        raise NotImplementedError

    def token_store(self, input_pos: Tensor) -> TokenStore | None:
        """Where the token at ``input_pos`` (1,) int64 is to be written by a fused kernel,
        which must then call ``attend_stored`` instead of ``decode``; None (the default):
        ``decode`` must see the token's k and v (the cache does more than write them)."""
        return None

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        """``decode`` after the token's k and v were written where ``token_store`` said:
        q (B, H, 1, D) -> attention output (B, H, 1, D). Subclasses of a cache that offers
        ``token_store`` change the attention here, not in ``decode``."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        """Bytes of every buffer this cache owns (K/V and auxiliary data)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def bytes_read_per_step(self) -> int:
        """Bytes of cached K/V (and auxiliary data) one decode step reads."""
        raise NotImplementedError

    def ideal_bytes_per_step(self) -> int:
        """Bytes a step would read if every read touched only the elements it uses (the
        RocketKV paper's Table 1 count); ``bytes_read_per_step`` counts what the kernels touch
        at the layout used (32-byte sectors where a gather is strided). Equal by default."""
        return self.bytes_read_per_step()

    def host_bytes(self) -> int:
        """Bytes of this cache kept in host memory (OmniKV's ``--offload``); not part of
        ``allocated_bytes``."""
        return 0

    def offload_bytes_per_step(self) -> int:
        """Bytes this cache copies from host to device memory per decode step."""
        return 0

    def method_params(self) -> dict[str, Any]:
        """Every derived parameter of the method, for reports."""
        return {}


class FullKVCache(KVCache):
    """Uncompressed static cache ``(B, H_kv, max_seq_len, D)`` for K and for V.

    Decode writes the new token at ``input_pos`` and attends to positions ``<= input_pos`` with a
    mask built from ``input_pos`` (static shapes: one compiled graph for every step). The step
    reads the whole static buffer, so ``max_seq_len`` is sized to prompt + new tokens.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_seq_len: int,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.max_seq_len = max_seq_len
        self._params = dict(params or {})
        self._register_kv(max_seq_len)

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        if end > self.max_seq_len:
            raise ValueError(f"prompt of {end} tokens exceeds the cache "
                             f"({self.max_seq_len})")
        return self.k_cache[:, :, start:end], self.v_cache[:, :, start:end]

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        k_buf, v_buf = self.prompt_buffers(start, start + k.shape[2])
        if not same_view(k, k_buf):  # the model did not write into our buffers directly
            k_buf.copy_(k)
            v_buf.copy_(v)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        end = start + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"a chunk ending at position {end} exceeds the cache "
                             f"({self.max_seq_len} tokens)")
        self.k_cache[:, :, start:end] = k
        self.v_cache[:, :, start:end] = v
        return causal_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], start)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.attend_stored(q, input_pos)

    def token_store(self, input_pos: Tensor) -> TokenStore | None:
        if type(self).decode is not FullKVCache.decode:  # a subclass that decodes its own
            return None  # way sees k and v
        return TokenStore(self.k_cache, self.v_cache, input_pos, None,
                          *kernels.no_aux(self.k_cache))

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        # the mask of written slots is built inside, only where the PyTorch path runs
        return prefix_attention(q, self.k_cache, self.v_cache, None, input_pos)

    def bytes_read_per_step(self) -> int:
        # compiled, the step reads the written blocks; at the last step that is the whole
        # buffer (sized prompt + new tokens), which this counts
        return self.allocated_bytes()

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "max_seq_len": self.max_seq_len}


def same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is exactly the view ``b`` (same storage, offset, shape and strides)."""
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride())


SECTOR = 32  # bytes: the unit in which GPU memory is read (an L2 sector)


def sector_bytes(nbytes: int) -> int:
    """Bytes read for ``nbytes`` contiguous bytes: whole 32-byte sectors (aligned start)."""
    return -(-nbytes // SECTOR) * SECTOR


def strided_bytes(n: int, row: int, elem: int) -> int:
    """Bytes read for ``n`` scattered elements of one contiguous row of ``row`` elements of
    ``elem`` bytes: each in its own sector at worst, never more than the whole row."""
    return min(n * SECTOR, sector_bytes(row * elem))


def token_bytes(cache: KVCache, n: int) -> int:
    """Bytes of ``n`` gathered key+value rows (whole sectors each) for every sequence and KV
    head of ``cache``."""
    row = sector_bytes(cache.head_dim * torch.empty((), dtype=cache.dtype).element_size())
    return 2 * cache.batch_size * cache.n_kv_heads * n * row


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Rows of ``x`` (B, H_kv, S, D) at token indices ``idx`` (B, H_kv, n) -> (B, H_kv, n, D).

    Any (B, H_kv, rows, width) tensor works the same way: SparQ and hybrid attention read r
    whole rows of transposed keys or page summaries with it.

    On CPU a contiguous ``x`` is read as whole D-element rows (``index_select`` over the
    flattened (B * H_kv * S, D) view): the same values as the element-wise ``gather``, about
    10x faster in bfloat16 (3.5 ms against 0.3 ms at B=10, H_kv=3, S=2200, n=512, D=64, 2
    threads). Other devices keep ``gather``.
    """
    B, Hkv, S, D = x.shape
    if x.device.type == "cpu" and x.is_contiguous():
        base = torch.arange(B * Hkv, device=x.device).view(B, Hkv, 1) * S
        return x.view(-1, D).index_select(0, (idx + base).reshape(-1)).view(*idx.shape, D)
    return x.gather(2, idx[..., None].expand(-1, -1, -1, D))


def attend_selected(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor,
                    valid: Tensor) -> Tensor:
    """Exact attention of q (B, H, 1, D) over the cached tokens ``idx`` (B, H_kv, n), shared by
    each query group; ``valid`` (S,) bool marks written slots (unwritten picks are masked)."""
    mask = valid[idx][:, :, None, :]  # (B, H_kv, 1, n)
    return attend(q, gather_tokens(k_cache, idx), gather_tokens(v_cache, idx), mask)


class Selector(nn.Module):
    """Decode-time token selection over a cache's slots; the base class attends densely.

    A selector may own auxiliary buffers (page summaries, running means): they are counted in
    the cache's ``allocated_bytes``. Subclasses override ``build`` (after prefill), ``update``
    (after each decode write) with ``extend`` (after a prompt chunk's writes: the state that
    ``update`` per slot would leave), ``select`` and the byte/parameter reports. A selector
    that attends to k chosen tokens derives from ``compression.selection.TopKSelector``, which
    declares what the fused kernels need and dispatches to them in one place.
    """

    page_size = 1  # the cache's buffer length is rounded up to a multiple of this

    def allocate(self, cache: CompressedKVCache) -> None:
        """Create auxiliary buffers for ``cache`` (its shapes are final)."""

    def build(self, cache: CompressedKVCache) -> None:
        """Recompute auxiliary data from the ``cache.kept`` prompt slots after prefill."""

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        """Account for key ``k`` (B, H_kv, 1, D) just written at ``slot`` (1,)."""

    def extend(self, cache: CompressedKVCache, first: int, n: int) -> None:
        """Account for the keys just written at slots ``first .. first + n - 1`` (a prompt
        chunk appended to the cache), leaving the state ``n`` ``update`` calls in order would.
        A selector that keeps per-slot state overrides both."""

    def token_aux(self, cache: CompressedKVCache) -> tuple[Tensor, int, int] | None:
        """The auxiliary keys a fused kernel updates with the token's write, as
        ``TokenStore``'s ``(aux, aux_kind, page_size)``, or None when ``update`` must run
        (the default for a selector that overrides ``update`` and not this)."""
        return None if type(self).update is not Selector.update else \
            kernels.no_aux(cache.k_cache)

    def store_token(self, cache: CompressedKVCache, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Write a decoded token's k, v (B, H_kv, 1, D) at ``slot`` (1,) int64 and ``update``.
        Selectors with a fused kernel for both (``kernels.sparse.write_token``) override it."""
        cache.k_cache.index_copy_(2, slot, k)
        cache.v_cache.index_copy_(2, slot, v)
        self.update(cache, slot, k)

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """The slots (B, H_kv, n) int64 that ``attend`` reads for q (B, H, 1, D), given the
        written slots ``valid`` (S,) bool, shared by each query group (picks of unwritten
        slots, where fewer than n are written, are masked out by the attention; a cache's
        ``head_mask`` further restricts each query head). Every slot here: dense attention."""
        return torch.arange(cache.length, device=valid.device).expand(
            cache.batch_size, cache.n_kv_heads, cache.length)

    def attend(self, cache: CompressedKVCache, q: Tensor, pos: Tensor) -> Tensor:
        """Attention output (B, H, 1, D) for q over the written slots of ``cache``: slots 0 ..
        pos - ``cache.slot_offset``, ``pos`` (1,) int64 the position of the token just
        written. Here dense attention (``prefix_attention``: the kernels where they run);
        the mask of written slots (``cache.valid_slots``) is built only for the PyTorch
        path."""
        if cache.head_mask is not None:  # per-query-head token sets (original SnapKV)
            return attend(q, cache.k_cache, cache.v_cache,
                          cache.valid_slots(pos) & cache.head_mask)
        return prefix_attention(q, cache.k_cache, cache.v_cache, None, pos, cache.slot_offset)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        """Bytes one decode step's kernels read at this layout: every slot's key and value."""
        return cache.kv_bytes(cache.capacity)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        """Bytes the step would read touching only the elements it uses (RocketKV Table 1)."""
        return self.bytes_read(cache)

    def params(self) -> dict[str, Any]:
        return {"selection": "dense"}


class CompressedKVCache(KVCache):
    """Static compact cache shared by every compression method.

    Slots ``0 .. kept-1`` hold the prompt tokens kept at the end of prefill (all of them, or the
    ones an eviction policy chose, in position order); slots ``kept ..`` hold generated tokens
    in order, so they never overwrite prompt slots. A decode step writes the token at
    ``input_pos`` into slot ``input_pos - (prompt_len - kept)`` and lets the selector attend.

    Args:
        prompt_len: prompt tokens (T).
        prompt_capacity: prompt tokens to keep; ``>= T`` means nothing to evict.
        max_new_tokens: slots reserved for generated tokens.
        evict: ``evict(q_obs, k) -> (idx, head_mask)`` choosing ``kept`` prompt tokens per KV
            head from the last ``obs_window`` queries q_obs (B, H, w, D) and the keys (idx
            (B, H_kv, kept) ascending; head_mask (B, H_kv, G, kept) bool or None when the
            selection is shared by the query group); None keeps the whole prompt.
        obs_window: prompt queries ``evict`` reads (the observation window).
        selector: decode-time selection (``Selector``).
        per_head: reserve a per-query-head mask (original SnapKV on GQA models).
        params: derived parameters to report.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, *, prompt_len: int, prompt_capacity: int, max_new_tokens: int,
                 selector: Selector, evict: Callable | None = None, per_head: bool = False,
                 obs_window: int = 0, params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.prompt_len = prompt_len
        self.kept = min(prompt_len, prompt_capacity)
        self.capacity = self.kept + max_new_tokens
        self.evict = evict
        self.obs_window = obs_window if evict is not None else 0
        self.selector = selector
        self._params = dict(params or {})
        length = -(-self.capacity // selector.page_size) * selector.page_size
        shape = (batch_size, args.n_kv_heads, length, args.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("slot_offset", torch.tensor(prompt_len - self.kept, device=device),
                             persistent=False)
        head_mask = torch.ones(batch_size, args.n_kv_heads, args.group_size, length,
                               dtype=torch.bool, device=device) if per_head else None
        self.register_buffer("head_mask", head_mask, persistent=False)  # None: group-shared
        selector.allocate(self)

    @property
    def length(self) -> int:
        """Slots in the static buffers (capacity rounded up to whole pages)."""
        return self.k_cache.shape[2]

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` key+value pairs for every sequence and KV head."""
        return 2 * self.batch_size * self.n_kv_heads * tokens * self.head_dim * \
            self.k_cache.element_size()

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor] | None:
        if self.evict is not None or start != 0 or end != self.prompt_len:
            return None  # K/V are gathered after eviction
        return self.k_cache[:, :, :end], self.v_cache[:, :, :end]

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        T = k.shape[2]
        if T != self.prompt_len:
            raise ValueError(f"cache set up for {self.prompt_len} prompt tokens, got {T}")
        if self.evict is not None:
            idx, head_mask = self.evict(q_obs, k)  # (B, H_kv, kept)
            k, v = gather_tokens(k, idx), gather_tokens(v, idx)
            if self.head_mask is not None:
                self.head_mask[..., :self.kept] = head_mask
        if not same_view(k, self.k_cache[:, :, :self.kept]):
            self.k_cache[:, :, :self.kept] = k
            self.v_cache[:, :, :self.kept] = v
        self.selector.build(self)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        Tc = k.shape[2]
        first = start - (self.prompt_len - self.kept)  # slots are positions minus the evicted
        if start < self.prompt_len or first + Tc > self.capacity:
            raise ValueError(f"a chunk at positions {start}..{start + Tc - 1} does not fit the "
                             f"cache (prompt {self.prompt_len} tokens, {self.capacity} slots "
                             f"for {self.kept} kept)")
        end = first + Tc
        self.k_cache[:, :, first:end] = k
        self.v_cache[:, :, first:end] = v
        self.selector.extend(self, first, Tc)
        if self.head_mask is None:
            return causal_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end],
                                    first)
        # original SnapKV: each query head sees only its own kept prompt tokens
        causal = torch.arange(end, device=q.device) <= \
            torch.arange(first, end, device=q.device)[:, None]  # (Tc, end)
        mask = self.head_mask[..., None, :end] & causal  # (B, H_kv, G, Tc, end)
        B, Hkv, G = mask.shape[:3]
        return attend(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end],
                      mask.reshape(B, Hkv, G * Tc, end))

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        self.selector.store_token(self, input_pos - self.slot_offset, k, v)
        return self.attend_stored(q, input_pos)

    def token_store(self, input_pos: Tensor) -> TokenStore | None:
        if type(self).decode is not CompressedKVCache.decode:  # a subclass that decodes its
            return None  # own way sees k and v
        aux = self.selector.token_aux(self)
        return None if aux is None else TokenStore(self.k_cache, self.v_cache, input_pos,
                                                   self.slot_offset, *aux)

    def valid_slots(self, input_pos: Tensor) -> Tensor:
        """(S,) bool: the slots written once the token at ``input_pos`` (1,) int64 is
        stored (slots 0 .. input_pos - ``slot_offset``). Only the PyTorch path builds it."""
        return written_slots(self.length, input_pos, self.slot_offset)

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        return self.selector.attend(self, q, input_pos)

    def bytes_read_per_step(self) -> int:
        return self.selector.bytes_read(self)

    def ideal_bytes_per_step(self) -> int:
        return self.selector.ideal_bytes(self)

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "prompt_tokens_kept": self.kept, "capacity": self.capacity,
                **self.selector.params()}


