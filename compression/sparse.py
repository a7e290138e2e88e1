"""Decode-time top-k selection: Exact-TopK, Quest, SparQ and hybrid attention.

Every method here picks ``k`` tokens per KV head (shared by the query group: GQA-aware as in the
RocketKV paper, App. A.3) and runs exact attention over them. They differ in how they score:

* Exact-TopK (oracle): exact softmax attention of each query head over the cache, summed over
  the group; k = t (its scoring cost is not counted in the budget, RocketKV Sec. 3.1).
* Quest (Tang et al. 2024): pages of ``page_size`` slots keep element-wise min/max keys; a page's
  bound for query q is sum_i max(q_i max_i, q_i min_i), summed over the group. Each page's bound
  is copied to its valid (written) slots and a token-level top-k is taken on these page-constant
  scores, so any k >= 1 is possible, including k below one page (RocketKV App. A.3 reports Quest
  at budgets such as 256 at 96K tokens, where t/2 is far below one page).
* SparQ (Ribar et al. 2024): top-r dims of the group-summed |q|; approximate scores q[r] . K[:, r]
  softmaxed per head with temperature sqrt(d * sum|q_r| / sum|q|), summed over the group; optional
  mean-value reallocation (alpha y + (1 - alpha) mean V, alpha the selected probability mass).
* Hybrid (RocketKV Sec. 3.4, Alg. 2): page min/max keys (sequence-dim reduction) read only at the
  top-r dims of the group-summed |q| (head-dim reduction), picking max where the group-summed q
  is >= 0 and min where it is < 0. As in the released code, each page's score is copied to every
  valid token of the page, softmaxed over tokens per query head with SparQ's temperature, summed
  over the group, and a token-level top-k is taken on the page-constant scores: a page weighs in
  the softmax once per valid token (a page-level softmax for full pages; a partial last page
  counts only its written tokens).

Token budget t (RocketKV Sec. 3.5): Quest, SparQ and hybrid spend t/2 on approximate scoring
and k = t // 2 on exact attention. A key+value pair is 2 d elements; with capacity C = cached
prompt tokens + max_new_tokens, traffic per step per KV group in pairs is:

* Quest: ceil(C / page_size) pages (min and max: one pair each) + k, with page_size =
  max(16, ceil(C / (t - k))) unless given, so ceil(C / page_size) <= t - k.
* SparQ: C r / (2 d) + k with r = floor(t d / C) clamped to [1, d]: within t whenever
  t d / C >= 1; below that r = 1 overshoots (reported as ``budget_overshoot``).
* Hybrid: ceil(C / page_size) r / (2 d) + k, c = C / t split as in the released code:
  page_size = min(floor(c), ceil(sqrt(c))), r = round(d * page_size / c) clamped to [1, d]
  (rounding may overshoot slightly; reported as ``budget_overshoot``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kv_cache import (
    CompressedKVCache,
    Selector,
    attend,
    attend_selected,
    gather_tokens,
    sector_bytes,
    strided_bytes,
    token_bytes,
)


def group_sum(x: Tensor, n_kv_heads: int) -> Tensor:
    """Sum (B, H, ...) over the query heads of each group -> (B, H_kv, ...)."""
    B, H = x.shape[:2]
    return x.view(B, n_kv_heads, H // n_kv_heads, *x.shape[2:]).sum(dim=2)


def exact_scores(q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
    """Group-summed exact attention weights.

    q: (B, H, 1, D); k: (B, H_kv, S, D); valid: (S,) bool. Returns (B, H_kv, S) float32 with
    -inf at invalid slots.
    """
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    s = torch.matmul(q.reshape(B, Hkv, H // Hkv, D), k.transpose(-1, -2)).float() / math.sqrt(D)
    p = s.masked_fill(~valid, float("-inf")).softmax(dim=-1)  # (B, H_kv, G, S)
    return p.sum(dim=2).masked_fill(~valid, float("-inf"))


def page_summary(kmin: Tensor, kmax: Tensor) -> Tensor:
    """Page min/max keys (B, H_kv, P, D) each -> the summary layout (B, H_kv, 2 D, P): rows
    0..D-1 the max of each head dim over each page, rows D..2D-1 the min, so that one head
    dim's values over all pages are one contiguous row (RocketKV Sec. 3.4: "along the head
    dimension to enable efficient gathering")."""
    return torch.cat([kmax, kmin], dim=-1).transpose(-1, -2)


