import getpass
import os
import sys
import tempfile
from pathlib import Path

import pytest

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    # no GPU: the Triton kernels (kernels/sparse.py) run in Triton's interpreter; it reads
    # this when the kernels are defined, so before anything imports them
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rocketkv.data import DATA, ESSAYS  # noqa: E402,F401  (ESSAYS: for the tests to import)

# The models under test are tiny: one thread avoids parallel-region overhead and contention
# (pytest-xdist runs one test process per core). The CLIs the tests start as subprocesses
# inherit OMP_NUM_THREADS.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _one_thread_again():
    """A test that runs a CLI in-process with ``--threads N`` sets torch's global thread count;
    restore 1 after it, or every later test in that process competes with the other xdist
    process for the cores (a 10-second test took 60 in a suite run)."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)

@pytest.fixture(autouse=True)
def _own_step_ledger(tmp_path_factory, monkeypatch):
    """Each test its own ``$ROCKETKV_CACHE_DIR`` (the CPU step ledger, ``engine.step_ledger``),
    so what one test's runs record never turns another's default step into a compiled one."""
    monkeypatch.setenv("ROCKETKV_CACHE_DIR", str(tmp_path_factory.mktemp("rocketkv-cache")))


# Inductor's compiled code stays where torch keeps it by default (shared by the suite's
# processes and runs), not under each test's ROCKETKV_CACHE_DIR
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))

SHARED = DATA  # ../shared/data, or $ROCKETKV_DATA (rocketkv/data.py)
STORIES_BIN = SHARED / "models" / "stories260K.bin"
TOK512 = SHARED / "tokenizers" / "tok512.model"
SMOLLM2_GGUF = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sigint_default() -> None:
    """``preexec_fn`` of a test's child process that is sent SIGINT: SIGINT's default action
    restored, since a shell running the suite in the background (``pytest ... &``) starts it
    with SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def shared_file(path: Path) -> Path:
    """A file from the data directory (``rocketkv.data.DATA``); skip when absent outside CI, fail
    in CI."""
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

    from rocketkv.formats.checkpoint import load_model

    return load_model(str(stories_dir), "cpu", torch.float32)


@pytest.fixture
def prefill_starts(monkeypatch) -> list:
    """Every ``Transformer.prefill`` of the test as (start, tokens): what was prefilled."""
    from rocketkv.model import Transformer

    starts: list = []
    prefill = Transformer.prefill

    def spy(self, tokens, start=0, on_layer=None):
        starts.append((start, tokens.shape[1]))
        return prefill(self, tokens, start, on_layer)

    monkeypatch.setattr(Transformer, "prefill", spy)
    return starts


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct loaded by our GGUF loader, float32 on CPU."""
    import torch

    from rocketkv.formats.checkpoint import load_model

    return load_model(str(shared_file(SMOLLM2_GGUF)), "cpu", torch.float32)


@pytest.fixture(scope="session")
def hf_smollm2():
    """The same GGUF through transformers' own GGUF reader (the independent reference)."""
    import torch

    transformers = pytest.importorskip("transformers")
    path = shared_file(SMOLLM2_GGUF)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th collected test from the I-th (0-based): N processes "
                          "of I = 0..N-1 share a file's tests (scripts/gpu_checklist.sh: the "
                          "CUDA tests of one file in parallel processes, under a time limit)")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is None:
        return
    try:
        i, n = (int(v) for v in shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--shard {shard}: expected I/N with 0 <= I < N") from None
    keep = [t for j, t in enumerate(items) if j % n == i]
    config.hook.pytest_deselected(items=[t for j, t in enumerate(items) if j % n != i])
    items[:] = keep
