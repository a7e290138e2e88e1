"""quantize.py: int8/int4 weight-only quantization against slow references, checkpoints that every
script loads, every KV method on a quantized model, SmolLM2 fidelity, and bad input."""

import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ESSAYS, ROOT, SMOLLM2_GGUF, shared_file, sigint_default

from rocketkv import kernels, quantized
from rocketkv.compression import METHODS
from rocketkv.engine.generate import CacheRequest, StepConfig, generate
from rocketkv.engine.measure import weight_bytes, weight_bytes_per_step
from rocketkv.formats.checkpoint import check_int8_activations, load_model, random_model
from rocketkv.model import ConfigError, ModelArgs
from rocketkv.quantized import (
    QUANT_CONFIG,
    Int4Linear,
    Int8Linear,
    check_quantizable,
    dequantize_int4,
    dequantize_int8,
    kernel_dtype,
    quantize_int4,
    quantize_int8,
    quantize_model,
    quantized_linears,
    unpack_int4,
    use_int8_activations,
)

TINY = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256,
                 vocab_size=512, max_seq_len=1024, name="tiny")


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] = 0.0  # a constant row (and groups): scale must not divide by zero
    w[5, :7] = 1.5  # an outlier
    return w


# ---- quantization arithmetic against slow loops ------------------------------------------


def test_int8_is_symmetric_per_output_channel():
    w = _weights(24, 40)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (24,)
    for o in range(24):  # slow reference, one row at a time
        amax = max(abs(float(v)) for v in w[o])
        scale = max(amax / 127, 1e-12)
        assert s[o].item() == pytest.approx(scale, rel=1e-6)
        expect = [max(-127, min(127, round(float(v) / scale))) for v in w[o]]
        assert q[o].tolist() == expect
    err = (dequantize_int8(q, s) - w).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all()
    assert q.abs().amax(dim=1)[w.abs().amax(dim=1) > 0].eq(127).all()


