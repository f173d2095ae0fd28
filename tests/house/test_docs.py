"""docs/architecture.md names every source module, and every module it names exists.

Each "### FOLDER/: ..." section is a table: a row names modules of FOLDER (`model_map.py`) or one of its
sub-folders (`shard/`), whose modules the row's text then names (`rewrite.py`). A path written from the
repository root (`tools/serve.py`) is checked as such. A package's __init__.py need not be named."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
FOLDERS = ("passes", "exporters", "runtime", "tools")


def named_modules() -> tuple[set[Path], set[str]]:
    """(module paths the tables name, names that do not exist)."""
    named, missing = set(), set()
    folder = None
    for line in DOC.read_text().splitlines():
        if heading := re.match(r"^### (\w+)/", line):
            folder = ROOT / heading.group(1)
            continue
        if line.startswith("## "):
            folder = None
        if folder is None or not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        subfolders = re.findall(r"`([\w/]+)/`", first)
        base = folder / subfolders[0] if subfolders else folder
        for name in re.findall(r"`([\w./]+\.(?:py|c))`", line):
            top = name.split("/")[0]
            path = ROOT / name if top in FOLDERS else (folder if name in first else base) / name
            (named if path.is_file() else missing).add(path if path.is_file() else name)
        for sub in subfolders:
            if not (folder / sub).is_dir():
                missing.add(f"{folder.name}/{sub}/")
    return named, missing


def source_modules() -> set[Path]:
    modules = set()
    for top in FOLDERS[:3]:
        for path in (ROOT / top).rglob("*.py"):
            if path.name == "__init__.py":
                continue  # a package's own row names it
            modules.add(path)
    return modules


def test_every_module_named_exists() -> None:
    _, missing = named_modules()
    assert not missing, f"docs/architecture.md names modules that do not exist: {sorted(missing)}"


def test_every_source_module_is_named() -> None:
    named, _ = named_modules()
    unnamed = sorted(str(p.relative_to(ROOT)) for p in source_modules() - named)
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"


def test_package_docstrings_name_existing_modules() -> None:
    """A module a package's docstring names (`rewrite.py` in its folder, `tools/serve.py` from the root)
    exists; a bare name may also be a file of the parent package."""
    missing = []
    for init in [p for top in FOLDERS[:3] for p in (ROOT / top).rglob("__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for name in set(re.findall(r"[\w/]+\.py", doc)):
            places = [ROOT / name] if "/" in name else [init.parent / name, init.parent.parent / name]
            if not any(p.is_file() for p in places):
                missing.append(f"{init.relative_to(ROOT)}: {name}")
    assert not missing, f"package docstrings name modules that do not exist: {sorted(missing)}"
