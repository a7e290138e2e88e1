"""compression/__init__.py: budget -> parameters, errors, bytes, and every method end to end."""

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import SHARED, shared_file
from hypothesis import given, settings
from hypothesis import strategies as st

from rocketkv.cache import CompressedKVCache, FullKVCache
from rocketkv.compression import (
    METHODS,
    Method,
    Option,
    build_caches,
    decode_horizon,
    derive,
    methods_table,
    smallest_budget,
)
from rocketkv.compression.registry import (
    DOC_TABLES,
    CompressedMethod,
    every_option,
    options_table,
    render_docs,
)
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.formats.tokenizer import load_tokenizer
from rocketkv.model import CONFIGS, ConfigError, ModelArgs

# the test matrix comes from the registry: a newly registered method is tested here at once
COMPRESSED = [name for name, m in METHODS.items() if m.budgeted]
LLAMA = ModelArgs.from_name("llama-3.1-8b")
# methods whose caches are CompressedKVCache (kept prompt tokens + a decode-time selector)
SELECTING = [name for name, m in METHODS.items() if isinstance(m, CompressedMethod)]
# ... of which those that approximate scores report the traffic they read (KV pairs per step)
APPROXIMATE = [name for name in SELECTING
               if derive(name, 256, 4096, LLAMA, {}).traffic_tokens is not None]
ROOT = Path(__file__).resolve().parents[1]


def test_every_method_file_is_registered_in_import_order():
    """A method is one file and one import line: every ``@register`` class of compression/ is
    in ``METHODS``, once, in the order compression/__init__.py imports the files (``--help``'s
    order), with what the docs table and ``--help`` show."""
    init = (ROOT / "rocketkv" / "compression" / "__init__.py").read_text()
    imported = re.findall(r"^from rocketkv.compression import (\w+)  # noqa: F401", init, re.M)
    files = {p.stem for p in (ROOT / "rocketkv" / "compression").glob("*.py")
             if re.search(r"^@register$", p.read_text(), re.M)}
    modules = [type(m).__module__.removeprefix("rocketkv.compression.") for m in METHODS.values()]
    assert set(modules) == files and len(files) == len(METHODS)
    assert modules == [f for f in imported if f in files]
    assert not METHODS["full"].budgeted and METHODS["rocketkv"].budgeted
    for name, m in METHODS.items():
        assert m.description and m.budget_rule and m.source, name
        assert type(m).__name__.endswith("Method"), name  # QuestMethod, QuestSelector, ...


def test_a_methods_shared_prefill_is_what_its_caches_do():
    """The harness prefills a batch once only for methods whose ``shared_prefill`` says so
    (``evals.harness.run_batch``), and records attention sums for ``needs_attention_sums``:
    a method reads both from the cache classes it declares, which are the ones it builds."""
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=8192)
    for name, m in METHODS.items():
        caches = build_caches(name, args, batch_size=1, prompt_len=4096, max_new_tokens=8,
                              budget=256 if m.budgeted else None, dtype=torch.bfloat16,
                              device="meta")
        assert all(type(c) in (*m.cache_classes, FullKVCache) for c in caches), name
        assert {c.shared_prefill for c in caches} == {m.shared_prefill}, name
        assert any(c.needs_attention_sums for c in caches) == m.needs_attention_sums, name
    assert not METHODS["keydiff"].shared_prefill and METHODS["h2o"].needs_attention_sums
    assert METHODS["rocketkv"].shared_prefill and not METHODS["rocketkv"].needs_attention_sums


def test_the_docs_tables_are_the_registrys():
    """README.md's and docs/methods.md's method and option tables are generated from the
    registry (``python -m rocketkv.compression --update-docs``); a stale one fails here."""
    for rel, tables in DOC_TABLES.items():
        text = (ROOT / rel).read_text()
        assert render_docs(text, tables) == text, \
            f"{rel} is stale: run python -m rocketkv.compression --update-docs"
    stale = "a\n<!-- methods-table -->\n| old |\n<!-- /methods-table -->\nb"
    fresh = render_docs(stale, {"methods-table": lambda: methods_table()})
    assert fresh != stale and "| `rocketkv` | t |" in fresh and fresh.endswith("\nb")
    with pytest.raises(ValueError, match="no <!-- options-table -->"):
        render_docs(stale, {"options-table": options_table})


