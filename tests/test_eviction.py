"""StreamingLLM, H2O and DuoAttention (compression/streamingllm.py, h2o.py, duoattention.py)
against slow references, and
DuoAttention's head identification (scripts/duo_identify.py)."""

import math
from pathlib import Path

import pytest
import torch
from conftest import SMOLLM2_GGUF, shared_file

from rocketkv import cache as kv_cache
from rocketkv.cache import attention as kv_attention
from rocketkv.cache import attention_column_sums
from rocketkv.cli.generate import main
from rocketkv.compression import build_caches, derive
from rocketkv.compression.duoattention import (
    duo_retrieval_heads,
    duo_split,
    load_duo_pattern,
    shipped_pattern,
)
from rocketkv.compression.h2o import H2OCache
from rocketkv.compression.streamingllm import SinkRecentCache
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.prefill import prefill_once
from rocketkv.model import ConfigError, ModelArgs, Transformer

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_PATTERN = ROOT / "rocketkv" / "patterns" / "SmolLM2-135M-Instruct"


def tiny_args(H=4, Hkv=2, D=8, layers=1, max_seq_len=2048):
    return ModelArgs(dim=H * D, n_layers=layers, n_heads=H, n_kv_heads=Hkv, head_dim=D,
                     intermediate_size=8, vocab_size=50, max_seq_len=max_seq_len)


def qkv(B, H, Hkv, N, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g),
            torch.randn(B, Hkv, N, D, generator=g))


