"""OmniKV: no token dropped; filter layers select, later layers reuse the selection.

OmniKV (Hao et al. 2025, ``../shared/papers/omnikv.txt`` Sec. 4, Alg. 1, App. B) keeps every
token of every layer. At each decode step a few "filter" layers attend fully and pick the
top-k tokens by a context selector (Eq. 3-4):

    S = sum_j alpha_j max_h A[h, j, :]

over the queries j of an observation window (the last 16 tokens at that layer) and every query
head h of the layer (one index set per sequence, shared by all heads of the later layers);
alpha is ``last`` (only the newest query; the paper's recommended selector, Sec. 5.3), ``uniform``
(all ones) or ``exponential`` (2^(j - w), newest heaviest). The layers after a filter layer
attend only to its selection, except (Eq. 2) the layers before the first filter layer and the
layer right after each filter layer, which attend fully (the latter hides the transfer of the
selection in the offloaded setting). Prefill attends fully in every layer.

Budget (RocketKV Sec. 3.5: key+value pairs read per decode step, per layer, per KV head): a
sparse layer reads ``t`` pairs: the ``t - 1`` selected earlier tokens and the new token itself,
which every query attends to (the filter layer selects among the earlier positions, since the
sparse layers' new K/V does not exist yet when the selection is made and loaded). Full and
filter layers read everything, so the per-step traffic averaged over layers exceeds t; the
parameters report it (``traffic_tokens``, ``budget_overshoot``), as the paper's own latency
runs (2048 tokens for sparse layers, Sec. 5.4) count only the sparse layers.

Filter layers: the paper gives {2, 8, 18} for its 32-layer Llama-3-8B-262K (also used here for
Llama-3.1-8B and Mistral-7B, 32 layers each), {6, 11, 30} for Yi-9B (48) and {4, 19, 41} for
Llama-3.1-70B (80). For other depths ``default_filter_layers`` scales the 32-layer choice
to the depth: round(l * L / 32) for l in {2, 8, 18} (SmolLM2's 30 layers: {2, 8, 17}).
``--filter-layers`` overrides.

Offload (``--offload``, Sec. 4.1 "Context Bank" and "Packed Load"): the sparse layers' full K/V
lives in host memory (pinned when CUDA is available). After its selection, each filter layer
gathers the selected tokens of every sparse layer it serves on the host and brings them to the
device in one packed, asynchronous copy; a sparse layer writes its new token's K/V back to the
host. The selection's indices must reach the host, so the offloaded step synchronizes once per
filter layer and is run eagerly (``compilable = False``); the in-memory path compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv import tp
from rocketkv.cache import (
    FullKVCache,
    KVCache,
    attend,
    attention_probs,
    causal_attention,
    same_view,
)
from rocketkv.compression.registry import BudgetError, Method, Option, Params, register
from rocketkv.flags import layer_list
from rocketkv.model import ConfigError, ModelArgs

OMNIKV_WINDOW = 16  # observation window of the uniform and exponential selectors (Sec. 5)
SELECTORS = ("last", "uniform", "exponential")
PAPER_FILTER_LAYERS = {32: (2, 8, 18), 48: (6, 11, 30), 80: (4, 19, 41)}  # Sec. 5, App. D.2

FILTER_LAYERS = Option("filter_layers", "omnikv: filter layers (default: the paper's 2,8,18 for "
                       "32 layers, scaled to other depths)", type=layer_list,
                       metavar="L1,L2,...")
SELECTOR = Option("omnikv_selector", "omnikv: context selector over its observation window "
                  "(default last)", type=str, choices=SELECTORS)
OFFLOAD = Option("offload", "omnikv: keep the sparse layers' K/V in host memory (runs eagerly)",
                 type=None)


def default_filter_layers(n_layers: int) -> list[int]:
    """The paper's filter layers for its depths (``PAPER_FILTER_LAYERS``); otherwise the
    32-layer choice {2, 8, 18} scaled to ``n_layers`` (rounded half up), keeping only filter
    layers that serve at least one sparse layer (a shallow model: fewer filter layers; with
    fewer than 4 layers none can, and layer 0 filters alone)."""
    if n_layers in PAPER_FILTER_LAYERS:
        return list(PAPER_FILTER_LAYERS[n_layers])
    scaled = sorted({min(n_layers - 1, int(f * n_layers / 32 + 0.5)) for f in (2, 8, 18)})
    kept: list[int] = []
    for f in reversed(scaled):  # f serves f + 2 .. (next filter - 1)
        if f + 2 < (kept[0] if kept else n_layers):
            kept.insert(0, f)
    return kept or [0]


def layer_roles(n_layers: int, filter_layers: Sequence[int]) -> list[str]:
    """Each layer's role (Eq. 2): ``full`` (before the first filter layer, or right after a
    filter layer), ``filter`` or ``sparse`` (attends to the preceding filter layer's
    selection)."""
    f = set(filter_layers)
    return ["filter" if i in f else
            "full" if i < min(f) or i - 1 in f else "sparse" for i in range(n_layers)]


def selector_weights(selector: str, pos: Tensor, now: Tensor) -> Tensor:
    """alpha for window queries at positions ``pos`` (w,) int64 (-1: empty) when the newest is
    ``now`` (Eq. 4): last 1 for the newest only; uniform 1; exponential 2^(p - now - 1) (the
    newest 1/2, halving with each older one). Empty slots weigh 0. Returns (w,) float32."""
    if selector == "last":
        w = (pos == now).float()
    elif selector == "uniform":
        w = torch.ones(pos.shape, dtype=torch.float32, device=pos.device)
    elif selector == "exponential":
        w = torch.exp2((pos - now - 1).float())
    else:
        raise ValueError(f"unknown OmniKV selector {selector!r}; known: {', '.join(SELECTORS)}")
    return w * (pos >= 0)


class OmniKVFilterCache(FullKVCache):
    """A filter layer: full cache and full attention, then the selection (Alg. 1 lines 1-4).

    Args:
        k_select: tokens selected (t - 1) among the earlier positions.
        selector: ``last``, ``uniform`` or ``exponential``; window: its observation window.
    Buffers: the full cache's; ``selected`` (B, k_select) int64 positions and
    ``selected_valid`` (B, k_select) bool (False: a pick beyond the tokens so far, early in a
    short sequence); with a windowed selector, ``q_window`` (B, H, w, D) the window's queries
    (a ring: position p in slot p mod w) and ``q_window_pos`` (w,) int64 (-1 empty).
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, max_seq_len: int, *, k_select: int, selector: str, window: int,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device, max_seq_len, params)
        if selector not in SELECTORS:
            raise ValueError(f"unknown OmniKV selector {selector!r}")
        self.k_select, self.selector = k_select, selector
        self.window = 1 if selector == "last" else window
        self.obs_window = 0 if selector == "last" else window  # prompt queries to record
        self.register_buffer("selected", torch.zeros(batch_size, k_select, dtype=torch.long,
                                                     device=device), persistent=False)
        self.register_buffer("selected_valid", torch.zeros(batch_size, k_select,
                                                           dtype=torch.bool, device=device),
                             persistent=False)
        qw = pos = None
        if selector != "last":
            qw = torch.zeros(batch_size, args.n_heads, window, args.head_dim, dtype=dtype,
                             device=device)
            pos = torch.full((window,), -1, dtype=torch.long, device=device)
        self.register_buffer("q_window", qw, persistent=False)
        self.register_buffer("q_window_pos", pos, persistent=False)
        self.group: list[OmniKVSparseCache] = []  # sparse layers reading this selection
        self.offload = False
        self.host_pos = -1  # offload: the step's position, known on the host
        self.pack_host = None
        self.register_buffer("pack", None, persistent=False)  # offload: the device side

    # ---- the window of queries (windowed selectors only)

    def _record_queries(self, q: Tensor, first: int) -> None:
        if self.q_window is None:
            return
        n = q.shape[2]
        i = max(0, n - self.window)  # the last queries, position p in slot p mod w
        pos = torch.arange(first + i, first + n, device=self.q_window_pos.device)
        self.q_window.index_copy_(2, pos % self.window, q[:, :, i:])
        self.q_window_pos.index_copy_(0, pos % self.window, pos)

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        super().store_prompt(k, v, q_obs, start)
        if self.q_window is not None:
            self.q_window_pos.fill_(-1)
        self._record_queries(q_obs, k.shape[2] - q_obs.shape[2])

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        out = super().append(q, k, v, start)
        self._record_queries(q, start)
        return out

    # ---- decode

    def attend_stored(self, q: Tensor, input_pos: Tensor) -> Tensor:
        """Attend densely (the token is written at ``input_pos``), then select the tokens
        the served sparse layers read this step."""
        B, H, _, D = q.shape
        S = self.k_cache.shape[2]
        keys = torch.arange(S, device=input_pos.device)
        probs = attention_probs(q, self.k_cache, keys <= input_pos)  # (B, H_kv, G, S)
        out = torch.matmul(probs.to(self.v_cache.dtype), self.v_cache).reshape(B, H, 1, D)
        if self.q_window is None:  # last: the step's own attention, max over every head
            scores = tp.all_reduce_max(probs.amax(dim=(1, 2)))  # (B, S): every head
        else:
            slot = input_pos % self.window
            self.q_window.index_copy_(2, slot, q)
            self.q_window_pos.index_copy_(0, slot, input_pos)
            pos = self.q_window_pos  # (w,)
            w = self.window
            visible = (keys <= pos[:, None]) | (pos[:, None] < 0)  # empty rows: weight 0
            Hkv = self.n_kv_heads
            pw = attention_probs(self.q_window, self.k_cache, visible.repeat(H // Hkv, 1))
            pw = tp.all_reduce_max(pw.view(B, Hkv, H // Hkv, w, S).amax(dim=(1, 2)))  # (B,w,S)
            alpha = selector_weights(self.selector, pos, input_pos)  # (w,)
            scores = (alpha[None, :, None] * pw).sum(dim=1)  # (B, S)
        scores = scores.masked_fill(keys >= input_pos, float("-inf"))  # earlier tokens only
        top = scores.topk(self.k_select, dim=-1, sorted=False)
        self.selected.copy_(top.indices)
        self.selected_valid.copy_(top.values > float("-inf"))
        if self.offload:
            self._packed_load(input_pos)
        return out

    def _packed_load(self, input_pos: Tensor) -> None:
        """Gather every served sparse layer's selected K/V on the host and start one packed
        copy to the device (Sec. 4.1 "Packed Load"); synchronizes for the indices."""
        if not self.group:
            return
        idx = self.selected.cpu()  # the step's one host sync at this layer
        self.host_pos = int(input_pos.cpu())
        B, n = idx.shape
        Hkv, D = self.n_kv_heads, self.head_dim
        ix = idx[:, None, :, None].expand(B, Hkv, n, D)
        for g, sparse in enumerate(self.group):
            torch.gather(sparse.k_bank, 2, ix, out=self.pack_host[g, 0])
            torch.gather(sparse.v_bank, 2, ix, out=self.pack_host[g, 1])
        self.pack.copy_(self.pack_host, non_blocking=True)

    def setup_offload(self) -> None:
        """Allocate the packed transfer buffers for ``group`` (host: pinned when CUDA is
        available; device: the cache's)."""
        self.offload = True
        shape = (len(self.group), 2, self.batch_size, self.n_kv_heads, self.k_select,
                 self.head_dim)
        pin = torch.cuda.is_available()
        self.pack_host = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        self.register_buffer("pack", torch.zeros(shape, dtype=self.dtype, device=self.device),
                             persistent=False)

    def offload_bytes_per_step(self) -> int:
        """Host-to-device bytes of this layer's packed load per decode step."""
        return 0 if self.pack_host is None else \
            self.pack_host.numel() * self.pack_host.element_size()

    def bytes_read_per_step(self) -> int:
        """The whole static K/V buffer (as the full cache) and, for a windowed selector, the
        window's queries."""
        kv = 2 * self.k_cache.numel() * self.k_cache.element_size()
        window = 0 if self.q_window is None else \
            self.q_window.numel() * self.q_window.element_size()
        return kv + window

    def method_params(self) -> dict[str, Any]:
        return {**super().method_params(), "role": "filter", "k_select": self.k_select,
                "selector": self.selector, "selector_window": self.window,
                "serves_layers": [c.layer_idx for c in self.group],
                "offload_bytes_per_step": self.offload_bytes_per_step()}


class OmniKVSparseCache(KVCache):
    """A sparse layer: every token kept (on the device, or in host memory with ``offload``),
    attention over the preceding filter layer's selection plus the new token (Eq. 2).

    Args:
        max_seq_len: prompt + new tokens; filter: the preceding filter layer's cache (read for
            its ``selected`` positions, or its packed transfer with ``offload``).
        offload: keep K/V in host memory (``k_bank``, ``v_bank``: (B, H_kv, max_seq_len, D),
            pinned when CUDA is available; not module buffers, so they stay on the host).
    """

    def __init__(self, layer_idx: int, args: ModelArgs, batch_size: int, dtype: torch.dtype,
                 device, max_seq_len: int, *, filter_cache: OmniKVFilterCache, offload: bool,
                 params: dict[str, Any] | None = None):
        super().__init__(layer_idx, args, batch_size, dtype, device)
        self.max_seq_len = max_seq_len
        self._params = dict(params or {})
        self._filter = (filter_cache,)  # a tuple: not a submodule (its buffers are its own)
        self._group_index = len(filter_cache.group)  # this layer's slot in the packed load
        self.offload = offload
        shape = (batch_size, args.n_kv_heads, max_seq_len, args.head_dim)
        if offload:
            pin = torch.cuda.is_available()
            self.k_bank = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.v_bank = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            self.compilable = False
        else:
            self.register_buffer("k_bank", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer("v_bank", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)
        filter_cache.group.append(self)

    @property
    def filter(self) -> OmniKVFilterCache:
        return self._filter[0]

    def prompt_buffers(self, start: int, end: int) -> tuple[Tensor, Tensor] | None:
        if self.offload:
            return None  # computed on the device, then copied to the host bank
        return self.k_bank[:, :, start:end], self.v_bank[:, :, start:end]

    def store_prompt(self, k: Tensor, v: Tensor, q_obs: Tensor, start: int = 0) -> None:
        end = start + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"prompt of {end} tokens exceeds the cache ({self.max_seq_len})")
        if not same_view(k, self.k_bank[:, :, start:end]):
            self.k_bank[:, :, start:end].copy_(k)
            self.v_bank[:, :, start:end].copy_(v)

    def append(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        end = start + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(f"a chunk ending at position {end} exceeds the cache "
                             f"({self.max_seq_len} tokens)")
        self.k_bank[:, :, start:end].copy_(k)
        self.v_bank[:, :, start:end].copy_(v)
        keys = self.k_bank[:, :, :end].to(q.device)  # offload: this layer's K/V, once
        values = self.v_bank[:, :, :end].to(q.device)
        return causal_attention(q, keys, values, start)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        f = self.filter
        B, Hkv, n = self.batch_size, self.n_kv_heads, f.k_select
        if self.offload:
            p = f.host_pos
            self.k_bank[:, :, p].copy_(k[:, :, 0], non_blocking=True)
            self.v_bank[:, :, p].copy_(v[:, :, 0], non_blocking=True)
            ks = f.pack[self._group_index, 0]  # (B, H_kv, n, D)
            vs = f.pack[self._group_index, 1]
        else:
            self.k_bank.index_copy_(2, input_pos, k)
            self.v_bank.index_copy_(2, input_pos, v)
            ix = f.selected[:, None, :, None].expand(B, Hkv, n, self.head_dim)
            ks, vs = self.k_bank.gather(2, ix), self.v_bank.gather(2, ix)
        keys, values = torch.cat([ks, k], dim=2), torch.cat([vs, v], dim=2)
        valid = torch.cat([f.selected_valid, f.selected_valid.new_ones(B, 1)], dim=1)
        return attend(q, keys, values, valid[:, None, None, :])  # (B, H, 1, D)

    def read_positions(self, input_pos: int) -> Tensor:
        """Positions (B, H_kv, t) the last step read: the selection and the new token."""
        f = self.filter
        pos = torch.cat([f.selected.masked_fill(~f.selected_valid, -1),
                         f.selected.new_full((self.batch_size, 1), input_pos)], dim=1)
        return pos[:, None].expand(-1, self.n_kv_heads, -1).clone()

    def allocated_bytes(self) -> int:
        """Device bytes (the host bank is ``host_bytes``)."""
        return 0 if self.offload else super().allocated_bytes()

    def host_bytes(self) -> int:
        """Bytes of the K/V kept in host memory (offload), else 0."""
        if not self.offload:
            return 0
        return 2 * self.k_bank.numel() * self.k_bank.element_size()

    def bytes_read_per_step(self) -> int:
        t = self.filter.k_select + 1
        elt = self.k_bank.element_size()
        kv = 2 * self.batch_size * self.n_kv_heads * t * self.head_dim * elt
        return kv + self.batch_size * self.filter.k_select * 8  # the shared index

    def method_params(self) -> dict[str, Any]:
        return {**self._params, "role": "sparse", "filter_layer": self.filter.layer_idx,
                "k_select": self.filter.k_select, "offload": self.offload,
                "max_seq_len": self.max_seq_len}


def build_omnikv(args: ModelArgs, *, batch_size: int, prompt_len: int, max_new_tokens: int,
                 budget: int, dtype: torch.dtype, device, filter_layers: Sequence[int],
                 selector: str = "last", window: int = OMNIKV_WINDOW, offload: bool = False,
                 params: dict[str, Any] | None = None) -> list[KVCache]:
    """OmniKV's caches for every layer (roles from ``layer_roles``); sparse layers read
    ``budget`` pairs: ``budget - 1`` selected + the new token.

    Raises:
        ValueError: filter layers out of range, not increasing, or a budget below 2.
    """
    L = args.n_layers
    fl = list(filter_layers)
    if not fl or any(b <= a for a, b in zip(fl, fl[1:])) or fl[0] < 0 or fl[-1] >= L:
        raise ValueError(f"filter layers must be increasing layer indices in [0, {L - 1}], "
                         f"got {fl}")
    if budget < 2:
        raise ValueError("OmniKV needs a budget of at least 2 (one selected token + the new)")
    cap = prompt_len + max_new_tokens
    roles = layer_roles(L, fl)
    params = {**(params or {}), "prompt_tokens_kept": prompt_len}  # nothing is dropped
    caches: list[KVCache] = []
    current: OmniKVFilterCache | None = None
    for i, role in enumerate(roles):
        p = {**params, "role": role}
        if role == "filter":
            current = OmniKVFilterCache(i, args, batch_size, dtype, device, cap,
                                        k_select=budget - 1, selector=selector, window=window,
                                        params=p)
            caches.append(current)
        elif role == "full":
            caches.append(FullKVCache(i, args, batch_size, dtype, device, cap, params=p))
        else:
            caches.append(OmniKVSparseCache(i, args, batch_size, dtype, device, cap,
                                            filter_cache=current, offload=offload, params=p))
    if offload:
        for c in caches:
            if isinstance(c, OmniKVFilterCache):
                c.setup_offload()
    return caches


def omnikv_traffic(roles: Sequence[str], capacity: int, t: int) -> float:
    """KV pairs read per step per KV head, averaged over layers: full and filter layers read
    the whole ``capacity``, sparse layers t."""
    return sum(t if r == "sparse" else capacity for r in roles) / len(roles)


@dataclass(frozen=True, kw_only=True)
class OmniKVParams(Params):
    """OmniKV at budget t: ``filter_layers`` select ``k_select`` = t - 1 tokens (``selector``
    over ``selector_window`` queries) for the ``sparse_layers``; ``offload``: host memory."""

    filter_layers: list[int]
    sparse_layers: int
    k_select: int
    selector: str
    selector_window: int
    offload: bool


@register
class OmniKVMethod(Method):
    name = "omnikv"
    description = ("OmniKV: filter layers select t - 1 tokens for the layers after them, nothing "
                   "evicted (--offload: host memory)")
    budget_rule = ("sparse layers read t - 1 selected + the new token; filter layers "
                   "`--filter-layers` (the paper's 2,8,18 for 32 layers, scaled to other "
                   "depths); `traffic_tokens` averages every layer's reads")
    options = (FILTER_LAYERS, SELECTOR, OFFLOAD)
    cache_classes = (OmniKVFilterCache, OmniKVSparseCache)
    skip_layers = "the layers before the first filter layer attend fully (--filter-layers)"
    source = "OmniKV (Hao et al. 2025) Sec. 4, Alg. 1, Eq. 2-4"

    def derive(self, budget, prompt_len, args, options):
        if budget < 2:
            raise BudgetError("omnikv selects t - 1 tokens beside the new one: t must be >= 2")
        layers = options.get("filter_layers")
        layers = list(layers) if layers else default_filter_layers(args.n_layers)
        if any(b <= a for a, b in zip(layers, layers[1:])) or layers[0] < 0 or \
                layers[-1] >= args.n_layers:
            raise ConfigError(f"--filter-layers must be increasing layer indices in [0, "
                              f"{args.n_layers - 1}], got {layers}")
        roles = layer_roles(args.n_layers, layers)
        selector = options.get("omnikv_selector") or "last"
        note = None if roles.count("sparse") else (
            "no sparse layer: every layer attends fully (the filter layers and the layers "
            "after them leave none)")
        return OmniKVParams(
            budget=budget, compression_ratio=prompt_len / budget, filter_layers=layers,
            sparse_layers=roles.count("sparse"), k_select=budget - 1, selector=selector,
            selector_window=1 if selector == "last" else OMNIKV_WINDOW,
            offload=bool(options.get("offload")),
            traffic_tokens=omnikv_traffic(roles, prompt_len + 1, budget), note=note)

    def build(self, args, params, *, batch_size, prompt_len, max_new_tokens, dtype, device,
              options):
        return build_omnikv(args, batch_size=batch_size, prompt_len=prompt_len,
                            max_new_tokens=max_new_tokens, budget=params.budget, dtype=dtype,
                            device=device, filter_layers=params.filter_layers,
                            selector=params.selector, offload=params.offload,
                            params=params.to_dict())
