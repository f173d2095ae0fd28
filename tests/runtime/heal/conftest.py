"""Fixtures of the heal tests: the synthetic model healed once per run (synthetic.py)."""

from __future__ import annotations

import pytest

from tests.runtime.heal.synthetic import healed_model


@pytest.fixture(scope="session", params=["last", "fold"])
def synthetic(request, tmp_path_factory):
    """(folder, original, fused, report) for each norm mode."""
    return healed_model(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def folded(tmp_path_factory):
    """(folder, original, fused, report) for the "fold" norm mode."""
    return healed_model("fold", tmp_path_factory)
