"""The project's imports flow one way: no module imports another of the project inside a function
(the way an import cycle hides), the module-level import graph has no cycle, and no import runs
back up the package's layers (``rocketkv/__init__.py`` names them)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("", "scripts", "tools")  # and the rocketkv package; tests/ import anything

# The package's layers, lowest first (rocketkv/__init__.py says what each holds): a module may
# import only from its own layer or a lower one. Above them all: the commands at the root,
# scripts/ and tools/.
LAYERS = (
    ("rocketkv.errors", "rocketkv.method_tables", "rocketkv.flags", "rocketkv.data"),
    ("rocketkv.model",),
    ("rocketkv.kernels",),
    ("rocketkv.quantized", "rocketkv.tp"),
    ("rocketkv.cache",),
    ("rocketkv.compression",),
    ("rocketkv.formats",),
    ("rocketkv.engine",),
    ("rocketkv.api",),
    ("rocketkv.cli", "rocketkv.serve"),
    ("rocketkv.evals",),
)
TOP = len(LAYERS)  # the package's __init__ and __main__, the root commands, scripts, tools
# Modules that import on first use, on purpose: the package's names load the API when first
# asked for (importing a light module loads no torch), and the console command loads only the
# command it runs, after parsing. Nothing imports them, so no cycle can hide behind them.
DEFERRED = {"rocketkv", "rocketkv.cli.main"}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every source file of the project (tests excluded)."""
    mods = {}
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).glob("*.py"))]
    files += sorted((ROOT / "rocketkv").rglob("*.py"))
    for path in files:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the layer ``module`` belongs to (``TOP`` above them)."""
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return TOP


def imported(node: ast.AST, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement names (``from pkg import mod`` included)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        subs = [f"{node.module}.{a.name}" for a in node.names]
        # ``from pkg import mod`` imports the module; the package counts when a name is not one
        names = [s for s in subs if s in modules]
        if len(names) < len(subs):
            names.append(node.module)
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
            elif name not in DEFERRED:
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
    assert len(graph) > 20
    assert graph["rocketkv.engine.generate"] >= {"rocketkv.model", "rocketkv.engine.session",
                                                 "rocketkv.engine.prefill"}
    assert graph["rocketkv.engine.session"] >= {"rocketkv.model", "rocketkv.compression"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of ``graph`` from a module into a higher layer."""
    return [f"{m} (layer {layer(m)}) imports {n} (layer {layer(n)})"
            for m, targets in sorted(graph.items()) for n in sorted(targets)
            if layer(n) > layer(m)]


def test_no_import_runs_back_up_a_layer():
    graph, _ = scan()
    assert every_module_has_a_layer(graph)
    bad = upward_imports(graph)
    assert not bad, "\n".join(bad)


def every_module_has_a_layer(graph: dict[str, set[str]]) -> bool:
    """Every module of the package but its ``__init__`` and ``__main__`` sits in a layer."""
    loose = [m for m in graph if m.startswith("rocketkv.") and layer(m) == TOP
             and m != "rocketkv.__main__"]
    assert not loose, f"modules in no layer of LAYERS: {loose}"
    return True


def test_the_layer_check_sees_an_upward_import():
    """A model that imports the cache, and a kernel that imports the engine, are refused; the
    engine importing the model is not."""
    graph = {"rocketkv.model": {"rocketkv.cache"},
             "rocketkv.kernels.sparse": {"rocketkv.engine.step"},
             "rocketkv.engine.step": {"rocketkv.model"}}
    assert [b.split(" ")[0] for b in upward_imports(graph)] == ["rocketkv.kernels.sparse",
                                                                 "rocketkv.model"]


def test_the_checker_sees_a_cycle_and_a_hidden_import():
    """The checks above can fail: a two-module cycle is found, and so is an import of a
    project module inside a function."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    modules = {"model": ROOT / "model.py"}
    fn = ast.parse("def f():\n    from model import ConfigError\n").body[0].body[0]
    assert imported(fn, modules) == ["model"]


def test_the_install_adds_one_import_name():
    """pyproject.toml installs the rocketkv package alone: no top-level module, no
    ``scripts``, ``tools`` or ``tests`` package; every folder of rocketkv with Python files is
    one of the packages it finds."""
    import tomllib
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py-modules" not in config
    found = set(find_packages(ROOT, include=config["packages"]["find"]["include"]))
    assert {p.split(".")[0] for p in found} == {"rocketkv"}
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "rocketkv").rglob("*.py")}
    assert folders == found
