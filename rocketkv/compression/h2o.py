"""H2O (Zhang et al. 2023): heavy hitters (accumulated attention) plus the most recent tokens.

Per KV head, ``heavy`` heavy hitters (largest accumulated attention, summed over the query heads
of the group as in the RocketKV paper's GQA baselines) and the ``recent`` latest tokens (half
and half by default). The prompt's accumulated scores are the column sums of every prompt query's
causal attention (``cache.attention_and_column_sums``: on the CPU one flash-attention pass beside
the attention's own, row blocks elsewhere, never T x T); at each decode step, when the cache is
full, the token with the lowest accumulated score outside the recent window is evicted before the
new token is written, so the step reads exactly t tokens, and the new query's attention is added to
the scores (``H2OCache``). Prefill attends to the whole uncompressed prompt (RocketKV App.
A.3).

Token budget ``t`` (RocketKV Sec. 3.5): the capacity; heavy = int(t * 0.5) (``--heavy-ratio``)
heavy hitters + recent t - heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import KVCache, attention_and_column_sums, attention_probs
from rocketkv.compression.registry import BudgetError, Method, Option, Params, register
from rocketkv.model import ConfigError, ModelArgs

H2O_HEAVY_RATIO = 0.5  # share of the budget for heavy hitters (H2O's paper: half and half)


def _ratio(value: float) -> str | None:
    return None if 0 < value < 1 else f"must lie strictly between 0 and 1, got {value}"


HEAVY_RATIO = Option("heavy_ratio", "h2o: share of the budget for heavy hitters (default 0.5)",
                     type=float, check=_ratio)


class H2OCache(KVCache):
    """Heavy hitters + recent window per KV head within a capacity of ``heavy + recent`` slots.

    Args:
        prompt_len, max_new_tokens: tokens (T, m); heavy, recent: the split of the capacity.
    Buffers: ``k_cache``/``v_cache`` (B, H_kv, C, D) in the model dtype, ``slot_pos``
    (B, H_kv, C) int64 (the position a slot holds, -1 empty) and ``scores`` (B, H_kv, C)
    float32, the attention each slot's token has accumulated (summed over the group's query
    heads), C = heavy + recent. Slots are not in position order: a decode step writes the new
    token into the slot it evicts.

    The prompt needs the column sums of every prompt query's attention, which ``store_prompt``
    cannot see: the cache keeps the prompt's K/V until ``prefill_attention`` has seen the last
    query block (each block adds its sums), then evicts; a shared prefill hands the sums over
    to ``store_recorded_prompt`` (``needs_attention_sums``).
    """

    needs_attention_sums = True

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, *, prompt_len: int, max_new_tokens: int, heavy: int, recent: int,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        if heavy < 1 or recent < 1:
            raise ValueError(f"heavy ({heavy}) and recent ({recent}) must be positive")
        self.prompt_len, self.max_len = prompt_len, prompt_len + max_new_tokens
        self.heavy, self.recent = heavy, recent
        self.capacity = heavy + recent
        self.kept = min(prompt_len, self.capacity)
        self._params = dict(params or {})
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None
        self._register_kv(self.capacity, positions=True)
        self.register_buffer("scores", torch.zeros(batch_size, args.n_kv_heads, self.capacity,
                                                   dtype=torch.float32, device=device),
                             persistent=False)

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        T = k.shape[2]
        if T != self.prompt_len:
            raise ValueError(f"cache set up for {self.prompt_len} prompt tokens, got {T}")
        self._pending = (k, v, torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device))

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        if self._pending is None:
            raise RuntimeError("H2OCache.prefill_attention before store_prompt")
        out, block_sums = attention_and_column_sums(q, k, v, start)
        end = start + q.shape[2]
        sums = self._pending[2]
        sums[..., :end] += block_sums
        if end == self.prompt_len:  # the last query block: every prompt query has voted
            pk, pv, _ = self._pending
            self._pending = None
            self.store_scored_prompt(pk, pv, sums)
        return out

    def store_recorded_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor,
                              attention_sums: Tensor | None, memo: dict) -> None:
        if attention_sums is None:
            raise ConfigError(f"{type(self).__name__} evicts on the prompt's accumulated "
                              "attention: prefill_once(..., attention_sums=True) must record it")
        self.store_scored_prompt(k, v, attention_sums)

    def store_scored_prompt(self, k: Tensor, v: Tensor, sums: Tensor) -> None:
        """Keep the prompt's heavy hitters and recent tokens.

        Args:
            k, v: (B, H_kv, T, D) the prompt's keys (rotated) and values.
            sums: (B, H_kv, T) float32, the column sums of every prompt query's causal
                attention, summed over the group (``attention_column_sums``).
        """
        T = k.shape[2]
        if T != self.prompt_len:
            raise ValueError(f"cache set up for {self.prompt_len} prompt tokens, got {T}")
        pos = torch.arange(T, device=k.device).expand(k.shape[0], k.shape[1], T)
        self._keep(k, v, pos, sums, T - 1)

    def _keep(self, k: Tensor, v: Tensor, pos: Tensor, scores: Tensor, now: int) -> None:
        """Store the candidates' recent tokens (positions > now - recent) and their heavy
        hitters (largest ``scores``) up to the capacity; ``pos`` -1 marks empty candidates."""
        priority = scores.masked_fill(pos > now - self.recent, float("inf"))
        priority = priority.masked_fill(pos < 0, -1.0)  # scores are >= 0: empty goes last
        n = min(self.capacity, pos.shape[-1])
        idx = priority.topk(n, dim=-1).indices.sort(dim=-1).values  # (B, H_kv, n)
        gathered_pos = pos.gather(-1, idx)
        self.k_cache[:, :, :n] = k.gather(2, idx[..., None].expand(-1, -1, -1, k.shape[-1]))
        self.v_cache[:, :, :n] = v.gather(2, idx[..., None].expand(-1, -1, -1, v.shape[-1]))
        self.slot_pos.fill_(-1)
        self.slot_pos[..., :n] = gathered_pos
        self.scores.zero_()
        self.scores[..., :n] = scores.gather(-1, idx).masked_fill(gathered_pos < 0, 0.0)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        B, H, Tc, D = q.shape
        end = start + Tc
        if start < self.prompt_len or end > self.max_len:
            raise ValueError(f"a chunk at positions {start}..{end - 1} does not fit the cache "
                             f"(prompt {self.prompt_len} tokens, {self.max_len} positions)")
        keys = torch.cat([self.k_cache, k], 2)
        values = torch.cat([self.v_cache, v], 2)
        chunk_pos = torch.arange(start, end, device=k.device)
        pos = torch.cat([self.slot_pos, chunk_pos.expand(B, self.n_kv_heads, Tc)], -1)
        visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= chunk_pos[:, None])
        G = H // self.n_kv_heads
        mask = visible[:, :, None].expand(-1, -1, G, -1, -1).flatten(2, 3)  # rows (g, t)
        probs = attention_probs(q, keys, mask)  # (B, H_kv, G*Tc, S)
        out = torch.matmul(probs.to(values.dtype), values)  # (B, H_kv, G*Tc, D)
        scores = torch.cat([self.scores, self.scores.new_zeros(B, self.n_kv_heads, Tc)], -1)
        self._keep(keys, values, pos, scores + probs.sum(dim=2), end - 1)
        return out.reshape(B, H, Tc, D)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        B, H, _, D = q.shape
        Hkv = self.n_kv_heads
        # the slot to write: an empty one, else the lowest score outside the recent window
        evictable = self.slot_pos <= input_pos - self.recent
        key = torch.where(self.slot_pos < 0, float("-inf"),
                          torch.where(evictable, self.scores, float("inf")))
        slot = key.argmin(dim=-1, keepdim=True)  # (B, H_kv, 1)
        self.k_cache.scatter_(2, slot[..., None].expand(-1, -1, -1, D), k)
        self.v_cache.scatter_(2, slot[..., None].expand(-1, -1, -1, D), v)
        self.slot_pos.scatter_(2, slot, input_pos.expand(B, Hkv, 1))
        self.scores.scatter_(2, slot, torch.zeros_like(slot, dtype=self.scores.dtype))
        valid = self.slot_pos >= 0  # (B, H_kv, C)
        probs = attention_probs(q, self.k_cache, valid[:, :, None, :])  # (B, H_kv, G, C)
        self.scores += probs.sum(dim=2)
        return torch.matmul(probs.to(self.v_cache.dtype), self.v_cache).reshape(B, H, 1, D)

    def read_positions(self, input_pos: int) -> Tensor:
        """Positions (B, H_kv, C) int64 the last step read, -1 for empty slots."""
        return self.slot_pos.clone()

    def bytes_read_per_step(self) -> int:
        elt = self.k_cache.element_size()
        kv = 2 * self.batch_size * self.n_kv_heads * self.capacity * self.head_dim * elt
        # every slot's position and score are read (for the eviction) at every step
        aux = self.batch_size * self.n_kv_heads * self.capacity * self.AUX_BYTES_PER_SLOT
        return kv + aux

    AUX_BYTES_PER_SLOT = 8 + 4  # a slot's position (int64) and accumulated score (float32)

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "heavy": self.heavy, "recent": self.recent,
                "capacity": self.capacity, "prompt_tokens_kept": self.kept,
                "aux_bytes_per_slot": self.AUX_BYTES_PER_SLOT}


@dataclass(frozen=True, kw_only=True)
class H2OParams(Params):
    """H2O at budget t: ``heavy`` heavy hitters (``heavy_ratio`` of t) and ``recent`` tokens,
    ``capacity`` = t slots."""

    heavy: int
    recent: int
    heavy_ratio: float
    capacity: int


@register
class H2OMethod(Method):
    name = "h2o"
    description = "H2O: heavy hitters (accumulated attention) + recent tokens, evicting every step"
    budget_rule = "capacity t: int(t / 2) heavy hitters (`--heavy-ratio`), the rest recent"
    options = (HEAVY_RATIO,)
    cache_classes = (H2OCache,)
    source = "H2O (Zhang et al. 2023); RocketKV App. A.3"

    def derive(self, budget, prompt_len, args, options):
        ratio = options.get("heavy_ratio") or H2O_HEAVY_RATIO
        heavy = int(budget * ratio)
        if heavy < 1 or budget - heavy < 1:
            raise BudgetError(f"{heavy} heavy hitters and {budget - heavy} recent tokens (each "
                              "needs at least one)")
        return H2OParams(budget=budget, compression_ratio=prompt_len / budget, heavy=heavy,
                         recent=budget - heavy, heavy_ratio=ratio, capacity=budget,
                         traffic_tokens=float(budget))

    def build_layer(self, layer, args, params, *, batch_size, prompt_len, max_new_tokens,
                    dtype, device):
        return H2OCache(layer, args, batch_size, dtype, device, prompt_len=prompt_len,
                        max_new_tokens=max_new_tokens, heavy=params.heavy,
                        recent=params.recent, params=params.to_dict())
