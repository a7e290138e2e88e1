import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# The models under test are tiny: one thread avoids parallel-region overhead and contention.
torch.set_num_threads(1)

SHARED = ROOT.parent / "shared" / "data"
STORIES_BIN = SHARED / "models" / "stories260K.bin"
TOK512 = SHARED / "tokenizers" / "tok512.model"


def shared_file(path: Path) -> Path:
    """A file from ../shared/data; skip when absent outside CI, fail in CI."""
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing in CI")
        pytest.skip(f"{path} not available")
    return path


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory) -> Path:
    """stories260K converted with scripts/convert_llama2c.py."""
    from scripts.convert_llama2c import main as convert

    out = tmp_path_factory.mktemp("stories260K")
    rc = convert(["--checkpoint", str(shared_file(STORIES_BIN)),
                  "--tokenizer", str(shared_file(TOK512)), "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def stories_model(stories_dir):
    import torch

    from checkpoint import load_model

    return load_model(str(stories_dir), "cpu", torch.float32)