@pytest.mark.parametrize("groupsize", [32, 64])
def test_int4_groups_match_a_slow_loop(groupsize):
    n, k = 16, 128
    w = _weights(n, k, seed=1)
    packed, sz = quantize_int4(w, groupsize)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert sz.shape == (k // groupsize, n, 2)
    q = unpack_int4(packed)
    for o in range(n):
        for gi in range(k // groupsize):
            group = [float(v) for v in w[o, gi * groupsize:(gi + 1) * groupsize]]
            lo, hi = min(group), max(group)
            scale = max((hi - lo) / 15, 1e-12)
            assert sz[gi, o, 0].item() == pytest.approx(scale, rel=1e-5)
            assert sz[gi, o, 1].item() == pytest.approx(lo + 8 * scale, rel=1e-5, abs=1e-7)
            expect = [max(0, min(15, round((v - lo) / scale))) for v in group]
            got = q[o, gi * groupsize:(gi + 1) * groupsize].tolist()
            assert sum(a != b for a, b in zip(got, expect)) <= 1  # float rounding at .5 ties
    # nibble order: the even column in the high nibble
    assert ((packed[:, 0] >> 4).int() == q[:, 0]).all() and ((packed[:, 0] & 15).int()
                                                              == q[:, 1]).all()
    deq = dequantize_int4(packed, sz, groupsize)
    scale = sz[..., 0].t().repeat_interleave(groupsize, dim=1)
    assert ((deq - w).abs() <= scale / 2 + 1e-6).all()


def test_groupsize_that_does_not_divide_names_the_layer():
    with pytest.raises(ConfigError, match="does not divide the input width 576 .*one of 32, 64"):
        quantize_int4(torch.zeros(8, 576), 128)
    stories = ModelArgs.from_name("stories260K")  # w2's input is 172 wide
    with pytest.raises(ConfigError, match="172 of layers.*feed_forward.w2 .*use int8"):
        check_quantizable(stories, "int4", 32)
    with pytest.raises(ConfigError, match="applies to int4 only"):
        check_quantizable(stories, "int8", 32)
    with pytest.raises(ConfigError, match="unknown --mode"):
        check_quantizable(stories, "int2", None)
    with pytest.raises(ConfigError, match="--classifier must be one of"):
        check_quantizable(ModelArgs.from_name("llama-2-7b"), "int8", None, "int2")
    llama = ModelArgs.from_name("llama-2-7b")
    check_quantizable(llama, "int4", 256)


def test_classifier_storage_choices():
    a = TINY
    int8 = quantized_linears(a, "int4", "int8")
    assert int8["output"] == "int8" and int8["layers.1.feed_forward.w2"] == "int4"
    assert quantized_linears(a, "int4", "same")["output"] == "int4"
    assert "output" not in quantized_linears(a, "int4", "float")
    assert len(quantized_linears(a, "int8", "float")) == 4 * a.n_layers  # wqkv wo w13 w2


# ---- quantized linears against dequantize-then-matmul -------------------------------------


def _reference(x, w_deq, kd):
    """The product the kernels compute: input rounded to the kernel dtype, weights as stored
    in that dtype, accumulated in float32."""
    return F.linear(x.to(kd).float(), w_deq.float())


def _close(y, ref):
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=1.5e-2 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("width", [128, 40, 172])  # 40, 172: widths the CPU kernel gets wrong
def test_int8_linear_matches_dequantized_matmul(dtype, rows, width):
    w = _weights(96, width)
    q, s = quantize_int8(w)
    layer = Int8Linear(q, s, dtype)
    kd = kernel_dtype(torch.device("cpu"), dtype)
    assert layer.scales.dtype == kd
    x = torch.randn(2, rows, width).to(dtype)
    y = layer(x)
    assert y.shape == (2, rows, 96) and y.dtype == dtype
    kernel = rows == 1 and width % 16 == 0
    ref = _reference(x, dequantize_int8(q, layer.scales.float()), kd if kernel else dtype)
    _close(y, ref)
    assert (y.float() - F.linear(x.float(), w)).abs().max() > 0  # it is quantized
    torch.testing.assert_close(layer.forward_rows(x, 32, 80), y[..., 32:80])


def test_int8_weight_off_64_byte_alignment_takes_the_dense_path():
    """An int8 weight whose storage is not 64-byte aligned (memory-mapped from a checkpoint
    file) must not reach torch's CPU int8 kernel, which segfaults on it (torch 2.13): the
    layer gives the dequantized product instead."""
    q, s = quantize_int8(_weights(64, 64))
    layer = Int8Linear(q, s, torch.bfloat16)
    buf = torch.empty(q.numel() + 64, dtype=torch.int8)
    off = (60 - buf.data_ptr()) % 64  # 60 bytes past a 64-byte boundary
    layer.weight = torch.nn.Parameter(buf[off:off + q.numel()].view_as(q).copy_(q),
                                      requires_grad=False)
    assert layer.weight.data_ptr() % 64 == 60
    x = torch.randn(1, 16, 64).to(torch.bfloat16)
    ref = _reference(x, dequantize_int8(q, layer.scales.float()), torch.bfloat16)
    _close(layer(x), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groupsize", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 40])
def test_int4_linear_matches_dequantized_matmul(dtype, groupsize, rows):
    w = _weights(192, 256, seed=2)
    packed, sz = quantize_int4(w, groupsize)
    layer = Int4Linear(packed, sz, groupsize, "cpu", dtype)
    assert layer.layout == "cpu" and layer.weight.numel() * layer.weight.element_size() \
        == 192 * 256 // 2
    kd = kernel_dtype(torch.device("cpu"), dtype)
    x = torch.randn(rows, 256).to(dtype)
    y = layer(x)
    assert y.shape == (rows, 192) and y.dtype == dtype
    _close(y, _reference(x, dequantize_int4(packed, sz, groupsize, kd), kd))
    # rows: whole 64-row blocks are sliced, anything else computed whole and sliced
    for start, stop in [(0, 128), (128, 192), (64, 192), (0, 100), (70, 130)]:
        torch.testing.assert_close(layer.forward_rows(x, start, stop), y[:, start:stop])


# llama-3.1-8b's linear shapes (out, in): wqkv, wo, w13 (gate and up fused), w2
LLAMA8B_LINEARS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (the GPU machine)")
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("shape", LLAMA8B_LINEARS)
@pytest.mark.parametrize("rows", [1, 300])  # a decode step, a prefill chunk
def test_cuda_kernels_match_dequantized_matmul(mode, shape, rows):
    """The CUDA paths at the real shapes, eager (and compiled for a decode step): int8
    (``F.linear`` on the int8 weight cast to bfloat16, times the scales; compiled, one kernel
    reading int8) and int4, groups of 128 and 32: tinygemm ``_weight_int4pack_mm`` where the
    dense decode kernels are off, and the stored nibbles (dequantized here; the kernels read
    them in the decode step, test_dense_kernels) where they run; each against a float32
    matmul of the dequantized weights."""
    w = _weights(*shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to("cuda", torch.bfloat16)
    layouts = {"cuda": False, "nibbles": True}  # the layout, whether the dense kernels run
    cases = [(None, None)] if mode == "int8" else [(g, k) for g in (128, 32) for k in layouts]
    for groupsize, layout in cases:
        if mode == "int8":
            q, s = quantize_int8(w)
            layer = Int8Linear(q.cuda(), s, torch.bfloat16)
            deq = dequantize_int8(q, layer.scales.float().cpu())
        else:
            packed, sz = quantize_int4(w, groupsize)
            dense = kernels.set_dense(layouts[layout])
            try:
                layer = Int4Linear(packed, sz, groupsize, "cuda", torch.bfloat16)
            finally:
                kernels.set_dense(dense)
            assert layer.layout == (layout if kernels.ops() is not None else "cuda")
            deq = dequantize_int4(packed, sz, groupsize, torch.bfloat16)
        ref = F.linear(x.float(), deq.float().cuda())
        torch._dynamo.reset()  # each case's layer compiles afresh (the recompile limit is 8)
        compiled = (torch.compile(layer, fullgraph=True),) if rows == 1 else ()
        for f in (layer, *compiled):
            y = f(x)
            assert y.shape == (rows, shape[0]) and y.dtype == torch.bfloat16
            _close(y, ref)
        assert (ref - F.linear(x.float(), w.cuda())).abs().max() > 0  # it is quantized
        # the first 1024 output rows alone: another GEMM shape, another summation order
        # (cuBLAS), so equal within bfloat16's rounding of the whole output's scale
        whole = layer(x)[:, :1024].float()
        torch.testing.assert_close(layer.forward_rows(x, 0, 1024).float(), whole, rtol=0,
                                   atol=2**-7 * whole.abs().max().item())


def test_int4_layer_the_cpu_kernel_cannot_take_is_dequantized():
    w = _weights(40, 64, seed=3)  # 40 output features: not a multiple of 16
    packed, sz = quantize_int4(w, 32)
    layer = Int4Linear(packed, sz, 32, "cpu", torch.bfloat16)
    assert layer.layout == "nibbles"
    x = torch.randn(3, 64).bfloat16()
    _close(layer(x), _reference(x, dequantize_int4(packed, sz, 32, torch.bfloat16),
                                torch.bfloat16))
    torch.testing.assert_close(layer.forward_rows(x, 8, 30), layer(x)[:, 8:30])


# ---- whole models ---------------------------------------------------------------------------


def _prompt(n, vocab=512, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_quantized():
    """TINY with random weights, int8 and int4-g32 (float32 activations)."""
    out = {}
    for mode, g in [("int8", None), ("int4", 32)]:
        out[mode] = quantize_model(random_model(TINY, "cpu", torch.float32), mode, g)
    return out


def test_quantized_model_reads_the_bytes_of_its_formats(tiny_quantized):
    a = TINY
    D = a.head_dim
    shapes = [((a.n_heads + 2 * a.n_kv_heads) * D, a.dim), (a.dim, a.n_heads * D),
              (a.intermediate_size, a.dim), (a.dim, a.intermediate_size),
              (a.intermediate_size, a.dim)] * a.n_layers
    norms = (2 * a.n_layers + 1) * a.dim * 4
    emb = a.vocab_size * a.dim * 4
    head = a.vocab_size * a.dim + a.vocab_size * 2  # the classifier in int8 (the default)
    int8 = sum(n * k + n * 2 for n, k in shapes) + head  # int8 weights + bfloat16 scales
    int4 = sum(n * k // 2 + (k // 32) * n * 2 * 2 for n, k in shapes) + head  # + scale/zero
    for mode, linear_bytes in (("int8", int8), ("int4", int4)):
        m = tiny_quantized[mode]
        assert weight_bytes_per_step(m) == linear_bytes + norms  # the embedding is gathered
        assert weight_bytes(m) == linear_bytes + norms + emb
        assert m.quantization["mode"] == mode


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_kv_method_runs_on_a_quantized_model(tiny_quantized, mode):
    model = tiny_quantized[mode]
    prompt = _prompt(300)
    m = 8
    full = generate(model, prompt, CacheRequest("full"), max_new_tokens=m)["token_ids"]
    for method in METHODS:
        if not METHODS[method].budgeted:
            r = generate(model, prompt, CacheRequest(method), max_new_tokens=m)
            assert r["token_ids"] == full, method
            continue
        covering = generate(model, prompt, CacheRequest(method, 300 + m), max_new_tokens=m)
        assert covering["token_ids"] == full, method
        r = generate(model, prompt, CacheRequest(method, 96), max_new_tokens=m)
        assert len(r["token_ids"][0]) == m, method
        if r["method_params"].get("sparse_layers") == 0:  # omnikv: too few layers to have any
            assert r["kv_bytes_per_step"] >= covering["kv_bytes_per_step"]
        else:
            assert r["kv_bytes_per_step"] < covering["kv_bytes_per_step"], method


# ---- int8 activations (W8A8 on the CPU, fbgemm) ------------------------------------------


def _w8a8_reference(x, q, w_scales, qmax):
    """W8A8 as ``quantized._int8_dynamic_linear`` documents it, row by row: the row mapped
    onto [-1, 1] by its range (mid, half), quantized on the grid of [-1, 1] (times the float32
    inverse of the step 2 / qmax, rounded half to even, as fbgemm does; the zero point
    cancels), the integer dot products with the int8 weight times the grid's step, the
    weight's scales and half, plus mid times the dequantized weight's row sums."""
    step = 2.0 / qmax
    inv = 1 / torch.tensor(step, dtype=torch.float32)
    w = q.double() * w_scales.float().double()[:, None]
    out = []
    for r in x.float():
        lo, hi = r.min(), r.max()
        mid, half = (hi + lo) * 0.5, ((hi - lo) * 0.5).clamp(min=torch.finfo(torch.float32).tiny)
        xq = torch.round(((r - mid) / half) * inv)
        dots = xq.double() @ q.double().t()
        out.append((half.double() * step * w_scales.float().double() * dots
                    + mid.double() * w.sum(1)).float())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_quantize_each_row_on_its_own(dtype):
    """Every input, decode or prefill: each row quantized to 8 bits across its own range
    (the slow reference), a row's result the same alone as among others;
    the packed copy replaces the int8 weight (one copy held, counted by weight_bytes)."""
    q, s = quantize_int8(_weights(96, 128))
    layer = Int8Linear(q, s, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 128, generator=g)
    x[1, 5] = 9.0  # an outlier widens its row's step only
    x[2] = x[2].abs() + 3.0  # a row far from 0: its grid spans its range, not [0, max]
    x = x.to(dtype)
    prefill = torch.randn(quantized.KERNEL_ROWS + 4, 128, generator=g).to(dtype)
    weight_only, weight_only_prefill = layer(x), layer(prefill)
    assert use_int8_activations(torch.nn.Sequential(layer)) == 1 and layer.int8_activations
    assert not hasattr(layer, "weight") and layer.packed_bytes == 96 * (128 + 2 + 12)
    y = layer(x)
    qmax = 127 if quantized._reduce_range() else 255
    for inp, got, dense in ((x, y, weight_only), (prefill, layer(prefill), weight_only_prefill)):
        ref = _w8a8_reference(inp, q, layer.scales, qmax).to(dtype).float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:  # bfloat16 inputs land on rounding ties, which fbgemm's float32 arithmetic may
            # break the other way: a few outputs one activation step (2 / qmax of c) apart
            off = (got.float() - ref).abs()
            assert (off > 1e-5).float().mean() < 0.1 and off.max() < 0.02
        assert (got.float() - dense.float()).abs().max() > 1e-3  # the activations are rounded
    for i in range(3):
        assert torch.equal(layer(x[i:i + 1]), y[i:i + 1])
        assert torch.equal(layer(torch.cat([prefill, x[i:i + 1]]))[-1:], y[i:i + 1])
    assert torch.equal(layer.forward_rows(x, 10, 30), y[:, 10:30])


def test_int8_activations_decode_compiles_and_equals_eager():
    model = quantize_model(random_model(TINY, "cpu", torch.float32), "int8")
    assert use_int8_activations(model) == 4 * TINY.n_layers + 1  # the layers and the classifier
    assert model.quantization["activations"] == "int8"
    prompt = _prompt(120, seed=3)
    eager = generate(model, prompt, CacheRequest("full"), max_new_tokens=5)
    compiled = generate(model, prompt, CacheRequest("full"), max_new_tokens=5,
                        step=StepConfig(compile=True))
    assert compiled["compiled"] and compiled["token_ids"] == eager["token_ids"]


def test_int8_activations_run_on_the_cpu_only():
    with pytest.raises(ConfigError, match="CPU only"):
        check_int8_activations("cuda")
    with pytest.raises(ConfigError, match="CPU only"):  # before anything loads
        load_model("no/such/file.gguf", "cuda", torch.float32, gguf_weights="quantized-w8a8")


def test_quantized_decode_compiles_and_equals_eager(tiny_quantized):
    model = tiny_quantized["int4"]
    prompt = _prompt(200, seed=1)
    eager = generate(model, prompt, CacheRequest("rocketkv", 64), max_new_tokens=6)
    compiled = generate(model, prompt, CacheRequest("rocketkv", 64), max_new_tokens=6,
                        step=StepConfig(compile=True))
    assert compiled["compiled"] and compiled["token_ids"] == eager["token_ids"]


def _run(*argv, cwd=None):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          cwd=cwd or ROOT)


def _main(capsys, *argv):
    """quantize.py's main in this process (the CLI path without a second torch import):
    (exit status, stdout, stderr)."""
    from rocketkv.cli.quantize import main

    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_checkpoint_loads_as_the_in_memory_quantization(tmp_path, capsys):
    out = tmp_path / "q"
    rc, stdout, err = _main(capsys, "--checkpoint", "random:stories260K", "--mode", "int8",
                            "--dtype", "float32", "--out", out, "--no-progress")
    assert rc == 0 and stdout == f"wrote {out}\n", err
    cfg = json.loads((out / QUANT_CONFIG).read_text())
    assert cfg["mode"] == "int8" and cfg["groupsize"] is None
    assert cfg["linears"]["output"] == "int8" and cfg["classifier"] == "int8"
    loaded = load_model(str(out), "cpu", torch.float32)
    assert loaded.quantization["mode"] == "int8"
    assert isinstance(loaded.layers[0].attention.wqkv, Int8Linear)
    assert loaded.output.weight is not loaded.tok_embeddings.weight  # tie broken
    ref = quantize_model(load_model("random:stories260K", "cpu", torch.float32), "int8")
    prompt = _prompt(100)
    a = generate(loaded, prompt, CacheRequest("full"), max_new_tokens=8)
    b = generate(ref, prompt, CacheRequest("full"), max_new_tokens=8)
    assert a["token_ids"] == b["token_ids"]
    assert a["weight_bytes_per_step"] == b["weight_bytes_per_step"]
    r = _run("generate.py", "--checkpoint", str(out), "--random-prompt", "40",
             "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def bad_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


@pytest.mark.parametrize("case,argv,message", [
    ("mode", ["--checkpoint", "random:stories260K", "--mode", "int3"], "invalid choice"),
    ("groupsize", ["--checkpoint", "random:stories260K", "--mode", "int4", "--groupsize", "32"],
     "does not divide the input width 172"),
    ("int8-group", ["--checkpoint", "random:stories260K", "--mode", "int8", "--groupsize", "64"],
     "applies to int4 only"),
    ("int4-nogroup", ["--checkpoint", "random:stories260K", "--mode", "int4"],
     "needs --groupsize"),
    ("cuda", ["--checkpoint", "random:stories260K", "--mode", "int8", "--device", "cuda"],
     "CUDA is not available"),
    ("missing", ["--checkpoint", "no/such/dir", "--mode", "int8"], "checkpoint not found"),
])
def test_cli_bad_input_one_line_exit_2_nothing_written(bad_dir, capsys, case, argv, message):
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = bad_dir / case
    if case == "groupsize":  # one case as a real process, the rest in this one
        r = _run("quantize.py", *argv, "--out", str(out), "--no-progress")
        rc, err = r.returncode, r.stderr
    else:
        with pytest.raises(SystemExit) if case == "mode" else contextlib.nullcontext() as ex:
            rc, _, err = _main(capsys, *argv, "--out", out, "--no-progress")
        if case == "mode":
            rc, err = ex.value.code, capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error:") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and not any(p.name.startswith(".") for p in bad_dir.iterdir())


def test_cli_checks_the_output_location_before_any_work(tmp_path, capsys, monkeypatch):
    """--out under a file, or in a directory it cannot write (os.access patched: root writes
    through permissions): one line, before the checkpoint is read."""
    from rocketkv.formats import checkpoint

    def read(*a, **kw):
        raise AssertionError("the checkpoint was read before the output was checked")

    monkeypatch.setattr("rocketkv.cli.quantize.read_checkpoint", read)
    (tmp_path / "file.txt").write_text("x")
    rc, _, err = _main(capsys, "--checkpoint", "random:stories260K", "--mode", "int8",
                       "--out", tmp_path / "file.txt" / "out")
    assert rc == 2 and "is not a directory" in err and len(err.strip().splitlines()) == 1
    real = checkpoint.os.access
    monkeypatch.setattr(checkpoint.os, "access", lambda p, mode: False if mode & checkpoint.os.W_OK
                        else real(p, mode))
    rc, _, err = _main(capsys, "--checkpoint", "random:stories260K", "--mode", "int8",
                       "--out", tmp_path / "new" / "out")
    assert rc == 2 and "not writable" in err and not (tmp_path / "new").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_cli_refuses_an_output_the_filesystem_refuses_before_any_work(capsys, monkeypatch):
    """/proc passes os.access for root but takes no new directory: one line, exit 2, before
    the checkpoint is read (it used to quantize for 25 s and then print a traceback)."""
    def read(*a, **kw):
        raise AssertionError("the checkpoint was read before the output was checked")

    monkeypatch.setattr("rocketkv.cli.quantize.read_checkpoint", read)
    rc, _, err = _main(capsys, "--checkpoint", "random:stories260K", "--mode", "int8",
                       "--out", "/proc/rocketkv-out")
    assert rc == 2 and err.startswith("error: --out /proc/rocketkv-out: cannot create")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_default_output_is_in_the_current_directory_not_beside_the_source(tmp_path,
                                                                            monkeypatch):
    from rocketkv.cli.quantize import default_out

    src = tmp_path / "models" / "m.Q4_1.gguf"
    src.parent.mkdir()
    src.write_bytes(b"")
    assert default_out(str(src), "int4", 32) == Path("m.Q4_1-int4-g32")
    assert default_out(str(tmp_path / "models"), "int8", None) == Path("models-int8")
    assert default_out("random:stories260K", "int8", None) == \
        Path("checkpoints/random-stories260K-int8")


def test_ctrl_c_in_quantize_is_one_line_and_leaves_nothing(tmp_path):
    """SIGINT while the SmolLM2 checkpoint is quantized: exit 130, one error line, neither the
    output directory nor its temporary sibling left behind."""
    import os
    import select
    import signal
    import time

    out = tmp_path / "q"
    proc = subprocess.Popen([sys.executable, "quantize.py", "--checkpoint",
                             str(shared_file(SMOLLM2_GGUF)), "--mode", "int4", "--groupsize",
                             "32", "--out", str(out)],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            preexec_fn=sigint_default)
    seen, deadline = b"", time.time() + 120
    while b"quantize int4" not in seen and time.time() < deadline:  # the progress bar
        if select.select([proc.stderr], [], [], 1.0)[0]:
            seen += os.read(proc.stderr.fileno(), 4096)
    assert b"quantize int4" in seen, seen
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.decode().replace("\r", "\n").splitlines()
             if ln.startswith("error")]
    assert proc.returncode == 130 and lines == ["error: interrupted; nothing was written"]
    assert b"Traceback" not in err and list(tmp_path.iterdir()) == []


def test_cli_refuses_a_quantized_source_and_a_used_out_dir(tmp_path, capsys):
    src = tmp_path / "src"
    assert _main(capsys, "--checkpoint", "random:stories260K", "--mode", "int8", "--out", src,
                 "--no-progress")[0] == 0
    rc, _, err = _main(capsys, "--checkpoint", src, "--mode", "int8", "--out",
                       tmp_path / "again")
    assert rc == 2 and "already quantized" in err
    assert not (tmp_path / "again").exists()
    rc, _, err = _main(capsys, "--checkpoint", "random:stories260K", "--mode", "int8", "--out",
                       src)
    assert rc == 2 and "not an empty directory" in err


# ---- SmolLM2: the real checkpoint -----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_int8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "smollm2-int8"
    r = _run("quantize.py", "--checkpoint", str(shared_file(SMOLLM2_GGUF)), "--mode", "int8",
             "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    return out


def test_smollm2_quantized_checkpoint_keeps_its_tokenizer_and_chat(smollm2_int8_dir, tmp_path):
    from rocketkv.formats.tokenizer import load_tokenizer

    src, dst = load_tokenizer(SMOLLM2_GGUF), load_tokenizer(smollm2_int8_dir)
    text = "The hidden code is 1679215. What is it?"
    assert dst.encode(text) == src.encode(text)
    assert dst.encode_chat(text) == src.encode_chat(text)
    assert dst.chat_stop_ids == src.chat_stop_ids and dst.stop_ids == src.stop_ids
    prompt = tmp_path / "p.txt"
    prompt.write_text("Name a colour.")
    r = _run("generate.py", "--checkpoint", str(smollm2_int8_dir), "--chat", "--prompt",
             str(prompt), "--max-new-tokens", "8", "--method", "rocketkv", "--budget", "64")
    assert r.returncode == 0, r.stderr


def test_smollm2_quantized_checkpoint_keeps_float_tensors_in_bfloat16(smollm2_int8_dir):
    """A GGUF's float tensors are dequantized blocks: kept in bfloat16 by default, not
    float32 (the int4 checkpoint was 2.2x its Q4_1 source for its float32 embedding)."""
    from safetensors import safe_open

    cfg = json.loads((smollm2_int8_dir / QUANT_CONFIG).read_text())
    assert cfg["float_dtype"] == "bfloat16"
    with safe_open(smollm2_int8_dir / "model.safetensors", "pt") as f:
        assert f.get_slice("tok_embeddings.weight").get_dtype() == "BF16"


def _essay_window(tok, n=640):
    text = sorted(shared_file(ESSAYS).glob("*.txt"))[0].read_text()
    return tok.encode(text, bos=False)[:n]


def _teacher_forced(model, ids, prompt_len):
    """Log-probs of every continuation position after a prompt_len-token prefill."""
    from rocketkv.evals.fidelity import attach_caches, teacher_forced_logprobs

    attach_caches(model, "full", None, prompt_len, len(ids) - prompt_len)
    return teacher_forced_logprobs(model, ids[:prompt_len], ids[prompt_len:])


def test_smollm2_quantized_stays_close_to_float(smollm2_model):
    """KL(float || quantized) and top-1 agreement of next-token distributions on essay text,
    teacher-forced through the decode path. SmolLM2's GGUF holds Q4_1 weights (4-bit, groups
    of 32, min/scale): int4 with groups of 32 and a float classifier re-expresses them exactly,
    so its distributions equal float's; int8 is close; breaking the model must fail."""
    from rocketkv.formats.tokenizer import load_tokenizer

    ids = _essay_window(load_tokenizer(SMOLLM2_GGUF), 288)
    T = 256
    ref = _teacher_forced(smollm2_model, ids, T)

    def compare(model):
        lp = _teacher_forced(model, ids, T)
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        return kl, (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()

    exact = quantize_model(copy.deepcopy(smollm2_model), "int4", 32, classifier="float")
    kl, top1 = compare(exact)
    assert kl < 2e-3 and top1 >= 0.95  # only bfloat16 rounding of the kernels' input
    kl8, top8 = compare(quantize_model(copy.deepcopy(smollm2_model), "int8"))
    assert kl8 < 0.05 and top8 >= 0.85
    broken = quantize_model(copy.deepcopy(smollm2_model), "int8")
    broken.layers[0].feed_forward.w2.scales.mul_(4)
    kl_b, _ = compare(broken)
    assert kl_b > 5 * kl8


def test_int4_checkpoint_round_trip_with_each_classifier_storage(tmp_path):
    from rocketkv.cli.quantize import quantize_checkpoint
    from rocketkv.formats.checkpoint import save_native

    src = save_native(tmp_path / "tiny", TINY, random_model(TINY, "cpu", torch.float32)
                      .state_dict())
    prompt = _prompt(120, seed=4)
    for classifier, head in (("int8", Int8Linear), ("same", Int4Linear), ("float", None)):
        out = quantize_checkpoint(str(src), "int4", 32, tmp_path / f"q-{classifier}",
                                  classifier=classifier, progress=False)
        loaded = load_model(str(out), "cpu", torch.float32)
        assert isinstance(loaded.layers[1].feed_forward.w2, Int4Linear)
        assert isinstance(loaded.output, head) if head else \
            isinstance(loaded.output, torch.nn.Linear)
        ref = quantize_model(random_model(TINY, "cpu", torch.float32), "int4", 32, classifier)
        assert loaded.quantization == ref.quantization
        a = generate(loaded, prompt, CacheRequest("full"), max_new_tokens=6)
        b = generate(ref, prompt, CacheRequest("full"), max_new_tokens=6)
        assert a["token_ids"] == b["token_ids"] and a["weights"] == b["weights"]


def test_accuracy_scripts_load_a_quantized_checkpoint(stories_dir, tmp_path, capsys):
    """eval_accuracy on stories260K quantized to int8 (tokenizer carried over): the quantized
    model's own full-cache row agrees with itself, and a budget covering the sequence too."""
    from rocketkv.cli.quantize import quantize_checkpoint
    from rocketkv.data import TINYSTORIES_TEXTS
    from scripts.eval_accuracy import main as eval_accuracy

    out = quantize_checkpoint(str(stories_dir), "int8", None, tmp_path / "q", progress=False)
    texts = [str(shared_file(p)) for p in TINYSTORIES_TEXTS]
    rc = eval_accuracy(["--checkpoint", str(out), "--text", *texts, "--context", "120",
                        "--max-new-tokens", "8", "--num-prompts", "1", "--methods", "full",
                        "rocketkv", "--budgets", "256", "--json", str(tmp_path / "e.json"),
                        "--no-progress"])
    assert rc == 0
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert all(r["match_prefix"] == 8 and r["kl_divergence"] == 0 for r in rows)


def test_a_hugging_face_directory_quantizes_like_the_loaded_model(tmp_path):
    """quantize.py on an HF directory (transformers' own save) equals quantizing the model
    our loader builds from it: the q/k row permutation and q/k/v fusion come first."""
    from rocketkv.cli.quantize import quantize_checkpoint

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    out = quantize_checkpoint(str(tmp_path / "hf"), "int4", 64, tmp_path / "q",
                              progress=False)
    loaded = load_model(str(out), "cpu", torch.float32)
    ref = quantize_model(load_model(str(tmp_path / "hf"), "cpu", torch.float32), "int4", 64)
    pa, pb = dict(loaded.named_parameters()), dict(ref.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_eval_quantized_measures_a_gguf_files_own_loads(tmp_path, capsys):
    """eval_quantized --gguf-weights on SmolLM2's file: a row per load against the float
    (dequantized) one; the weight-only int4 layers with the float classifier nearly exact, the
    int8 classifier further off, int8 activations further still (docs/quantization.md); a
    checkpoint that is not a GGUF file is one error line before any load."""
    from scripts.eval_quantized import main as eval_quantized

    gguf = str(shared_file(SMOLLM2_GGUF))
    texts = [str(shared_file(ESSAYS))]
    rc = eval_quantized(["--checkpoint", gguf, "--gguf-weights", "quantized", "quantized-w8a8",
                         "--text", *texts, "--context", "96", "--max-new-tokens", "8",
                         "--num-prompts", "1", "--methods", "full", "--threads", "1",
                         "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "quantization.json").read_text())
    assert "commit" in doc["provenance"] and doc["provenance"]["checkpoint"]["sha256"]
    rows = doc["rows"]
    assert [(r["weights"], r["classifier"]) for r in rows] == [
        ("float", "float"), ("gguf quantized (int4-g32, classifier float)", "float"),
        ("gguf quantized-w8a8 (int4-g32, classifier int8, int8 activations)", "int8")]
    kl = [r["kl_vs_float"] for r in rows]
    assert kl[0] == 0 and 0 < kl[1] < kl[2] < 0.05
    assert eval_quantized(["--checkpoint", "random:stories260K", "--gguf-weights",
                           "quantized"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --gguf-weights")