def test_a_flag_means_one_thing_and_a_name_registers_once():
    """Methods sharing an option share one ``Option`` (one flag, one help), and a name
    cannot be registered twice."""
    from rocketkv.compression.registry import register
    from rocketkv.compression.snapkv import KERNEL_SIZE

    flags = [o.flag for o in every_option().values()]
    assert len(flags) == len(set(flags)) and "--kernel-size" in flags
    assert KERNEL_SIZE in METHODS["rocketkv"].options and KERNEL_SIZE in METHODS["snapkv"].options

    class Again(Method):
        name = "quest"

    with pytest.raises(ValueError, match="registered twice"):
        register(Again)

    class Clash(Method):
        name = "clash"
        options = (Option("kernel_size", "another meaning"),)

    with pytest.raises(ValueError, match="share one Option"):
        register(Clash)
    assert "clash" not in METHODS


def test_rocketkv_sqrt_split_parameters():
    # S = 4096, t = 256: c = 16 -> stage 1 keeps S / 4; stage 2 at the first step's 1025
    # tokens, 1088 rounded up to 64: c2 = 4.25 -> page min(4, ceil(2.06)) = 3, r = 128 * 3 / 4.25
    p = derive("rocketkv", 256, 4096, LLAMA, {})
    assert p.keep == 1024 and p.c2 == 1088 / 256
    assert (p.page_size, p.r, p.k) == (3, round(128 * 3 / 4.25), 128)
    assert p.kernel_size == 63  # below Llama-3.1's 48K threshold
    p = derive("rocketkv", 256, 64 * 1024, LLAMA, {})
    assert p.kernel_size == 511 and p.keep == round(64 * 1024 / 16)
    # the kernel follows the config, not its name (an HF directory or GGUF file of Llama 3.1)
    renamed = ModelArgs(**{**CONFIGS["llama-3.1-8b"], "name": "Llama-3.1-8B-Instruct.gguf"})
    assert derive("rocketkv", 256, 64 * 1024, renamed, {}).kernel_size == 511
    assert derive("snapkv_pp", 4096, 64 * 1024, renamed, {}).kernel_size == 511
    assert derive("rocketkv", 256, 64 * 1024, renamed, {"kernel_size": 7}).kernel_size == 7
    mistral = ModelArgs(**{**CONFIGS["mistral-7b-v0.2"], "name": "mistral"})
    assert derive("rocketkv", 256, 30 * 1024, mistral, {}).kernel_size == 63


def test_rocketkv_adaptive_split_matches_the_released_example():
    # c = 64: alpha = 0.2 + 0.06 * 6 = 0.56 -> 10.3x at stage 1, then 6.2x
    p = derive("rocketkv", 256, 16384, LLAMA, {"rocket_split": "adaptive"})
    assert p.alpha == pytest.approx(0.56)
    assert p.c1 == pytest.approx(10.3, abs=0.05) and p.c2 == pytest.approx(6.2, abs=0.05)
    c2 = p.c2
    assert p.page_size == min(math.floor(c2), math.ceil(math.sqrt(c2)))
    assert p.r == round(128 * p.page_size / c2)


def test_derived_parameters_of_the_other_methods():
    T = 4096
    assert derive("exact_topk", 256, T, LLAMA, {}).k == 256
    p = derive("snapkv", 1024, T, LLAMA, {})  # t // G per query head, whatever m
    assert p.per_head_keep == 1024 // 4
    assert p.keep == 4 * (256 - 32) + 32 and (p.kernel_size, p.pooling) == (7, "avg")
    p = derive("snapkv_pp", 1024, T, LLAMA, {})  # t prompt tokens, whatever m
    assert p.keep == 1024 and p.pooling == "max"
    # the first decode step's cache holds T + 1 = 4097 tokens: C = 4160 (rounded up to 64)
    p = derive("quest", 512, T, LLAMA, {})  # pages of ceil(4160 / 256): 245 bounds + 256
    assert (p.k, p.page_size, p.pages_scored, p.traffic_tokens) == (256, 17, 245, 501)
    p = derive("quest", 256, T, LLAMA, {})  # 4160 / 128 pages > t/2 with 16-token pages
    assert p.page_size == 33 and p.pages_scored == 127 and p.traffic_tokens == 255
    assert p.budget_overshoot is None
    p = derive("quest", 100, T, LLAMA, {})  # k = 50 tokens, less than one 84-token page
    assert (p.k, p.page_size, p.pages_scored) == (50, 84, 50)
    assert derive("quest", 512, T, LLAMA, {"page_size": 64}).page_size == 64
    p = derive("sparq", 256, T, LLAMA, {})  # r = floor(256 * 128 / 4160)
    assert (p.k, p.r, p.traffic_tokens) == (128, 7, 4160 * 7 / 256 + 128)
    p = derive("sparq", 300, T, LLAMA, {})  # t d / C = 9.23: floor, not round (9, not 9.2)
    assert p.r == 9 and p.traffic_tokens <= 300
    p = derive("hybrid", 256, T, LLAMA, {})  # c = 4160 / 256 = 16.25: pages of 5
    assert (p.page_size, p.r, p.k) == (5, round(128 * 5 / 16.25), 128)


