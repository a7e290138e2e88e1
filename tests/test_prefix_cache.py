"""Prompts kept between runs (``engine/prefix_cache.py``, ``Engine(prefix_cache=...)``,
``serve.py --prefix-cache-mib``): a run whose prompt starts with a kept one prefills only the
rest and answers as a run prefilled from scratch does."""

import pytest
import torch
from fastapi.testclient import TestClient

import rocketkv
from rocketkv.engine.prefill import prefill_once
from rocketkv.engine.prefix_cache import PrefixCache
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import ConfigError
from rocketkv.serve.app import ServeDefaults, create_app


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tok(stories_dir):
    return load_tokenizer(stories_dir)


def test_the_longest_kept_proper_prefix_is_found(stories_model):
    a, b = _ids(40, 0), _ids(30, 1)
    cache = PrefixCache(2**30)
    short, long = prefill_once(stories_model, a), prefill_once(stories_model, a + b)
    assert cache.add(short) and cache.add(long) and len(cache) == 2
    assert cache.longest(a + b + [7]) is long  # the longer of two prefixes
    assert cache.longest(a + [7]) is short
    assert cache.longest(a + b) is short  # a proper prefix only: one token left at least
    assert cache.longest(b + a) is None
    assert cache.longest(a + [7], obs_window=128) is None  # recorded too few queries
    assert cache.longest(a + [7], attention_sums=True) is None  # no attention sums
    assert (cache.stats.hits, cache.stats.misses, cache.stats.tokens_reused) == (3, 3, 150)
    assert cache.nbytes() == short.nbytes() + long.nbytes()


