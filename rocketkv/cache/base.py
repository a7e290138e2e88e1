"""The cache interface (``KVCache``, ``TokenStore``) and the full (uncompressed) cache
(``FullKVCache``); ``rocketkv/cache/__init__.py`` describes the interface."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from rocketkv import kernels
from rocketkv.cache.attention import causal_attention, prefill_memo, prefix_attention
from rocketkv.model import ConfigError, ModelArgs

NEVER = 1 << 62  # a decode position no run reaches

class TokenStore(NamedTuple):
    """Where a decode step's fused projection kernel (``kernels.dense.qkv_store``) writes the
    new token's key and value, and which auxiliary keys it updates in the same pass
    (``kernels.sparse.write_token``'s formats).

    Attributes:
        k_cache, v_cache: (B, H_kv, S, D) buffers, last dim contiguous.
        pos, offset: (1,) int64 device tensors: the slot written is pos - offset (the
            token's position less a compressed cache's ``slot_offset``, subtracted in the
            kernel); offset None: the slot is pos.
        aux: the auxiliary keys (a page summary or a dim-major key copy), or an empty tensor.
        aux_kind: ``kernels.AUX_NONE``, ``AUX_SUMMARY`` or ``AUX_DIM_MAJOR``.
        page_size: tokens per page of ``AUX_SUMMARY``.
    """

    k_cache: Tensor
    v_cache: Tensor
    pos: Tensor
    offset: Tensor | None
    aux: Tensor
    aux_kind: int
    page_size: int


class KVCache(nn.Module):
    """One layer's cache. Subclasses implement ``prefill`` and ``decode``; a cache whose
    decode step is "write the token, then attend" also offers ``token_store`` and
    ``attend_stored``, so the fused projection kernel writes the token for it.

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

    obs_window = 0  # last prompt queries ``store_prompt`` needs (observation window)
    retune_at = NEVER  # the decode position at which ``retune_for`` must next be asked

    def retune_for(self, input_pos: int, force: bool = False) -> bool:
        """Re-derive the decode parameters for the step that writes position ``input_pos``,
        if they follow the cache's length (``CompressedKVCache``); True when the step's
        tensors changed (a captured CUDA graph must be recaptured). Called by the decode loop
        when ``input_pos`` reaches ``retune_at``, and with ``force`` at a call's first step."""
        return False
    dense_kernels = True  # the decode step may run the dense kernels (``kernels/dense.py``)

    def _register_kv(self, slots: int, positions: bool = False) -> None:
        """Zeroed ``k_cache`` and ``v_cache`` buffers (B, H_kv, slots, D) in the cache's dtype
        and, with ``positions``, ``slot_pos`` (B, H_kv, slots) int64, the position each slot
        holds (-1: empty), for caches whose slots are not in position order."""
        shape = (self.batch_size, self.n_kv_heads, slots)
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(*shape, self.head_dim, dtype=self.dtype,
                                                   device=self.device), persistent=False)
        if positions:
            self.register_buffer("slot_pos", torch.full(shape, -1, dtype=torch.long,
                                                        device=self.device), persistent=False)

    prefill_block: int | None = None  # prompt tokens per prefill block (None: the whole
    # prompt at once); a cache with blocks sees ``store_prompt`` once per block

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor] | None:
        """Views (B, H_kv, end - start, D) of this cache's own storage where the model may
        write the K/V of the prefill block at positions ``start .. end - 1`` directly (saving
        a copy), or None: the model allocates them."""
        return None

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        """Store what the method keeps of one prefill block (it may evict here).

        Called once per block (once per layer unless ``prefill_block`` is set), after every key
        and value of the block exists and before any of its queries attends, so only one
        block's uncompressed K/V ever exists.

        Args:
            k, v: (B, H_kv, Tb, D), keys rotated at positions ``start .. start + Tb - 1``
                (possibly the views ``prompt_buffers`` returned); the whole prompt (start 0,
                Tb = T) for a cache without ``prefill_block``.
            q_obs: (B, H, min(obs_window, Tb), D), the block's last queries (rotated).
            start: position of the block's first token.
        """
        raise NotImplementedError

    def prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Attention of the prompt queries at positions ``start ..`` (q (B, H, Tq, D)) over
        the prompt keys up to position ``start + Tq - 1``; k, v (B, H_kv, start + Tq - b, D)
        hold the current prefill block's keys from its first position b (b = 0 without
        ``prefill_block``: the whole prompt so far).

        Prefill attends to the whole uncompressed prompt for every method but KeyDiff
        (RocketKV App. A.3); the model calls this in query chunks, so no (T x T) scores and no
        whole-prompt query or output tensor exist. Returns (B, H, Tq, D).
        """
        return causal_attention(q, k, v, start)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One layer's whole prompt, given its q, k, v: per prefill block (the whole prompt
        without ``prefill_block``), ``store_prompt`` then ``prefill_attention``, as
        ``TransformerBlock.prefill`` calls them.

        Args:
            q: (B, H, T, D); k, v: (B, H_kv, T, D), rotated at positions 0..T-1.
        Returns:
            attention output (B, H, T, D).
        """
        T = k.shape[2]
        block = self.prefill_block or T
        out = []
        for b in range(0, T, block):
            e = min(b + block, T)
            kb, vb = k[:, :, b:e], v[:, :, b:e]
            bufs = self.prompt_buffers(b, e)
            if bufs is not None:
                bufs[0].copy_(kb)
                bufs[1].copy_(vb)
                kb, vb = bufs
            w = min(self.obs_window, e - b)
            self.store_prompt(kb, vb, q[:, :, e - w:e], b)
            out.append(self.prefill_attention(q[:, :, b:e], kb, vb, b))
        return torch.cat(out, dim=2)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """A later prompt chunk (a conversation's next turn): store its K/V after everything
        cached and let its queries attend, densely, to what the cache holds plus the chunk
        causally.

        The earlier prompt stays as the method left it (compressed, for an evicting method):
        the chunk's queries see only the kept tokens, which is the multi-turn setting of the
        RocketKV paper's SCBench results. Its tokens are stored like generated tokens (never
        evicted; the decode-time selection of the method scores them from the next step on).

        Args:
            q: (B, H, Tc, D); k, v: (B, H_kv, Tc, D), rotated at positions ``start ..
                start + Tc - 1``; ``start`` is the number of tokens fed so far.
        Returns:
            attention output (B, H, Tc, D).
        Raises:
            ValueError: the chunk does not fit in the cache's capacity.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot append a prompt chunk")

    needs_attention_sums = False  # True: storing a recorded prompt needs the column sums of
    # every prompt query's attention (H2O): ``prefill.prefill_once(attention_sums=True)``

    def store_recorded_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor,
                              attention_sums: Tensor | None, memo: dict) -> None:
        """Store a whole prompt recorded by a shared prefill (``prefill.prefill_once``), as
        ``store_prompt`` would have stored it during that prefill.

        Args:
            k, v: (B, H_kv, T, D), keys rotated at positions 0..T-1.
            q_obs: (B, H, w, D), the prompt's last w recorded queries (w = T when the prompt
                is shorter than the recorded window).
            attention_sums: (B, H_kv, T) float32 column sums of every prompt query's attention
                (``attention_column_sums``), or None when the prefill did not record them.
            memo: the prefill's dict for this layer, shared by every cache built from it
                (``prefill_memo``).
        Raises:
            ConfigError: the cache's observation window exceeds the recorded queries.
        """
        w_rec = q_obs.shape[2]
        if self.obs_window > w_rec and w_rec < k.shape[2]:
            raise ConfigError(f"the method's observation window ({self.obs_window} tokens) "
                              f"exceeds the {w_rec} queries recorded by prefill_once")
        w = min(self.obs_window, w_rec)  # the method's window; 0: no eviction
        with prefill_memo(memo):
            self.store_prompt(k, v, q_obs[:, :, w_rec - w:])

    compilable = True  # False: the decode step syncs with the host (OmniKV's offload) and runs
    # eagerly

    shared_prefill = True  # prefill attends to the whole uncompressed prompt, so every such
    # method's caches may be built from one prefill's K/V (``prefill.prefill_once``)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Store the new token's k, v and attend.

        Args:
            q: (B, H, 1, D); k, v: (B, H_kv, 1, D) rotated at ``input_pos``.
            input_pos: (1,) int64 device tensor, the token's absolute position.
        Returns:
            attention output (B, H, 1, D).
        """
        raise NotImplementedError

    def token_store(self, input_pos: Tensor) -> TokenStore | None:
        """Where the token at ``input_pos`` (1,) int64 is to be written by a fused kernel,
        which must then call ``attend_stored`` instead of ``decode``; None (the default):
        ``decode`` must see the token's k and v (the cache does more than write them)."""
        return None

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        """``decode`` after the token's k and v were written where ``token_store`` said:
        q (B, H, 1, D) -> attention output (B, H, 1, D). Subclasses of a cache that offers
        ``token_store`` change the attention here, not in ``decode``."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        """Bytes of every buffer this cache owns (K/V and auxiliary data)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def bytes_read_per_step(self) -> int:
        """Bytes of cached K/V (and auxiliary data) one decode step reads."""
        raise NotImplementedError

    def ideal_bytes_per_step(self) -> int:
        """Bytes a step would read if every read touched only the elements it uses (the
        RocketKV paper's Table 1 count); ``bytes_read_per_step`` counts what the kernels touch
        at the layout used (32-byte sectors where a gather is strided). Equal by default."""
        return self.bytes_read_per_step()

    def host_bytes(self) -> int:
        """Bytes of this cache kept in host memory (OmniKV's ``--offload``); not part of
        ``allocated_bytes``."""
        return 0

    def offload_bytes_per_step(self) -> int:
        """Bytes this cache copies from host to device memory per decode step."""
        return 0

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
        self._register_kv(max_seq_len)

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        if end > self.max_seq_len:
            raise ValueError(f"prompt of {end} tokens exceeds the cache "
                             f"({self.max_seq_len})")
        return self.k_cache[:, :, start:end], self.v_cache[:, :, start:end]

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        k_buf, v_buf = self.prompt_buffers(start, start + k.shape[2])
        if not same_view(k, k_buf):  # the model did not write into our buffers directly
            k_buf.copy_(k)
            v_buf.copy_(v)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        end = start + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"a chunk ending at position {end} exceeds the cache "
                             f"({self.max_seq_len} tokens)")
        self.k_cache[:, :, start:end] = k
        self.v_cache[:, :, start:end] = v
        return causal_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], start)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.attend_stored(q, input_pos)

    def token_store(self, input_pos: Tensor) -> TokenStore | None:
        if type(self).decode is not FullKVCache.decode:  # a subclass that decodes its own
            return None  # way sees k and v
        return TokenStore(self.k_cache, self.v_cache, input_pos, None,
                          *kernels.no_aux(self.k_cache))

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        # the mask of written slots is built inside, only where the PyTorch path runs
        return prefix_attention(q, self.k_cache, self.v_cache, None, input_pos)

    def bytes_read_per_step(self) -> int:
        # compiled, the step reads the written blocks; at the last step that is the whole
        # buffer (sized prompt + new tokens), which this counts
        return self.allocated_bytes()

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "max_seq_len": self.max_seq_len}


def same_view(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` is exactly the view ``b`` (same storage, offset, shape and strides)."""
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride())
