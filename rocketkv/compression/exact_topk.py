"""Exact-TopK: the oracle top-k on exact attention scores (RocketKV Sec. 3.1).

Each query head's exact softmax attention over the cache is summed over its query group; the
``k`` best tokens per KV head are attended exactly. Token budget t: k = t. The oracle's scoring
reads every key and is not counted in the budget (RocketKV Sec. 3.1); ``bytes_read`` counts it,
``ideal_bytes`` does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import CompressedKVCache
from rocketkv.compression.registry import CompressedMethod, Params, register
from rocketkv.compression.selection import TopKSelector


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


class ExactTopKSelector(TopKSelector):
    """Oracle: exact group-summed attention weights, top-k tokens, exact attention over them.
    Fused, the kernels score every head dim of K^T (``kernel_mode`` "softmax", r = d)."""

    def __init__(self, k: int):
        super().__init__(k)

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64 (unsorted) of the top exact scores."""
        scores = exact_scores(q, cache.k_cache, valid)
        return scores.topk(min(self.k, cache.length), dim=-1, sorted=False).indices

    def bytes_read(self, cache: CompressedKVCache) -> int:
        # physically: every key for the exact scores, then the k chosen pairs
        return cache.kv_bytes(cache.length) // 2 + cache.kv_bytes(self.k)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        return cache.kv_bytes(self.k)  # the oracle's scoring is not counted (RocketKV Sec. 3.1)

    def params(self) -> dict[str, Any]:
        return {"selection": "exact_topk", "k": self.k,
                "note": "oracle: its exact scoring is not counted in the budget"}


@dataclass(frozen=True, kw_only=True)
class ExactTopKParams(Params):
    """Exact-TopK at budget t: ``k`` = t tokens attended."""

    k: int


@register
class ExactTopKMethod(CompressedMethod):
    name = "exact_topk"
    description = "oracle top-k on exact attention scores (k = t), exact attention over them"
    budget_rule = "k = t (its exact scoring is not counted, as in the paper)"
    source = "RocketKV Sec. 3.1"

    def derive(self, budget, prompt_len, args, options):
        return ExactTopKParams(budget=budget, compression_ratio=prompt_len / budget, k=budget)

    def selector(self, params):
        return ExactTopKSelector(params.k)
