"""GGUF weights kept quantized: a GGUF's block-quantized linear layers mapped straight into the
engine's int4 / int8 layers (``quantized.Int4Linear``, ``quantized.Int8Linear``), the opt-in
``load_model(..., gguf_weights="quantized")`` (``generate.py --gguf-weights quantized``).

The default (``"float"``) dequantizes every GGUF tensor to the run's dtype
(``checkpoint.gguf_state_dict``). ``"quantized"`` instead builds, in memory, the tensors and
config of a ``quantize.py`` checkpoint (``quantized.QUANT_CONFIG``), which
``quantized.load_quantized`` then lays out for the device, so a decode step reads the 4-bit
blocks (about 1/7 of float32's bytes) in torch's packed CPU kernels. Nothing is written to disk.

How each GGUF type maps (block layouts: ggml-common.h / ggml-quants.c; ``decode_int4``):

* ``Q4_0`` (blocks of 32: f16 ``d``, 16 bytes of 4-bit ``q``; ``w = d (q - 8)``), ``Q4_1``
  (f16 ``d`` and ``m``; ``w = d q + m``) and ``Q4_K`` (super-blocks of 256: f16 ``d`` and
  ``dmin``, 8 sub-blocks of 32 with 6-bit scale ``sc`` and minimum ``mn``; ``w = d sc q - dmin
  mn``) become int4 with groups of 32, exactly: the 4-bit values are copied as they are, and
  each group of 32 gets ``scale = d`` (``d sc``) and ``zero = minimum + 8 scale`` with
  ``minimum`` = ``-8 d``, ``m`` or ``-dmin mn``, so that ``quantized.dequantize_int4``'s ``(q -
  8) scale + zero`` is the GGUF's ``scale q + minimum``. The only change is the dtype of the
  stored scales and zeros: ``quantized.kernel_dtype`` (bfloat16 on the CPU with float32
  activations), a relative error of at most 2^-8 on each (tests/test_gguf.py bounds it).
* Every other block type (``Q8_0``, ``Q5_0``, ``Q5_1``, ``Q5_K``, ``Q6_K``, ``Q2_K``, ``Q3_K``,
  the ``IQ`` types) is dequantized and requantized to symmetric per-output-channel int8
  (``quantized.quantize_int8``): not exact, since one scale per row replaces one per block of
  16-32 (SmolLM2's Q8_0 classifier: see docs/quantization.md for the measured error).
* ``F32``, ``F16`` and ``BF16`` linear weights stay in float (the activation dtype).
* A fused layer (``wqkv`` from q/k/v, ``w13`` from gate/up) is int4 when all its parts are
  4-bit blocks, float when all are float, else int8 (each part's rows requantized, which is
  the same as requantizing the fused rows: int8 scales are per row).
* The token embedding keeps its GGUF blocks where they are ``Q8_0``, ``Q4_0``, ``Q4_1`` or
  ``Q5_0`` and no float classifier shares it (``quantized.GGUFEmbedding``: a step gathers B
  rows' bytes and dequantizes them, bit for bit the float load's rows; Qwen2.5-0.5B's Q5_0
  table 89 MiB instead of 519 MiB in float32); otherwise it is dequantized to the activation
  dtype. The
  classifier is dequantized too with ``"quantized"`` (a tied one stays tied, and its
  embedding then stays the float matrix they share). With
  ``"quantized-int8-classifier"`` it is requantized to per-channel int8 whatever its GGUF type
  (a tied one, SmolLM2's ``Q8_0`` embedding, becomes its own int8 copy, as ``quantize.py``'s
  default int8 classifier does): a quarter of float32's bytes, at a measured cost in accuracy
  (docs/quantization.md: SmolLM2's per-channel int8 classifier is what moves its logits, not
  the int4 layers).
* ``"quantized-w8a8"``: as ``"quantized-int8-classifier"``, then the int8 layers and the
  classifier run on int8 activations at decode (``quantized.use_int8_activations``, CPU only;
  the int4 layers keep bfloat16 ones): fbgemm's integer dot products, about twice as fast as
  the weight-only int8 kernel here, at a measured cost in accuracy (docs/quantization.md).
* qwen2's q/k rows are permuted to Meta's RoPE order as on the float path
  (``checkpoint.hf_to_meta_rope_rows``): rows of 4-bit values and their per-row scales alike.

Repacking SmolLM2's file takes about as long as dequantizing it (measured in
docs/quantization.md), so there is no on-disk cache of the repacked weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rocketkv.flags import GGUF_WEIGHTS
from rocketkv.formats.gguf_reader import gguf_field
from rocketkv.model import ConfigError, ModelArgs
from rocketkv.quantized import (
    FORMAT_VERSION,
    TORCH_DEQUANT,
    f16_from_bytes,
    output_dim,
    quantize_int8,
)

# load_model(gguf_weights=...), --gguf-weights: the GGUF's weights dequantized to float, or kept
# quantized with the classifier in float (the activation dtype) or in int8
INT4_GROUPSIZE = 32  # the GGUF 4-bit types' (sub-)block of values with one scale and minimum
INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")  # mapped to int4 g32 exactly
FLOAT_KINDS = ("F32", "F16", "BF16")  # kept in float
_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}  # bytes, values per block


def check_gguf_weights(value: str) -> str:
    """``value`` if it is one of ``GGUF_WEIGHTS``.

    Raises:
        ConfigError: any other value."""
    if value not in GGUF_WEIGHTS:
        raise ConfigError(f"--gguf-weights must be one of {', '.join(GGUF_WEIGHTS)}, "
                          f"got {value!r}")
    return value


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 packed bytes (blocks, 12) -> 6-bit scales and minimums (blocks, 8), int32
    (ggml's ``get_scale_min_k4``): sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales)
    and 4-7 (minimums); sub-blocks 4-7 in the nibbles of bytes 8-11 with their top 2 bits in
    the top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    s = s.to(torch.int32)
    lo_sc, lo_mn, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 63, (hi & 15) | ((lo_sc >> 6) << 4)], dim=1)
    mn = torch.cat([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], dim=1)
    return sc, mn


def decode_int4(raw, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """A GGUF 4-bit tensor's blocks as 4-bit values and per-group (32 values) scale and
    minimum, with ``w = scale * q + minimum`` the GGUF's dequantized weight (module docstring).

    Args:
        raw: uint8 array (rows, row bytes), a ``gguf.GGUFReader`` tensor's ``data``.
        kind: ``"Q4_0"``, ``"Q4_1"`` or ``"Q4_K"``.
    Returns:
        q: uint8 (rows, in) in [0, 15], in the row's value order.
        scale, minimum: float32 (rows, in / 32), computed from the blocks' float16 fields in
            float32 (``d * sc`` and ``dmin * mn`` are exact there).
    """
    nbytes, _ = _BLOCK[kind]
    rows = raw.shape[0]
    b = torch.from_numpy(raw.copy()).reshape(-1, nbytes)  # a copy: the mapping is read-only
    d = f16_from_bytes(b[:, 0:2])  # (blocks,)
    if kind == "Q4_K":
        dmin = f16_from_bytes(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 values: low nibbles then high
        q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 256)
        scale = d[:, None] * sc.float()  # (blocks, 8)
        minimum = -(dmin[:, None] * mn.float())
    else:
        qs = b[:, 4:] if kind == "Q4_1" else b[:, 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=1)  # low nibbles values 0-15, high 16-31
        scale = d[:, None]
        minimum = f16_from_bytes(b[:, 2:4])[:, None] if kind == "Q4_1" else -8 * scale
    return (q.reshape(rows, -1), scale.reshape(rows, -1).contiguous(),
            minimum.reshape(rows, -1).contiguous())


def int4_stored(q: Tensor, scale: Tensor, minimum: Tensor) -> dict[str, Tensor]:
    """``decode_int4``'s output as ``quantized.quantize_tensor``'s int4 tensors: ``int4_weight``
    uint8 (out, in / 2), the even column in the high nibble, and ``int4_scales_and_zeros``
    float32 (in / 32, out, 2) with ``zero = minimum + 8 * scale``."""
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    sz = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1).contiguous()
    return {"int4_weight": packed, "int4_scales_and_zeros": sz}


@dataclass(frozen=True)
class GGUFLoader:
    """What the float GGUF loader (``checkpoint.py``) knows and the quantized mapping reuses,
    handed in by ``checkpoint.read_checkpoint`` (``checkpoint`` imports this module, so this
    module cannot import it): ``dequantize`` (a GGUF tensor -> float32 Tensor),
    ``rope_rows`` (``hf_to_meta_rope_rows``), ``layer_names`` (GGUF layer name -> the
    model's), ``rotate_half`` (architectures stored in rotate-half order), ``fused_qkv`` and
    ``qkv_names`` (the fused q/k/v layout)."""

    dequantize: Callable[[Any], Tensor]
    rope_rows: Callable[[Tensor, int], Tensor]
    layer_names: dict[str, Any]
    rotate_half: tuple[str, ...]
    fused_qkv: Callable[..., Tensor]
    qkv_names: Callable[[ModelArgs], dict[str, str]]


def _mode(kinds: list[str]) -> str | None:
    """The mode of a layer made of GGUF tensors of ``kinds`` (module docstring); None: float."""
    if all(k in INT4_KINDS for k in kinds):
        return "int4"
    if all(k in FLOAT_KINDS for k in kinds):
        return None
    return "int8"


def _part(tensor, mode: str | None, dtype: torch.dtype, perm_heads: int | None,
          loader: GGUFLoader) -> dict[str, Tensor]:
    """One GGUF linear weight in ``mode``, keyed by ``quantize_tensor``'s suffixes (``weight``
    for float), its rows permuted from rotate-half order when ``perm_heads`` is given."""
    def rows(t: Tensor) -> Tensor:
        return t if perm_heads is None else loader.rope_rows(t, perm_heads)

    if mode == "int4":
        q, scale, minimum = (rows(t) for t in decode_int4(tensor.data, tensor.tensor_type.name))
        return int4_stored(q, scale, minimum)
    w = rows(loader.dequantize(tensor))
    if mode is None:
        return {"weight": w.to(dtype)}
    q8, s8 = quantize_int8(w)
    return {"int8_weight": q8, "int8_scales": s8}


def _fused(parts: list, dtype: torch.dtype, perms: list[int | None], loader: GGUFLoader
           ) -> tuple[str | None, dict[str, Tensor]]:
    """``parts`` (GGUF tensors) as one layer, their rows concatenated in order."""
    mode = _mode([t.tensor_type.name for t in parts])
    stored = [_part(t, mode, dtype, p, loader) for t, p in zip(parts, perms)]
    return mode, {s: torch.cat([st[s] for st in stored], dim=output_dim(s)) for s in stored[0]}


def gguf_quantized_state_dict(reader, args: ModelArgs, dtype: torch.dtype,
                              classifier: str = "float", *, loader: GGUFLoader
                              ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The stored tensors and ``quantization.json`` config of a quantized checkpoint holding
    a GGUF's weights as they are mapped (module docstring), for ``quantized.load_quantized``
    (``checkpoint.read_checkpoint(gguf_weights="quantized")``).

    Args:
        reader: a ``gguf.GGUFReader`` (``gguf_reader.open_gguf``) of a llama or qwen2 file.
        args: its config (``checkpoint.gguf_args``).
        dtype: of the tensors kept in float (embedding, norms, biases, float layers).
        classifier: ``"float"`` (in ``dtype``; a tied classifier stays tied) or ``"int8"``.
        loader: the float loader's pieces (``GGUFLoader``, ``checkpoint.GGUF_LOADER``).
    Returns:
        (state dict in ``model.py``'s names, quantized layers by their ``quantize_tensor``
        suffixes; config with ``format_version``, ``mode`` ("int4" when any layer is int4,
        else "int8"), ``groupsize`` (32 or None), ``linears`` {layer: mode}, ``classifier``,
        ``source`` "gguf").
    Raises:
        ConfigError: a missing or unexpected tensor, or an undequantizable type.
    """
    tensors = {t.name: t for t in reader.tensors}
    tensors.pop("rope_freqs.weight", None)  # in args.rope_scaling

    def pop(name: str):
        if name not in tensors:
            raise ConfigError(f"GGUF file lacks the tensor {name!r}")
        return tensors.pop(name)

    sd: dict[str, Tensor] = {}
    linears: dict[str, str] = {}

    def put(name: str, mode: str | None, stored: dict[str, Tensor]) -> None:
        if mode is None:
            sd[f"{name}.weight"] = stored["weight"]
        else:
            linears[name] = mode
            sd.update({f"{name}.{s}": t for s, t in stored.items()})

    emb = pop("token_embd.weight")
    head = tensors.pop("output.weight", None)
    embedding = emb.tensor_type.name
    if embedding in TORCH_DEQUANT and (head is not None or classifier == "int8"):
        # gathered only (not the float classifier's matrix too): kept as its blocks
        sd["tok_embeddings.blocks"] = torch.from_numpy(emb.data.copy())
    else:
        embedding = None
        sd["tok_embeddings.weight"] = loader.dequantize(emb).to(dtype)
    sd["norm.weight"] = loader.dequantize(pop("output_norm.weight")).to(dtype)
    if classifier == "int8":
        put("output", "int8", _part(head or emb, "int8", dtype, None, loader))
    elif head is not None:  # untied: its own float matrix (a tied one is tied on load)
        sd["output.weight"] = loader.dequantize(head).to(dtype)
    rotate_half = gguf_field(reader, "general.architecture") in loader.rotate_half
    qk_perm = [args.n_heads, args.n_kv_heads, None] if rotate_half else [None] * 3
    fused_linears = {"attention.wqkv": (("attn_q", "attn_k", "attn_v"), qk_perm),
                     "feed_forward.w13": (("ffn_gate", "ffn_up"), [None, None])}
    single = {n.removesuffix(".weight"): m.removesuffix(".weight")
              for n, m in loader.layer_names.items()
              if n.startswith(("attn_output", "ffn_down"))}
    norms = {n: m for n, m in loader.layer_names.items() if n.endswith("norm.weight")}
    for i in range(args.n_layers):
        p = f"blk.{i}."
        for name, (parts, perms) in fused_linears.items():
            put(f"layers.{i}.{name}", *_fused([pop(f"{p}{n}.weight") for n in parts], dtype,
                                             perms, loader))
        for gname, name in single.items():
            put(f"layers.{i}.{name}", *_fused([pop(f"{p}{gname}.weight")], dtype, [None],
                                                    loader))
        for gname, name in norms.items():
            sd[f"layers.{i}.{name}"] = loader.dequantize(pop(p + gname)).to(dtype)
        if args.qkv_bias:
            q, k, v = (loader.dequantize(pop(f"{p}attn_{n}.bias")).to(dtype) for n in "qkv")
            sd[f"layers.{i}.{loader.qkv_names(args)['bias']}"] = (
                loader.fused_qkv(q, k, v, args) if rotate_half else torch.cat([q, k, v]))
    if tensors:
        raise ConfigError(f"unexpected tensors in GGUF file: {', '.join(list(tensors)[:5])}")
    any_int4 = "int4" in linears.values()
    config = {"format_version": FORMAT_VERSION, "mode": "int4" if any_int4 else "int8",
              "groupsize": INT4_GROUPSIZE if any_int4 else None, "linears": linears,
              "classifier": linears.get("output", "float"), "embedding": embedding or "float",
              "source": "gguf"}
    return sd, config
