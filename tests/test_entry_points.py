"""The scripts as entry points: each runs the engine of the checkout it sits in
(``scripts/_here.py``)."""

import ast
import os
import shutil
import subprocess
import sys

from conftest import ROOT

SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py")
                 if p.name not in ("__init__.py", "_here.py"))
ENGINE = {p.stem for p in ROOT.glob("*.py")} | {"compression", "evals", "kernels", "scripts"}


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


def test_a_script_imports_its_own_checkouts_modules(tmp_path):
    """A second clone's script, run with the first clone on the path (as an editable install of
    the first puts it), imports the second clone's ``cli``, not the first's."""
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    for name in ("__init__.py", "_here.py", "selection_steps.py"):
        shutil.copy(ROOT / "scripts" / name, clone / "scripts" / name)
    (clone / "cli.py").write_text(
        "import argparse\nimport sys\n\n"
        "print('cli of the clone', file=sys.stderr)\n"
        "OneLineParser = argparse.ArgumentParser\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the first clone
    p = subprocess.run([sys.executable, str(clone / "scripts" / "selection_steps.py"), "--help"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "cli of the clone" in p.stderr