def page_bounds(q: Tensor, summary: Tensor) -> Tensor:
    """Quest page bounds summed over each query group.

    Args:
        q: (B, H, 1, D) queries.
        summary: (B, H_kv, 2 D, P) page max rows then min rows (``page_summary``), or
            (B, H_kv, D, P) when a page's max and min coincide (pages of one token: K^T).
    Returns:
        (B, H_kv, P) float32: sum over the group's query heads of sum_i max(q_i kmax_i,
        q_i kmin_i), an upper bound of the group-summed q . k for every key k in the page.
        Since kmax >= kmin, max(q_i kmax_i, q_i kmin_i) = max(q_i, 0) kmax_i + min(q_i, 0)
        kmin_i, which is linear in q: the group's queries are summed first and the bound is
        one matrix-vector product over the summary, read once.
    """
    B, H, _, D = q.shape
    Hkv = summary.shape[1]
    qs = q.reshape(B, Hkv, H // Hkv, D).float()
    if summary.shape[2] == 2 * D:
        qs = torch.cat([qs.clamp(min=0), qs.clamp(max=0)], dim=-1)  # (B, H_kv, G, 2 D)
    qs = qs.sum(dim=2, keepdim=True).to(summary.dtype)  # (B, H_kv, 1, 2 D or D)
    return torch.matmul(qs, summary).float()[:, :, 0]


def top_r_dims(q: Tensor, n_kv_heads: int, r: int) -> Tensor:
    """Indices (B, H_kv, r) of the r largest dims of |q| summed over each query group."""
    return group_sum(q[:, :, 0].abs().float(), n_kv_heads).topk(r, dim=-1, sorted=False).indices


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


def sparq_scores(q: Tensor, k: Tensor, dims: Tensor, valid: Tensor,
                 dim_major: bool = False) -> Tensor:
    """SparQ approximate attention per query head.

    Args:
        q: (B, H, 1, D); dims: (B, H_kv, r); valid: (S,) bool.
        k: the keys, (B, H_kv, S, D), or with ``dim_major`` their transposed copy
            (B, H_kv, D, S), whose r chosen dims are r contiguous rows.
    Returns:
        (B, H_kv, G, S) float32 probabilities softmax(q_r . K_r / temperature).
    """
    q_r = query_dims(q, dims)  # (B, H_kv, G, r)
    if dim_major:
        k_r = gather_tokens(k, dims)  # (B, H_kv, r, S): r whole rows
    else:  # r elements of every key row: a strided read
        k_r = k.gather(-1, dims[:, :, None, :].expand(-1, -1, k.shape[2], -1)).transpose(-1, -2)
    s = torch.matmul(q_r, k_r).float() / sparq_temperature(q, q_r)
    return s.masked_fill(~valid, float("-inf")).softmax(dim=-1)


def hybrid_page_scores(q: Tensor, summary: Tensor, dims: Tensor, counts: Tensor) -> Tensor:
    """Hybrid attention (RocketKV Alg. 2, steps 2-3) token probabilities per page, group-summed.

    Args:
        q: (B, H, 1, D) queries.
        summary: (B, H_kv, 2 D, P) page max rows then min rows (``page_summary``), or
            (B, H_kv, D, P) when max and min coincide (pages of one token: K^T).
        dims: (B, H_kv, r) int64, the top-r dims of the group-summed |q| (``top_r_dims``).
        counts: (P,) integer, valid (written) tokens of each page (0 .. page_size); a device
            tensor, so shapes stay static in the compiled decode step.
    Returns:
        (B, H_kv, P) float32: for query head g the page logit is
        s_gp = sum_{i in dims} q_gi * (kmax_pi if sum_group(q)_i >= 0 else kmin_pi) / T_g,
        T_g = sqrt(D * sum_{i in dims} |q_gi| / sum_i |q_gi|) (SparQ's temperature); every
        valid token of page p carries s_gp and the softmax runs over the valid tokens, so each
        of them gets exp(s_gp) / sum_p' counts_p' exp(s_gp') (the released code's token
        expansion, computed per page with log(counts) in the normalizer); summed over the
        group. Pages without a valid token get 0. Only the r summary rows the signs pick are
        read (one gather of r contiguous rows), not the other bound.
    """
    D = q.shape[-1]
    q_r = query_dims(q, dims)  # (B, H_kv, G, r)
    rows = dims
    if summary.shape[2] == 2 * D:  # the min row where the group-summed q is negative
        rows = dims + D * (q_r.float().sum(dim=2) < 0)
    chosen = gather_tokens(summary, rows)  # (B, H_kv, r, P): r whole rows
    s = torch.matmul(q_r, chosen).float() / sparq_temperature(q, q_r)  # (B, H_kv, G, P)
    # log-normalizer over tokens: log sum_p n_p exp(s_p); log(0) = -inf drops empty pages
    lse = torch.logsumexp(s + counts.float().log(), dim=-1, keepdim=True)  # (B, H_kv, G, 1)
    return torch.exp(s - lse).masked_fill(counts == 0, 0.0).sum(dim=2)


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


# --------------------------------------------------------------------------------------------
# Selectors


class ExactTopK(Selector):
    """Oracle: exact group-summed attention weights, top-k tokens, exact attention over them."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        scores = exact_scores(q, cache.k_cache, valid)
        idx = scores.topk(min(self.k, cache.length), dim=-1, sorted=False).indices
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # physically: every key for the exact scores, then the k chosen pairs
        return cache.kv_bytes(cache.length) // 2 + cache.kv_bytes(self.k)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        return cache.kv_bytes(self.k)  # the oracle's scoring is not counted (RocketKV Sec. 3.1)

    def params(self) -> dict[str, Any]:
        return {"selection": "exact_topk", "k": self.k,
                "note": "oracle: its exact scoring is not counted in the budget"}


class PagedSelector(Selector):
    """A selector that keeps element-wise min/max keys per page of ``page_size`` slots.

    They live in ``summary`` (B, H_kv, 2 D, pages): rows 0..D-1 the max of each head dim over
    each page, rows D..2D-1 the min (``page_summary``), so the pages' values of one head dim are
    one contiguous row: reading r dims reads r rows, not a strided r / D of every page's row.
    Pages of one token keep no summary: K^T (a strided view of the cache) stands for it.
    """

    def __init__(self, page_size: int):
        super().__init__()
        self.page_size = page_size

    def allocate(self, cache: CompressedKVCache) -> None:
        if self.page_size == 1:  # a one-token page's min and max are the key itself
            return
        B, Hkv, S, D = cache.k_cache.shape
        self.register_buffer("summary", torch.zeros(B, Hkv, 2 * D, S // self.page_size,
                                                    dtype=cache.dtype, device=cache.device),
                             persistent=False)

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


class Quest(PagedSelector):
    """Quest with group-accumulated page bounds and a token-level top-k of ``k`` tokens.

    Each page's bound (``page_bounds``) stands for its valid slots and the ``k`` best tokens
    are attended exactly, so k need not be a multiple of the page size (k = t // 2 may be less
    than one page); they are chosen page-first (``top_pages_to_tokens``).
    """

    def __init__(self, page_size: int, k: int):
        super().__init__(page_size)
        self.k = k

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64 of the top page-constant bounds; the
        newest page (the one holding the token being decoded) is always read, within k."""
        counts = self.page_counts(valid)
        newest = (counts > 0).sum() - 1  # the page of the last valid slot
        bounds = page_bounds(q, self.rows(cache))  # (B, H_kv, P)
        pages = torch.arange(bounds.shape[-1], device=bounds.device)
        return self.select_tokens(cache, bounds.masked_fill(pages == newest, float("inf")),
                                  counts)

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        idx = self.select(cache, q, valid)
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # every min and max row (whole sectors), then k pairs
        return self.summary_bytes(cache, 2 * cache.head_dim) + token_bytes(cache, self.k)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        # min and max of every page (one key+value pair's worth each), then k pairs
        return cache.kv_bytes(self.n_pages(cache) + self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "quest", "page_size": self.page_size, "k": self.k}


class SparQ(Selector):
    """SparQ with group-summed |q| dims and group-summed approximate scores.

    With ``dim_major`` (the default, as the paper's Table 1 counts SparQ: storage 2) a
    transposed copy of the keys, ``k_dims`` (B, H_kv, D, S), makes the r chosen dims r
    contiguous rows; without it they are gathered from every key row (a strided read that
    touches min(r, D e / 32) 32-byte sectors of each row, e bytes per element).
    """

    def __init__(self, r: int, k: int, reallocate: bool = False, dim_major: bool = True):
        super().__init__()
        self.r, self.k, self.reallocate, self.dim_major = r, k, reallocate, dim_major

    def allocate(self, cache: CompressedKVCache) -> None:
        B, Hkv, S, D = cache.k_cache.shape
        if self.reallocate:
            self.register_buffer("v_mean", torch.zeros(B, Hkv, 1, D, dtype=torch.float32,
                                                       device=cache.device), persistent=False)
        if self.dim_major:
            self.register_buffer("k_dims", torch.zeros(B, Hkv, D, S, dtype=cache.dtype,
                                                       device=cache.device), persistent=False)

    def build(self, cache: CompressedKVCache) -> None:
        if self.reallocate:
            self.v_mean.copy_(cache.v_cache[:, :, :cache.kept].float().mean(dim=2, keepdim=True))
        if self.dim_major:
            self.k_dims.copy_(cache.k_cache.transpose(-1, -2))

    def _add_to_mean(self, cache: CompressedKVCache, slot: Tensor) -> None:
        """The running mean of values over slots 0..slot (``slot`` (1,) int64), float32."""
        v = cache.v_cache.index_select(2, slot).float()
        self.v_mean.add_((v - self.v_mean) / (slot + 1).float())

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        if self.reallocate:
            self._add_to_mean(cache, slot)
        if self.dim_major:
            self.k_dims.index_copy_(3, slot, k.transpose(-1, -2))

    def extend(self, cache: CompressedKVCache, first: int, n: int) -> None:
        """Copy the chunk's keys into ``k_dims`` at once; the running mean of values (with
        ``reallocate``) keeps its per-slot float32 updates so it sums in the decode order."""
        if self.reallocate:
            for slot in range(first, first + n):
                self._add_to_mean(cache, torch.tensor([slot], device=cache.device))
        if self.dim_major:
            chunk = cache.k_cache[:, :, first:first + n]  # (B, H_kv, n, D)
            self.k_dims[..., first:first + n] = chunk.transpose(-1, -2)

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        dims = top_r_dims(q, cache.n_kv_heads, self.r)
        keys = self.k_dims if self.dim_major else cache.k_cache
        probs = sparq_scores(q, keys, dims, valid, self.dim_major)  # (B, H_kv, G, S)
        scores = probs.sum(dim=2).masked_fill(~valid, float("-inf"))
        idx = scores.topk(min(self.k, cache.length), dim=-1, sorted=False).indices
        y = attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)  # (B, H, 1, D)
        if not self.reallocate:
            return y
        B, H = q.shape[:2]
        G = H // cache.n_kv_heads
        alpha = probs.gather(-1, idx[:, :, None].expand(-1, -1, G, -1)).sum(-1)  # (B,Hkv,G)
        alpha = alpha.reshape(B, H, 1, 1)
        v_mean = self.v_mean.repeat_interleave(G, dim=1)  # (B, H, 1, D), tiny
        return (alpha * y.float() + (1 - alpha) * v_mean).to(y.dtype)

    def _mean_bytes(self) -> int:
        return self.v_mean.numel() * self.v_mean.element_size() if self.reallocate else 0

    def bytes_read(self, cache: CompressedKVCache) -> int:
        B, Hkv, S, D = cache.k_cache.shape
        e = cache.k_cache.element_size()
        approx = B * Hkv * (self.r * sector_bytes(S * e) if self.dim_major
                            else S * strided_bytes(self.r, D, e))
        return approx + token_bytes(cache, self.k) + self._mean_bytes()

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        # r of d key elements per slot, then k pairs (+ the mean value vector)
        approx = cache.kv_bytes(cache.capacity) * self.r // (2 * cache.head_dim)
        return approx + cache.kv_bytes(self.k) + self._mean_bytes()

    def params(self) -> dict[str, Any]:
        return {"selection": "sparq", "r": self.r, "k": self.k, "reallocate": self.reallocate,
                "dim_major_keys": self.dim_major}


