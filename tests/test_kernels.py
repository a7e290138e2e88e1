"""The fused Triton kernels (kernels/sparse.py) against the PyTorch code they replace
(compression/: the selectors' writes, selections and attention).

On CPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py before the
kernels are imported) at small shapes; the ``cuda`` tests run the same checks at real shapes on
the GPU machine (``pytest -m cuda``). Unwritten slots and pages of the kernels' cache are
poisoned with NaN: a kernel that reads one fails. Selections must equal the reference's as
sets, ties aside: in float32 exactly; in bfloat16 a token may differ only where the
reference's own scores of the two tokens are within bfloat16 rounding.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from tolerance import assert_near

from rocketkv import kernels
from rocketkv.cache import CompressedKVCache, FullKVCache, Selector
from rocketkv.compression import METHODS, derive
from rocketkv.compression.exact_topk import ExactTopKSelector, exact_scores
from rocketkv.compression.hybrid import HybridSelector, hybrid_page_scores
from rocketkv.compression.quest import QuestSelector, page_bounds
from rocketkv.compression.selection import PagedSelector, group_sum, top_r_dims
from rocketkv.compression.sparq import SparQSelector, sparq_scores
from rocketkv.model import ModelArgs

ROOT = Path(__file__).resolve().parents[1]
OPS = kernels.ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"triton: {kernels.missing()}")
CUDA = torch.cuda.is_available()
# the CPU tests run the kernels in Triton's interpreter (conftest.py sets it without a GPU);
# on the GPU machine, where the kernels are compiled, the cuda tests run instead
interpreted = pytest.mark.skipif(CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter; the GPU "
                                        "machine runs the cuda tests")

SELECTORS = {  # name -> (selector for k tokens)
    "hybrid": lambda k: HybridSelector(4, 5, k),
    "hybrid_page3": lambda k: HybridSelector(3, 9, k),
    "hybrid_page1": lambda k: HybridSelector(1, 5, k),
    "quest": lambda k: QuestSelector(4, k),
    "quest_page1": lambda k: QuestSelector(1, k),
    "quest_page100": lambda k: QuestSelector(100, k),  # a page over one loop's 64 slots
    "sparq": lambda k: SparQSelector(5, k),
    "sparq_strided": lambda k: SparQSelector(5, k, dim_major=False),
    "sparq_realloc": lambda k: SparQSelector(5, k, reallocate=True),
    "sparq_realloc_strided": lambda k: SparQSelector(3, k, reallocate=True,
                                                     dim_major=False),
    "exact_topk": lambda k: ExactTopKSelector(k),
}


@pytest.fixture(autouse=True)
def _kernels_forced():
    previous = kernels.set_mode("force")
    yield
    kernels.set_mode(previous)


def model_args(heads, kv_heads, head_dim):
    return ModelArgs(dim=heads * head_dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                     intermediate_size=8, vocab_size=10, max_seq_len=1 << 18)


def aux_of(selector):
    """The selector's auxiliary buffer (page summary or dim-major keys), or None."""
    return getattr(selector, "summary", None) if isinstance(selector, PagedSelector) else \
        getattr(selector, "k_dims", None)


def twin_caches(name, k, args, T, steps, dtype, device, seed=0, B=1):
    """Two caches of one method holding the same prefilled prompt: the reference (PyTorch
    path) and the kernels' (every unwritten slot and page poisoned with NaN); the decode
    inputs of ``steps`` more tokens."""
    g = torch.Generator().manual_seed(seed)
    n = T + steps
    q, kk, v = (torch.randn(B, h, n, args.head_dim, generator=g).to(device, dtype)
                for h in (args.n_heads, args.n_kv_heads, args.n_kv_heads))
    caches = []
    for _ in range(2):
        cache = CompressedKVCache(0, args, B, dtype, device, prompt_len=T, prompt_capacity=T,
                                  max_new_tokens=steps, selector=SELECTORS[name](k))
        with torch.no_grad():
            cache.prefill(q[:, :, :T], kk[:, :, :T], v[:, :, :T])
        caches.append(cache)
    ref, ker = caches
    poison_unwritten(ker, T)
    return ref, ker, (q, kk, v)


