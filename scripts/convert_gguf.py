"""Convert a llama- or qwen2-architecture GGUF file into a Hugging Face model directory.

    python scripts/convert_gguf.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
        [--dtype float32|bfloat16|float16]

The output is what ``transformers`` and ``generate.py --checkpoint DIR`` both load:
``config.json`` (LlamaForCausalLM or Qwen2ForCausalLM), ``generation_config.json`` (BOS and
the EOS ids),
``model.safetensors`` (dequantized weights in HF names, q/k rows in HF's rotate-half order),
``tokenizer.json`` and ``tokenizer_config.json`` (the GGUF's own tokenizer and chat template).
The default float32 keeps the dequantized values exactly (a 4-bit value times its block scale
is exact in float32, not always in bfloat16). Everything is written under temporary names and
renamed at the end, so a failed conversion leaves no half-written directory behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, OneLineParser, deprecated_alias


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", metavar="GGUF",
                   help="llama- or qwen2-architecture GGUF file (required)")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory (new or empty)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="dtype of the written weights (default float32: exact)")
    deprecated_alias(p, "--gguf", "--checkpoint")
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
import torch

from rocketkv.cli.common import DTYPES
from rocketkv.formats.checkpoint import (
    check_new_directory,
    hf_config,
    load_gguf,
    meta_to_hf_state_dict,
    write_directory,
)
from rocketkv.formats.tokenizer import gguf_tokenizer
from rocketkv.model import ConfigError


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32
            ) -> Path:
    """Write the Hugging Face directory ``out_dir`` for ``gguf_path``; returns it.

    Raises:
        ConfigError: unreadable or unsupported GGUF (see ``checkpoint.load_gguf``), a tokenizer
            that cannot be built from its metadata, or ``out_dir`` that exists and is not an
            empty directory.
    """
    from safetensors.torch import save_file

    out = check_new_directory(out_dir)
    args, sd = load_gguf(gguf_path, dtype)
    config = hf_config(args, dtype)
    tok = gguf_tokenizer(gguf_path)
    config["bos_token_id"] = tok.bos_id
    config["eos_token_id"] = list(tok.chat_stop_ids) if len(tok.chat_stop_ids) > 1 \
        else tok.chat_stop_ids[0]
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": config["eos_token_id"]}

    def fill(tmp: Path) -> None:
        save_file(meta_to_hf_state_dict(sd, args), tmp / "model.safetensors",
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        tok.save(tmp)

    return write_directory(out, fill)


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Convert as the parsed arguments ``a`` say; the exit status."""
    if a.checkpoint is None:  # not required=True: --gguf may give it
        build_parser().error("the following arguments are required: --checkpoint")
    try:
        out = convert(a.checkpoint, a.out, DTYPES[a.dtype])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
