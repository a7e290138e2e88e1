"""KV cache interface and the full (uncompressed) cache.

Every attention layer owns one ``KVCache``. The model hands it q, k, v (keys already rotated at
their true positions) and gets the attention output back; the cache decides what to store, what
to read and how to attend. Compression methods (``compression/``) are subclasses.

The interface carries what the methods need without bending:

* ``prefill(q, k, v)`` sees one layer's q, k, v for the whole prompt before the next layer runs,
  so a cache may evict right there (SnapKV family) or process the prompt in blocks, each
  attending to the already-compressed cache (KeyDiff).
* ``decode(q, k, v, input_pos)`` gets the new token at ``input_pos``, a device tensor, so the
  step has static shapes and compiles once; a cache may evict inside it within a fixed
  capacity (H2O, StreamingLLM) or update page summaries on write (Quest, RocketKV).
* Buffers are per-cache ``register_buffer`` tensors of any shape and device: different
  capacities per KV head (DuoAttention) or CPU-resident storage (OmniKV offload) are the
  subclass's choice. Caches are built together by a method's factory (``build_caches``), so
  a later layer's cache may hold a reference to an earlier layer's state (OmniKV filter layers).
* ``allocated_bytes()`` and ``bytes_read_per_step()`` report storage and per-step traffic.

Token budget (RocketKV paper Sec. 3.5): key+value pairs read per decode step, per layer, per
KV-head group, approximation traffic included. The full cache has no budget: it reads every
cached token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import ConfigError, ModelArgs


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal self-attention over a prompt without repeating K/V.

    Args:
        q: (B, H, T, D) queries; k, v: (B, H_kv, T, D) with H a multiple of H_kv.
    Returns:
        (B, H, T, D), dtype of q. Uses fused SDPA kernels (flash on GPU); no T x T mask exists.
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=q.shape[1] != k.shape[1])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Grouped-query attention of a few queries over cached keys, K/V never repeated.

    Args:
        q: (B, H, Tq, D) queries.
        k, v: (B, H_kv, S, D) keys and values; query head h reads KV head h // (H / H_kv).
        mask: bool, broadcastable to (B, H_kv, G * Tq, S) with G = H / H_kv (rows ordered
            query head within the group, then query token); False masks a key out.
    Returns:
        (B, H, Tq, D) in the dtype of v. Scores and softmax in float32.
    """
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, (H // Hkv) * Tq, D)  # (B, H_kv, G*Tq, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(D))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # (B, H_kv, G*Tq, S)
    return torch.matmul(probs, v).reshape(B, H, Tq, D)


class KVCache(nn.Module):
    """One layer's cache. Subclasses implement ``prefill`` and ``decode``.

    Args:
        layer_idx: index of the layer this cache serves.
        args: the model's shapes (heads, KV heads, head_dim).
        batch_size: sequences decoded together (equal prompt lengths).
        dtype, device: of the stored K/V.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.layer_idx = layer_idx
        self.batch_size = batch_size
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.dtype, self.device = dtype, torch.device(device)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend over the whole prompt of this layer and store what the method keeps.

        Args:
            q: (B, H, T, D); k, v: (B, H_kv, T, D), keys rotated at positions 0..T-1.
        Returns:
            attention output (B, H, T, D).
        """
        raise NotImplementedError

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Store the new token's k, v and attend.

        Args:
            q: (B, H, 1, D); k, v: (B, H_kv, 1, D) rotated at ``input_pos``.
            input_pos: (1,) int64 device tensor, the token's absolute position.
        Returns:
            attention output (B, H, 1, D).
        """
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        """Bytes of every buffer this cache owns (K/V and auxiliary data)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def bytes_read_per_step(self) -> int:
        """Bytes of cached K/V (and auxiliary data) one decode step reads."""
        raise NotImplementedError

    def method_params(self) -> dict[str, Any]:
        """Every derived parameter of the method, for reports."""
        return {}


class FullKVCache(KVCache):
    """Uncompressed static cache ``(B, H_kv, max_seq_len, D)`` for K and for V.

    Decode writes the new token at ``input_pos`` and attends to positions ``<= input_pos`` with a
    mask built from ``input_pos`` (static shapes: one compiled graph for every step). The step
    reads the whole static buffer, so ``max_seq_len`` is sized to prompt + new tokens.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_seq_len: int,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.max_seq_len = max_seq_len
        self._params = dict(params or {})
        shape = (batch_size, args.n_kv_heads, max_seq_len, args.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        T = k.shape[2]
        if T > self.max_seq_len:
            raise ValueError(f"prompt of {T} tokens exceeds the cache ({self.max_seq_len})")
        self.k_cache[:, :, :T] = k
        self.v_cache[:, :, :T] = v
        return causal_attention(q, k, v)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        mask = torch.arange(self.max_seq_len, device=input_pos.device) <= input_pos  # (S,)
        return attend(q, self.k_cache, self.v_cache, mask)

    def bytes_read_per_step(self) -> int:
        return self.allocated_bytes()  # the whole static buffer, masked

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "max_seq_len": self.max_seq_len}


class GptFastDenseCache(FullKVCache):
    """Full-KV the way gpt-fast (and the RocketKV release) ran it, as a benchmark baseline.

    K/V are expanded to every query head with ``repeat_interleave`` at each step, attention
    runs SDPA's math kernel over the whole static buffer, and a (max_seq x max_seq) boolean
    causal mask is materialized (counted in ``allocated_bytes``: 16 GiB at 128K). Prefill uses
    ``causal_attention`` like every other cache (the decode step is what is compared).
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_seq_len: int, causal_mask: Tensor):
        super().__init__(layer_idx, args, batch_size, dtype, device, max_seq_len,
                         params={"baseline": "gpt-fast dense decode"})
        self.causal_mask = causal_mask  # shared by every layer, as gpt-fast's model buffer

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        G = self.n_heads // self.n_kv_heads
        keys = self.k_cache.repeat_interleave(G, dim=1)  # (B, H, S, D) copies, as gpt-fast
        values = self.v_cache.repeat_interleave(G, dim=1)
        mask = self.causal_mask[input_pos][None, None]  # (1, 1, 1, S) bool
        # SDPA's math kernel, which takes the mask additively (what SDPA does with a bool mask)
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_attention_math(q, keys, values,
                                                                 attn_mask=bias)[0]

    def allocated_bytes(self) -> int:
        mask = self.causal_mask.numel() if self.layer_idx == 0 else 0  # count the shared mask once
        return super().allocated_bytes() + mask


