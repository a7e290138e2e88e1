"""Checkpoint loading: Hugging Face directories, our converted directories, random weights.

Layouts accepted by ``load_model``:

* Hugging Face: ``config.json`` + ``model.safetensors`` or ``model.safetensors.index.json`` with
  its shards. Tensors are memory-mapped, renamed to ``model.py``'s names, q/k rows permuted from
  HF's rotate-half layout back to Meta's adjacent-pair RoPE layout, and q/k/v fused.
* Converted (``scripts/convert_*.py``): ``model_args.json`` + ``model.safetensors`` already in
  ``model.py``'s names and layout.
* ``random:NAME``: the named config of ``model.CONFIGS`` with random weights (cost depends on
  shapes, not values).
The tokenizer comes from ``tokenizer.model`` or ``original/tokenizer.model`` in the directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import Tensor

from model import ConfigError, ModelArgs, Transformer

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


def hf_to_meta_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Permute q or k projection rows from HF rotate-half order to Meta adjacent-pair order.

    ``w``: (n_heads * head_dim, dim). Within a head HF stores the first halves of all pairs,
    then the second halves; Meta interleaves them.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.view(n_heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def meta_to_hf_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of ``hf_to_meta_rope_rows``."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.view(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


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


def hf_state_dict(tensors: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename HF Llama/Mistral tensors to ``model.py`` names, permute q/k, fuse q/k/v."""
    sd: dict[str, Tensor] = {}
    for name, new in _HF_TOP_NAMES.items():
        if name in tensors:
            sd[new] = tensors.pop(name)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        try:
            q = hf_to_meta_rope_rows(tensors.pop(p + "self_attn.q_proj.weight"), args.n_heads)
            k = hf_to_meta_rope_rows(tensors.pop(p + "self_attn.k_proj.weight"), args.n_kv_heads)
            v = tensors.pop(p + "self_attn.v_proj.weight")
            sd[f"layers.{i}.attention.wqkv.weight"] = torch.cat([q, k, v])
            for hf_name, name in _HF_LAYER_NAMES.items():
                sd[f"layers.{i}.{name}"] = tensors.pop(p + hf_name)
        except KeyError as e:
            raise ConfigError(f"checkpoint lacks tensor {e.args[0]!r}") from None
    extra = [n for n in tensors if not re.search(r"rotary_emb\.inv_freq$", n)]
    if extra:
        raise ConfigError(f"unexpected tensors in checkpoint: {', '.join(extra[:5])}")
    return sd


def _materialize(args: ModelArgs, state_dict: dict[str, Tensor], device, dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_word_embeddings:
        state_dict.pop("output.weight", None)
    expected = {n for n, _ in model.named_parameters()}
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise ConfigError(f"checkpoint lacks weights: {', '.join(missing[:5])}")
    for name, p in model.named_parameters():
        if tuple(state_dict[name].shape) != tuple(p.shape):
            raise ConfigError(f"weight {name} has shape {tuple(state_dict[name].shape)}, "
                              f"config implies {tuple(p.shape)}")
    state_dict = {n: t.to(device=device, dtype=dtype) for n, t in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope = torch.empty(0, args.head_dim // 2, 2, device=device)
    return model.eval().requires_grad_(False)


def random_model(args: ModelArgs, device, dtype, seed: int = 0) -> Transformer:
    """Model of shape ``args`` with random weights (N(0, 0.02); norms 1), built on ``device``."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval().requires_grad_(False)


def load_model(checkpoint: str, device, dtype) -> Transformer:
    """Load ``checkpoint`` (a directory, or ``random:NAME``) onto ``device`` in ``dtype``.

    Raises:
        ConfigError: missing or unreadable directory, config without weights, unsupported
            architecture, or weights that do not match the config.
    """
    if checkpoint.startswith(RANDOM_PREFIX):
        return random_model(ModelArgs.from_name(checkpoint[len(RANDOM_PREFIX):]), device, dtype)
    ckpt = Path(checkpoint)
    if not ckpt.exists():
        raise ConfigError(f"checkpoint not found: {ckpt}")
    if not ckpt.is_dir():
        raise ConfigError(f"checkpoint must be a directory (HF layout or converted): {ckpt}")
    if not os.access(ckpt, os.R_OK | os.X_OK):
        raise ConfigError(f"checkpoint directory is not readable: {ckpt}")
    if (ckpt / NATIVE_CONFIG).is_file():
        cfg = _read_json(ckpt / NATIVE_CONFIG)
        try:
            args = ModelArgs(**cfg)
        except TypeError as e:
            raise ConfigError(f"bad {NATIVE_CONFIG} in {ckpt}: {e}") from None
        weights = ckpt / NATIVE_WEIGHTS
        if not weights.is_file():
            raise ConfigError(f"no {NATIVE_WEIGHTS} in {ckpt} (config without weights)")
        return _materialize(args, _load_tensors([weights], "cpu"), device, dtype)
    if (ckpt / "config.json").is_file():
        args = ModelArgs.from_hf_config(_read_json(ckpt / "config.json"), name=ckpt.name)
        tensors = _load_tensors(_safetensors_files(ckpt), "cpu")
        return _materialize(args, hf_state_dict(tensors, args), device, dtype)
    raise ConfigError(f"{ckpt} holds neither config.json (HF layout) nor {NATIVE_CONFIG} "
                      "(converted checkpoint)")


def save_native(out_dir: str | Path, args: ModelArgs, state_dict: dict[str, Tensor],
                tokenizer_file: str | Path | None) -> Path:
    """Write a converted checkpoint directory (``model_args.json``, ``model.safetensors``,
    ``tokenizer.model``). Files are written under temporary names, then renamed, so a failed
    conversion leaves nothing half-written."""
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
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, out / "tokenizer.model.tmp")
        pending.append("tokenizer.model")
    for name in pending:
        os.replace(out / (name + ".tmp"), out / name)
    return out
