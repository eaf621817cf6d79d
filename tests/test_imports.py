"""Imports run one way. Inside the core the parts are layered, each importing only those below it:

    kernels <- layers <- models, speculative <- engine <- distributed <- server, cli, the package root

models and speculative do not import each other; config and data sit beside them (config checks a
speculative tree by building it). The engine is one process's scheduler and model side; distributed
builds on it (a worker rank builds the engine's model side, engine/runtime.py, and start_engine starts the
ranks before handing the engine rank 0's group), and the engine only ever sees that group through the
object it is handed. Across packages: proto <- core, proto <- client <- bench; the core never imports a
client, and a client never imports the core at all (any llmserve_core import runs its __init__, which
loads torch).

Every import statement counts, also those inside functions. Besides the part table, no module of the
core imports itself back through others (a circle at module granularity, which the part table cannot see
inside one part), and no test module imports another: shared test code lives in tests/helpers/."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What each part of the core may import from the core (itself always allowed). The root-level modules
# (config, data, cli, the package __init__) are parts of their own.
CORE_ALLOWED = {
    "kernels": set(),
    "layers": {"kernels"},
    "models": {"kernels", "layers", "data"},
    "speculative": {"kernels", "layers"},
    "config": {"speculative"},      # validates speculative_tree by building it
    "data": set(),
    "engine": {"kernels", "layers", "models", "speculative", "config"},
    "distributed": {"layers", "models", "config", "engine"},
    "server": {"engine", "distributed", "config"},
    "__init__": {"config", "engine", "distributed"},
    "__main__": {"cli"},
    "cli": {"config", "server", "models", "distributed"},
}
# Which top-level packages each top-level package may import.
PACKAGE_ALLOWED = {
    "llmserve_proto": set(),
    "llmserve_core": {"llmserve_proto"},
    "llmserve_client": {"llmserve_proto"},
    "llmserve_bench": {"llmserve_proto", "llmserve_client"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "proto":              # llmserve_proto is the repo-root symlink to proto/
        parts[0] = "llmserve_proto"
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            # `from llmserve_core import engine` names a submodule as much as `import llmserve_core.engine`
            # (and the package only as its parent, as `import llmserve_core.engine` does).
            subs = [f"{name}.{alias.name}" for alias in node.names if is_module(f"{name}.{alias.name}")]
            if len(subs) < len(node.names):
                found.append((node.lineno, name))
            found += [(node.lineno, sub) for sub in subs]
    return found


def core_part(dotted: str) -> str:
    """llmserve_core.layers.attention.base -> layers; llmserve_core -> __init__; llmserve_core.cli -> cli."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def source_files(package_dir: str) -> list[Path]:
    return sorted(p for p in (ROOT / package_dir).rglob("*.py") if "__pycache__" not in p.parts)


def forbidden_edges() -> list[str]:
    bad = []
    for package_dir in ("llmserve_core", "proto", "llmserve_client", "llmserve_bench"):
        for path in source_files(package_dir):
            here = module_name(path)
            top = here.split(".")[0]
            for line, name in imported_modules(path):
                target_top = name.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{line} imports {name}"
                if target_top in PACKAGE_ALLOWED and target_top != top and target_top not in PACKAGE_ALLOWED[top]:
                    bad.append(where)
                if top == target_top == "llmserve_core":
                    src, dst = core_part(here), core_part(name)
                    if src != dst and dst not in CORE_ALLOWED[src]:
                        bad.append(where)
    return bad


def test_imports_run_one_way():
    assert forbidden_edges() == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan): each holds a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def module_graph() -> dict[str, set[str]]:
    """Every core module -> the core modules its import statements name (a package is its __init__)."""
    paths = source_files("llmserve_core")
    modules = {module_name(p).removesuffix(".__init__") for p in paths}

    def owner(dotted: str) -> str:          # `from m import Class` names m
        while dotted not in modules and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted
    graph = {}
    for path in paths:
        here = module_name(path).removesuffix(".__init__")
        graph[here] = {owner(name) for _, name in imported_modules(path) if name.startswith("llmserve_core")} - {here}
    return graph


