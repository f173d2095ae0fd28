"""Fixtures of the verifier tests: the artifacts of artifacts.py, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.verify.artifacts import checkpoint_artifacts, healed_artifacts, tiny_artifacts


@pytest.fixture(scope="session")
def healed(tmp_path_factory) -> dict[str, Path]:
    return healed_artifacts(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return tiny_artifacts(tmp_path_factory)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return checkpoint_artifacts(tmp_path_factory)
