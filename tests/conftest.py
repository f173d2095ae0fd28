"""Fixtures shared by the whole suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The third-party export corpus (issue 9): fixtures `third_party_corpus` and `corpus_hf`
# (tests/corpora/fixtures.py).
from tests.corpora.fixtures import corpus_hf, third_party_corpus  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def run_tool(
    tool: str, *args: object, check: bool = False, timeout: float = 900
) -> subprocess.CompletedProcess:
    """Run tools/<tool>.py as a user would, capturing its output."""
    command = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{tool} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def tool():
    return run_tool


@pytest.fixture(scope="session")
def smollm2_pruned_onnx(tmp_path_factory) -> Path:
    """SmolLM2-135M with attention removed from blocks 13-22, exported once per test session."""
    from exporters.onnx_export import export_smollm2

    path = tmp_path_factory.mktemp("smollm2") / "smollm2_pruned.onnx"
    export_smollm2(path, drop_attention=range(13, 23))
    return path


@pytest.fixture(scope="session")
def super49b_onnx(tmp_path_factory) -> Path:
    """The Super-49B block pattern (docs/design.md §6) at hidden 64, 8 heads, 1 KV head, exported once."""
    from exporters.onnx_export import export_spec_model
    from exporters.spec import super49b_spec

    path = tmp_path_factory.mktemp("super49b") / "super49b.onnx"
    export_spec_model(super49b_spec(hidden=64, heads=8, kv_heads=1, vocab=256), path, seed=0)
    return path
