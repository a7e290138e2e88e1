"""SnapKV and SnapKV++: prompt eviction by observation-window voting.

SnapKV (snapkv.tex Sec. 4, listing): the last ``window`` prompt queries vote for prefix keys
(softmax attention weights summed over the window), the votes are pooled along the sequence
(kernel 7, avg or max, stride 1, padding kernel // 2) so neighbours of important tokens survive,
and each query head keeps its top ``prompt_budget - window`` prefix tokens plus the window.

SnapKV++ (RocketKV paper, Sec. 3.3, Alg. 1): the votes are also summed over the query heads of
each KV group, so one selection is shared by the group (GQA-compatible), pooling is max-pooling,
and the kernel adapts to the prompt length (63 below a model's threshold, 511 from it on).

Adaptive kernel threshold (``snapkv_pp_kernel``), derived from the model config rather than looked
up by name, so every checkpoint of a model (HF directory, GGUF) gets the same rule. The paper's
thresholds (RocketKV Sec. 4.4.2 and App. A.3) are Llama3.1-8B 48K (context 131072, llama3 RoPE
scaling), LongChat-7B-v1.5 12K (context 32768, linear RoPE scaling, factor 8) and Mistral-7B-v0.2
none, always 63 (context 32768 native, rope theta 1e6, no RoPE scaling). Both thresholds are 3/8
of the model's context (49152 = 3/8 * 131072, 12288 = 3/8 * 32768), and both models reach that
context by RoPE scaling, which Mistral lacks. Rule: kernel 511 when the config has RoPE scaling
and the prompt has at least ``3 * max_seq_len // 8`` tokens, else 63.

Token budget ``t`` (RocketKV Sec. 3.5 and App. A.3): both methods compress only the prompt and
read everything they keep, so the prompt budget is ``t - max_new_tokens``. The SnapKV baseline on
GQA models divides it by the group size, because each query head keeps its own tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kv_cache import attention_column_sums
from model import ModelArgs

WINDOW = 32  # observation window (tokens), both methods
SNAPKV_KERNEL = 7
SNAPKV_PP_KERNELS = (63, 511)  # (below the threshold, at or above it)


_VOTES_MEMO: ContextVar[dict | None] = ContextVar("window_votes_memo", default=None)


@contextmanager
def shared_window_votes(memo: dict) -> Iterator[None]:
    """Within the block, ``window_votes`` stores its result in ``memo`` and returns the stored
    one when asked again for the same key tensor (the same object, not modified since) and the
    same window queries (the same memory) and window length.

    Every SnapKV-family cache built from one shared prefill scores the same prompt keys with the
    same observation window, so the votes (the costly part of eviction: ``window`` x T scores
    per query head) need computing once per layer and window, not once per method and budget.
    The memo keeps the key tensors it saw alive, so an identity check cannot be fooled by a
    freed tensor's reused address. Give it the lifetime of the prefill (``PrefilledPrompt``).
    """
    token = _VOTES_MEMO.set(memo)
    try:
        yield
    finally:
        _VOTES_MEMO.reset(token)


def window_votes(q: Tensor, k: Tensor, window: int) -> Tensor:
    """Attention weights of the last ``window`` queries on each prefix key, summed over them.

    Args:
        q: (B, H, Tq, D) queries whose last ``window`` rows are the prompt's last ``window``
            queries (the whole prompt's, or only the observation window: Tq >= window).
        k: (B, H_kv, T, D) the prompt's keys (RoPE applied), T > window.
    Returns:
        (B, H, T - window) float32: per query head, sum over window queries i of
        softmax_j(q_i . k_j / sqrt(D)) (causal over the whole prompt) at prefix keys j
        (``kv_cache.attention_column_sums`` per query head: scores one KV head at a time, so
        the float32 transient is (B, G * window, T), 64 MiB at 128K tokens, G = 4, window 32).
    """
    T = k.shape[2]
    q_win = q[:, :, -window:]
    memo = _VOTES_MEMO.get()
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


def _with_window(prefix_idx: Tensor, T: int, window: int) -> Tensor:
    """Sorted prefix indices (..., n) followed by the window positions T-window..T-1."""
    win = torch.arange(T - window, T, device=prefix_idx.device)
    prefix_idx = prefix_idx.sort(dim=-1).values
    return torch.cat([prefix_idx, win.expand(*prefix_idx.shape[:-1], window)], dim=-1)


def snapkv_pp_select(q: Tensor, k: Tensor, keep: int, window: int, kernel: int) -> Tensor:
    """SnapKV++ (Alg. 1): token indices kept per KV head, shared by its query group.

    Args:
        q: (B, H, Tq, D), its last ``window`` rows the prompt's last queries; k: (B, H_kv, T, D);
        keep: prompt tokens to keep (window < keep < T).
    Returns:
        (B, H_kv, keep) int64, ascending: top ``keep - window`` prefix tokens by max-pooled
        group-summed votes, then the ``window`` observation tokens.
    """
    B, H = q.shape[:2]
    T = k.shape[2]
    Hkv = k.shape[1]
    votes = window_votes(q, k, window).view(B, Hkv, H // Hkv, T - window).sum(dim=2)
    pooled = pool_votes(votes, kernel, "max")
    return _with_window(pooled.topk(keep - window, dim=-1).indices, T, window)


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
    idx = _with_window(order, T, window)  # (B, H_kv, keep)
    prefix = idx[..., :keep - window]
    mask = chosen.gather(-1, prefix[:, :, None, :].expand(-1, -1, G, -1))
    head_mask = torch.cat([mask, mask.new_ones(B, Hkv, G, window)], dim=-1)
    return idx, head_mask


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
        ``compression.derive``.
    """
    small, large = SNAPKV_PP_KERNELS
    scaled = args.rope_scaling is not None
    return large if scaled and prompt_len >= 3 * args.max_seq_len // 8 else small
