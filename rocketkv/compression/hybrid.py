"""Hybrid sparse attention (RocketKV Sec. 3.4, Alg. 2) on the full cache.

Page min/max keys (sequence-dim reduction) are read only at the top-r dims of the group-summed
|q| (head-dim reduction), picking max where the group-summed q is >= 0 and min where it is < 0.
As in the released code, each page's score is copied to every valid token of the page,
softmaxed over tokens per query head with SparQ's temperature, summed over the group, and a
token-level top-k is taken on the page-constant scores: a page weighs in the softmax once per
valid token (a page-level softmax for full pages; a partial last page counts only its written
tokens). RocketKV (``compression/rocketkv.py``) runs the same selection after SnapKV++.

Token budget t (``hybrid_split``, released-code split): c = C / t, page_size = min(floor(c),
ceil(sqrt(c))), r = round(d page_size / c) clamped to [1, d], k = t // 2; traffic
ceil(C / page_size) r / (2 d) + k key+value pairs (rounding may overshoot slightly; reported as
``budget_overshoot``). The released code takes C = prompt + new tokens, so its answer depends on
how many tokens are asked for; here C is the cache's length at the decode step, rounded up to a
multiple of 64 (``decode_horizon``): the page size is fixed when decoding starts (the cache's
layout, from the first length above t), r follows the cache as the answer grows
(``hybrid_at``), and while the whole cache fits the budget (C <= t) attention is dense.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import CompressedKVCache, Selector, gather_tokens, token_bytes
from rocketkv.compression.registry import (
    INTERNAL,
    BudgetError,
    CompressedMethod,
    Params,
    decode_horizon,
    register,
)
from rocketkv.compression.selection import PagedSelector, query_dims, sparq_temperature, top_r_dims


@dataclass(frozen=True, kw_only=True)
class HybridSplit:
    """Hybrid attention's parameters (``hybrid_split``), mixed into ``HybridParams`` and
    RocketKV's.

    Attributes:
        c2: the ratio it compresses (cached + new tokens over t); page_size: slots per page;
        r: head dims scored; k: tokens attended; dense: c2 <= 1, dense attention over the cache
        (internal); traffic_tokens: KV pairs read per step per layer per KV group.
    """

    c2: float
    page_size: int
    r: int
    k: int
    dense: bool = field(metadata=INTERNAL)
    traffic_tokens: float


def hybrid_split(capacity: int, t: int, head_dim: int) -> HybridSplit:
    """Stage-2 (hybrid attention) parameters, released-code split (RocketKV Sec. 3.4, App. A.3).

    c = capacity / t; page_size = min(floor(c), ceil(sqrt(c))) (at least 1); r = round(d *
    page_size / c) clamped to [1, d]; k = t // 2. c <= 1 means dense attention over the cache.
    Traffic (KV pairs) = ceil(capacity / page_size) * r / (2 d) + k.

    Raises:
        BudgetError: k = t // 2 < 1 (no valid setting).
    """
    c = capacity / t
    if c <= 1:
        return HybridSplit(c2=c, page_size=1, r=head_dim, k=capacity, dense=True,
                           traffic_tokens=float(capacity))
    if t // 2 < 1:
        raise BudgetError("k = t // 2 rounds to zero")
    page = max(1, min(math.floor(c), math.ceil(math.sqrt(c))))
    r = min(head_dim, max(1, round(head_dim * page / c)))
    k = t // 2
    traffic = math.ceil(capacity / page) * r / (2 * head_dim) + k
    return HybridSplit(c2=c, page_size=page, r=r, k=k, dense=False, traffic_tokens=traffic)


def hybrid_at(layout: HybridSplit, length: int, t: int, head_dim: int
              ) -> tuple[HybridSplit, int]:
    """Stage-2 parameters of a decode step whose cache holds ``length`` tokens, and the largest
    length they serve.

    ``layout``'s page size is kept (the cache's pages); the rest is ``hybrid_split``'s rule for
    C = ``decode_horizon(length)``: r = round(d page_size t / C) clamped to [1, d] (the released
    r = round(d page_size / c), c = C / t), k = t // 2, so the traffic stays at t until the cache
    outgrows C. ``length <= t``: dense attention over the whole cache (at most t pairs, c2
    reported as 1), serving lengths up to t.
    """
    if length <= t:
        return dataclasses.replace(layout, c2=1.0, r=head_dim, dense=True,
                                   traffic_tokens=float(t)), t
    horizon = decode_horizon(length)
    page, k = layout.page_size, layout.k
    r = min(head_dim, max(1, round(head_dim * page * t / horizon)))
    traffic = math.ceil(horizon / page) * r / (2 * head_dim) + k
    return HybridSplit(c2=horizon / t, page_size=page, r=r, k=k, dense=False,
                       traffic_tokens=traffic), horizon


def hybrid_start(kept: int, t: int, head_dim: int) -> HybridSplit:
    """Stage-2 parameters of the first decode step over ``kept`` cached prompt tokens: the page
    size from ``hybrid_split`` at the first cache length that needs compressing (the larger of
    the first step's kept + 1 and t + 1, rounded by ``decode_horizon``), then ``hybrid_at``.

    Raises:
        BudgetError: k = t // 2 < 1.
    """
    layout = hybrid_split(decode_horizon(max(kept + 1, t + 1)), t, head_dim)
    return hybrid_at(layout, kept + 1, t, head_dim)[0]


def split_fields(split: HybridSplit) -> dict[str, Any]:
    """``split``'s fields as keyword arguments of a ``Params`` that mixes in ``HybridSplit``."""
    return {f.name: getattr(split, f.name) for f in dataclasses.fields(split)}


@dataclass(frozen=True, kw_only=True)
class HybridParams(HybridSplit, Params):
    """Hybrid attention at budget t on the full cache (``hybrid_split``)."""


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


class HybridSelector(PagedSelector):
    """Hybrid attention (RocketKV Alg. 2): paged min/max keys read at the top-r query dims;
    the fused kernels score the same (``kernel_mode`` "softmax", r head dims)."""

    kernel_mode = "softmax"

    def __init__(self, page_size: int, r: int, k: int):
        super().__init__(page_size, k)
        self.r = r

    def kernel_r(self, cache: CompressedKVCache) -> int:
        return self.r

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64: top-k of the page-constant token scores
        (``hybrid_page_scores`` of each page standing for its valid slots), page-first."""
        dims = top_r_dims(q, cache.n_kv_heads, self.r)
        counts = self.page_counts(valid)
        return self.select_tokens(cache, hybrid_page_scores(q, self.rows(cache), dims, counts),
                                  counts)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # r summary rows (the min or the max one of each chosen dim), then k pairs
        return self.summary_bytes(cache, self.r) + token_bytes(cache, self.k)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        # r elements (min or max by sign) per page, then k pairs
        pages = -(-self.span(cache) // self.page_size)
        approx = cache.kv_bytes(pages) * self.r // (2 * cache.head_dim)
        return approx + cache.kv_bytes(self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "hybrid", "page_size": self.page_size, "r": self.r, "k": self.k}


def hybrid_params_at(params: Params, length: int, args) -> tuple[Params, int]:
    """``Method.at_length`` of the methods whose ``params`` mix in ``HybridSplit`` (hybrid,
    RocketKV): ``hybrid_at`` with the run's page size."""
    split, holds = hybrid_at(params, length, params.budget, args.head_dim)
    return params.replace(**split_fields(split)), holds


def hybrid_selector(params: HybridSplit) -> Selector:
    """``HybridSelector`` for ``hybrid_split``'s parameters, or dense attention when they say
    so."""
    if params.dense:
        return Selector()
    return HybridSelector(params.page_size, params.r, params.k)


@register
class HybridMethod(CompressedMethod):
    name = "hybrid"
    description = "hybrid attention (RocketKV Alg. 2) on the full cache (t/2 + t/2)"
    budget_rule = ("c = C / t (C: the cache's length, rounded up to 64 tokens); page = "
                   "min(floor c, ceil sqrt c) when decoding starts, r = round(d page / c) "
                   "clamped to [1, d] as the cache grows, k = t // 2; dense while C <= t")
    source = "RocketKV Sec. 3.4, Alg. 2, App. A.3"

    def derive(self, budget, prompt_len, args, options):
        split = hybrid_start(prompt_len, budget, args.head_dim)
        return HybridParams(budget=budget, compression_ratio=prompt_len / budget,
                            **split_fields(split))

    def at_length(self, params, length, args):
        return hybrid_params_at(params, length, args)

    def selector(self, params):
        return hybrid_selector(params)
