"""Exact-TopK, Quest, SparQ and hybrid selection (compression/exact_topk.py, quest.py, sparq.py,
hybrid.py, selection.py) against slow loop references."""

import math
import types

import pytest
import torch

from rocketkv.cache import CompressedKVCache, FullKVCache, Selector
from rocketkv.compression.exact_topk import ExactTopKSelector, exact_scores
from rocketkv.compression.hybrid import HybridSelector, hybrid_page_scores
from rocketkv.compression.quest import QuestSelector, page_bounds
from rocketkv.compression.selection import page_summary, top_pages_to_tokens, top_r_dims
from rocketkv.compression.sparq import SparQSelector, sparq_scores
from rocketkv.model import ModelArgs

ARGS = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                 vocab_size=10, max_seq_len=512)
G, D = 2, 16


def page_to_tokens(page_scores, page_size, valid):
    """The token-level view of page-constant scores: each page's score copied to its slots,
    (B, H_kv, P) -> (B, H_kv, P * page_size), -inf at slots not ``valid``."""
    scores = page_scores.repeat_interleave(page_size, dim=-1)
    return scores.masked_fill(~valid, float("-inf"))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_r_dims_rank_equal_sums_by_the_lower_dim(dtype):
    """The r largest group sums of |q|, largest first, equal sums to the lower dim (the fused
    kernels' rule): queries of small integers tie in most dims, as 16-bit queries often do."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-3, 4, (2, 8, 1, 32), generator=g).to(dtype)  # 2 KV heads of 4
    r = 11
    dims = top_r_dims(q, 2, r)
    assert dims.shape == (2, 2, r) and dims.dtype == torch.int64
    for b in range(2):
        for kv in range(2):
            sums = [sum(abs(float(q[b, h, 0, i])) for h in range(kv * 4, kv * 4 + 4))
                    for i in range(32)]
            want = sorted(range(32), key=lambda i: (-sums[i], i))[:r]
            assert dims[b, kv].tolist() == want, (b, kv)


def test_quest_page_bounds_bound_every_token():
    q, k = rand(1, 4, 1, D), rand(1, 2, 32, D, seed=2)
    page = 8
    kp = k.view(1, 2, 4, page, D)
    kmin, kmax = kp.amin(3), kp.amax(3)
    bounds = page_bounds(q, page_summary(kmin, kmax))
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
    return math.sqrt(len(qh) * sum(abs(float(qh[i])) for i in dims) / float(qh.abs().sum()))


def test_sparq_scores_match_loops():
    q, k = rand(1, 4, 1, D), rand(1, 2, 12, D, seed=3)
    dims = torch.tensor([[[1, 5, 7], [0, 2, 9]]])
    valid = torch.arange(12) < 10
    s = sparq_scores(q, k, dims, valid)
    # the transposed (dim-major) copy of K gives the same scores
    assert torch.equal(sparq_scores(q, k.transpose(-1, -2).contiguous(), dims, valid, True), s)
    for kv in range(2):
        for g in range(G):
            qh = q[0, kv * G + g, 0]
            ds = dims[0, kv].tolist()
            logits = torch.tensor([sum(float(qh[i] * k[0, kv, j, i]) for i in ds) /
                                   slow_temperature(qh, ds) for j in range(10)])
            assert torch.allclose(s[0, kv, g, :10], torch.softmax(logits, 0), atol=1e-6)
            assert (s[0, kv, g, 10:] == 0).all()


def slow_hybrid_token_scores(q, kmin, kmax, dims, valid, page):
    """The released code's order, with loops: each page's logit copied to every valid token of
    the page, softmax over the valid tokens per query head (SparQ temperature), summed over the
    group. Returns (B, H_kv, S) with -inf at invalid slots."""
    B, H = q.shape[:2]
    Hkv, S = kmin.shape[1], valid.shape[0]
    g_size = H // Hkv
    out = torch.full((B, Hkv, S), float("-inf"))
    for b in range(B):
        for kv in range(Hkv):
            ds = dims[b, kv].tolist()
            qsum = q[b, kv * g_size:(kv + 1) * g_size, 0].sum(0)
            total = torch.zeros(S)
            for g in range(g_size):
                qh = q[b, kv * g_size + g, 0]
                logits = []
                for j in range(S):
                    if not valid[j]:
                        continue
                    p = j // page
                    val = [float(kmax[b, kv, p, i] if qsum[i] >= 0 else kmin[b, kv, p, i])
                           for i in ds]
                    logits.append(sum(float(qh[i]) * v for i, v in zip(ds, val)) /
                                  slow_temperature(qh, ds))
                probs = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                n = 0
                for j in range(S):
                    if valid[j]:
                        total[j] += float(probs[n])
                        n += 1
            for j in range(S):
                if valid[j]:
                    out[b, kv, j] = total[j]
    return out


@pytest.mark.parametrize("n_valid", [20, 17, 13, 9])  # full pages; partial last pages
def test_hybrid_page_scores_match_token_expansion_loops(n_valid):
    page, P = 4, 5
    q, kmin, kmax = rand(2, 4, 1, D), rand(2, 2, P, D, seed=4), rand(2, 2, P, D, seed=5)
    dims = torch.tensor([[[3, 4], [8, 15]], [[0, 1], [2, 14]]])
    valid = torch.arange(P * page) < n_valid
    counts = valid.view(P, page).sum(-1)
    s = hybrid_page_scores(q, page_summary(kmin, kmax), dims, counts)
    assert s.shape == (2, 2, P)
    assert (s[..., counts == 0] == 0).all()  # pages no token reached
    tokens = page_to_tokens(s, page, valid)
    ref = slow_hybrid_token_scores(q, kmin, kmax, dims, valid, page)
    assert torch.allclose(tokens[..., valid], ref[..., valid], atol=1e-6)
    assert torch.isinf(tokens[..., ~valid]).all()
    # each query head's token probabilities sum to one: the group sums to G
    per_kv = (tokens[..., valid]).sum(-1)
    assert torch.allclose(per_kv, torch.full_like(per_kv, G), atol=1e-5)


def slow_page_level_scores(logits):
    """Page-level softmax per head (rows) over pages (columns), summed over the heads."""
    return sum(torch.softmax(torch.tensor(row, dtype=torch.float64), 0) for row in logits)


def test_hybrid_partial_last_page_counts_only_its_written_tokens():
    """A hand-made GQA group (2 query heads, 1 KV head, d = 4, pages of 4 tokens): pages 0-2
    full, page 3 holds one written token (slot 12). Page logits s[head][page] are set through
    the keys: head 0 looks at dim 0, head 1 at dim 1; temperature sqrt(4 * 2 / 2) = 2 with
    dims {0, 1}, so s = key value there. Page-level softmax ranks page 1 first; the released
    code's token-weighted softmax (a full page's probability spread over 4 tokens, the partial
    page's over 1) ranks page 3's token first, so the top-4 tokens differ."""
    logits = [[0.0, 0.0, 0.0, 2.0],   # head 0: the partial page
              [0.0, 3.0, 1.0, 0.0]]   # head 1: full pages 1 and 2
    args = ModelArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=8,
                     vocab_size=10, max_seq_len=64)
    T, page = 13, 4
    cache = CompressedKVCache(0, args, 1, torch.float32, "cpu", prompt_len=T,
                              prompt_capacity=T, max_new_tokens=3,
                              selector=HybridSelector(page, 2, 4))
    keys = torch.zeros(1, 1, T, 4)
    for j in range(T):  # every token of page p has key (s[0][p], s[1][p], 0, 0)
        keys[0, 0, j, 0], keys[0, 0, j, 1] = logits[0][j // page], logits[1][j // page]
    cache.prefill(rand(1, 2, T, 4), keys, rand(1, 1, T, 4, seed=1))
    q = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0]]).view(1, 2, 1, 4)
    valid = torch.arange(cache.length) < T
    # the slow reference (token expansion, loops) on the cache's own page bounds
    kmin, kmax = cache.selector.bounds(cache)
    ref = slow_hybrid_token_scores(q, kmin, kmax, torch.tensor([[[0, 1]]]), valid, page)[0, 0]
    n = [4, 4, 4, 1]
    expected = [sum(math.exp(row[p]) / sum(c * math.exp(x) for c, x in zip(n, row))
                    for row in logits) for p in range(4)]
    assert torch.allclose(ref[:T], torch.tensor([expected[j // page] for j in range(T)]),
                          atol=1e-6)
    page_level = slow_page_level_scores(logits)
    assert page_level.argmax() == 1 and page_level[1] > page_level[3]
    assert ref[12] > ref[4]  # token-weighted: the partial page's token wins
    idx = set(cache.selector.select(cache, q, valid)[0, 0].tolist())
    assert 12 in idx and len(idx) == 4 and idx - {12} <= {4, 5, 6, 7}
    # a page-level softmax would have read page 1 whole: {4, 5, 6, 7}, without slot 12
    pages = hybrid_page_scores(q, page_summary(kmin, kmax), torch.tensor([[[0, 1]]]),
                               torch.tensor([4, 4, 4, 4]))  # as if page 3 were full
    assert pages[0, 0].argmax() == 1


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
    cache, _, _ = run_cache(HybridSelector(page, 4, 8))
    n = cache.capacity
    for b in range(2):
        for kv in range(2):
            for p in range(-(-n // page)):
                toks = cache.k_cache[b, kv, p * page:min(n, (p + 1) * page)]
                kmin, kmax = cache.selector.bounds(cache)
                assert torch.equal(kmin[b, kv, p], toks.amin(0))
                assert torch.equal(kmax[b, kv, p], toks.amax(0))


@pytest.mark.parametrize("selector", [
    lambda n: ExactTopKSelector(n), lambda n: QuestSelector(4, n), lambda n: SparQSelector(D, n),
    lambda n: HybridSelector(4, D, n), lambda n: Selector()], ids=["exact_topk", "quest", "sparq",
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


@pytest.mark.parametrize("make", [
    lambda: QuestSelector(4, 8), lambda: HybridSelector(4, 4, 8), lambda: HybridSelector(1, 4, 8),
    lambda: SparQSelector(4, 8), lambda: SparQSelector(4, 8, reallocate=True)],
    ids=["quest", "hybrid", "hybrid_page1", "sparq", "sparq_reallocate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_appending_a_chunk_equals_one_update_per_slot(make, dtype):
    """A selector's one-pass ``extend`` leaves exactly the state that one ``update`` per slot
    leaves, chunks starting and ending inside pages."""
    T, steps = 37, 40  # prompt ends inside page 9 (4-slot pages)

    def per_slot(self, cache, first, n):
        for slot in range(first, first + n):
            s = torch.tensor([slot])
            self.update(cache, s, cache.k_cache.index_select(2, s))

    sel = make()
    looped = make()
    looped.extend = types.MethodType(per_slot, looped)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, T + steps, D, generator=g).to(dtype) for h in (4, 2, 2))
    caches, outs = [], []
    for s in (sel, looped):
        cache = CompressedKVCache(0, ARGS, 2, dtype, "cpu", prompt_len=T, prompt_capacity=T,
                                  max_new_tokens=steps, selector=s)
        cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
        out = []
        for a, b in ((T, T + 11), (T + 11, T + 12), (T + 12, T + 30)):  # 11, 1 and 18 slots
            out.append(cache.append(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], a))
        t = T + 30
        out.append(cache.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                torch.tensor([t])))
        caches.append(cache)
        outs.append(torch.cat(out, dim=2))
    state = [dict(c.selector.named_buffers()) for c in caches]
    assert state[0].keys() == state[1].keys()
    for name in state[0]:
        assert torch.equal(state[0][name], state[1][name]), name
    assert torch.equal(outs[0], outs[1])


def test_every_selector_with_per_slot_state_appends_chunks_itself():
    """The base ``extend`` does nothing, so a selector overriding ``update`` must override it."""
    from rocketkv import compression  # noqa: F401  (imports every selector module)

    def subclasses(c):
        return [c] + [s for d in c.__subclasses__() for s in subclasses(d)]

    for c in subclasses(Selector):
        if c.update is not Selector.update:
            assert c.extend is not Selector.extend, c.__name__


def test_sparq_mean_value_running_mean():
    cache, _, (q, k, v) = run_cache(SparQSelector(4, 8, reallocate=True))
    n = cache.capacity
    assert torch.allclose(cache.selector.v_mean[:, :, 0], v[:, :, :n].mean(dim=2), atol=1e-5)


def is_top_k(scores, chosen, k):
    """``chosen`` (list of slots) is a top-k of ``scores`` (1-D, -inf = invalid), ties allowed."""
    chosen = set(chosen)
    rest = [float(s) for i, s in enumerate(scores) if i not in chosen]
    worst = min(float(scores[i]) for i in chosen)
    return len(chosen) == k and worst > float("-inf") and (not rest or worst >= max(rest) - 1e-6)


def slow_page_min_max(keys, n_written, page):
    """Element-wise min/max over the written keys (S, D) of each page, loops; (P, D) each."""
    P = keys.shape[0] // page
    kmin, kmax = torch.zeros(P, keys.shape[1]), torch.zeros(P, keys.shape[1])
    for p in range(P):
        toks = [keys[j] for j in range(p * page, (p + 1) * page) if j < n_written]
        if toks:
            kmin[p], kmax[p] = torch.stack(toks).amin(0), torch.stack(toks).amax(0)
    return kmin, kmax


@pytest.mark.parametrize("kind", ["quest", "hybrid"])
def test_token_level_selection_matches_loops_at_every_decode_step(kind):
    """Quest and hybrid pick the top-k tokens of page-constant scores (every step's last page
    is partial in turn), k below one page included for Quest (k = 3, pages of 8)."""
    page, k, r = (8, 3, None) if kind == "quest" else (4, 6, 5)
    sel = QuestSelector(page, k) if kind == "quest" else HybridSelector(page, r, k)
    T, steps = 21, 13
    cache = CompressedKVCache(0, ARGS, 2, torch.float32, "cpu", prompt_len=T,
                              prompt_capacity=T, max_new_tokens=steps, selector=sel)
    g = torch.Generator().manual_seed(7)
    n = T + steps
    q, k_all, v = (torch.randn(2, h, n, D, generator=g) for h in (4, 2, 2))
    cache.prefill(q[:, :, :T], k_all[:, :, :T], v[:, :, :T])
    for t in range(T, n):
        qt = q[:, :, t:t + 1]
        cache.decode(qt, k_all[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t]))
        valid = torch.arange(cache.length) <= t
        idx = sel.select(cache, qt, valid)
        for b in range(2):
            kmins, kmaxs = zip(*(slow_page_min_max(cache.k_cache[b, kv], t + 1, page)
                                 for kv in range(2)))
            kmin, kmax = torch.stack(kmins)[None], torch.stack(kmaxs)[None]
            for kv in range(2):
                heads = range(kv * G, kv * G + G)
                if kind == "quest":
                    bound = [sum(max(float(qt[b, h, 0, i] * kmax[0, kv, p, i]),
                                     float(qt[b, h, 0, i] * kmin[0, kv, p, i]))
                                 for h in heads for i in range(D))
                             for p in range(cache.length // page)]
                    # the page of the token being decoded (slot t) is always read
                    ref = torch.tensor([float("inf") if valid[j] and j // page == t // page
                                        else bound[j // page] if valid[j] else float("-inf")
                                        for j in range(cache.length)])
                else:
                    qabs = sum(qt[b, h, 0].abs() for h in heads)
                    dims = sorted(range(D), key=lambda i: -float(qabs[i]))[:r]
                    ref = slow_hybrid_token_scores(
                        qt[b:b + 1, kv * G:kv * G + G], kmin[:, kv:kv + 1], kmax[:, kv:kv + 1],
                        torch.tensor([[dims]]), valid, page)[0, 0]
                assert is_top_k(ref, idx[b, kv].tolist(), k), (t, b, kv)


def test_bytes_read_at_sector_granularity_and_ideal():
    """Hand counts; B = 2, H_kv = 2, D = 16, float32 (a 64-byte key row, two 32-byte
    sectors); 37 prompt tokens + 29 new = 66 slots."""
    cache, _, _ = run_cache(QuestSelector(16, 3))  # k = 3 < one page
    pages = cache.length // 16  # 80 slots: 5 pages, a 20-byte summary row: one sector
    assert pages == 5
    assert cache.ideal_bytes_per_step() == cache.kv_bytes(pages + 3)
    # 32 summary rows (max, min) of one sector, then 3 key+value rows of 64 bytes
    assert cache.bytes_read_per_step() == 2 * 2 * (32 * 32 + 2 * 3 * 64)
    assert cache.selector.params() == {"selection": "quest", "page_size": 16, "k": 3}

    cache, _, _ = run_cache(HybridSelector(4, 5, 8))  # 68 slots, 17 pages: 68 bytes -> 3 sectors
    assert cache.ideal_bytes_per_step() == 2 * 2 * (17 * 5 * 4 + 2 * 8 * 64)
    assert cache.bytes_read_per_step() == 2 * 2 * (5 * 96 + 2 * 8 * 64)
    cache, _, _ = run_cache(HybridSelector(1, 5, 8))  # no summary: 5 dims of every key row
    assert cache.bytes_read_per_step() == 2 * 2 * (66 * 64 + 2 * 8 * 64)  # 5 of 2 sectors

    for dim_major, approx in ((True, 5 * 288), (False, 66 * 64)):  # 264 bytes: 9 sectors
        cache, _, _ = run_cache(SparQSelector(5, 8, dim_major=dim_major))
        assert cache.ideal_bytes_per_step() == 2 * 2 * (66 * 5 * 4 + 2 * 8 * 64)
        assert cache.bytes_read_per_step() == 2 * 2 * (approx + 2 * 8 * 64)
        extra = 2 * 2 * 16 * 66 * 4 if dim_major else 0  # the transposed copy of K
        assert cache.allocated_bytes() == cache.kv_bytes(66) + extra + 8  # + slot offset
    cache, _, _ = run_cache(SparQSelector(1, 8, dim_major=False))
    assert cache.bytes_read_per_step() == 2 * 2 * (66 * 32 + 2 * 8 * 64)  # one sector a row


def test_quest_always_reads_the_newest_page():
    """A partial page's bound is tight (few keys) while full pages' bounds are loose upper
    bounds; unforced, the page of the token being decoded loses (SmolLM2 at budget 256 then
    read its own slot in 0-11% of layers and wrote broken digits). Here every full page's
    bound beats the newest page's, yet the newest tokens are read."""
    args = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=8)
    cache = CompressedKVCache(0, args, 1, torch.float32, "cpu", prompt_len=16,
                              prompt_capacity=16, max_new_tokens=8, selector=QuestSelector(4, 6))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 16, 8, generator=g) * 3  # wide pages: large bounds
    cache.store_prompt(k, torch.randn(1, 1, 16, 8, generator=g), torch.zeros(1, 2, 0, 8))
    q = torch.randn(1, 2, 1, 8, generator=g)
    small = torch.randn(1, 1, 1, 8, generator=g) * 0.01  # newest keys: tiny scores
    for step in range(2):
        cache.decode(q, small, small, torch.tensor([16 + step]))
    valid = torch.arange(cache.length) <= 17
    bounds = page_bounds(q, cache.selector.rows(cache))[0, 0]
    assert bounds[4] < bounds[:4].min()  # the newest page would lose on its bound
    idx = cache.selector.select(cache, q, valid)[0, 0].tolist()
    assert {16, 17} <= set(idx) and len(idx) == 6


