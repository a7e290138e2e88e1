"""The project's imports flow one way: no module imports another of the project inside a function
(the way an import cycle hides), and the module-level import graph has no cycle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("", "compression", "evals", "kernels", "scripts", "tools")  # tests/ import anything


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every source file of the project (tests excluded)."""
    mods = {}
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).glob("*.py")):
            parts = [*Path(d).parts, path.stem]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def imported(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement names (``from pkg import mod`` included)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        return []
    return [n for n in names if n in modules]


def scan() -> tuple[dict[str, set[str]], list[str]]:
    """The module-level import graph and every import of a project module below module level."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    hidden = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set()
        top = set(map(id, tree.body))
        for node in ast.walk(tree):
            targets = imported(node, modules)
            if not targets:
                continue
            if id(node) in top:
                graph[name].update(t for t in targets if t != name)
            else:
                hidden.append(f"{path.relative_to(ROOT)}:{node.lineno} imports "
                              f"{', '.join(targets)} inside a function or block")
    return graph, hidden


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_project_import_hides_inside_a_function():
    _, hidden = scan()
    assert not hidden, "\n".join(hidden)


def test_the_import_graph_has_no_cycle():
    graph, _ = scan()
    assert len(graph) > 20 and graph["generate"] >= {"model", "session", "prefill"}
    assert graph["session"] >= {"model", "compression"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_sees_a_cycle_and_a_hidden_import():
    """The checks above can fail: a two-module cycle is found, and so is an import of a
    project module inside a function."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    modules = {"model": ROOT / "model.py"}
    fn = ast.parse("def f():\n    from model import ConfigError\n").body[0].body[0]
    assert imported(fn, modules) == ["model"]


def test_the_package_lists_every_module():
    """``pip install -e .`` (requirements.txt) makes exactly the modules and packages that
    pyproject.toml lists importable from anywhere: a new top-level module or package must be
    listed there, or scripts fail to import it outside the repository root."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {p.stem for p in ROOT.glob("*.py")}
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
    assert set(config["py-modules"]) == modules
    assert set(config["packages"]) == packages
