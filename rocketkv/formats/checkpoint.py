"""Checkpoint loading: Hugging Face directories, GGUF files, our converted directories, random
weights, and the short names of the models our users run.

Layouts accepted by ``load_model``:

* Hugging Face (Llama, Mistral, Qwen2): ``config.json`` + ``model.safetensors`` or
  ``model.safetensors.index.json`` with its shards. Tensors are memory-mapped, renamed to
  ``model.py``'s names, q/k rows (and Qwen2's q/k biases) permuted from HF's rotate-half layout
  back to Meta's adjacent-pair RoPE layout, and q/k/v fused.
* Converted (``scripts/convert_*.py``): ``model_args.json`` + ``model.safetensors`` already in
  ``model.py``'s names and layout.
* GGUF (llama.cpp's format, ``*.gguf``): config from the GGUF metadata, tensors dequantized
  with the ``gguf`` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants and the
  other types it implements) to the run's dtype. For the llama architecture llama.cpp's
  converter stores the q/k rows in Meta's adjacent-pair RoPE order (it applies the same
  permutation as ``hf_to_meta_rope_rows``), which is ours: they load as they are. For qwen2 it
  stores them, and the q/k biases, in HF's rotate-half order (llama.cpp runs qwen2 with its
  NEOX, rotate-half RoPE), so they are permuted on load like an HF checkpoint's
  (``tests/test_gguf.py`` and ``tests/test_qwen2.py`` check both against transformers' GGUF
  reader). Opt-in, ``gguf_weights="quantized"`` keeps the 4-bit blocks as int4 and the other
  block types as int8 layers instead (``gguf_quantized.py``).
* ``random:NAME``: the named config of ``model.CONFIGS`` with random weights (cost depends on
  shapes, not values).
* A short name (``KNOWN_CHECKPOINTS``: ``llama-3.1-8b``, ``smollm2-135m``...): resolved to a
  local copy by ``resolve_checkpoint``.
The tokenizer (``tokenizer.py``) comes from the directory's ``tokenizer.json`` or
``tokenizer.model``, or from the GGUF file's own metadata.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rocketkv import tp
from rocketkv.data import MODELS
from rocketkv.flags import KNOWN_CHECKPOINTS, model_name  # KNOWN_CHECKPOINTS: re-exported
from rocketkv.formats.gguf_quantized import (
    GGUFLoader,
    check_gguf_weights,
    gguf_quantized_state_dict,
)
from rocketkv.formats.gguf_reader import (
    MISSING,
    forget_readers,
    gguf_field,
    is_gguf,
    open_gguf,
    release_pages,
)
from rocketkv.model import LLAMA31_ROPE, ConfigError, ModelArgs, Transformer, rope_inv_freq
from rocketkv.quantized import (
    QUANT_CONFIG,
    TORCH_DEQUANT,
    check_int8_activations,
    dequantize_blocks,
    load_quantized,
    output_dim,
    use_int8_activations,
)

NATIVE_CONFIG = "model_args.json"
NATIVE_WEIGHTS = "model.safetensors"
RANDOM_PREFIX = "random:"

_HF_LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _qwen2_window_applies(config: dict[str, Any]) -> bool:
    """Whether a Qwen2 ``config.json``'s ``sliding_window`` reaches any layer. As transformers'
    Qwen2Config reads it: only with ``use_sliding_window``, and then in the layers
    ``layer_types`` marks ``sliding_attention`` (by default those from ``max_window_layers``
    on). Qwen2.5 configs carry a window with ``use_sliding_window: false``."""
    if not config.get("use_sliding_window", False):
        return False
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return config.get("max_window_layers", 28) < config.get("num_hidden_layers", 0)


def args_from_hf_config(config: dict[str, Any], name: str | None = None) -> ModelArgs:
    """Read a Hugging Face ``config.json`` dict of a Llama, Mistral or Qwen2 model.

    Both the classic layout (``rope_theta`` + ``rope_scaling``) and the ``rope_parameters``
    layout written by transformers 5 are accepted. Qwen2 (``model_type`` qwen2) has q/k/v
    biases whatever ``attention_bias`` says; its sliding window counts only where the config
    enables it (``_qwen2_window_applies``). An enabled window narrower than the context is
    kept, and ``model.py`` refuses runs longer than it.

    Raises:
        ConfigError: unsupported architecture (not Llama/Mistral/Qwen2, Llama or Mistral
            with biases), a bad sliding window, unsupported rope type, or a missing field.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = config.get("architectures")
        raise ConfigError(f"unsupported architecture: model_type={model_type!r} "
                          f"architectures={archs!r} (supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    qwen2 = model_type == "qwen2"
    if not qwen2 and (config.get("attention_bias") or config.get("mlp_bias")):
        raise ConfigError("unsupported architecture: attention or MLP biases")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported activation {config.get('hidden_act')!r} (need silu)")
    window = config.get("sliding_window")
    if qwen2 and not _qwen2_window_applies(config):
        window = None
    max_pos = config.get("max_position_embeddings")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ConfigError(f"config.json: sliding_window must be a positive integer or "
                          f"null, got {window!r}")
    if window is not None and max_pos is not None and window >= max_pos:
        window = None  # the window spans the whole context: plain attention
    try:
        dim = config["hidden_size"]
        n_heads = config["num_attention_heads"]
        args = dict(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=config.get("head_dim") or dim // n_heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=window,
            qkv_bias=qwen2,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the field {e.args[0]!r}") from None

    rope = config.get("rope_parameters")
    if rope is None:  # classic layout
        rope = dict(config.get("rope_scaling") or {})
        rope["rope_theta"] = config.get("rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r} "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    args["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    if rope_type == "linear":
        args["rope_scaling"] = {"type": "linear", "factor": float(rope["factor"])}
    elif rope_type == "llama3":
        args["rope_scaling"] = {
            "type": "llama3",
            "factor": float(rope["factor"]),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        }
    return ModelArgs(name=name or config.get("_name_or_path") or model_type, **args)


def hf_to_meta_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Permute q or k projection rows from HF rotate-half order to Meta adjacent-pair order.

    ``w``: the weight (n_heads * head_dim, dim) or the bias (n_heads * head_dim,). Within a
    head HF stores the first halves of all pairs, then the second halves; Meta interleaves
    them.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def meta_to_hf_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of ``hf_to_meta_rope_rows``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _safetensors_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [ckpt / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"checkpoint shards listed in {index.name} are missing: "
                              f"{', '.join(missing)}")
        return files
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {ckpt} (config without weights)")
    return files


def _load_tensors(files: list[Path], device) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f, device=str(device)))  # memory-mapped read
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"cannot read weights {f}: {e}") from None
    return tensors


GATE_UP = ("w1", "w3")  # the MLP's gate and up projections as checkpoints store them


def fuse_gate_up(sd: dict[str, Tensor], n_layers: int,
                 quant: dict[str, Any] | None = None) -> dict[str, Tensor]:
    """Join each layer's MLP gate (``feed_forward.w1``) and up (``feed_forward.w3``)
    projections, as HF, GGUF and older converted or quantized checkpoints store them, into
    ``model.py``'s one ``feed_forward.w13`` (the gate's rows first), in place; layers already
    fused are left alone. Float weights (I, dim) twice -> (2 I, dim); a quantized layer's
    stored tensors alike along their output rows (int8 weight and per-row scales, int4 packed
    weight, int4 ``scales_and_zeros`` (dim / G, I, 2) along its dim 1), and ``quant``'s
    ``linears`` (``quantization.json``) renamed to match.

    Raises:
        ConfigError: a layer with one of the two projections and not the other, or with
            the two in different quantization modes.
    """
    linears = (quant or {}).get("linears", {})
    for i in range(n_layers):
        p = f"layers.{i}.feed_forward."
        gate, up = (f"{p}{n}" for n in GATE_UP)
        leaves = sorted({n.rsplit(".", 1)[1] for n in sd if n.startswith((gate + ".", up + "."))})
        for leaf in leaves:
            lone = [f"{n}.{leaf}" for n in (gate, up) if f"{n}.{leaf}" not in sd]
            if lone:
                raise ConfigError(f"checkpoint lacks tensor {lone[0]!r} (the MLP's gate and up "
                                  "projections come in pairs)")
            a, b = sd.pop(f"{gate}.{leaf}"), sd.pop(f"{up}.{leaf}")
            sd[f"{p}w13.{leaf}"] = torch.cat([a, b], dim=output_dim(leaf))
        if gate in linears or up in linears:
            modes = {linears.pop(gate, None), linears.pop(up, None)}
            if len(modes) != 1:
                raise ConfigError(f"{QUANT_CONFIG}: {gate} and {up} are quantized differently "
                                  f"({', '.join(sorted(map(str, modes)))})")
            linears[f"{p}w13"] = modes.pop()
    return sd


def qkv_names(args: ModelArgs) -> dict[str, str]:
    """``model.py``'s names (under ``layers.N.``) of the fused q/k/v weight and, for models
    with q/k/v biases (Qwen2), of their bias, keyed ``weight`` and ``bias``."""
    names = {"weight": "attention.wqkv.weight"}
    return names | ({"bias": "attention.wqkv_bias"} if args.qkv_bias else {})


def fused_qkv(q: Tensor, k: Tensor, v: Tensor, args: ModelArgs) -> Tensor:
    """``model.py``'s fused q/k/v weight or bias from HF's three (q/k rows in rotate-half
    order, permuted here to Meta's adjacent-pair order)."""
    return torch.cat([hf_to_meta_rope_rows(q, args.n_heads),
                      hf_to_meta_rope_rows(k, args.n_kv_heads), v])


def hf_state_dict(tensors: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename HF Llama/Mistral/Qwen2 tensors to ``model.py`` names, permute q/k, fuse q/k/v
    (and Qwen2's q/k/v biases)."""
    sd: dict[str, Tensor] = {}
    for name, new in _HF_TOP_NAMES.items():
        if name in tensors:
            sd[new] = tensors.pop(name)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        try:
            for kind, name in qkv_names(args).items():
                q, k, v = (tensors.pop(f"{p}self_attn.{n}_proj.{kind}") for n in "qkv")
                sd[f"layers.{i}.{name}"] = fused_qkv(q, k, v, args)
            for hf_name, name in _HF_LAYER_NAMES.items():
                sd[f"layers.{i}.{name}"] = tensors.pop(p + hf_name)
        except KeyError as e:
            raise ConfigError(f"checkpoint lacks tensor {e.args[0]!r}") from None
    extra = [n for n in tensors if not re.search(r"rotary_emb\.inv_freq$", n)]
    if extra:
        raise ConfigError(f"unexpected tensors in checkpoint: {', '.join(extra[:5])}")
    return fuse_gate_up(sd, args.n_layers)


def meta_to_hf_state_dict(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Inverse of ``hf_state_dict``: ``model.py`` names to Hugging Face Llama (Qwen2 with
    q/k/v biases) names, q/k/v split and q/k rows permuted back to HF's rotate-half order,
    the MLP's ``w13`` split into gate and up. A tied classifier is left out (HF ties it on
    load)."""
    top = {new: name for name, new in _HF_TOP_NAMES.items()}
    layer = {new: name for name, new in _HF_LAYER_NAMES.items()}
    qkv = {name: kind for kind, name in qkv_names(args).items()}
    D = args.head_dim
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if name in top:
            if not (name == "output.weight" and args.tie_word_embeddings):
                out[top[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        p = f"model.layers.{i}."
        if rest in qkv:
            q, k, v = t.split([args.n_heads * D, args.n_kv_heads * D, args.n_kv_heads * D])
            out[f"{p}self_attn.q_proj.{qkv[rest]}"] = meta_to_hf_rope_rows(q, args.n_heads)
            out[f"{p}self_attn.k_proj.{qkv[rest]}"] = meta_to_hf_rope_rows(k, args.n_kv_heads)
            out[f"{p}self_attn.v_proj.{qkv[rest]}"] = v
        elif rest == "feed_forward.w13.weight":
            gate, up = t.chunk(2)
            out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate, up
        else:
            out[p + layer[rest]] = t
    return {n: t.contiguous() for n, t in out.items()}


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for ``args`` (Qwen2ForCausalLM for a model with q/k/v
    biases, else LlamaForCausalLM); ``args_from_hf_config`` reads it back to the same
    ``ModelArgs``.

    Raises:
        ConfigError: RoPE frequency factors (GGUF ``rope_freqs``) that are not Llama 3.1's
            scaling, which config.json cannot express.
    """
    rope = args.rope_scaling
    if rope is not None and rope["type"] == "freq_factors":
        # llama.cpp writes factors only for Llama 3.1's scaling: recognize it
        llama31 = dataclasses.replace(args, rope_scaling=LLAMA31_ROPE)
        if not torch.allclose(rope_inv_freq(args), rope_inv_freq(llama31), rtol=1e-5):
            raise ConfigError("the GGUF's RoPE frequency factors are not Llama 3.1's scaling; "
                              "config.json cannot express them")
        rope = LLAMA31_ROPE
    rope_scaling = None if rope is None else {
        "rope_type": rope["type"], **{k: v for k, v in rope.items() if k != "type"}}
    if args.qkv_bias:  # Qwen2: a window, where there is one, in every layer
        arch = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "use_sliding_window": args.sliding_window is not None, "max_window_layers": 0}
    else:
        arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "attention_bias": False, "mlp_bias": False}
    return {
        **arch,
        "hidden_size": args.dim,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_word_embeddings,
        "sliding_window": args.sliding_window,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def meta_transformer(args: ModelArgs) -> Transformer:
    """``Transformer(args)`` with every parameter on the meta device (no memory), for loaders
    that fill it with a checkpoint's tensors. The modules' random initialization is skipped:
    on meta tensors it does nothing but import torch's Python decompositions on first use
    (1.5-2 s of every load on the 2-core VM)."""
    inits = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_")
    saved = {name: getattr(torch.nn.init, name) for name in inits}
    try:
        for name in inits:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            return Transformer(args)
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _materialize(args: ModelArgs, state_dict: dict[str, Tensor], device, dtype,
                 model: Transformer | None = None) -> Transformer:
    """``Transformer(args)`` on ``device`` with ``state_dict``'s tensors cast to ``dtype``.
    ``model``: one built on the meta device whose quantized layers are already real
    (``quantized.load_quantized``); only its meta parameters are loaded here."""
    if model is None:
        model = meta_transformer(args)
    tied = args.tie_word_embeddings and isinstance(model.output, torch.nn.Linear)
    if tied:
        state_dict.pop("output.weight", None)
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.is_meta}
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise ConfigError(f"checkpoint lacks weights: {', '.join(missing[:5])}")
    extra = sorted(state_dict.keys() - expected)
    if extra:
        raise ConfigError(f"unexpected weights in checkpoint: {', '.join(extra[:5])}")
    for name in expected:
        if tuple(state_dict[name].shape) != tuple(params[name].shape):
            raise ConfigError(f"weight {name} has shape {tuple(state_dict[name].shape)}, "
                              f"config implies {tuple(params[name].shape)}")
    state_dict = {n: t.to(device=device, dtype=dtype) for n, t in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    model.rope = torch.empty(0, args.head_dim // 2, 2, device=device)
    return model.eval().requires_grad_(False)


def random_model(args: ModelArgs, device, dtype, seed: int = 0,
                 shard: tuple[int, int] = (0, 1)) -> Transformer:
    """Model of shape ``args`` with random weights (N(0, 0.02); norms 1), built on ``device``
    directly in ``dtype`` (no float32 copy first). Models over 1 GiB show a progress bar on
    stderr while their weights are drawn (minutes for an 8B model on a CPU). ``shard`` (rank,
    world size): that rank's share under tensor parallelism (``tp.py``), the same values as
    sharding the whole model: each tensor is drawn whole, one at a time, and sliced."""
    rank, world = shard
    whole = dict(meta_transformer(args).named_parameters()) if world > 1 else None
    model = meta_transformer(tp.local_args(args, world))
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = list(model.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in params)
    if total > 2**30:
        try:  # tqdm is optional here: random-weight benchmarks need torch alone
            from tqdm import tqdm

            params = tqdm(params, desc=f"random weights ({total / 2**30:.1f} GiB)",
                          unit="tensor", file=sys.stderr)
        except ImportError:
            print(f"drawing {total / 2**30:.1f} GiB of random weights...", file=sys.stderr)
    with torch.no_grad():
        for name, p in params:
            t = p if whole is None else torch.empty(whole[name].shape, dtype=dtype,
                                                    device=device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            if whole is not None:
                p.copy_(tp.shard_tensor(name, t, args, rank, world))
                del t
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model = model.eval().requires_grad_(False)
    return tp.attach(model, rank, world, args) if world > 1 else model


# --------------------------------------------------------------------------------------------
# GGUF


GGUF_ARCHITECTURES = ("llama", "qwen2")  # Mistral 7B files are labelled llama too
# Architectures whose q/k rows (and biases) llama.cpp's converter leaves in HF's rotate-half
# order, as its NEOX RoPE type expects; llama files hold Meta's adjacent-pair order
GGUF_ROTATE_HALF = ("qwen2",)
GGUF_QKV_BIAS = ("qwen2",)  # blk.N.attn_{q,k,v}.bias


def gguf_args(reader, name: str | None = None) -> ModelArgs:
    """``ModelArgs`` from a llama- or qwen2-architecture GGUF's metadata.

    Fields (``A`` = ``general.architecture``, ``llama`` or ``qwen2``): ``A.block_count``,
    ``A.embedding_length``, ``A.feed_forward_length``, ``A.attention.head_count(_kv)``,
    ``A.attention.key_length`` or ``A.rope.dimension_count`` (head_dim), ``A.context_length``,
    ``A.rope.freq_base``, ``A.rope.scaling.type``/``.factor`` (linear),
    ``A.attention.layer_norm_rms_epsilon``. The vocabulary size and the tied classifier (no
    ``output.weight``) come from the tensors; a ``rope_freqs.weight`` tensor (llama.cpp's form
    of Llama 3.1 RoPE scaling: one divisor per frequency) becomes ``rope_scaling = {"type":
    "freq_factors", ...}``. qwen2 has q/k/v biases (``GGUF_QKV_BIAS``).

    Raises:
        ConfigError: another architecture, mixture of experts, partial rotary, an unsupported
            RoPE scaling, or a missing field.
    """
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture in GGUF: {arch!r} (supported: "
                          f"{', '.join(GGUF_ARCHITECTURES)}, which includes Mistral)")
    if gguf_field(reader, f"{arch}.expert_count", 0):
        raise ConfigError("unsupported architecture: mixture of experts in GGUF")

    def get(key, default=MISSING):
        return gguf_field(reader, f"{arch}.{key}", default)

    dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", 0) or get("rope.dimension_count", 0)
                   or dim // n_heads)
    n_rot = int(get("rope.dimension_count", head_dim))
    if n_rot != head_dim:
        raise ConfigError(f"unsupported architecture: partial rotary embedding ({n_rot} of "
                          f"{head_dim} dims)")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError("GGUF file lacks the tensor 'token_embd.weight'")
    rope_scaling = None
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        rope_scaling = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind not in ("none", None, ""):
        raise ConfigError(f"unsupported rope scaling in GGUF: {kind!r} (supported: linear, "
                          "and Llama 3.1's rope_freqs)")
    if "rope_freqs.weight" in tensors:
        factors = _dequantize(tensors["rope_freqs.weight"]).reshape(-1)
        rope_scaling = {"type": "freq_factors", "factors": [float(f) for f in factors]}
    return ModelArgs(
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are (in, out)
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_seq_len=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=arch in GGUF_QKV_BIAS,
        name=name or gguf_field(reader, "general.name", None) or arch,
    )


_GGUF_LAYER_NAMES = {
    "attn_output.weight": "attention.wo.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "attn_norm.weight": "attention_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight":
                   "norm.weight", "output.weight": "output.weight"}


def _dequantize(tensor) -> Tensor:
    """One GGUF tensor as float32, shaped (out, in) like ``nn.Linear.weight``: the block
    formats of ``TORCH_DEQUANT`` in torch, the rest by the ``gguf`` package.

    Raises:
        ConfigError: a quantization type the ``gguf`` package cannot dequantize.
    """
    import gguf

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dim first
    kind = tensor.tensor_type.name
    if kind in TORCH_DEQUANT:
        return dequantize_blocks(tensor.data, kind).reshape(shape)
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ConfigError(f"tensor {tensor.name} has quantization type "
                          f"{tensor.tensor_type.name}, which the gguf package cannot "
                          "dequantize") from None
    return torch.from_numpy(values.astype("float32", copy=True).reshape(shape))


def gguf_state_dict(reader, args: ModelArgs, dtype: torch.dtype | None = None
                    ) -> dict[str, Tensor]:
    """``model.py``'s state dict from a llama- or qwen2-architecture GGUF: tensors renamed,
    dequantized one at a time and cast to ``dtype`` (default float32), q/k/v fused (weights,
    and qwen2's biases). llama's q/k rows stay as stored (Meta's adjacent-pair RoPE order,
    which llama.cpp's converter writes); qwen2's are stored in HF's rotate-half order and
    permuted like an HF checkpoint's (``GGUF_ROTATE_HALF``).

    Raises:
        ConfigError: a missing or unexpected tensor, or an undequantizable type.
    """
    dtype = dtype or torch.float32
    tensors = {t.name: t for t in reader.tensors}
    tensors.pop("rope_freqs.weight", None)  # in args.rope_scaling

    def take(name: str) -> Tensor:
        if name not in tensors:
            raise ConfigError(f"GGUF file lacks the tensor {name!r}")
        return _dequantize(tensors.pop(name)).to(dtype)

    sd: dict[str, Tensor] = {}
    for name, new in _GGUF_TOP_NAMES.items():
        if name in tensors or name != "output.weight":
            sd[new] = take(name)
    rotate_half = gguf_field(reader, "general.architecture") in GGUF_ROTATE_HALF
    for i in range(args.n_layers):
        p = f"blk.{i}."
        for kind, name in qkv_names(args).items():
            q, k, v = (take(f"{p}attn_{n}.{kind}") for n in "qkv")
            sd[f"layers.{i}.{name}"] = (fused_qkv(q, k, v, args) if rotate_half
                                        else torch.cat([q, k, v]))
        for name, new in _GGUF_LAYER_NAMES.items():
            sd[f"layers.{i}.{new}"] = take(p + name)
    if tensors:
        raise ConfigError(f"unexpected tensors in GGUF file: {', '.join(list(tensors)[:5])}")
    return fuse_gate_up(sd, args.n_layers)


def load_gguf(path: str | Path, dtype: torch.dtype | None = None
              ) -> tuple[ModelArgs, dict[str, Tensor]]:
    """Config and state dict (``dtype``, default float32) of a llama- or qwen2-architecture
    GGUF file.

    Raises:
        ConfigError: see ``open_gguf``, ``gguf_args`` and ``gguf_state_dict``.
    """
    reader = open_gguf(path)
    args = gguf_args(reader, name=None)
    return args, gguf_state_dict(reader, args, dtype)


# --------------------------------------------------------------------------------------------
# Short names

CHECKPOINT_DIRS = (Path("checkpoints"), Path(__file__).resolve().parents[2] / "checkpoints")


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of ``repo_id`` in the Hugging Face cache (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, no huggingface_hub, or a broken cache: not found
        return None
    return path if (path / "config.json").is_file() else None


def resolve_checkpoint(checkpoint: str) -> str:
    """A ``--checkpoint`` value made a loadable path.

    Paths are returned as they are, ``random:NAME`` with NAME in its one spelling
    (``flags.model_name``). A name of ``KNOWN_CHECKPOINTS``
    resolves to a local copy: in ``checkpoints/`` (of the working directory, then of this
    project) the directory ``scripts/download.py`` writes (the repository's name), a directory
    or ``.gguf`` file named after the short name, or a GGUF of the repository
    (``<repo name>*.gguf``); then the Hugging Face cache (local files only).

    Raises:
        ConfigError: a known name with no local copy; the message gives the command that
            downloads it.
    """
    if checkpoint.startswith(RANDOM_PREFIX):  # an old spelling of the shape's name: noted once
        return RANDOM_PREFIX + model_name(checkpoint[len(RANDOM_PREFIX):])
    if Path(checkpoint).exists():
        return checkpoint
    checkpoint = model_name(checkpoint)
    if checkpoint not in KNOWN_CHECKPOINTS:
        return checkpoint
    repo_id = KNOWN_CHECKPOINTS[checkpoint]
    repo_name = repo_id.split("/")[-1]
    dirs = list(dict.fromkeys(d.resolve() for d in CHECKPOINT_DIRS))
    for d in dirs:
        candidates = [d / repo_name, d / checkpoint, d / f"{checkpoint}.gguf",
                      *sorted(d.glob(f"{repo_name}*.gguf"))]
        for c in candidates:
            if c.is_file() or (c.is_dir() and ((c / "config.json").is_file()
                                               or (c / NATIVE_CONFIG).is_file())):
                return str(c)
    cached = _hf_cache_snapshot(repo_id)
    if cached is not None:
        return str(cached)
    raise ConfigError(f"checkpoint {checkpoint!r} ({repo_id}) is not on this machine (looked in "
                      f"{' and '.join(str(d) for d in dirs)} and the Hugging Face cache); "
                      f"download it with: python scripts/download.py --repo-id {repo_id}")


DEFAULT_CHECKPOINT = "smollm2-135m"  # what a command runs without --checkpoint
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # its file in the data directory


def default_checkpoint() -> str:
    """The checkpoint a command runs when none is given: SmolLM2-135M-Instruct, a small instruct
    model with an 8K context (``DEFAULT_GGUF`` in the data directory's ``models/``,
    ``rocketkv.data.MODELS``; else a local copy of the short name ``smollm2-135m``, as
    ``resolve_checkpoint`` finds one).

    Raises:
        ConfigError: none on this machine; the message says how to get it.
    """
    gguf = MODELS / DEFAULT_GGUF
    if gguf.is_file():
        return str(gguf)
    try:
        return resolve_checkpoint(DEFAULT_CHECKPOINT)
    except ConfigError:
        raise ConfigError(f"no --checkpoint given, and the default model is not on this machine "
                          f"(not {gguf}, nor {DEFAULT_CHECKPOINT} in checkpoints/ or the Hugging "
                          f"Face cache): download it with python scripts/download.py --repo-id "
                          f"{KNOWN_CHECKPOINTS[DEFAULT_CHECKPOINT]}, or pass --checkpoint"
                          ) from None


def is_quantized(checkpoint: str) -> bool:
    """Whether ``checkpoint`` (a resolved path) is a ``quantize.py`` directory."""
    return (Path(checkpoint) / QUANT_CONFIG).is_file()


def checkpoint_args(checkpoint: str) -> ModelArgs:
    """The config of ``checkpoint`` (resolved path or ``random:NAME``) without reading its
    weights.

    Raises:
        ConfigError: see ``read_checkpoint``.
    """
    if checkpoint.startswith(RANDOM_PREFIX):
        return ModelArgs.from_name(checkpoint[len(RANDOM_PREFIX):])
    ckpt = _checked_path(checkpoint)
    if is_gguf(ckpt):
        return gguf_args(open_gguf(ckpt))
    if (ckpt / NATIVE_CONFIG).is_file():
        return _native_args(ckpt)
    return args_from_hf_config(_read_json(ckpt / "config.json"), name=ckpt.name)


def _checked_path(checkpoint: str) -> Path:
    ckpt = Path(resolve_checkpoint(checkpoint))
    if not ckpt.exists():
        raise ConfigError(f"checkpoint not found: {ckpt} (a directory, a .gguf file, random:NAME "
                          f"or one of {', '.join(KNOWN_CHECKPOINTS)})")
    if ckpt.is_file() and not os.access(ckpt, os.R_OK):
        raise ConfigError(f"checkpoint file is not readable: {ckpt}")
    if is_gguf(ckpt):
        return ckpt
    if not ckpt.is_dir():
        raise ConfigError(f"checkpoint must be a directory (HF layout or converted) or a GGUF "
                          f"file: {ckpt}")
    if not os.access(ckpt, os.R_OK | os.X_OK):
        raise ConfigError(f"checkpoint directory is not readable: {ckpt}")
    if not (ckpt / NATIVE_CONFIG).is_file() and not (ckpt / "config.json").is_file():
        raise ConfigError(f"{ckpt} holds neither config.json (HF layout) nor {NATIVE_CONFIG} "
                          "(converted checkpoint)")
    return ckpt


def _native_args(ckpt: Path) -> ModelArgs:
    try:
        return ModelArgs(**_read_json(ckpt / NATIVE_CONFIG))
    except TypeError as e:
        raise ConfigError(f"bad {NATIVE_CONFIG} in {ckpt}: {e}") from None


def read_checkpoint(checkpoint: str, dtype: torch.dtype | None = None,
                    random_dtype: torch.dtype = torch.float32, gguf_weights: str = "float"
                    ) -> tuple[ModelArgs, dict[str, Tensor], dict[str, Any] | None]:
    """Config, state dict (``model.py``'s names, on the CPU) and quantization config
    (``quantized.QUANT_CONFIG``; None for float checkpoints) of ``checkpoint``.

    Float tensors are cast to ``dtype`` when given, else kept as stored (GGUF tensors are
    dequantized to float32; ``random:NAME`` weights are drawn in ``random_dtype``); a quantized
    checkpoint's tensors are always returned as stored. ``gguf_weights`` ``"quantized"`` or
    ``"quantized-int8-classifier"`` or ``"quantized-w8a8"`` (GGUF files only; the last two
    with an int8 classifier): the GGUF's 4-bit and other
    block-quantized layers as a quantized checkpoint's int4/int8 tensors and config
    (``gguf_quantized``), the rest in ``dtype``.

    Raises:
        ConfigError: missing or unreadable checkpoint, config without weights, unsupported
            architecture or quantization type, truncated file; ``gguf_weights`` not one of
            ``gguf_quantized.GGUF_WEIGHTS``, or ``"quantized"`` for a checkpoint that is not
            a GGUF file.
    """
    check_gguf_weights(gguf_weights)
    if gguf_weights != "float" and (checkpoint.startswith(RANDOM_PREFIX)
                                    or not is_gguf(_checked_path(checkpoint))):
        raise ConfigError(f"--gguf-weights {gguf_weights} applies to GGUF checkpoints only, "
                          f"not {checkpoint}")
    if checkpoint.startswith(RANDOM_PREFIX):
        args = ModelArgs.from_name(checkpoint[len(RANDOM_PREFIX):])
        model = random_model(args, "cpu", dtype or random_dtype)
        return args, dict(model.state_dict()), None
    ckpt = _checked_path(checkpoint)
    if is_gguf(ckpt) and gguf_weights != "float":
        reader = open_gguf(ckpt)
        args = gguf_args(reader, name=None)
        sd, quant = gguf_quantized_state_dict(
            reader, args, dtype or torch.float32,
            classifier="float" if gguf_weights == "quantized" else "int8",
            loader=GGUFLoader(dequantize=_dequantize, rope_rows=hf_to_meta_rope_rows,
                              layer_names=_GGUF_LAYER_NAMES, rotate_half=GGUF_ROTATE_HALF,
                              fused_qkv=fused_qkv, qkv_names=qkv_names))
        return args, sd, quant
    if is_gguf(ckpt):
        args, sd = load_gguf(ckpt, dtype)
        return args, sd, None
    if (ckpt / NATIVE_CONFIG).is_file():
        args = _native_args(ckpt)
        weights = ckpt / NATIVE_WEIGHTS
        if not weights.is_file():
            raise ConfigError(f"no {NATIVE_WEIGHTS} in {ckpt} (config without weights)")
        sd = _load_tensors([weights], "cpu")
        quant = _read_json(ckpt / QUANT_CONFIG) if (ckpt / QUANT_CONFIG).is_file() else None
        fuse_gate_up(sd, args.n_layers, quant)  # files written before w1/w3 were fused
    else:
        args = args_from_hf_config(_read_json(ckpt / "config.json"), name=ckpt.name)
        sd = hf_state_dict(_load_tensors(_safetensors_files(ckpt), "cpu"), args)
        quant = None
    if dtype is not None and quant is None:
        sd = {n: t.to(dtype) if t.is_floating_point() else t for n, t in sd.items()}
    return args, sd, quant


def load_model(checkpoint: str, device, dtype, shard: tuple[int, int] = (0, 1),
               gguf_weights: str = "float") -> Transformer:
    """Load ``checkpoint`` (a directory, a GGUF file, ``random:NAME`` or a short name of
    ``KNOWN_CHECKPOINTS``) onto ``device`` in ``dtype`` (the activation dtype; a quantized
    checkpoint from ``quantize.py`` keeps its int8/int4 layers, laid out for ``device``).
    ``gguf_weights``: ``"float"`` (default) dequantizes a GGUF's weights to ``dtype``;
    ``"quantized"`` keeps its 4-bit blocks as int4 (groups of 32, exact up to the scales'
    dtype) and its other block types as per-channel int8, the embedding and classifier in
    ``dtype``; ``"quantized-int8-classifier"`` also the classifier in int8
    (``gguf_quantized``); ``"quantized-w8a8"`` as that, its int8 layers and classifier then
    running on int8 activations at decode (CPU only, ``quantized.use_int8_activations``).
    ``shard`` (rank, world size): only that rank's share under tensor parallelism
    (``tp.shard_state_dict``; float, int8 and int4 alike) reaches the device, and the model
    is that rank's (``tp.attach``).

    Raises:
        ConfigError: missing or unreadable checkpoint, config without weights, unsupported
            architecture or quantization type, truncated file, weights that do not match
            the config, a quantized layout with no kernel for ``device``/``dtype``, or a world
            size that does not split the model; a bad ``gguf_weights`` (``read_checkpoint``),
            or ``"quantized-w8a8"`` off the CPU or without fbgemm.
    """
    rank, world = shard
    check_gguf_weights(gguf_weights)
    if gguf_weights == "quantized-w8a8":
        check_int8_activations(device)
    if checkpoint.startswith(RANDOM_PREFIX) and gguf_weights == "float":
        return random_model(ModelArgs.from_name(checkpoint[len(RANDOM_PREFIX):]), device, dtype,
                            shard=shard)
    gguf = _is_gguf_path(checkpoint)
    args, sd, quant = read_checkpoint(checkpoint, dtype=dtype if gguf else None,
                                      gguf_weights=gguf_weights)
    local = args
    if world > 1:
        sd = tp.shard_state_dict(sd, args, rank, world, (quant or {}).get("groupsize"))
        local = tp.local_args(args, world)
    if quant is not None:
        model = load_quantized(meta_transformer(local), sd, quant, device, dtype, _materialize)
    else:
        model = _materialize(local, sd, device, dtype)
    del sd
    if gguf:  # the weights are built: the file's pages and parsed fields leave our RSS
        release_pages(open_gguf(resolve_checkpoint(checkpoint)))
        forget_readers()
    if gguf_weights == "quantized-w8a8":
        use_int8_activations(model)
    if torch.device(device).type == "cpu":
        _trim_heap()
    return tp.attach(model, rank, world, args) if world > 1 else model


def default_gguf_weights(gguf_weights: str | None, checkpoint: str, device) -> str:
    """``gguf_weights`` when given, else the default of ``generate.py --gguf-weights`` and
    ``rocketkv.load``: ``"quantized-int8-classifier"`` for a GGUF checkpoint on the CPU (its
    blocks read as int4/int8 by torch's CPU kernels, the classifier int8 as ``quantize.py``'s
    default keeps it: dev-split mean KL 0.0027 and 0.0020 nats to the float load on SmolLM2
    and Qwen2.5-0.5B; Qwen's decode 1.9x faster than with the float32 classifier,
    docs/quantization.md), else ``"float"`` (CUDA's quantized paths have not been timed on a
    GPU).

    ``"quantized-w8a8"`` (int8 activations) stays opt-in: it met a KL rule set for a default
    (dev-split mean KL 0.0062 and 0.0055 nats, under 0.01), yet on SmolLM2 it changes the
    README's chat answer from its first token, and eager it was no faster on Qwen."""
    if gguf_weights is not None:
        return gguf_weights
    cpu = torch.device(device).type == "cpu"
    return "quantized-int8-classifier" if cpu and _is_gguf_path(checkpoint) else "float"


def _trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; nothing where
    the C library has none). The load's temporaries (dequantized and repacked copies) leave
    hundreds of MiB free but resident in the heap: 234 MiB for SmolLM2-135M with
    ``--gguf-weights quantized``, which every later peak of the process would count."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _is_gguf_path(checkpoint: str) -> bool:
    return is_gguf(resolve_checkpoint(checkpoint))


def check_creatable(out: str | Path, start: Path) -> None:
    """ConfigError (naming ``--out {out}``) unless a directory can be created in ``start``'s
    nearest existing ancestor (``start`` itself when it exists): it must be a directory, and
    writable: permissions, a read-only filesystem, or one such as ``/proc`` that takes no new
    directories whatever its permission bits say (``os.access`` says yes to root there, so a
    probe directory is made and removed at once)."""
    import tempfile

    parent = start.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {parent} is not writable (permissions or a read-only "
                          "filesystem)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe.", dir=parent))
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create a directory in {parent} "
                          f"({e.strerror or e})") from None


def check_new_directory(out: str | Path) -> Path:
    """``out`` as a Path; ConfigError when it exists and is not an empty directory, or when it
    cannot be made (``check_creatable``). Called before expensive work, and again by
    ``write_directory``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory")
    check_creatable(out, out.absolute().parent)
    return out


def write_directory(out: str | Path, fill) -> Path:
    """Create the directory ``out`` whole: ``fill(tmp)`` writes its files into a temporary
    directory beside it, which is then made readable (files 0644, directory 0755) and renamed
    to ``out``. If ``fill`` fails, nothing is left behind.

    Raises:
        ConfigError: ``out`` exists and is not an empty directory, or cannot be made (checked
            before ``fill``); the filesystem refuses the directory or a file ``fill`` writes
            (the OS's reason, e.g. a full disk). ``fill``'s own errors propagate as they are.
    """
    import shutil
    import tempfile

    out = check_new_directory(out)
    prefix = f".{out.name}."

    def temporaries() -> set[Path]:  # this output's temporary folders beside it
        return {p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()}

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        before = temporaries()
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
        fill(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException as e:
        # tmp None: interrupted (Ctrl-C) between mkdtemp making the folder and returning it
        for made in [tmp] if tmp is not None else temporaries() - before:
            shutil.rmtree(made, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConfigError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return out


def save_native(out_dir: str | Path, args: ModelArgs, state_dict: dict[str, Tensor],
                tokenizer_files: list[str | Path] = ()) -> Path:
    """Write a converted checkpoint directory (``model_args.json``, ``model.safetensors`` and
    copies of ``tokenizer_files``: a ``*.model`` file, SentencePiece or tiktoken, as
    ``tokenizer.model``; others, ``tokenizer.json`` and its config files, under their names).
    Files are written under temporary names, then renamed, so a failed conversion leaves
    nothing half-written."""
    import shutil

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {n: t.contiguous() for n, t in state_dict.items()
          if not (args.tie_word_embeddings and n == "output.weight")}
    pending = []
    save_file(sd, out / (NATIVE_WEIGHTS + ".tmp"))
    pending.append(NATIVE_WEIGHTS)
    with open(out / (NATIVE_CONFIG + ".tmp"), "w") as f:
        json.dump(args.to_dict(), f, indent=2)
    pending.append(NATIVE_CONFIG)
    for src in tokenizer_files:
        name = "tokenizer.model" if Path(src).suffix == ".model" else Path(src).name
        shutil.copyfile(src, out / (name + ".tmp"))
        pending.append(name)
    for name in pending:
        (out / (name + ".tmp")).chmod(0o644)
        os.replace(out / (name + ".tmp"), out / name)
    return out
