"""Exports shared by tests/exporters (session-scoped: each is written once per test session).

`smollm2_pruned_onnx` (SmolLM2 with attention removed from blocks 13-22) lives in tests/conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from exporters.spec import BlockSpec, ModelSpec
from tests.artifacts import spec_export

MIXED_SEED = 3


@pytest.fixture(scope="session")
def mixed_spec() -> ModelSpec:
    """Tiny model: attention / no-attention blocks mixed, every FFN width different, GQA 4:2."""
    blocks = [BlockSpec(True, 48), BlockSpec(False, 40), BlockSpec(False, 24), BlockSpec(True, 56),
              BlockSpec(False, 32)]
    return ModelSpec(hidden=32, heads=4, kv_heads=2, vocab=64, blocks=blocks)


@pytest.fixture(scope="session")
def mixed_seed() -> int:
    return MIXED_SEED


@pytest.fixture(scope="session")
def mixed_spec_onnx(mixed_spec, tmp_path_factory) -> Path:
    """`mixed_spec` with seed MIXED_SEED, exported once."""
    path = tmp_path_factory.mktemp("mixed") / "mixed.onnx"
    spec_export(mixed_spec, path, seed=MIXED_SEED)
    return path