def dense_over(q, k, v, positions):
    """Reference attention of q (B, H, 1, D) over the positions ``positions[b][h_kv]`` (lists)
    of k, v (B, H_kv, N, D), one query head at a time."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    out = torch.zeros(B, H, 1, D)
    for b in range(B):
        for h in range(H):
            idx = torch.tensor(sorted(positions[b][h // G]))
            s = (k[b, h // G, idx] @ q[b, h, 0]) / math.sqrt(D)
            out[b, h, 0] = torch.softmax(s, 0) @ v[b, h // G, idx]
    return out


def window(p, sink, recent):
    return [j for j in range(p + 1) if j < sink or j > p - recent]


def positions_read(cache, p):
    pos = cache.read_positions(p)
    return [[sorted(x for x in pos[b, h].tolist() if x >= 0) for h in range(pos.shape[1])]
            for b in range(pos.shape[0])]


# ---- StreamingLLM ------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [30, 8, 3])
def test_streaming_ring_keeps_sinks_and_window_over_many_steps(T):
    B, H, Hkv, D, sink, recent, m = 2, 4, 2, 8, 4, 10, 40
    args = tiny_args(H, Hkv, D)
    cache = SinkRecentCache(0, args, B, torch.float32, "cpu", prompt_len=T, max_new_tokens=m,
                            sink=sink, recent=recent)
    q, k, v = qkv(B, H, Hkv, T + m, D, seed=T)
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    assert positions_read(cache, T - 1)[0][0] == window(T - 1, sink, recent)
    for p in range(T, T + m):  # wraps the 10-slot ring four times
        out = cache.decode(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1],
                           torch.tensor([p]))
        want = window(p, sink, recent)
        assert positions_read(cache, p) == [[want] * Hkv] * B
        ref = dense_over(q[:, :, p:p + 1], k, v, [[want] * Hkv] * B)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert cache.bytes_read_per_step() == 2 * B * Hkv * (sink + recent) * D * 4


@pytest.mark.parametrize("retrieval", [[], [1]])
def test_append_sees_a_sliding_window_then_decodes_on(retrieval):
    B, H, Hkv, D, sink, recent, T, Tc, m = 1, 4, 2, 8, 2, 6, 20, 9, 20
    args = tiny_args(H, Hkv, D)
    cache = SinkRecentCache(0, args, B, torch.float32, "cpu", prompt_len=T, max_new_tokens=m,
                            sink=sink, recent=recent, retrieval_heads=retrieval)
    # K/V storage per head (retrieval: T + m, streaming: the ring) and the index buffers
    n_r = len(retrieval)
    assert cache.allocated_bytes() == 2 * B * D * 4 * (n_r * (T + m) + (Hkv - n_r) * 8) + \
        8 * (Hkv + Hkv)
    q, k, v = qkv(B, H, Hkv, T + m, D, seed=3)

    def want(p):  # streaming heads: sinks + window; a retrieval head: everything
        return [[list(range(p + 1)) if h in retrieval else window(p, sink, recent)
                 for h in range(Hkv)]]

    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    out = cache.append(q[:, :, T:T + Tc], k[:, :, T:T + Tc], v[:, :, T:T + Tc], T)
    for i in range(Tc):  # each chunk query sees the sinks and its own window
        p = T + i
        ref = dense_over(q[:, :, p:p + 1], k, v, want(p))
        torch.testing.assert_close(out[:, :, i:i + 1], ref, rtol=1e-5, atol=1e-5)
    for p in range(T + Tc, T + Tc + 3):
        out = cache.decode(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1],
                           torch.tensor([p]))
        assert positions_read(cache, p) == want(p)
        torch.testing.assert_close(out, dense_over(q[:, :, p:p + 1], k, v, want(p)),
                                   rtol=1e-5, atol=1e-5)


# ---- H2O ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["lse", "blocks"])
@pytest.mark.parametrize("start", [0, 9])
def test_attention_column_sums_against_the_whole_matrix(monkeypatch, path, start):
    """Both implementations (the CPU's two flash passes; row blocks, as on other devices)
    against the whole causal softmax matrix, for a prompt and for a later block of queries,
    summed over the group and per query head."""
    B, H, Hkv, D, S = 2, 6, 2, 8, 23
    q, k, _ = qkv(B, H, Hkv, S, D, seed=1)
    G = H // Hkv
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    p = s.softmax(-1)[:, :, start:]  # the block's queries
    want = p.sum(2)  # (B, H, S)
    if path == "blocks":
        monkeypatch.setattr(kv_attention, "_CPU_FLASH", "no such kernel")
        monkeypatch.setattr(kv_attention, "MASK_ELEMENTS", 50)  # many small row blocks
    else:
        monkeypatch.setattr(kv_attention, "LSE_ROWS", 5)  # the transposed pass in several blocks
    got = attention_column_sums(q[:, :, start:], k, start)
    torch.testing.assert_close(got, want.view(B, Hkv, G, S).sum(2), rtol=1e-5, atol=1e-5)
    per_head = attention_column_sums(q[:, :, start:], k, start, per_query_head=True)
    torch.testing.assert_close(per_head, want, rtol=1e-5, atol=1e-5)
    # each query's weights sum to one: the sums add up to the queries x group size
    assert float(got.sum()) == pytest.approx(B * Hkv * G * (S - start), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 9])
def test_attention_and_column_sums_reuse_the_attention_log_sum_exp(dtype, start):
    """The fused call (the attention pass's log-sum-exp serving the column sums) gives the
    same bits as the two separate calls, and the sums match the whole causal softmax matrix:
    a resumed evaluation's answers do not depend on which call made its prefill."""
    B, H, Hkv, D, S = 2, 6, 2, 16, 40
    q, k, v = qkv(B, H, Hkv, S, D, seed=3)
    G = H // Hkv
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    want = s.softmax(-1)[:, :, start:].sum(2).view(B, Hkv, G, S).sum(2)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out, sums = kv_cache.attention_and_column_sums(q[:, :, start:], k, v, start)
    assert torch.equal(out, kv_cache.causal_attention(q[:, :, start:], k, v, start))
    assert torch.equal(sums, attention_column_sums(q[:, :, start:], k, start))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(sums, want, rtol=tol, atol=tol)


def test_attention_column_sums_in_bfloat16_keep_float32_scores():
    """In bfloat16 the CPU path's sums stay within 1e-3 (relative) of the float32 sums of the
    same inputs: the flash kernel keeps the scores in float32, and the log-sum-exp bias
    travels as a high and a low bfloat16 part (one part alone errs by about 1%)."""
    B, H, Hkv, D, S = 1, 4, 2, 64, 700
    q, k, _ = qkv(B, H, Hkv, S, D, seed=2)
    q, k = q.to(torch.bfloat16), (2 * k).to(torch.bfloat16)
    want = attention_column_sums(q.float(), k.float())
    got = attention_column_sums(q, k)
    assert ((got - want).abs() / want.clamp(min=1e-2)).max() < 1e-3


class H2OReference:
    """H2O with Python lists: per (sequence, KV head) the kept positions and their scores."""

    def __init__(self, q, k, v, T, heavy, recent):
        self.q, self.k, self.v = q, k, v
        self.heavy, self.recent, self.C = heavy, recent, heavy + recent
        B, H, _, D = q.shape
        Hkv = k.shape[1]
        self.G = H // Hkv
        self.kept, self.score = [], []
        for b in range(B):
            kb, sb = [], []
            for h in range(Hkv):
                sums = torch.zeros(T)
                for g in range(self.G):
                    qh = q[b, h * self.G + g, :T]
                    s = (qh @ k[b, h, :T].T) / math.sqrt(D)
                    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                    sums += s.softmax(-1).sum(0)
                keep = set(range(max(0, T - recent), T))
                rest = sorted(range(0, max(0, T - recent)), key=lambda j: -float(sums[j]))
                keep |= set(rest[:self.C - len(keep)])
                kb.append(sorted(keep))
                sb.append({j: float(sums[j]) for j in keep})
            self.kept.append(kb)
            self.score.append(sb)

    def step(self, p):
        B, H, _, D = self.q.shape
        out = torch.zeros(B, H, 1, D)
        for b in range(B):
            for h in range(len(self.kept[b])):
                kept, score = self.kept[b][h], self.score[b][h]
                if len(kept) == self.C:
                    old = [j for j in kept if j <= p - self.recent]
                    victim = min(old, key=lambda j: score[j])
                    kept.remove(victim)
                    del score[victim]
                kept.append(p)
                kept.sort()
                score[p] = 0.0
                idx = torch.tensor(kept)
                for g in range(self.G):
                    qh = self.q[b, h * self.G + g, p]
                    w = ((self.k[b, h, idx] @ qh) / math.sqrt(D)).softmax(0)
                    out[b, h * self.G + g, 0] = w @ self.v[b, h, idx]
                    for j, x in zip(kept, w.tolist()):
                        score[j] += x
        return out


@pytest.mark.parametrize("T,heavy,recent", [(40, 6, 5), (7, 4, 4), (25, 10, 1)])
def test_h2o_scores_and_evictions_over_many_steps(T, heavy, recent):
    B, H, Hkv, D, m = 2, 4, 2, 8, 30
    args = tiny_args(H, Hkv, D)
    q, k, v = qkv(B, H, Hkv, T + m, D, seed=T + heavy)
    cache = H2OCache(0, args, B, torch.float32, "cpu", prompt_len=T, max_new_tokens=m,
                     heavy=heavy, recent=recent)
    ref = H2OReference(q, k, v, T, heavy, recent)
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    assert positions_read(cache, T - 1) == ref.kept
    for p in range(T, T + m):
        out = cache.decode(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1],
                           torch.tensor([p]))
        want = ref.step(p)
        assert positions_read(cache, p) == ref.kept, p
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        slot_scores = {(b, h, int(j)): float(s) for b in range(B) for h in range(Hkv)
                       for j, s in zip(cache.slot_pos[b, h], cache.scores[b, h]) if j >= 0}
        for (b, h, j), s in slot_scores.items():
            assert s == pytest.approx(ref.score[b][h][j], rel=1e-4, abs=1e-5)


def test_h2o_append_attends_to_kept_and_chunk_then_evicts_by_the_same_rule():
    B, H, Hkv, D, T, heavy, recent, Tc = 1, 4, 2, 8, 30, 6, 4, 7
    args = tiny_args(H, Hkv, D)
    q, k, v = qkv(B, H, Hkv, T + Tc + 5, D, seed=11)
    cache = H2OCache(0, args, B, torch.float32, "cpu", prompt_len=T, max_new_tokens=Tc + 5,
                     heavy=heavy, recent=recent)
    ref = H2OReference(q, k, v, T, heavy, recent)
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    out = cache.append(q[:, :, T:T + Tc], k[:, :, T:T + Tc], v[:, :, T:T + Tc], T)
    G = H // Hkv
    for h in range(Hkv):  # reference: kept + chunk, causal; sums added; then the keep rule
        kept, score = ref.kept[0][h], ref.score[0][h]
        cand = kept + list(range(T, T + Tc))
        for j in range(T, T + Tc):
            score[j] = 0.0
        for i in range(Tc):
            p = T + i
            vis = [j for j in cand if j <= p]
            idx = torch.tensor(vis)
            for g in range(G):
                w = ((k[0, h, idx] @ q[0, h * G + g, p]) / math.sqrt(D)).softmax(0)
                torch.testing.assert_close(out[0, h * G + g, i], w @ v[0, h, idx],
                                           rtol=1e-5, atol=1e-5)
                for j, x in zip(vis, w.tolist()):
                    score[j] += x
        now = T + Tc - 1
        keep = {j for j in cand if j > now - recent}
        rest = sorted((j for j in cand if j not in keep), key=lambda j: -score[j])
        keep |= set(rest[:heavy + recent - len(keep)])
        ref.kept[0][h] = sorted(keep)
        ref.score[0][h] = {j: score[j] for j in keep}
    assert positions_read(cache, T + Tc - 1) == ref.kept
    p = T + Tc
    out = cache.decode(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor([p]))
    torch.testing.assert_close(out, ref.step(p), rtol=1e-5, atol=1e-5)


def test_h2o_shared_prefill_equals_its_own_prefill(stories_model):
    prompt = torch.randint(1, 500, (2, 120), generator=torch.Generator().manual_seed(0))
    own = generate(stories_model, prompt, CacheRequest("h2o", 48), max_new_tokens=12)
    with pytest.raises(ConfigError, match="attention_sums=True"):
        generate(stories_model, prompt, CacheRequest("h2o", 48), max_new_tokens=12,
                 prefilled=prefill_once(stories_model, prompt))
    pre = prefill_once(stories_model, prompt, attention_sums=True)
    shared = generate(stories_model, prompt, CacheRequest("h2o", 48), max_new_tokens=12,
                      prefilled=pre)
    assert shared["token_ids"] == own["token_ids"]
    a = stories_model.args
    pair = 2 * a.head_dim * 4
    assert own["kv_bytes_per_step"] == a.n_layers * 2 * a.n_kv_heads * 48 * (pair + 12)
    assert own["kv_cache_bytes"] == a.n_layers * 2 * a.n_kv_heads * 48 * (pair + 12)


# ---- DuoAttention -----------------------------------------------------------------------------

def test_duo_budget_mapping_follows_the_papers_baseline():
    assert duo_split(128, 8192, 96) == {"sink": 25, "recent": 103, "retrieval_heads": 0,
                                        "needs_pattern": False}
    assert duo_split(256, 8192, 96)["sink"] == 51  # 20% at 256 and below
    assert duo_split(512, 8192, 96)["sink"] == 128
    assert duo_split(640, 8192, 96)["retrieval_heads"] == 0
    d = duo_split(1024, 8192, 96)
    assert (d["sink"], d["recent"]) == (128, 512)
    assert d["retrieval_heads"] == math.floor(96 * (1024 - 640) / (8192 - 640)) == 4
    # the average read per KV head stays within the budget
    args = ModelArgs.from_name("llama-3.1-8b")
    p = derive("duoattention", 4096, 32768, args, {})
    assert p.traffic_tokens <= 4096 and p.retrieval_heads == 27


def write_tsv(path, rows):
    path.write_text("\n".join("\t".join(str(x) for x in r) for r in rows) + "\n")
    return path


def test_duo_pattern_file_and_head_split(tmp_path):
    args = tiny_args(4, 2, 8, layers=3)
    rows = [[0.9, 0.1], [0.2, 0.6], [0.55, 0.95]]
    write_tsv(tmp_path / "full_attention_heads.tsv", rows)
    gates = load_duo_pattern(tmp_path, args)  # a directory holding the file
    assert gates.tolist() == rows
    assert duo_retrieval_heads(gates, threshold=0.5) == [[0], [1], [0, 1]]
    assert duo_retrieval_heads(gates, n_ret=2) == [[0], [], [1]]  # 0.95, then 0.9
    # gates clipped at 1.0 tie: the lower layer, then the lower KV head, goes first
    tied = torch.tensor([[0.5, 1.0], [1.0, 1.0], [1.0, 0.2]])
    assert duo_retrieval_heads(tied, n_ret=2) == [[1], [0], []]
    assert duo_retrieval_heads(tied, n_ret=3) == [[1], [0, 1], []]
    for bad, match in (([[1, 2]] * 2, "3 rows"), ([[1, 2], [1], [1, 2]], "3 rows"),
                       ([["a", 1]] * 3, "non-numeric")):
        write_tsv(tmp_path / "bad.tsv", bad)
        with pytest.raises(ConfigError, match=match):
            load_duo_pattern(tmp_path / "bad.tsv", args)
    with pytest.raises(ConfigError, match="cannot read"):
        load_duo_pattern(tmp_path / "missing.tsv", args)


def test_duo_finds_the_pattern_shipped_for_its_model(tmp_path):
    """Without --duo-patterns, the pattern under patterns/ whose config.json names the model
    (and whose TSV has its layers x KV heads) is used; with none, the error names the option,
    and with --duo-threshold it says the threshold needs the gates too."""
    import json

    name = json.loads((SMOLLM2_PATTERN / "config.json").read_text())["model"]
    smollm2 = ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                        vocab_size=49152, name=name)
    assert shipped_pattern(smollm2) == SMOLLM2_PATTERN
    assert shipped_pattern(ModelArgs(**{**smollm2.__dict__, "n_layers": 29})) is None
    caches = build_caches("duoattention", smollm2, batch_size=1, prompt_len=900,
                          max_new_tokens=4, budget=700, dtype=torch.float32, device="meta")
    assert caches[0].method_params()["duo_patterns"] == str(SMOLLM2_PATTERN)
    other = ModelArgs(**{**smollm2.__dict__, "name": "another model"})
    with pytest.raises(ConfigError, match="keeps 16 retrieval heads .* --duo-patterns PATH"):
        build_caches("duoattention", other, batch_size=1, prompt_len=900, max_new_tokens=4,
                     budget=700, dtype=torch.float32, device="meta")
    with pytest.raises(ConfigError, match="gates above --duo-threshold 0.5 .* --duo-patterns"):
        build_caches("duoattention", other, batch_size=1, prompt_len=900, max_new_tokens=4,
                     budget=700, dtype=torch.float32, device="meta", duo_threshold=0.5)
    assert shipped_pattern(smollm2, root=tmp_path) is None
    # the Qwen2.5-Coder-0.5B-Instruct pattern is found for the model its config.json names
    qwen_dir = ROOT / "rocketkv" / "patterns" / "Qwen2.5-Coder-0.5B-Instruct"
    qwen = ModelArgs(**{**ModelArgs.from_name("qwen2.5-0.5b").__dict__,
                        "name": json.loads((qwen_dir / "config.json").read_text())["model"]})
    assert shipped_pattern(qwen) == qwen_dir
    assert shipped_pattern(ModelArgs(**{**qwen.__dict__, "n_layers": 23})) is None


