"""Expensive test artifacts (a real-model export, a tiny model's graphs) built once and shared.

`artifact(name, build, *inputs)` returns the folder that `build(folder, *inputs)` filled, built once per key:

- by one pytest-xdist worker while the others wait on a file lock, then read the same files;
- once across runs: the folder lives under $FFN_FUSION_CACHE (default ~/.cache/ffn-fusion/artifacts),
  named by a hash of `name`, `inputs`, the build function's source, the project's source in passes/ and
  exporters/ (what writes graphs) and the versions of the packages that export them. An edit there builds
  anew; a clean clone with an empty cache builds everything once per run.

A half-built artifact never counts: `build` writes into a staging folder that is renamed into place.
Treat the files as read-only: a test that changes one writes its copy under tmp_path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("passes", "exporters")  # the code that writes the artifacts' graphs
PACKAGES = ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime")


def cache_root() -> Path:
    env = os.environ.get("FFN_FUSION_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ffn-fusion" / "artifacts"


@functools.cache
def source_hash() -> str:
    digest = hashlib.sha256()
    for package in PACKAGES:
        digest.update(f"{package}=={importlib.metadata.version(package)}\n".encode())
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def artifact(name: str, build: Callable[..., object], *inputs: object) -> Path:
    """The folder `build` wrote for (name, inputs), built now only if no run has built it yet."""
    digest = hashlib.sha256(f"{name}\n{inputs!r}\n{source_hash()}\n".encode())
    digest.update(inspect.getsource(build).encode())
    folder = cache_root() / f"{name}-{digest.hexdigest()[:16]}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not folder.is_dir():
            staging = folder.with_name(folder.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            build(staging, *inputs)
            staging.rename(folder)
    return folder


def spec_export(spec: object, path: Path, seed: int = 0, *, decode: bool = False) -> Path:
    """exporters' torch.onnx export of the tiny `spec` with `seed` (the prefill graph, or the decode graph),
    exported once and copied to `path`: the copy is the test's own to change. Tiny graphs hold their
    weights inline, so the copy is one file."""
    folder = artifact("decode" if decode else "prefill", _export_spec, spec, seed, decode)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(folder / "model.onnx", path)
    return path


def _export_spec(folder: Path, spec: object, seed: int, decode: bool) -> None:
    from exporters.decode import export_spec_decode  # noqa: PLC0415 (torch: seconds to import; only when the export is not cached)
    from exporters.onnx_export import export_spec_model  # noqa: PLC0415 (torch: seconds to import; only when the export is not cached)

    (export_spec_decode if decode else export_spec_model)(spec, folder / "model.onnx", seed=seed)
    if [p.name for p in folder.iterdir()] != ["model.onnx"]:
        raise RuntimeError(f"{spec} exported with external data: too large for spec_export")
