"""SparQ (Ribar et al. 2024): top-r query dims approximate the scores, top-k exact attention.

The r largest dims of the group-summed |q| index r rows of the keys; the approximate scores
q[r] . K[:, r] are softmaxed per query head with temperature sqrt(d * sum|q_r| / sum|q|) and
summed over the group; the k best tokens are attended exactly. Optional mean-value reallocation
(``--sparq-reallocate``): alpha y + (1 - alpha) mean V, alpha the selected probability mass.

Token budget t (RocketKV Sec. 3.5): k = t // 2 and r = floor(t d / C) clamped to [1, d] (d =
head_dim; C = the cache's length at the decode step rounded up to a multiple of 64,
``decode_horizon``, never the number of tokens asked for, so r follows the answer as it
grows: ``sparq_at``); traffic C r / (2 d) + k key+value pairs, within t whenever t d / C >= 1;
below that r = 1 overshoots (reported as ``budget_overshoot``); dense while C <= t. K is also stored
dim-major (storage 1.5x the full cache; Table 1 counts 2) unless ``--sparq-strided-keys``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rocketkv import kernels
from rocketkv.cache import (
    CompressedKVCache,
    Selector,
    attend_selected,
    gather_tokens,
    sector_bytes,
    strided_bytes,
    token_bytes,
)
from rocketkv.compression.registry import (
    INTERNAL,
    BudgetError,
    CompressedMethod,
    Option,
    Params,
    decode_horizon,
    register,
)
from rocketkv.compression.selection import TopKSelector, query_dims, sparq_temperature, top_r_dims

REALLOCATE = Option("sparq_reallocate", "sparq: mix in the mean value by the unselected "
                    "probability mass", type=None)
STRIDED_KEYS = Option("sparq_strided_keys", "sparq: no dim-major copy of K (storage 1x instead "
                      "of 1.5x the full cache); the r dims are then a strided read of every key "
                      "row", type=None)


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


class SparQSelector(TopKSelector):
    """SparQ with group-summed |q| dims and group-summed approximate scores.

    With ``dim_major`` (the default, as the paper's Table 1 counts SparQ: storage 2) a
    transposed copy of the keys, ``k_dims`` (B, H_kv, D, S), makes the r chosen dims r
    contiguous rows; without it they are gathered from every key row (a strided read that
    touches min(r, D e / 32) 32-byte sectors of each row, e bytes per element). The fused
    kernels score the same (``kernel_mode`` "softmax", r head dims, from ``k_dims`` or K^T).
    """

    def __init__(self, r: int, k: int, reallocate: bool = False, dim_major: bool = True):
        super().__init__(k)
        self.r, self.reallocate, self.dim_major = r, reallocate, dim_major

    def kernel_r(self, cache: CompressedKVCache) -> int:
        return self.r

    def kernel_rows(self, cache: CompressedKVCache) -> Tensor | None:
        return self.k_dims if self.dim_major else None

    def kernel_v_mean(self) -> Tensor | None:
        return self.v_mean if self.reallocate else None

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

    def token_aux(self, cache: CompressedKVCache) -> tuple[Tensor, int, int] | None:
        """The dim-major key copy's column, written with the token (None with ``reallocate``
        where the selection does not run fused: the running mean of values is then
        ``update``'s; fused, the attention kernel updates it)."""
        if self.reallocate and not self.fused(cache, cache.k_cache):
            return None
        if self.dim_major:
            return self.k_dims, kernels.AUX_DIM_MAJOR, 1
        return kernels.no_aux(cache.k_cache)

    def store_token(self, cache: CompressedKVCache, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """K/V and the dim-major key column in one kernel where the selection runs fused (the
        running mean of values, with ``reallocate``, is then the attention kernel's), else
        ``index_copy_`` and ``update``."""
        if self.fused(cache, k):
            aux, kind, _ = self.token_aux(cache)
            torch.ops.rocketkv.write_token(cache.k_cache, cache.v_cache, aux, k, v, slot, kind,
                                           1)
        else:
            super().store_token(cache, slot, k, v)

    def _probs_and_slots(self, cache: CompressedKVCache, q: Tensor,
                         valid: Tensor) -> tuple[Tensor, Tensor]:
        """The approximate probabilities (B, H_kv, G, S) float32 (``sparq_scores``) and the
        slots (B, H_kv, min(k, S)) int64 (unsorted) of their top group sums."""
        keys = self.k_dims if self.dim_major else cache.k_cache
        dims = top_r_dims(q, cache.n_kv_heads, self.r)
        probs = sparq_scores(q, keys, dims, valid, self.dim_major)  # (B, H_kv, G, S)
        scores = probs.sum(dim=2).masked_fill(~valid, float("-inf"))
        return probs, scores.topk(min(self.k, cache.length), dim=-1, sorted=False).indices

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Token indices (B, H_kv, min(k, S)) int64 (unsorted) of the top approximate
        scores."""
        return self._probs_and_slots(cache, q, valid)[1]

    def attend_valid(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Exact attention over the selected slots, with ``reallocate`` mixed with the mean
        value by the selected approximate probability mass alpha: alpha y + (1 - alpha)
        mean V."""
        probs, idx = self._probs_and_slots(cache, q, valid)
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
        approx = cache.kv_bytes(self.span(cache)) * self.r // (2 * cache.head_dim)
        return approx + cache.kv_bytes(self.k) + self._mean_bytes()

    def params(self) -> dict[str, Any]:
        return {"selection": "sparq", "r": self.r, "k": self.k, "reallocate": self.reallocate,
                "dim_major_keys": self.dim_major}


@dataclass(frozen=True, kw_only=True)
class SparQParams(Params):
    """SparQ at budget t: ``k`` tokens attended, ``r`` query dims scored, mean-value
    ``reallocate``, the ``dim_major`` key copy."""

    k: int
    r: int
    reallocate: bool
    dim_major: bool
    dense: bool = field(metadata=INTERNAL)


def sparq_at(params: SparQParams, length: int, head_dim: int) -> tuple[SparQParams, int]:
    """SparQ's parameters for a decode step whose cache holds ``length`` tokens, and the
    largest length they serve: dense up to t (the whole cache, at most t pairs); then
    r = floor(t d / C) clamped to [1, d] for
    C = ``decode_horizon(length)`` (r C <= t d: within budget while r >= 1), k = t // 2."""
    t, d = params.budget, head_dim
    if length <= t:
        return params.replace(r=d, dense=True, traffic_tokens=float(t)), t
    horizon = decode_horizon(length)
    r = min(d, max(1, t * d // horizon))
    return params.replace(r=r, dense=False,
                          traffic_tokens=horizon * r / (2 * d) + params.k), horizon


@register
class SparQMethod(CompressedMethod):
    name = "sparq"
    description = "SparQ: top-r query dims approximate scores, top-k exact attention (t/2 + t/2)"
    budget_rule = ("C: the cache's length, rounded up to 64 tokens; k = t // 2, r = floor(t d / "
                   "C) clamped to [1, d] as the cache grows; traffic C r / (2 d) + k (r = 1 "
                   "may overshoot: reported); dense while C <= t")
    options = (REALLOCATE, STRIDED_KEYS)
    source = "SparQ (Ribar et al. 2024); RocketKV Sec. 3.5"

    def derive(self, budget, prompt_len, args, options):
        k = budget // 2
        if k < 1:
            raise BudgetError("k = t // 2 rounds to zero")
        params = SparQParams(budget=budget, compression_ratio=prompt_len / budget, k=k,
                             r=args.head_dim, reallocate=bool(options.get("sparq_reallocate")),
                             dim_major=not options.get("sparq_strided_keys"), dense=False,
                             traffic_tokens=0.0)
        return sparq_at(params, prompt_len + 1, args.head_dim)[0]

    def at_length(self, params, length, args):
        return sparq_at(params, length, args.head_dim)

    def selector(self, params):
        if params.dense:
            return Selector()
        return SparQSelector(params.r, params.k, params.reallocate, params.dim_major)
