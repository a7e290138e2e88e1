"""Write a weight-only int8 or int4 checkpoint (the format: ``quantized.py``).

    python quantize.py --checkpoint CKPT --mode int8 [--out DIR]
    python quantize.py --checkpoint CKPT --mode int4 --groupsize 32|64|128|256 [--out DIR]

``CKPT`` is anything ``generate.py --checkpoint`` takes: a Hugging Face directory, a GGUF file, a
converted directory, a short name, or ``random:NAME`` (random weights at a named config's shapes,
for benchmarks). The output directory (default: in the current directory, ``<name>-int8`` or
``<name>-int4-g<G>``, never beside the source; ``checkpoints/random-<NAME>-...`` for random
weights) is a converted
checkpoint (``model_args.json`` + ``model.safetensors``) plus ``quantization.json``, which
records the mode, the group size and the quantized layers, and the source's tokenizer.
Everything is written under a temporary name and renamed at the end: a failed run leaves
nothing behind. What is quantized and how it runs: ``quantized.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from torch import Tensor

from rocketkv.cli.common import DTYPES
from rocketkv.cli.quantize_flags import build_parser
from rocketkv.formats.checkpoint import (
    NATIVE_CONFIG,
    NATIVE_WEIGHTS,
    RANDOM_PREFIX,
    check_new_directory,
    checkpoint_args,
    read_checkpoint,
    resolve_checkpoint,
    write_directory,
)
from rocketkv.formats.gguf_reader import is_gguf
from rocketkv.formats.tokenizer import TOKENIZER_FILES, HFTokenizer, has_tokenizer, load_tokenizer
from rocketkv.model import ConfigError
from rocketkv.quantized import (
    FORMAT_VERSION,
    QUANT_CONFIG,
    check_quantizable,
    quantize_tensor,
    quantized_linears,
)


def default_out(checkpoint: str, mode: str, groupsize: int | None) -> Path:
    """``<source>-int8`` / ``<source>-int4-g<G>`` in the current directory (the source's stem
    for a file): never beside the source, whose folder may be read-only or shared;
    ``checkpoints/random-<NAME>-...`` for ``random:NAME``."""
    tag = mode if mode == "int8" else f"{mode}-g{groupsize}"
    if checkpoint.startswith(RANDOM_PREFIX):
        return Path("checkpoints") / f"random-{checkpoint[len(RANDOM_PREFIX):]}-{tag}"
    src = Path(checkpoint)
    return Path(f"{src.stem if src.is_file() else src.name}-{tag}")


def _save_tokenizer(source: str, out: Path) -> list[str]:
    """Copy the source's tokenizer into ``out`` (files named as ``load_tokenizer`` reads them);
    returns the names written (none for a source without a tokenizer)."""
    if source.startswith(RANDOM_PREFIX) or not has_tokenizer(source):
        return []
    tok = load_tokenizer(source)
    if isinstance(tok, HFTokenizer):  # tokenizer.json, a GGUF's metadata
        written = [p.name for p in tok.save(out)]
        generation = {"bos_token_id": tok.bos_id, "eos_token_id": list(tok.stop_ids)}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
        return written + ["generation_config.json"]
    src = Path(source)  # a SentencePiece or tiktoken tokenizer.model in a directory
    model_file = next(src / n for n in TOKENIZER_FILES if (src / n).is_file())
    shutil.copyfile(model_file, out / "tokenizer.model")
    written = ["tokenizer.model"]
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            written.append(name)
    return written


def quantize_checkpoint(checkpoint: str, mode: str, groupsize: int | None, out: str | Path,
                        classifier: str = "int8", dtype: torch.dtype | None = None,
                        device: str = "cpu", progress: bool = True) -> Path:
    """Write the quantized checkpoint directory ``out`` for ``checkpoint`` (module docstring).

    ``dtype``: the dtype of the tensors kept in float (embedding, norms, a float classifier):
    default as stored, except bfloat16 for a GGUF's dequantized tensors and random weights.
    ``device``: where the quantization arithmetic runs.

    Raises:
        ConfigError: see ``check_quantizable``; an already quantized source; ``out`` that
            exists and is not an empty directory; ``device`` cuda without CUDA; unreadable
            sources (``checkpoint.read_checkpoint``).
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine")
    out = check_new_directory(out)
    source = resolve_checkpoint(checkpoint)
    if Path(source).is_dir() and (Path(source) / QUANT_CONFIG).is_file():
        raise ConfigError(f"{checkpoint} is already quantized ({QUANT_CONFIG}); quantize its "
                          "float source instead")
    check_quantizable(checkpoint_args(source), mode, groupsize, classifier)  # before reading
    if dtype is None and not source.startswith(RANDOM_PREFIX) and is_gguf(source):
        # a GGUF's float tensors are dequantized blocks: float32 would store the embedding at
        # 2-8x its file's size (an int4 SmolLM2 was 2.2x its Q4_1 source); bfloat16's rounding
        # (2^-9 relative) is far below a 4-bit block's step and about an 8-bit block's
        dtype = torch.bfloat16
    args, sd, _ = read_checkpoint(source, dtype=dtype, random_dtype=dtype or torch.bfloat16)

    names = quantized_linears(args, mode, classifier)
    if args.tie_word_embeddings and "output" in names:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    stored: dict[str, Tensor] = {}
    for name, m in tqdm(names.items(), desc=f"quantize {mode}", unit="layer",
                        disable=not progress):
        w = sd.pop(f"{name}.weight").to(device)
        for suffix, t in quantize_tensor(w, m, groupsize).items():
            stored[f"{name}.{suffix}"] = t.cpu()
    if args.tie_word_embeddings:
        sd.pop("output.weight", None)
    stored.update({n: t.contiguous() for n, t in sd.items()})
    config = {"format_version": FORMAT_VERSION, "mode": mode, "groupsize": groupsize,
              "classifier": names.get("output", "float"),
              "embedding": "float", "linears": names, "source": checkpoint,
              "float_dtype": str(sd["tok_embeddings.weight"].dtype).removeprefix("torch."),
              "torch_version": torch.__version__}

    def fill(tmp: Path) -> None:
        save_file(stored, tmp / NATIVE_WEIGHTS, metadata={"format": "pt"})
        (tmp / NATIVE_CONFIG).write_text(json.dumps(args.to_dict(), indent=2))
        (tmp / QUANT_CONFIG).write_text(json.dumps(config, indent=2))
        _save_tokenizer(source, tmp)

    return write_directory(out, fill)


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Quantize as the parsed arguments ``a`` say; the exit status."""
    try:
        out = a.out or default_out(a.checkpoint, a.mode, a.groupsize)
        path = quantize_checkpoint(a.checkpoint, a.mode, a.groupsize, out,
                                   classifier=a.classifier,
                                   dtype=DTYPES[a.dtype] if a.dtype else None, device=a.device,
                                   progress=not a.no_progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # write_directory removed its temporary directory
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {path}")
    return 0


def entry(args=None) -> None:
    """``python quantize.py`` and the ``rocketkv quantize`` console command."""
    sys.exit(run(args) if args is not None else main())
