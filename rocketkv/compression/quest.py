"""Quest (Tang et al. 2024): page min/max key bounds rank the tokens, exact attention over k.

Pages of ``page_size`` slots keep element-wise min/max keys; a page's bound for query q is
sum_i max(q_i max_i, q_i min_i), summed over the group. Each page's bound is copied to its valid
(written) slots and a token-level top-k is taken on these page-constant scores, so any k >= 1
is possible, including k below one page (RocketKV App. A.3 reports Quest at budgets such as 256
at 96K tokens, where t/2 is far below one page).

Token budget t (RocketKV Sec. 3.5): k = t // 2 tokens attended exactly; page_size =
max(16, ceil(C / (t - k))) unless ``--page-size``, so the ceil(C / page_size) pages scored (min
and max: one key+value pair each) fit in t - k. Traffic ceil(C / page_size) + k pairs; above t
(a small ``--page-size``) it is reported as ``budget_overshoot``. C is the cache's length at
the decode step rounded up to a multiple of 64 (``decode_horizon``), never the number of tokens
asked for: the page size is fixed when decoding starts (the cache's layout, from the first
length above t), and as the answer grows k shrinks to t - ceil(C / page_size) (at most t // 2,
at least 1) so the step stays within the budget (``quest_at``); while the whole cache fits the
budget (C <= t) attention is dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import CompressedKVCache, Selector, token_bytes
from rocketkv.compression.registry import (
    INTERNAL,
    BudgetError,
    CompressedMethod,
    Option,
    Params,
    decode_horizon,
    positive,
    register,
)
from rocketkv.compression.selection import PagedSelector

PAGE_SIZE = Option("page_size", "quest page size (default max(16, tokens / (budget / 2)))",
                   check=positive)


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


class QuestSelector(PagedSelector):
    """Quest with group-accumulated page bounds and a token-level top-k of ``k`` tokens.

    Each page's bound (``page_bounds``) stands for its valid slots and the ``k`` best tokens
    are attended exactly, so k need not be a multiple of the page size (k = t // 2 may be less
    than one page); they are chosen page-first (``top_pages_to_tokens``). The fused kernels
    score the same bounds (``kernel_mode`` "bound", every head dim).
    """

    kernel_mode = "bound"

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64 of the top page-constant bounds; the
        newest page (the one holding the token being decoded) is always read, within k."""
        counts = self.page_counts(valid)
        newest = (counts > 0).sum() - 1  # the page of the last valid slot
        bounds = page_bounds(q, self.rows(cache))  # (B, H_kv, P)
        pages = torch.arange(bounds.shape[-1], device=bounds.device)
        return self.select_tokens(cache, bounds.masked_fill(pages == newest, float("inf")),
                                  counts)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # every min and max row (whole sectors), then k pairs
        return self.summary_bytes(cache, 2 * cache.head_dim) + token_bytes(cache, self.k)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        # min and max of every page (one key+value pair's worth each), then k pairs
        return cache.kv_bytes(-(-self.span(cache) // self.page_size) + self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "quest", "page_size": self.page_size, "k": self.k}


@dataclass(frozen=True, kw_only=True)
class QuestParams(Params):
    """Quest at budget t: ``k`` tokens attended, pages of ``page_size`` slots, ``pages_scored``
    page bounds read (ceil(C / page_size))."""

    k: int
    page_size: int
    pages_scored: int
    dense: bool = field(metadata=INTERNAL)


def quest_at(params: QuestParams, length: int) -> tuple[QuestParams, int]:
    """Quest's parameters for a decode step whose cache holds ``length`` tokens, and the
    largest length they serve: dense up to t (the whole cache, at most t pairs); then, for
    C = ``decode_horizon(length)``,
    ceil(C / page_size) pages scored and k = min(t // 2, t - pages) tokens (at least 1)."""
    t = params.budget
    if length <= t:
        return params.replace(k=t, pages_scored=0, dense=True, traffic_tokens=float(t)), t
    horizon = decode_horizon(length)
    pages = math.ceil(horizon / params.page_size)  # min and max keys: one KV pair's worth each
    k = max(1, min(t // 2, t - pages))
    return params.replace(k=k, pages_scored=pages, dense=False,
                          traffic_tokens=float(pages + k)), horizon


@register
class QuestMethod(CompressedMethod):
    name = "quest"
    description = "Quest: page min/max bounds rank tokens, exact attention over the top t/2"
    budget_rule = ("C: the cache's length, rounded up to 64 tokens; page max(16, ceil(C / (t - "
                   "t // 2))) when decoding starts; k = min(t // 2, t - ceil(C / page)) as the "
                   "cache grows; traffic ceil(C / page) + k; dense while C <= t")
    options = (PAGE_SIZE,)
    source = "Quest (Tang et al. 2024); RocketKV App. A.3"

    def derive(self, budget, prompt_len, args, options):
        k = budget // 2
        if k < 1:
            raise BudgetError("k = t // 2 rounds to zero")
        cap = decode_horizon(max(prompt_len + 1, budget + 1))  # the first length compressed
        page = options.get("page_size") or max(16, math.ceil(cap / max(1, budget - k)))
        params = QuestParams(budget=budget, compression_ratio=prompt_len / budget, k=k,
                             page_size=page, pages_scored=0, dense=False, traffic_tokens=0.0)
        return quest_at(params, prompt_len + 1)[0]

    def at_length(self, params, length, args):
        return quest_at(params, length)

    def selector(self, params):
        return Selector() if params.dense else QuestSelector(params.page_size, params.k)
