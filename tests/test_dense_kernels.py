"""The dense decode kernels (kernels/dense.py) against the PyTorch modules they replace.

On CPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py) at small
shapes: each launch against the plain formula (``F.linear``, ``RMSNorm``, ``apply_rope``, the
cache write and the selectors' ``update``), then whole decode steps of every method with the
dense kernels on against the same steps with them off. Slots and pages the write must not
touch are poisoned with NaN. The ``cuda`` tests run the checks at the llama-3.1-8b shape on
the GPU machine (``pytest -m cuda``).
"""

import dataclasses
import importlib
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tolerance import assert_near
from torch.fx.experimental.proxy_tensor import make_fx

from rocketkv import kernels, quantized
from rocketkv.cache import CompressedKVCache, FullKVCache
from rocketkv.compression import METHODS, build_caches, smallest_budget
from rocketkv.compression.hybrid import HybridSelector
from rocketkv.compression.sparq import SparQSelector
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.formats.checkpoint import random_model
from rocketkv.kernels import tuning
from rocketkv.kernels.fuse import fuse, kernel_weight
from rocketkv.model import ModelArgs, RMSNorm, Transformer, apply_rope, precompute_rope
from rocketkv.quantized import (
    Int4Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

OPS = kernels.ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"triton: {kernels.missing()}")
DENSE = importlib.import_module("rocketkv.kernels.dense") if OPS is not None else None
CUDA = torch.cuda.is_available()
interpreted = pytest.mark.skipif(CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU tensors need Triton's interpreter; the GPU "
                                        "machine runs the cuda tests")


@pytest.fixture(autouse=True)
def _kernels_forced():
    previous, dense = kernels.set_mode("force"), kernels.set_dense(True)
    yield
    kernels.set_mode(previous)
    kernels.set_dense(dense)


def tolerance(dtype):
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


@pytest.fixture
def few_programs(monkeypatch):
    """Larger blocks, fewer programs: the whole-model tests' launches at these small shapes
    (the interpreter's time grows with the programs; the launch tests cover the blocks)."""
    monkeypatch.setattr(DENSE, "TARGET_PROGRAMS", 8)


@pytest.fixture(params=[512, 3], ids=["rows-1", "rows-many"])
def programs(request, monkeypatch):
    """``TARGET_PROGRAMS``: 512 gives one weight row per program at these shapes, 3 the
    largest blocks, with a partial last block."""
    monkeypatch.setattr(DENSE, "TARGET_PROGRAMS", request.param)


