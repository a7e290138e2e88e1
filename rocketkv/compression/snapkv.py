"""SnapKV (Li et al. 2024): prompt eviction by observation-window voting, per query head.

SnapKV (snapkv.tex Sec. 4, listing): the last ``window`` prompt queries vote for prefix keys
(softmax attention weights summed over the window), the votes are pooled along the sequence
(kernel 7, avg or max, stride 1, padding kernel // 2) so neighbours of important tokens survive,
and each query head keeps its top prefix tokens plus the window. The voting (``window_votes``,
``pool_votes``), the order in which kept tokens go (``eviction_order``) and the decode-time
eviction (``VoteEvictionSelector``) are shared with SnapKV++ (``snapkv_pp.py``); RocketKV's
first stage uses the voting only.

Token budget ``t`` (RocketKV Sec. 3.5 and App. A.3): a decode step reads at most the
equivalent of t key+value pairs per layer and KV group, and the method's behaviour never
depends on the number of tokens asked for (m). The paper fixes a prompt budget P = t - m at
prefill; here the prompt is cut as the answer grows instead ("evict as the answer grows"): each
query head keeps t // G prompt tokens at prefill (its top t // G - window prefix tokens plus the
window; G query heads per KV head, the RocketKV paper's GQA baseline, which counts each query
head's prompt tokens once per query head and the answer's tokens once per group), and while
i answer tokens are cached each query head reads at most p_i = (t - i) // G prompt tokens:
whenever G * p + i would exceed t it stops attending to its lowest-voted remaining prefix token,
and once its prefix tokens are gone, to the oldest window or answer token. At the answer's last
step (i = m) this is the paper's selection at P = t - m, so the rule contains the paper's;
at every earlier step it reads at least as much of the prompt. A KV head stores the union of
its query heads' tokens with a per-query-head mask, and the ranks of each query head's kept
prefix tokens (``VoteEvictionSelector.ranks``) say which goes next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rocketkv.cache import (
    CompressedKVCache,
    KVCache,
    Selector,
    attend,
    attention_column_sums,
    current_prefill_memo,
    gather_tokens,
    prefix_attention,
    token_bytes,
)
from rocketkv.compression.registry import (
    BudgetError,
    CompressedMethod,
    Option,
    Params,
    PromptEviction,
    positive,
    register,
)
from rocketkv.model import ModelArgs

WINDOW = 32  # observation window (tokens), the SnapKV family
SNAPKV_KERNEL = 7


def _odd_positive(value: int) -> str | None:
    if value <= 0:
        return "must be positive"
    return None if value % 2 else "must be odd (pooling keeps the sequence length)"


KERNEL_SIZE = Option("kernel_size", "SnapKV/SnapKV++/RocketKV pooling kernel (odd; default 7 "
                     "for snapkv, 63/511 by prompt length for snapkv_pp and rocketkv)",
                     check=_odd_positive)
WINDOW_OPTION = Option("window", "observation window in tokens (default 32)", check=positive)
POOLING = Option("pooling", "snapkv pooling (default avg)", type=str, choices=("avg", "max"))


def window_votes(q: Tensor, k: Tensor, window: int) -> Tensor:
    """Attention weights of the last ``window`` queries on each prefix key, summed over them.

    Args:
        q: (B, H, Tq, D) queries whose last ``window`` rows are the prompt's last ``window``
            queries (the whole prompt's, or only the observation window: Tq >= window).
        k: (B, H_kv, T, D) the prompt's keys (RoPE applied), T > window.
    Returns:
        (B, H, T - window) float32: per query head, sum over window queries i of
        softmax_j(q_i . k_j / sqrt(D)) (causal over the whole prompt) at prefix keys j
        (``cache.attention_column_sums`` per query head: scores one KV head at a time, so
        the float32 transient is (B, G * window, T), 64 MiB at 128K tokens, G = 4, window 32).
    """
    T = k.shape[2]
    q_win = q[:, :, -window:]
    memo = current_prefill_memo()  # one prefill's votes, shared by the caches built from it
    key = (id(k), window, q_win.data_ptr(), tuple(q_win.shape), q_win.stride(), q_win.dtype)
    if memo is not None and key in memo:
        k_seen, k_version, q_version, votes = memo[key]
        if k_seen is k and k_version == k._version and q_version == q._version:
            return votes
    votes = attention_column_sums(q_win, k, T - window, per_query_head=True)[..., :T - window]
    if memo is not None:
        memo[key] = (k, k._version, q._version, votes)
    return votes


def pool_votes(votes: Tensor, kernel: int, kind: str) -> Tensor:
    """Pool ``votes`` (..., L) along the sequence: stride 1, padding kernel // 2, same length.

    ``kind`` is "max" or "avg" (avg counts the zero padding, as F.avg_pool1d does by default).
    """
    shape = votes.shape
    x = votes.reshape(-1, 1, shape[-1])
    if kind == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    elif kind == "avg":
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pooling must be max or avg, got {kind!r}")
    return y[..., :shape[-1]].reshape(shape)


def with_window(prefix_idx: Tensor, T: int, window: int) -> Tensor:
    """Sorted prefix indices (..., n) followed by the window positions T-window..T-1."""
    win = torch.arange(T - window, T, device=prefix_idx.device)
    prefix_idx = prefix_idx.sort(dim=-1).values
    return torch.cat([prefix_idx, win.expand(*prefix_idx.shape[:-1], window)], dim=-1)


def eviction_order(pooled: Tensor) -> Tensor:
    """The prefix positions (..., L) int64 of pooled votes ``pooled`` (..., L) in the order the
    SnapKV family gives them up: lowest vote first, equal votes (max pooling makes plateaus)
    earlier position first (a stable sort, the same on every device). A selection keeping n
    prefix tokens keeps the last n; at decode time they go from the first of those on."""
    return pooled.sort(dim=-1, stable=True).indices


def snapkv_ranked(q: Tensor, k: Tensor, keep: int, per_head: int, window: int, kernel: int,
                  pooling: str) -> tuple[Tensor, Tensor, Tensor]:
    """Original SnapKV with per-query-head selection, stored without repeating K/V, and the
    order in which each query head gives its kept prefix tokens up at decode time.

    Each query head keeps its top ``per_head - window`` prefix tokens by its pooled votes
    (``eviction_order``) plus the window. A KV head stores the union of its query heads' tokens
    (at most ``G * (per_head - window) + window <= keep``) in position order, padded with
    unselected tokens to ``keep`` slots; the returned mask says which query head may attend to
    which stored slot.

    Args:
        q: (B, H, Tq, D), its last ``window`` rows the prompt's last queries; k: (B, H_kv, T, D).
        keep: stored prompt slots per KV head (window < keep <= T).
        per_head: prompt tokens each query head keeps (window < per_head <= T).
        window, kernel, pooling: observation window (tokens), pooling kernel and kind.
    Returns:
        idx (B, H_kv, keep) int64 ascending (prompt positions of the stored slots);
        head_mask (B, H_kv, G, keep) bool;
        ranks (B, H_kv, G, keep - window) int32 at the prefix slots: the query head's rank of
        the token among its own kept prefix tokens, 0 the lowest-voted (given up first),
        -1 where the slot is not the head's.
    """
    B, H = q.shape[:2]
    T = k.shape[2]
    Hkv = k.shape[1]
    G = H // Hkv
    L, n = T - window, per_head - window
    pooled = pool_votes(window_votes(q, k, window), kernel, pooling)  # (B, H, L)
    picks = eviction_order(pooled)[..., L - n:]  # (B, H, n): each head's picks, lowest first
    rank = torch.full((B, H, L), -1, dtype=torch.int32, device=q.device)
    rank.scatter_(-1, picks, torch.arange(n, dtype=torch.int32, device=q.device).expand(B, H, n))
    rank = rank.view(B, Hkv, G, L)
    union = (rank >= 0).any(dim=2)  # (B, H_kv, L)
    # union members first, then padding tokens; the first keep - window, in position order
    order = torch.argsort((~union).to(torch.int8), dim=-1, stable=True)[..., :keep - window]
    idx = with_window(order, T, window)  # (B, H_kv, keep)
    prefix = idx[..., :keep - window]
    ranks = rank.gather(-1, prefix[:, :, None, :].expand(-1, -1, G, -1))  # (B, H_kv, G, P)
    head_mask = torch.cat([ranks >= 0, ranks.new_ones(B, Hkv, G, window, dtype=torch.bool)],
                          dim=-1)
    return idx, head_mask, ranks


def snapkv_select(q: Tensor, k: Tensor, keep: int, per_head: int, window: int, kernel: int,
                  pooling: str) -> tuple[Tensor, Tensor]:
    """``snapkv_ranked``'s idx (B, H_kv, keep) and head_mask (B, H_kv, G, keep): the prompt
    tokens SnapKV stores and which query head reads which."""
    idx, head_mask, _ = snapkv_ranked(q, k, keep, per_head, window, kernel, pooling)
    return idx, head_mask


def observation_window(budget: int, options) -> int:
    """The observation window (``--window``, default ``WINDOW``) of the SnapKV family.

    Raises:
        BudgetError: the budget is below the window.
    """
    window = options.get("window") or WINDOW
    if budget < window:
        raise BudgetError(f"below the observation window ({window} tokens)")
    return window


def compact_slots(member: Tensor, n: int, fill: Tensor) -> tuple[Tensor, Tensor]:
    """The slots where ``member`` (B, H_kv, S) bool is True, at most ``n`` per row, in
    ascending order, as fixed-size rows (static shapes: no host sync).

    Args:
        member: (B, H_kv, S) bool; n: slots per row; fill: (1,) int64, the slot padding the
            rows with fewer members (a member itself, so a reader that ignores ``picked`` sees
            no extra slot).
    Returns:
        idx (B, H_kv, n) int64, and picked (B, H_kv, n) bool: False on the padding (and
        members beyond the first n are dropped).
    """
    B, Hkv, S = member.shape
    rank = member.cumsum(dim=-1) - 1  # (B, H_kv, S) int64
    dest = torch.where(member & (rank < n), rank, n)  # n: a discarded column
    slots = torch.arange(S, device=member.device).expand(B, Hkv, S)
    idx = fill.view(1, 1, 1).expand(B, Hkv, n + 1).clone().scatter_(-1, dest, slots)
    picked = torch.arange(n, device=member.device) < member.sum(dim=-1, keepdim=True)
    return idx[..., :n], picked


class VoteEvictionSelector(Selector):
    """Decode-time attention of the SnapKV family: dense while the cache fits the budget, then
    evicting the lowest-voted kept prompt tokens, then the oldest, as the answer grows
    (``snapkv.py``'s docstring; RocketKV App. A.3 for the budget, SnapKV Sec. 4 for the votes).

    The cache's slot layout (written by the method's evictor at the end of prefill):
    slots 0 .. P - 1 hold the kept prefix tokens, P .. kept - 1 the observation window in
    position order, kept .. the answer (generated tokens, and a later turn's appended tokens)
    in order. Group-shared (SnapKV++) the prefix slots are in eviction order: slot s holds the
    token of rank s (0: lowest pooled vote, given up first), so a step reads the contiguous
    slots e .. e + t - 1 (e = ``evicted``) and no rank is stored. Per query head (original
    SnapKV, ``per_query_head``) the prefix slots hold the union of the group's picks in
    position order and ``ranks`` (B, H_kv, G, P) int32 gives each query head's rank of each
    slot (-1: not its own), filled by the evictor (``set_ranks``).

    Rule at the step that writes position ``pos`` (T prompt tokens, i = pos - T + 1 answer
    tokens cached, the step's own included): each query head (the group, when shared) reads
    p_i = min(c, max(t - i, 0) // G_a) prompt tokens, c = the prompt tokens it kept at
    prefill, G_a = G per query head (its prompt tokens count once per query head) or 1 when
    shared, and the last min(i, t) answer tokens; the prompt tokens it drops are its
    lowest-ranked prefix tokens, then the window's oldest. Shared, that is "read the last
    min(cached, t) slots in eviction order": exactly t pairs once the cache holds more than t
    tokens. At i = m it is the paper's selection for P = t - m (App. A.3).

    Args:
        budget: the token budget t (KV pairs per decode step, per layer, per KV group).
        window: the observation window (tokens), whose slots follow the prefix slots.
        per_query_head: ranks per query head (original SnapKV) instead of the shared order.
    """

    def __init__(self, budget: int, window: int, per_query_head: bool = False):
        super().__init__()
        self.budget, self.window, self.per_query_head = budget, window, per_query_head

    def layout(self, cache: CompressedKVCache) -> tuple[int, int, int, int]:
        """(G_a, c, n_prefix, P) for ``cache``: query heads a prompt token counts for, prompt
        tokens each query head (or the group) kept at prefill, how many of them are prefix
        tokens (c less the window), and the prefix slots stored per KV head. A cache without
        an evictor (a prompt no longer than the window) holds only window tokens."""
        kept = cache.kept
        w = kept if cache.evict is None else min(self.window, kept)
        if self.per_query_head:
            G = cache.n_heads // cache.n_kv_heads
            c = min(cache.prompt_len, self.budget // G)
        else:
            G, c = 1, kept
        return G, c, c - w, kept - w

    def reads(self, cache: CompressedKVCache) -> int:
        """Slots one step gathers per KV head: min(t, the buffer's length)."""
        return min(self.budget, cache.length)

    def allocate(self, cache: CompressedKVCache) -> None:
        if self.per_query_head:
            G = cache.n_heads // cache.n_kv_heads
            P = self.layout(cache)[3]
            self.register_buffer("ranks", torch.full(
                (cache.batch_size, cache.n_kv_heads, G, P), -1, dtype=torch.int32,
                device=cache.device), persistent=False)

    def set_ranks(self, ranks: Tensor) -> None:
        """Take each query head's ranks of the stored prefix slots, (B, H_kv, G, P) int32
        (``snapkv_ranked``), from the evictor at the end of prefill."""
        self.ranks.copy_(ranks)

    def evicted(self, cache: CompressedKVCache, pos: Tensor) -> Tensor:
        """e (1,) int64: how many of its kept tokens each query head (the group, shared) has
        given up at the step that writes position ``pos`` (1,) int64, in rank order (prefix
        tokens by rank, then window and answer tokens by age): c - p_i + max(i - t, 0). A
        tensor op on the device: no host sync, one graph for every step."""
        G, c, _, _ = self.layout(cache)
        i = pos + (1 - cache.prompt_len)  # answer tokens cached, the step's own included
        room = (self.budget - i).clamp(min=0)
        prompt = (room if G == 1 else torch.div(room, G, rounding_mode="floor")).clamp(max=c)
        return (c - prompt) + (i - self.budget).clamp(min=0)

    def attended(self, cache: CompressedKVCache, pos: Tensor) -> Tensor:
        """(B, H_kv, G or 1, S) bool: the slots each query head (one row per group, shared)
        reads at the step that writes position ``pos`` (1,) int64."""
        _, _, n_prefix, P = self.layout(cache)
        e = self.evicted(cache, pos)
        last = pos - cache.slot_offset  # the step's own slot
        slots = torch.arange(cache.length, device=pos.device)
        B, Hkv = cache.batch_size, cache.n_kv_heads
        if not self.per_query_head:  # slots in eviction order: the last min(cached, t)
            return ((slots >= e) & (slots <= last)).expand(B, Hkv, 1, cache.length)
        recent = slots[P:]
        recent = (recent - P >= e - n_prefix) & (recent <= last)  # window and answer, by age
        G = self.ranks.shape[2]
        return torch.cat([self.ranks >= e, recent.expand(B, Hkv, G, recent.shape[0])], dim=-1)

    def shared_slots(self, cache: CompressedKVCache, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Group-shared: the ``reads`` contiguous slots e .. e + n - 1 (e = ``evicted``) the
        step that writes ``pos`` (1,) int64 reads, (n,) int64, and which are written, (n,)
        bool (all once the cache holds t tokens)."""
        idx = self.evicted(cache, pos) + torch.arange(self.reads(cache), device=pos.device)
        return idx, idx <= pos - cache.slot_offset

    def read_slots(self, cache: CompressedKVCache, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The slots the step that writes ``pos`` (1,) int64 gathers, (B, H_kv, n) int64 with
        n = ``reads``, and which query head reads each, (B, H_kv, G or 1, n) bool."""
        n = self.reads(cache)
        B, Hkv = cache.batch_size, cache.n_kv_heads
        if not self.per_query_head:
            idx, mask = self.shared_slots(cache, pos)
            return idx.expand(B, Hkv, n), mask.expand(B, Hkv, 1, n)
        att = self.attended(cache, pos)  # (B, H_kv, G, S)
        idx, picked = compact_slots(att.any(dim=2), n, pos - cache.slot_offset)
        mask = att.gather(-1, idx[:, :, None].expand(-1, -1, att.shape[2], -1))
        return idx, mask & picked[:, :, None]

    def attend(self, cache: CompressedKVCache, q: Tensor, pos: Tensor) -> Tensor:
        """Attention output (B, H, 1, D) of q over the slots ``attended`` says, for the token
        at ``pos`` (1,) int64 just written: group-shared, the ``reads`` contiguous slots from
        ``evicted`` on (``index_select``; dense ``prefix_attention`` where the buffer holds no
        more than t slots, so nothing is ever evicted); per query head, the union of the
        group's slots gathered (at most t: G p_i + i <= t) and masked per query head."""
        dense = self.reads(cache) == cache.length
        if not self.per_query_head:
            if dense:
                return prefix_attention(q, cache.k_cache, cache.v_cache, None, pos,
                                        cache.slot_offset)
            idx, mask = self.shared_slots(cache, pos)  # (n,), (n,)
            return attend(q, cache.k_cache.index_select(2, idx),
                          cache.v_cache.index_select(2, idx), mask)
        if dense:
            return attend(q, cache.k_cache, cache.v_cache, self.attended(cache, pos))
        idx, mask = self.read_slots(cache, pos)  # (B, H_kv, n), (B, H_kv, G, n)
        return attend(q, gather_tokens(cache.k_cache, idx), gather_tokens(cache.v_cache, idx),
                      mask)

    def select(self, cache: CompressedKVCache, q: Tensor, valid: Tensor) -> Tensor:
        """The slots (B, H_kv, n) int64 ``attend`` gathers given the written slots ``valid``
        (S,) bool (the last one the step's own); per query head, the union of the group's."""
        pos = valid.sum(dim=0, keepdim=True) - 1 + cache.slot_offset
        return self.read_slots(cache, pos)[0]

    def bytes_read(self, cache: CompressedKVCache) -> int:
        """Bytes of a full step: min(t, capacity) key+value pairs (contiguous when shared;
        gathered rows in whole sectors per query head's union, plus the int32 ranks, per
        query head)."""
        n = min(self.budget, cache.capacity)
        if not self.per_query_head:
            return cache.kv_bytes(n)
        rows = cache.kv_bytes(cache.capacity) if n == cache.length else token_bytes(cache, n)
        return rows + self.ranks.numel() * self.ranks.element_size()

    def ideal_bytes(self, cache: CompressedKVCache) -> int:
        """min(t, capacity) key+value pairs: t once the cache holds more than t tokens."""
        return cache.kv_bytes(min(self.budget, cache.capacity))

    def params(self) -> dict[str, Any]:
        return {"selection": "vote_eviction", "k": self.budget,
                **({"per_query_head": True} if self.per_query_head else {})}


@dataclass(frozen=True, kw_only=True)
class SnapKVParams(PromptEviction, Params):
    """SnapKV at budget t: each query head keeps ``per_head_keep`` = min(T, t // G) prompt
    tokens at prefill, a KV head stores ``keep`` slots (the union of its group's), pooling;
    ``evict`` (internal): the prompt is longer than the window, so the votes rank it."""

    per_head_keep: int
    pooling: str
    kernel_size: int


@register
class SnapKVMethod(CompressedMethod):
    name = "snapkv"
    description = ("SnapKV: per-head observation-window voting; each query head keeps t // G "
                   "prompt tokens, evicting more as the answer grows")
    budget_rule = ("t // G prompt tokens per query head at prefill; as i answer tokens are cached "
                   "each head reads (t - i) // G (its lowest-voted go first, then the oldest); "
                   "window 32, kernel 7, avg pooling")
    options = (KERNEL_SIZE, POOLING, WINDOW_OPTION)
    per_head_mask = True
    source = "SnapKV (Li et al. 2024) Sec. 4; RocketKV App. A.3"

    def derive(self, budget, prompt_len, args, options):
        window = observation_window(budget, options)
        G = args.group_size
        per_head = budget // G
        if per_head <= window:
            raise BudgetError(f"each query head's share t // G = {budget} // {G} = {per_head} "
                              f"does not exceed the observation window ({window})")
        prefix = per_head - window  # prompt tokens each query head keeps beside the window
        degenerate = None if prefix >= window or prompt_len <= per_head else (
            f"each query head keeps {prefix} prompt tokens beside its {window}-token window "
            f"(t // G = {budget} // {G}; at least {2 * window * G} keeps the window's worth)")
        return SnapKVParams(
            budget=budget, compression_ratio=prompt_len / budget, window=window,
            degenerate=degenerate, per_head_keep=min(prompt_len, per_head),
            pooling=options.get("pooling") or "avg",
            kernel_size=options.get("kernel_size") or SNAPKV_KERNEL,
            keep=min(prompt_len, G * (per_head - window) + window),
            evict=prompt_len > window)

    def selector(self, params):
        return VoteEvictionSelector(params.budget, params.window, per_query_head=True)

    def evictor(self, params, selector: VoteEvictionSelector | None = None):
        """``evict(q, k) -> (idx, head_mask)`` (``snapkv_ranked``), handing the ranks to
        ``selector`` when given; None for a prompt no longer than the window."""
        if not params.evict:
            return None
        p = params

        def evict(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
            idx, head_mask, ranks = snapkv_ranked(q, k, p.keep, p.per_head_keep, p.window,
                                                  p.kernel_size, p.pooling)
            if selector is not None:
                selector.set_ranks(ranks)
            return idx, head_mask

        return evict

    def build_layer(self, layer: int, args: ModelArgs, params: Params, *, batch_size: int,
                    prompt_len: int, max_new_tokens: int, dtype: torch.dtype,
                    device) -> KVCache:
        """``CompressedMethod.build_layer`` with one selector shared by the evictor, which
        hands it each query head's ranks at the end of prefill."""
        selector = self.selector(params)
        evict = self.evictor(params, selector)
        return CompressedKVCache(
            layer, args, batch_size, dtype, device, prompt_len=prompt_len,
            prompt_capacity=min(prompt_len, params.keep), max_new_tokens=max_new_tokens,
            selector=selector, evict=evict, per_head=evict is not None,
            obs_window=params.window, params=params.to_dict())
