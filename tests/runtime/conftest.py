"""Decode-graph fixtures for tests/runtime (session-scoped)."""

from __future__ import annotations

import pytest

from tests import decode_fixtures


@pytest.fixture(scope="session")
def tiny_models():
    """tiny_models("decode" | "prefill" | "decode_fused" | "prefill_fused") -> path (decode_fixtures)."""
    return decode_fixtures.decode_models
