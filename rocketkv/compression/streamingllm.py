"""StreamingLLM (Xiao et al. 2024, "Efficient streaming language models with attention sinks").

Each KV head keeps the first ``sink`` tokens (attention sinks, 4 by default) and the
``t - sink`` most recent ones, and attends densely to all of them at every step. The recent
window is a ring buffer: position p >= sink lives in slot ``sink + (p - sink) mod (t - sink)``,
so the token written at step p overwrites exactly the one that leaves the window, generated
tokens included. Prefill attends to the whole uncompressed prompt, as for every baseline in the
RocketKV paper (App. A.3); keys stay rotated at their true positions (no re-rotation into the
cache's slots). ``SinkRecentCache`` also serves DuoAttention (``duoattention.py``), whose
retrieval heads keep every token beside the streaming ones.

Token budget ``t`` (RocketKV Sec. 3.5): the method reads all it keeps, so t is its capacity:
sink = 4 (``--sink-size``), recent window t - sink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv.cache import KVCache, attend, causal_attention
from rocketkv.compression.registry import BudgetError, Method, Option, Params, register
from rocketkv.model import ModelArgs

STREAMING_SINK = 4  # StreamingLLM's attention sinks (its paper's default)


def _not_negative(value: int) -> str | None:
    return None if value >= 0 else f"must not be negative, got {value}"


SINK_SIZE = Option("sink_size", "streamingllm: attention sinks kept (default 4)",
                   check=_not_negative)


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


@dataclass(frozen=True, kw_only=True)
class SinkRecentParams(Params):
    """A sink + recent ring buffer of ``capacity`` = t slots per KV head."""

    sink: int
    recent: int
    capacity: int


@register
class StreamingLLMMethod(Method):
    name = "streamingllm"
    description = "StreamingLLM: attention sinks + a recent window (ring buffer), budget t"
    budget_rule = "capacity t: 4 sinks (`--sink-size`), t - 4 recent"
    options = (SINK_SIZE,)
    cache_classes = (SinkRecentCache,)
    source = "StreamingLLM (Xiao et al. 2024); RocketKV App. A.3"

    def derive(self, budget, prompt_len, args, options):
        sink = STREAMING_SINK if options.get("sink_size") is None else options["sink_size"]
        if budget <= sink:
            raise BudgetError(f"no room for a recent window beside {sink} sink tokens")
        return SinkRecentParams(budget=budget, compression_ratio=prompt_len / budget, sink=sink,
                                recent=budget - sink, capacity=budget,
                                traffic_tokens=float(budget))

    def build_layer(self, layer, args, params, *, batch_size, prompt_len, max_new_tokens,
                    dtype, device):
        return SinkRecentCache(layer, args, batch_size, dtype, device, prompt_len=prompt_len,
                               max_new_tokens=max_new_tokens, sink=params.sink,
                               recent=params.recent, params=params.to_dict())
