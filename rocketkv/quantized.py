"""Weight-only int8 and int4 quantization: the format, the quantized linear layers and their
loader (``checkpoint.load_model`` reads a ``quantize.py`` directory through ``load_quantized``).

A quantized checkpoint is a converted checkpoint (``model_args.json`` + ``model.safetensors``)
plus ``quantization.json`` (``QUANT_CONFIG``), which records the mode, the group size and the
quantized layers, so the loader never guesses them from a file name. ``quantize.py`` writes it.

What is quantized (round to nearest, no calibration data):

* ``int8``: symmetric, per output channel. ``scale_o = max_i |W[o, i]| / 127``, ``q = round(W /
  scale)`` in [-127, 127]; ``W ~ q * scale``. The error of each weight is at most ``scale_o / 2``.
* ``int4``: asymmetric, per output channel and group of ``G`` consecutive input features (the
  layout of PyTorch's packed int4 matmul, ``torch.ops.aten._weight_int4pack_mm``, as gpt-fast
  uses it). With ``lo``/``hi`` the group's min/max, ``scale = (hi - lo) / 15``, ``q = round((W -
  lo) / scale)`` in [0, 15], ``zero = lo + 8 * scale``; ``W ~ (q - 8) * scale + zero``. Stored as
  two 4-bit values per byte (``(q[:, 2j] << 4) | q[:, 2j + 1]``, (out, in / 2) uint8) and
  ``scales_and_zeros`` (in / G, out, 2) float32. ``G`` must divide every quantized layer's input
  width (SmolLM2's 576 takes 32 or 64, not 128 or 256).
* Quantized: every linear layer of every block (``wqkv``, ``wo``, ``w13``, ``w2``) in the
  chosen mode, and the classifier (``output``) in int8 by default, under int4 too
  (``--classifier same``: the layers' mode; ``float``: kept in float). The default was chosen on
  a development set (``scripts/eval_quantized.py --split dev``, SmolLM2, 4 essay windows of 2048
  tokens, ``results/quantization/quantization-dev.md``): with int4-g32 layers, the mean KL to
  the float model was 0.0025 nats with an int8 classifier, 0.058 with an int4 one and 0.0002
  with a float one, for 90, 80 and 171 MiB of weights read per step. (llama.cpp's int4 mixes
  likewise keep the output matrix at higher precision.)
* The token embedding stays in float: a decode step gathers B of its rows, so quantizing it
  would save memory but no traffic. A tied classifier (SmolLM2) is quantized as its own copy:
  the float embedding stays for the gather and the tie is broken, so the checkpoint holds both
  while a decode step reads only the quantized one. Norms stay float. The KV cache stays in the
  activation dtype.

At run time (``Int8Linear``, ``Int4Linear``) the weights are laid out for the device and
activation dtype they are loaded with:

* CUDA, where the dense decode kernels run (``kernels.dense_in_use``, the default with
  triton): a decode step's projections read int8 and int4 in ``kernels/dense.py``, dequantized
  in registers (``kernel_weight``); int4 keeps the stored nibble layout for it (``"nibbles"``),
  and larger inputs (prefill) dequantize, then run a dense matmul.
* CUDA without them: int8 is ``F.linear(x, q.to(x.dtype)) * scale``, which ``torch.compile``
  fuses into one kernel reading int8 (gpt-fast's form); int4 is ``_weight_int4pack_mm``
  (tinygemm) on the tiled layout of ``_convert_weight_to_int4pack``, which needs bfloat16
  activations and a GPU of compute capability >= 8.0.
* CPU: ``_weight_int8pack_mm`` for decode-sized inputs whose width is a multiple of 16 (torch
  2.13's kernel returns wrong values for other widths; prefill and those layers dequantize, then
  run a dense matmul) and ``_weight_int4pack_mm_for_cpu`` for int4. These
  kernels are fast only in bfloat16 or float16 (10-100x slower than a dense matmul in float32
  here), so with float32 activations the quantized matmul rounds its input to bfloat16 and casts
  its output back (``kernel_dtype``); scales are stored in that dtype.

* CPU with int8 activations (``use_int8_activations``, ``--gguf-weights quantized-w8a8``):
  the int8 layers run fbgemm's dynamically quantized linear (``torch.ops.quantized
  .linear_dynamic`` on ``linear_prepack``'s packed copy of the weight, which replaces the int8
  weight: one copy in memory), decode and prefill alike, one call per layer. fbgemm quantizes
  a call's input with one scale and zero point; each row (token) is first mapped onto
  [-1, 1] by its own range and two columns holding -1 and +1 pin the call's range, so every
  row is quantized to 8 bits across its own range (7 bits on CPUs without VNNI,
  ``_reduce_range``, at a larger cost in accuracy) and a row's result does not depend on the
  rows beside it (``_int8_dynamic_linear``). W8A8 as llama.cpp's CPU dot products are (which
  quantize activations to 8 bits in blocks of 32): the integer dot products read the int8
  weight at memory speed at decode (Qwen2.5-0.5B's int8 layers and classifier: 2.1x less time
  per step than ``_weight_int8pack_mm`` at 1 thread, 1.7x at 2) and run prefill's products in
  VNNI instructions (Qwen's gate/up shape, one thread: 11x faster than dequantizing into a
  float32 matmul at 33 rows, about 3x at 512-2048),
  at a measured cost in accuracy (docs/quantization.md).

The CUDA paths follow PyTorch's documented kernels; on the H200 (2026-11-27) 12 of their 16
CUDA tests passed and the other 4 failed on the tests themselves (fixed, not yet rerun there);
no quantized model has been timed on a GPU. The CPU paths are tested against ``dequantize_*``
references.
"""

