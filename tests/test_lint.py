"""ruff over the whole project, so the README's one test command also lints."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT


def test_ruff_is_clean():
    try:
        import ruff  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ruff is missing in CI (requirements-test.txt)")
        pytest.skip("ruff not installed")
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
