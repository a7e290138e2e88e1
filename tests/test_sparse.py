"""compression/sparse.py against slow loop references."""

import math

import pytest
import torch

from compression.sparse import (
    ExactTopK,
    Hybrid,
    Quest,
    SparQ,
    exact_scores,
    hybrid_page_scores,
    page_bounds,
    sparq_scores,
)
from kv_cache import CompressedKVCache, FullKVCache, Selector
from model import ModelArgs

ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                 vocab_size=10, max_seq_len=512)
G, D = 2, 16


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_exact_scores_and_topk_indices():
    q, k = rand(1, 4, 1, D), rand(1, 2, 20, D, seed=1)
    valid = torch.arange(20) < 15
    s = exact_scores(q, k, valid)
    for kv in range(2):
        ref = torch.zeros(20)
        for g in range(G):
            logits = [float(q[0, kv * G + g, 0] @ k[0, kv, j]) / math.sqrt(D) for j in range(15)]
            ref[:15] += torch.softmax(torch.tensor(logits), 0)
        assert torch.allclose(s[0, kv, :15], ref[:15], atol=1e-6)
        assert torch.isinf(s[0, kv, 15:]).all()
        top = set(s[0, kv].topk(5).indices.tolist())
        assert top == set(ref[:15].topk(5).indices.tolist())


def test_quest_page_bounds_bound_every_token():
    q, k = rand(1, 4, 1, D), rand(1, 2, 32, D, seed=2)
    page = 8
    kp = k.view(1, 2, 4, page, D)
    kmin, kmax = kp.amin(3), kp.amax(3)
    bounds = page_bounds(q, kmin, kmax)
    for kv in range(2):
        for p in range(4):
            ref = sum(max(float(q[0, h, 0, i] * kmax[0, kv, p, i]),
                          float(q[0, h, 0, i] * kmin[0, kv, p, i]))
                      for h in range(kv * G, kv * G + G) for i in range(D))
            assert bounds[0, kv, p] == pytest.approx(ref, abs=1e-4)
            true_max = max(sum(float(q[0, h, 0] @ k[0, kv, p * page + j])
                               for h in range(kv * G, kv * G + G)) for j in range(page))
            assert bounds[0, kv, p] >= true_max - 1e-4


def slow_temperature(qh, dims):
    return math.sqrt(D * sum(abs(float(qh[i])) for i in dims) / float(qh.abs().sum()))


def test_sparq_scores_match_loops():
    q, k = rand(1, 4, 1, D), rand(1, 2, 12, D, seed=3)
    dims = torch.tensor([[[1, 5, 7], [0, 2, 9]]])
    valid = torch.arange(12) < 10
    s = sparq_scores(q, k, dims, valid)
    for kv in range(2):
        for g in range(G):
            qh = q[0, kv * G + g, 0]
            ds = dims[0, kv].tolist()
            logits = torch.tensor([sum(float(qh[i] * k[0, kv, j, i]) for i in ds) /
                                   slow_temperature(qh, ds) for j in range(10)])
            assert torch.allclose(s[0, kv, g, :10], torch.softmax(logits, 0), atol=1e-6)
            assert (s[0, kv, g, 10:] == 0).all()


def test_hybrid_page_scores_match_loops():
    q, kmin, kmax = rand(1, 4, 1, D), rand(1, 2, 5, D, seed=4), rand(1, 2, 5, D, seed=5)
    dims = torch.tensor([[[3, 4], [8, 15]]])
    page_valid = torch.tensor([True, True, True, True, False])
    s = hybrid_page_scores(q, kmin, kmax, dims, page_valid)
    for kv in range(2):
        ds = dims[0, kv].tolist()
        qsum = q[0, kv * G:kv * G + G, 0].sum(0)
        ref = torch.zeros(5)
        for g in range(G):
            qh = q[0, kv * G + g, 0]
            logits = []
            for p in range(4):
                val = [float(kmax[0, kv, p, i] if qsum[i] >= 0 else kmin[0, kv, p, i])
                       for i in ds]
                logits.append(sum(float(qh[i]) * v for i, v in zip(ds, val)) /
                              slow_temperature(qh, ds))
            ref[:4] += torch.softmax(torch.tensor(logits), 0)
        assert torch.allclose(s[0, kv], ref, atol=1e-6)


def run_cache(selector, T=37, steps=29, seed=0, kept=None):
    cache = CompressedKVCache(0, ARGS, 2, torch.float32, "cpu", prompt_len=T,
                              prompt_capacity=T, max_new_tokens=steps, selector=selector)
    g = torch.Generator().manual_seed(seed)
    n = T + steps
    q, k, v = (torch.randn(2, h, n, D, generator=g) for h in (4, 2, 2))
    outs = [cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])]
    for t in range(T, n):
        outs.append(cache.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                 torch.tensor([t])))
    return cache, torch.cat(outs, dim=2), (q, k, v)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_min_max_after_decode_equals_recomputation(page):
    cache, _, _ = run_cache(Hybrid(page, 4, 8))
    n = cache.capacity
    for b in range(2):
        for kv in range(2):
            for p in range(-(-n // page)):
                toks = cache.k_cache[b, kv, p * page:min(n, (p + 1) * page)]
                kmin, kmax = cache.selector.bounds(cache)
                assert torch.equal(kmin[b, kv, p], toks.amin(0))
                assert torch.equal(kmax[b, kv, p], toks.amax(0))


@pytest.mark.parametrize("selector", [
    lambda n: ExactTopK(n), lambda n: Quest(4, n), lambda n: SparQ(D, n),
    lambda n: Hybrid(4, D, n), lambda n: Selector()], ids=["exact_topk", "quest", "sparq",
                                                             "hybrid", "dense"])
def test_selecting_everything_equals_full_attention(selector):
    T, steps = 37, 29
    _, out, (q, k, v) = run_cache(selector(T + steps + 3), T, steps)
    full = FullKVCache(0, ARGS, 2, torch.float32, "cpu", T + steps)
    ref = [full.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])]
    for t in range(T, T + steps):
        ref.append(full.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                               torch.tensor([t])))
    assert torch.allclose(out, torch.cat(ref, dim=2), atol=1e-5)


def test_sparq_mean_value_running_mean():
    cache, _, (q, k, v) = run_cache(SparQ(4, 8, reallocate=True))
    n = cache.capacity
    assert torch.allclose(cache.selector.v_mean[:, :, 0], v[:, :, :n].mean(dim=2), atol=1e-5)
