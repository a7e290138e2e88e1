"""scripts/gpu_checklist.sh: every part's commands are valid before a GPU call spends them.

Each part runs with ``PYTHON`` set to a stand-in that only records its arguments; then every
recorded script call is parsed by the script's own parser (a mistyped flag exits 2) and its
method names and weight specs are checked as the script would check them, every pytest call
collects at least one test, and every ``-c`` program compiles. A GPU call lasts up to ten
minutes of a session's thirty, so a typo found here saves a third of a session.
"""

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compression import check_methods
from evals.peers import PEERS
from quantized import parse_weights

ROOT = Path(__file__).resolve().parents[1]
CHECKLIST = ROOT / "scripts" / "gpu_checklist.sh"
RECORDER = """import json, os, sys
with open(os.environ["CHECKLIST_CALLS"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def parts() -> list[str]:
    """The part names of the checklist's ``case`` (every ``name)`` or ``a|b)`` label)."""
    text = CHECKLIST.read_text()
    body = text[text.index("case $part in"):text.index("esac")]
    names = []
    for label in re.findall(r"^(\S+)\)$", body, flags=re.M):
        names += [n for n in label.split("|") if n != "*"]
    return names


def recorded_calls(tmp_path: Path, part: str) -> list[list[str]]:
    """The Python calls of one part, as argument lists, with ``nvidia-smi`` and ``timeout``
    left to the shell (``timeout`` runs the stand-in; a missing ``nvidia-smi`` only logs)."""
    recorder = tmp_path / "recorder.py"
    recorder.write_text(RECORDER)
    calls = tmp_path / f"calls-{part}.jsonl"
    out = tmp_path / f"out-{part}"
    env = dict(os.environ, PYTHON=f"{sys.executable} {recorder}", CHECKLIST_CALLS=str(calls))
    done = subprocess.run(["bash", str(CHECKLIST), part, str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / f"log-{part}.txt").exists()
    return [json.loads(line) for line in calls.read_text().splitlines()] \
        if calls.exists() else []


class Parsed(BaseException):
    """Raised by the patched parser once a script's arguments parse: the run stops there."""

    def __init__(self, namespace):
        self.namespace = namespace


def parse_only(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """``script``'s ``main(argv)`` up to its ``parse_args``: the namespace, or a failure with
    the parser's own message."""
    original = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            module.main(argv)
        except Parsed as p:
            return p.namespace
        except SystemExit as e:
            pytest.fail(f"{script} {' '.join(argv)}: its parser exits {e.code}")
    pytest.fail(f"{script} returned before parsing its arguments")


def test_the_parts_are_the_documented_ones():
    names = parts()
    assert names[:3] == ["k", "t", "q"]  # the first three calls of a session
    usage = re.search(r"part=\$\{1:\?part ([^}]*)\}", CHECKLIST.read_text()).group(1)
    assert re.findall(r"\b[a-z][a-z0-9]?\b", usage.replace(" or ", ", ")) == names
    header = CHECKLIST.read_text().split("set -o pipefail")[0]
    for name in names:  # each part says what it measures in the header
        assert re.search(rf"^# (\S+, )?{name}(, \S+)?: ", header, flags=re.M), name


@pytest.mark.parametrize("part", parts())
def test_every_command_of_a_part_parses(part, tmp_path, monkeypatch):
    calls = recorded_calls(tmp_path, part)
    assert calls, f"part {part} runs no Python"
    for argv in calls:
        if argv[0] == "-c":
            compile(argv[1], f"<{part} -c>", "exec")
        elif argv[:2] == ["-m", "pytest"]:
            args = [a for a in argv[2:] if a != "-q"]  # -qq: one "file: count" line a file
            done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-qq",
                                   "-p", "no:cacheprovider", *args], cwd=ROOT,
                                  capture_output=True, text=True, timeout=300)
            found = sum(int(n) for n in re.findall(r"^\S+\.py: (\d+)$", done.stdout, re.M))
            assert done.returncode == 0 and found > 0, \
                f"{part}: pytest {' '.join(args)} selects no test\n{done.stdout[-2000:]}"
        else:
            script, args = argv[0], argv[1:]
            assert (ROOT / script).is_file(), f"{part}: no {script}"
            ns = parse_only(script, args, monkeypatch)
            if getattr(ns, "methods", None):
                check_methods([m for m in ns.methods if m not in PEERS])
            for spec in getattr(ns, "weights", None) or []:
                parse_weights(spec)
