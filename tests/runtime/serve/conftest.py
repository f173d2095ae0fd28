"""Session fixtures of the serving tests: the tiny model folder loaded once, one server over it that every
module shares, and the tiny model sharded at TP 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from passes.shard import shard_file
from runtime.serve import loading
from runtime.serve.server import ServerThread
from tests import serve_fixtures as sf


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> loading.ServedModel:
    return loading.load(sf.tiny_folder(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="session")
def server(tiny) -> Iterator[ServerThread]:
    with ServerThread(tiny, max_batch=8, max_queue=64) as running:
        yield running


@pytest.fixture(scope="session")
def tp2_folder(tmp_path_factory) -> Path:
    """The tiny decode model's folder sharded at TP 2 (rank graphs + tp.json, no tokenizer of its own)."""
    base = tmp_path_factory.getbasetemp()
    folder = base / "serve_models" / "tiny_decode_tp2"
    if not (folder / "tp.json").is_file():
        shard_file(sf.tiny_folder(base) / "model.onnx", 2, folder, progress=False)
    return folder
