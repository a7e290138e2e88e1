"""Where the real data lives: the models, tokenizers and texts that are not in the repository.

One place says it: ``../shared/data`` relative to the repository root, unless the environment
variable ``ROCKETKV_DATA`` names another directory. The scripts' default texts and the tests'
data files are paths under it; nothing here checks that they exist (a script reports a missing
file when it reads it, the tests skip outside CI).

    ROCKETKV_DATA=/data/rocketkv python scripts/eval_needle.py --checkpoint ...
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root (of a checkout)
DATA_ENV = "ROCKETKV_DATA"


def data_dir() -> Path:
    """The data directory: ``$ROCKETKV_DATA`` when set and not empty (``~`` expanded, relative
    to the working directory), else ``ROOT/../shared/data``."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else ROOT.parent / "shared" / "data"


DATA = data_dir()  # read once, when first imported
MODELS = DATA / "models"
TOKENIZERS = DATA / "tokenizers"
TEXT = DATA / "text"
ESSAYS = TEXT / "PaulGrahamEssays"  # the needle and RULER haystacks, the fidelity prompts
RULER_ESSAYS = TEXT / "RULER_PaulGrahamEssays.json"  # {"text": 3.05M chars}: long windows
TINYSTORIES_TEXTS = (TEXT / "tinystories_sample_cs336.txt",
                     TEXT / "tinystories_valid_excerpt_30KB.txt")
