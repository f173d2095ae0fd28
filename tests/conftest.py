"""Fixtures shared by the whole suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
