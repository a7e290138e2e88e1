"""The scripts as entry points: each runs the engine of the checkout it sits in
(``scripts/_here.py``)."""

import argparse
import ast
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPTS = sorted(p for d in ("scripts", "tools") for p in (ROOT / d).glob("*.py")
                 if p.name not in ("__init__.py", "_here.py"))
ENGINE = {"rocketkv", "scripts", "tools"}


def test_every_script_imports_here_before_the_engine():
    """``import _here`` at module level, above every import of the engine's modules."""
    late = []
    for path in SCRIPTS:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import) and [a.name for a in node.names] == ["_here"]:
                break
            name = (node.names[0].name if isinstance(node, ast.Import) else node.module
                    if isinstance(node, ast.ImportFrom) else None)
            if name and name.split(".")[0] in ENGINE:
                late.append(f"{path.name} imports {name} before _here")
                break
        else:
            late.append(f"{path.name} never imports _here")
    assert not late, "\n".join(late)


@pytest.mark.parametrize("folder, script", [("scripts", "download.py"),
                                            ("tools", "selection_steps.py")])
def test_a_script_imports_its_own_checkouts_modules(folder, script, tmp_path):
    """A second clone's script (a user's script or a developer tool), run with the first clone
    on the path (as an editable install of the first puts it), imports the second clone's
    modules, not the first's."""
    clone = tmp_path / "clone"
    (clone / folder).mkdir(parents=True)
    for name in ("__init__.py", "_here.py", script):
        shutil.copy(ROOT / folder / name, clone / folder / name)
    fake = clone / "rocketkv"  # the script's parser class comes from its flags module
    (fake / "cli").mkdir(parents=True)
    for name in ("__init__.py", "cli/__init__.py"):
        (fake / name).write_text("")
    for name in ("flags", "cli/common"):
        (fake / f"{name}.py").write_text(
            "import argparse\nimport sys\n\n"
            f"print('{name} of the clone', file=sys.stderr)\n"
            "OneLineParser = argparse.ArgumentParser\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the first clone
    p = subprocess.run([sys.executable, str(clone / folder / script), "--help"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "of the clone" in p.stderr


FAST_PARSE = {  # script -> a usage error its parser refuses
    "scripts/bench.py": ["--budgets", "many", "--rocket-split", "sqrt"],
    "scripts/bench_step.py": ["--knob", "NUM_WARPS=4,x"],
    "scripts/bench_cpu.py": ["--checkpoint", "c", "--gguf-weights", "int3"],
    "quantize.py": ["--checkpoint", "x", "--mode", "int9"],
    "rocketkv/__main__.py": ["generate", "--checkpoint", "c", "--random-prompt", "many"],
    "scripts/make_prompt.py": ["--text", "a.txt", "--prompt-out", "p.txt", "--context", "many"],
    "scripts/profile_step.py": ["--context", "many"],
    "scripts/predict_memory.py": ["--tp", "two"],
    "scripts/download.py": ["--repo-id"],
    "scripts/convert_gguf.py": ["--dtype", "int3"],
    "scripts/convert_hf_checkpoint.py": ["--dtype", "int3"],
    "scripts/convert_llama2c.py": ["--out"],
    "scripts/plot_bench.py": ["rows.json", "--prefix", "p", "--compare-context", "32K"],
    "tools/check_targets.py": ["rows.json", "--json"],
    "tools/selection_steps.py": ["--trials", "many"],
    "scripts/compare_hf.py": ["--checkpoint", "c", "--random", "--dtype", "int3"],
    "scripts/duo_identify.py": ["--checkpoint", "c", "--out", "d", "--steps", "many"],
    "scripts/eval_quantized.py": ["--checkpoint", "c", "--classifier", "int3"],
    "generate.py": ["--checkpoint", "c", "--random-prompt", "many"],
    "serve.py": ["--port", "many"],
}


@pytest.mark.parametrize("script", sorted(FAST_PARSE))
def test_help_and_usage_errors_come_before_torch(script, tmp_path):
    """``--help`` and a usage error are answered before ``import torch`` (the seconds of a
    bare start): the import log (``-X importtime``) names no torch, and the error is one line
    with exit status 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv, rc in ((["--help"], 0), (FAST_PARSE[script], 2)):
        p = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / script), *argv],
                           capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        log = [x for x in p.stderr.splitlines() if x.startswith("import time:")]
        err = [x for x in p.stderr.splitlines() if not x.startswith("import time:")]
        assert p.returncode == rc, p.stderr[-2000:]
        assert log and not [x for x in log if x.split("|")[-1].strip() == "torch"], script
        if rc == 0:
            assert p.stdout.startswith("usage:") and not err
        else:
            assert len(err) == 1 and err[0].startswith("error: argument "), err


def test_the_torch_free_method_tables_are_generated_from_the_registry():
    """``rocketkv/method_tables.py`` (what parsers built before torch loads know of the
    methods) is exactly what the registry renders: ``python -m rocketkv.compression
    --update-docs`` writes it, and a registry change without it fails here."""
    from rocketkv.compression.registry import TORCH_FREE_MODULE, torch_free_tables

    assert (ROOT / TORCH_FREE_MODULE).read_text() == torch_free_tables(), \
        f"{TORCH_FREE_MODULE} is stale: run python -m rocketkv.compression --update-docs"


def test_the_torch_free_method_flags_are_the_registrys():
    """``flags.add_method_flags`` (for parsers built before torch loads) adds the flags
    ``compression.add_method_options`` adds: same names, types, choices, metavars and help."""
    from rocketkv.compression import add_method_options
    from rocketkv.flags import add_method_flags

    def actions(add):
        p = argparse.ArgumentParser(add_help=False)
        add(p)
        return [(a.option_strings, a.dest, type(a).__name__, a.type, a.choices, a.metavar,
                 a.help, a.default) for a in p._actions]

    assert actions(add_method_flags) == actions(add_method_options)


def test_the_torch_free_method_table_is_the_registrys():
    """``flags.METHOD_TABLE`` (generate.py's --method choices and --help list, before torch
    loads) names the registry's methods in its order with their descriptions."""
    from rocketkv.compression import METHODS, help_epilog
    from rocketkv.flags import METHOD_TABLE, method_epilog

    assert METHOD_TABLE == tuple((m.name, m.description) for m in METHODS.values())
    assert method_epilog() == help_epilog()
