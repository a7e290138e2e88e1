"""Shared pieces of decode-time top-k selection (Quest, SparQ, hybrid attention, RocketKV).

Every selecting method picks ``k`` tokens per KV head, shared by the query group (GQA-aware as in
the RocketKV paper, App. A.3), and runs exact attention over them. This module holds what
several of them use: their base class ``TopKSelector`` (what each declares for the fused
kernels, and the one place a selector dispatches to them), group sums over the query heads, the
top-r head dims of the group-summed |q| and SparQ's softmax temperature (SparQ, hybrid), and
pages of min/max keys (``PagedSelector``: Quest, hybrid) with the page-first token top-k
(``top_pages_to_tokens``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rocketkv import kernels
from rocketkv.cache import CompressedKVCache, Selector, attend_selected, sector_bytes, strided_bytes


def group_sum(x: Tensor, n_kv_heads: int) -> Tensor:
    """Sum (B, H, ...) over the query heads of each group -> (B, H_kv, ...)."""
    B, H = x.shape[:2]
    return x.view(B, n_kv_heads, H // n_kv_heads, *x.shape[2:]).sum(dim=2)


def top_r_dims(q: Tensor, n_kv_heads: int, r: int) -> Tensor:
    """Indices (B, H_kv, r) int64 of the r largest dims of |q| summed over each query group
    (q: (B, H, 1, D)), largest first (RocketKV Alg. 2, first line: argtopk(sum(|q|, group), r)).

    Equal sums go to the lower dim, the rule of the fused kernels (``kernels.sparse``): 16-bit
    queries tie often (their group sums have few mantissa bits), and topk breaks ties its own
    way, so without one rule the PyTorch path and the kernels could score other dims and choose
    other pages for the same query."""
    a = group_sum(q[:, :, 0].abs().float(), n_kv_heads)
    return a.sort(dim=-1, descending=True, stable=True).indices[..., :r]


def query_dims(q: Tensor, dims: Tensor) -> Tensor:
    """The group's queries at ``dims``: q (B, H, 1, D), dims (B, H_kv, r) -> (B, H_kv, G, r)."""
    B, H, _, D = q.shape
    Hkv = dims.shape[1]
    return q.reshape(B, Hkv, H // Hkv, D).gather(-1, dims[:, :, None].expand(-1, -1, H // Hkv, -1))


def sparq_temperature(q: Tensor, q_r: Tensor) -> Tensor:
    """SparQ's softmax scale denominator sqrt(d * sum|q_r| / sum|q|), (B, H_kv, G, 1).

    q: (B, H, 1, D); q_r: (B, H_kv, G, r), the queries at the chosen dims (``query_dims``)."""
    B, H, _, D = q.shape
    qa = q.reshape(B, q_r.shape[1], H // q_r.shape[1], D).abs().float()
    return torch.sqrt(D * q_r.abs().float().sum(-1, keepdim=True) / qa.sum(-1, keepdim=True))


def page_summary(kmin: Tensor, kmax: Tensor) -> Tensor:
    """Page min/max keys (B, H_kv, P, D) each -> the summary layout (B, H_kv, 2 D, P): rows
    0..D-1 the max of each head dim over each page, rows D..2D-1 the min, so that one head
    dim's values over all pages are one contiguous row (RocketKV Sec. 3.4: "along the head
    dimension to enable efficient gathering")."""
    return torch.cat([kmax, kmin], dim=-1).transpose(-1, -2)


def top_pages_to_tokens(page_scores: Tensor, counts: Tensor, page_size: int, k: int,
                        fill: int) -> Tensor:
    """The top-k tokens of page-constant scores, chosen page by page.

    Args:
        page_scores: (B, H_kv, P) float32, one score per page.
        counts: (P,) valid (written) tokens per page; the valid slots are a prefix of the
            buffer, so every page is full but the last non-empty one.
        page_size: slots per page; k: tokens to select.
        fill: a slot that is not valid, returned where fewer than k tokens are valid (the
            attention masks it out); only needed when the buffer is not all valid.
    Returns:
        (B, H_kv, k) int64 slots: the valid tokens of the m = ceil(k / page_size) + 1 best
        pages (one top-k over P pages, sorted), taken in page order until k are taken. This is
        the set a top-k over the P * page_size token copies of the page scores gives, up to
        ties, at 1 / page_size of the entries (RocketKV at 32K, budget 256: 740 pages instead of
        2960 tokens). The one extra page covers a partial page among the first m - 1.
    """
    B, Hkv, P = page_scores.shape
    m = min(P, -(-k // page_size) + 1)
    pages = page_scores.topk(m, dim=-1).indices  # (B, H_kv, m), best first
    offsets = torch.arange(page_size, device=pages.device)
    toks = (pages[..., None] * page_size + offsets).flatten(-2)  # (B, H_kv, m * page_size)
    ok = (offsets < counts[pages][..., None]).flatten(-2)  # written slots of those pages
    rank = ok.cumsum(dim=-1)
    dest = torch.where(ok & (rank <= k), rank - 1, k)  # k: the discard slot
    out = toks.new_full((B, Hkv, k + 1), fill).scatter_(-1, dest, toks)
    return out[..., :k]


class TopKSelector(Selector):
    """A selector that picks ``k`` slots per KV head (shared by the query group) and attends
    exactly over them: Quest, SparQ, hybrid attention, Exact-TopK.

    A subclass declares what the fused kernels (``kernels.sparse_attention``) need as class
    attributes and properties, and implements ``select`` (the PyTorch path); ``attend``
    dispatches between the two here, once for every such selector:

    * ``kernel_mode``: how the kernel scores, ``"bound"`` (Quest's page bounds, summed over
      the group) or ``"softmax"`` (approximate scores softmaxed per query head with SparQ's
      temperature, summed over the group);
    * ``page_size``: slots per scored row (1: every slot is scored, from K^T or a dim-major
      copy); ``k``: slots attended; ``kernel_r(cache)``: head dims the scores read (d: all);
    * ``kernel_rows(cache)``: what the kernel scores from, (B, H_kv, rows, pages) (a page
      summary or a dim-major key copy), None: the keys themselves read as K^T;
    * ``kernel_v_mean()``: SparQ's running mean of values (B, H_kv, 1, D) float32 with
      mean-value reallocation, else None.
    """

    kernel_mode = "softmax"
    KERNEL_MODES = ("bound", "softmax")

    def __init_subclass__(cls, **kwargs) -> None:
        """Raises ValueError for a ``kernel_mode`` the kernels do not know."""
        super().__init_subclass__(**kwargs)
        if cls.kernel_mode not in TopKSelector.KERNEL_MODES:
            raise ValueError(f"{cls.__name__}.kernel_mode must be one of "
                             f"{', '.join(TopKSelector.KERNEL_MODES)}, got {cls.kernel_mode!r}")

    def __init__(self, k: int, page_size: int = 1):
        super().__init__()
        self.k, self.page_size = k, page_size

    def kernel_r(self, cache: CompressedKVCache) -> int:
        """Head dims the scores read (default: every one, d)."""
        return cache.head_dim

    def kernel_rows(self, cache: CompressedKVCache) -> Tensor | None:
        """What the fused selection scores from (None: K^T, the keys themselves)."""
        return None

    def kernel_v_mean(self) -> Tensor | None:
        """SparQ's running mean of values for the fused reallocation, or None."""
        return None

    def fused(self, cache: CompressedKVCache, x: Tensor) -> bool:
        """Whether this step's selection runs in the kernels (``x`` on the step's device):
        where the ``sparse`` family runs (``kernels.enabled``: not switched off by the
        self-check) and the selection fits one (``kernels.selection_fits``)."""
        return kernels.enabled(x, "sparse") and kernels.selection_fits(
            cache.length // self.page_size, min(self.k, cache.length), self.page_size)

    def attend(self, cache: CompressedKVCache, q: Tensor, pos: Tensor) -> Tensor:
        """Exact attention (B, H, 1, D) of q over the ``k`` slots the selection picks: the
        fused kernel where ``fused`` says so (it reads ``pos`` and the cache's
        ``slot_offset``, no mask), else ``select`` then ``attend_valid`` over the written
        slots (``cache.valid_slots``)."""
        if self.fused(cache, q):
            return kernels.sparse_attention(
                q, cache.k_cache, cache.v_cache, self.kernel_rows(cache), pos,
                mode=getattr(kernels.ops(), "MODE_" + self.kernel_mode.upper()),
                two_bounds=self.page_size > 1, r=self.kernel_r(cache),
                k=min(self.k, cache.length), page_size=self.page_size,
                offset=cache.slot_offset, v_mean=self.kernel_v_mean())
        return self.attend_valid(cache, q, cache.valid_slots(pos))

    def attend_valid(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """The PyTorch path of ``attend`` given the written slots ``valid`` (S,) bool: exact
        attention over ``select``'s slots."""
        idx = self.select(cache, q, valid)
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Slots (B, H_kv, min(k, S)) int64 to attend to (see ``Selector.select``)."""
        raise NotImplementedError


class PagedSelector(TopKSelector):
    """A selector that keeps element-wise min/max keys per page of ``page_size`` slots.

    They live in ``summary`` (B, H_kv, 2 D, pages): rows 0..D-1 the max of each head dim over
    each page, rows D..2D-1 the min (``page_summary``), so the pages' values of one head dim are
    one contiguous row: reading r dims reads r rows, not a strided r / D of every page's row.
    Pages of one token keep no summary: K^T (a strided view of the cache) stands for it.
    """

    def __init__(self, page_size: int, k: int):
        super().__init__(k, page_size)

    def allocate(self, cache: CompressedKVCache) -> None:
        if self.page_size == 1:  # a one-token page's min and max are the key itself
            return
        B, Hkv, S, D = cache.k_cache.shape
        self.register_buffer("summary", torch.zeros(B, Hkv, 2 * D, S // self.page_size,
                                                    dtype=cache.dtype, device=cache.device),
                             persistent=False)

    def kernel_rows(self, cache: CompressedKVCache) -> Tensor | None:
        """The summary for the fused kernels, or None for pages of one token (the kernels
        read the keys as K^T themselves, ``kernels.sparse_attention``)."""
        return None if self.page_size == 1 else self.summary

    def rows(self, cache: CompressedKVCache) -> Tensor:
        """The summary (B, H_kv, 2 D, pages), or K^T (B, H_kv, D, S) for pages of one token."""
        if self.page_size == 1:
            return cache.k_cache.transpose(-1, -2)
        return self.summary

    def bounds(self, cache: CompressedKVCache) -> tuple[Tensor, Tensor]:
        """Element-wise (min, max) keys per page, each a (B, H_kv, pages, D) view."""
        if self.page_size == 1:
            return cache.k_cache, cache.k_cache
        D = cache.head_dim
        return self.summary[:, :, D:].transpose(-1, -2), self.summary[:, :, :D].transpose(-1, -2)

    def n_pages(self, cache: CompressedKVCache) -> int:
        return cache.length // self.page_size

    def summarize(self, cache: CompressedKVCache, p0: int, p1: int, written: int) -> None:
        """Set the summary of pages ``p0 .. p1 - 1`` from the cache's first ``written`` slots
        (min and max over each page's written slots; 0 for a page with none)."""
        P = self.page_size
        pages = cache.k_cache[:, :, p0 * P:p1 * P].unflatten(2, (p1 - p0, P))  # (B,Hkv,n_p,P,D)
        ok = (torch.arange(p0 * P, p1 * P, device=cache.device) < written).view(-1, P)
        w = ok[None, None, :, :, None]
        kmin = pages.masked_fill(~w, float("inf")).amin(dim=3)
        kmax = pages.masked_fill(~w, float("-inf")).amax(dim=3)
        empty = ~ok.any(dim=-1)[None, None, :, None]  # pages no token reached yet
        self.summary[..., p0:p1] = page_summary(kmin.masked_fill(empty, 0),
                                                kmax.masked_fill(empty, 0))

    def build(self, cache: CompressedKVCache) -> None:
        if self.page_size > 1:
            self.summarize(cache, 0, self.n_pages(cache), cache.kept)

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        if self.page_size == 1:
            return
        D = cache.head_dim
        page = torch.div(slot, self.page_size, rounding_mode="floor")  # (1,)
        first = (slot % self.page_size) == 0  # a new page starts with this token
        old = self.summary.index_select(3, page)  # (B, H_kv, 2 D, 1)
        kt = k.transpose(-1, -2)  # (B, H_kv, D, 1)
        new = torch.cat([torch.maximum(old[:, :, :D], kt), torch.minimum(old[:, :, D:], kt)], 2)
        self.summary.index_copy_(3, page, torch.where(first, torch.cat([kt, kt], 2), new))

    def token_aux(self, cache: CompressedKVCache) -> tuple[Tensor, int, int]:
        """The page summary, updated with the token's write (pages of one slot: none)."""
        if self.page_size == 1:
            return kernels.no_aux(cache.k_cache)
        return self.summary, kernels.AUX_SUMMARY, self.page_size

    def store_token(self, cache: CompressedKVCache, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """The token's K/V and its page's min/max in one kernel where the kernels run
        (``kernels.sparse.write_token``), else ``index_copy_`` and ``update``."""
        if self.page_size > 1 and kernels.enabled(k, "write"):
            torch.ops.rocketkv.write_token(cache.k_cache, cache.v_cache, self.summary, k, v,
                                           slot, kernels.AUX_SUMMARY, self.page_size)
        else:
            super().store_token(cache, slot, k, v)

    def extend(self, cache: CompressedKVCache, first: int, n: int) -> None:
        """Recompute the summary of the pages that slots ``first .. first + n - 1`` touch from
        the cache's written slots of those pages: min and max are exact, so this equals ``n``
        ``update`` calls in order, in one pass instead of n."""
        if self.page_size > 1 and n > 0:  # the pages touched; slots before first are written
            P = self.page_size
            self.summarize(cache, first // P, (first + n - 1) // P + 1, first + n)

    def page_counts(self, valid: Tensor) -> Tensor:
        """Valid (written) slots per page, (pages,) int64, from ``valid`` (S,) bool."""
        return valid.view(-1, self.page_size).sum(dim=-1)

    def select_tokens(self, cache: CompressedKVCache, page_scores: Tensor,
                      counts: Tensor) -> Tensor:
        """Slots (B, H_kv, min(k, S)) of the top-k tokens of ``page_scores`` (B, H_kv, P),
        empty pages excluded (``top_pages_to_tokens``)."""
        scores = page_scores.masked_fill(counts == 0, float("-inf"))
        return top_pages_to_tokens(scores, counts, self.page_size, min(self.k, cache.length),
                                   fill=cache.length - 1)

    def summary_bytes(self, cache: CompressedKVCache, rows: int) -> int:
        """Bytes of ``rows`` summary rows for every sequence and KV head, each row whole
        32-byte sectors (for pages of one token: ``rows`` elements of every key row)."""
        B, Hkv, e = cache.batch_size, cache.n_kv_heads, cache.k_cache.element_size()
        if self.page_size == 1:
            return B * Hkv * cache.length * strided_bytes(rows, cache.head_dim, e)
        return B * Hkv * rows * sector_bytes(self.n_pages(cache) * e)
