"""compression/snapkv.py against slow loop references (SnapKV listing, RocketKV Alg. 1); the
decode steps are in test_snapkv_decode.py."""

import math

import pytest
import torch

from rocketkv.cache import prefill_memo
from rocketkv.compression import METHODS, build_caches, derive
from rocketkv.compression.registry import BudgetError
from rocketkv.compression.snapkv import (
    VoteEvictionSelector,
    pool_votes,
    snapkv_ranked,
    snapkv_select,
    window_votes,
)
from rocketkv.compression.snapkv_pp import (
    snapkv_pp_evictor,
    snapkv_pp_kernel,
    snapkv_pp_order,
    snapkv_pp_select,
)
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


def test_snapkv_pp_order_keeps_the_top_and_stores_them_lowest_first(qk):
    """SnapKV++'s cache layout: the top keep - window prefix tokens by the group's pooled votes,
    lowest first (the order the decode steps evict them in), then the window; the same set as
    RocketKV's stage 1 (``snapkv_pp_select``, ascending) where no votes tie."""
    q, k = qk
    T, window, keep, kernel = 40, 6, 16, 1  # kernel 1: no pooling plateaus, so no ties
    idx = snapkv_pp_order(q, k, keep, window, kernel)
    assert idx.shape == (2, 2, keep)
    votes = slow_votes(q, k, window)
    for b in range(2):
        for kv in range(2):
            pooled = slow_pool(votes[b, 2 * kv] + votes[b, 2 * kv + 1], kernel, "max")
            prefix = idx[b, kv, :-window].tolist()
            assert idx[b, kv, -window:].tolist() == list(range(T - window, T))
            assert is_top(pooled, set(prefix), keep - window)
            assert all(pooled[x] <= pooled[y] + 1e-6 for x, y in zip(prefix, prefix[1:]))
    ascending = snapkv_pp_select(q, k, keep, window, kernel)
    assert torch.equal(idx.sort(dim=-1).values, ascending)


def test_equal_votes_go_earlier_position_first():
    """Max pooling makes plateaus of equal votes: the earlier position is evicted first, so
    the later one is kept (one rule on every device)."""
    from rocketkv.compression.snapkv import eviction_order

    pooled = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0]])
    assert eviction_order(pooled).tolist() == [[1, 4, 3, 0, 2, 5]]


def test_snapkv_ranks_give_each_query_heads_eviction_order(qk):
    q, k = qk
    window, per_head, kernel = 6, 10, 7
    keep = 2 * (per_head - window) + window
    idx, head_mask, ranks = snapkv_ranked(q, k, keep, per_head, window, kernel, "avg")
    assert ranks.shape == (2, 2, 2, keep - window) and ranks.dtype == torch.int32
    assert torch.equal(head_mask[..., :keep - window], ranks >= 0)
    votes = slow_votes(q, k, window)
    for b in range(2):
        for h in range(4):
            kv, g = divmod(h, 2)
            pooled = slow_pool(votes[b, h], kernel, "avg")
            r = ranks[b, kv, g].tolist()
            mine = sorted((rank, int(idx[b, kv, s])) for s, rank in enumerate(r) if rank >= 0)
            assert [rank for rank, _ in mine] == list(range(per_head - window))
            by_rank = [pos for _, pos in mine]  # lowest vote first
            assert all(pooled[x] <= pooled[y] + 1e-6 for x, y in zip(by_rank, by_rank[1:]))
            assert is_top(pooled, set(by_rank), per_head - window)


LLAMA = ModelArgs.from_name("llama-3.1-8b")  # G = 4


def test_parameters_follow_the_budget_not_the_answer_length():
    """SnapKV keeps t // G tokens per query head, SnapKV++ min(T, t) per KV head, whatever the
    number of tokens asked for (derive never sees it); the window bounds the budget."""
    p = derive("snapkv", 1024, 4096, LLAMA, {})
    assert (p.per_head_keep, p.keep, p.window) == (256, 4 * (256 - 32) + 32, 32)
    assert (p.kernel_size, p.pooling, p.evict) == (7, "avg", True)
    assert "prompt_budget" not in p.to_dict() and "per_head_budget" not in p.to_dict()
    assert derive("snapkv", 1024, 100, LLAMA, {}).per_head_keep == 100
    p = derive("snapkv_pp", 1024, 4096, LLAMA, {})
    assert (p.keep, p.pooling, p.evict) == (1024, "max", True)
    assert derive("snapkv_pp", 1024, 300, LLAMA, {}).keep == 300  # kept whole, then ranked
    assert not derive("snapkv_pp", 1024, 32, LLAMA, {}).evict  # window only: nothing to rank
    derive("snapkv_pp", 33, 4096, LLAMA, {})
    with pytest.raises(BudgetError, match="t = 32 does not exceed the observation window"):
        derive("snapkv_pp", 32, 4096, LLAMA, {})
    derive("snapkv", 132, 4096, LLAMA, {})
    with pytest.raises(BudgetError, match="t // G = 131 // 4 = 32 does not exceed"):
        derive("snapkv", 131, 4096, LLAMA, {})


@pytest.mark.parametrize("method", ["snapkv", "snapkv_pp"])
def test_caches_read_t_tokens_per_step(method):
    """The selector of both methods reports a full step's traffic: t key+value pairs (RocketKV
    App. A.3), or the whole buffer where it holds fewer (SnapKV stores G * (t // G - window) +
    window prompt slots: 224 + m here)."""
    args = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=8192)
    for m in (8, 400):
        cache = build_caches(method, args, batch_size=1, prompt_len=4096, max_new_tokens=m,
                             budget=256, dtype=torch.bfloat16, device="meta")[0]
        assert isinstance(cache.selector, VoteEvictionSelector)
        assert cache.ideal_bytes_per_step() == cache.kv_bytes(min(256, cache.capacity))
        params = cache.method_params()
        assert params["selection"] == "vote_eviction" and params["k"] == 256
        assert cache.kept == (256 if method == "snapkv_pp" else 2 * (128 - 32) + 32)
        if method == "snapkv_pp":
            assert cache.bytes_read_per_step() == cache.kv_bytes(256)


def test_rocketkv_stage1_keeps_ascending_positions_and_no_decode_eviction(qk):
    q, k = qk
    p = METHODS["rocketkv"].derive(256, 4096, LLAMA, {})
    params = p.replace(keep=16, window=6, kernel_size=5)
    idx, mask = snapkv_pp_evictor(params)(q, k)
    assert mask is None and torch.equal(idx, snapkv_pp_select(q, k, 16, 6, 5))
    cache = build_caches("rocketkv", LLAMA, batch_size=1, prompt_len=4096, max_new_tokens=8,
                         budget=256, dtype=torch.bfloat16, device="meta")[0]
    assert not isinstance(cache.selector, VoteEvictionSelector)


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