def test_the_part_table_is_layered():
    """The table itself has no circle: each part imports only parts below it."""
    assert circles(CORE_ALLOWED) == []


def test_no_module_of_the_core_imports_itself_back():
    assert circles(module_graph()) == []


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_a_circle_through_function_local_imports_is_found(monkeypatch):
    """Two engine modules importing each other, one inside a function: a circle the part table allows."""
    here = ROOT / "llmserve_core" / "engine"
    sources = {here / "x.py": "from llmserve_core.engine.y import f", here / "y.py": "def f():\n    from . import x"}
    real_read, real_files = Path.read_text, source_files
    monkeypatch.setattr(Path, "read_text", lambda self, **kw: sources[self] if self in sources else real_read(self, **kw))
    monkeypatch.setattr(sys.modules[__name__], "source_files",
                        lambda d: real_files(d) + (sorted(sources) if d == "llmserve_core" else []))
    monkeypatch.setattr(sys.modules[__name__], "is_module",
                        lambda dotted, real=is_module: dotted in ("llmserve_core.engine.x", "llmserve_core.engine.y")
                        or real(dotted))
    assert ["llmserve_core.engine.x", "llmserve_core.engine.y"] in circles(module_graph())


def imports_of_test_modules(paths: list[Path]) -> list[str]:
    """'file:line imports name' for every import of a test module (test_*, conftest) by another module."""
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[-1].startswith("test_") or n.split(".")[-1] == "conftest"]
    return bad


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/ (a package), never in a test module another one imports."""
    assert imports_of_test_modules(sorted((ROOT / "tests").rglob("*.py"))) == []


def test_a_test_module_importing_another_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    fake = tmp_path / "test_x.py"
    fake.write_text("import os\nfrom helpers.daemon import start_core\nfrom test_http import stop\n")
    assert imports_of_test_modules([fake]) == ["test_x.py:3 imports test_http"]


def test_every_core_part_has_a_rule():
    parts = {core_part(module_name(p)) for p in source_files("llmserve_core")}
    assert parts <= CORE_ALLOWED.keys(), f"no import rule for {sorted(parts - CORE_ALLOWED.keys())}"


@pytest.mark.parametrize("source,expected", [
    ("from llmserve_core.layers.batch import ForwardBatch", "llmserve_core/kernels/x.py:1 imports llmserve_core.layers.batch"),
    ("from ..layers import norm", "llmserve_core/kernels/x.py:1 imports llmserve_core.layers.norm"),
    ("def f():\n    import llmserve_core.engine.engine", "llmserve_core/kernels/x.py:2 imports llmserve_core.engine.engine"),
])
def test_a_forbidden_edge_is_found(source, expected, monkeypatch):
    """The checker sees absolute, relative and function-local imports (a kernel importing a layer)."""
    fake = ROOT / "llmserve_core" / "kernels" / "x.py"
    real_read, real_files = Path.read_text, source_files
    monkeypatch.setattr(Path, "read_text", lambda self, **kw: source if self == fake else real_read(self, **kw))
    monkeypatch.setattr(sys.modules[__name__], "source_files",
                        lambda d: real_files(d) + ([fake] if d == "llmserve_core" else []))
    edges = forbidden_edges()
    assert any(e.startswith(expected) for e in edges), edges


def test_a_client_importing_the_core_is_found(monkeypatch):
    fake = ROOT / "llmserve_client" / "x.py"
    real_read, real_files = Path.read_text, source_files
    monkeypatch.setattr(Path, "read_text",
                        lambda self, **kw: "from llmserve_core.data import CORPUS_PATH" if self == fake
                        else real_read(self, **kw))
    monkeypatch.setattr(sys.modules[__name__], "source_files",
                        lambda d: real_files(d) + ([fake] if d == "llmserve_client" else []))
    assert "llmserve_client/x.py:1 imports llmserve_core.data" in forbidden_edges()
