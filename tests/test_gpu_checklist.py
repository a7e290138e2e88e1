"""scripts/gpu_checklist.sh: every part's commands are valid before a GPU call spends them.

Each part runs with ``PYTHON`` set to a stand-in that only records its arguments; then every
recorded script call is parsed by the script's own parser (a mistyped flag exits 2) and its
method names and weight specs are checked as the script would check them, every pytest call
collects at least one test, and every ``-c`` program compiles. The step limits (``timeout``) of
each part are added up from the script's text: ``first``, a GPU visit's one call, under 500 s,
every other part under a command's 600 s. A session has 15 minutes of device time, so a typo
found here saves a visit.
"""

import argparse
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rocketkv.compression import check_methods
from rocketkv.evals.peers import PEERS
from rocketkv.quantized import parse_weights

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


COMMANDS = {"generate.py": "rocketkv/cli/generate.py",  # the root commands' code
            "quantize.py": "rocketkv/cli/quantize.py"}


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

    script = COMMANDS.get(script, script)
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


def part_body(part: str) -> str:
    """The text of one part's ``case`` branch, from its label to its ``;;``."""
    text = CHECKLIST.read_text()
    body = text[text.index("case $part in"):text.index("esac")]
    label = re.search(rf"^(\S+\|)?{re.escape(part)}(\|\S+)?\)$", body, flags=re.M)
    return body[label.end():body.index(";;", label.end())]


def functions() -> dict[str, str]:
    """The checklist's shell functions of several lines (``name() {``, then the body up to a
    ``}`` alone on a line)."""
    return {name: body for name, _, body in re.findall(
        r"^(\w+)\(\) \{\s*(#[^\n]*)?\n(.*?)^\}", CHECKLIST.read_text(), flags=re.M | re.S)}


TIMEOUT = re.compile(r"\btimeout((?:\s+-[sk]\s+\S+)*)\s+(\d+)\b")
RUNS = re.compile(r"\$py\b|\bnvidia-smi\b|\bcc\b")  # what must run under a limit


def step_limits(body: str, funcs: dict[str, str]) -> int:
    """Seconds a part may take at most, from its text: the ``timeout`` limits (plus any
    ``-k`` grace) of its steps added up, a called function's steps included; steps ending in
    ``&`` run together up to the next ``wait``, so such a group costs its longest limit. A
    command that runs Python or the device without a ``timeout``, or a ``timeout`` in a loop
    that runs in sequence (its count is not in the text), fails."""
    lines = re.sub(r"\\\n\s*", " ", body).splitlines()  # continuation lines joined
    total, group, loops = 0, [], 0
    for line in (ln.split(" #")[0].strip() for ln in lines):
        if line in funcs:
            total += step_limits(funcs[line], funcs)
            continue
        loops += len(re.findall(r"^(for|while)\b", line)) - len(re.findall(r"\bdone\b", line))
        found = TIMEOUT.search(line)
        if found is None:
            assert not RUNS.search(line) or line.startswith(("step ", "echo ", "for ")), \
                f"no timeout: {line}"
        else:
            kill = re.search(r"-k\s+(\d+)", found.group(1))
            limit = int(found.group(2)) + (int(kill.group(1)) if kill else 0)
            if line.endswith("&"):
                group.append(limit)
            else:
                assert loops == 0, f"a timeout in a sequential loop: {line}"
                total += limit
        if re.search(r"(^|;\s*)wait$", line) and group:
            total, group = total + max(group), []
    return total + max(group, default=0)


