"""SnapKV and SnapKV++ decode steps ("evict as the answer grows", snapkv.VoteEvictionSelector)
against a slow float64 reference of the rule; the answer does not depend on max_new_tokens; a
step never reads more than t tokens per KV group; the step compiles."""

import math

import pytest
import torch

from rocketkv.compression import build_caches
from rocketkv.compression import snapkv as snapkv_module
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.model import ModelArgs, Transformer


def ref_pooled(q_obs, k, window, kernel, pooling, shared):
    """Pooled votes in float64: per query head and window query, a softmax over the keys up to
    the query's position; summed over the window (and over the query group when ``shared``),
    then pooled with zero padding (stride 1, ``kernel // 2`` each side; avg divides by the
    kernel). Returns (B, H or H_kv, T - window) float64."""
    B, H, w, D = q_obs.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, L = H // Hkv, T - window
    votes = torch.zeros(B, H, L, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for r in range(w):
                i = T - w + r  # the query's position
                s = k[b, h // G, :i + 1].double() @ q_obs[b, h, r].double() / math.sqrt(D)
                votes[b, h] += torch.softmax(s, 0)[:L]
    if shared:
        votes = votes.view(B, Hkv, G, L).sum(dim=2)
    pooled = torch.empty_like(votes)
    for j in range(L):
        near = votes[..., max(0, j - kernel // 2):min(L, j + kernel // 2 + 1)]
        pooled[..., j] = near.amax(-1) if pooling == "max" else near.sum(-1) / kernel
    return pooled


class Reference:
    """The rule, written out: each row (a KV head when ``shared``, else a query head) keeps
    c = min(T, t // G_a) prompt tokens at prefill (the window, and the top c - window prefix
    tokens by pooled vote), and gives them up in order (lowest vote first, equal votes earlier
    position first, then the window's oldest) so that, with i answer tokens cached, it reads
    min(c, max(t - i, 0) // G_a) prompt tokens and the last min(i, t) answer tokens."""

    def __init__(self, q_obs, k, v, budget, window, kernel, pooling, shared):
        B, H = q_obs.shape[:2]
        Hkv, T = k.shape[1], k.shape[2]
        self.G = H // Hkv
        self.Ga = 1 if shared else self.G
        self.k, self.v, self.t, self.T, self.shared = k.double(), v.double(), budget, T, shared
        w = min(window, T)
        c = min(T, budget // self.Ga)
        pooled = ref_pooled(q_obs, k, window, kernel, pooling, shared) if T > window else None
        self.order = {}  # (b, row) -> the kept prompt positions, first given up first
        for b in range(B):
            for row in range(Hkv if shared else H):
                prefix = []
                if pooled is not None:
                    scores = pooled[b, row].tolist()
                    ranked = sorted(range(T - w), key=lambda j: (scores[j], j))
                    prefix = ranked[len(ranked) - (c - w):]
                self.order[b, row] = prefix + list(range(T - w, T))
        self.c = c

    def positions(self, b, h, i):
        """The positions query head h of sequence b reads with i answer tokens cached."""
        p = min(self.c, max(self.t - i, 0) // self.Ga)
        prompt = self.order[b, h // self.G if self.shared else h][self.c - p:]
        return prompt + list(range(self.T + max(0, i - self.t), self.T + i))

    def step(self, q, k_all, v_all, i):
        """Attention (B, H, 1, D) float64 of q (B, H, 1, D) at the step with i answer tokens
        cached; k_all, v_all (B, H_kv, >= T + i, D) hold every position."""
        B, H, _, D = q.shape
        out = torch.zeros(B, H, 1, D, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                js = self.positions(b, h, i)
                kh, vh = k_all[b, h // self.G, js].double(), v_all[b, h // self.G, js].double()
                p = torch.softmax(kh @ q[b, h, 0].double() / math.sqrt(D), 0)
                out[b, h, 0] = p @ vh
        return out


def random_qkv(B, H, Hkv, n, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(B, H, n, D, generator=g)  # peaked attention: votes far apart
    k, v = torch.randn(2, B, Hkv, n, D, generator=g)
    return q, k, v


def compressed_cache(method, H, Hkv, T, m, budget, window, kernel, B=2, D=8):
    args = ModelArgs(dim=H * D, n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=D,
                     vocab_size=16)
    cache = build_caches(method, args, batch_size=B, prompt_len=T, max_new_tokens=m,
                         budget=budget, dtype=torch.float32, device="cpu", window=window,
                         kernel_size=kernel)[0]
    assert cache.method_params()["compressed"]
    return cache


CASES = [  # method, (H, H_kv), T, t, m: prefix, then window, then answer tokens evicted
    ("snapkv_pp", (4, 2), 50, 24, 50),   # T > t
    ("snapkv_pp", (4, 2), 14, 24, 40),   # T < t: dense for 10 steps
    ("snapkv_pp", (4, 2), 5, 24, 40),    # T <= window: nothing to vote on
    ("snapkv_pp", (6, 1), 40, 20, 30),
    ("snapkv", (4, 2), 50, 30, 45),      # per query head, G = 2
    ("snapkv", (4, 2), 12, 40, 45),      # t // G >= T: every head keeps the whole prompt
    ("snapkv", (6, 1), 50, 60, 70),      # G = 6: 10 prompt tokens per head
    ("snapkv", (4, 4), 40, 20, 30),      # MHA: per query head is per KV head
]


@pytest.mark.parametrize("method,heads,T,t,m", CASES)
def test_decode_matches_the_rule_at_every_step(method, heads, T, t, m):
    H, Hkv = heads
    window, kernel, B, D = 6, 5, 2, 8
    pooling = "max" if method == "snapkv_pp" else "avg"
    cache = compressed_cache(method, H, Hkv, T, m, t, window, kernel, B, D)
    q, k, v = random_qkv(B, H, Hkv, T + m, D, seed=T + t)
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    ref = Reference(q[:, :, T - min(window, T):T], k[:, :, :T], v[:, :, :T], t, window,
                    kernel, pooling, shared=method == "snapkv_pp")
    for i in range(1, m + 1):  # i answer tokens cached once the step's own is written
        pos = T + i - 1
        out = cache.decode(q[:, :, pos:pos + 1], k[:, :, pos:pos + 1], v[:, :, pos:pos + 1],
                           torch.tensor([pos]))
        expected = ref.step(q[:, :, pos:pos + 1], k, v, i)
        assert torch.allclose(out.double(), expected, atol=1e-5), (method, i)
    assert m > t  # the last steps read answer tokens only


@pytest.mark.parametrize("method,heads,T,t,m", [c for c in CASES if c[1] != (4, 4)])
def test_a_step_never_reads_more_than_the_budget(method, heads, T, t, m, monkeypatch):
    """Count the masks the attention gets: per KV group at most t slots are read (exactly
    min(cached, t) when shared), and per query head G * prompt + answer <= t (SnapKV's
    per-head accounting)."""
    H, Hkv = heads
    G = H // Hkv
    cache = compressed_cache(method, H, Hkv, T, m, t, window=6, kernel=5)
    sel = cache.selector
    q, k, v = random_qkv(2, H, Hkv, T + m, 8, seed=1)
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    masks = []
    real = snapkv_module.attend
    monkeypatch.setattr(snapkv_module, "attend",
                        lambda q_, k_, v_, mask: masks.append((k_.shape[2], mask)) or
                        real(q_, k_, v_, mask))
    for i in range(1, m + 1):
        pos = T + i - 1
        cache.decode(q[:, :, pos:pos + 1], k[:, :, pos:pos + 1], v[:, :, pos:pos + 1],
                     torch.tensor([pos]))
        read, mask = masks[-1]
        assert read in (t, cache.length)  # t gathered slots, or a buffer of at most t
        mask = mask.view(*[1] * (4 - mask.dim()), *mask.shape).expand(2, Hkv, -1, read)
        per_group = mask.any(dim=2).sum(dim=-1)  # (B, H_kv) slots read by some query head
        cached = cache.kept + i
        assert int(per_group.max()) <= t
        idx, want = sel.read_slots(cache, torch.tensor([pos]))
        if read < cache.length:  # the gathered slots: the same selection
            assert torch.equal(mask, want.expand_as(mask))
        if method == "snapkv_pp":
            assert (per_group == min(cached, t)).all()
        else:
            slots = idx if read < cache.length else torch.arange(cache.length).expand(2, Hkv, -1)
            prompt = (mask & (slots < cache.kept)[:, :, None]).sum(-1)  # (B, H_kv, G)
            answer = (mask & (slots >= cache.kept)[:, :, None]).sum(-1)
            assert (G * prompt + answer <= t).all()
            assert (answer == min(i, t)).all()
    assert sel.ideal_bytes(cache) == cache.kv_bytes(t)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     intermediate_size=64, vocab_size=97, max_seq_len=640)
    return Transformer(args).eval()


@pytest.mark.parametrize("method", ["snapkv", "snapkv_pp"])
@pytest.mark.parametrize("T", [100, 50])
def test_the_answer_does_not_depend_on_max_new_tokens(stories_model, method, T):
    """Caches sized for 16 and for 400 new tokens give the same first 16 tokens, though the
    rule evicts within them (t = 64: from the first step when T = 100, from the 15th when
    T = 50), where the paper's P = t - m would refuse m = 400."""
    prompt = torch.randint(3, 500, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    cache = CacheRequest(method, 64, {"window": 16})
    short = generate(stories_model, prompt, cache, max_new_tokens=16)
    long = generate(stories_model, prompt, cache, max_new_tokens=400)
    assert len(long["token_ids"][0]) == 400
    assert short["token_ids"][0] == long["token_ids"][0][:16]
    assert short["method_params"]["capacity"] < long["method_params"]["capacity"]
    # the eviction shows: the full cache's answer differs within the 400 tokens
    full = generate(stories_model, prompt, max_new_tokens=400)
    assert full["token_ids"][0] != long["token_ids"][0]


def test_logits_do_not_depend_on_the_cache_size():
    """Teacher-forced decode steps on caches sized for 16 and 400 new tokens give the same
    logits at every step, evicting from the first step on (a random model)."""
    model = tiny_model()
    T, t = 90, 48
    tokens = torch.randint(0, 97, (1, T + 16), generator=torch.Generator().manual_seed(3))
    for method in ("snapkv", "snapkv_pp"):
        logits = []
        for m in (16, 400):
            model.setup_caches(build_caches(method, model.args, batch_size=1, prompt_len=T,
                                            max_new_tokens=m, budget=t, dtype=torch.float32,
                                            device="cpu", window=8), T + m)
            with torch.no_grad():
                steps = [model.prefill(tokens[:, :T])]
                for pos in range(T, T + 15):
                    steps.append(model(tokens[:, pos:pos + 1], torch.tensor([pos])))
            logits.append(torch.stack(steps))
        assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0), method


@pytest.mark.parametrize("method", ["snapkv", "snapkv_pp"])
def test_the_evicting_step_compiles_once_and_equals_eager(method):
    from torch._dynamo.testing import CompileCounterWithBackend

    model = tiny_model(1)
    prompt = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = CacheRequest(method, 48, {"window": 8})
    eager = generate(model, prompt, cache, max_new_tokens=10)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")  # traced through AOTAutograd too
    try:
        compiled = generate(model, prompt, cache, max_new_tokens=10,
                            step=StepConfig(compile=True, backend=counter))
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1  # fullgraph: a graph break or a host sync would raise
    assert compiled["token_ids"] == eager["token_ids"]
