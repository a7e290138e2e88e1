"""The selection machinery of the budgeted methods: byte accounting in GPU sectors, gathering
selected tokens, the ``Selector`` (decode-time token selection over a cache's slots) and
``CompressedKVCache`` (a cache that may evict at prefill and selects at every decode step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from rocketkv import kernels
from rocketkv.cache.attention import attend, causal_attention, prefix_attention, written_slots
from rocketkv.cache.base import NEVER, KVCache, TokenStore, same_view
from rocketkv.model import ModelArgs

SECTOR = 32  # bytes: the unit in which GPU memory is read (an L2 sector)


def sector_bytes(nbytes: int) -> int:
    """Bytes read for ``nbytes`` contiguous bytes: whole 32-byte sectors (aligned start)."""
    return -(-nbytes // SECTOR) * SECTOR


def strided_bytes(n: int, row: int, elem: int) -> int:
    """Bytes read for ``n`` scattered elements of one contiguous row of ``row`` elements of
    ``elem`` bytes: each in its own sector at worst, never more than the whole row."""
    return min(n * SECTOR, sector_bytes(row * elem))


def token_bytes(cache: KVCache, n: int) -> int:
    """Bytes of ``n`` gathered key+value rows (whole sectors each) for every sequence and KV
    head of ``cache``."""
    row = sector_bytes(cache.head_dim * torch.empty((), dtype=cache.dtype).element_size())
    return 2 * cache.batch_size * cache.n_kv_heads * n * row


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Rows of ``x`` (B, H_kv, S, D) at token indices ``idx`` (B, H_kv, n) -> (B, H_kv, n, D).

    Any (B, H_kv, rows, width) tensor works the same way: SparQ and hybrid attention read r
    whole rows of transposed keys or page summaries with it.

    On CPU a contiguous ``x`` is read as whole D-element rows (``index_select`` over the
    flattened (B * H_kv * S, D) view): the same values as the element-wise ``gather``, about
    10x faster in bfloat16 (3.5 ms against 0.3 ms at B=10, H_kv=3, S=2200, n=512, D=64, 2
    threads). Other devices keep ``gather``.
    """
    B, Hkv, S, D = x.shape
    if x.device.type == "cpu" and x.is_contiguous():
        base = torch.arange(B * Hkv, device=x.device).view(B, Hkv, 1) * S
        return x.view(-1, D).index_select(0, (idx + base).reshape(-1)).view(*idx.shape, D)
    return x.gather(2, idx[..., None].expand(-1, -1, -1, D))


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
    (after each decode write) with ``extend`` (after a prompt chunk's writes: the state that
    ``update`` per slot would leave), ``select`` and the byte/parameter reports. A selector
    that attends to k chosen tokens derives from ``compression.selection.TopKSelector``, which
    declares what the fused kernels need and dispatches to them in one place.
    """

    page_size = 1  # the cache's buffer length is rounded up to a multiple of this
    horizon: int | None = None  # the cache length its parameters were derived for (set when
    # they follow the cache: ``CompressedKVCache.retune_for``); None: the cache's capacity

    def span(self, cache: CompressedKVCache) -> int:
        """Tokens the ideal traffic counts (``ideal_bytes``): the cache length the parameters
        were derived for, else the cache's capacity."""
        return cache.capacity if self.horizon is None else self.horizon

    def allocate(self, cache: CompressedKVCache) -> None:
        """Create auxiliary buffers for ``cache`` (its shapes are final)."""

    def build(self, cache: CompressedKVCache) -> None:
        """Recompute auxiliary data from the ``cache.kept`` prompt slots after prefill."""

    def update(self, cache: CompressedKVCache, slot: Tensor, k: Tensor) -> None:
        """Account for key ``k`` (B, H_kv, 1, D) just written at ``slot`` (1,)."""

    def extend(self, cache: CompressedKVCache, first: int, n: int) -> None:
        """Account for the keys just written at slots ``first .. first + n - 1`` (a prompt
        chunk appended to the cache), leaving the state ``n`` ``update`` calls in order would.
        A selector that keeps per-slot state overrides both."""

    def rebuild(self, cache: CompressedKVCache, written: int) -> None:
        """Allocate this selector's buffers for ``cache`` and build them from its first
        ``written`` slots (``extend`` over slots 0 .. written - 1): it takes over from a
        selector of another kind or page size (``CompressedKVCache.retune_for``)."""
        self.allocate(cache)
        if written:
            self.extend(cache, 0, written)

    def token_aux(self, cache: CompressedKVCache) -> tuple[Tensor, int, int] | None:
        """The auxiliary keys a fused kernel updates with the token's write, as
        ``TokenStore``'s ``(aux, aux_kind, page_size)``, or None when ``update`` must run
        (the default for a selector that overrides ``update`` and not this)."""
        return None if type(self).update is not Selector.update else \
            kernels.no_aux(cache.k_cache)

    def store_token(self, cache: CompressedKVCache, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Write a decoded token's k, v (B, H_kv, 1, D) at ``slot`` (1,) int64 and ``update``.
        Selectors with a fused kernel for both (``kernels.sparse.write_token``) override it."""
        cache.k_cache.index_copy_(2, slot, k)
        cache.v_cache.index_copy_(2, slot, v)
        self.update(cache, slot, k)

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """The slots (B, H_kv, n) int64 that ``attend`` reads for q (B, H, 1, D), given the
        written slots ``valid`` (S,) bool, shared by each query group (picks of unwritten
        slots, where fewer than n are written, are masked out by the attention; a cache's
        ``head_mask`` further restricts each query head). Every slot here: dense attention."""
        return torch.arange(cache.length, device=valid.device).expand(
            cache.batch_size, cache.n_kv_heads, cache.length)

    def attend(self, cache: CompressedKVCache, q: Tensor, pos: Tensor) -> Tensor:
        """Attention output (B, H, 1, D) for q over the written slots of ``cache``: slots 0 ..
        pos - ``cache.slot_offset``, ``pos`` (1,) int64 the position of the token just
        written. Here dense attention (``prefix_attention``: the kernels where they run);
        the mask of written slots (``cache.valid_slots``) is built only for the PyTorch
        path."""
        if cache.head_mask is not None:  # per-query-head token sets (original SnapKV)
            return attend(q, cache.k_cache, cache.v_cache,
                          cache.valid_slots(pos) & cache.head_mask)
        return prefix_attention(q, cache.k_cache, cache.v_cache, None, pos, cache.slot_offset)

    def bytes_read(self, cache: CompressedKVCache) -> int:
        """Bytes one decode step's kernels read at this layout: every slot's key and value."""
        return cache.kv_bytes(cache.capacity)

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        """Bytes the step would read touching only the elements it uses (RocketKV Table 1)."""
        return self.bytes_read(cache)

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
        evict: ``evict(q_obs, k) -> (idx, head_mask)`` choosing ``kept`` prompt tokens per KV
            head from the last ``obs_window`` queries q_obs (B, H, w, D) and the keys (idx
            (B, H_kv, kept) ascending; head_mask (B, H_kv, G, kept) bool or None when the
            selection is shared by the query group); None keeps the whole prompt.
        obs_window: prompt queries ``evict`` reads (the observation window).
        selector: decode-time selection (``Selector``).
        per_head: reserve a per-query-head mask (original SnapKV on GQA models).
        params: derived parameters to report.
        retune: ``retune(length) -> (selector, holds_until, params)``: the selector of a
            decode step whose cache holds ``length`` tokens, the largest length it serves and
            its parameters to report (the method's ``at_length``); None: ``selector`` serves
            every step. The report gives the latest step's parameters.
        page_size: the page size the buffers are laid out for (rounded up to whole pages),
            when the selectors ``retune`` gives (dense while the cache fits the budget) may
            differ from ``selector``; default ``selector.page_size``.
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, *, prompt_len: int, prompt_capacity: int, max_new_tokens: int,
                 selector: Selector | None = None, evict: Callable | None = None,
                 per_head: bool = False, obs_window: int = 0,
                 params: dict[str, Any] | None = None,
                 retune: Callable[[int], tuple[Selector, int]] | None = None,
                 page_size: int | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.prompt_len = prompt_len
        self.kept = min(prompt_len, prompt_capacity)
        self.capacity = self.kept + max_new_tokens
        self.evict = evict
        self.obs_window = obs_window if evict is not None else 0
        self._retune = retune
        self.retune_at = NEVER  # the next decode position whose step may need other parameters
        self._params = dict(params or {})
        if retune is not None:
            selector = self._derive(self.kept + 1)
        self.selector = selector
        page = page_size or selector.page_size
        length = -(-self.capacity // page) * page
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

    def _report(self, step_params: dict[str, Any]) -> None:
        """Report the parameters of the latest step (``budget_overshoot`` only where they
        overshoot)."""
        self._params.pop("budget_overshoot", None)
        self._params.update(step_params)

    def _position_after(self, holds: int) -> int:
        """The decode position whose step's cache holds ``holds + 1`` tokens."""
        return NEVER if holds >= NEVER else holds + self.prompt_len - self.kept

    def retune_for(self, input_pos: int, force: bool = False) -> bool:
        """Re-derive the decode parameters for the step that writes position ``input_pos``
        (the cache then holds ``input_pos - slot_offset + 1`` tokens), when the current ones
        no longer serve it, or whatever they are with ``force`` (a call's first step: the
        cache may have been rewound); True when the selector changed (a captured step must be
        recaptured; a compiled one recompiles on its own). The decode loop calls it at
        ``retune_at`` only: a host-side integer check, no device read."""
        if self._retune is None or (input_pos < self.retune_at and not force):
            return False
        length = input_pos - (self.prompt_len - self.kept) + 1
        return self._tune(length, length - 1)  # the step's own token: the new selector's

    def _derive(self, length: int) -> Selector:
        """The selector of a step whose cache holds ``length`` tokens (``retune``), its
        ``horizon`` set; ``retune_at`` and the reported parameters follow it."""
        new, holds, step_params = self._retune(length)
        self.retune_at = self._position_after(holds)
        self._report(step_params)
        new.horizon = holds if holds < NEVER else None
        return new

    def _tune(self, length: int, written: int) -> bool:
        """Take the selector of a step whose cache holds ``length`` tokens, ``written`` of
        them already in the cache; True when it differs from the current one."""
        new, old = self._derive(length), self.selector
        old.horizon = new.horizon
        if type(new) is type(old) and new.params() == old.params():
            return False
        if type(new) is type(old) and new.page_size == old.page_size:
            # the same kind over the same pages (r or k changed): keep the module, whose
            # buffers describe the same slots, and take the new integers, so a compiled step
            # sees one module whose integers Dynamo may treat as symbolic (no recompile each)
            for name, value in vars(new).items():
                if not name.startswith("_"):
                    setattr(old, name, value)
            return True
        new.rebuild(self, written)
        self.selector = new
        return True

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` key+value pairs for every sequence and KV head."""
        return 2 * self.batch_size * self.n_kv_heads * tokens * self.head_dim * \
            self.k_cache.element_size()

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor] | None:
        if self.evict is not None or start != 0 or end != self.prompt_len:
            return None  # K/V are gathered after eviction
        return self.k_cache[:, :, :end], self.v_cache[:, :, :end]

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        T = k.shape[2]
        if T != self.prompt_len:
            raise ValueError(f"cache set up for {self.prompt_len} prompt tokens, got {T}")
        if self.evict is not None:
            idx, head_mask = self.evict(q_obs, k)  # (B, H_kv, kept)
            k, v = gather_tokens(k, idx), gather_tokens(v, idx)
            if self.head_mask is not None:
                self.head_mask[..., :self.kept] = head_mask
        if not same_view(k, self.k_cache[:, :, :self.kept]):
            self.k_cache[:, :, :self.kept] = k
            self.v_cache[:, :, :self.kept] = v
        if self._retune is not None:  # reused caches: the first step's parameters again
            self._tune(self.kept + 1, 0)
        self.selector.build(self)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        Tc = k.shape[2]
        first = start - (self.prompt_len - self.kept)  # slots are positions minus the evicted
        if start < self.prompt_len or first + Tc > self.capacity:
            raise ValueError(f"a chunk at positions {start}..{start + Tc - 1} does not fit the "
                             f"cache (prompt {self.prompt_len} tokens, {self.capacity} slots "
                             f"for {self.kept} kept)")
        end = first + Tc
        self.k_cache[:, :, first:end] = k
        self.v_cache[:, :, first:end] = v
        self.selector.extend(self, first, Tc)
        if self.head_mask is None:
            return causal_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end],
                                    first)
        # original SnapKV: each query head sees only its own kept prompt tokens
        causal = torch.arange(end, device=q.device) <= \
            torch.arange(first, end, device=q.device)[:, None]  # (Tc, end)
        mask = self.head_mask[..., None, :end] & causal  # (B, H_kv, G, Tc, end)
        B, Hkv, G = mask.shape[:3]
        return attend(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end],
                      mask.reshape(B, Hkv, G * Tc, end))

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        self.selector.store_token(self, input_pos - self.slot_offset, k, v)
        return self.attend_stored(q, input_pos)

    def token_store(self, input_pos: Tensor) -> TokenStore | None:
        if type(self).decode is not CompressedKVCache.decode:  # a subclass that decodes its
            return None  # own way sees k and v
        aux = self.selector.token_aux(self)
        return None if aux is None else TokenStore(self.k_cache, self.v_cache, input_pos,
                                                   self.slot_offset, *aux)

    def valid_slots(self, input_pos: Tensor) -> Tensor:
        """(S,) bool: the slots written once the token at ``input_pos`` (1,) int64 is
        stored (slots 0 .. input_pos - ``slot_offset``). Only the PyTorch path builds it."""
        return written_slots(self.length, input_pos, self.slot_offset)

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        return self.selector.attend(self, q, input_pos)

    def bytes_read_per_step(self) -> int:
        return self.selector.bytes_read(self)

    def ideal_bytes_per_step(self) -> int:
        return self.selector.ideal_bytes(self)

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "prompt_tokens_kept": self.kept, "capacity": self.capacity,
                **self.selector.params()}
