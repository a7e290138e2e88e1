"""Convert a Hugging Face Llama/Mistral directory into a checkpoint directory of this project.

    python scripts/convert_hf_checkpoint.py --checkpoint HF_DIR --out DIR [--dtype bfloat16]

The output holds ``model_args.json``, one ``model.safetensors`` in ``model.py``'s names (q/k rows
already permuted to the adjacent-pair RoPE layout, q/k/v fused) and the tokenizer files
(``tokenizer.json`` with its config files, or ``tokenizer.model``), so loading skips the
renaming. ``generate.py`` also loads HF directories directly; converting is optional.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import DTYPE_NAMES, OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF directory (config.json + safetensors)")
    p.add_argument("--out", metavar="DIR", required=True, help="output checkpoint directory")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="cast weights (default: keep)")
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
import torch

from rocketkv.formats.checkpoint import load_model, save_native
from rocketkv.formats.tokenizer import TOKENIZER_FILES
from rocketkv.model import ConfigError

# files beside tokenizer.json that hold its special tokens, EOS ids and chat template
TOKENIZER_CONFIGS = ("tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                     "special_tokens_map.json")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Convert as the parsed arguments ``a`` say; the exit status."""
    src = Path(a.checkpoint)
    try:
        if not (src / "config.json").is_file():
            raise ConfigError(f"{src} is not a Hugging Face checkpoint (no config.json)")
        model = load_model(str(src), "cpu", DTYPES[a.dtype] if a.dtype else None)
        tok = next((src / n for n in TOKENIZER_FILES if (src / n).is_file()), None)
        files = [tok] if tok else []
        if tok is not None and tok.name == "tokenizer.json":
            files += [src / n for n in TOKENIZER_CONFIGS if (src / n).is_file()]
        out = save_native(a.out, model.args, model.state_dict(), files)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = "" if tok else " (no tokenizer found: pass --tokenizer to generate.py)"
    print(f"wrote {out}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