def test_page_first_top_k_equals_the_token_top_k_set():
    """``top_pages_to_tokens`` (top pages, then their tokens) against a top-k over every token
    copy of page-constant scores: the same set (ties within the boundary page aside), for
    partial newest pages, empty pages, k below one page and k above the valid tokens."""
    g = torch.Generator().manual_seed(3)
    for page, P in ((4, 9), (1, 12), (8, 5)):
        S = page * P
        for n_valid in (S, S - 1, S - page + 1, 2 * page + 1, 3):
            valid = torch.arange(S) < n_valid
            counts = valid.view(P, page).sum(-1)
            scores = torch.randn(2, 3, P, generator=g).masked_fill(counts == 0, float("-inf"))
            tokens = page_to_tokens(scores, page, valid)  # (2, 3, S)
            for k in (1, 3, page, 2 * page, 2 * page + 3, n_valid, min(S, n_valid + 5)):
                idx = top_pages_to_tokens(scores, counts, page, k, fill=S - 1)
                assert idx.shape == (2, 3, k)
                for b in range(2):
                    for h in range(3):
                        chosen = idx[b, h].tolist()
                        real = [j for j in chosen if valid[j]]
                        assert len(set(real)) == len(real) == min(k, n_valid)
                        assert all(j == S - 1 for j in chosen if not valid[j])  # the fill slot
                        assert is_top_k(tokens[b, h], real, min(k, n_valid)), (page, n_valid, k)
                        ref = set(tokens[b, h].topk(k).indices.tolist()) & set(range(n_valid))
                        pages = [j // page for j in real]
                        if k <= n_valid and all(pages.count(p) == counts[p] for p in pages):
                            assert set(real) == ref  # no partly taken page: no ties at all