# ---- the paper's operating points: budget 256 at 96K tokens (RocketKV Sec. 4, App. A.3) ----

@pytest.mark.parametrize("method", ["quest", "sparq", "hybrid", "rocketkv"])
def test_paper_budgets_at_96k_tokens_derive(method):
    """Llama-3.1-8B shape, T = 96K, t = 256: every approximate method runs there; the
    traffic it reads is reported, with the overshoot where it exceeds the budget. C: the first
    decode step's T + 1 tokens rounded up to 64 (``decode_horizon``)."""
    T, t = 96 * 1024, 256
    C, d = decode_horizon(T + 1), LLAMA.head_dim
    p = derive(method, t, T, LLAMA, {})
    assert p.k == t // 2
    traffic = p.traffic_tokens
    if traffic > t:
        assert p.budget_overshoot == pytest.approx(traffic / t) and p.budget_overshoot > 1
    else:
        assert p.budget_overshoot is None
    if method == "quest":  # k = 128 tokens, far below one page: pages of ceil(C / 128) tokens
        assert p.page_size == math.ceil(C / 128) and p.pages_scored <= 128
        assert traffic <= t
    elif method == "sparq":  # t d / C = 0.33 < 1: r = 1, C / (2 d) + k pairs, about 2 t
        assert p.r == 1 and traffic == pytest.approx(C / (2 * d) + 128)
        assert p.budget_overshoot == pytest.approx((C / 256 + 128) / 256)
    elif method == "hybrid":  # c = 384.25: pages of 20, r = round(128 * 20 / 384.25) = 7
        assert (p.page_size, p.r) == (20, 7)
        assert traffic == pytest.approx(math.ceil(C / 20) * 7 / 256 + 128)
    else:
        assert p.kernel_size == 511 and p.keep == round(T / math.sqrt(T / t))
        assert traffic <= t


@pytest.mark.parametrize("method", APPROXIMATE)
def test_reported_traffic_is_what_the_cache_reads(method):
    """``traffic_tokens`` equals the cache's ideal bytes per step in KV pairs per KV group, and
    what its kernels read exceeds that by less than one sector per row they read."""
    args = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=65536)
    for T, t in [(4096, 256), (60000, 256), (3000, 100), (500, 40)]:
        p = derive(method, t, T, args, {})
        kept = min(T, getattr(p, "keep", T))
        m = decode_horizon(kept + 1) - kept  # the static buffers as long as the first step's C
        cache = build_caches(method, args, batch_size=1, prompt_len=T, max_new_tokens=m,
                             budget=t, dtype=torch.bfloat16, device="meta")[0]
        pair = 2 * args.n_kv_heads * args.head_dim * 2  # K+V, every KV head, bf16
        ideal = cache.ideal_bytes_per_step()
        assert ideal == pytest.approx(p.traffic_tokens * pair)
        # the kernels read whole 32-byte sectors of each summary (or K^T) row they touch
        slack = cache.bytes_read_per_step() - ideal
        assert 0 <= slack < 2 * args.head_dim * 32 * args.n_kv_heads
        assert cache.method_params()["traffic_tokens"] == p.traffic_tokens


