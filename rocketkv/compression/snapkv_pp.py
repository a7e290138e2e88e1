"""SnapKV++ (RocketKV paper, Sec. 3.3, Alg. 1): group-shared observation-window voting.

The SnapKV votes (``snapkv.window_votes``) are also summed over the query heads of each KV
group, so one selection is shared by the group (GQA-compatible), pooling is max-pooling, and the
kernel adapts to the prompt length (63 below a model's threshold, 511 from it on).

Adaptive kernel threshold (``snapkv_pp_kernel``), derived from the model config rather than looked
up by name, so every checkpoint of a model (HF directory, GGUF) gets the same rule. The paper's
thresholds (RocketKV Sec. 4.4.2 and App. A.3) are Llama3.1-8B 48K (context 131072, llama3 RoPE
scaling), LongChat-7B-v1.5 12K (context 32768, linear RoPE scaling, factor 8) and Mistral-7B-v0.2
none, always 63 (context 32768 native, rope theta 1e6, no RoPE scaling). Both thresholds are 3/8
of the model's context (49152 = 3/8 * 131072, 12288 = 3/8 * 32768), and both models reach that
context by RoPE scaling, which Mistral lacks. Rule: kernel 511 when the config has RoPE scaling
and the prompt has at least ``3 * max_seq_len // 8`` tokens, else 63.

Token budget ``t`` (RocketKV Sec. 3.5 and App. A.3): a decode step reads at most t key+value
pairs per layer and KV group, and the method's behaviour never depends on the number of tokens
asked for (m). The paper keeps a prompt budget P = t - m at prefill; here the prompt is cut as
the answer grows instead ("evict as the answer grows"): at the end of prefill each KV head keeps
min(T, t) prompt tokens, the window plus its top t - window prefix tokens by the group's pooled
votes, stored lowest vote first (``snapkv_pp_order``). While the kept and generated tokens number
at most t, a step attends to all of them; beyond that, each generated token evicts (no longer
attends to) the lowest-voted remaining prefix token, and once none remains, the oldest window
or generated token (a recent window): a step reads exactly t tokens
(``snapkv.VoteEvictionSelector``). The set read at the step with i generated tokens cached
contains the paper's set for m = i (top t - i prefix tokens, the window, the i generated ones),
so the paper's rule is this one's last step. RocketKV's first stage (``rocketkv.py``) is
SnapKV++'s selection (``snapkv_pp_select``) with its own keep count and no decode-time eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rocketkv.compression.registry import (
    BudgetError,
    CompressedMethod,
    Params,
    PromptEviction,
    register,
)
from rocketkv.compression.snapkv import (
    KERNEL_SIZE,
    WINDOW_OPTION,
    VoteEvictionSelector,
    eviction_order,
    observation_window,
    pool_votes,
    window_votes,
    with_window,
)
from rocketkv.model import ModelArgs

SNAPKV_PP_KERNELS = (63, 511)  # (below the threshold, at or above it)


def group_votes(q: Tensor, k: Tensor, window: int, kernel: int) -> Tensor:
    """SnapKV++'s scores (Alg. 1): the window's votes (``snapkv.window_votes``) summed over each
    query group, max-pooled with ``kernel``.

    Args:
        q: (B, H, Tq, D), its last ``window`` rows the prompt's last queries; k: (B, H_kv, T, D).
    Returns:
        (B, H_kv, T - window) float32, one score per prefix token and KV head.
    """
    B, H = q.shape[:2]
    T = k.shape[2]
    Hkv = k.shape[1]
    votes = window_votes(q, k, window).view(B, Hkv, H // Hkv, T - window).sum(dim=2)
    return pool_votes(votes, kernel, "max")


def snapkv_pp_select(q: Tensor, k: Tensor, keep: int, window: int, kernel: int) -> Tensor:
    """SnapKV++ (Alg. 1): token indices kept per KV head, shared by its query group (RocketKV's
    first stage).

    Args:
        q: (B, H, Tq, D), its last ``window`` rows the prompt's last queries; k: (B, H_kv, T, D);
        keep: prompt tokens to keep (window < keep < T).
    Returns:
        (B, H_kv, keep) int64, ascending: top ``keep - window`` prefix tokens by max-pooled
        group-summed votes (``group_votes``), then the ``window`` observation tokens.
    """
    T = k.shape[2]
    pooled = group_votes(q, k, window, kernel)
    return with_window(pooled.topk(keep - window, dim=-1).indices, T, window)


def snapkv_pp_order(q: Tensor, k: Tensor, keep: int, window: int, kernel: int) -> Tensor:
    """SnapKV++'s kept prompt tokens in the order the method evicts them at decode time.

    Args:
        q: (B, H, Tq, D), its last ``window`` rows the prompt's last queries; k: (B, H_kv, T, D);
        keep: prompt tokens to keep (window < keep <= T).
    Returns:
        (B, H_kv, keep) int64: the top ``keep - window`` prefix tokens by ``group_votes``,
        lowest vote first (``snapkv.eviction_order``: equal votes, earlier position first),
        then the ``window`` observation tokens in position order. The cache stores them in
        this order, so the slots a step reads are contiguous
        (``snapkv.VoteEvictionSelector``).
    """
    T = k.shape[2]
    L = T - window
    prefix = eviction_order(group_votes(q, k, window, kernel))[..., L - (keep - window):]
    win = torch.arange(L, T, device=prefix.device)
    return torch.cat([prefix, win.expand(*prefix.shape[:-1], window)], dim=-1)


def snapkv_pp_kernel(args: ModelArgs, prompt_len: int) -> int:
    """Adaptive SnapKV++ max-pooling kernel (RocketKV Sec. 3.3, Sec. 4.4.2, App. A.3).

    Rule: 511 when ``args.rope_scaling is not None`` and ``prompt_len >= 3 * args.max_seq_len
    // 8``, else 63.

    Derivation: the paper's empirically chosen thresholds are 48K tokens for Llama3.1-8B
    (max_seq_len 131072, llama3 RoPE scaling: 3/8 * 131072 = 49152 = 48K) and 12K for
    LongChat-7B-v1.5 (max_seq_len 32768, linear RoPE scaling factor 8: 3/8 * 32768 = 12288 =
    12K); Mistral-7B-v0.2 (max_seq_len 32768 reached natively with rope theta 1e6, no scaling)
    always uses 63. The rule reproduces all three from the config alone, whatever the
    checkpoint is called (a GGUF Llama 3.1 carries its scaling as ``freq_factors``, which
    counts as scaling). The released code pools with 63 always.

    Args:
        args: the model config (``rope_scaling`` and ``max_seq_len``, tokens, are read).
        prompt_len: prompt tokens T.
    Returns:
        The odd kernel size in tokens (63 or 511); ``--kernel-size`` overrides it in
        ``SnapKVPPMethod.derive``.
    """
    small, large = SNAPKV_PP_KERNELS
    scaled = args.rope_scaling is not None
    return large if scaled and prompt_len >= 3 * args.max_seq_len // 8 else small


@dataclass(frozen=True, kw_only=True)
class SnapKVPPEviction(PromptEviction):
    """SnapKV++'s eviction (also RocketKV's stage 1): ``keep`` tokens per KV head, shared by
    the group, votes max-pooled with ``kernel_size``."""

    pooling: str
    kernel_size: int


@dataclass(frozen=True, kw_only=True)
class SnapKVPPParams(SnapKVPPEviction, Params):
    """SnapKV++ at budget t: ``keep`` = min(T, t) prompt tokens per KV head at prefill, shared
    by the group, then evicted as the answer grows (``snapkv.VoteEvictionSelector``);
    ``evict`` (internal): the prompt is longer than the window, so the votes order it."""


def snapkv_pp_evictor(params: SnapKVPPEviction):
    """SnapKV++'s ``evict(q_obs, k) -> (idx, None)`` as RocketKV's first stage uses it: the
    ``keep`` kept tokens ascending (``snapkv_pp_select``; ``evict`` False: None)."""
    if not params.evict:
        return None
    keep, window, kernel = params.keep, params.window, params.kernel_size
    return lambda q, k: (snapkv_pp_select(q, k, keep, window, kernel), None)


@register
class SnapKVPPMethod(CompressedMethod):
    name = "snapkv_pp"
    description = "SnapKV++: group-shared voting, adaptive max-pool kernel (RocketKV Alg. 1)"
    budget_rule = ("min(T, t) prompt tokens per KV head at prefill, shared by the group; beyond t "
                   "cached tokens each new one evicts the lowest-voted, then the oldest; window "
                   "32, max pooling, kernel 63, or 511 when the model reaches its context by RoPE "
                   "scaling and T >= 3/8 of that context")
    options = (KERNEL_SIZE, WINDOW_OPTION)
    source = "RocketKV Sec. 3.3, Alg. 1, App. A.3"

    def derive(self, budget, prompt_len, args, options):
        window = observation_window(budget, options)
        if budget <= window:
            raise BudgetError(f"the budget t = {budget} does not exceed the observation window "
                              f"({window})")
        return SnapKVPPParams(
            budget=budget, compression_ratio=prompt_len / budget, window=window,
            kernel_size=options.get("kernel_size") or snapkv_pp_kernel(args, prompt_len),
            pooling="max", keep=min(prompt_len, budget), evict=prompt_len > window)

    def evictor(self, params):
        """``evict(q_obs, k) -> (idx, None)``: the kept tokens in eviction order
        (``snapkv_pp_order``); None for a prompt no longer than the window."""
        if not params.evict:
            return None
        keep, window, kernel = params.keep, params.window, params.kernel_size
        return lambda q, k: (snapkv_pp_order(q, k, keep, window, kernel), None)

    def selector(self, params):
        return VoteEvictionSelector(params.budget, params.window)
