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
                 device: torch.device | str, max_seq_len: int):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.max_seq_len = max_seq_len
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
        return {"max_seq_len": self.max_seq_len}


def _build_full(args: ModelArgs, *, batch_size: int, prompt_len: int, max_new_tokens: int,
                budget: int | None, dtype: torch.dtype, device, **_) -> list[KVCache]:
    max_seq_len = prompt_len + max_new_tokens
    return [FullKVCache(i, args, batch_size, dtype, device, max_seq_len)
            for i in range(args.n_layers)]


# method name -> (one-line description for --help, factory building one cache per layer)
METHODS: dict[str, tuple[str, Callable[..., list[KVCache]]]] = {
    "full": ("Full-KV: every token cached and read at every step (no budget)", _build_full),
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
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if budget is not None and budget <= 0:
        raise ConfigError(f"--budget must be a positive number of tokens, got {budget}")
    return METHODS[method][1](args, batch_size=batch_size, prompt_len=prompt_len,
                              max_new_tokens=max_new_tokens, budget=budget, dtype=dtype,
                              device=device, **options)
