"""Atomic outputs: write into a staging folder beside the target, then move into place (no onnx import).

passes.io.model_io re-exports both; exporters.hf.checkpoint imports them from here so that its weight copy
starts before onnx and onnx_ir (~2 s) are imported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from passes.io.data_files import data_files, remove_data_files

# Above this size of committed data the emptied staging folder is removed by a detached process: removing
# it frees a block, and a file system that discards freed blocks synchronously (ext4 mounted with
# `discard`, as on these machines) makes that wait behind all the writeback queued ahead of it, 0.5-2 s
# after a few GB (docs/scale.md). The output is already in place by then.
DETACHED_REMOVAL_BYTES = 256 << 20


@contextlib.contextmanager
def staged_output(path: str | Path) -> Iterator[Path]:
    """A temporary folder beside `path`; commit_output() moves its files into place, else nothing stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield staging
    finally:
        if _committed_large(staging, path):
            _remove_detached(staging)
        else:
            shutil.rmtree(staging, ignore_errors=True)


def commit_output(staged: Path, path: Path) -> None:
    """Move a staged model (and its data files) to `path`; the data files first, the model last, then the
    data files of an earlier output at `path` that the new one does not have are removed."""
    moved = []
    for data in data_files(staged):
        target = path.with_name(path.name + data.name.removeprefix(staged.name))
        os.replace(data, target)
        moved.append(target)
    os.replace(staged, path)
    remove_data_files(path, keep=moved)


def _committed_large(staging: Path, path: Path) -> bool:
    """The staging folder is empty (its files were committed) and the output's data is large."""
    try:
        committed = sum(data.stat().st_size for data in data_files(path))
        return not any(staging.iterdir()) and committed >= DETACHED_REMOVAL_BYTES
    except OSError:
        return False


def _remove_detached(folder: Path) -> None:
    """rmdir `folder` (empty) in a background process that outlives this one; `sh` returns at once."""
    command = ['rmdir -- "$1" 2>/dev/null &', "sh", str(folder)]
    subprocess.run(["sh", "-c", *command], check=False, stdin=subprocess.DEVNULL)
