"""compression/snapkv.py against slow loop references (SnapKV listing, RocketKV Alg. 1)."""

import math

import pytest
import torch

from rocketkv.cache import prefill_memo
from rocketkv.compression.snapkv import pool_votes, snapkv_select, window_votes
from rocketkv.compression.snapkv_pp import snapkv_pp_kernel, snapkv_pp_select
from rocketkv.model import CONFIGS, ModelArgs


def slow_votes(q, k, window):
    """Per query head: sum over window queries of softmax attention on each prefix key."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, T - window)
    for b in range(B):
        for h in range(H):
            for i in range(T - window, T):
                s = torch.tensor([float(q[b, h, i] @ k[b, h // G, j]) / math.sqrt(D)
                                  for j in range(i + 1)])
                p = torch.softmax(s, 0)
                for j in range(T - window):
                    out[b, h, j] += p[j]
    return out


def slow_pool(x, kernel, kind):
    L = x.shape[-1]
    out = torch.empty_like(x)
    for j in range(L):
        lo, hi = j - kernel // 2, j + kernel // 2
        vals = [x[..., i] for i in range(max(lo, 0), min(hi, L - 1) + 1)]
        stacked = torch.stack(vals, -1)
        out[..., j] = stacked.amax(-1) if kind == "max" else stacked.sum(-1) / kernel
    return out


def is_top(scores, chosen, n):
    """``chosen`` (set of n indices) is a valid top-n of ``scores`` (1-D), ties allowed."""
    rest = [s for i, s in enumerate(scores.tolist()) if i not in chosen]
    return len(chosen) == n and (not rest or min(float(scores[i]) for i in chosen)
                                 >= max(rest) - 1e-6)


@pytest.fixture
def qk():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 8, generator=g)
    k = torch.randn(2, 2, 40, 8, generator=g)
    return q, k


def test_a_prefill_memo_scores_each_window_once(qk, monkeypatch):
    """Inside ``kv_cache.prefill_memo`` the SnapKV family asks for the votes of one prefill's
    window once per window length: the selections are those computed without the memo, a key
    tensor changed in place (or another window) is scored afresh."""
    from rocketkv.compression import snapkv

    q, k = qk
    expect_pp = snapkv_pp_select(q, k, 20, 8, 5)
    expect = snapkv_select(q, k, 20, 10, 8, 5, "avg")
    calls = []
    real = snapkv.attention_column_sums
    monkeypatch.setattr(snapkv, "attention_column_sums",
                        lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    memo = {}
    with prefill_memo(memo):
        assert torch.equal(snapkv_pp_select(q, k, 20, 8, 5), expect_pp)
        assert torch.equal(snapkv_pp_select(q, k, 24, 8, 9), snapkv_pp_select(q, k, 24, 8, 9))
        got = snapkv_select(q, k, 20, 10, 8, 5, "avg")
        assert all(torch.equal(a, b) for a, b in zip(got, expect))
        assert calls == [8]  # one window: scored once
        snapkv_pp_select(q[:, :, -16:], k, 20, 16, 5)  # another window: scored
        assert calls == [8, 16]
        k2 = k.clone()
        before = snapkv_pp_select(q, k2, 20, 8, 5)
        k2[:, :, :20] *= -1  # the same tensor, changed: scored again
        after = snapkv_pp_select(q, k2, 20, 8, 5)
        assert calls == [8, 16, 8, 8] and torch.equal(before, expect_pp)
        assert not torch.equal(after, before)
    calls.clear()
    snapkv_pp_select(q, k, 20, 8, 5)  # outside the block: no memo
    snapkv_pp_select(q, k, 20, 8, 5)
    assert calls == [8, 8]


def test_window_votes_match_loops(qk):
    q, k = qk
    assert torch.allclose(window_votes(q, k, 6), slow_votes(q, k, 6), atol=1e-5)
    # only the observation window's queries are needed (what prefill hands the cache)
    assert torch.equal(window_votes(q[:, :, -6:], k, 6), window_votes(q, k, 6))


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7, 63])
def test_pooling_matches_loops(kind, kernel):
    x = torch.rand(2, 3, 30)
    assert torch.allclose(pool_votes(x, kernel, kind), slow_pool(x, kernel, kind), atol=1e-6)


def test_snapkv_pp_selection_is_group_shared_top_k_plus_window(qk):
    q, k = qk
    T, window, keep, kernel = 40, 6, 16, 3
    idx = snapkv_pp_select(q, k, keep, window, kernel)
    assert idx.shape == (2, 2, keep)
    votes = slow_votes(q, k, window)
    for b in range(2):
        for kv in range(2):
            group = votes[b, 2 * kv] + votes[b, 2 * kv + 1]  # sum over the group's heads
            pooled = slow_pool(group, kernel, "max")
            sel = idx[b, kv].tolist()
            assert sel == sorted(sel) and sel[-window:] == list(range(T - window, T))
            assert is_top(pooled, set(sel[:-window]), keep - window)


def test_snapkv_per_head_selection_and_union_storage(qk):
    q, k = qk
    T, window, per_head, kernel = 40, 6, 10, 7
    keep = 2 * (per_head - window) + window  # G * (per_head - window) + window
    idx, head_mask = snapkv_select(q, k, keep, per_head, window, kernel, "avg")
    assert idx.shape == (2, 2, keep) and head_mask.shape == (2, 2, 2, keep)
    votes = slow_votes(q, k, window)
    for b in range(2):
        for h in range(4):
            kv, g = divmod(h, 2)
            pooled = slow_pool(votes[b, h], kernel, "avg")
            slots = idx[b, kv].tolist()
            mine = {slots[s] for s in range(keep) if head_mask[b, kv, g, s]}
            window_tokens = set(range(T - window, T))
            assert window_tokens <= mine
            assert is_top(pooled, mine - window_tokens, per_head - window)
            assert slots == sorted(slots)  # stored once per KV head, in position order


def paper_args(name):
    """The RocketKV paper's three models (context and RoPE scaling from their config.json) and
    a SmolLM2-like config (8K context, no scaling), as ModelArgs with unrelated names, so the
    rule cannot depend on the name."""
    if name == "smollm2":
        return ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                         vocab_size=49152, rope_theta=100000.0, max_seq_len=8192,
                         name="SmolLM2-135M-Instruct.Q4_1.gguf")
    return ModelArgs(**{**CONFIGS[name], "name": f"/models/{name}-checkpoint"})


@pytest.mark.parametrize("name,threshold", [
    ("llama-3.1-8b", 48 * 1024),          # context 131072, llama3 scaling (App. A.3: 48K)
    ("longchat-7b-v1.5-32k", 12 * 1024),  # context 32768, linear scaling x8 (App. A.3: 12K)
    ("mistral-7b-v0.2", None),            # context 32768, no scaling: always 63
    ("smollm2", None),                    # context 8192, no scaling: always 63
])
def test_adaptive_kernel_from_the_config(name, threshold):
    args = paper_args(name)
    assert (args.rope_scaling is not None) == (threshold is not None)
    if threshold is None:
        for T in (1, 8 * 1024, 12 * 1024, 3 * args.max_seq_len // 8, args.max_seq_len,
                  128 * 1024):
            assert snapkv_pp_kernel(args, T) == 63
        return
    assert threshold == 3 * args.max_seq_len // 8
    assert snapkv_pp_kernel(args, threshold - 1) == 63
    assert snapkv_pp_kernel(args, threshold) == 511
    assert snapkv_pp_kernel(args, args.max_seq_len) == 511


def test_adaptive_kernel_of_a_gguf_style_llama31():
    """A GGUF Llama 3.1 carries its scaling as per-frequency factors: still scaled."""
    base = paper_args("llama-3.1-8b")
    args = ModelArgs(**{**CONFIGS["llama-3.1-8b"], "name": "Meta-Llama-3.1-8B.Q4_0.gguf",
                        "rope_scaling": {"type": "freq_factors",
                                         "factors": [1.0] * (base.head_dim // 2)}})
    assert snapkv_pp_kernel(args, 48 * 1024 - 1) == 63
    assert snapkv_pp_kernel(args, 48 * 1024) == 511
