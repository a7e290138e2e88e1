"""kv_cache.py: attention helpers and the full cache against slow references."""

import math

import pytest
import torch

from rocketkv.cache import (
    FLEX_BLOCK,
    FullKVCache,
    attend,
    causal_attention,
    flex_prefix_attention,
    gather_tokens,
    prefix_attention,
)
from rocketkv.cache import attention as kv_attention
from rocketkv.compression import build_caches
from rocketkv.model import ConfigError, ModelArgs


def slow_attention(q, k, v, allowed):
    """Loop over batch, heads and queries; ``allowed(b, h, i, j)`` says whether query i sees j."""
    B, H, Tq, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // G], v[b, h // G]
            for i in range(Tq):
                js = [j for j in range(k.shape[2]) if allowed(b, h, i, j)]
                s = torch.stack([q[b, h, i] @ kh[j] / math.sqrt(D) for j in js])
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[n] * vh[j] for n, j in enumerate(js))
    return out


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
def test_causal_attention_matches_loop(H, Hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, 9, 8, generator=g)
    k, v = torch.randn(2, 2, Hkv, 9, 8, generator=g)
    ref = slow_attention(q, k, v, lambda b, h, i, j: j <= i)
    assert torch.allclose(causal_attention(q, k, v), ref, atol=1e-5)


@pytest.mark.parametrize("start", [1, 5, 8])
@pytest.mark.parametrize("mask_elements,flash", [(1 << 26, False), (50, False), (0, True)])
def test_causal_attention_of_a_query_block(start, mask_elements, flash, monkeypatch):
    """Queries start..8 over keys 0..8: the causal diagonal sits at the bottom right. Masked
    path in one block and one query row per block; the CPU flash path (two passes merged)."""
    monkeypatch.setattr(kv_attention, "MASK_ELEMENTS", mask_elements or 1 << 26)
    monkeypatch.setattr(kv_attention, "CPU_FLASH_PREFILL", flash)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = torch.randn(2, 2, 2, 9, 8, generator=g)
    ref = slow_attention(q, k, v, lambda b, h, i, j: j <= i)[:, :, start:]
    assert torch.allclose(causal_attention(q[:, :, start:], k, v, start), ref, atol=1e-5)
    with pytest.raises(ValueError, match="got 9"):
        causal_attention(q[:, :, start:], k, v, start - 1)


def masked_reference(q, k, v, start):
    """Explicit (Tq, S) boolean mask, K/V repeated per query head, float64 softmax."""
    G = q.shape[1] // k.shape[1]
    kr, vr = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keys, rows = torch.arange(k.shape[2]), torch.arange(start, start + q.shape[2])
    s = s.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
    return s.softmax(-1) @ vr


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("start", [0, 1, 23, 61])
def test_cpu_flash_prefill_chunk_matches_explicit_mask(start, dtype, atol, monkeypatch):
    """A prefill chunk at ``start`` through the CPU flash kernel (prefix without a mask plus
    the chunk causally, merged by log-sum-exp) equals masked attention: GQA (6 query heads
    on 2 KV heads), batch 2, 37 queries, queries transposed from (B, T, H, D) and keys a
    slice of a longer buffer, as the model and the caches pass them. No SDPA call with a
    mask (the math kernel) may run."""

    monkeypatch.setattr(kv_attention, "CPU_FLASH_PREFILL", True)

    def no_sdpa(*a, **kw):
        raise AssertionError("SDPA called: the flash path did not run")

    monkeypatch.setattr(kv_attention.F, "scaled_dot_product_attention", no_sdpa)
    g = torch.Generator().manual_seed(3)
    Tq, D = 37, 16
    q = torch.randn(2, Tq, 6, D, generator=g).to(dtype).transpose(1, 2)
    k_buf, v_buf = torch.randn(2, 2, 2, 130, D, generator=g).to(dtype)
    k, v = k_buf[:, :, :start + Tq], v_buf[:, :, :start + Tq]
    out = causal_attention(q, k, v, start)
    assert out.shape == q.shape and out.dtype == dtype
    ref = masked_reference(q, k, v, start)
    assert torch.allclose(out.double(), ref, atol=atol), (out.double() - ref).abs().max()


