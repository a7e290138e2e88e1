"""KeyDiff (compression/keydiff.py) and OmniKV (compression/omnikv.py) against slow references."""

import math

import pytest
import torch
from conftest import SMOLLM2_GGUF, shared_file
from test_eviction import qkv, tiny_args
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from rocketkv.cache import FullKVCache
from rocketkv.cli.generate import main
from rocketkv.compression import build_caches, derive
from rocketkv.compression.keydiff import KeyDiffCache, keydiff_scores
from rocketkv.compression.omnikv import (
    OmniKVFilterCache,
    OmniKVSparseCache,
    build_omnikv,
    default_filter_layers,
    layer_roles,
)
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.prefill import prefill_once
from rocketkv.model import ConfigError, ModelArgs, Transformer


def dense_over(q, k, v, positions):
    """Attention of each query q[b, h, i] (B, H, n, D) over ``positions[b][h_kv][i]`` of k, v
    (B, H_kv, N, D), one query head and one query at a time."""
    B, H, n, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, n, D)
    for b in range(B):
        for h in range(H):
            for i in range(n):
                idx = torch.tensor(sorted(positions[b][h // G][i]))
                s = (k[b, h // G, idx] @ q[b, h, i]) / math.sqrt(D)
                out[b, h, i] = torch.softmax(s, 0) @ v[b, h // G, idx]
    return out


def random_model(layers=6, seed=0):
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2,
                                  head_dim=16, intermediate_size=32, vocab_size=60,
                                  max_seq_len=2048)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


# ---- KeyDiff ------------------------------------------------------------------------------

def test_keydiff_scores_are_cosines_to_the_mean_key():
    _, k, _ = qkv(2, 4, 2, 9, 8)
    valid = torch.rand(2, 2, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    got = keydiff_scores(k, valid)
    for b in range(2):
        for h in range(2):
            keys = [k[b, h, i] for i in range(9) if valid[b, h, i]]
            mean = sum(keys) / len(keys)
            for i in range(9):
                want = float(k[b, h, i] @ mean / (k[b, h, i].norm() * mean.norm())) \
                    if valid[b, h, i] else -math.inf
                assert float(got[b, h, i]) == pytest.approx(want, abs=1e-5)


def keydiff_reference(k, C):
    """The kept positions per (b, h_kv) after a block: the C lowest cosine similarities to the
    mean of the candidates' keys."""

    def keep(cands, b, h):
        if len(cands) <= C:
            return list(cands)
        keys = k[b, h, cands]
        mean = keys.mean(0)
        cos = [float(x @ mean / (x.norm() * mean.norm())) for x in keys]
        order = sorted(range(len(cands)), key=lambda i: cos[i])[:C]
        return sorted(cands[i] for i in order)
    return keep


@pytest.mark.parametrize("T,block,t", [(50, 8, 16), (30, 16, 40), (37, 5, 9)])
def test_keydiff_block_prefill_and_decode_match_a_slow_reference(T, block, t):
    B, H, Hkv, D, m = 2, 4, 2, 8, 12
    C = t - 1
    q, k, v = qkv(B, H, Hkv, T + m, D, seed=T)
    cache = KeyDiffCache(0, tiny_args(H, Hkv, D), B, torch.float32, "cpu", prompt_len=T,
                         max_new_tokens=m, capacity=C, block=block)
    keep = keydiff_reference(k, C)
    kept = [[[] for _ in range(Hkv)] for _ in range(B)]
    for s in range(0, T, block):
        e = min(s + block, T)
        kb, vb = cache.prompt_buffers(s, e)
        kb.copy_(k[:, :, s:e])
        vb.copy_(v[:, :, s:e])
        cache.store_prompt(kb, vb, q[:, :, :0], s)
        chunks = [(a, min(a + 3, e)) for a in range(s, e, 3)]  # query chunks in the block
        out = torch.cat([cache.prefill_attention(q[:, :, a:c], kb[:, :, :c - s],
                                                 vb[:, :, :c - s], a) for a, c in chunks], 2)
        # each block query sees what the cache kept of earlier blocks, and the block causally
        want = dense_over(q[:, :, s:e], k, v, [[[kept[b][h] + list(range(s, p + 1))
                                                 for p in range(s, e)] for h in range(Hkv)]
                                               for b in range(B)])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        kept = [[keep(kept[b][h] + list(range(s, e)), b, h) for h in range(Hkv)]
                for b in range(B)]
        held = cache.slot_pos[..., :cache.capacity]
        assert [[sorted(x for x in held[b, h].tolist() if x >= 0) for h in range(Hkv)]
                for b in range(B)] == kept
    # decode: a block of one; the cache + new token are read (t pairs), then one is evicted
    for p in range(T, T + m):
        y = cache.decode(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1],
                         torch.tensor([p]))
        read = [[kept[b][h] + [p] for h in range(Hkv)] for b in range(B)]
        assert all(len(x) <= t for row in read for x in row)
        want = dense_over(q[:, :, p:p + 1], k, v, [[[x] for x in row] for row in read])
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        kept = [[keep(read[b][h], b, h) for h in range(Hkv)] for b in range(B)]
        held = cache.slot_pos[..., :cache.capacity]
        assert [[sorted(x for x in held[b, h].tolist() if x >= 0) for h in range(Hkv)]
                for b in range(B)] == kept
        # the running key sum equals the kept keys' sum
        for b in range(B):
            for h in range(Hkv):
                torch.testing.assert_close(cache.key_sum[b, h], k[b, h, kept[b][h]].sum(0),
                                           atol=1e-4, rtol=1e-4)


class _KVShapes(TorchFunctionMode):
    """The largest sequence extent of any (B, H_kv, L, D) or (B, L, H_kv, D) tensor created."""

    def __init__(self, Hkv, D):
        super().__init__()
        self.Hkv, self.D, self.largest = Hkv, D, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[3] == self.D:
                if t.shape[1] == self.Hkv:
                    self.largest = max(self.largest, t.shape[2])
                elif t.shape[2] == self.Hkv:
                    self.largest = max(self.largest, t.shape[1])
        return out


def test_keydiff_prefill_never_holds_more_than_budget_plus_block():
    model = random_model(layers=3)
    model.prefill_chunk_size = 16
    T, t, block = 300, 48, 16
    prompt = torch.randint(0, 60, (1, T), generator=torch.Generator().manual_seed(0))
    for method, bound in (("keydiff", t - 1 + block), ("full", T)):
        caches = build_caches(method, model.args, batch_size=1, prompt_len=T, max_new_tokens=4,
                              budget=t if method == "keydiff" else None, dtype=torch.float32,
                              device="cpu", **({"block_size": block} if method == "keydiff"
                                               else {}))
        model.setup_caches(caches, T + 4)
        with _KVShapes(2, 16) as seen:
            model.prefill(prompt)
        assert seen.largest == bound  # full: one layer's whole prompt; keydiff: never
    assert sum(c.k_cache.shape[2] for c in caches) == 3 * (T + 4)


def test_keydiff_covering_the_sequence_equals_full_and_appends_like_one_prefill():
    """Capacity for every token: blocks attend to all earlier tokens, nothing is evicted, so
    logits and greedy tokens equal the full cache's; a conversation's next chunk (more blocks)
    equals one prefill of the concatenation."""
    model = random_model()
    T, m, Tc = 90, 10, 21
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 60, (1, T), generator=g)
    chunk = torch.randint(0, 60, (1, Tc), generator=g)
    full = generate(model, prompt, max_new_tokens=m)
    caches = [KeyDiffCache(i, model.args, 1, torch.float32, "cpu", prompt_len=T,
                           max_new_tokens=m + Tc, capacity=T + m + Tc, block=16)
              for i in range(model.args.n_layers)]
    model.setup_caches(caches, T + m + Tc)
    logits = model.prefill(prompt)
    ref = [FullKVCache(i, model.args, 1, torch.float32, "cpu", T + m + Tc)
           for i in range(model.args.n_layers)]
    tokens = [int(logits.argmax())]
    for j in range(m - 1):
        logits = model(torch.tensor([[tokens[-1]]]), torch.tensor([T + j]))
        tokens.append(int(logits.argmax()))
    assert tokens == full["token_ids"][0]
    # append: a fresh prompt, then a chunk of 21 tokens (two blocks) at position T
    model.setup_caches(caches, T + Tc)
    model.prefill(prompt)
    got = model.prefill(chunk, start=T)
    model.setup_caches(ref, T + Tc)
    want = model.prefill(torch.cat([prompt, chunk], 1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_keydiff_budget_parameters_and_cli_errors(capsys):
    p = derive("keydiff", 256, 4000, tiny_args(), {})
    assert (p.capacity, p.block_size, p.cache_slots) == (255, 128, 383)
    assert derive("keydiff", 256, 4000, tiny_args(), {"block_size": 64}).block_size == 64
    with pytest.raises(ConfigError, match="smallest valid budget here is 2"):
        build_caches("keydiff", tiny_args(), batch_size=1, prompt_len=100, max_new_tokens=4,
                     budget=1, dtype=torch.float32, device="meta")
    with pytest.raises(ConfigError, match="--block-size must be positive"):
        build_caches("keydiff", tiny_args(), batch_size=1, prompt_len=100, max_new_tokens=4,
                     budget=16, dtype=torch.float32, device="meta", block_size=0)
    with pytest.raises(ConfigError, match="--block-size does not apply to method h2o"):
        build_caches("h2o", tiny_args(), batch_size=1, prompt_len=100, max_new_tokens=4,
                     budget=16, dtype=torch.float32, device="meta", block_size=8)


# ---- OmniKV -------------------------------------------------------------------------------

def test_filter_layers_and_roles():
    assert default_filter_layers(32) == [2, 8, 18]  # the paper's Llama-3-8B choice
    assert default_filter_layers(80) == [4, 19, 41]
    assert default_filter_layers(30) == [2, 8, 17]  # SmolLM2: the 32-layer choice scaled
    assert default_filter_layers(5) == [1]  # each filter layer serves a sparse layer
    assert layer_roles(8, [2, 5]) == ["full", "full", "filter", "full", "sparse", "filter",
                                      "full", "sparse"]
    p = derive("omnikv", 64, 1000, tiny_args(layers=8), {"filter_layers": [2, 5]})
    # at the first decode step layers 0, 1, 2, 3, 5, 6 read all 1001 tokens, layers 4 and 7 64
    assert p.traffic_tokens == pytest.approx((6 * 1001 + 2 * 64) / 8)
    assert p.budget_overshoot == pytest.approx(p.traffic_tokens / 64)
    for bad in ([5, 2], [1, 8], [-1]):
        with pytest.raises(ConfigError, match="--filter-layers must be increasing"):
            derive("omnikv", 64, 1000, tiny_args(layers=8), {"filter_layers": bad})


def omnikv_reference_scores(q_win, pos_win, k, now, selector):
    """S = sum_j alpha_j max_h softmax(q_j K^T / sqrt(d))[h] over keys <= pos_j (Eq. 3-4),
    one window query and one head at a time; positions >= now excluded."""
    B, H, w, D = q_win.shape
    G = H // k.shape[1]
    S = torch.zeros(B, now + 1)
    for b in range(B):
        for j in range(w):
            p = int(pos_win[j])
            if p < 0:
                continue
            alpha = {"last": float(p == now), "uniform": 1.0,
                     "exponential": 2.0 ** (p - now - 1)}[selector]
            best = torch.zeros(now + 1)
            for h in range(H):
                a = torch.softmax(k[b, h // G, :p + 1] @ q_win[b, h, j] / math.sqrt(D), 0)
                best[:p + 1] = torch.maximum(best[:p + 1], a)
            S[b] += alpha * best
    return S[:, :now]


@pytest.mark.parametrize("selector", ["last", "uniform", "exponential"])
def test_omnikv_selection_and_sparse_attention_match_a_slow_reference(selector):
    B, H, Hkv, D, T, m, t, w = 2, 4, 2, 8, 40, 8, 11, 6
    args = tiny_args(H, Hkv, D, layers=4)
    q, k, v = qkv(B, H, Hkv, T + m, D, seed=5)
    caches = build_omnikv(args, batch_size=B, prompt_len=T, max_new_tokens=m, budget=t,
                          dtype=torch.float32, device="cpu", filter_layers=[1],
                          selector=selector, window=w)
    assert [type(c) for c in caches] == [FullKVCache, OmniKVFilterCache, FullKVCache,
                                         OmniKVSparseCache]
    filt, sparse = caches[1], caches[3]
    # the sparse layer gets its own K/V (here: the same random tensors, shifted)
    ks, vs = k.roll(1, dims=-1), v.flip(-1)
    filt.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    sparse.prefill(q[:, :, :T], ks[:, :, :T], vs[:, :, :T])
    for p in range(T, T + m):
        sl = slice(p, p + 1)
        y = filt.decode(q[:, :, sl], k[:, :, sl], v[:, :, sl], torch.tensor([p]))
        everything = [[[list(range(p + 1))] for _ in range(Hkv)] for _ in range(B)]
        torch.testing.assert_close(y, dense_over(q[:, :, sl], k, v, everything),
                                   atol=1e-5, rtol=1e-5)
        win = [x for x in range(p - (1 if selector == "last" else w) + 1, p + 1)]
        S = omnikv_reference_scores(q[:, :, win], torch.tensor(win), k, p, selector)
        for b in range(B):
            got = sorted(filt.selected[b].tolist())
            want = sorted(S[b].topk(t - 1).indices.tolist())
            assert got == want and bool(filt.selected_valid[b].all())
        z = sparse.decode(q[:, :, sl], ks[:, :, sl], vs[:, :, sl], torch.tensor([p]))
        read = [[[sorted(filt.selected[b].tolist()) + [p]] for _ in range(Hkv)]
                for b in range(B)]
        torch.testing.assert_close(z, dense_over(q[:, :, sl], ks, vs, read),
                                   atol=1e-5, rtol=1e-5)


def test_omnikv_offload_equals_in_memory_and_k_covering_the_sequence_equals_full():
    model = random_model()
    T, m = 120, 12
    prompt = torch.randint(0, 60, (2, T), generator=torch.Generator().manual_seed(4))
    opts = {"filter_layers": [1, 3]}
    mem = generate(model, prompt, CacheRequest("omnikv", 24, options=opts), max_new_tokens=m)
    off = generate(model, prompt, CacheRequest("omnikv", 24, options={**opts, "offload": True}),
                   max_new_tokens=m)
    assert off["token_ids"] == mem["token_ids"]
    caches = model.caches
    assert caches[5].offload and caches[5].allocated_bytes() == 0
    # one sparse layer (5): its K/V in host memory, 23 selected tokens copied per step
    assert off["kv_host_bytes"] == caches[5].host_bytes() == 2 * 2 * 2 * (T + m) * 16 * 4
    assert off["offload_bytes_per_step"] == 2 * 2 * 2 * 23 * 16 * 4
    assert mem["kv_host_bytes"] == mem["offload_bytes_per_step"] == 0
    with pytest.raises(ConfigError, match="--no-compile"):
        generate(model, prompt, CacheRequest("omnikv", 24, options={**opts, "offload": True}),
                 max_new_tokens=m, step=StepConfig(compile=True))
    # k >= every earlier token: sparse layers read everything, as the full cache does
    full = generate(model, prompt, max_new_tokens=m)
    for offload in (False, True):
        caches = build_omnikv(model.args, batch_size=2, prompt_len=T, max_new_tokens=m,
                              budget=T + m, dtype=torch.float32, device="cpu",
                              filter_layers=[1, 3], offload=offload)
        model.setup_caches(caches, T + m)
        logits = model.prefill(prompt)
        tokens = [logits.argmax(-1)]
        for j in range(m - 1):
            with torch.no_grad():
                logits = model(tokens[-1][:, None], torch.tensor([T + j]))
            tokens.append(logits.argmax(-1))
        assert torch.stack(tokens, 1).tolist() == full["token_ids"]


def test_omnikv_cli_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", "random:llama-3.1-8b", "--method", "omnikv", "--budget", "64",
              "--random-prompt", "100", "--filter-layers", "2,x"])
    assert e.value.code == 2 and "comma-separated layer indices" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no --skip-layers"):
        build_caches("omnikv", tiny_args(layers=6), batch_size=1, prompt_len=100,
                     max_new_tokens=4, budget=16, dtype=torch.float32, device="meta",
                     skip_layers=2)
    with pytest.raises(ConfigError, match="--omnikv-selector must be one of"):
        derive("omnikv", 64, 1000, tiny_args(layers=8), {"omnikv_selector": "max"})


# ---- a real model ------------------------------------------------------------------------

def test_smollm2_runs_keydiff_and_omnikv_at_128_to_1024(smollm2_model):
    from conftest import ESSAYS

    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_file(SMOLLM2_GGUF))
    essay = sorted(shared_file(ESSAYS).glob("*.txt"))[0].read_text()
    ids = tok.encode_chat(" ".join(essay.split()[:800]) + "\n\nSummarize the text above.")
    T, m = len(ids), 3
    pre = prefill_once(smollm2_model, ids)
    full = generate(smollm2_model, ids, max_new_tokens=m, prefilled=pre)
    for budget in (128, 1024):
        for method in ("keydiff", "omnikv"):
            r = generate(smollm2_model, ids, CacheRequest(method, budget), max_new_tokens=m,
                         prefilled=pre)
            assert len(r["token_ids"][0]) == m and r["method_params"]["compressed"]
            assert r["prefill_shared"] == (method == "omnikv")
            if method == "keydiff":  # a step reads t pairs per layer and KV head
                a = smollm2_model.args
                kv = 2 * a.n_layers * a.n_kv_heads * budget * a.head_dim * 4
                assert kv < r["kv_bytes_per_step"] < kv * 1.2
                assert r["kv_cache_bytes"] < full["kv_cache_bytes"] or budget > T / 2
            else:  # prefill is the full model's: the same first token
                assert r["token_ids"][0][0] == full["token_ids"][0][0]
                assert r["method_params"]["filter_layers"] == [2, 8, 17]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU machine)")
def test_omnikv_offload_on_cuda_equals_in_memory():
    """The pinned host bank and the packed asynchronous copy on a real device."""
    model = random_model().cuda()
    prompt = torch.randint(0, 60, (2, 120), generator=torch.Generator().manual_seed(4)).cuda()
    opts = {"filter_layers": [1, 3]}
    mem = generate(model, prompt, CacheRequest("omnikv", 24, options=opts), max_new_tokens=12)
    off = generate(model, prompt, CacheRequest("omnikv", 24, options={**opts, "offload": True}),
                   max_new_tokens=12)
    assert off["token_ids"] == mem["token_ids"]
    assert model.caches[5].k_bank.is_pinned() and model.caches[5].k_bank.device.type == "cpu"