from __future__ import annotations

import itertools
import re
import warnings
import weakref
from functools import cache
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from rocketkv import kernels
from rocketkv.flags import CLASSIFIER_CHOICES, GROUPSIZES, MODES  # noqa: F401  (re-exported)
from rocketkv.model import ConfigError, ModelArgs, Transformer

QUANT_CONFIG = "quantization.json"
FORMAT_VERSION = 1
LAYER_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
KERNEL_ROWS = 16  # int8 on CPU: inputs with at most this many rows use the int8 kernel
_CPU_INT4_BLOCK = 64  # rows per block of the CPU int4 layout (slicable at block boundaries)
_CUDA_INT4_BLOCK = 8  # rows per tile of the CUDA int4 layout


# --------------------------------------------------------------------------------------------
# Quantize / dequantize (the reference the modules are tested against)


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 of ``w`` (out, in), any float dtype.

    Returns:
        q: int8 (out, in) in [-127, 127].
        scales: float32 (out,): ``w ~ q * scales[:, None]``, error <= scales / 2 per weight.
    """
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    """``q * scales[:, None]`` as float32 (out, in)."""
    return q.float() * scales.float()[:, None]


def check_groupsize(in_features: int, groupsize: int, name: str = "layer") -> None:
    """ConfigError unless ``groupsize`` is one of ``GROUPSIZES`` and divides ``in_features``."""
    if groupsize not in GROUPSIZES:
        raise ConfigError(f"--groupsize must be one of {', '.join(map(str, GROUPSIZES))}, "
                          f"got {groupsize}")
    if in_features % groupsize:
        fits = [str(g) for g in GROUPSIZES if in_features % g == 0]
        hint = f"one of {', '.join(fits)}" if fits else "none fits: use int8"
        raise ConfigError(f"--groupsize {groupsize} does not divide the input width "
                          f"{in_features} of {name} ({hint})")


def quantize_int4(w: Tensor, groupsize: int) -> tuple[Tensor, Tensor]:
    """Asymmetric group-wise int4 of ``w`` (out, in), any float dtype (module docstring).

    Returns:
        packed: uint8 (out, in / 2), two 4-bit values per byte, the even column in the high
            nibble.
        scales_and_zeros: float32 (in / groupsize, out, 2): ``[..., 0]`` scale, ``[..., 1]``
            zero, as ``_weight_int4pack_mm`` takes them.

    Raises:
        ConfigError: ``groupsize`` not in ``GROUPSIZES`` or not dividing ``in``.
    """
    n, k = w.shape
    check_groupsize(k, groupsize)
    g = w.detach().float().reshape(n, k // groupsize, groupsize)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k)
    zeros = lo + 8 * scales
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    return packed, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of the nibble packing: uint8 (out, in / 2) -> int32 (out, in) in [0, 15]."""
    q = torch.stack([packed >> 4, packed & 15], dim=-1)
    return q.reshape(packed.shape[0], -1).to(torch.int32)


