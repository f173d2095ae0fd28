"""The house rules docs/architecture.md states, kept by a test: four floors that import only downward,
no circle of imports between modules, no folder over 15 modules, and each metadata key defined once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"passes": 1, "exporters": 2, "runtime": 3, "tools": 4}
MAX_MODULES = 15


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every source module (tools/ scripts as tools.NAME)."""
    found = {}
    for top in FLOORS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Every project module `path` imports, at the top or inside a function (not for type checking only)."""
    names = set()
    for node in _walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {n for n in names if n.split(".")[0] in FLOORS}


def _walk(node: ast.AST):
    """ast.walk without the bodies of `if TYPE_CHECKING:`."""
    yield node
    for child in ast.iter_child_nodes(node):
        test = child.test if isinstance(child, ast.If) else None
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
            continue
        yield from _walk(child)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {n for n in imports(path) if n in known and n != name} for name, path in known.items()}


def test_imports_only_go_down() -> None:
    up = [(a, b) for a, targets in graph().items() for b in targets
          if FLOORS[b.split(".")[0]] > FLOORS[a.split(".")[0]]]
    assert not up, f"imports from a lower floor up to a higher one: {up}"


def test_no_circle_of_imports() -> None:
    edges = graph()
    # a package's __init__ that re-exports its modules is not a circle with them
    packages = modules_with_init()
    edges = {a: {b for b in bs if not (a.startswith(b + ".") or (b.startswith(a + ".") and a in packages))}
             for a, bs in edges.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not circles, f"circles of imports: {circles}"


def modules_with_init() -> set[str]:
    return {name for name, path in modules().items() if path.name == "__init__.py"}


def test_no_folder_over_15_modules() -> None:
    big = {}
    for top in FLOORS:
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES and "__pycache__" not in folder.parts:
                big[str(folder.relative_to(ROOT))] = count
    assert not big, f"folders over {MAX_MODULES} modules: {big}"


def test_each_metadata_key_is_defined_once() -> None:
    """Every "ffn_fusion.*" metadata key (and the config.json key) is a constant of passes/metadata.py only;
    elsewhere the code imports it."""
    pattern = re.compile(r'^\s*[A-Z_]*KEY\s*=\s*"(ffn_fusion[._][a-z_]+)"', re.M)
    where: dict[str, list[str]] = {}
    for path in modules().values():
        for key in pattern.findall(path.read_text()):
            where.setdefault(key, []).append(str(path.relative_to(ROOT)))
    twice = {k: v for k, v in where.items() if v != ["passes/metadata.py"]}
    assert not twice, f"metadata keys defined outside passes/metadata.py: {twice}"
