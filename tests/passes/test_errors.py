"""Internal errors (a failed pass post-condition, any other bug) reach a user as one line, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import INTERNAL_ERROR_STATUS, TRACEBACK_VARIABLE

TOOLS = Path(__file__).resolve().parents[2] / "tools"

# Runs tools/fuse_onnx.py with the fuse pass's post-condition broken, as a bug in the pass would break it.
BROKEN_POSTCONDITION = """
import runpy, sys
import passes.fuse

def ensures(self, model):
    raise AssertionError("fused model has 2 blocks, expected 3")

passes.fuse.FuseFFNGroups.ensures = ensures
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _fuse_with_broken_pass(tmp_path, env=None):
    model = build_synthetic(SyntheticSpec(), tmp_path / "model.onnx")
    plan = tmp_path / "plan.json"
    plan.write_text('{"groups": [[0, 2]], "norm": "fold"}')
    command = [sys.executable, "-c", BROKEN_POSTCONDITION, str(TOOLS / "fuse_onnx.py"), model, plan]
    return subprocess.run([*map(str, command)], capture_output=True, text=True, env=env, cwd=tmp_path)


def test_failed_postcondition_is_one_line_internal_error(tmp_path):
    result = _fuse_with_broken_pass(tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == INTERNAL_ERROR_STATUS, result.stderr
    assert len(errors) == 1 and errors[0].startswith("error: internal error: PostconditionError"), errors
    assert result.stderr.rstrip().endswith(errors[0])  # the last thing printed
    assert "fused model has 2 blocks, expected 3" in errors[0] and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "plan.json"]  # nothing written


def test_traceback_on_request(tmp_path):
    result = _fuse_with_broken_pass(tmp_path, env={**os.environ, TRACEBACK_VARIABLE: "1"})
    assert result.returncode == 1 and "Traceback" in result.stderr and "PostconditionError" in result.stderr
