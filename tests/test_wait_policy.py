"""Importing ``rocketkv`` makes idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless
the user chose a policy; ``scripts/wait_policy.py`` refuses bad counts."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

PROBE = "import os, rocketkv; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(**env_extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env | env_extra, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_default_policy_is_passive():
    assert _policy() == "PASSIVE"


@pytest.mark.parametrize("env, expected", [({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                           ({"GOMP_SPINCOUNT": "1000"}, "None")])
def test_a_policy_of_the_users_own_wins(env, expected):
    assert _policy(**env) == expected


def test_wait_policy_script_refuses_a_bad_count(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts/wait_policy.py"), "--repeats", "0",
                        "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --repeats must be positive, got 0"]
