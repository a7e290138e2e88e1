"""Download a Hugging Face checkpoint (safetensors, config, tokenizer) with ``huggingface_hub``.

    python scripts/download.py --repo-id meta-llama/Llama-3.1-8B-Instruct [--out checkpoints/]
    python scripts/download.py --repo-id smollm2-135m     # a short name of generate.py

Gated models need a token (``--hf-token`` or the ``HF_TOKEN`` environment variable). The result
is a directory that ``generate.py --checkpoint`` loads as it is, by path or, in
``checkpoints/``, by its short name (``checkpoint.KNOWN_CHECKPOINTS``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import _here  # noqa: F401  (this checkout's engine: scripts/_here.py)

from rocketkv.flags import OneLineParser


def build_parser() -> OneLineParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo-id", required=True, help="e.g. meta-llama/Llama-3.1-8B-Instruct, or "
                   "a short name (llama-3.1-8b, mistral-7b-v0.2, qwen2.5-0.5b, smollm2-135m, ...)")
    p.add_argument("--out", metavar="DIR", default="checkpoints",
                   help="parent directory (default checkpoints/)")
    p.add_argument("--hf-token", default=os.environ.get("HF_TOKEN"))
    return p


if __name__ == "__main__":  # --help and usage errors before torch and the engine load
    ARGS = build_parser().parse_args()

# ruff: noqa: E402  (the engine's imports come after the arguments are parsed)
from rocketkv.formats.checkpoint import KNOWN_CHECKPOINTS

PATTERNS = ["config.json", "generation_config.json", "*.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model",
            "original/tokenizer.model"]


def download(repo_id: str, out_dir: str | Path, token: str | None = None) -> Path:
    """Fetch ``repo_id`` into ``out_dir/<repo name>``; returns that directory.

    Raises:
        RuntimeError: the hub is unreachable (offline), the repository does not exist, or
            access is denied; the message says which.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    target = Path(out_dir) / repo_id.split("/")[-1]
    try:
        path = snapshot_download(repo_id=repo_id, local_dir=target, allow_patterns=PATTERNS,
                                 token=token)
    except GatedRepoError:
        raise RuntimeError(f"{repo_id} is gated: accept its license on the hub and pass "
                           "--hf-token (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise RuntimeError(f"repository {repo_id} not found (or private without a token)") \
            from None
    except LocalEntryNotFoundError:
        raise RuntimeError(f"cannot reach the Hugging Face hub to download {repo_id} "
                           "(offline?); copy the checkpoint directory here by other means") \
            from None
    except OSError as e:  # connection errors surface as OSError subclasses
        raise RuntimeError(f"download of {repo_id} failed: {e}") from None
    return Path(path)


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))


def run(a) -> int:
    """Download as the parsed arguments ``a`` say; the exit status."""
    repo_id = KNOWN_CHECKPOINTS.get(a.repo_id, a.repo_id)
    try:
        path = download(repo_id, a.out, a.hf_token)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"downloaded {repo_id} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run(ARGS))