def poison_unwritten(cache, T):
    """NaN in every slot past the ``T`` written ones and in every page (summary column) no
    token reached yet: a kernel that reads one shows it in its output."""
    cache.k_cache[:, :, T:] = float("nan")
    cache.v_cache[:, :, T:] = float("nan")
    aux = aux_of(cache.selector)
    if aux is not None:
        ps = cache.selector.page_size if isinstance(cache.selector, PagedSelector) else 1
        aux[..., -(-T // ps):] = float("nan")


def decode(cache, mode, q, k, v, t):
    previous = kernels.set_mode(mode)
    try:
        with torch.no_grad():
            return cache.decode(q, k, v, torch.tensor([t], device=q.device))
    finally:
        kernels.set_mode(previous)


def reference_scores(cache, q, valid, dtype=None):
    """The reference's token scores (B, H_kv, S) float32 of the cache's selector: page-constant
    for paged selectors, -inf at unwritten slots; with ``dtype`` computed from the query and
    keys cast to it (float32: what the kernels compute from 16-bit data)."""
    sel = cache.selector
    f = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    q = f(q)
    if isinstance(sel, ExactTopKSelector):
        return exact_scores(q, f(cache.k_cache), valid).float()
    if isinstance(sel, SparQSelector):
        keys = f(sel.k_dims if sel.dim_major else cache.k_cache)
        s = sparq_scores(q, keys, top_r_dims(q, cache.n_kv_heads, sel.r), valid, sel.dim_major)
        return s.sum(dim=2).masked_fill(~valid, float("-inf")).float()
    counts = sel.page_counts(valid)
    if isinstance(sel, QuestSelector):
        pages = page_bounds(q, f(sel.rows(cache)))
        newest = torch.arange(pages.shape[-1], device=q.device) == (counts > 0).sum() - 1
        pages = pages.masked_fill(newest, float("inf"))
    else:
        pages = hybrid_page_scores(q, f(sel.rows(cache)),
                                   top_r_dims(q, cache.n_kv_heads, sel.r), counts)
    s = pages.repeat_interleave(sel.page_size, dim=-1)
    return s.masked_fill(~valid, float("-inf")).float()


def chosen_slots(pages, take, page_size, S):
    """(B, H_kv, S) bool of the slots ``paged_select`` chose."""
    B, Hkv, M = pages.shape
    out = torch.zeros(B, Hkv, S, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            for p, n in zip(pages[b, h].tolist(), take[b, h].tolist()):
                out[b, h, p * page_size:p * page_size + n] = True
    return out


def check_selection(ref_cache, ker_cache, q, t, k, exact):
    """paged_select on the kernels' cache chooses the reference's top-k token set: the top-k
    of the reference's scores computed in float32 from the cache's data (the kernels score
    16-bit data in float32), ties aside (``exact``: float32 data), or near-ties within 1e-4
    of the largest score aside (16-bit data: the reference's float32 order of operations is
    not the kernels'). Returns the chosen slots (B, H_kv, S) bool (CPU) and whether each KV
    head chose the slots the reference's own path chose from its scores in the cache's dtype
    (B, H_kv) bool."""
    sel = ker_cache.selector
    S = ker_cache.length
    valid = torch.arange(S, device=q.device) <= t
    scores = reference_scores(ref_cache, q, valid, torch.float32).cpu()
    native = scores if q.dtype == torch.float32 else reference_scores(ref_cache, q, valid).cpu()
    keys = ker_cache.k_cache  # read as K^T by the kernel (by_token)
    if isinstance(sel, QuestSelector):
        mode, two, r = OPS.MODE_BOUND, sel.page_size > 1, q.shape[-1]
        rows = sel.kernel_rows(ker_cache)
    elif isinstance(sel, SparQSelector):
        mode, two, r, rows = OPS.MODE_SOFTMAX, False, sel.r, sel.k_dims if sel.dim_major else None
    elif isinstance(sel, ExactTopKSelector):
        mode, two, r, rows = OPS.MODE_SOFTMAX, False, q.shape[-1], None
    else:
        mode, two, r, rows = OPS.MODE_SOFTMAX, sel.page_size > 1, sel.r, sel.kernel_rows(ker_cache)
    ps = sel.page_size
    # odd steps give the slot as a compressed cache does: a position less the slot offset
    last, offset = (torch.tensor([t + 9], device=q.device), torch.tensor([9], device=q.device)) \
        if t % 2 else (torch.tensor([t], device=q.device), None)
    splits = max(1, OPS.selection_splits(S // ps, min(k, S), ps))  # as the selectors run
    pages, take = torch.ops.rocketkv.paged_select(q, keys if rows is None else rows, last, mode,
                                                  two, r, min(k, S), ps, rows is None, offset,
                                                  splits)
    assert pages.shape[-1] == OPS.selected_pages(min(k, S), ps, S // ps, splits)
    got = chosen_slots(pages.cpu(), take.cpu(), ps, S)
    n = min(k, t + 1)  # slots 0..t are written
    assert (got.sum(-1) == n).all()
    assert not (got & ~valid.cpu()).any()
    same = torch.zeros(got.shape[:2], dtype=torch.bool)
    for b in range(got.shape[0]):
        for h in range(got.shape[1]):
            s = scores[b, h]
            ref = set(s.topk(n).indices.tolist())
            mine = set(got[b, h].nonzero().flatten().tolist())
            kth = s[list(ref)].min()
            if exact:
                if mine != ref:  # ties aside: equal scores may go either way
                    assert (s[list(mine ^ ref)] == kth).all(), (b, h, mine ^ ref)
            else:
                finite = s[s.isfinite()]
                tol = 1e-4 * float(finite.abs().max()) + 1e-9
                assert all(float(s[j]) >= float(kth) - tol for j in mine - ref), (b, h)
            # the slots the reference's path chose: as many from each page (both take a page's
            # first slots), unless a page it left holds its k-th score too (its own choice
            # among such ties is not topk's)
            sn = native[b, h]
            own = set(sn.topk(n).indices.tolist())
            kth_own = sn[list(own)].min()
            tied = {j // ps for j in (sn == kth_own).nonzero().flatten().tolist()}
            same[b, h] = (Counter(j // ps for j in mine) == Counter(j // ps for j in own)
                          and tied <= {j // ps for j in own})
    return got, same


def attention_over(cache, q, chosen):
    """Exact attention of ``q`` (B, H, 1, D) over the ``chosen`` slots (B, H_kv, S) bool of
    ``cache``'s K/V, in float64 from the (rounded) data: (B, H, 1, D) float64."""
    B, H, _, D = q.shape
    Hkv = chosen.shape[1]
    mask = chosen.to(q.device)[:, :, None, :]  # (B, H_kv, 1, S)
    k = cache.k_cache.double().masked_fill(~mask.transpose(-1, -2), 0)  # unwritten slots: NaN
    v = cache.v_cache.double().masked_fill(~mask.transpose(-1, -2), 0)
    logits = q.double().view(B, Hkv, H // Hkv, D) @ k.transpose(-1, -2) / D ** 0.5
    p = logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (p @ v).view(B, H, 1, D)


CASES = [  # (selector, k, heads, kv heads, head dim, prompt, steps)
    ("hybrid", 6, 8, 2, 32, 41, 7),
    ("hybrid", 1, 8, 2, 32, 29, 3),  # k = 1
    ("hybrid", 8, 2, 2, 16, 30, 4),  # MHA, k two whole pages
    ("hybrid", 500, 8, 2, 32, 37, 3),  # k above the written tokens: every one of them
    ("hybrid_page3", 13, 8, 2, 32, 50, 5),
    ("hybrid_page1", 9, 8, 2, 32, 40, 4),
    ("quest", 3, 8, 2, 32, 33, 6),  # k below one page
    ("quest", 12, 8, 2, 32, 45, 4),
    ("quest_page1", 7, 8, 2, 32, 30, 3),
    ("quest_page100", 150, 8, 2, 32, 230, 3),
    ("sparq", 10, 8, 2, 32, 45, 4),
    ("sparq_strided", 10, 8, 2, 32, 45, 3),
    ("exact_topk", 12, 8, 2, 32, 40, 4),
    ("exact_topk", 12, 4, 4, 32, 40, 3),  # MHA
    ("sparq_realloc", 10, 8, 2, 32, 45, 4),  # mean-value reallocation
    ("sparq_realloc_strided", 50, 4, 4, 32, 45, 3),  # MHA, k above the written tokens
]


def _case_id(c):
    return f"{c[0]}-k{c[1]}-h{c[2]}x{c[3]}"


@interpreted
@pytest.mark.parametrize("case,path", [(c, "registers") for c in CASES] +
                         [(CASES[i], "passes") for i in (0, 4, 8, 11)] +
                         [(CASES[i], "split") for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14,
                                                          15)],
                         ids=lambda v: _case_id(v) if isinstance(v, tuple) else v)
def test_decode_steps_equal_the_pytorch_path(case, path, monkeypatch):
    """Each decode step through the kernels (token write, selection, attention) on a cache
    poisoned past its written slots gives the reference's output, and leaves the same K/V and
    auxiliary keys (page min/max, dim-major copy) on the written slots and pages. With
    ``passes`` the choice of k runs as over more pages than registers hold: passes of
    ``SELECT_BLOCK`` scores, here 16, so that a pass has several blocks and a partial last
    one (the selectors' own rule would leave those pages to PyTorch: overridden). With
    ``split`` the selection is split over programs of about 4 pages or 8 tokens each
    (``SPLIT_PAGES``, with at most 64 candidates), partial last splits and k above a split's
    tokens included."""
    if path == "passes":
        monkeypatch.setattr(OPS, "SELECT_REGISTER_PAGES", 0)
        monkeypatch.setattr(OPS, "SELECT_BLOCK", 16)
        monkeypatch.setattr(kernels, "selection_fits", lambda *a: True)
        assert OPS.register_pages(10) == 0
    if "realloc" in case[0]:  # k past SPLIT_TOKENS: the reallocating kernel still attends in
        monkeypatch.setattr(OPS, "SPLIT_TOKENS", 8)  # one program per KV head
    split_calls = []
    if path == "split":
        monkeypatch.setattr(OPS, "SPLIT_PAGES", 4 if getattr(SELECTORS[case[0]](1), "page_size",
                                                             1) > 1 else 8)
        monkeypatch.setattr(OPS, "SELECT_CANDIDATES", 64)
        spy = OPS._split_selection

        def counting(*a, **kw):
            split_calls.append(1)
            return spy(*a, **kw)

        monkeypatch.setattr(OPS, "_split_selection", counting)
    name, k, H, Hkv, D, T, steps = case
    ref, ker, (q, kk, v) = twin_caches(name, k, model_args(H, Hkv, D), T, steps,
                                       torch.float32, "cpu")
    for t in range(T, T + steps):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        want = decode(ref, "off", *ins, t)
        got = decode(ker, "force", *ins, t)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (t, (got - want).abs().max())
        assert torch.equal(ker.k_cache[:, :, :t + 1], ref.k_cache[:, :, :t + 1])
        assert torch.equal(ker.v_cache[:, :, :t + 1], ref.v_cache[:, :, :t + 1])
        aux = aux_of(ref.selector)
        if aux is not None:
            ps = ref.selector.page_size if isinstance(ref.selector, PagedSelector) else 1
            n = t // ps + 1
            assert torch.equal(aux_of(ker.selector)[..., :n], aux[..., :n]), t
        if getattr(ref.selector, "reallocate", False):  # the running mean of values
            assert torch.allclose(ker.selector.v_mean, ref.selector.v_mean, atol=1e-6), t
        check_selection(ref, ker, q[:, :, t:t + 1], t, k, exact=True)
    if path == "split":  # every step's selection ran split (and check_selection's)
        assert len(split_calls) == 2 * steps, split_calls


@interpreted
@pytest.mark.parametrize("name", ["hybrid", "quest", "sparq", "exact_topk"])
def test_more_pages_than_registers_hold_leave_the_selection_to_pytorch(name, monkeypatch):
    """Where no program's choice fits in registers (past ``SELECT_REGISTER_PAGES`` pages,
    or tokens for pages of one slot, and no split that fits) the selectors attend through
    the PyTorch path, with the fused write where they have one; below, the fused selection
    (``kernels.selection_fits``)."""
    calls = []
    spy = kernels.sparse_attention

    def counting(*a, **kw):
        calls.append(1)
        return spy(*a, **kw)

    monkeypatch.setattr(kernels, "sparse_attention", counting)
    for limit, fused in ((8, False), (4096, True)):
        monkeypatch.setattr(OPS, "SELECT_REGISTER_PAGES", limit)
        calls.clear()
        ref, ker, (q, kk, v) = twin_caches(name, 6, model_args(8, 2, 32), 41, 2, torch.float32,
                                           "cpu")
        for name_, buf in ker.named_buffers():  # no NaN poison: the PyTorch path reads all
            buf.copy_(dict(ref.named_buffers())[name_])
        for t in range(41, 43):
            ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
            want = decode(ref, "off", *ins, t)
            got = decode(ker, "force", *ins, t)
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (limit, t)
        assert len(calls) == (2 if fused else 0), limit


@interpreted
@pytest.mark.parametrize("name,k,split", [("hybrid", 10, False), ("quest", 6, False),
                                          ("sparq", 9, False), ("exact_topk", 9, False),
                                          ("hybrid_page3", 20, False), ("sparq", 9, True),
                                          ("exact_topk", 9, True), ("hybrid_page3", 20, True),
                                          ("sparq_realloc", 9, False),
                                          ("sparq_realloc", 9, True)])
def test_bfloat16_selection_and_output(name, k, split, monkeypatch):
    """bfloat16 caches: the chosen tokens differ from the reference's only among near-ties,
    and the attention output is within bfloat16 tolerance of the reference's; in one program
    per KV head, or with ``split`` over programs of 16 pages."""
    if split:
        monkeypatch.setattr(OPS, "SPLIT_PAGES", 16)
    T, steps = 48, 3
    ref, ker, (q, kk, v) = twin_caches(name, k, model_args(8, 2, 32), T, steps,
                                       torch.bfloat16, "cpu", seed=3, B=2)
    for t in range(T, T + steps):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        want = decode(ref, "off", *ins, t).float()
        got = decode(ker, "force", *ins, t).float()
        chosen, _ = check_selection(ref, ker, q[:, :, t:t + 1], t, k, exact=False)
        assert (got - want).abs().max() < 0.1, t
        if "realloc" not in name:  # exact attention over the slots chosen (no mean-V term)
            assert (got - attention_over(ker, ins[0], chosen)).abs().max() < 0.05, t


@interpreted
@pytest.mark.parametrize("name,k", [("hybrid", 6), ("hybrid_page1", 9), ("sparq", 10),
                                    ("sparq_strided", 10)])
def test_equal_query_sums_choose_the_same_dims_on_both_paths(name, k):
    """Queries of small integers, whose group sums of |q| tie in most head dims (as 16-bit
    queries often do): the kernels and the PyTorch path rank the tied dims alike (the lower dim
    first, ``top_r_dims``), so they score the same dims and give the same output."""
    ref, ker, (q, kk, v) = twin_caches(name, k, model_args(8, 2, 32), 40, 3, torch.float32,
                                       "cpu", seed=5)
    q = (q * 1.5).round()
    sums = group_sum(q.abs(), 2)[:, :, 40:]  # (B, H_kv, steps, D)
    assert all(len(set(s.tolist())) < 20 for s in sums.reshape(-1, 32))  # ties in every head
    for t in range(40, 43):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        want = decode(ref, "off", *ins, t)
        got = decode(ker, "force", *ins, t)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (t, (got - want).abs().max())


@interpreted
@pytest.mark.parametrize("name,k,split", [("hybrid", 9, False), ("quest_page100", 150, False),
                                          ("sparq", 7, False), ("exact_topk", 40, False),
                                          ("hybrid", 9, True), ("quest_page1", 7, True),
                                          ("exact_topk", 40, True)])
def test_select_attend_is_paged_select_then_attend_pages(name, k, split, monkeypatch):
    """The one-kernel selection and attention (``select_attend``, what runs for k <= 512)
    gives the two kernels' output, the page list passing between its two phases in one
    program (NaN-poisoned unwritten slots, GQA, two steps); with ``split`` the split
    selection's last kernel attends, against its page list attended by ``attend_pages``."""
    if split:
        monkeypatch.setattr(OPS, "SPLIT_PAGES", 16)
    ref, ker, (q, kk, v) = twin_caches(name, k, model_args(8, 2, 32), 70, 2, torch.float32,
                                       "cpu", B=2)
    ref.k_cache.copy_(ker.k_cache)  # both poisoned alike: the kernels read the same data
    ref.v_cache.copy_(ker.v_cache)
    aux_ref, aux_ker = aux_of(ref.selector), aux_of(ker.selector)
    if aux_ker is not None:
        aux_ref.copy_(aux_ker)
    assert OPS.attention_splits(k) == 1  # the selection select_attend takes
    for t in range(70, 72):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        with monkeypatch.context() as m:  # the reference: the two-kernel path
            m.setattr(kernels, "sparse_attention",  # (no reallocation in these cases)
                      lambda *a, v_mean=None, **kw: kernels.select_then_attend(*a, **kw))
            two = decode(ref, "force", *ins, t)
        one = decode(ker, "force", *ins, t)
        assert torch.isfinite(one).all() and torch.allclose(one, two, atol=1e-6, rtol=1e-5), t


@interpreted
def test_split_attention_merges_like_one_program(monkeypatch):
    """A selection attended by several programs per KV head (log-sum-exp merge) equals one
    program's result and the reference."""
    monkeypatch.setattr(OPS, "SPLIT_TOKENS", 8)
    assert OPS.attention_splits(40) > 1
    ref, ker, (q, kk, v) = twin_caches("hybrid", 40, model_args(8, 2, 32), 90, 2,
                                       torch.float32, "cpu")
    for t in range(90, 92):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        want = decode(ref, "off", *ins, t)
        got = decode(ker, "force", *ins, t)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)


def test_selection_splits_follow_the_rule():
    """One program up to ``SPLIT_PAGES`` pages; above, about ``SPLIT_PAGES`` pages a split,
    fewer splits where the candidates would pass ``SELECT_CANDIDATES``; none where no split
    fits in registers. The paper's configurations at llama-3.1-8b's shape (budget 256): the
    page counts of RocketKV (1171 at 128K) stay in one program; hybrid (2736 at 32K, 5699 at
    128K) and the one-token pages of SparQ (k 128) and Exact-TopK (k 256) split."""
    assert OPS.selection_splits(1171, 128, 44) == 1
    assert OPS.selection_splits(2736, 128, 12) == 2
    assert OPS.selection_splits(5699, 128, 23) == 4
    assert OPS.selection_splits(32768, 128, 1) == 16
    assert OPS.selection_splits(131072, 128, 1) == 64
    assert OPS.selection_splits(131072, 256, 1) == 32  # 64 splits: 64 x 256 candidates
    assert OPS.selection_splits(16384, 4096, 1) == 2
    assert OPS.selection_splits(32768, 4096, 1) == 0  # 4 x 4096 candidates; 2: 16K a split
    assert OPS.selected_pages(128, 1, 2048) == 128
    assert OPS.selected_pages(128, 23, 5699, 4) == 6 + 4


@interpreted
@pytest.mark.parametrize("heads,kv_heads,split", [(8, 2, 16), (4, 4, 16), (8, 2, 4096)],
                         ids=["gqa-split", "mha-split", "one-program"])
def test_prefix_attention_equals_the_masked_formula(heads, kv_heads, split, monkeypatch):
    """attend_prefix (Full-KV decode): each step over slots 0..t of a static buffer whose
    unwritten slots are NaN, split over the sequence or in one program per KV head, equals
    the masked formula of the PyTorch path."""
    monkeypatch.setattr(OPS, "PREFIX_SPLIT", split)
    args = model_args(heads, kv_heads, 32)
    T, steps, S = 70, 4, 100
    g = torch.Generator().manual_seed(5)
    q, kk, v = (torch.randn(2, h, T + steps, 32, generator=g) for h in (heads, kv_heads,
                                                                         kv_heads))
    ref, ker = (FullKVCache(0, args, 2, torch.float32, "cpu", S) for _ in range(2))
    with torch.no_grad():
        for c in (ref, ker):
            c.prefill(q[:, :, :T], kk[:, :, :T], v[:, :, :T])
    ker.k_cache[:, :, T:] = float("nan")
    ker.v_cache[:, :, T:] = float("nan")
    if split == 16:
        assert OPS.prefix_splits(2 * kv_heads, S) > 1
    for t in range(T, T + steps):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        want = decode(ref, "off", *ins, t)
        got = decode(ker, "force", *ins, t)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), t


@interpreted
def test_dense_selector_uses_the_prefix_kernel(monkeypatch):
    """A compressed cache that attends to everything it keeps (SnapKV's decode) goes
    through attend_prefix with the slot it wrote, and matches the PyTorch path."""
    args = model_args(8, 2, 32)
    T, steps = 40, 3
    g = torch.Generator().manual_seed(9)
    q, kk, v = (torch.randn(1, h, T + steps, 32, generator=g) for h in (8, 2, 2))
    caches = [CompressedKVCache(0, args, 1, torch.float32, "cpu", prompt_len=T,
                                prompt_capacity=T, max_new_tokens=steps, selector=Selector())
              for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            c.prefill(q[:, :, :T], kk[:, :, :T], v[:, :, :T])
    caches[1].v_cache[:, :, T:] = float("nan")
    calls = []
    spy = kernels.prefix_attention

    def counting(q, k, v, last, offset):  # the slot: position less the slot offset
        calls.append(last - offset)
        return spy(q, k, v, last, offset)

    monkeypatch.setattr(kernels, "prefix_attention", counting)
    for t in range(T, T + steps):
        ins = q[:, :, t:t + 1], kk[:, :, t:t + 1], v[:, :, t:t + 1]
        want = decode(caches[0], "off", *ins, t)
        got = decode(caches[1], "force", *ins, t)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)
    assert [int(c) for c in calls] == list(range(T, T + steps))


@interpreted
def test_write_token_restarts_a_page_and_writes_a_column():
    """write_token: on a page's first slot the summary column is the token itself (the stale
    NaN there is ignored), later slots take max / min; the dim-major copy gets one column."""
    B, Hkv, S, D, ps = 1, 2, 12, 16, 4
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(B, Hkv, S, D), torch.zeros(B, Hkv, S, D)
    summary = torch.full((B, Hkv, 2 * D, S // ps), float("nan"))
    toks = [torch.randn(B, Hkv, 1, D, generator=g) for _ in range(3)]
    for slot, tok in zip((4, 5, 6), toks):
        torch.ops.rocketkv.write_token(kc, vc, summary, tok, -tok, torch.tensor([slot]),
                                       kernels.AUX_SUMMARY, ps)
    stack = torch.cat(toks, dim=2)
    assert torch.equal(summary[..., :D, 1], stack.amax(2))
    assert torch.equal(summary[..., D:, 1], stack.amin(2))
    assert summary[..., 0].isnan().all() and summary[..., 2].isnan().all()
    assert torch.equal(vc[:, :, 4:7], -stack)
    dims = torch.zeros(B, Hkv, D, S)
    torch.ops.rocketkv.write_token(kc, vc, dims, toks[0], toks[0], torch.tensor([9]),
                                   kernels.AUX_DIM_MAJOR, 1)
    assert torch.equal(dims[..., 9], toks[0][:, :, 0])
    assert dims[..., :9].eq(0).all() and dims[..., 10:].eq(0).all()


def compiled_triton(script: Path, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a process where Triton compiles rather than interprets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("checkpoint,dtype,n,biased,runs,floats",
                         [("llama-3.1-8b", "bfloat16", 49, 0, "rocketkv", "fp32"),
                          ("qwen2.5-0.5b", "float32", 49, 8, "none", "fp64")])
def test_every_kernel_compiles_for_hopper(checkpoint, dtype, n, biased, runs, floats, tmp_path):
    """The GPU path (bf16 dots on the tensor cores, float32 "ieee" dots: neither runs in the
    interpreter) compiles for sm_90 at every launch configuration of the table, through
    triton's own ptxas, without a GPU, at llama-3.1-8b's shape in bfloat16 and at
    Qwen2.5-0.5B's in float32 (head dim 64, query groups of 7, q/k/v biases: ``biased``
    q/k/v launches); register spills stay small (tools/compile_kernels.py). At llama's
    shape the launches of RocketKV @256's decode steps at 32K and 128K compile as they run,
    captured from the engine's own code: page lists of 1024 and 2048 registers (740 and 1171
    pages), integers equal to 1 made constants and multiples of 16 marked divisible (the
    other runs, ``--runs all``, are a command in docs/design.md: about a minute more). The
    float32 case passes the float scalars (the attention scale, RMSNorm's epsilon) as fp64,
    as torch.compile's Inductor launches a user kernel: a float32 "ieee" dot of an fp64
    product failed to compile on the H200 (results/NVIDIA-H200/gpu-20261127)."""
    out = tmp_path / "regs.json"
    r = compiled_triton(ROOT / "tools" / "compile_kernels.py", "--json", str(out),
                        "--config", checkpoint, "--dtype", dtype, "--runs", runs,
                        "--float-args", floats)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    table = [row for row in rows if "runs" not in row]
    assert len(table) == n and all(row["registers"] for row in rows)
    assert max(row["spill_bytes"] for row in rows) <= 512, rows
    head_dim = ModelArgs.from_name(checkpoint).head_dim
    assert {f"'D_BLOCK': {head_dim}" in row["kernel"] for row in table if
            "_linear_kernel" not in row["kernel"]} == {True}
    assert sum("'BIAS': True" in row["kernel"] for row in table) == biased
    captured = [row for row in rows if "runs" in row]
    if runs == "none":
        assert not captured
        return
    select = {row["kernel"].split("'PR': ")[1].split(",")[0]: row for row in captured
              if row["kernel"].startswith("_select_attend_kernel")}
    assert set(select) == {"1024", "2048"}, [row["kernel"] for row in captured]
    assert "rocketkv@256 32768" in select["1024"]["runs"]
    assert "rocketkv@256 131008" in select["2048"]["runs"]
    for row in select.values():  # as the launcher specialises them
        assert "s_rp" in row["equal_to_1"] and "s_cs" in row["divisible_by_16"], row
    assert any(row["kernel"].startswith("_linear_kernel") and "'EPI': 3" in row["kernel"]
               for row in captured)  # the dense path's q/k/v with the token's write


def test_the_kernels_compile_with_a_float_baked_in(tmp_path):
    """torch.compile's Inductor passed RMSNorm's epsilon to the q/k/v kernel as a Python
    float in the code (a constexpr), where ``eps.to(...)`` failed to compile on the H200: the
    full cache's decode-step launches (q/k/v, projections, prefix attention) compile with
    every float scalar made a constexpr (the fp64 case is the table's float32 case above)."""
    out = tmp_path / "regs.json"
    r = compiled_triton(ROOT / "tools" / "compile_kernels.py", "--json", str(out),
                        "--config", "qwen2.5-0.5b", "--dtype", "float32", "--runs", "full",
                        "--no-table", "--float-args", "constexpr")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert {row["kernel"].split()[0] for row in rows} == {
        "_linear_kernel", "_attend_prefix_kernel", "_merge_splits_kernel"}
    assert all("'eps': 0.125" in row["kernel"] for row in rows
               if row["kernel"].startswith("_linear_kernel"))
    assert all("'scale': 0.125" in row["kernel"] for row in rows
               if row["kernel"].startswith("_attend_prefix_kernel"))


def test_the_compiled_decode_step_holds_the_kernels_whole():
    """Each method's decode step traces as the GPU compiles it (fullgraph, AOT
    functionalization; Triton not interpreted, nothing run): no graph break, and the graph
    calls the fused kernels: the write (for the caches with auxiliary keys), the selection with
    the sparse attention, or the prefix attention for the full cache (tests/trace_decode.py);
    a split selection is three kernels (two for Quest, without a log-sum-exp). A whole
    decoder layer is the q/k/v kernel (which writes the token), the cache's kernels and three
    projection kernels, and nothing else: five kernels for Full-KV and for a selecting method
    (the compressed cache's slot offset is subtracted in the kernels), seven with a split
    selection."""
    r = compiled_triton(ROOT / "tests" / "trace_decode.py")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    sel = ["_select_attend_kernel"]  # selection and attention in one program (k <= 512)
    split = ["_split_lse_kernel", "_split_choose_kernel", "_split_merge_kernel"]
    lin = "_linear_kernel"
    layer_full, layer_hybrid = got.pop("layer_full"), got.pop("layer_hybrid")
    layer_split = got.pop("layer_sparq_split")
    assert got == {"full": ["_attend_prefix_kernel"], "hybrid": ["_write_token_kernel", *sel],
                   "hybrid_page1": sel, "quest": ["_write_token_kernel", *sel],
                   "sparq": ["_write_token_kernel", *sel],
                   "sparq_strided": ["_write_token_kernel", *sel],
                   "exact_topk": sel, "sparq_realloc": ["_write_token_kernel", *sel],
                   "quest_split": ["_write_token_kernel", *split[1:]],
                   "exact_topk_split": split,
                   "sparq_realloc_split": ["_write_token_kernel", *split]}, got
    assert layer_full == {"triton": [lin, "_attend_prefix_kernel", lin, lin, lin],
                          "other": []}, layer_full
    assert layer_hybrid == {"triton": [lin, *sel, lin, lin, lin], "other": []}, layer_hybrid
    assert layer_split == {"triton": [lin, *split, lin, lin, lin], "other": []}, layer_split


def test_kernels_stay_off_on_cpu_by_default():
    """``auto`` runs the kernels on CUDA only; a head dim under 16 never."""
    kernels.set_mode("auto")
    assert not kernels.enabled(torch.zeros(1, 1, 1, 64))
    kernels.set_mode("force")
    assert kernels.enabled(torch.zeros(1, 1, 1, 64))
    assert not kernels.enabled(torch.zeros(1, 1, 1, 8))
    with pytest.raises(ValueError, match="kernel mode"):
        kernels.set_mode("always")


# ---- CUDA, real shapes (pytest -m cuda) ---------------------------------------------------
# Every output is held to tests/tolerance.py's bound: its relative error per query head
# against exact attention in float64 over the slots the kernels chose, from the cache's own
# (rounded) data; 8 unit roundoffs in bfloat16, 2^-14 in float32. The choice itself is
# check_selection's (the reference's top-k, ties or near-ties aside), the token's write
# (K/V, page min/max, SparQ's dim-major column, its running mean of values) the PyTorch
# path's, bit for bit.

BOTH = (torch.bfloat16, torch.float32)
LLAMA = ModelArgs.from_name("llama-3.1-8b")  # the shape the parameters are derived at
NEW_TOKENS = 64  # the decode steps a cache holds room for (scripts/bench.py's --new-tokens)
ROCKETKV_PAGES = {32768: 740, 131008: 1171}  # RocketKV @256's pages: docs/design.md


def paper_selector(method, budget, prompt, options):
    """(selector factory, prompt tokens the cache keeps) of ``method`` at ``budget`` for a
    prompt of ``prompt`` tokens and ``NEW_TOKENS`` new ones at llama-3.1-8b's shape, as the
    registry derives them (RocketKV keeps SnapKV++'s share of the prompt)."""
    params = derive(method, budget, prompt, LLAMA, options)
    return (lambda: METHODS[method].selector(params)), getattr(params, "keep", prompt)


def device_caches(make, T, dtype, device, steps=2, seed=0):
    """Twin caches (the PyTorch path's, the kernels') of ``T`` random prompt tokens plus
    ``NEW_TOKENS`` slots at llama-3.1-8b's heads, built on ``device`` (the kernels' slots and
    pages past the prompt poisoned with NaN); the next ``steps`` tokens' q, k, v."""
    args = model_args(32, 8, 128)
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(heads, n):
        return torch.randn(1, heads, n, 128, generator=g, device=device).to(dtype)

    k, v, q = rand(8, T + steps), rand(8, T + steps), rand(32, steps)
    caches = []
    for _ in range(2):
        cache = CompressedKVCache(0, args, 1, dtype, device, prompt_len=T, prompt_capacity=T,
                                  max_new_tokens=NEW_TOKENS, selector=make())
        with torch.no_grad():
            cache.store_prompt(k[:, :, :T], v[:, :, :T], q[:, :, :1])
        caches.append(cache)
    ref, ker = caches
    poison_unwritten(ker, T)
    return ref, ker, [(q[:, :, i:i + 1], k[:, :, T + i:T + i + 1], v[:, :, T + i:T + i + 1])
                      for i in range(steps)]


def reallocated_reference(ref, q, t, chosen):
    """SparQ's reallocated output in float64: alpha y + (1 - alpha) mean V, y exact attention
    over the ``chosen`` slots, alpha each query head's mass of them under the approximate
    softmax (from the cache's rounded keys), the mean the PyTorch path's running mean after
    the step (B, H, 1, D)."""
    sel, Hkv = ref.selector, ref.n_kv_heads
    G = q.shape[1] // Hkv
    valid = torch.arange(ref.length, device=q.device) <= t
    keys = sel.k_dims if sel.dim_major else ref.k_cache
    probs = sparq_scores(q, keys, top_r_dims(q, Hkv, sel.r), valid, sel.dim_major)
    alpha = (probs.double() * chosen.to(q.device)[:, :, None, :]).sum(-1)  # (B, H_kv, G)
    alpha = alpha.reshape(q.shape[0], q.shape[1], 1, 1)
    mean = sel.v_mean.double().repeat_interleave(G, dim=1)
    return alpha * attention_over(ref, q, chosen) + (1 - alpha) * mean


def check_cuda_step(ref, ker, ins, t, k, dtype):
    """One decode step through the kernels against the PyTorch path's write, the reference's
    choice of k and the float64 attention over the chosen slots (``tests/tolerance.py``)."""
    decode(ref, "off", *ins, t)
    got = decode(ker, "force", *ins, t)
    assert torch.equal(ker.k_cache[:, :, :t + 1], ref.k_cache[:, :, :t + 1]), t
    assert torch.equal(ker.v_cache[:, :, :t + 1], ref.v_cache[:, :, :t + 1]), t
    aux = aux_of(ref.selector)
    if aux is not None:
        ps = ref.selector.page_size if isinstance(ref.selector, PagedSelector) else 1
        assert torch.equal(aux_of(ker.selector)[..., :t // ps + 1], aux[..., :t // ps + 1]), t
    chosen, same = check_selection(ref, ker, ins[0], t, k, exact=dtype == torch.float32)
    assert dtype == torch.bfloat16 or same.all(), same  # float32: the reference's own choice
    if getattr(ref.selector, "reallocate", False):
        assert_near(ker.selector.v_mean, ref.selector.v_mean.double(), torch.float32,
                    what="running mean of values")
        want = reallocated_reference(ref, ins[0], t, chosen)
    else:
        want = attention_over(ker, ins[0], chosen)
    assert_near(got, want, dtype, dims=2, what=f"step {t}")
    return got


CUDA_CASES = [  # (id, method, budget, prompt tokens, options, dtypes, path taken)
    ("rocketkv-32k", "rocketkv", 256, 32768, {}, BOTH, "one program"),  # 740 pages of 4
    ("rocketkv-128k", "rocketkv", 256, 131008, {}, BOTH, "one program"),  # 1171 pages of 5
    ("rocketkv2048-32k", "rocketkv", 2048, 32768, {}, BOTH, "k > 512"),  # k 1024, split
    ("rocketkv2048-128k", "rocketkv", 2048, 131008, {}, BOTH, "k > 512"),
    ("hybrid-32k", "hybrid", 256, 32768, {}, BOTH, "split"),  # 2736 pages of 12
    ("hybrid-128k", "hybrid", 256, 131008, {}, (torch.float32,), "split"),  # 5699 of 23
    ("quest-32k", "quest", 256, 32768, {}, BOTH, "one program"),  # 128 pages of 257
    ("quest-page16-32k", "quest", 256, 32768, {"page_size": 16}, BOTH, "split"),  # 2052
    ("quest-page16-128k", "quest", 256, 131008, {"page_size": 16}, (torch.float32,),
     "split"),  # 8192 pages: Quest's split selection, 4 programs
    ("quest2048-32k", "quest", 2048, 32768, {}, BOTH, "k > 512"),  # 995 pages of 33
    ("sparq-32k", "sparq", 256, 32768, {}, BOTH, "split"),  # one-token pages, r 1
    ("sparq-128k", "sparq", 256, 131008, {}, (torch.float32,), "split"),
    ("sparq-realloc-2k", "sparq", 256, 1984, {"sparq_reallocate": True}, BOTH,
     "one program"),  # select_attend_reallocated, 2048 slots
    ("sparq-realloc-32k", "sparq", 256, 32768, {"sparq_reallocate": True}, BOTH, "split"),
    ("sparq-realloc-128k", "sparq", 256, 131008, {"sparq_reallocate": True},
     (torch.float32,), "split"),
    ("exact_topk-32k", "exact_topk", 256, 32768, {}, BOTH, "split"),
    ("exact_topk-128k", "exact_topk", 256, 131008, {}, (torch.float32,), "split"),
]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA only (the GPU machine)")
@pytest.mark.parametrize("method,budget,T,options,dtype,path",
                         [(*c[1:5], dt, c[6]) for c in CUDA_CASES for dt in c[5]],
                         ids=[f"{c[0]}-{str(dt)[6:]}" for c in CUDA_CASES for dt in c[5]])
def test_cuda_real_shapes(method, budget, T, options, dtype, path, monkeypatch):
    """Two decode steps of each selecting method at the parameters the registry derives
    for llama-3.1-8b at budget 256 (and 2048: k = 1024, above ``SPLIT_TOKENS``) on 32K and
    128K prompts, with 64 new tokens of room: RocketKV's 740 and 1171 pages in one program
    (``select_attend``, its page list in registers of 1024 and 2048), the split selection
    (hybrid, Quest with pages of 16, SparQ, Exact-TopK), k above 512 (``paged_select`` then
    ``attend_pages`` split over programs), SparQ's reallocation (``select_attend_reallocated``,
    in one program at 2K, split above)."""
    make, kept = paper_selector(method, budget, T, options)
    sel = make()
    ref, ker, steps = device_caches(make, kept, dtype, "cuda")
    pages = ker.length // getattr(sel, "page_size", 1)
    k = min(sel.k, ker.length)
    if method == "rocketkv" and budget == 256:  # a change to the budget rule shows here
        assert pages == ROCKETKV_PAGES[T]
        assert OPS.register_pages(pages) == {32768: 1024, 131008: 2048}[T]  # PR
    splits = OPS.selection_splits(pages, k, getattr(sel, "page_size", 1))
    assert (splits > 1) == (path == "split") or path == "k > 512", splits
    assert (OPS.attention_splits(k) > 1) == (path == "k > 512")
    calls = []
    spy = kernels.select_then_attend
    monkeypatch.setattr(kernels, "select_then_attend",
                        lambda *a, **kw: calls.append(1) or spy(*a, **kw))
    for i, ins in enumerate(steps):
        check_cuda_step(ref, ker, ins, kept + i, k, dtype)
    assert len(calls) == (len(steps) if path == "k > 512" else 0)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA only (the GPU machine)")
@pytest.mark.parametrize("dtype", BOTH, ids=["bfloat16", "float32"])
@pytest.mark.parametrize("T", [32768, 131008])
def test_cuda_prefix_attention_real_shapes(T, dtype):
    """attend_prefix (Full-KV decode) at llama-3.1-8b's heads over 32K and 128K written
    slots of a buffer poisoned past them: the token written as the PyTorch path writes it,
    the output within the bound of float64 attention over slots 0..T (whose entries at 128K
    are about 0.005: an absolute 0.02 accepted zeros there)."""
    args = model_args(32, 8, 128)
    g = torch.Generator(device="cuda").manual_seed(1)
    ref, ker = (FullKVCache(0, args, 1, dtype, "cuda", T + NEW_TOKENS) for _ in range(2))
    for buf in ("k_cache", "v_cache"):
        x = torch.randn(1, 8, T, 128, generator=g, device="cuda").to(dtype)
        getattr(ref, buf)[:, :, :T] = x
        getattr(ker, buf)[:, :, :T] = x
    ker.k_cache[:, :, T:] = float("nan")
    ker.v_cache[:, :, T:] = float("nan")
    q, kk, v = (torch.randn(1, h, 1, 128, generator=g, device="cuda").to(dtype)
                for h in (32, 8, 8))
    decode(ref, "off", q, kk, v, T)
    got = decode(ker, "force", q, kk, v, T)
    assert torch.equal(ker.k_cache[:, :, :T + 1], ref.k_cache[:, :, :T + 1])
    assert torch.equal(ker.v_cache[:, :, :T + 1], ref.v_cache[:, :, :T + 1])
    written = (torch.arange(T + NEW_TOKENS) <= T).expand(1, 8, -1)
    assert_near(got, attention_over(ker, q, written), dtype, dims=2, what=f"{T} slots")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="CUDA only (the GPU machine)")
def test_cuda_graph_captures_the_kernels():
    """The decode step with the kernels compiles (fullgraph) and replays in a CUDA graph with
    the output of the eager kernels: RocketKV @256 at 32K (740 pages), bfloat16."""
    make, kept = paper_selector("rocketkv", 256, 32768, {})
    ref, ker, steps = device_caches(make, kept, torch.bfloat16, "cuda", steps=1)
    t, ins = kept, steps[0]
    eager = check_cuda_step(ref, ker, ins, t, 128, torch.bfloat16)
    step = torch.compile(ker.decode, mode="reduce-overhead", fullgraph=True)
    pos = torch.tensor([t], device="cuda")
    with torch.no_grad():
        for _ in range(3):  # warm-up and capture; the same token rewritten each time
            got = step(*ins, pos)
    assert_near(got, eager.double(), torch.bfloat16, dims=2, what="graph replay")


# ---- the choice of k slots among scored pages, alone -------------------------------------

if OPS is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _choose_probe(key_ptr, cnt_ptr, pages_ptr, take_ptr, n_ptr, k_eff, N: tl.constexpr,
                      LIMIT: tl.constexpr):
        p = tl.arange(0, N)
        n = OPS._choose(tl.load(key_ptr + p), tl.load(cnt_ptr + p), p, k_eff, pages_ptr,
                        take_ptr, LIMIT)
        tl.store(n_ptr, n)


def choice_reference(key: list[int], cnt: list[int], k: int) -> list[tuple[int, int]]:
    """(page, slots) of the page-first choice of k slots: tau the largest key whose pages
    hold at least k slots (the smallest key when none does); pages above tau give all their
    slots, pages at tau their first slots in page order while the k last."""
    live = sorted({x for x, c in zip(key, cnt) if c > 0}, reverse=True)
    tau = next((t for t in live if sum(c for x, c in zip(key, cnt) if x >= t) >= k),
               -2**31 if not live else None)
    if tau is None:  # fewer than k slots in all: every page with slots
        tau = live[-1]
    room = k - sum(c for x, c in zip(key, cnt) if x > tau)
    out = []
    for p, (x, c) in enumerate(zip(key, cnt)):
        take = c if x > tau else min(c, max(room, 0)) if x == tau else 0
        room -= c if x == tau else 0
        if take > 0:
            out.append((p, take))
    return out


@interpreted
@pytest.mark.parametrize("case", ["random", "ties", "extremes", "sparse", "k-past-all",
                                  "no-slots"])
def test_the_choice_takes_the_reference_slots(case):
    """``_choose`` (the snapping bisection over order keys) on crafted keys: the chosen
    pages and their slots equal the page-first reference, with ties broken in page order,
    keys at the int32 extremes, pages without slots never chosen, and k past every slot."""
    g = torch.Generator().manual_seed(7)
    N, k = 64, 40
    key = torch.randint(-2**31, 2**31 - 1, (N,), generator=g, dtype=torch.int64)
    cnt = torch.randint(1, 9, (N,), generator=g, dtype=torch.int32)
    if case == "ties":
        key = torch.randint(-2, 3, (N,), generator=g, dtype=torch.int64)
    elif case == "extremes":
        key[:8] = 2**31 - 1
        key[8:16] = -2**31
        k = 60
    elif case == "sparse":
        cnt[::3] = 0  # pages past the written slots: any key, no slots
    elif case == "k-past-all":
        k = int(cnt.sum()) + 5
    elif case == "no-slots":
        cnt[:] = 0
    k_eff = min(k, int(cnt.sum()))
    pages = torch.full((N,), -1, dtype=torch.int32)
    take = torch.full((N,), -1, dtype=torch.int32)
    n = torch.zeros(1, dtype=torch.int32)
    _choose_probe[(1,)](key, cnt, pages, take, n, k_eff, N=N, LIMIT=N)
    got = list(zip(pages[:int(n)].tolist(), take[:int(n)].tolist()))
    assert got == choice_reference(key.tolist(), cnt.tolist(), k_eff)
    assert sum(t for _, t in got) == k_eff


def test_selection_splits_fill_the_gpus_multiprocessors():
    """With ``sms`` multiprocessors and ``programs`` (B x H_kv) that leave them idle, the
    selection splits further: up to the power of two >= sms / programs, each split at least
    ``MIN_SPLIT_PAGES`` pages, never fewer than the ``SPLIT_PAGES`` rule. RocketKV @256 at
    32K on an H200 (132 SMs, 8 KV heads; 740-1,171 pages): 8-16 splits at batch 1 (64-128
    programs), 2 at batch 16; off CUDA (sms 0) the rule of one program per KV head stands."""
    assert [OPS.selection_splits(p, 128, 44, 8, 132) for p in (740, 1171)] == [8, 16]
    assert [OPS.selection_splits(p, 128, 44, 128, 132) for p in (740, 1171)] == [2, 2]
    assert [OPS.selection_splits(p, 128, 44) for p in (740, 1171)] == [1, 1]
    assert OPS.selection_splits(2736, 128, 12, 8, 132) == 32  # hybrid at 32K: 85 pages each
    assert OPS.selection_splits(2736, 128, 12, 256, 132) == 2  # GPU full: SPLIT_PAGES's rule
    assert OPS.selection_splits(100, 128, 44, 8, 132) == 1  # too few pages to split
    assert OPS.selection_splits(32768, 128, 1, 8, 132) == 32
    assert OPS.selection_splits(131072, 256, 1, 8, 132) == 32  # candidates cap it as before


@interpreted
@pytest.mark.parametrize("name,pages", [("hybrid", 1024), ("hybrid", 1171), ("quest", 740)])
def test_a_step_split_over_the_gpu_gives_the_one_program_output(name, pages, monkeypatch):
    """At real page counts (RocketKV's at 32K) with few heads, the decode step whose
    selection is split to fill 132 SMs (``kernels.multiprocessors``) gives the one-program
    step's output and the reference's."""
    ps = SELECTORS[name](1).page_size
    T, k = pages * ps, 128
    ref, ker, (q, kk, v) = twin_caches(name, k, model_args(2, 1, 16), T, 1, torch.float32,
                                       "cpu")
    ins = q[:, :, T:T + 1], kk[:, :, T:T + 1], v[:, :, T:T + 1]
    want = decode(ref, "off", *ins, T)
    splits = []
    spy = OPS._split_selection

    def counting(*a, **kw):
        splits.append(a[10] if len(a) > 10 else kw["splits"])
        return spy(*a, **kw)

    monkeypatch.setattr(OPS, "_split_selection", counting)
    outputs = {}
    for sms in (0, 132):
        monkeypatch.setattr(kernels, "multiprocessors", lambda device, sms=sms: sms)
        cache = twin_caches(name, k, model_args(2, 1, 16), T, 1, torch.float32, "cpu")[1]
        outputs[sms] = decode(cache, "force", *ins, T)
        assert torch.allclose(outputs[sms], want, atol=2e-5, rtol=1e-4), sms
    assert len(splits) == 1 and splits[0] > 1  # only the filled step ran split
    assert torch.allclose(outputs[0], outputs[132], atol=1e-6, rtol=1e-5)