class Hybrid(PagedSelector):
    """Hybrid attention (RocketKV Alg. 2): paged min/max keys read at the top-r query dims."""

    def __init__(self, page_size: int, r: int, k: int):
        super().__init__(page_size)
        self.r, self.k = r, k

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64: top-k of the page-constant token scores
        (``hybrid_page_scores`` of each page standing for its valid slots), page-first."""
        dims = top_r_dims(q, cache.n_kv_heads, self.r)
        counts = self.page_counts(valid)
        return self.select_tokens(cache, hybrid_page_scores(q, self.rows(cache), dims, counts),
                                  counts)

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        idx = self.select(cache, q, valid)
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # r summary rows (the min or the max one of each chosen dim), then k pairs
        return self.summary_bytes(cache, self.r) + token_bytes(cache, self.k)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        # r elements (min or max by sign) per page, then k pairs
        approx = cache.kv_bytes(self.n_pages(cache)) * self.r // (2 * cache.head_dim)
        return approx + cache.kv_bytes(self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "hybrid", "page_size": self.page_size, "r": self.r, "k": self.k}


__all__ = ["ExactTopK", "Quest", "SparQ", "Hybrid", "exact_scores", "page_summary",
           "page_bounds", "sparq_scores", "hybrid_page_scores",
           "top_pages_to_tokens", "top_r_dims", "gather_tokens", "attend"]
