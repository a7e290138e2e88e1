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

from kv_cache import CompressedKVCache, Selector, attend, attend_selected, gather_tokens


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


def page_bounds(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest page bounds summed over each query group.

    q: (B, H, 1, D); kmin, kmax: (B, H_kv, P, D). Returns (B, H_kv, P) float32 with
    sum_i max(q_i kmax_i, q_i kmin_i) per query head, summed over the group: an upper bound of
    the group-summed q . k for every key k in the page.
    """
    B, H, _, D = q.shape
    Hkv = kmin.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, 1, D).float()  # (B, H_kv, G, 1, D)
    bound = torch.maximum(qg * kmax[:, :, None].float(), qg * kmin[:, :, None].float())
    return bound.sum(dim=-1).sum(dim=2)  # (B, H_kv, P)


def top_r_dims(q: Tensor, n_kv_heads: int, r: int) -> Tensor:
    """Indices (B, H_kv, r) of the r largest dims of |q| summed over each query group."""
    return group_sum(q[:, :, 0].abs().float(), n_kv_heads).topk(r, dim=-1).indices


def sparq_temperature(q: Tensor, dims: Tensor) -> Tensor:
    """SparQ's softmax scale denominator sqrt(d * sum|q_r| / sum|q|), (B, H_kv, G, 1).

    q: (B, H, 1, D); dims: (B, H_kv, r)."""
    B, H, _, D = q.shape
    Hkv = dims.shape[1]
    qa = q.reshape(B, Hkv, H // Hkv, D).abs().float()
    q_r = qa.gather(-1, dims[:, :, None].expand(-1, -1, H // Hkv, -1))
    return torch.sqrt(D * q_r.sum(-1, keepdim=True) / qa.sum(-1, keepdim=True))


def sparq_scores(q: Tensor, k: Tensor, dims: Tensor, valid: Tensor) -> Tensor:
    """SparQ approximate attention per query head.

    q: (B, H, 1, D); k: (B, H_kv, S, D); dims: (B, H_kv, r); valid: (S,).
    Returns (B, H_kv, G, S) float32 probabilities softmax(q_r . K_r / temperature).
    """
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, D)
    q_r = qg.gather(-1, dims[:, :, None].expand(-1, -1, G, -1))  # (B, H_kv, G, r)
    k_r = k.gather(-1, dims[:, :, None, :].expand(-1, -1, k.shape[2], -1))  # (B, H_kv, S, r)
    s = torch.matmul(q_r, k_r.transpose(-1, -2)).float() / sparq_temperature(q, dims)
    return s.masked_fill(~valid, float("-inf")).softmax(dim=-1)


def hybrid_page_scores(q: Tensor, kmin: Tensor, kmax: Tensor, dims: Tensor,
                       counts: Tensor) -> Tensor:
    """Hybrid attention (RocketKV Alg. 2, steps 2-3) token probabilities per page, group-summed.

    Args:
        q: (B, H, 1, D) queries.
        kmin, kmax: (B, H_kv, P, D) element-wise min and max keys of each page.
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
        group. Pages without a valid token get 0.
    """
    B, H, _, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G, D)
    sign = qg.float().sum(dim=2).gather(-1, dims) >= 0  # (B, H_kv, r)
    idx = dims[:, :, None, :].expand(-1, -1, P, -1)
    chosen = torch.where(sign[:, :, None, :], kmax.gather(-1, idx), kmin.gather(-1, idx))
    q_r = qg.gather(-1, dims[:, :, None].expand(-1, -1, G, -1))  # (B, H_kv, G, r)
    s = torch.matmul(q_r, chosen.transpose(-1, -2)).float() / sparq_temperature(q, dims)
    # log-normalizer over tokens: log sum_p n_p exp(s_p); log(0) = -inf drops empty pages
    lse = torch.logsumexp(s + counts.float().log(), dim=-1, keepdim=True)  # (B, H_kv, G, 1)
    return torch.exp(s - lse).masked_fill(counts == 0, 0.0).sum(dim=2)


def page_to_tokens(page_scores: Tensor, page_size: int, valid: Tensor) -> Tensor:
    """Copy each page's score to its slots: (B, H_kv, P) -> (B, H_kv, P * page_size) float32,
    -inf at slots not marked ``valid`` (S,) bool, for a token-level top-k."""
    scores = page_scores.repeat_interleave(page_size, dim=-1)
    return scores.masked_fill(~valid, float("-inf"))


def newest_page(valid: Tensor, page_size: int) -> Tensor:
    """(S,) bool: the valid slots of the page holding the last valid slot of ``valid`` (S,)
    bool (a prefix of True), computed on the device (no host sync)."""
    slots = torch.arange(valid.shape[0], device=valid.device)
    last = torch.div(valid.sum() - 1, page_size, rounding_mode="floor")
    return valid & (torch.div(slots, page_size, rounding_mode="floor") == last)


# --------------------------------------------------------------------------------------------
# Selectors


class ExactTopK(Selector):
    """Oracle: exact group-summed attention weights, top-k tokens, exact attention over them."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        scores = exact_scores(q, cache.k_cache, valid)
        idx = scores.topk(min(self.k, cache.length), dim=-1).indices
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # physically: every key for the exact scores, then k values (keys re-read from cache)
        return cache.kv_bytes(cache.capacity) // 2 + cache.kv_bytes(self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "exact_topk", "k": self.k,
                "note": "oracle: its exact scoring is not counted in the budget"}