@settings(max_examples=200, deadline=None)
@given(t=st.integers(2, 4096), T=st.integers(1, 200_000), d=st.sampled_from([8, 64, 128, 256]))
def test_sparq_traffic_within_budget_whenever_one_dim_fits(t, T, d):
    """r = floor(t d / C) clamped to [1, d] (C: the first step's T + 1 tokens rounded up to
    64): within budget whenever t d / C >= 1; otherwise r = 1 and the overshoot is reported;
    dense while the cache fits the budget."""
    C = decode_horizon(T + 1)
    args = ModelArgs(dim=d, n_layers=1, n_heads=1, head_dim=d, intermediate_size=8,
                     vocab_size=10, max_seq_len=8192)
    p = derive("sparq", t, T, args, {})
    if T + 1 <= t:
        assert p.dense and p.traffic_tokens == t
        return
    assert 1 <= p.r <= d and p.r == min(d, max(1, t * d // C))
    assert p.traffic_tokens == C * p.r / (2 * d) + t // 2
    if t * d >= C:
        assert p.traffic_tokens <= t and p.budget_overshoot is None
    else:
        assert p.r == 1
        assert (p.budget_overshoot is not None) == (p.traffic_tokens > t)


def table1_bytes(method, t, S, args):
    """Storage and traffic of one layer at B = 1, bf16, via build_caches."""
    caches = build_caches(method, args, batch_size=1, prompt_len=S, max_new_tokens=0,
                          budget=t, dtype=torch.bfloat16, device="meta")
    return caches[0].allocated_bytes(), caches[0].ideal_bytes_per_step()


@pytest.mark.parametrize("method", ["snapkv_pp", "quest", "sparq", "rocketkv"])
def test_bytes_against_table_1(method):
    """RocketKV Table 1: traffic 1/c for all; storage 1/c (SnapKV), 1 + 1/c (Quest),
    2 (SparQ, which stores K twice: K and its dim-major copy, with V 1.5 of the full cache),
    1/sqrt(c) + 2/c^(3/4) (RocketKV, which
    counts min and max each as 1/page of the whole KV; they hold keys only, so half that)."""
    args = ModelArgs(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=8192)
    S, t = 4088, 256  # first decode steps at 4089 tokens (RocketKV: 1024 kept): C = 4096 (1024)
    c = S / t
    full = 2 * args.n_kv_heads * S * args.head_dim * 2  # K and V, bf16
    storage, traffic = table1_bytes(method, t, S, args)
    assert traffic == pytest.approx(full / c, rel=0.02)
    expected = {"snapkv_pp": 1 / c, "quest": 1 + 1 / (2 * c), "sparq": 1.5,
                "rocketkv": 1 / math.sqrt(c) + 1 / c ** 0.75}[method]
    # + an 8-byte slot offset, and the buffers round S = 4088 up to whole pages
    assert storage / full == pytest.approx(expected, rel=3e-3)
    paper = {"snapkv_pp": 1 / c, "quest": 1 + 1 / c, "sparq": 2,
             "rocketkv": 1 / math.sqrt(c) + 2 / c ** 0.75}[method]
    assert storage / full <= paper * (1 + 1e-4)


@pytest.mark.parametrize("method,budget,T,m,smallest", [
    ("snapkv", 64, 400, 32, 66),  # t // G must exceed the window (stories260K: G = 2)
    ("snapkv", 32, 400, 32, 66),
    ("snapkv_pp", 32, 400, 32, 33),  # t must exceed the window
    ("rocketkv", 16, 400, 32, None),  # below the observation window
    ("quest", 1, 400, 32, 2),  # k = t // 2 rounds to zero; any k >= 1 works (token top-k)
    ("sparq", 1, 4000, 32, 2),  # k rounds to zero; r is clamped to 1 (overshoot reported)
    ("hybrid", 1, 4000, 32, 2),
])
def test_too_small_budgets_name_the_smallest_valid_one(method, budget, T, m, smallest):
    args = ModelArgs.from_name("stories260K") if T < 500 else LLAMA
    expected = smallest if smallest is not None else smallest_budget(method, T, args, {}, T + m)
    with pytest.raises(ConfigError, match=f"smallest valid budget here is {expected}"):
        build_caches(method, args, batch_size=1, prompt_len=T, max_new_tokens=m,
                     budget=budget, dtype=torch.float32, device="meta")
    build_caches(method, args, batch_size=1, prompt_len=T, max_new_tokens=m,
                 budget=expected, dtype=torch.float32, device="meta")


def test_budget_at_least_the_sequence_means_no_compression():
    caches = build_caches("rocketkv", LLAMA, batch_size=1, prompt_len=100, max_new_tokens=10,
                          budget=110, dtype=torch.float32, device="meta")
    assert all(isinstance(c, FullKVCache) for c in caches)
    assert "no compression" in caches[0].method_params()["note"]


def test_skip_layers_and_bad_options():
    caches = build_caches("rocketkv", LLAMA, batch_size=1, prompt_len=4096, max_new_tokens=8,
                          budget=256, dtype=torch.bfloat16, device="meta", skip_layers=2)
    assert [type(c).__name__ for c in caches[:3]] == ["FullKVCache", "FullKVCache",
                                                     "CompressedKVCache"]
    with pytest.raises(ConfigError, match="needs --budget"):
        build_caches("quest", LLAMA, batch_size=1, prompt_len=10, max_new_tokens=1,
                     budget=None, dtype=torch.float32, device="meta")
    with pytest.raises(ConfigError, match="odd"):
        build_caches("snapkv_pp", LLAMA, batch_size=1, prompt_len=4096, max_new_tokens=8,
                     budget=512, dtype=torch.float32, device="meta", kernel_size=64)


# ---- end to end on the real checkpoint -----------------------------------------------------

@pytest.fixture(scope="module")
def story_prompt(stories_dir):
    tok = load_tokenizer(stories_dir)
    text = shared_file(SHARED / "text" / "tinystories_sample_cs336.txt").read_text()
    ids = tok.encode(" ".join(text.split("<|endoftext|>")[:2]).strip())
    assert len(ids) >= 400
    return ids[:400]


@pytest.mark.parametrize("method", COMPRESSED)
def test_budget_covering_the_sequence_equals_full(stories_model, story_prompt, method):
    m = 16
    full = generate(stories_model, story_prompt, max_new_tokens=m)
    r = generate(stories_model, story_prompt, CacheRequest(method, len(story_prompt) + m),
                 max_new_tokens=m)
    assert r["token_ids"] == full["token_ids"]
    assert r["method_params"]["compressed"] is False


@pytest.mark.parametrize("method", COMPRESSED)
def test_real_checkpoint_runs_every_method_at_64_128_256(stories_model, story_prompt, method):
    m = 32
    T = len(story_prompt)
    full = generate(stories_model, story_prompt, max_new_tokens=m)
    for budget in (64, 128, 256):
        t_min = smallest_budget(method, T, stories_model.args, {}, T + m)
        if budget < t_min:
            with pytest.raises(ConfigError, match=f"smallest valid budget here is {t_min}"):
                generate(stories_model, story_prompt, CacheRequest(method, budget),
                         max_new_tokens=m)
            continue
        r = generate(stories_model, story_prompt, CacheRequest(method, budget), max_new_tokens=m)
        assert len(r["token_ids"][0]) == m
        assert r["method_params"]["budget"] == budget and r["method_params"]["compressed"]
        assert 0 < r["kv_bytes_per_step"] < full["kv_bytes_per_step"] or method == "exact_topk"
        if method in ("snapkv_pp", "rocketkv", "snapkv"):
            assert r["kv_cache_bytes"] < full["kv_cache_bytes"]
    # the oracle with k = 256 of 432 tokens keeps the greedy continuation on this prompt
    if method == "exact_topk":
        assert r["token_ids"] == full["token_ids"]


@pytest.mark.parametrize("method", COMPRESSED)
def test_decode_step_compiles_once_per_method(stories_model, story_prompt, method):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    eager = generate(stories_model, story_prompt[:300], CacheRequest(method, 128),
                     max_new_tokens=12)
    r = generate(stories_model, story_prompt[:300], CacheRequest(method, 128), max_new_tokens=12,
                 step=StepConfig(compile=True, backend=counter))
    assert counter.frame_count == 1  # fullgraph: a graph break would raise
    assert r["token_ids"] == eager["token_ids"]


# ---- random shapes and budgets --------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(method=st.sampled_from(COMPRESSED), T=st.integers(40, 120), m=st.integers(1, 12),
       budget=st.integers(1, 140), heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
       seed=st.integers(0, 10))
def test_random_shapes_and_budgets(method, T, m, budget, heads, seed):
    H, Hkv = heads
    args = ModelArgs(dim=16 * H, n_layers=1, n_heads=H, n_kv_heads=Hkv, intermediate_size=8,
                     vocab_size=10, max_seq_len=512)
    try:
        caches = build_caches(method, args, batch_size=2, prompt_len=T, max_new_tokens=m,
                              budget=budget, dtype=torch.float32, device="cpu")
    except ConfigError as e:
        assert "smallest valid budget" in str(e) or "no budget below" in str(e)
        return
    cache = caches[0]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, T + m, 16, generator=g)
    k, v = torch.randn(2, 2, Hkv, T + m, 16, generator=g)
    out = cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    assert out.shape == (2, H, T, 16) and torch.isfinite(out).all()
    if isinstance(cache, CompressedKVCache):
        # kept prompt keys are the original keys at ascending positions (SnapKV++: its prefix
        # lowest vote first, the order its decode steps give them up; then its window)
        kept = cache.k_cache[:, :, :cache.kept]
        pos = [[[int(((k[b, h, :T] - kept[b, h, s]).abs().sum(-1) == 0).nonzero()[0])
                 for s in range(cache.kept)] for h in range(Hkv)] for b in range(2)]
        ordered = [p[-32:] if method == "snapkv_pp" else p for row in pos for p in row]
        assert all(p == sorted(p) for p in ordered)
        assert all(len(set(p)) == len(p) for row in pos for p in row)
        assert all(p[-1] == T - 1 for row in pos for p in row)  # the last prompt token kept
        # the formula: K and V slots, the slot offset, and each method's auxiliary data
        sel, L = cache.selector, cache.length
        expected = 2 * 2 * Hkv * L * 16 * 4 + 8
        if getattr(sel, "page_size", 1) > 1:
            expected += 2 * 2 * Hkv * (L // sel.page_size) * 16 * 4  # page min and max keys
        if getattr(sel, "dim_major", False):
            expected += 2 * Hkv * 16 * L * 4  # SparQ's dim-major copy of K
        if cache.head_mask is not None:
            expected += 2 * Hkv * (H // Hkv) * L  # per-query-head bool mask (original SnapKV)
        if hasattr(sel, "ranks"):
            expected += sel.ranks.numel() * 4  # original SnapKV's per-query-head ranks (int32)
        assert cache.allocated_bytes() == expected
        assert L == cache.capacity + (-cache.capacity) % getattr(sel, "page_size", 1)
    for t in range(T, T + m - 1):
        y = cache.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t]))
        assert y.shape == (2, H, 1, 16) and torch.isfinite(y).all()
        if isinstance(cache, CompressedKVCache):
            slot = t - int(cache.slot_offset)
            assert cache.kept <= slot < cache.capacity
            assert torch.equal(cache.k_cache[:, :, slot], k[:, :, t])