def test_the_least_recently_used_prompt_goes_first(stories_model):
    pres = [prefill_once(stories_model, _ids(50, s)) for s in range(3)]
    size = pres[0].nbytes()
    cache = PrefixCache(2 * size + size // 2)  # room for two
    cache.add(pres[0])
    cache.add(pres[1])
    cache.longest(pres[0].tokens[0].tolist() + [5])  # used: the first stays
    cache.add(pres[2])
    assert cache.longest(pres[1].tokens[0].tolist() + [5]) is None
    assert cache.longest(pres[0].tokens[0].tolist() + [5]) is pres[0]
    assert cache.stats.evicted == 1 and len(cache) == 2
    assert not PrefixCache(size - 1).add(pres[0])  # larger than the whole cache: not kept
    with pytest.raises(ConfigError, match="must not be negative"):
        PrefixCache(-1)


@pytest.mark.parametrize("method,budget", [("rocketkv", 64), ("snapkv_pp", 64), ("h2o", 64),
                                           ("full", None), ("keydiff", 64)])
def test_a_conversation_prefills_each_turn_once_and_answers_as_fresh(stories_model, tok,
                                                                     prefill_starts, method,
                                                                     budget):
    """Turn 2's prompt is turn 1's, its answer and a new message: with a prefix cache only the
    answer and the message are prefilled, and both answers equal an engine's without one
    (KeyDiff, whose blocks prefill their own way, prefills each turn whole)."""
    fresh = rocketkv.Engine(stories_model, tok)
    kept = rocketkv.Engine(stories_model, tok, prefix_cache=PrefixCache(2**30))
    turn1 = _ids(300, 2)
    kw = dict(method=method, budget=budget, max_new_tokens=10, stop_ids=())
    first = kept.generate(turn1, **kw)
    assert first.tokens == fresh.generate(turn1, **kw).tokens
    assert first.metrics.get("prefix_tokens_reused", 0) == 0
    turn2 = turn1 + first.tokens + _ids(15, 3)
    prefill_starts.clear()
    second = kept.generate(turn2, **kw)
    starts = list(prefill_starts)
    assert second.tokens == fresh.generate(turn2, **kw).tokens
    if method == "keydiff":
        assert "prefix_tokens_reused" not in second.metrics
        assert len(kept.prefix_cache) == 0
    else:
        assert second.metrics["prefix_tokens_reused"] == 300
        assert starts == [(300, 25)]  # the answer and the new message, nothing else
        assert len(kept.prefix_cache) == 2


def test_the_server_keeps_a_conversations_prompt(stories_model, tok):
    engine = rocketkv.Engine(stories_model, tok, prefix_cache=PrefixCache(2**30))
    with TestClient(create_app(engine, ServeDefaults(method="rocketkv", budget=64,
                                                     max_new_tokens=8))) as client:
        prompt = "Once upon a time, there was a little girl named Lily. " * 8
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        first = client.post("/v1/completions", json=body).json()
        body["prompt"] = prompt + first["choices"][0]["text"] + " She"
        second = client.post("/v1/completions", json=body)
        assert second.status_code == 200
        metrics = client.get("/metrics").text
    reused = [line for line in metrics.splitlines()
              if line.startswith('rocketkv_prefix_tokens_reused_total{method="rocketkv"}')]
    assert reused and float(reused[0].split()[-1]) > 50, metrics
    assert "rocketkv_prefix_cache_bytes " in metrics


def test_load_and_serve_refuse_a_negative_size(stories_dir, capsys):
    from rocketkv.cli import serve as serve_cli

    with pytest.raises(ConfigError, match="prefix_cache_mib must be an int >= 0"):
        rocketkv.load(str(stories_dir), device="cpu", prefix_cache_mib=-1)
    assert serve_cli.main(["--checkpoint", str(stories_dir), "--prefix-cache-mib", "-5"]) == 2
    assert "--prefix-cache-mib must not be negative" in capsys.readouterr().err


@pytest.mark.parametrize("method,budget", [("rocketkv", 64), ("snapkv_pp", 64), ("h2o", 64)])
def test_another_question_after_the_same_document_reuses_the_document(stories_model, tok,
                                                                      prefill_starts, method,
                                                                      budget):
    """Prompts that share a document and part at the question: the second prefills the last
    64 shared tokens (its observation window's queries must be its own) and its question;
    H2O, whose attention sums cover every later query, prefills it whole. Answers as fresh."""
    fresh = rocketkv.Engine(stories_model, tok)
    kept = rocketkv.Engine(stories_model, tok, prefix_cache=PrefixCache(2**30))
    doc = _ids(300, 4)
    kw = dict(method=method, budget=budget, max_new_tokens=10, stop_ids=())
    kept.generate(doc + _ids(12, 5), **kw)
    second = doc + _ids(20, 6)
    prefill_starts.clear()
    r = kept.generate(second, **kw)
    starts = list(prefill_starts)
    assert r.tokens == fresh.generate(second, **kw).tokens
    if method == "h2o":
        assert starts == [(0, 320)] and r.metrics["prefix_tokens_reused"] == 0
    else:
        assert starts == [(236, 84)] and r.metrics["prefix_tokens_reused"] == 236


def test_batched_requests_reuse_kept_prompts_and_answer_as_fresh(stories_model, tok,
                                                                 prefill_starts):
    """Through the batcher (``Engine.submit``): a conversation's second turn, submitted while
    another request decodes, prefills only what is new, and both answers are a fresh
    engine's."""
    fresh = rocketkv.Engine(stories_model, tok)
    kept = rocketkv.Engine(stories_model, tok, prefix_cache=PrefixCache(2**30))
    turn1, other = _ids(300, 7), _ids(200, 8)
    kw = dict(method="rocketkv", budget=64, max_new_tokens=10, stop_ids=())
    try:
        first = kept.submit(turn1, **kw).result(60)
        turn2 = turn1 + first.tokens + _ids(15, 9)
        prefill_starts.clear()
        running = kept.submit(other, **{**kw, "max_new_tokens": 40})
        second = kept.submit(turn2, **kw).result(60)
        running = running.result(60)
    finally:
        kept.close_batching()
    starts = list(prefill_starts)  # the batched ones: the other request's, then turn 2's rest
    assert first.tokens == fresh.generate(turn1, **kw).tokens
    assert second.tokens == fresh.generate(turn2, **kw).tokens
    assert running.tokens == fresh.generate(other, **{**kw, "max_new_tokens": 40}).tokens
    assert second.metrics["prefix_tokens_reused"] == 300
    assert starts == [(0, 200), (300, 25)]
