"""Quest (Tang et al. 2024): page min/max key bounds rank the tokens, exact attention over k.

Pages of ``page_size`` slots keep element-wise min/max keys; a page's bound for query q is
sum_i max(q_i max_i, q_i min_i), summed over the group. Each page's bound is copied to its valid
(written) slots and a token-level top-k is taken on these page-constant scores, so any k >= 1
is possible, including k below one page (RocketKV App. A.3 reports Quest at budgets such as 256
at 96K tokens, where t/2 is far below one page).

Token budget t (RocketKV Sec. 3.5): k = t // 2 tokens attended exactly; page_size =
max(16, ceil(C / (t - k))) unless ``--page-size`` (C = prompt + new tokens), so the
ceil(C / page_size) pages scored (min and max: one key+value pair each) fit in t - k. Traffic
ceil(C / page_size) + k pairs; above t (a small ``--page-size``) it is reported as
``budget_overshoot``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import CompressedKVCache, token_bytes
from rocketkv.compression.registry import (
    BudgetError,
    CompressedMethod,
    Option,
    Params,
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
        return cache.kv_bytes(self.n_pages(cache) + self.k)

    def params(self) -> dict[str, Any]:
        return {"selection": "quest", "page_size": self.page_size, "k": self.k}


@dataclass(frozen=True, kw_only=True)
class QuestParams(Params):
    """Quest at budget t: ``k`` tokens attended, pages of ``page_size`` slots, ``pages_scored``
    page bounds read (ceil(C / page_size))."""

    k: int
    page_size: int
    pages_scored: int


@register
class QuestMethod(CompressedMethod):
    name = "quest"
    description = "Quest: page min/max bounds rank tokens, exact attention over the top t/2"
    budget_rule = ("k = t // 2; page max(16, ceil((T + m) / (t - k))); traffic ceil((T + m) / "
                   "page) + k")
    options = (PAGE_SIZE,)
    source = "Quest (Tang et al. 2024); RocketKV App. A.3"

    def derive(self, budget, prompt_len, new_tokens, args, options):
        k = budget // 2
        if k < 1:
            raise BudgetError("k = t // 2 rounds to zero")
        cap = prompt_len + new_tokens
        page = options.get("page_size") or max(16, math.ceil(cap / max(1, budget - k)))
        pages = math.ceil(cap / page)  # min and max keys: one KV pair's worth each
        return QuestParams(budget=budget, compression_ratio=prompt_len / budget, k=k,
                           page_size=page, pages_scored=pages, traffic_tokens=float(pages + k))

    def selector(self, params):
        return QuestSelector(params.page_size, params.k)