@pytest.mark.parametrize("method", COMPRESSED)
def test_prompt_shorter_than_the_budget_has_nothing_to_evict(stories_model, method):
    prompt = [1, 403, 407, 261, 378, 13, 300, 301, 302, 303] * 4  # 40 tokens
    m = 40
    try:
        r = generate(stories_model, prompt, CacheRequest(method, 60), max_new_tokens=m)
    except ConfigError as e:  # a method whose minimum exceeds 60 says so
        assert "smallest valid budget" in str(e)
        return
    p = r["method_params"]
    assert p["compressed"] and p["prompt_tokens_kept"] == len(prompt)
    assert len(r["token_ids"][0]) == m
    # a second call on the same shapes reuses and resets the caches
    assert generate(stories_model, prompt, CacheRequest(method, 60),
                    max_new_tokens=m)["token_ids"] == r["token_ids"]


# --------------------------------------------------------------------------------------------
# A real 8K-context instruct model (SmolLM2-135M-Instruct, GQA 9:3, head_dim 64)


@pytest.fixture(scope="module")
def essay_question():
    """A 1.2K-token chat prompt: essay text, then a question about it."""
    from conftest import ESSAYS, SMOLLM2_GGUF

    tok = load_tokenizer(shared_file(SMOLLM2_GGUF))
    essays = sorted(shared_file(ESSAYS).glob("*.txt"))
    words = " ".join(p.read_text() for p in essays[:3]).split()
    doc = " ".join(words[:900])
    ids = tok.encode_chat(f"{doc}\n\nWhat is the main point of the text above?")
    assert 1100 <= len(ids) <= 1600, len(ids)
    return ids, tok


