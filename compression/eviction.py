"""Eviction within a fixed capacity: StreamingLLM, H2O and DuoAttention.

These baselines keep a bounded set of tokens per KV head and attend densely to all of it at
every decode step, so the token budget ``t`` (RocketKV Sec. 3.5: key+value pairs read per step,
per layer, per KV head) is their capacity. Prefill attends to the whole uncompressed prompt, as
for every baseline in the RocketKV paper (App. A.3: "we do not perform any KV cache compression
or sparse attention mechanism in the prefill phase ... including DuoAttention"); eviction
happens when the prompt is stored and at every decode step. Keys stay rotated at their true
positions (no re-rotation into the cache's slots).

* StreamingLLM (Xiao et al. 2024, "Efficient streaming language models with attention sinks"):
  the first ``sink`` tokens (attention sinks, 4 by default) and the ``t - sink`` most recent
  ones. The recent window is a ring buffer: position p >= sink lives in slot
  ``sink + (p - sink) mod (t - sink)``, so the token written at step p overwrites exactly the
  one that leaves the window, generated tokens included (``SinkRecentCache`` with no retrieval
  heads).
* DuoAttention (Xiao et al. 2025): per KV head, retrieval heads keep every token, streaming
  heads keep ``sink`` + ``recent`` tokens in a ring as above; heads are split by learned gates
  (a TSV with one row per layer and one column per KV head, ``load_duo_pattern``). Budget
  mapping of the RocketKV paper's baseline (App. A.3, ``duo_split``): above 640 tokens the
  streaming heads keep 128 sinks + 512 recent and the share of retrieval heads is set so the
  average read per KV head meets t; at or below 640 every head streams, with 128 sinks above
  256 and ``int(0.2 t)`` below, the rest recent. A layer's retrieval and streaming heads live in
  two buffers of their own sizes (``SinkRecentCache``), so nothing is padded to the largest
  capacity and one compiled step serves every layer's split.
* H2O (Zhang et al. 2023): per KV head, ``heavy`` heavy hitters (largest accumulated attention,
  summed over the query heads of the group as in the RocketKV paper's GQA baselines) and the
  ``recent`` latest tokens (half and half by default). The prompt's accumulated scores are the
  column sums of every prompt query's causal attention (``kv_cache.attention_column_sums``:
  computed block by block, never T x T); at each decode step, when the cache is full, the
  token with the lowest accumulated score outside the recent window is evicted before the new
  token is written, so the step reads exactly t tokens, and the new query's attention is added
  to the scores (``H2OCache``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kv_cache import KVCache, attend, attention_column_sums, attention_probs, causal_attention
from model import ConfigError, ModelArgs

STREAMING_SINK = 4  # StreamingLLM's attention sinks (its paper's default)
H2O_HEAVY_RATIO = 0.5  # share of the budget for heavy hitters (H2O's paper: half and half)
DUO_SINK, DUO_RECENT = 128, 512  # streaming heads above the 640-token budget (RocketKV App. A.3)
DUO_PATTERN_FILE = "full_attention_heads.tsv"


def duo_split(t: int, capacity: int, n_heads_total: int,
              threshold: float | None = None) -> dict[str, Any]:
    """DuoAttention's parameters at budget t (RocketKV App. A.3).

    Args:
        t: token budget; capacity: prompt + new tokens (what a retrieval head reads per step,
            its whole static buffer); n_heads_total: layers x KV heads.
        threshold: gates above it make retrieval heads (the pattern's own split); None: the
            budget sets how many.
    Returns:
        sink and recent (streaming heads), ``retrieval_heads`` (how many, over the model; None
        when the threshold decides) and ``needs_pattern``.
    """
    if t > DUO_SINK + DUO_RECENT:
        sink, recent = DUO_SINK, DUO_RECENT
    else:
        sink = DUO_SINK if t > 256 else int(0.2 * t)
        recent = t - sink
    n_ret = None
    if threshold is None:
        stream = sink + recent
        share = max(0.0, (t - stream) / (capacity - stream)) if capacity > stream else 1.0
        n_ret = min(n_heads_total, math.floor(share * n_heads_total))
    return {"sink": sink, "recent": recent, "retrieval_heads": n_ret,
            "needs_pattern": threshold is not None or n_ret > 0}


def duo_traffic(n_ret: int, n_total: int, capacity: int, sink: int, recent: int) -> float:
    """Mean KV pairs read per step per KV head: retrieval heads read ``capacity``, streaming
    heads ``sink + recent``."""
    return (n_ret * capacity + (n_total - n_ret) * (sink + recent)) / n_total


def load_duo_pattern(path: str | Path, args: ModelArgs) -> Tensor:
    """DuoAttention head gates: (n_layers, n_kv_heads) float64.

    Args:
        path: a TSV file (one row per layer, one tab-separated gate per KV head; near 1 marks a
            retrieval head) or a directory holding ``full_attention_heads.tsv`` (the layout of
            DuoAttention's released patterns and of ``scripts/duo_identify.py``'s output).
    Raises:
        ConfigError: missing or unreadable file, a non-numeric value, or a shape other than the
            model's (layers x KV heads).
    """
    p = Path(path)
    if p.is_dir():
        p = p / DUO_PATTERN_FILE
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--duo-patterns: cannot read {p}: {e}") from None
    try:
        rows = [[float(x) for x in ln.split()] for ln in lines]
    except ValueError as e:
        raise ConfigError(f"--duo-patterns: {p} holds a non-numeric value ({e})") from None
    shape = (len(rows), len({len(r) for r in rows}) == 1 and len(rows[0]) if rows else 0)
    want = (args.n_layers, args.n_kv_heads)
    if shape != want:
        raise ConfigError(f"--duo-patterns: {p} has {len(rows)} rows of "
                          f"{sorted({len(r) for r in rows})} gates; the model needs {want[0]} "
                          f"rows (layers) of {want[1]} gates (KV heads)")
    gates = torch.tensor(rows, dtype=torch.float64)
    if not torch.isfinite(gates).all():
        raise ConfigError(f"--duo-patterns: {p} holds a value that is not finite")
    return gates


def duo_retrieval_heads(gates: Tensor, n_ret: int | None = None,
                        threshold: float | None = None) -> list[list[int]]:
    """Retrieval KV heads per layer: the ``n_ret`` largest gates over the whole model (ties by
    layer, then head), or every gate above ``threshold``."""
    L, Hkv = gates.shape
    flat = gates.flatten()
    if threshold is not None:
        chosen = set((flat > threshold).nonzero().flatten().tolist())
    else:
        order = sorted(range(L * Hkv), key=lambda i: (-float(flat[i]), i))
        chosen = set(order[:n_ret])
    return [[h for h in range(Hkv) if i * Hkv + h in chosen] for i in range(L)]


class SinkRecentCache(KVCache):
    """Retrieval heads keep every token; streaming heads keep sinks + a recent ring.

    Args:
        prompt_len, max_new_tokens: tokens (T, m); retrieval heads hold T + m positions.
        sink, recent: streaming heads keep positions < sink and the last ``recent`` ones.
        retrieval_heads: KV heads of this layer that keep every token (none: StreamingLLM).
    Buffers: ``k_full``/``v_full`` (B, n_retrieval, T + m, D) and ``k_ring``/``v_ring``
    (B, n_streaming, sink + recent, D) in the model dtype. Which position a ring slot holds follows
    from the last position written (``ring_positions``), so no position buffer is kept.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, *, prompt_len: int, max_new_tokens: int, sink: int, recent: int,
                 retrieval_heads: Sequence[int] = (), params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        if recent < 1:
            raise ValueError(f"the recent window needs at least one token, got {recent}")
        self.prompt_len, self.sink, self.recent = prompt_len, sink, recent
        self.max_len = prompt_len + max_new_tokens
        ret = sorted(set(retrieval_heads))
        stream = [h for h in range(args.n_kv_heads) if h not in ret]
        self.n_retrieval, self.n_streaming = len(ret), len(stream)
        self._params = dict(params or {})
        B, D = batch_size, args.head_dim
        kw = {"dtype": dtype, "device": device}
        order = ret + stream  # the concatenated outputs' head order -> head order
        inverse = [order.index(h) for h in range(args.n_kv_heads)]
        self.register_buffer("retrieval_idx", torch.tensor(ret, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("streaming_idx", torch.tensor(stream, dtype=torch.long,
                                                           device=device), persistent=False)
        self.register_buffer("inverse", torch.tensor(inverse, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("k_full", torch.zeros(B, len(ret), self.max_len, D, **kw)
                             if ret else None, persistent=False)
        self.register_buffer("v_full", torch.zeros(B, len(ret), self.max_len, D, **kw)
                             if ret else None, persistent=False)
        ring = sink + recent
        self.register_buffer("k_ring", torch.zeros(B, len(stream), ring, D, **kw)
                             if stream else None, persistent=False)
        self.register_buffer("v_ring", torch.zeros(B, len(stream), ring, D, **kw)
                             if stream else None, persistent=False)
        self.kept = round((len(ret) * prompt_len + len(stream) * min(prompt_len, ring))
                          / args.n_kv_heads)

    def slot_of(self, pos: Tensor) -> Tensor:
        """Ring slot of positions ``pos`` (int64): the position itself below ``sink``, else
        ``sink + (pos - sink) mod recent``."""
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink) % self.recent)

    def ring_positions(self, last: int) -> Tensor:
        """Positions (sink + recent,) int64 the ring slots hold once every position up to
        ``last`` was written (-1: empty). Sink slot s holds s; ring slot s holds the latest
        p <= last with p = s mod recent (``slot_of``), if p >= s."""
        s = torch.arange(self.sink + self.recent, device=self.device)
        p = torch.where(s < self.sink, s, last - (last - s) % self.recent)
        return p.masked_fill((p > last) | (p < s), -1)

    def _split(self, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(B, H_kv, ...) -> its retrieval heads and its streaming heads (None when absent)."""
        if self.n_retrieval == 0:
            return None, x
        if self.n_streaming == 0:
            return x, None
        return x.index_select(1, self.retrieval_idx), x.index_select(1, self.streaming_idx)

    def _merge(self, out_r: Tensor | None, out_s: Tensor | None) -> Tensor:
        """Outputs (B, n_r, G, T, D) and (B, n_s, G, T, D) -> (B, H, T, D) in head order."""
        parts = [o for o in (out_r, out_s) if o is not None]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, 1).index_select(1, self.inverse)
        B, Hkv, G, T, D = out.shape
        return out.reshape(B, Hkv * G, T, D)

    def _grouped(self, q: Tensor) -> Tensor:
        B, H, T, D = q.shape
        return q.view(B, self.n_kv_heads, H // self.n_kv_heads, T, D)

    @staticmethod
    def _flat(q: Tensor) -> Tensor:
        B, n, G, T, D = q.shape
        return q.reshape(B, n * G, T, D)

    @staticmethod
    def _unflat(y: Tensor, n: int) -> Tensor:
        B, H, T, D = y.shape
        return y.view(B, n, H // n, T, D)

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        T = k.shape[2]
        if T != self.prompt_len:
            raise ValueError(f"cache set up for {self.prompt_len} prompt tokens, got {T}")
        (k_r, k_s), (v_r, v_s) = self._split(k), self._split(v)
        if k_r is not None:
            self.k_full[:, :, :T] = k_r
            self.v_full[:, :, :T] = v_r
        if k_s is not None:
            pos = torch.cat([torch.arange(min(self.sink, T)),
                             torch.arange(min(T, max(self.sink, T - self.recent)), T)])
            pos = pos.to(k.device)
            slots = self.slot_of(pos)
            self.k_ring[:, :, slots] = k_s[:, :, pos]
            self.v_ring[:, :, slots] = v_s[:, :, pos]

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        Tc = k.shape[2]
        end = start + Tc
        if start < self.prompt_len or end > self.max_len:
            raise ValueError(f"a chunk at positions {start}..{end - 1} does not fit the cache "
                             f"(prompt {self.prompt_len} tokens, {self.max_len} positions)")
        (k_r, k_s), (v_r, v_s) = self._split(k), self._split(v)
        q_r, q_s = self._split(self._grouped(q))
        out_r = out_s = None
        if k_r is not None:
            self.k_full[:, :, start:end] = k_r
            self.v_full[:, :, start:end] = v_r
            out_r = self._unflat(causal_attention(
                self._flat(q_r), self.k_full[:, :, :end], self.v_full[:, :, :end], start),
                self.n_retrieval)
        if k_s is not None:
            chunk_pos = torch.arange(start, end, device=k.device)
            key_pos = torch.cat([self.ring_positions(start - 1), chunk_pos])  # (ring + Tc,)
            qp = chunk_pos[:, None]
            visible = (key_pos >= 0) & (key_pos <= qp) & \
                ((key_pos < self.sink) | (key_pos > qp - self.recent))  # (Tc, ring + Tc)
            G = q.shape[1] // self.n_kv_heads
            out_s = self._unflat(attend(
                self._flat(q_s), torch.cat([self.k_ring, k_s], 2),
                torch.cat([self.v_ring, v_s], 2), visible.repeat(G, 1)), self.n_streaming)
            survive = (chunk_pos < self.sink) | (chunk_pos > end - 1 - self.recent)
            pos = chunk_pos[survive]
            slots = self.slot_of(pos)
            self.k_ring[:, :, slots] = k_s[:, :, pos - start]
            self.v_ring[:, :, slots] = v_s[:, :, pos - start]
        return self._merge(out_r, out_s)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        (k_r, k_s), (v_r, v_s) = self._split(k), self._split(v)
        q_r, q_s = self._split(self._grouped(q))
        out_r = out_s = None
        if k_r is not None:
            self.k_full.index_copy_(2, input_pos, k_r)
            self.v_full.index_copy_(2, input_pos, v_r)
            mask = torch.arange(self.max_len, device=input_pos.device) <= input_pos
            out_r = self._unflat(attend(self._flat(q_r), self.k_full, self.v_full, mask),
                                 self.n_retrieval)
        if k_s is not None:
            slot = self.slot_of(input_pos)
            self.k_ring.index_copy_(2, slot, k_s)
            self.v_ring.index_copy_(2, slot, v_s)
            # slots fill in order (0, 1, ...) until the ring is full, so slot s holds a token
            # iff s <= input_pos: the mask needs no position buffer
            written = torch.arange(self.sink + self.recent, device=slot.device) <= input_pos
            out_s = self._unflat(attend(self._flat(q_s), self.k_ring, self.v_ring, written),
                                 self.n_streaming)
        return self._merge(out_r, out_s)

    def read_positions(self, input_pos: int) -> Tensor:
        """Positions (B, H_kv, n) int64 the step at ``input_pos`` read, -1 padding (after the
        step: used by the accuracy harness's attention recall)."""
        n = max(self.max_len if self.n_retrieval else 0, self.sink + self.recent)
        out = torch.full((self.batch_size, self.n_kv_heads, n), -1, dtype=torch.long,
                         device=self.device)
        if self.n_retrieval:
            out[:, self.retrieval_idx, :input_pos + 1] = torch.arange(input_pos + 1,
                                                                      device=self.device)
        if self.n_streaming:
            ring = self.ring_positions(input_pos)
            out[:, self.streaming_idx, :ring.shape[0]] = ring
        return out

    def bytes_read_per_step(self) -> int:
        elt = torch.empty(0, dtype=self.dtype).element_size()
        pairs = self.n_retrieval * self.max_len + self.n_streaming * (self.sink + self.recent)
        return 2 * self.batch_size * self.head_dim * elt * pairs

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "sink": self.sink, "recent": self.recent,
                "prompt_tokens_kept": self.kept}


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
    with ``store_scored_prompt`` (``needs_attention_sums``).
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
        out = causal_attention(q, k, v, start)
        end = start + q.shape[2]
        sums = self._pending[2]
        sums[..., :end] += attention_column_sums(q, k, start)
        if end == self.prompt_len:  # the last query block: every prompt query has voted
            pk, pv, _ = self._pending
            self._pending = None
            self.store_scored_prompt(pk, pv, sums)
        return out

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