def test_duo_caches_have_per_head_capacities_and_attend_like_the_references(tmp_path):
    B, H, Hkv, D, L, T, m = 1, 4, 2, 8, 2, 800, 3
    args = tiny_args(H, Hkv, D, layers=L)
    pattern = write_tsv(tmp_path / "p.tsv", [[0.3, 0.8], [0.1, 0.2]])
    with pytest.raises(ConfigError, match="--duo-patterns"):
        build_caches("duoattention", args, batch_size=B, prompt_len=T, max_new_tokens=m,
                     budget=700, dtype=torch.float32, device="cpu")
    caches = build_caches("duoattention", args, batch_size=B, prompt_len=T, max_new_tokens=m,
                          budget=700, dtype=torch.float32, device="cpu",
                          duo_patterns=str(pattern))
    # (700 - 640) / (832 - 640) of the 4 KV heads -> 1 retrieval head: layer 0, head 1 (832:
    # the cache's 801 tokens at the first decode step, rounded up to 64; not T + m)
    assert [(c.n_retrieval, c.n_streaming) for c in caches] == [(1, 1), (0, 2)]
    assert caches[0].k_full.shape == (B, 1, T + m, D)
    assert caches[0].k_ring.shape == (B, 1, 640, D) and caches[1].k_ring.shape == (B, 2, 640, D)
    p = caches[0].method_params()
    assert p["traffic_tokens"] == pytest.approx((832 + 3 * 640) / 4) and p["traffic_tokens"] < 700
    total = sum(c.bytes_read_per_step() for c in caches)
    assert total == 2 * D * 4 * (803 + 3 * 640) * B
    q, k, v = qkv(B, H, Hkv, T + m, D, seed=5)
    c = caches[0]
    c.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    for pos in range(T, T + m):
        out = c.decode(q[:, :, pos:pos + 1], k[:, :, pos:pos + 1], v[:, :, pos:pos + 1],
                       torch.tensor([pos]))
        want = [[window(pos, 128, 512), list(range(pos + 1))]]  # head 0 streams, 1 retrieves
        assert positions_read(c, pos) == want
        torch.testing.assert_close(out, dense_over(q[:, :, pos:pos + 1], k, v, want),
                                   rtol=1e-5, atol=1e-5)
    # the pattern's own split (threshold) instead of the budget's share
    caches = build_caches("duoattention", args, batch_size=B, prompt_len=T, max_new_tokens=m,
                          budget=700, dtype=torch.float32, device="cpu",
                          duo_patterns=str(pattern), duo_threshold=0.25)
    assert [c.n_retrieval for c in caches] == [2, 0]
    assert caches[0].method_params()["budget_overshoot"] == pytest.approx(
        (2 * 832 + 2 * 640) / 4 / 700)


