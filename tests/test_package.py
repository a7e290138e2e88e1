"""The installed package: one import name (``rocketkv``) that works from any folder, whatever
files of its own the folder holds; the ``rocketkv`` console command; the commands of a checkout."""

import os
import subprocess
import sys

from conftest import ROOT

# Names the engine's modules had at the repository's root once; most ML projects hold one.
COMMON_NAMES = ("model", "generate", "tokenizer", "errors", "cli", "step", "session", "report",
                "checks", "flags", "kv_cache", "quantize", "checkpoint", "scripts", "tools",
                "evals", "compression", "kernels")


def run_in(folder, code: str) -> subprocess.CompletedProcess:
    """``python -c code`` started in ``folder`` (first on ``sys.path``, as for a user's script),
    with this checkout importable as the install puts it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_folder_with_its_own_model_py_changes_nothing(tmp_path, stories_dir):
    """A project folder holding its own ``model.py``, ``generate.py``, ``tokenizer.py``,
    ``errors.py``, ``cli.py`` (and packages named ``scripts``, ``tools``, ``evals``...) loads
    and runs the engine through ``import rocketkv``: the folder's files are not imported."""
    for name in COMMON_NAMES:
        if name in ("scripts", "tools", "evals", "compression", "kernels"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} of the "
                                                         "project was imported')\n")
        else:
            (tmp_path / f"{name}.py").write_text(f"raise ImportError('{name}.py of the "
                                                 "project was imported')\n")
    p = run_in(tmp_path, "import rocketkv\n"
                         f"engine = rocketkv.load({str(stories_dir)!r}, device='cpu')\n"
                         "r = engine.generate('Once upon a time', max_new_tokens=4)\n"
                         "print(len(r.tokens), rocketkv.__version__)\n")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[0] == "4" and "was imported" not in p.stderr
    # the check can fail: the folder's model.py is what a bare `import model` finds there
    p = run_in(tmp_path, "import model\n")
    assert p.returncode != 0 and "model.py of the project was imported" in p.stderr


def test_importing_the_package_loads_no_torch_until_the_api_is_used(tmp_path):
    """``import rocketkv`` (and its torch-free vocabulary, ``rocketkv.flags``) loads no torch;
    the first use of an API name does."""
    p = run_in(tmp_path, "import sys, rocketkv, rocketkv.flags\n"
                         "print('torch' in sys.modules, rocketkv.__version__)\n"
                         "rocketkv.Engine\n"
                         "print('torch' in sys.modules)\n")
    assert p.returncode == 0, p.stderr
    first, second = p.stdout.splitlines()
    assert first.split()[0] == "False" and second == "True"


def test_the_console_command_runs_the_checkouts_commands(tmp_path, stories_dir):
    """``python -m rocketkv generate`` (the ``rocketkv`` console command) takes
    ``generate.py``'s flags; an unknown command is one ``error:`` line and exit 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "rocketkv", "generate", "--checkpoint",
                        str(stories_dir), "-p", "Once upon a time", "--max-new-tokens", "4",
                        "--no-stream"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() and "decode" in p.stderr
    p = subprocess.run([sys.executable, "-m", "rocketkv", "serve-me"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: unknown")
