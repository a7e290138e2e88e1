"""KeyDiff: attention-free eviction with block-wise prefill under a memory bound.

KeyDiff (Park et al. 2025, ``../shared/papers/keydiff.txt`` Sec. 3.2) scores every cached key
by its cosine similarity to the anchor, the mean of the cached keys of its KV head (Eq. 8, the
efficient variant with unnormalized keys the paper evaluates), and evicts the most similar:
it keeps the most distinct keys, which recover the attention sinks without reading any
attention weight. Because the score needs no attention, it works while the prompt is still
being processed (Sec. 2.3, Eq. 6, "block prompt processing"): each layer takes the prompt in
blocks of ``block`` tokens; a block's queries attend to the already-compressed cache plus the
block itself (causally), then the cache (kept tokens + block) is evicted down to capacity. A
decode step is a block of one token. Cache memory therefore never exceeds capacity + block at
any point of the run, prompt or generation: no layer's whole-prompt K/V ever exists.

Budget (RocketKV Sec. 3.5: key+value pairs read per decode step, per layer, per KV head): a
step reads the ``t - 1`` kept tokens and the new one, so the cache keeps ``C = t - 1`` tokens
per KV head between steps; its buffers hold ``C + block`` slots (the block's room, which a
decode step uses for its one new token). Selection is per KV head (keys are per KV head; the
paper's GQA models share them across the query group). Keys stay rotated at their true
positions, as every method here does.

Deviations from the paper's setup, all documented in ``KeyDiffCache``: the anchor is kept as a
running sum of the kept keys (exact after each prefill block, updated by one key per decode
step) instead of being recomputed from every key at each step, and scoring a decode step reads
the keys once together with the attention (the anchor is one more query row of the same
matmul). The optional sliding-window share of the budget (Sec. 3.2, "KeyDiff with sliding
window") is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import KVCache, causal_attention, same_view
from rocketkv.compression.registry import BudgetError, Method, Option, Params, positive, register
from rocketkv.model import ModelArgs

KEYDIFF_BLOCK = 128  # prompt tokens per prefill block (the default; the paper uses 128)
BLOCK_SIZE = Option("block_size", "keydiff: prompt tokens per prefill block (default 128); "
                    "cache memory stays within budget + block", check=positive)


def keydiff_scores(k: Tensor, valid: Tensor | None = None) -> Tensor:
    """KeyDiff's eviction score (keydiff.txt Eq. 8): cosine similarity of each key to the mean
    key of its KV head (the anchor); the highest scores are evicted first.

    Args:
        k: (B, H_kv, S, D) keys (any float dtype).
        valid: (B, H_kv, S) bool, the slots that hold a key (None: all); others score -inf
            and do not enter the mean.
    Returns:
        (B, H_kv, S) float32.
    """
    kf = k.float()
    if valid is None:
        anchor = kf.mean(dim=2, keepdim=True)  # (B, H_kv, 1, D)
    else:
        w = valid[..., None].float()
        anchor = (kf * w).sum(dim=2, keepdim=True) / w.sum(dim=2, keepdim=True).clamp(min=1)
    cos = torch.nn.functional.cosine_similarity(kf, anchor, dim=-1, eps=1e-8)
    return cos if valid is None else cos.masked_fill(~valid, float("-inf"))


class KeyDiffCache(KVCache):
    """KeyDiff's cache: ``capacity`` distinct keys per KV head, block-wise prefill.

    Args:
        prompt_len, max_new_tokens: tokens (T, m), for the reports and the append check.
        capacity: tokens kept between steps, C = t - 1 (a step reads them and the new token).
        block: prompt tokens per prefill block (``--block-size``).
    Buffers: ``k_cache``/``v_cache`` (B, H_kv, C + block, D) in the model dtype;
    ``slot_pos`` (B, H_kv, C + block) int64, the position each slot holds (-1 empty);
    ``key_norm`` (B, H_kv, C + block) float32, each slot's key norm; ``key_sum`` (B, H_kv, D)
    float32, the sum of the keys in slots 0..C-1 (empty slots hold zeros). Peak cache memory
    is these buffers: (C + block) slots, never the whole prompt.

    Prefill: the kept tokens fill slots ``0 .. n - 1``; a block is written at ``n .. n + Tb - 1``
    (``prompt_buffers``: the model writes it there directly), its queries attend to slots
    ``0 .. n + i`` (a lower-right causal mask: every kept token precedes the block), and after
    its last query the ``C`` lowest-scoring slots (``keydiff_scores`` over the n + Tb) are
    compacted into slots ``0 .. C - 1`` in slot order. Decode: the new token goes to slot C, the
    query attends to slots ``0 .. C`` (t pairs), then the slot with the highest score among
    those t (an empty slot first, while the cache is not full) takes the new token, which may
    itself be the one evicted (Eq. 6 with a block of one).
    """

    shared_prefill = False  # each block attends to the compressed cache, not the whole prompt

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, *, prompt_len: int, max_new_tokens: int, capacity: int, block: int,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        if capacity < 1 or block < 1:
            raise ValueError(f"capacity ({capacity}) and block ({block}) must be positive")
        self.prompt_len, self.max_len = prompt_len, prompt_len + max_new_tokens
        self.capacity, self.block = capacity, block
        self.kept = min(prompt_len, capacity)  # prompt tokens kept after prefill
        self.prefill_block = block
        self._params = dict(params or {})
        self.filled = 0  # prefill: slots 0..filled-1 hold the kept tokens
        self._block = (0, 0)  # positions of the block being prefilled
        self._register_kv(capacity + block, positions=True)
        self.register_buffer("key_norm", torch.zeros(self.slot_pos.shape, dtype=torch.float32,
                                                     device=device), persistent=False)
        self.register_buffer("key_sum", torch.zeros(batch_size, args.n_kv_heads, args.head_dim,
                                                    dtype=torch.float32, device=device),
                             persistent=False)

    # ---------------------------------------------------------------- prefill (blocks)

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        if start == 0:  # a new prompt (the cache may be reused)
            self.filled = 0
            self.slot_pos.fill_(-1)
        n = self.filled
        if end - start > self.block:
            raise ValueError(f"a block of {end - start} tokens exceeds the cache's block room "
                             f"({self.block})")
        return self.k_cache[:, :, n:n + end - start], self.v_cache[:, :, n:n + end - start]

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        Tb = k.shape[2]
        k_buf, v_buf = self.prompt_buffers(start, start + Tb)
        if not same_view(k, k_buf):
            k_buf.copy_(k)
            v_buf.copy_(v)
        n = self.filled
        self.slot_pos[..., n:n + Tb] = torch.arange(start, start + Tb, device=k.device)
        self._block = (start, start + Tb)

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        Tq = q.shape[2]
        first = self.filled + (start - self._block[0])  # slot of the first query's token
        end = first + Tq
        out = causal_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], first)
        if start + Tq == self._block[1]:  # the block's last query: evict down to capacity
            self._evict_block(end)
        return out

    def _evict_block(self, n: int) -> None:
        """Keep the C most distinct of slots 0..n-1 (in slot order) in slots 0..C-1."""
        C = self.capacity
        if n > C:
            scores = keydiff_scores(self.k_cache[:, :, :n])  # (B, H_kv, n)
            idx = scores.topk(C, dim=-1, largest=False).indices.sort(dim=-1).values
            ix = idx[..., None].expand(-1, -1, -1, self.head_dim)
            self.k_cache[:, :, :C] = self.k_cache[:, :, :n].gather(2, ix)
            self.v_cache[:, :, :C] = self.v_cache[:, :, :n].gather(2, ix)
            self.slot_pos[..., :C] = self.slot_pos[..., :n].gather(-1, idx)
            self.slot_pos[..., C:] = -1
            n = C
        self.filled = n
        kept = self.k_cache[:, :, :n].float()
        self.key_norm[..., :n] = kept.norm(dim=-1)
        self.key_sum.copy_(kept.sum(dim=2))

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """A conversation's next chunk: more prefill blocks (each attends to the compressed
        cache plus itself, then the cache is evicted to capacity)."""
        Tc = k.shape[2]
        if start < self.prompt_len or start + Tc > self.max_len:
            raise ValueError(f"a chunk at positions {start}..{start + Tc - 1} does not fit the "
                             f"cache (prompt {self.prompt_len} tokens, {self.max_len} "
                             "positions)")
        # the cache holds every token so far up to capacity, in slots 0..n-1 (decode fills an
        # empty slot first)
        self.filled = min(self.capacity, start)
        out = []
        for b in range(0, Tc, self.block):
            e = min(b + self.block, Tc)
            self.store_prompt(k[:, :, b:e], v[:, :, b:e], q[:, :, :0], start + b)
            out.append(self.prefill_attention(q[:, :, b:e], k[:, :, b:e], v[:, :, b:e],
                                              start + b))
        return torch.cat(out, dim=2)

    # ---------------------------------------------------------------- decode

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        B, H, _, D = q.shape
        Hkv, C = self.n_kv_heads, self.capacity
        G = H // Hkv
        # the new token in slot C: the step reads slots 0..C (t = C + 1 pairs)
        self.k_cache[:, :, C:C + 1] = k
        self.v_cache[:, :, C:C + 1] = v
        self.slot_pos[..., C] = input_pos
        k_new = k[:, :, 0].float()  # (B, H_kv, D)
        norm_new = k_new.norm(dim=-1)  # (B, H_kv)
        self.key_norm[..., C] = norm_new
        keys, values = self.k_cache[:, :, :C + 1], self.v_cache[:, :, :C + 1]
        pos = self.slot_pos[..., :C + 1]
        valid = pos >= 0  # (B, H_kv, C + 1)
        # the anchor (mean of the t keys) is one more query row: K is read once
        anchor = (self.key_sum + k_new) / valid.sum(dim=-1, keepdim=True)  # (B, H_kv, D)
        rows = torch.cat([q.reshape(B, Hkv, G, D), anchor[:, :, None].to(q.dtype)], dim=2)
        dots = torch.matmul(rows.to(keys.dtype), keys.transpose(-1, -2)).float()
        scores = (dots[:, :, :G] * D ** -0.5).masked_fill(~valid[:, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out = torch.matmul(probs.to(values.dtype), values).reshape(B, H, 1, D)
        # evict: an empty slot first, else the key most similar to the anchor
        cos = dots[:, :, G] / (self.key_norm[..., :C + 1] * anchor.norm(dim=-1, keepdim=True)
                               ).clamp(min=1e-8)
        cos = torch.where(valid, cos, float("inf"))
        slot = cos.argmax(dim=-1, keepdim=True)  # (B, H_kv, 1); C: the new token goes
        k_old = keys.gather(2, slot[..., None].expand(-1, -1, -1, D))[:, :, 0].float()
        self.key_sum += (k_new - k_old * valid.gather(-1, slot)) * (slot < C)
        self.k_cache.scatter_(2, slot[..., None].expand(-1, -1, -1, D), k)
        self.v_cache.scatter_(2, slot[..., None].expand(-1, -1, -1, D), v)
        self.slot_pos.scatter_(2, slot, input_pos.expand(B, Hkv, 1))
        self.key_norm.scatter_(2, slot, norm_new[..., None])
        self.slot_pos[..., C] = -1
        return out

    def read_positions(self, input_pos: int) -> Tensor:
        """Positions (B, H_kv, C) int64 the cache holds after the last step (-1 empty); the
        step itself read these and the one it evicted."""
        return self.slot_pos[..., :self.capacity].clone()

    # ---------------------------------------------------------------- reports

    AUX_BYTES_PER_SLOT = 8 + 4  # a slot's position (int64) and key norm (float32)

    def bytes_read_per_step(self) -> int:
        t = self.capacity + 1
        elt = self.k_cache.element_size()
        kv = 2 * self.batch_size * self.n_kv_heads * t * self.head_dim * elt
        aux = self.batch_size * self.n_kv_heads * (t * self.AUX_BYTES_PER_SLOT + 4 * self.head_dim)
        return kv + aux

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "capacity": self.capacity, "block_size": self.block,
                "prompt_tokens_kept": self.kept,
                "cache_slots": self.capacity + self.block}


@dataclass(frozen=True, kw_only=True)
class KeyDiffParams(Params):
    """KeyDiff at budget t: ``capacity`` = t - 1 kept tokens per KV head, prefill blocks of
    ``block_size``, ``cache_slots`` = capacity + block_size."""

    capacity: int
    block_size: int
    cache_slots: int


@register
class KeyDiffMethod(Method):
    name = "keydiff"
    description = ("KeyDiff: keeps the most distinct keys (cosine to the mean key), block-wise "
                   "prefill within t + block slots")
    budget_rule = ("capacity t - 1 per KV head (a step reads them + the new token); blocks of 128 "
                   "(`--block-size`): t - 1 + block slots")
    options = (BLOCK_SIZE,)
    cache_classes = (KeyDiffCache,)  # prefills in blocks of its own: no shared prefill
    source = "KeyDiff (Park et al. 2025) Sec. 3.2, Eq. 6, 8"

    def derive(self, budget, prompt_len, args, options):
        if budget < 2:
            raise BudgetError("keydiff keeps t - 1 tokens beside the new one: t must be >= 2")
        block = options.get("block_size") or KEYDIFF_BLOCK
        return KeyDiffParams(budget=budget, compression_ratio=prompt_len / budget,
                             capacity=budget - 1, block_size=block,
                             cache_slots=budget - 1 + block, traffic_tokens=float(budget))

    def build_layer(self, layer, args, params, *, batch_size, prompt_len, max_new_tokens,
                    dtype, device):
        return KeyDiffCache(layer, args, batch_size, dtype, device, prompt_len=prompt_len,
                            max_new_tokens=max_new_tokens, capacity=params.capacity,
                            block=params.block_size, params=params.to_dict())
