"""SnapKV (Li et al. 2024): prompt eviction by observation-window voting, per query head.

SnapKV (snapkv.tex Sec. 4, listing): the last ``window`` prompt queries vote for prefix keys
(softmax attention weights summed over the window), the votes are pooled along the sequence
(kernel 7, avg or max, stride 1, padding kernel // 2) so neighbours of important tokens survive,
and each query head keeps its top ``prompt_budget - window`` prefix tokens plus the window.
The voting (``window_votes``, ``pool_votes``) is shared with SnapKV++ (``snapkv_pp.py``) and
RocketKV's first stage.

Token budget ``t`` (RocketKV Sec. 3.5 and App. A.3): SnapKV compresses only the prompt and
reads everything it keeps, so the prompt budget is P = t - max_new_tokens; on GQA models each
query head keeps its own P // G tokens (the RocketKV paper's GQA baseline), and a KV head stores
the union of its query heads' tokens with a per-query-head mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rocketkv.cache import attention_column_sums, current_prefill_memo
from rocketkv.compression.registry import (
    BudgetError,
    CompressedMethod,
    Option,
    Params,
    PromptEviction,
    positive,
    register,
)

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


def snapkv_select(q: Tensor, k: Tensor, keep: int, per_head: int, window: int, kernel: int,
                  pooling: str) -> tuple[Tensor, Tensor]:
    """Original SnapKV with per-query-head selection, stored without repeating K/V.

    Each query head keeps its top ``per_head - window`` prefix tokens plus the window. A KV
    head stores the union of its query heads' tokens (at most ``G * (per_head - window) +
    window <= keep``), padded with unselected tokens to ``keep`` slots; the returned mask says
    which query head may attend to which stored slot.

    Args:
        q: (B, H, Tq, D), its last ``window`` rows the prompt's last queries; k: (B, H_kv, T, D);
        keep: stored prompt slots per KV head;
        per_head: tokens each query head keeps (window < per_head, G * per_head <= keep + ...).
    Returns:
        idx (B, H_kv, keep) int64 ascending, and head_mask (B, H_kv, G, keep) bool.
    """
    B, H = q.shape[:2]
    T = k.shape[2]
    Hkv = k.shape[1]
    G = H // Hkv
    L = T - window
    pooled = pool_votes(window_votes(q, k, window), kernel, pooling)  # (B, H, L)
    chosen = torch.zeros(B, H, L, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, pooled.topk(per_head - window, dim=-1).indices, True)
    chosen = chosen.view(B, Hkv, G, L)
    union = chosen.any(dim=2)  # (B, H_kv, L)
    # union members first (in position order), then padding tokens; keep the first keep-window
    order = torch.argsort((~union).to(torch.int8), dim=-1, stable=True)[..., :keep - window]
    idx = with_window(order, T, window)  # (B, H_kv, keep)
    prefix = idx[..., :keep - window]
    mask = chosen.gather(-1, prefix[:, :, None, :].expand(-1, -1, G, -1))
    head_mask = torch.cat([mask, mask.new_ones(B, Hkv, G, window)], dim=-1)
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


def prompt_budget(budget: int, new_tokens: int, options) -> tuple[int, int]:
    """(window, prompt budget t - m) of SnapKV and SnapKV++, which compress only the prompt
    and read every token they keep (RocketKV Sec. 3.5, App. A.3).

    Raises:
        BudgetError: the budget is below the window, or leaves no prompt budget.
    """
    window = observation_window(budget, options)
    p = budget - new_tokens
    if p <= 0:
        raise BudgetError(f"the prompt budget t - max_new_tokens = {p} is not positive")
    return window, p


@dataclass(frozen=True, kw_only=True)
class SnapKVParams(PromptEviction, Params):
    """SnapKV at budget t: the prompt budget t - m, ``per_head_budget`` = (t - m) // G tokens
    per query head, ``keep`` slots per KV head (the union of its group's), pooling."""

    prompt_budget: int
    per_head_budget: int
    pooling: str
    kernel_size: int


@register
class SnapKVMethod(CompressedMethod):
    name = "snapkv"
    description = "SnapKV: per-head observation-window voting evicts prompt tokens (budget t - m)"
    budget_rule = "prompt budget (t - m) // G per query head; window 32, kernel 7, avg pooling"
    options = (KERNEL_SIZE, POOLING, WINDOW_OPTION)
    per_head_mask = True
    source = "SnapKV (Li et al. 2024) Sec. 4; RocketKV App. A.3"

    def derive(self, budget, prompt_len, new_tokens, args, options):
        window, budget_p = prompt_budget(budget, new_tokens, options)
        per_head = budget_p // args.group_size
        if per_head <= window:
            raise BudgetError(f"the per-head prompt budget (t - m) // G = {per_head} does "
                              f"not exceed the observation window ({window})")
        return SnapKVParams(
            budget=budget, compression_ratio=prompt_len / budget, window=window,
            prompt_budget=budget_p, per_head_budget=per_head,
            pooling=options.get("pooling") or "avg",
            kernel_size=options.get("kernel_size") or SNAPKV_KERNEL,
            keep=min(prompt_len, args.group_size * (per_head - window) + window),
            evict=prompt_len > per_head)

    def evictor(self, p):
        if not p.evict:
            return None
        keep, per_head, window = p.keep, p.per_head_budget, p.window
        kernel, pooling = p.kernel_size, p.pooling
        return lambda q, k: snapkv_select(q, k, keep, per_head, window, kernel, pooling)