def test_step_limits_fit_a_visit():
    """``first`` ends within 8 minutes (under 500 s of step limits: a 15-minute visit keeps
    time for the machine's start and one short rerun); every other part within a command's 10
    minutes. The parser counts what it should: a parallel group at its longest limit, a
    function's steps, a kill grace."""
    funcs = functions()
    assert set(funcs) == {"environment"} and step_limits(funcs["environment"], funcs) == 45
    assert step_limits("x &\n(timeout 30 $py a) > f &\n(timeout -k 5 40 $py b) &\nwait\n"
                       "timeout 7 $py c\nenvironment\n", {"environment": "timeout 3 $py d"}) \
        == 45 + 7 + 3
    for bad in ("for f in a b; do\n timeout 5 $py x\ndone\n", "$py x\n"):
        with pytest.raises(AssertionError):
            step_limits(bad, funcs)
    limits = {name: step_limits(part_body(name), funcs) for name in parts()}
    assert limits["first"] < 500, limits
    assert all(limit < 600 for limit in limits.values()), limits


def test_cuda_only_tests_carry_the_cuda_marker():
    """``first`` runs the CUDA tests by their marker (``pytest -m cuda``): a test skipped
    without CUDA but not marked would never run on the GPU."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        if re.search(r"^pytestmark = .*pytest\.mark\.cuda\b", text, flags=re.M):
            continue  # every test of the file carries it
        # a test's decorators: the lines after a blank one up to its def (continuations too)
        decorators = re.findall(r"^\n((?:[@ \t)\]].*\n)+)def (test_\w+)", text, flags=re.M)
        for block, name in decorators:
            if re.search(r"skipif\(not (CUDA|torch\.cuda\.is_available\(\))", block):
                assert re.search(r"^@pytest\.mark\.cuda$", block, flags=re.M), \
                    f"{path.name}::{name}"


def test_the_parts_are_the_documented_ones():
    names = parts()
    assert names[0] == "first"  # a GPU visit's one call
    usage = re.search(r"part=\$\{1:\?part ([^}]*)\}", CHECKLIST.read_text()).group(1)
    assert usage.replace(" or ", ", ").split(", ") == names
    header = CHECKLIST.read_text().split("set -o pipefail")[0]
    for name in names:  # each part says what it measures in the header
        assert re.search(rf"^# (\S+, )?{name}(, \S+)?: ", header, flags=re.M), name


@pytest.mark.parametrize("part", parts())
def test_every_command_of_a_part_parses(part, tmp_path, monkeypatch):
    calls = recorded_calls(tmp_path, part)
    assert calls, f"part {part} runs no Python"
    tests = {}  # pytest's options -> the files given with them: one collection for them all
    for argv in calls:
        if argv[0] == "-c":
            compile(argv[1], f"<{part} -c>", "exec")
        elif argv[:2] == ["-m", "pytest"]:
            args = [a for a in argv[2:] if a != "-q"]  # -qq: one "file: count" line a file
            files = [a for a in args if a.endswith(".py")]
            options = tuple(a for a in args if a not in files)
            tests.setdefault(options, []).append(files)
        elif argv[:2] == ["-m", "rocketkv.engine.kernel_check"]:  # the self-check
            if importlib.util.find_spec("rocketkv.engine.kernel_check") is not None and \
                    hasattr(importlib.import_module("rocketkv.engine.kernel_check"), "main"):
                parse_only("rocketkv/engine/kernel_check.py", argv[2:], monkeypatch)
        else:
            script, args = argv[0], argv[1:]
            assert (ROOT / script).is_file(), f"{part}: no {script}"
            ns = parse_only(script, args, monkeypatch)
            if getattr(ns, "methods", None):
                check_methods([m for m in ns.methods if m not in PEERS])
            for spec in getattr(ns, "weights", None) or []:
                parse_weights(spec)
    for options, calls_files in tests.items():
        files = [f for fs in calls_files for f in fs]
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-qq",
                               "-p", "no:cacheprovider", *options, *files], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        found = dict(re.findall(r"^(\S+\.py): (\d+)$", done.stdout, re.M))
        assert done.returncode == 0 and found, \
            f"{part}: pytest {' '.join(options)} selects no test\n{done.stdout[-2000:]}"
        for fs in calls_files:  # every call selects a test of its own
            assert not fs or any(int(found.get(f, 0)) for f in fs), \
                f"{part}: pytest {' '.join(options)} {' '.join(fs)} selects no test"