def test_attend_with_mask_matches_loop():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 2, 2, 12, 8, generator=g)
    mask = torch.arange(12) <= 6
    ref = slow_attention(q, k, v, lambda b, h, i, j: j <= 6)
    assert torch.allclose(attend(q, k, v, mask), ref, atol=1e-5)


def tiny_args(**kw):
    return ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48,
                     vocab_size=50, max_seq_len=64, **kw)


def test_full_cache_decode_equals_attention_over_everything_so_far():
    args = tiny_args()
    cache = FullKVCache(0, args, 1, torch.float32, "cpu", max_seq_len=20)
    g = torch.Generator().manual_seed(0)
    T = 7
    q = torch.randn(1, 4, 20, 8, generator=g)
    k, v = torch.randn(2, 1, 2, 20, 8, generator=g)
    out = cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    assert torch.allclose(out, slow_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T],
                                              lambda b, h, i, j: j <= i), atol=1e-5)
    for t in range(T, 20):
        out = cache.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                           torch.tensor([t]))
        ref = slow_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1],
                             lambda b, h, i, j: True)
        assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_cache_bytes(dtype):
    args = tiny_args()
    caches = build_caches("full", args, batch_size=3, prompt_len=10, max_new_tokens=6,
                          budget=None, dtype=dtype, device="cpu")
    assert len(caches) == args.n_layers
    per_layer = 2 * 3 * args.n_kv_heads * 16 * args.head_dim * (4 if dtype == torch.float32
                                                                  else 2)
    assert all(c.allocated_bytes() == per_layer for c in caches)
    assert all(c.bytes_read_per_step() == per_layer for c in caches)


def test_build_caches_rejects_unknown_method_and_bad_budget():
    with pytest.raises(ConfigError, match="unknown method"):
        build_caches("snapkv2", tiny_args(), batch_size=1, prompt_len=4, max_new_tokens=4,
                     budget=8, dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="positive"):
        build_caches("full", tiny_args(), batch_size=1, prompt_len=4, max_new_tokens=4,
                     budget=0, dtype=torch.float32, device="cpu")