def test_mixed_head_layers_compile_once_and_equal_eager(tmp_path):
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    args = tiny_args(H=4, Hkv=2, D=16, layers=3, max_seq_len=1024)
    model = Transformer(args)
    # 6 KV heads, (704 - 640) / (768 - 640) of them -> 3 retrieval heads: 2, 1 and 0 per layer
    # (768: the 751 tokens of the first decode step rounded up to 64)
    pattern = write_tsv(tmp_path / "p.tsv", [[0.9, 0.8], [0.1, 0.7], [0.2, 0.3]])
    prompt = torch.randint(0, args.vocab_size, (1, 750))
    cache = CacheRequest("duoattention", 704, {"duo_patterns": str(pattern)})
    eager = generate(model, prompt, cache, max_new_tokens=10)
    assert [(c.n_retrieval, c.n_streaming) for c in model.caches] == [(2, 0), (1, 1), (0, 2)]
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = generate(model, prompt, cache, max_new_tokens=10,
                        step=StepConfig(compile=True, backend=counter))
    assert counter.frame_count == 1  # fullgraph: a graph break would raise
    assert compiled["token_ids"] == eager["token_ids"]


def test_cli_errors_for_the_new_options(tmp_path, capsys):
    base = ["--checkpoint", "random:stories260K", "--random-prompt", "200",
            "--max-new-tokens", "4", "--no-stream"]
    assert main(base + ["--method", "h2o", "--budget", "64", "--sink-size", "3"]) == 2
    assert "--sink-size does not apply to method h2o" in capsys.readouterr().err
    assert main(base + ["--method", "h2o", "--budget", "64", "--heavy-ratio", "1.5"]) == 2
    assert "--heavy-ratio must lie" in capsys.readouterr().err
    assert main(base + ["--method", "streamingllm", "--budget", "4"]) == 2
    assert "smallest valid budget here is 5" in capsys.readouterr().err


