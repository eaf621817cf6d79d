"""Imports run one way. Inside the core: kernels <- layers <- models and speculative (neither imports the
other) <- engine <- server. Across packages: proto <- core, proto <- client <- bench; the core never
imports a client, and a client never imports the core at all (any llmserve_core import runs its
__init__, which loads torch). Every import statement counts, also those inside functions."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What each part of the core may import from the core (itself always allowed). The root-level modules
# (config, data, cli, the package __init__) are parts of their own: data is a leaf, config sits beside
# engine.
CORE_ALLOWED = {
    "kernels": set(),
    "layers": {"kernels"},
    "models": {"kernels", "layers", "data"},
    "speculative": {"kernels", "layers"},
    "engine": {"kernels", "layers", "models", "speculative", "config", "distributed"},
    # Tensor parallelism: the engine starts it, and a worker rank runs an engine of its own.
    "distributed": {"layers", "models", "config", "engine"},
    "server": {"engine", "config", "__init__"},
    "config": {"speculative"},      # validates speculative_tree by building it
    "data": set(),
    "__init__": {"config", "engine"},
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
            found.append((node.lineno, name))
            # `from llmserve_core import engine` names a submodule as much as `import llmserve_core.engine`.
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names if is_module(f"{name}.{alias.name}")]
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
