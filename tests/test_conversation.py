"""Appending a prompt chunk to a (compressed) cache, and building caches from one prefill."""

import pytest
import torch
from test_kv_cache import slow_attention

from rocketkv.cache import CompressedKVCache, Selector
from rocketkv.compression import build_caches
from rocketkv.engine.generate import CacheRequest, generate
from rocketkv.engine.prefill import extend_prefilled, prefill_once
from rocketkv.model import ConfigError, ModelArgs

METHODS = ["exact_topk", "snapkv", "snapkv_pp", "quest", "sparq", "hybrid", "rocketkv"]


def ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_conversation_equals_one_prefill_of_the_whole(stories_model):
    doc, question = ids(200, 0), ids(30, 1)
    generate(stories_model, doc, CacheRequest(reserve_tokens=60), max_new_tokens=0)
    turn = generate(stories_model, question, continue_conversation=True, max_new_tokens=16)
    whole = generate(stories_model, doc + question, max_new_tokens=16)
    assert turn["token_ids"] == whole["token_ids"]
    assert turn["conversation"]["start"] == 200 and turn["conversation"]["position"] == 245


def test_continuation_feeds_the_pending_generated_token_first(stories_model):
    doc, question = ids(150, 2), ids(20, 3)
    first = generate(stories_model, doc, CacheRequest(reserve_tokens=40), max_new_tokens=6)
    answer = first["token_ids"][0]
    turn = generate(stories_model, question, continue_conversation=True, max_new_tokens=12)
    whole = generate(stories_model, doc + answer + question, max_new_tokens=12)
    assert turn["token_ids"] == whole["token_ids"]
    # the reserve is spent: 196 positions, 187 fed; a 31-token turn does not fit
    with pytest.raises(ConfigError, match="room"):
        generate(stories_model, ids(30, 4), continue_conversation=True, max_new_tokens=4)


def test_continuation_errors(stories_model):
    prefill_once(stories_model, ids(50, 5))  # drops any conversation
    with pytest.raises(ConfigError, match="no conversation"):
        generate(stories_model, ids(5, 6), continue_conversation=True)
    generate(stories_model, ids(50, 5), CacheRequest(reserve_tokens=10), max_new_tokens=0)
    with pytest.raises(ConfigError, match="room"):
        generate(stories_model, ids(11, 6), continue_conversation=True)
    with pytest.raises(ConfigError, match="reserve_tokens"):
        generate(stories_model, ids(50, 5), CacheRequest(reserve_tokens=500), max_new_tokens=10)


@pytest.mark.parametrize("method", METHODS)
def test_shared_prefill_gives_the_same_run(stories_model, method):
    prompt = ids(300, 7)
    pre = prefill_once(stories_model, prompt)
    opts = {"page_size": 8} if method == "quest" else {}
    a = generate(stories_model, prompt, CacheRequest(method, 96, options=opts), max_new_tokens=10)
    b = generate(stories_model, prompt, CacheRequest(method, 96, options=opts), max_new_tokens=10,
                 prefilled=pre)
    assert a["token_ids"] == b["token_ids"] and b["prefill_shared"]
    assert a["prompt_tokens_kept"] == b["prompt_tokens_kept"]
    with pytest.raises(ConfigError, match="another prompt"):
        generate(stories_model, prompt[1:], CacheRequest(method, 96), prefilled=pre)


ARGS = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=16)


@pytest.mark.parametrize("per_head", [False, True])
def test_appended_chunk_attends_to_the_kept_tokens_only(per_head):
    """A chunk after an evicting prefill sees the kept prompt tokens and itself causally; with
    a per-head mask (original SnapKV) each query head sees only its own kept tokens."""
    g = torch.Generator().manual_seed(0)
    T, Tc, B = 12, 5, 2
    kept = torch.tensor([1, 4, 5, 9, 10, 11])
    head_mask = torch.rand(B, 2, 2, len(kept), generator=g) > 0.4
    head_mask[..., -1] = True  # every head keeps the last token

    def evict(q_obs, k):
        return kept.expand(B, 2, -1), (head_mask if per_head else None)

    cache = CompressedKVCache(0, ARGS, B, torch.float32, "cpu", prompt_len=T,
                              prompt_capacity=len(kept), max_new_tokens=Tc + 2,
                              selector=Selector(), evict=evict, per_head=per_head, obs_window=2)
    k, v = torch.randn(2, B, 2, T, 8, generator=g)
    cache.store_prompt(k, v, torch.randn(B, 4, 2, 8, generator=g))
    q_c = torch.randn(B, 4, Tc, 8, generator=g)
    k_c, v_c = torch.randn(2, B, 2, Tc, 8, generator=g)
    out = cache.append(q_c, k_c, v_c, start=T)
    keys = torch.cat([k[:, :, kept], k_c], dim=2)
    values = torch.cat([v[:, :, kept], v_c], dim=2)
    n = len(kept)

    def allowed(b, h, i, j):
        if j >= n:
            return j - n <= i
        return bool(head_mask[b, h // 2, h % 2, j]) if per_head else True

    assert torch.allclose(out, slow_attention(q_c, keys, values, allowed), atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        cache.append(q_c, k_c, v_c, start=T + Tc)  # 5 more slots than the 2 left


def test_page_summaries_after_an_appended_chunk_equal_a_fresh_build():
    """Quest/hybrid page min/max after append equal those of one prefill of the whole."""
    g = torch.Generator().manual_seed(1)
    T, Tc = 21, 9
    k, v = torch.randn(2, 1, 2, T + Tc, 8, generator=g)
    q = torch.randn(1, 4, T + Tc, 8, generator=g)
    for method in ("quest", "hybrid"):
        opts = {"page_size": 4} if method == "quest" else {}
        a = build_caches(method, ARGS, batch_size=1, prompt_len=T, max_new_tokens=Tc + 3,
                         budget=12, dtype=torch.float32, device="cpu", **opts)[0]
        b = build_caches(method, ARGS, batch_size=1, prompt_len=T + Tc, max_new_tokens=3,
                         budget=12, dtype=torch.float32, device="cpu", **opts)[0]
        assert a.selector.page_size == b.selector.page_size > 1
        a.store_prompt(k[:, :, :T], v[:, :, :T], q[:, :, :0])
        a.append(q[:, :, T:], k[:, :, T:], v[:, :, T:], T)
        b.store_prompt(k, v, q[:, :, :0])
        pages = -(-(T + Tc) // a.selector.page_size)
        assert torch.equal(a.selector.summary[..., :pages], b.selector.summary[..., :pages])


def test_extending_a_recorded_prefill_equals_prefilling_the_whole(stories_model):
    doc, question = ids(120, 8), ids(25, 9)
    whole = prefill_once(stories_model, doc + question)
    ext = extend_prefilled(stories_model, prefill_once(stories_model, doc), question)
    assert torch.equal(ext.tokens, whole.tokens)
    assert torch.allclose(ext.logits, whole.logits, atol=1e-4)
    for a, b in zip(ext.k + ext.v + ext.q_obs, whole.k + whole.v + whole.q_obs):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)
    a = generate(stories_model, doc + question, CacheRequest("snapkv_pp", 64), max_new_tokens=8,
                 prefilled=ext)
    b = generate(stories_model, doc + question, CacheRequest("snapkv_pp", 64), max_new_tokens=8)
    assert a["token_ids"] == b["token_ids"]