# ---- SmolLM2 ------------------------------------------------------------------------------------

def test_smollm2_runs_each_method_at_budgets_128_to_1024(smollm2_model):
    from conftest import ESSAYS

    from rocketkv.formats.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_file(SMOLLM2_GGUF))
    words = " ".join(p.read_text() for p in sorted(shared_file(ESSAYS).glob("*.txt"))[:2]).split()
    ids = tok.encode_chat(" ".join(words[:1100]) + "\n\nWhat is the text about?")
    T, m = len(ids), 4
    assert 1200 < T < 1800
    pre = prefill_once(smollm2_model, ids, attention_sums=True)
    full = generate(smollm2_model, ids, max_new_tokens=m, prefilled=pre)["token_ids"]
    a = smollm2_model.args
    pair = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4  # K+V bytes of a token, all layers
    for method in ("streamingllm", "h2o", "duoattention"):
        for budget in (128, 256, 512, 1024):
            opts = {"duo_patterns": str(SMOLLM2_PATTERN)} if method == "duoattention" else {}
            r = generate(smollm2_model, ids, CacheRequest(method, budget, options=opts),
                         max_new_tokens=m, prefilled=pre)
            out = r["token_ids"][0]
            assert len(out) == m and out[0] == full[0][0]
            aux = 12 * a.n_layers * a.n_kv_heads * budget if method == "h2o" else 0
            assert r["kv_bytes_per_step"] - aux <= budget * pair
            assert r["kv_cache_bytes"] < r["full_kv_bytes"]
            if method == "duoattention" and budget == 1024:
                assert r["method_params"]["retrieval_heads"] > 0