def _build_gptfast_dense(args: ModelArgs, *, batch_size: int, prompt_len: int,
                         max_new_tokens: int, dtype: torch.dtype, device, **_) -> list[KVCache]:
    max_seq_len = prompt_len + max_new_tokens
    mask = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=device))
    return [GptFastDenseCache(i, args, batch_size, dtype, device, max_seq_len, mask)
            for i in range(args.n_layers)]


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Rows of ``x`` (B, H_kv, S, D) at token indices ``idx`` (B, H_kv, n) -> (B, H_kv, n, D)."""
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


def attend_selected(q: Tensor, k_cache: Tensor, v_cache: Tensor, idx: Tensor,
                    valid: Tensor) -> Tensor:
    """Exact attention of q (B, H, 1, D) over the cached tokens ``idx`` (B, H_kv, n), shared by
    each query group; ``valid`` (S,) bool marks written slots (unwritten picks are masked)."""
    mask = valid[idx][:, :, None, :]  # (B, H_kv, 1, n)
    return attend(q, gather_tokens(k_cache, idx), gather_tokens(v_cache, idx), mask)


class Selector(nn.Module):
    """Decode-time token selection over a cache's slots; the base class attends densely.

    A selector may own auxiliary buffers (page summaries, running means): they are counted in
    the cache's ``allocated_bytes``. Subclasses override ``build`` (after prefill), ``update``
    (after each write), ``attend`` and the byte/parameter reports.
    """

    page_size = 1  # the cache's buffer length is rounded up to a multiple of this

    def allocate(self, cache: CompressedKVCache) -> None:
        """Create auxiliary buffers for ``cache`` (its shapes are final)."""

    def build(self, cache: CompressedKVCache) -> None:
        """Recompute auxiliary data from the ``cache.kept`` prompt slots after prefill."""

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        """Account for key ``k`` (B, H_kv, 1, D) just written at ``slot`` (1,)."""

    def attend(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """Attention output (B, H, 1, D) for q over the slots marked ``valid`` (S,)."""
        mask = valid
        if cache.head_mask is not None:  # per-query-head token sets (original SnapKV)
            mask = valid & cache.head_mask  # (B, H_kv, G, S)
        return attend(q, cache.k_cache, cache.v_cache, mask)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        """Bytes one decode step reads: every slot's key and value."""
        return cache.kv_bytes(cache.capacity)

    def params(self) -> dict[str, Any]:
        return {"selection": "dense"}