def test_flex_decode_attention_merges_whole_blocks_and_the_written_tail():
    """``flex_prefix_attention`` (FlexAttention over the wholly written key blocks, the block
    holding the last slot attended exactly, the two merged by log-sum-exp) equals the loop
    reference at block edges: no whole block (last < FLEX_BLOCK), last at a block's first and
    final slot, a buffer that is not a multiple of the block. Run eagerly: inductor's CPU flex
    kernel has no log-sum-exp output; the CUDA test below compiles it and poisons the blocks it
    must not read."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D = 2, 8, 2, 16
    q = torch.randn(B, H, 1, D, generator=g)
    for S, lasts in ((300, (0, 127, 128, 255, 299)), (520, (400,))):
        k, v = torch.randn(2, B, Hkv, S, D, generator=g)
        for last in lasts:
            out = flex_prefix_attention(q, k, v, torch.tensor([last]))
            ref = slow_attention(q[:1], k[:1], v[:1], lambda b, h, i, j, n=last: j <= n)
            assert torch.allclose(out[:1], ref, atol=1e-5), (S, last)
            assert torch.allclose(out, prefix_attention(q, k, v, torch.arange(S) <= last),
                                  atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (the GPU machine)")
@pytest.mark.parametrize("H,Hkv", [(32, 8), (8, 8)])
def test_cuda_prefill_block_takes_flash_with_the_lower_right_mask(H, Hkv):
    """On CUDA a later prefill block (``start > 0``) with GQA runs SDPA's flash kernel with
    the lower-right causal mask (no mask tensor), and matches the explicit-mask path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rocketkv.cache import _flash_available

    g = torch.Generator(device="cuda").manual_seed(0)
    B, D, start, Tq = 1, 128, 700, 300
    q = torch.randn(B, H, Tq, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, B, Hkv, start + Tq, D, generator=g, device="cuda",
                       dtype=torch.bfloat16)
    assert _flash_available(q, k, v, H != Hkv)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take it
        flash = causal_attention(q, k, v, start)
    mask = torch.arange(start + Tq, device="cuda") <= \
        torch.arange(start, start + Tq, device="cuda")[:, None]
    explicit = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=H != Hkv)
    assert torch.allclose(flash.float(), explicit, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (the GPU machine)")
def test_cuda_compiled_decode_attention_matches_eager():
    """The flex decoding path under CUDA graphs (llama-3.1-8b head shapes, bf16) equals the
    eager formula as positions advance inside one captured graph."""
    torch._dynamo.reset()
    S = 4096 + 64

    def attend_written(q, k, v, pos):  # the position is the graph's input, as in decode
        return prefix_attention(q, k, v, torch.arange(S, device=pos.device) <= pos)

    step = torch.compile(attend_written, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 8, S, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([0], device="cuda")
    for last in (4000, 4037, 0, 127, 128, 255, 1000, S - 1):
        pos.fill_(last)  # in place: the captured graph reads this tensor
        end = (last // FLEX_BLOCK + 1) * FLEX_BLOCK  # the end of the block holding last
        kn, vn = k.clone(), v.clone()
        kn[:, :, end:], vn[:, :, end:] = float("nan"), float("nan")  # never to be read
        out = step(q, kn, vn, pos).clone()
        ref = attend_written(q.float(), k.float(), v.float(), pos)
        assert torch.allclose(out.float(), ref, atol=2e-2), last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_tokens_picks_each_heads_rows(dtype):
    """The CPU row path (index_select on the flattened cache) against a loop, and a
    non-contiguous cache (the element-wise path)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 17, 8, generator=g).to(dtype)
    idx = torch.randint(0, 17, (2, 3, 5), generator=g)
    expect = torch.stack([torch.stack([x[b, h, idx[b, h]] for h in range(3)])
                          for b in range(2)])
    assert torch.equal(gather_tokens(x, idx), expect)
    wide = torch.randn(2, 3, 17, 16, generator=g).to(dtype)[..., ::2]  # strided rows
    expect = torch.stack([torch.stack([wide[b, h, idx[b, h]] for h in range(3)])
                          for b in range(2)])
    assert not wide.is_contiguous() and torch.equal(gather_tokens(wide, idx), expect)


def aten_ops_of(fn):
    """The ops (``namespace::name``) ``fn()`` dispatches at the top level (a fused kernel's
    custom op counts as one; what runs inside it is not seen)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(f"{func.namespace}::{func.overloadpacket.__name__}")
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return names


@pytest.mark.parametrize("method", ["full", "exact_topk", "quest", "sparq", "hybrid",
                                    "rocketkv"])
def test_a_kernel_step_builds_no_mask_of_written_slots(method):
    """Issue 45 item 5: where the kernels run, the eager step builds nothing it does not use.
    The mask of written slots (``arange(S) <= pos``) is the PyTorch path's: a step through
    the kernels (forced, in Triton's interpreter) dispatches no ``arange`` and no ``le``, so
    the CUDA-graphs regime launches what the compiled step does. The PyTorch path still
    builds it (the counter sees it)."""
    from rocketkv import kernels

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8,
                     vocab_size=10, max_seq_len=512)  # head dim 16: the kernels' smallest
    T = 120
    cache = build_caches(method, args, batch_size=1, prompt_len=T, max_new_tokens=4,
                         budget=None if method == "full" else 40, dtype=torch.float32,
                         device="cpu", **({"window": 8} if "snapkv" in method or
                                          method == "rocketkv" else {}))[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T + 1, 16, generator=g) for h in (4, 2, 2))
    cache.prefill(q[:, :, :T], k[:, :, :T], v[:, :, :T])
    pos = torch.tensor([T])
    store = cache.token_store(pos)  # the token written as the dense kernels would
    store.k_cache.index_copy_(2, pos - (0 if store.offset is None else store.offset),
                              k[:, :, T:])
    store.v_cache.index_copy_(2, pos - (0 if store.offset is None else store.offset),
                              v[:, :, T:])
    step = q[:, :, T:]
    previous = kernels.set_mode("force")
    try:
        fused = aten_ops_of(lambda: cache.attend_stored(step, pos))
    finally:
        kernels.set_mode("off")
    try:
        plain = aten_ops_of(lambda: cache.attend_stored(step, pos))
    finally:
        kernels.set_mode(previous)
    assert "aten::arange" in plain and "aten::le" in plain
    assert "aten::arange" not in fused and "aten::le" not in fused, fused
    assert any(n.startswith("rocketkv::") for n in fused)  # the kernels ran