# ---- one launch against the formula ------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_linear_equals_the_formula(batch, dtype, programs):
    g = torch.Generator().manual_seed(batch)
    K, N = 48, 40  # neither a multiple of the blocks
    x = torch.randn(batch, 1, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / 7).to(dtype)
    w13 = (torch.randn(2 * N, K, generator=g) / 7).to(dtype)
    r = torch.randn(batch, 1, N, generator=g).to(dtype)
    norm = RMSNorm(K, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(K, generator=g) + 0.5).to(dtype)
    with torch.no_grad():
        cases = {
            "norm": (kernels.linear(x, w, norm.weight, norm.eps), F.linear(norm(x), w)),
            "residual": (kernels.linear(x, w, residual=r), r + F.linear(x, w)),
            "swiglu": (kernels.linear(x, w13, norm.weight, norm.eps, swiglu=True),
                       F.silu(F.linear(norm(x), w13[:N])) * F.linear(norm(x), w13[N:])),
        }
    for name, (out, ref) in cases.items():
        assert out.shape == ref.shape and out.dtype == dtype, name
        assert torch.allclose(out.float(), ref.float(), **tolerance(dtype)), name


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_weights_equal_the_dequantized_formula(mode, batch, dtype, monkeypatch):
    """int8 (per-row scales) and int4 (nibbles, scales and zeros per group of 32) weights,
    dequantized in the kernel: each launch equals the formula on ``quantized.py``'s
    dequantized weights (norm, residual, SwiGLU and the q/k/v store); the largest blocks,
    with a partial last one."""
    monkeypatch.setattr(DENSE, "TARGET_PROGRAMS", 3)
    g = torch.Generator().manual_seed(7 + batch)
    K, N, G = 96, 40, 32  # three groups; N not a multiple of the blocks

    def quant(w):
        if mode == "int8":
            q, s = quantize_int8(w)
            s = s.to(dtype)
            return (q, s, 0), dequantize_int8(q, s).float()
        q, sz = quantize_int4(w, G)
        sz = sz.to(dtype)
        return (q, sz, G), dequantize_int4(q, sz, G).float()

    x = torch.randn(batch, 1, K, generator=g).to(dtype)
    (w, ws, wg), wd = quant(torch.randn(N, K, generator=g) / 7)
    (w13, s13, g13), w13d = quant(torch.randn(2 * N, K, generator=g) / 7)
    r = torch.randn(batch, 1, N, generator=g).to(dtype)
    norm = RMSNorm(K, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(K, generator=g) + 0.5).to(dtype)
    xn = norm(x).float()
    with torch.no_grad():
        cases = {
            "norm": (kernels.linear(x, w, norm.weight, norm.eps, scales=ws, groupsize=wg),
                     F.linear(xn, wd)),
            "residual": (kernels.linear(x, w, residual=r, scales=ws, groupsize=wg),
                         r.float() + F.linear(x.float(), wd)),
            "swiglu": (kernels.linear(x, w13, norm.weight, norm.eps, swiglu=True, scales=s13,
                                      groupsize=g13),
                       F.silu(F.linear(xn, w13d[:N])) * F.linear(xn, w13d[N:])),
        }
    for name, (out, ref) in cases.items():
        assert out.shape == ref.shape and out.dtype == dtype, name
        assert torch.allclose(out.float(), ref, **tolerance(dtype)), \
            (name, (out.float() - ref).abs().max())
    H, Hkv, D = 4, 2, 32  # input width 3 D: three groups
    xq, nq, wf, _, rope = qkv_setup(H, Hkv, D, batch, torch.float32, False, g)
    (wq, sq, gq), wqd = quant(wf)
    pos = torch.tensor([5])
    q_ref, k_ref, v_ref = qkv_formula(xq.to(dtype).float(), nq, wqd, None, rope[pos], H, Hkv,
                                      D)
    kc = torch.full((batch, Hkv, 8, D), float("nan"), dtype=dtype)
    vc = kc.clone()
    with torch.no_grad():
        q = kernels.qkv_store(xq.to(dtype), nq.weight.to(dtype), nq.eps, wq, None, rope[pos],
                              (kc, vc, pos, None, *kernels.no_aux(kc)), H, scales=sq,
                              groupsize=gq)
    tol = tolerance(dtype)
    assert torch.allclose(q.float(), q_ref, **tol)
    assert torch.allclose(kc[:, :, 5].float(), k_ref[:, :, 0], **tol)
    assert torch.allclose(vc[:, :, 5].float(), v_ref[:, :, 0], **tol)