class CompressedKVCache(KVCache):
    """Static compact cache shared by every compression method.

    Slots ``0 .. kept-1`` hold the prompt tokens kept at the end of prefill (all of them, or the
    ones an eviction policy chose, in position order); slots ``kept ..`` hold generated tokens
    in order, so they never overwrite prompt slots. A decode step writes the token at
    ``input_pos`` into slot ``input_pos - (prompt_len - kept)`` and lets the selector attend.

    Args:
        prompt_len: prompt tokens (T).
        prompt_capacity: prompt tokens to keep; ``>= T`` means nothing to evict.
        max_new_tokens: slots reserved for generated tokens.
        evict: ``evict(q, k) -> (idx, head_mask)`` choosing ``kept`` prompt tokens per KV head
            (idx (B, H_kv, kept) ascending; head_mask (B, H_kv, G, kept) bool or None when the
            selection is shared by the query group); None keeps the whole prompt.
        selector: decode-time selection (``Selector``).
        per_head: reserve a per-query-head mask (original SnapKV on GQA models).
        params: derived parameters to report.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, *, prompt_len: int, prompt_capacity: int, max_new_tokens: int,
                 selector: Selector, evict: Callable | None = None, per_head: bool = False,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.prompt_len = prompt_len
        self.kept = min(prompt_len, prompt_capacity)
        self.capacity = self.kept + max_new_tokens
        self.evict = evict
        self.selector = selector
        self._params = dict(params or {})
        length = -(-self.capacity // selector.page_size) * selector.page_size
        shape = (batch_size, args.n_kv_heads, length, args.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("slot_offset", torch.tensor(prompt_len - self.kept, device=device),
                             persistent=False)
        head_mask = torch.ones(batch_size, args.n_kv_heads, args.group_size, length,
                               dtype=torch.bool, device=device) if per_head else None
        self.register_buffer("head_mask", head_mask, persistent=False)  # None: group-shared
        selector.allocate(self)

    @property
    def length(self) -> int:
        """Slots in the static buffers (capacity rounded up to whole pages)."""
        return self.k_cache.shape[2]

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` key+value pairs for every sequence and KV head."""
        return 2 * self.batch_size * self.n_kv_heads * tokens * self.head_dim * \
            self.k_cache.element_size()

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        T = k.shape[2]
        if T != self.prompt_len:
            raise ValueError(f"cache set up for {self.prompt_len} prompt tokens, got {T}")
        out = causal_attention(q, k, v)  # prefill attends to the whole prompt (RocketKV A.3)
        if self.evict is not None:
            idx, head_mask = self.evict(q, k)  # (B, H_kv, kept)
            k, v = gather_tokens(k, idx), gather_tokens(v, idx)
            if self.head_mask is not None:
                self.head_mask[..., :self.kept] = head_mask
        self.k_cache[:, :, :self.kept] = k
        self.v_cache[:, :, :self.kept] = v
        self.selector.build(self)
        return out

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        slot = input_pos - self.slot_offset  # (1,)
        self.k_cache.index_copy_(2, slot, k)
        self.v_cache.index_copy_(2, slot, v)
        self.selector.update(self, slot, k)
        valid = torch.arange(self.length, device=slot.device) <= slot  # (S,)
        return self.selector.attend(self, q, valid)

    def bytes_read_per_step(self) -> int:
        return self.selector.bytes_read(self)

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "prompt_tokens_kept": self.kept, "capacity": self.capacity,
                **self.selector.params()}


def _build_full(args: ModelArgs, *, batch_size: int, prompt_len: int, max_new_tokens: int,
                budget: int | None, dtype: torch.dtype, device, **_) -> list[KVCache]:
    max_seq_len = prompt_len + max_new_tokens
    return [FullKVCache(i, args, batch_size, dtype, device, max_seq_len)
            for i in range(args.n_layers)]


# method name -> (one-line description for --help, factory building one cache per layer)
METHODS: dict[str, tuple[str, Callable[..., list[KVCache]]]] = {
    "full": ("Full-KV: every token cached and read at every step (no budget)", _build_full),
    "gptfast_dense": ("benchmark baseline: Full-KV decoded as gpt-fast did (repeated K/V, math "
                      "SDPA, max_seq^2 mask)", _build_gptfast_dense),
}


def build_caches(method: str, args: ModelArgs, *, batch_size: int, prompt_len: int,
                 max_new_tokens: int, budget: int | None, dtype: torch.dtype, device,
                 **options) -> list[KVCache]:
    """One cache per layer for ``method``.

    Args:
        method: a key of ``METHODS``.
        prompt_len, max_new_tokens: tokens; static buffers are sized from them.
        budget: token budget (KV pairs read per decode step per layer per KV group), or None.
        options: method-specific settings.
    Raises:
        ConfigError: unknown method, or a budget that is not a positive integer.
    """
    import compression  # noqa: F401  (registers the compression methods in METHODS)

    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if budget is not None and budget <= 0:
        raise ConfigError(f"--budget must be a positive number of tokens, got {budget}")
    return METHODS[method][1](args, batch_size=batch_size, prompt_len=prompt_len,
                              max_new_tokens=max_new_tokens, budget=budget, dtype=dtype,
                              device=device, **options)