def dequantize_int4(packed: Tensor, scales_and_zeros: Tensor, groupsize: int,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """``(q - 8) * scale + zero`` per group, (out, in) in ``dtype`` (computed in ``dtype``,
    as a kernel with ``dtype`` scales would)."""
    n = packed.shape[0]
    q = unpack_int4(packed).to(dtype).view(n, -1, groupsize)
    sz = scales_and_zeros.to(dtype).transpose(0, 1)  # (out, groups, 2)
    return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(n, -1)


# --------------------------------------------------------------------------------------------
# GGUF blocks (the token embedding kept as its blocks, gguf_quantized.py)


def f16_from_bytes(b: Tensor) -> Tensor:
    """Little-endian float16 from byte pairs (..., 2) uint8 -> float32 (...)."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


# GGUF block formats dequantized in torch: (bytes, values) per block of 32 values
TORCH_DEQUANT = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32)}


def dequantize_blocks(raw, kind: str) -> Tensor:
    """GGUF blocks of ``kind`` (``TORCH_DEQUANT``) as float32, vectorized in torch: the same
    values, bit for bit, as the ``gguf`` package's numpy code (tests/test_gguf.py), about 4x
    faster (SmolLM2's file: 0.4 s instead of 1.4 s on the 2-core VM).

    Block layouts (ggml-common.h): Q8_0 = f16 scale d, 32 int8 q: d q; Q4_0 = d, 16 bytes of
    4-bit q (low nibbles the first 16 values, high nibbles the next 16): d (q - 8); Q4_1 = d,
    f16 minimum m, 16 bytes as Q4_0: d q + m; Q5_0 = d, a little-endian uint32 of the 32
    values' fifth bits (bit j: value j), 16 bytes of low nibbles as Q4_0: d (q - 16).

    Args:
        raw: uint8 (..., n_blocks * block bytes): a GGUF tensor's ``data`` (numpy, copied:
            the mapping is read-only) or a Tensor (``GGUFEmbedding``'s gathered rows).
    Returns:
        float32 (..., n_blocks * 32), on ``raw``'s device.
    """
    nbytes, n = TORCH_DEQUANT[kind]
    shape = tuple(raw.shape)
    b = (raw if isinstance(raw, Tensor) else torch.from_numpy(raw.copy())).reshape(-1, nbytes)
    d = f16_from_bytes(b[:, :2])[:, None]  # (blocks, 1)
    if kind == "Q8_0":
        out = d * b[:, 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[:, {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[kind]:]  # the 16 bytes of low nibbles
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # (blocks, 32) uint8
        if kind == "Q5_0":  # the uint32's bytes, little-endian: bit j of byte i is value 8i + j
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
            bits = (b[:, 2:6, None] >> shifts) & 1  # (blocks, 4, 8) uint8
            q = q | (bits.reshape(-1, 32) << 4)  # 0 .. 31
            out = d * (q.float() - 16)
        elif kind == "Q4_1":
            out = d * q.float() + f16_from_bytes(b[:, 2:4])[:, None]
        else:
            out = d * (q.float() - 8)
    return out.reshape(*shape[:-1], shape[-1] // nbytes * n)


class GGUFEmbedding(nn.Module):
    """A token embedding kept as its GGUF blocks (``TORCH_DEQUANT``'s types): a step gathers
    the rows' bytes and dequantizes them (``dequantize_blocks``), so the table costs its block
    bytes (Qwen2.5-0.5B's Q5_0 embedding: 89 MiB instead of 519 MiB in float32) and every row
    is the float load's row exactly, bit for bit.

    ``blocks`` uint8 (vocab, row bytes), a frozen parameter (``measure.weight_bytes`` counts
    it); ``tokens`` int64 (...) -> (..., dim) in ``dtype``."""

    ROWS = 1024  # rows dequantized at a time

    def __init__(self, blocks: Tensor, kind: str, dtype: torch.dtype):
        super().__init__()
        nbytes, n = TORCH_DEQUANT[kind]
        self.kind, self.out_dtype = kind, dtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], blocks.shape[1] // nbytes * n
        self.blocks = nn.Parameter(blocks.contiguous(), requires_grad=False)

    def forward(self, tokens: Tensor) -> Tensor:
        ids = tokens.reshape(-1)
        out = torch.empty(ids.shape[0], self.embedding_dim, dtype=self.out_dtype,
                          device=self.blocks.device)
        for s in range(0, ids.shape[0], self.ROWS):  # a prompt's rows a chunk at a time: the
            # dequantization's temporaries are several times the rows' float size
            out[s:s + self.ROWS] = dequantize_blocks(self.blocks[ids[s:s + self.ROWS]], self.kind)
        return out.reshape(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {self.kind} blocks"


# --------------------------------------------------------------------------------------------
# Modules


def _frozen(t: Tensor) -> nn.Parameter:
    # Parameters (not buffers): measure.weight_bytes and the loaders see them like float ones
    return nn.Parameter(t, requires_grad=False)


def _flat(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the quantized matmuls run in: ``dtype``, except float32 on the CPU,
    whose int8/int4 kernels are fast only in bfloat16 (10-100x slower in float32): there the
    input is rounded to bfloat16 and the output cast back (a relative error of 2^-9 on the
    input, far below the weights' quantization error)."""
    return torch.bfloat16 if device.type == "cpu" and dtype == torch.float32 else dtype


CPU_KERNEL_ALIGN = 64  # bytes: torch's CPU int8 kernel segfaults on a weight not so aligned


# fbgemm's packed weights of the int8 layers that run on int8 activations, by the key an
# ``Int8Linear`` holds in its ``packed_key`` buffer (the custom ops below receive that tensor: a
# compiled graph lifts it into an input, so the module is not at hand); an entry leaves with
# its module
_PACKED: dict[int, Any] = {}
_PACKED_KEYS = itertools.count(1)
PACKED_ROW_BYTES = 12  # fbgemm's per-row column offset, scale and zero point of a packed weight


@cache
def _reduce_range() -> bool:
    """fbgemm's ``reduce_range`` (7-bit activations): needed where its int8 dot products go
    through 16-bit intermediate sums that saturate (AVX2's ``vpmaddubsw``), not on CPUs with
    VNNI (``vpdpbusd`` sums in 32 bits)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not ({"avx512_vnni", "avx_vnni"} & set(flags))


def _int8_dynamic_linear(x: Tensor, key: Tensor, row_sums: Tensor) -> Tensor:
    """W8A8 on the CPU: ``x`` (M, in) float32 times the packed int8 weight W (out, in) of
    ``key`` (its per-channel scales are in it); (M, out) float32, in one fbgemm call per
    ``W8A8_ROWS`` rows. ``row_sums`` (out,) float32: the sums of W's dequantized rows.

    fbgemm quantizes its whole input with one scale and zero point (its range widened to hold
    0). So that each row gets a grid of its own, every row is mapped onto [-1, 1] by its own
    range [lo, hi] (x' = (x - mid) / half, mid = (hi + lo) / 2, half = (hi - lo) / 2) and
    given two more columns, -1 and +1, which pin the call's range to [-1, 1] (the packed
    weight has two zero columns for them: they add nothing). Each row is then quantized to
    8 bits across its own range (step 2 half / 255; 2 half / 127 with ``_reduce_range``),
    whatever rows share the call, and ``W x = half W x' + mid W 1`` gives its output."""
    M = x.shape[0]
    if M > W8A8_ROWS:  # prefill: row blocks, whose temporaries the allocator reuses (a
        # buffer of tens of MiB is mapped afresh, page faults and all, at every call)
        y = x.new_empty(M, row_sums.shape[0])
        for s in range(0, M, W8A8_ROWS):
            y[s:s + W8A8_ROWS] = _int8_dynamic_linear(x[s:s + W8A8_ROWS], key, row_sums)
        return y
    K = x.shape[1]
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)  # (10x aminmax's speed)
    mid = (hi + lo).mul_(0.5)
    half = (hi - lo).mul_(0.5).clamp_(min=torch.finfo(torch.float32).tiny)
    xn = x.new_empty(M, K + PIN_COLUMNS)
    torch.sub(x, mid, out=xn[:, :K])
    xn[:, :K].div_(half)
    xn[:, K:] = _PIN
    y = torch.ops.quantized.linear_dynamic(xn, _PACKED[int(key)], _reduce_range())
    return y.mul_(half).addcmul_(mid, row_sums)


W8A8_ROWS = 256  # rows per fbgemm call in prefill (``_int8_dynamic_linear``)
_PIN = torch.tensor([[-1.0, 1.0]])  # the range pin's two columns (``_int8_dynamic_linear``)
PIN_COLUMNS = 2


# the same as an opaque op for compiled graphs (eager calls the function: an op's dispatch
# costs about 40 µs a call, measured at one thread; 97 calls a step for Qwen2.5-0.5B)
int8_dynamic_linear = torch.library.custom_op("rocketkv::int8_dynamic_linear",
                                              _int8_dynamic_linear, mutates_args=())


@int8_dynamic_linear.register_fake
def _(x: Tensor, key: Tensor, row_sums: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], row_sums.shape[0])


class Int8Linear(nn.Module):
    """``y = x W^T`` with ``W = q * scales[:, None]``: int8 ``weight`` (out, in) and ``scales``
    (out,) in ``kernel_dtype``. ``x`` (..., in) -> (..., out) in ``x``'s dtype.

    After ``use_int8_activations`` (``int8_activations`` True) the layer holds fbgemm's packed
    copy instead of ``weight`` (``packed_key`` names it, ``packed_bytes`` is its size;
    ``row_sums`` (out,) float32 the dequantized rows' sums), and every input, decode or
    prefill, runs W8A8 on it (``_int8_dynamic_linear``)."""

    mode = "int8"
    int8_activations = False
    packed_bytes = 0

    def __init__(self, q: Tensor, scales: Tensor, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = q.shape
        q = q.to(torch.int8).contiguous()
        if q.device.type == "cpu" and q.data_ptr() % CPU_KERNEL_ALIGN:  # memory-mapped from
            q = q.clone()  # a file at an odd offset: a fresh allocation is aligned
        self.weight = _frozen(q)
        self.scales = _frozen(scales.to(device=q.device, dtype=kernel_dtype(q.device, dtype))
                              .contiguous())

    def forward(self, x: Tensor) -> Tensor:
        if self.int8_activations:
            x2, lead = _flat(x)
            mm = torch.ops.rocketkv.int8_dynamic_linear if torch.compiler.is_compiling() \
                else _int8_dynamic_linear
            y = mm(x2.float(), self.packed_key, self.row_sums)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        return self._mm(x, self.weight, self.scales)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` only (prefill's query or key/value rows; on int8
        activations all are computed, the packed weight being whole)."""
        if self.int8_activations:
            return self(x)[..., start:stop]
        return self._mm(x, self.weight[start:stop], self.scales[start:stop])

    @staticmethod
    def _mm(x: Tensor, q: Tensor, scales: Tensor) -> Tensor:
        x2, lead = _flat(x)
        if x.device.type == "cpu" and x2.shape[0] <= KERNEL_ROWS and q.shape[1] % 16 == 0 \
                and (torch.compiler.is_compiling() or q.data_ptr() % CPU_KERNEL_ALIGN == 0):
            # (torch 2.13's kernel returns garbage for input widths not a multiple of 16, and
            # crashes on a weight not 64-byte aligned: __init__ aligns the whole weight, this
            # checks a row slice eagerly; compiled graphs see whole, aligned weights)
            y = torch.ops.aten._weight_int8pack_mm(x2.to(scales.dtype).contiguous(), q, scales)
        elif x.device.type == "cpu":  # CPU prefill: the scaled weight dequantized, one dense
            # matmul (scaling the (rows, out) output instead costs a pass and a copy of it)
            y = F.linear(x2, q.to(x.dtype).mul_(scales.to(x.dtype)[:, None]))
        else:  # CUDA (fused by torch.compile): dequantize, dense matmul
            y = F.linear(x2, q.to(x.dtype)) * scales
        return y.to(x.dtype).reshape(*lead, q.shape[0])

    def kernel_weight(self) -> tuple[Tensor, Tensor, int] | None:
        """(int8 weight (out, in), scales (out,), 0): what the dense decode kernels read
        (``kernels.fuse.kernel_weight``); None once the weight is packed for the CPU."""
        return None if self.int8_activations else (self.weight, self.scales, 0)

    def extra_repr(self) -> str:
        act = ", int8 activations (packed)" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8{act}"


def check_int8_activations(device) -> None:
    """ConfigError unless int8 activations (``use_int8_activations``, ``--gguf-weights
    quantized-w8a8``) can run on ``device``: the CPU, with PyTorch's fbgemm engine."""
    if torch.device(device).type != "cpu":
        raise ConfigError("int8 activations (--gguf-weights quantized-w8a8) run on the CPU only, "
                          f"not {device}")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        engines = ", ".join(torch.backends.quantized.supported_engines)
        raise ConfigError("int8 activations (--gguf-weights quantized-w8a8) need PyTorch's "
                          f"fbgemm engine, which this torch lacks (engines: {engines})")


@torch.no_grad()
def use_int8_activations(model: nn.Module) -> int:
    """Run ``model``'s CPU ``Int8Linear`` layers on int8 activations at decode (W8A8, module
    docstring): each layer's int8 weight is replaced by fbgemm's packed copy of it (the weight
    dequantized with its scales, requantized per channel with the same scales: the same int8
    values), which decode and prefill read, so the layers hold one copy of their weights.
    Returns the number of layers switched.

    Raises:
        ConfigError: see ``check_int8_activations`` (for each layer's device)."""
    n = 0
    for m in model.modules():
        if not isinstance(m, Int8Linear) or m.int8_activations:
            continue
        check_int8_activations(m.weight.device)
        q = F.pad(m.weight, (0, PIN_COLUMNS))  # zero columns for the range pin
        scales = m.scales.double()
        with warnings.catch_warnings():  # torch 2.13: quantized tensors are "deprecated"
            warnings.simplefilter("ignore")
            wq = torch._make_per_channel_quantized_tensor(
                q, scales, torch.zeros(q.shape[0], dtype=torch.long), 0)
            key = next(_PACKED_KEYS)
            _PACKED[key] = torch.ops.quantized.linear_prepack(wq, None)
        weakref.finalize(m, _PACKED.pop, key, None)
        # the dequantized rows' sums, scale_o sum_i q_oi (summed exactly in int32)
        row_sums = m.weight.sum(dim=1, dtype=torch.int32).float() * m.scales.float()
        del wq, q
        del m.weight  # the packed copy is the layer's only one
        m.register_buffer("packed_key", torch.tensor([key]), persistent=False)
        m.register_buffer("row_sums", row_sums, persistent=False)
        m.packed_bytes = m.out_features * (m.in_features + PIN_COLUMNS + PACKED_ROW_BYTES)
        m.int8_activations = True
        n += 1
    if getattr(model, "quantization", None) is not None:
        model.quantization = {**model.quantization, "activations": "int8"}
    return n


def int4_layout(device: torch.device, dtype: torch.dtype, out_features: int) -> str:
    """The runtime layout ``Int4Linear`` uses: ``"cuda"`` (tinygemm tiles), ``"cpu"`` (the CPU
    kernel's blocks, in ``kernel_dtype``) or ``"nibbles"`` (the stored layout, dequantized per
    call: a layer whose output width the CPU kernel does not take).

    On CUDA where the dense decode kernels run (``kernels.dense_in_use``), ``"nibbles"``: they
    read the stored layout (``kernels.dense``), and larger inputs (prefill) dequantize.

    Raises:
        ConfigError: CUDA with activations that are not bfloat16, a GPU older than compute
            capability 8.0, a torch without the int4 kernels, or a device with no int4 path.
    """
    if device.type == "cuda" and kernels.dense_in_use(device):
        return "nibbles"
    if device.type == "cuda":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            raise ConfigError(f"int4 on CUDA needs torch's _weight_int4pack_mm (torch "
                              f"{torch.__version__} lacks it)")
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ConfigError(f"int4 on CUDA needs a GPU of compute capability >= 8.0 "
                              f"(_weight_int4pack_mm); this one is {major}.{minor}: use int8")
        if dtype != torch.bfloat16:
            raise ConfigError(f"int4 on CUDA needs --dtype bfloat16 (_weight_int4pack_mm takes "
                              f"bfloat16 activations), got {str(dtype).removeprefix('torch.')}")
        return "cuda"
    if device.type != "cpu":
        raise ConfigError(f"no int4 kernel for device {device.type} (cuda or cpu)")
    if out_features % 16:  # the CPU kernel takes multiples of 16 output features
        return "nibbles"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ConfigError(f"int4 on CPU needs torch >= 2.5's _weight_int4pack_mm_for_cpu "
                          f"(torch {torch.__version__})")
    return "cpu"


def _cuda_inner_k_tiles(in_features: int) -> int:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ConfigError(f"int4 on CUDA needs an input width divisible by 32, got {in_features}")


class Int4Linear(nn.Module):
    """``y = x W^T`` with group-wise int4 ``W`` (``dequantize_int4``). ``weight`` holds the
    4-bit values in the layout of ``int4_layout`` (in/2 bytes per output row in every layout);
    ``scales_and_zeros`` (in / groupsize, out, 2) is in ``kernel_dtype``. ``x`` (..., in)
    -> (..., out) in ``x``'s dtype."""

    mode = "int4"

    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, groupsize: int,
                 device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        device = torch.device(device)
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        check_groupsize(self.in_features, groupsize)
        self.groupsize = groupsize
        self.layout = int4_layout(device, dtype, self.out_features)
        packed = packed.to(device=device, dtype=torch.uint8).contiguous()
        if self.layout == "cuda":
            w = torch.ops.aten._convert_weight_to_int4pack(
                packed, _cuda_inner_k_tiles(self.in_features))
        elif self.layout == "cpu":
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed), 2)
        else:
            w = packed
        self.weight = _frozen(w)
        self.scales_and_zeros = _frozen(scales_and_zeros.to(
            device=device, dtype=kernel_dtype(device, dtype)).contiguous())

    def forward(self, x: Tensor) -> Tensor:
        return self._mm(x, self.weight, self.scales_and_zeros)

    def forward_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Output features ``start:stop`` only: a slice of the weights where the layout allows
        it (whole blocks), else every row computed and the slice returned."""
        block = {"cuda": _CUDA_INT4_BLOCK, "cpu": _CPU_INT4_BLOCK, "nibbles": 1}[self.layout]
        if start % block or (stop % block and stop != self.out_features):
            return self.forward(x)[..., start:stop]
        w = self.weight[start // block:-(-stop // block)] if self.layout == "cuda" \
            else self.weight[start:stop]
        return self._mm(x, w, self.scales_and_zeros[:, start:stop].contiguous())

    def _mm(self, x: Tensor, w: Tensor, sz: Tensor) -> Tensor:
        x2, lead = _flat(x)
        if self.layout == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), w, self.groupsize, sz)
        elif self.layout == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(sz.dtype).contiguous(), w,
                                                           self.groupsize, sz)
        elif x2.shape[0] <= KERNEL_ROWS and kernels.dense_in_use(x.device):  # decode-sized
            y = kernels.linear(x2, w, scales=sz, groupsize=self.groupsize)
        else:
            y = F.linear(x2.to(sz.dtype), dequantize_int4(w, sz, self.groupsize, sz.dtype))
        return y.to(x.dtype).reshape(*lead, sz.shape[1])

    def kernel_weight(self) -> tuple[Tensor, Tensor, int] | None:
        """(nibbles uint8 (out, in / 2), scales and zeros (in / G, out, 2), G): what the dense
        decode kernels read (``kernels.fuse.kernel_weight``), in the ``"nibbles"`` layout;
        None in the kernels' own layouts of torch's int4 matmuls."""
        if self.layout != "nibbles":
            return None
        return self.weight, self.scales_and_zeros, self.groupsize

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4, "
                f"groupsize={self.groupsize}, layout={self.layout}")


# --------------------------------------------------------------------------------------------
# Whole models and checkpoints


def parse_weights(spec: str) -> tuple[str, int | None]:
    """A benchmark's ``--weights`` mode: ``float``, ``int8`` or ``int4-g<G>`` -> (mode,
    groupsize).

    Raises:
        ConfigError: anything else, or G not in ``GROUPSIZES``."""
    m = re.fullmatch(r"float|int8|int4-g(\d+)", spec)
    if not m or (m.group(1) and int(m.group(1)) not in GROUPSIZES):
        raise ConfigError(f"--weights: {spec!r} is not float, int8 or int4-g<G> with G in "
                          f"{', '.join(map(str, GROUPSIZES))}")
    return (spec, None) if not m.group(1) else ("int4", int(m.group(1)))


def classifier_mode(mode: str, classifier: str) -> str | None:
    """How the classifier is stored for ``--classifier`` (``CLASSIFIER_CHOICES``): ``"int8"``,
    ``"int4"`` (``same`` with int4 layers) or None (float)."""
    if classifier not in CLASSIFIER_CHOICES:
        raise ConfigError(f"--classifier must be one of {', '.join(CLASSIFIER_CHOICES)}, "
                          f"got {classifier!r}")
    return None if classifier == "float" else mode if classifier == "same" else "int8"


def quantized_linears(args: ModelArgs, mode: str, classifier: str = "int8") -> dict[str, str]:
    """``{name: mode}`` (``model.py``'s names) of the linear layers a quantized checkpoint
    holds in int8/int4: every block's linears in ``mode``, the classifier as
    ``classifier_mode`` says."""
    names = {f"layers.{i}.{n}": mode for i in range(args.n_layers) for n in LAYER_LINEARS}
    head = classifier_mode(mode, classifier)
    return names | ({"output": head} if head else {})


def check_quantizable(args: ModelArgs, mode: str, groupsize: int | None,
                      classifier: str = "int8") -> None:
    """ConfigError for an unknown mode or classifier choice, a group size given to int8, or an
    int4 group size that does not divide every int4 layer's input width (the first such layer
    is named)."""
    if mode not in MODES:
        raise ConfigError(f"unknown --mode {mode!r} (known: {', '.join(MODES)})")
    classifier_mode(mode, classifier)
    if mode == "int8":
        if groupsize is not None:
            raise ConfigError("--groupsize applies to int4 only (int8 is per output channel)")
        return
    if groupsize is None:
        raise ConfigError(f"--mode int4 needs --groupsize ({', '.join(map(str, GROUPSIZES))})")
    widths = {"attention.wqkv": args.dim, "attention.wo": args.n_heads * args.head_dim,
              "feed_forward.w13": args.dim, "feed_forward.w2": args.intermediate_size}
    for name, width in widths.items():
        check_groupsize(width, groupsize, f"layers.*.{name}")
    if classifier_mode(mode, classifier) == "int4":
        check_groupsize(args.dim, groupsize, "output")


def output_dim(name: str) -> int:
    """The dim along which the output features (rows) of the stored tensor ``name`` lie: 1 for
    int4's ``scales_and_zeros`` (in / groupsize, out, 2), 0 for every other weight, bias or
    quantized tensor (``quantize_tensor``)."""
    return 1 if name.endswith("int4_scales_and_zeros") else 0


def quantize_tensor(w: Tensor, mode: str, groupsize: int | None) -> dict[str, Tensor]:
    """The stored tensors of one linear weight (out, in), by suffix: ``int8_weight`` and
    ``int8_scales``, or ``int4_weight`` and ``int4_scales_and_zeros``."""
    if mode == "int8":
        q, s = quantize_int8(w)
        return {"int8_weight": q, "int8_scales": s}
    packed, sz = quantize_int4(w, groupsize)
    return {"int4_weight": packed, "int4_scales_and_zeros": sz}


def quantized_module(stored: dict[str, Tensor], mode: str, groupsize: int | None, device,
                     dtype: torch.dtype) -> nn.Module:
    """``Int8Linear`` / ``Int4Linear`` on ``device`` from ``quantize_tensor``'s tensors."""
    if mode == "int8":
        return Int8Linear(stored["int8_weight"].to(device), stored["int8_scales"], dtype)
    return Int4Linear(stored["int4_weight"], stored["int4_scales_and_zeros"], groupsize,
                      device, dtype)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


@torch.no_grad()
def quantize_model(model: Transformer, mode: str, groupsize: int | None = None,
                   classifier: str = "int8") -> Transformer:
    """Replace ``model``'s linear layers (``quantized_linears``) by quantized ones in place,
    one at a time (peak: the float model plus one quantized layer), on the model's device and
    for its activation dtype: the model that loading ``quantize.py``'s checkpoint of the same
    weights gives.

    Raises:
        ConfigError: see ``check_quantizable`` and ``int4_layout``.
    """
    check_quantizable(model.args, mode, groupsize, classifier)
    device, dtype = model.device, model.dtype
    for name, m in quantized_linears(model.args, mode, classifier).items():
        w = model.get_submodule(name).weight
        _set_module(model, name, quantized_module(quantize_tensor(w, m, groupsize), m,
                                                  groupsize, device, dtype))
        del w
    model.quantization = {"mode": mode, "groupsize": groupsize,
                          "classifier": classifier_mode(mode, classifier) or "float"}
    return model


def load_quantized(model: Transformer, tensors: dict[str, Tensor], config: dict[str, Any],
                   device, dtype: torch.dtype, materialize) -> Transformer:
    """The model of a quantized checkpoint, from ``model`` built on the meta device
    (``checkpoint.meta_transformer``): ``config`` (``quantization.json``) names the
    quantized layers, whose stored tensors in ``tensors`` become quantized modules; the rest
    goes through ``materialize(args, tensors, device, dtype, model)`` (``checkpoint.py``).

    Raises:
        ConfigError: a config of another format version or mode, or missing tensors.
    """
    mode, groupsize = config.get("mode"), config.get("groupsize")
    if config.get("format_version") != FORMAT_VERSION or mode not in MODES:
        raise ConfigError(f"{QUANT_CONFIG}: unsupported format (format_version "
                          f"{config.get('format_version')!r}, mode {mode!r}); this engine "
                          f"reads format_version {FORMAT_VERSION}, modes {', '.join(MODES)}")
    suffixes = {"int8": ("int8_weight", "int8_scales"),
                "int4": ("int4_weight", "int4_scales_and_zeros")}
    args = model.args
    linears = config.get("linears", {})
    for name, m in linears.items():
        if m not in MODES:
            raise ConfigError(f"{QUANT_CONFIG}: layer {name} has unknown mode {m!r}")
        try:
            stored = {s: tensors.pop(f"{name}.{s}") for s in suffixes[m]}
        except KeyError as e:
            raise ConfigError(f"quantized checkpoint lacks tensor {e.args[0]!r}") from None
        module = quantized_module(stored, m, groupsize, device, dtype)
        expected = model.get_submodule(name).weight.shape
        if (module.out_features, module.in_features) != tuple(expected):
            raise ConfigError(f"quantized {name} is {module.out_features}x"
                              f"{module.in_features}, config implies {tuple(expected)}")
        _set_module(model, name, module)
    embedding = config.get("embedding", "float")
    if embedding != "float":  # a GGUF's token embedding kept as its blocks
        try:
            blocks = tensors.pop("tok_embeddings.blocks").to(device)
        except KeyError:
            raise ConfigError("quantized checkpoint lacks tensor 'tok_embeddings.blocks'") \
                from None
        _set_module(model, "tok_embeddings", GGUFEmbedding(blocks, embedding, dtype))
    model = materialize(args, tensors, device, dtype, model)
    model.quantization = {"mode": mode, "groupsize": groupsize,
                          "classifier": linears.get("output", "float")}
    return model