@pytest.fixture(scope="module")
def full_first_token(smollm2_model, essay_question):
    return generate(smollm2_model, essay_question[0], max_new_tokens=1)["token_ids"][0][0]


# the eviction baselines run on SmolLM2 at 128-1024 in test_eviction.py (one shared prefill)
@pytest.mark.parametrize("method", [n for n, m in METHODS.items() if not m.budgeted] +
                         SELECTING)
def test_every_method_on_smollm2_with_a_long_prompt(smollm2_model, essay_question,
                                                        full_first_token, method):
    ids, tok = essay_question
    budget = None if method in ("full", "gptfast_dense") else 256
    r = generate(smollm2_model, ids, CacheRequest(method, budget), max_new_tokens=8,
                 stop_ids=tok.chat_stop_ids)
    out = r["token_ids"][0]
    assert 1 <= len(out) <= 8 and all(0 <= t < smollm2_model.args.vocab_size for t in out)
    # prefill attends to the whole prompt for every method: the same first token as full
    assert out[0] == full_first_token
    a = smollm2_model.args
    per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4  # K+V bytes, float32
    if budget is not None and method != "exact_topk":  # exact_topk's scoring reads every key
        # the budget bounds what a step reads, approximation traffic included (Sec. 3.5)
        params = r["method_params"]
        if method in APPROXIMATE:
            # what the parameters report is what the caches read
            assert r["kv_ideal_bytes_per_step"] == pytest.approx(
                params["traffic_tokens"] * per_token)
        if method in ("quest", "sparq"):  # C = 1.3K, t d / C = 12 >= 1: within budget
            assert "budget_overshoot" not in params
            assert r["kv_ideal_bytes_per_step"] <= budget * per_token
        elif "budget_overshoot" in params:  # hybrid's r = round(d page / c) (released code)
            assert r["kv_ideal_bytes_per_step"] == pytest.approx(
                params["budget_overshoot"] * budget * per_token)
            assert r["kv_ideal_bytes_per_step"] <= 1.03 * budget * per_token
        else:
            assert r["kv_ideal_bytes_per_step"] <= budget * per_token
        assert r["kv_bytes_per_step"] < r["full_kv_bytes"] / 4
    # storage against the paper's Table 1 at c = S / t
    c = (len(ids) + 8) / 256
    if method in ("snapkv", "snapkv_pp"):  # min(T, t) prompt slots + the m new tokens' slots
        assert r["prompt_tokens_kept"]["max"] <= 256
        assert r["kv_cache_bytes"] <= 1.01 * r["full_kv_bytes"] * (256 + 8) / (len(ids) + 8)
    if method == "rocketkv":
        assert r["prompt_tokens_kept"]["max"] <= (len(ids) + 8) / c ** 0.5  # S / sqrt(c)
        assert r["kv_cache_bytes"] <= 1.01 * r["full_kv_bytes"] * (
            1 / c ** 0.5 + 2 / c ** 0.75)



def test_degenerate_budgets_are_said_by_the_method():
    """SnapKV below 2 G windows keeps fewer prompt tokens per query head than its window, and
    DuoAttention at 640 or less (or with no head's share) retrieves with no head: each says
    why in ``degenerate`` (reported, and marked in the accuracy tables); above, None."""
    qwen = ModelArgs.from_name("qwen2.5-0.5b")  # G = 7, 24 layers x 2 KV heads
    assert "keeps 4 prompt tokens beside its 32-token window" in \
        derive("snapkv", 256, 4088, qwen, {}).degenerate
    assert derive("snapkv", 448, 4088, qwen, {}).degenerate is None
    assert "every head streams" in derive("duoattention", 640, 4088, qwen, {}).degenerate
    assert derive("duoattention", 1024, 4088, qwen, {}).degenerate is None
    assert derive("snapkv", 256, 30, qwen, {}).degenerate is None  # the prompt fits t // G
    assert "degenerate" in derive("snapkv", 256, 4088, qwen, {}).to_dict()
