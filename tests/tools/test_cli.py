"""Every tool as a process, as a user starts it: `--help` answers with its usage, and a missing input is one
`error:` line with exit status 2, no traceback and nothing written. (Most other tool tests run the tools that
only parse arguments inside the test process: tests/conftest.py IN_PROCESS_TOOLS.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import IN_PROCESS_TOOLS, ROOT, run_tool

TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))
# For each tool that runs in-process elsewhere: arguments naming a model that is not there, and the message.
MISSING = {
    "analyze": (["missing.onnx", "--out", "out"], "model missing.onnx does not exist"),
    "build_engines": (["missing.onnx", "--out", "out"], "ONNX file not found: missing.onnx"),
    "evaluate": (["missing.onnx", "missing.onnx"], "model missing.onnx does not exist"),
    "export_checkpoint": (["missing.onnx", "--source", "ckpt", "-o", "out"], "missing.onnx not found"),
    "export_model": (["--hf", "ckpt", "-o", "out/m.onnx"], "ckpt/config.json not found"),
    "fuse_onnx": (["missing.onnx", "plan.json"], "plan plan.json does not exist"),
    "heal": (["missing.onnx", "missing.onnx", "-o", "out.onnx"], "model missing.onnx does not exist"),
    "prune_attention": (["missing.onnx", "--importance"], "missing.onnx"),
    "shard_tp": (["missing.onnx", "--tp", "2", "--out", "out"], "model missing.onnx does not exist"),
}


def test_every_in_process_tool_has_a_process_test() -> None:
    assert set(MISSING) == IN_PROCESS_TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_help(tool: str) -> None:
    result = run_tool(tool, "--help", process=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: "), result.stderr


@pytest.mark.parametrize("tool", sorted(MISSING))
def test_missing_input_is_one_line(tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args, message = MISSING[tool]
    result = run_tool(tool, *args, process=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [], "a refused run left files behind"
