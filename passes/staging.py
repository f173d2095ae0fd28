"""Atomic outputs: write into a staging folder beside the target, then move into place (no onnx import).

passes.model_io re-exports both; exporters.hf_checkpoint imports them from here so that its weight copy
starts before onnx and onnx_ir (~2 s) are imported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_output(path: str | Path) -> Iterator[Path]:
    """A temporary folder beside `path`; commit_output() moves its files into place, else nothing stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def commit_output(staged: Path, path: Path) -> None:
    """Move a staged model (and its data file) to `path`; the data file first, the model last."""
    data = staged.with_name(f"{staged.name}.data")
    if data.exists():
        os.replace(data, path.with_name(f"{path.name}.data"))
    os.replace(staged, path)