def test_committed_smollm2_pattern_matches_the_model(smollm2_model):
    gates = load_duo_pattern(SMOLLM2_PATTERN, smollm2_model.args)
    assert ((gates >= 0) & (gates <= 1)).all()
    assert (SMOLLM2_PATTERN / "config.json").exists()


# ---- head identification ------------------------------------------------------------------------

def test_identification_keeps_a_retrieving_head_and_drops_an_idle_one():
    from rocketkv.evals.duo_identify import identify

    torch.manual_seed(0)
    args = tiny_args(H=2, Hkv=2, D=16, layers=1, max_seq_len=64)
    model = Transformer(args)
    model.setup_caches([None], 64)
    D = args.head_dim
    with torch.no_grad():
        w = model.layers[0].attention.wqkv.weight  # rows: q (2 heads), k (2), v (2)
        w[0:D] = 0  # head 0: zero queries -> uniform attention over every earlier token
        w[5 * D:6 * D] = 0  # head 1: zero values -> its output never depends on its gate
    g = torch.Generator().manual_seed(1)

    def samples(step):
        return torch.randint(0, args.vocab_size, (1, 48), generator=g), 6

    gates, history = identify(model, samples, 40, lr=0.05, reg_weight=1e-3, sink=2, recent=4,
                              progress=False)
    assert gates.shape == (1, 2)
    assert gates[0, 0] > 0.8  # must see beyond the window: stays a retrieval head
    assert gates[0, 1] < 0.05  # nothing to lose: the L1 term makes it streaming
    assert history[0]["distill"] == 0.0 and len(history) == 40


def test_passkey_samples_have_the_exact_length_and_end_with_the_answer():
    import random

    from rocketkv.evals.duo_identify import passkey_sample

    def encode(s):
        return [ord(c) for c in s]

    ids, answer = passkey_sample(list(range(100, 200)), encode, 400, 3, 6, random.Random(0))
    assert len(ids) == 400
    text = "".join(chr(c) for c in ids[-answer:])
    assert text.endswith(".") and text.count(",") == 2
    with pytest.raises(ConfigError, match="do not fit"):
        passkey_sample(list(range(100, 200)), encode, 60, 3, 6, random.Random(0))


def test_duo_identify_cli_refuses_a_window_covering_the_sequences(tmp_path, capsys):
    from scripts.duo_identify import main as identify_main

    rc = identify_main(["--checkpoint", "random:stories260K", "--out", str(tmp_path / "o"),
                        "--lengths", "100", "200", "--sink", "64", "--recent", "64"])
    assert rc == 2 and "covers the shortest sequence" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