def qkv_setup(H, Hkv, D, B, dtype, bias, g):
    dim = 3 * D
    w = (torch.randn((H + 2 * Hkv) * D, dim, generator=g) / 5).to(dtype)
    b = torch.randn((H + 2 * Hkv) * D, generator=g).to(dtype) if bias else None
    norm = RMSNorm(dim, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    x = torch.randn(B, 1, dim, generator=g).to(dtype)
    args = ModelArgs(dim=dim, n_layers=1, n_heads=H, n_kv_heads=Hkv, head_dim=D,
                     intermediate_size=8, vocab_size=10, max_seq_len=64)
    rope = precompute_rope(args, 64)
    return x, norm, w, b, rope


def qkv_formula(x, norm, w, b, rope, H, Hkv, D):
    """The model's path: ``Attention.qkv`` on the normed hidden state."""
    B = x.shape[0]
    y = F.linear(norm(x), w) + (b if b is not None else 0)
    q, k, v = y.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = apply_rope(q.view(B, 1, H, D), rope).transpose(1, 2)
    k = apply_rope(k.view(B, 1, Hkv, D), rope).transpose(1, 2)
    return q, k, v.view(B, 1, Hkv, D).transpose(1, 2)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aux", ["none", "summary", "dim_major"])
@pytest.mark.parametrize("heads,bias,batch", [((4, 2), False, 1), ((2, 2), True, 2),
                                              ((6, 1), True, 1)])
def test_qkv_store_equals_the_projection_rope_and_write(heads, bias, batch, aux, dtype,
                                                        programs):
    """q returned, k and v written at the slot (and nowhere else), the page summary updated
    (a page's first slot restarts it, a later one takes the max and min) or the dim-major
    column written, as the PyTorch write and ``update``."""
    H, Hkv = heads
    D, S, P = 16, 12, 4
    g = torch.Generator().manual_seed(H + batch)
    x, norm, w, b, rope = qkv_setup(H, Hkv, D, batch, dtype, bias, g)
    for slot in (8, 9):  # a page's first slot, then the next
        pos = torch.tensor([slot + 5])
        q_ref, k_ref, v_ref = qkv_formula(x, norm, w, b, rope[pos], H, Hkv, D)
        kc = torch.full((batch, Hkv, S, D), float("nan"), dtype=dtype)
        vc = kc.clone()
        if aux == "summary":
            buf = torch.randn(batch, Hkv, 2 * D, S // P, generator=g).to(dtype)
            kind, ps = kernels.AUX_SUMMARY, P
        elif aux == "dim_major":
            buf = torch.full((batch, Hkv, D, S), float("nan"), dtype=dtype)
            kind, ps = kernels.AUX_DIM_MAJOR, 1
        else:
            buf, kind, ps = kernels.no_aux(kc)
        before = buf.clone()
        # the slot as a compressed cache gives it (position less the slot offset), or as is
        where = (torch.tensor([slot + 3]), torch.tensor([3])) if slot % 2 else \
            (torch.tensor([slot]), None)
        store = (kc, vc, *where, buf, kind, ps)
        with torch.no_grad():
            q = kernels.qkv_store(x, norm.weight, norm.eps, w, b, rope[pos], store, H)
        tol = tolerance(dtype)
        assert q.shape == (batch, H, 1, D) and torch.allclose(q.float(), q_ref.float(), **tol)
        k_new, v_new = kc[:, :, slot], vc[:, :, slot]
        assert torch.allclose(k_new.float(), k_ref[:, :, 0].float(), **tol)
        assert torch.allclose(v_new.float(), v_ref[:, :, 0].float(), **tol)
        others = torch.arange(S) != slot
        assert kc[:, :, others].isnan().all() and vc[:, :, others].isnan().all()
        if aux == "summary":  # the update of the stored (rounded) key, exactly
            page = slot // P
            kf = k_new.float()
            old = before[..., page].float()
            first = slot % P == 0
            mx = kf if first else torch.maximum(old[:, :, :D], kf)
            mn = kf if first else torch.minimum(old[:, :, D:], kf)
            assert torch.equal(buf[..., page].float(), torch.cat([mx, mn], dim=2))
            rest = torch.arange(S // P) != page
            assert torch.equal(buf[..., rest], before[..., rest])
        elif aux == "dim_major":
            assert torch.equal(buf[..., slot], k_new)
            assert buf[..., others].isnan().all()


# ---- whole decode steps of every method ----------------------------------------------------

ARGS = {
    "gqa": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=80,
                     vocab_size=40, max_seq_len=256),
    "qwen-like": ModelArgs(dim=48, n_layers=2, n_heads=3, n_kv_heads=1, intermediate_size=64,
                           vocab_size=40, max_seq_len=256, qkv_bias=True,
                           tie_word_embeddings=True),
}


def decode_logits(model, method, fused, T=72, steps=2, batch=2, replay=False, **options):
    """Logits (steps, B, vocab) of greedy decode steps after a prefill of ``T`` random
    tokens, with every kernel (``fused``) or none: the PyTorch path; ``options`` the
    method's (``build_caches``). ``replay``: as a CUDA graph of the eager step runs it
    (``step.GraphStep``): the first step is traced (``make_fx``: what the step reads of
    Python values is frozen into the trace, as a capture freezes its kernels' arguments; a
    sync with the host fails the trace, as it fails a capture) and the later steps replay
    the trace, the token and the position tensor advanced in place."""
    args = model.args
    budget = None
    if METHODS[method].budgeted:  # compressing: below prompt + new tokens
        smallest = smallest_budget(method, T, args, options, T + steps + 1)
        if smallest is None:
            pytest.skip(f"{method} takes no budget below the sequence at this shape")
        budget = max(40, smallest)
    caches = build_caches(method, args, batch_size=batch, prompt_len=T,
                          max_new_tokens=steps + 1, budget=budget,
                          dtype=model.tok_embeddings.weight.dtype, device="cpu", **options)
    model.setup_caches(caches, T + steps + 1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (batch, T), generator=g)
    previous = kernels.set_mode("force" if fused else "off")

    def step(tok, pos, logits):  # the step writes its logits where the trace can return them
        return logits.copy_(model(tok, pos).reshape(logits.shape))

    try:
        with torch.no_grad():
            tok = model.prefill(tokens).argmax(-1, keepdim=True)
            pos, logits, trace = torch.tensor([T]), torch.empty(batch, 1, args.vocab_size), None
            out = []
            for _ in range(steps):
                if replay and trace is None:
                    trace = make_fx(step)(tok, pos, logits)
                else:
                    (trace or step)(tok, pos, logits)
                out.append(logits.clone())
                tok.copy_(logits.argmax(-1))
                pos += 1
    finally:
        kernels.set_mode(previous)
    return torch.stack(out), caches


def small_model(shape, **overrides):
    """A random model of the shape ``ARGS[shape]``, fused (``kernels.fuse``): its decode
    steps run the dense kernels where they run (the ``fused`` runs), the PyTorch path else."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(ARGS[shape], **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        if model.args.qkv_bias:
            for layer in model.layers:
                layer.attention.wqkv_bias.normal_(0, 0.5)
    return fuse(model.eval())


@interpreted
@pytest.mark.parametrize("method,shape,options",
                         [(m, "gqa", {}) for m in METHODS] +
                         [(m, "qwen-like", {}) for m in ("full", "rocketkv", "h2o")] +
                         [("sparq", "gqa", {"sparq_reallocate": True})],
                         ids=lambda v: "reallocate" if v == {"sparq_reallocate": True} else
                         None if isinstance(v, dict) else v)
def test_every_method_decodes_alike_with_the_kernels(method, shape, options, few_programs):
    """The model's decode steps with every kernel (dense and sparse) equal the PyTorch path's
    (fp32): for a cache that offers ``token_store`` the q/k/v kernel writes the token where
    its own write would (its buffers equal after the steps; the selectors' auxiliary keys
    too, and SparQ's running mean of values, which its attention kernel updates); for the
    others ``decode`` gets the same k and v."""
    model = small_model(shape)
    ref, ref_caches = decode_logits(model, method, fused=False, **options)
    calls = []
    spy = kernels.qkv_store

    def counting(*a, **kw):
        calls.append(1)
        return spy(*a, **kw)

    kernels.qkv_store = counting
    try:
        out, caches = decode_logits(model, method, fused=True, **options)
    finally:
        kernels.qkv_store = spy
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    fused = all(c.dense_kernels for c in caches)
    assert len(calls) == (out.shape[0] * model.args.n_layers if fused else 0)
    for c, r in zip(caches, ref_caches):
        if c.token_store(torch.tensor([0])) is not None:
            for name, buf in c.named_buffers():
                assert torch.allclose(buf.float(), dict(r.named_buffers())[name].float(),
                                      atol=1e-4, equal_nan=True), name


@interpreted
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_decodes_alike_with_the_kernels(mode, monkeypatch, few_programs):
    """A quantized model (``quantize_model``: int8, or int4 in groups of 32 with the int8
    classifier) decodes through the dense kernels (every layer fused, the int8 LM head too;
    int4 in the nibble layout it has on CUDA where they run) with the PyTorch path's logits,
    within the bfloat16 rounding of the PyTorch path's quantized matmuls on CPU."""
    monkeypatch.setattr(quantized, "int4_layout", lambda *a: "nibbles")
    model = quantize_model(small_model("gqa", intermediate_size=96), mode,
                           32 if mode == "int4" else None)
    assert all(kernel_weight(m) is not None for layer in model.layers
               for m in (layer.attention.wqkv, layer.feed_forward.w2)) and \
        kernel_weight(model.output) is not None
    # the full cache: a compressed one may pick other tokens where the quantized matmuls'
    # rounding reorders near-tied scores (rocketkv's second step differs by 6-100% of the
    # logits' scale at T = 64 or 96 from a selection flip, not from the kernels)
    ref, _ = decode_logits(model, "full", fused=False)
    calls = []
    spy = kernels.linear

    def counting(*a, **kw):
        calls.append(kw.get("scales") is not None)
        return spy(*a, **kw)

    monkeypatch.setattr(kernels, "linear", counting)
    out, _ = decode_logits(model, "full", fused=True)
    assert calls and all(calls)  # every projection and the LM head, from quantized weights
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= 0.01 * scale, (out - ref).abs().max() / scale


@interpreted
def test_bfloat16_decode_step_is_within_rounding_of_the_pytorch_path(few_programs):
    """A bfloat16 model (its RoPE table cast with it): the first decode step's logits with
    every kernel are within bfloat16 rounding of the PyTorch path's, for the full cache and a
    compressed one; each rounds differently (the kernels once per projection, the PyTorch
    path after each op)."""
    model = small_model("qwen-like").to(torch.bfloat16)
    for method in ("full", "rocketkv"):
        ref, _ = decode_logits(model, method, fused=False, steps=1)
        out, _ = decode_logits(model, method, fused=True, steps=1)
        scale = ref.float().abs().max()
        assert (out.float() - ref.float()).abs().max() <= 0.03 * scale, method


@interpreted
def test_generate_reports_which_kernels_ran(few_programs):
    """``generate`` through the kernels (interpreted, eager) gives the PyTorch path's greedy
    tokens and says so in its result: ``fused_kernels`` and ``dense_kernels``; with the dense
    kernels off only the sparse ones ran."""
    model = small_model("gqa")
    prompt = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {}
    for mode, dense in (("off", True), ("force", True), ("force", False)):
        kernels.set_mode(mode)
        kernels.set_dense(dense)
        runs[mode, dense] = generate(model, prompt, CacheRequest("rocketkv", 40), max_new_tokens=4)
    flags = {key: (r["fused_kernels"], r["dense_kernels"]) for key, r in runs.items()}
    assert flags == {("off", True): (False, False), ("force", True): (True, True),
                     ("force", False): (True, False)}
    assert len({str(r["token_ids"]) for r in runs.values()}) == 1


def test_what_the_dense_kernels_leave_to_pytorch():
    """Biased or hooked linears (tensor parallelism's all-reduce), a hooked MLP, int4 in the
    layouts of torch's own int4 matmuls and the gpt-fast baseline keep the PyTorch path;
    ``set_dense(False)`` keeps it everywhere."""
    model = small_model("gqa")
    layer = model.layers[0]
    layer.attention.kv_cache = FullKVCache(0, model.args, 1, torch.float32, "cpu", 16)
    assert layer.fusable()
    handle = layer.attention.wo.register_forward_hook(lambda *a: None)
    assert not layer.fusable()
    handle.remove()
    handle = layer.feed_forward.register_forward_pre_hook(lambda *a: None)  # e.g. steering
    assert not layer.fusable()
    handle.remove()
    layer.feed_forward.w2 = nn.Linear(80, 64, bias=True)
    assert not layer.fusable()
    packed, sz = quantize_int4(torch.randn(64, 64), 32)  # the CPU int4 kernel's layout
    assert Int4Linear(packed, sz, 32, "cpu", torch.float32).kernel_weight() is None
    caches = build_caches("gptfast_dense", model.args, batch_size=1, prompt_len=8,
                          max_new_tokens=2, budget=None, dtype=torch.float32, device="cpu")
    assert not caches[0].dense_kernels
    x = torch.zeros(1, 1, 64)
    assert kernels.dense_in_use(x.device)
    kernels.set_dense(False)
    assert not kernels.dense_in_use(x.device) and kernels.enabled(torch.zeros(1, 1, 16))


def test_a_cache_that_decodes_its_own_way_gets_k_and_v():
    """A subclass of the full or compact cache that overrides ``decode`` (rather than
    ``attend_stored``) offers no token store: the fused path then calls its ``decode``."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=64)

    class OwnFull(FullKVCache):
        def decode(self, q, k, v, input_pos):
            return super().decode(q, k, v, input_pos)

    class OwnCompact(CompressedKVCache):
        def decode(self, q, k, v, input_pos):
            return super().decode(q, k, v, input_pos)

    pos = torch.tensor([3])
    assert FullKVCache(0, args, 1, torch.float32, "cpu", 8).token_store(pos) is not None
    assert OwnFull(0, args, 1, torch.float32, "cpu", 8).token_store(pos) is None
    compact = dict(prompt_len=4, prompt_capacity=4, max_new_tokens=4,
                   selector=HybridSelector(2, 5, 4))
    assert CompressedKVCache(0, args, 1, torch.float32, "cpu", **compact).token_store(pos)
    assert OwnCompact(0, args, 1, torch.float32, "cpu", **compact).token_store(pos) is None


def test_token_stores_name_the_selectors_auxiliary_keys():
    """A selector's write in the fused kernel: Hybrid's page summary, SparQ's dim-major copy,
    none for SparQ's strided keys, the copy with SparQ's mean-V reallocation where its
    attention kernel reallocates (the selection fits), else no fused write: ``update`` keeps
    the running mean."""
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=64)
    pos = torch.tensor([20])

    def cache(sel):
        return CompressedKVCache(0, args, 1, torch.float32, "cpu", prompt_len=16,
                                 prompt_capacity=12, max_new_tokens=8, selector=sel)

    c = cache(HybridSelector(4, 5, 8))
    s = c.token_store(pos)
    assert s.aux is c.selector.summary and s.aux_kind == kernels.AUX_SUMMARY and \
        s.page_size == 4 and int(s.pos - s.offset) == 20 - 4
    s = cache(SparQSelector(5, 8)).token_store(pos)
    assert s.aux_kind == kernels.AUX_DIM_MAJOR
    assert cache(SparQSelector(5, 8, dim_major=False)).token_store(pos).aux_kind == kernels.AUX_NONE
    assert cache(SparQSelector(5, 8, reallocate=True)).token_store(pos).aux_kind == \
        kernels.AUX_DIM_MAJOR
    with pytest.MonkeyPatch.context() as m:
        m.setattr(OPS, "SELECT_REGISTER_PAGES", 8)  # 20 slots: no choice fits
        assert cache(SparQSelector(5, 8, reallocate=True)).token_store(pos) is None


# ---- CUDA, real shapes ---------------------------------------------------------------------
# Each output against the formula in float64 on the same (rounded) inputs and weights, as a
# relative error per output row (per head for q, k and v), within tests/tolerance.py's bound
# (8 unit roundoffs of bfloat16): an all-zero or shuffled output fails.

LLAMA_LINEARS = [(4096, 4096, False), (14336, 4096, True), (4096, 14336, False),
                 (128256, 4096, False)]  # (out, in, SwiGLU): wo, w13, w2, the LM head


def rms_norm64(x, weight, eps):
    """RMSNorm in float64: x / sqrt(mean x^2 + eps) * weight."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def linear64(x, w64, norm=None, swiglu=False):
    """[RMSNorm] x @ W^T (SwiGLU over W's two halves) in float64: (..., N)."""
    xn = rms_norm64(x, norm.weight, norm.eps) if norm is not None else x.double()
    y = xn @ w64.T
    if swiglu:
        a, b = y.chunk(2, dim=-1)
        return F.silu(a) * b
    return y


def qkv64(x, norm, w64, rope, H, Hkv, D):
    """The q/k/v projection with RoPE (adjacent pairs, ``apply_rope``'s) in float64:
    q (B, H, 1, D), k and v (B, H_kv, D)."""
    B = x.shape[0]
    y = linear64(x, w64, norm).reshape(B, -1)
    q, k, v = y.split([H * D, Hkv * D, Hkv * D], dim=-1)
    cos, sin = rope[0, :, 0].double(), rope[0, :, 1].double()

    def rotate(t, n):
        p = t.reshape(B, n, D // 2, 2)
        return torch.stack([p[..., 0] * cos - p[..., 1] * sin,
                            p[..., 1] * cos + p[..., 0] * sin], dim=-1).reshape(B, n, D)

    return rotate(q, H).view(B, H, 1, D), rotate(k, Hkv), v.reshape(B, Hkv, D)


def cuda_norm(n, g, dev, dt):
    norm = RMSNorm(n, 1e-5).to(dev, dt)
    norm.weight.data = (torch.rand(n, generator=g, device=dev) + 0.5).to(dt)
    return norm


def check_qkv_store_cuda(batch, g, weight, w64, scales=None, groupsize=0):
    """qkv_store at llama-3.1-8b's shape on the GPU: q, and k and v written at slot 32768
    (position 32868, offset 100), within the bound of the float64 formula; the page summary
    of that page's first slot equal to the stored key."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, Hkv, D, dim = 32, 8, 128, 4096
    x = torch.randn(batch, 1, dim, generator=g, device=dev).to(dt)
    norm = cuda_norm(dim, g, dev, dt)
    rope = precompute_rope(ModelArgs.from_name("llama-3.1-8b"), 40000, dev)[
        torch.tensor([32768 + 100], device=dev)]
    kc = torch.full((batch, Hkv, 40000, D), float("nan"), device=dev, dtype=dt)
    vc = kc.clone()
    summary = torch.randn(batch, Hkv, 2 * D, 40000 // 16, device=dev).to(dt)
    pos, offset = torch.tensor([32768 + 100], device=dev), torch.tensor([100], device=dev)
    q = kernels.qkv_store(x, norm.weight, norm.eps, weight, None, rope,
                          (kc, vc, pos, offset, summary, kernels.AUX_SUMMARY, 16), H,
                          scales=scales, groupsize=groupsize)
    q_ref, k_ref, v_ref = qkv64(x, norm, w64, rope, H, Hkv, D)
    assert_near(q, q_ref, what="q")
    assert_near(kc[:, :, 32768], k_ref, what="k written")
    assert_near(vc[:, :, 32768], v_ref, what="v written")
    assert kc[:, :, 32767].isnan().all() and kc[:, :, 32769].isnan().all()
    for rows in (slice(0, D), slice(D, 2 * D)):  # the page's first slot: max = min = key
        assert torch.equal(summary[:, :, rows, 2048], kc[:, :, 32768])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_cuda_real_shapes(batch):
    """The llama-3.1-8b layer shapes in bf16: the output, gate/up (SwiGLU) and down
    projections and the LM head, each after its norm, and the q/k/v launch with its write,
    against the formula in float64; batch 1 (the GEMV), 16 and 64 (``tl.dot`` over blocks
    of 16 and 64 rows)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    for n_out, k_in, swiglu in LLAMA_LINEARS:
        w = (torch.randn((2 if swiglu else 1) * n_out, k_in, generator=g, device=dev)
             / k_in ** 0.5).to(dt)
        x = torch.randn(batch, 1, k_in, generator=g, device=dev).to(dt)
        n = cuda_norm(k_in, g, dev, dt)
        out = kernels.linear(x, w, n.weight, n.eps, swiglu=swiglu)
        assert_near(out, linear64(x, w.double(), n, swiglu), what=f"{n_out} x {k_in}")
        r = torch.randn(batch, 1, n_out, generator=g, device=dev).to(dt)
        if not swiglu and n_out == 4096:  # wo, w2: the residual added
            out = kernels.linear(x, w, residual=r)
            assert_near(out, r.double() + linear64(x, w.double()), what="residual")
    w = (torch.randn((32 + 2 * 8) * 128, 4096, generator=g, device=dev) / 64).to(dt)
    check_qkv_store_cuda(batch, g, w, w.double())


def quantized_weight(w, mode):
    """(stored weight, scales, group size, float64 dequantized weight) of ``w`` in ``mode``
    (int8 per row, int4 in groups of 128), the scales in bf16 as the model keeps them."""
    if mode == "int8":
        q, sc = quantize_int8(w)
        sc = sc.to(torch.bfloat16)
        return q, sc, 0, dequantize_int8(q, sc).double()  # exact in float32
    q, sz = quantize_int4(w, 128)
    sz = sz.to(torch.bfloat16)
    return q, sz, 128, dequantize_int4(q, sz, 128, torch.float64)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cuda_quantized_real_shapes(mode, batch):
    """int8 and int4 (group 128) weights at llama-3.1-8b's gate/up and down projections and
    its q/k/v launch (``qkv_store`` with the token's write), bf16, against the formula in
    float64 on the dequantized weights."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    for n_out, k_in, swiglu in LLAMA_LINEARS[1:3]:
        w = torch.randn((2 if swiglu else 1) * n_out, k_in, generator=g, device=dev) / k_in ** .5
        q, sc, group, w64 = quantized_weight(w, mode)
        x = torch.randn(batch, 1, k_in, generator=g, device=dev).to(dt)
        n = cuda_norm(k_in, g, dev, dt)
        out = kernels.linear(x, q, n.weight, n.eps, swiglu=swiglu, scales=sc, groupsize=group)
        assert_near(out, linear64(x, w64, n, swiglu), what=f"{mode} {n_out} x {k_in}")
    w = torch.randn((32 + 2 * 8) * 128, 4096, generator=g, device=dev) / 64
    q, sc, group, w64 = quantized_weight(w, mode)
    check_qkv_store_cuda(batch, g, q, w64, scales=sc, groupsize=group)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("method,budget", [("full", None), ("rocketkv", 64), ("sparq", 64),
                                           ("h2o", 64)])
def test_cuda_compiled_decode_with_every_kernel_equals_the_pytorch_path(method, budget):
    """``generate`` with the decode step compiled and captured in CUDA graphs, every kernel
    on (the dense ones writing the token, or a scratch for H2O; SparQ's selection over 600
    tokens in registers), gives the PyTorch path's greedy tokens (float32, a small random
    model). Its weights are N(0, 0.2), as the CPU tests' (``small_model``): the engine's
    N(0, 0.02) draws nearly uniform logits and attention, where summation order alone flips
    a greedy token or an eviction (the H200's first run of this test: H2O's tokens parted at
    the fourth, undecided between a tie and a fault)."""
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512,
                     vocab_size=1000, max_seq_len=1024)
    model = random_model(args, "cuda", torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    prompt = torch.randint(3, 1000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    runs = {}
    for mode in ("auto", "off"):
        kernels.set_mode(mode)
        torch._dynamo.reset()
        runs[mode] = generate(model, prompt, CacheRequest(method, budget), max_new_tokens=12,
                              step=StepConfig(compile=True))
    assert runs["auto"]["dense_kernels"] and not runs["off"]["fused_kernels"]
    assert runs["auto"]["token_ids"] == runs["off"]["token_ids"]


@interpreted
@pytest.mark.parametrize("method,fused,options", [
    *[pytest.param(m, False, {}, id=f"{m}-pytorch") for m in METHODS],
    *[pytest.param(m, True, {}, id=f"{m}-kernels") for m in (
        "full", "rocketkv", "hybrid", "quest", "exact_topk", "h2o")],
    pytest.param("sparq", True, {"sparq_reallocate": True}, id="sparq-kernels-reallocate"),
    *[pytest.param(m, "sparse", {}, id=f"{m}-sparse-kernels") for m in ("full", "rocketkv")]])
def test_a_replayed_step_decodes_as_the_eager_one(method, fused, options, few_programs):
    """``--compile-regime graphs`` captures the eager step once and replays it
    (``GraphStep``): every value that changes from step to step must live in a tensor the
    step reads, never in a Python value its kernels take. A traced first step replayed for
    the later ones gives the eager steps' logits exactly, through the kernels, through the
    sparse ones alone (``--kernels sparse``; the caches' own ``decode``, which
    ``bench_step.py --cuda-graphs`` captures) and through the PyTorch path (which
    ``--kernels off`` captures), for every method that compiles."""
    if fused == "sparse":
        kernels.set_dense(False)  # the autouse fixture restores it
    model = small_model("gqa")
    ref, caches = decode_logits(model, method, fused, steps=3, batch=1, **options)
    if not all(c.compilable for c in caches):
        pytest.skip(f"{method}'s decode step synchronizes with the host: it runs eagerly")
    out, _ = decode_logits(model, method, fused, steps=3, batch=1, replay=True, **options)
    assert torch.equal(out, ref), (out - ref).abs().amax(dim=(1, 2, 3))


# ---- launch knobs measured per GPU (kernels/tuned/) ------------------------------------


def test_a_tuned_table_gives_the_launch_knobs_on_the_gpu_it_names(tmp_path, monkeypatch):
    """``kernels/tuned/*.json``: the launch entries of the files naming this GPU give a launch
    its knobs (a later file over an earlier one); another GPU's file, a launch without an
    entry and CPU tensors keep the module's constants; the knobs shape the blocks and grid.
    (The files themselves: tests/test_tuning.py.)"""
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_tables", {})
    monkeypatch.setattr(tuning, "_names", {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    epi, quant = DENSE.EPI_SWIGLU, DENSE.QUANT_INT4
    key = DENSE.launch_key(epi, quant, 1, 4096, 14336)
    assert key == "swiglu/int4/M=1/K=4096/n=14336"
    assert DENSE.launch_key(epi, quant, 16, 4096, 14336) == "swiglu/int4/M=many/K=4096/n=14336"
    knobs = {"TARGET_PROGRAMS": 128, "MAX_BLOCK_N": 16, "K_BLOCK": 512, "NUM_WARPS": 8}

    def write(name, gpu, config):
        (tmp_path / name).write_text(json.dumps({"device": gpu, "launches": [
            {"key": key, "config": config, "us": 1.0}]}))

    write("a.json", "NVIDIA H100", dict(knobs, NUM_WARPS=2))
    write("b.json", "NVIDIA H100", knobs)  # later: it wins
    write("c.json", "NVIDIA H200", dict(knobs, K_BLOCK=64))
    gpu = torch.device("cuda")
    assert DENSE.launch_knobs(gpu, epi, quant, 1, 4096, 14336) == knobs
    assert DENSE.launch_knobs(gpu, epi, quant, 16, 4096, 14336) is None
    assert DENSE.launch_knobs(torch.device("cpu"), epi, quant, 1, 4096, 14336) is None
    # 14336 rows at about 128 programs, at most 16 rows a program: 896 programs
    assert DENSE.launch_config(epi, 1, 4096, 14336, knobs=knobs) == (1, 16, 512, (896, 1))
    assert DENSE.launch_config(epi, 1, 4096, 14336)[2] == DENSE.K_BLOCK_GEMV  # the constants


@interpreted
def test_a_launch_takes_its_tuned_knobs(monkeypatch):
    """The knobs ``launch_knobs`` gives reach the launch (its blocks and warps), and the
    result is still the formula's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 1, 48, generator=g), torch.randn(40, 48, generator=g) / 7
    knobs = {"TARGET_PROGRAMS": 2, "MAX_BLOCK_N": 16, "K_BLOCK": 16, "NUM_WARPS": 2}
    key = DENSE.launch_key(DENSE.EPI_PLAIN, DENSE.QUANT_NONE, 1, 48, 40)
    monkeypatch.setattr(DENSE, "tuned_table", lambda device: {key: knobs})
    seen = []
    config = DENSE.launch_config
    monkeypatch.setattr(DENSE, "launch_config", lambda *a: seen.append(config(*a)) or seen[-1])
    with torch.no_grad():
        out = kernels.linear(x, w)
    assert seen == [(1, 16, 16, (3, 1))]  # 40 rows, 16 a program; K in blocks of 16
    assert torch.allclose(out, F.linear(x, w), **tolerance(torch.float32))