class PagedSelector(Selector):
    """A selector that keeps element-wise min/max keys per page of ``page_size`` slots."""

    def __init__(self, page_size: int):
        super().__init__()
        self.page_size = page_size

    def allocate(self, cache: CompressedKVCache) -> None:
        if self.page_size == 1:  # a one-token page's min and max are the key itself
            return
        B, Hkv, S, D = cache.k_cache.shape
        shape = (B, Hkv, S // self.page_size, D)
        self.register_buffer("kmin", torch.zeros(shape, dtype=cache.dtype, device=cache.device),
                             persistent=False)
        self.register_buffer("kmax", torch.zeros(shape, dtype=cache.dtype, device=cache.device),
                             persistent=False)

    def bounds(self, cache: CompressedKVCache) -> tuple[Tensor, Tensor]:
        """Element-wise (min, max) keys per page, each (B, H_kv, pages, D)."""
        if self.page_size == 1:
            return cache.k_cache, cache.k_cache
        return self.kmin, self.kmax

    def n_pages(self, cache: CompressedKVCache) -> int:
        return cache.length // self.page_size

    def build(self, cache: CompressedKVCache) -> None:
        if self.page_size == 1:
            return
        B, Hkv, S, D = cache.k_cache.shape
        pages = cache.k_cache.view(B, Hkv, S // self.page_size, self.page_size, D)
        written = (torch.arange(S, device=cache.device) < cache.kept).view(-1, self.page_size)
        w = written[None, None, :, :, None]
        kmin = pages.masked_fill(~w, float("inf")).amin(dim=3)
        kmax = pages.masked_fill(~w, float("-inf")).amax(dim=3)
        empty = ~written.any(dim=-1)[None, None, :, None]  # pages no token reached yet
        self.kmin.copy_(kmin.masked_fill(empty, 0))
        self.kmax.copy_(kmax.masked_fill(empty, 0))

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        if self.page_size == 1:
            return
        page = torch.div(slot, self.page_size, rounding_mode="floor")  # (1,)
        first = (slot % self.page_size) == 0  # a new page starts with this token
        old_min, old_max = self.kmin.index_select(2, page), self.kmax.index_select(2, page)
        self.kmin.index_copy_(2, page, torch.where(first, k, torch.minimum(old_min, k)))
        self.kmax.index_copy_(2, page, torch.where(first, k, torch.maximum(old_max, k)))

    def page_counts(self, valid: Tensor) -> Tensor:
        """Valid (written) slots per page, (pages,) int64, from ``valid`` (S,) bool."""
        return valid.view(-1, self.page_size).sum(dim=-1)


class Quest(PagedSelector):
    """Quest with group-accumulated page bounds and a token-level top-k of ``k`` tokens.

    Each page's bound (``page_bounds``) is copied to its valid slots (invalid slots -inf) and
    the ``k`` best tokens are attended exactly, so k need not be a multiple of the page size
    (k = t // 2 may be less than one page).
    """

    def __init__(self, page_size: int, k: int):
        super().__init__(page_size)
        self.k = k

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64 of the top page-constant bounds; the
        newest page (the one holding the token being decoded) is always read, within k."""
        scores = page_to_tokens(page_bounds(q, *self.bounds(cache)), self.page_size, valid)
        scores = scores.masked_fill(newest_page(valid, self.page_size), float("inf"))
        return scores.topk(min(self.k, cache.length), dim=-1).indices

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        idx = self.select(cache, q, valid)
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # min and max of every page (one key+value pair's worth each), then k pairs
        return cache.kv_bytes(self.n_pages(cache) + self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "quest", "page_size": self.page_size, "k": self.k}


class SparQ(Selector):
    """SparQ with group-summed |q| dims and group-summed approximate scores."""

    def __init__(self, r: int, k: int, reallocate: bool = False):
        super().__init__()
        self.r, self.k, self.reallocate = r, k, reallocate

    def allocate(self, cache: CompressedKVCache) -> None:
        if self.reallocate:
            B, Hkv, _, D = cache.k_cache.shape
            self.register_buffer("v_mean", torch.zeros(B, Hkv, 1, D, dtype=torch.float32,
                                                       device=cache.device), persistent=False)

    def build(self, cache: CompressedKVCache) -> None:
        if self.reallocate:
            self.v_mean.copy_(cache.v_cache[:, :, :cache.kept].float().mean(dim=2, keepdim=True))

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        if self.reallocate:  # running mean over slots 0..slot
            v = cache.v_cache.index_select(2, slot).float()
            self.v_mean.add_((v - self.v_mean) / (slot + 1).float())

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        dims = top_r_dims(q, cache.n_kv_heads, self.r)
        probs = sparq_scores(q, cache.k_cache, dims, valid)  # (B, H_kv, G, S)
        scores = probs.sum(dim=2).masked_fill(~valid, float("-inf"))
        idx = scores.topk(min(self.k, cache.length), dim=-1).indices
        y = attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)  # (B, H, 1, D)
        if not self.reallocate:
            return y
        B, H = q.shape[:2]
        G = H // cache.n_kv_heads
        alpha = probs.gather(-1, idx[:, :, None].expand(-1, -1, G, -1)).sum(-1)  # (B,Hkv,G)
        alpha = alpha.reshape(B, H, 1, 1)
        v_mean = self.v_mean.repeat_interleave(G, dim=1)  # (B, H, 1, D), tiny
        return (alpha * y.float() + (1 - alpha) * v_mean).to(y.dtype)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # r of d key elements per slot, then k pairs (+ the mean value vector)
        approx = cache.kv_bytes(cache.capacity) * self.r // (2 * cache.head_dim)
        mean = self.v_mean.numel() * self.v_mean.element_size() if self.reallocate else 0
        return approx + cache.kv_bytes(self.k) + mean

    def params(self) -> dict[str, Any]:
        return {"selection": "sparq", "r": self.r, "k": self.k, "reallocate": self.reallocate}


class Hybrid(PagedSelector):
    """Hybrid attention (RocketKV Alg. 2): paged min/max keys read at the top-r query dims."""

    def __init__(self, page_size: int, r: int, k: int):
        super().__init__(page_size)
        self.r, self.k = r, k

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64: top-k of the page-constant token scores
        (``hybrid_page_scores`` copied to each valid slot, -inf elsewhere)."""
        dims = top_r_dims(q, cache.n_kv_heads, self.r)
        pages = hybrid_page_scores(q, *self.bounds(cache), dims, self.page_counts(valid))
        scores = page_to_tokens(pages, self.page_size, valid)  # (B, H_kv, S)
        return scores.topk(min(self.k, cache.length), dim=-1).indices

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        idx = self.select(cache, q, valid)
        return attend_selected(q, cache.k_cache, cache.v_cache, idx, valid)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # r elements (min or max by sign) per page, then k pairs
        approx = cache.kv_bytes(self.n_pages(cache)) * self.r // (2 * cache.head_dim)
        return approx + cache.kv_bytes(self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "hybrid", "page_size": self.page_size, "r": self.r, "k": self.k}


__all__ = ["ExactTopK", "Quest", "SparQ", "Hybrid", "exact_scores", "page_bounds",
           "sparq_scores", "hybrid_page_scores", "page_to_tokens", "top_r_dims",
           "gather_tokens", "attend"]
