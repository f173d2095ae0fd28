"""Internal errors (a failed pass post-condition, any other bug) reach a user as one line, not a traceback."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import INTERNAL_ERROR_STATUS, TRACEBACK_VARIABLE, run_cli

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


def _run_cli_raising(exc: BaseException, capsys) -> tuple[int, list[str]]:
    """run_cli in this process around a main() that raises `exc`: (exit status, stderr lines)."""

    def main():
        raise exc

    with pytest.raises(SystemExit) as stopped:
        run_cli(main)
    return stopped.value.code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("code", "said"), [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded")]
)
def test_full_disk_is_an_environment_error_not_a_bug(capsys, code, said):
    status, lines = _run_cli_raising(OSError(code, os.strerror(code), "/out/model.onnx.data"), capsys)
    assert status == 2
    assert lines == [
        f"error: {said} writing /out/model.onnx.data: free space or choose another output folder"
    ]


def test_full_disk_found_behind_a_wrapping_error(capsys):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as full:
            raise RuntimeError("PassManager failed") from full
    except RuntimeError as wrapped:
        status, lines = _run_cli_raising(wrapped, capsys)
    assert status == 2 and lines == [
        "error: no space left on device: free space or choose another output folder"
    ]


def test_other_os_errors_are_still_internal_errors(capsys):
    status, lines = _run_cli_raising(OSError(errno.EIO, "Input/output error", "/out/x"), capsys)
    assert status == INTERNAL_ERROR_STATUS and len(lines) == 1
    assert lines[0].startswith("error: internal error: OSError: [Errno 5] Input/output error")


def test_a_tool_writing_to_a_full_device_exits_2_in_one_line(tool, tmp_path):
    """analyze's report goes to /dev/full, a device the kernel always answers with ENOSPC."""
    model = build_synthetic(SyntheticSpec(), tmp_path / "model.onnx")
    out = tmp_path / "out"
    out.mkdir()
    (out / "analysis.json").symlink_to("/dev/full")
    result = tool(
        "analyze", model, "--out", out, "--norm", "last", "--num-tokens", 16, "--window", 8, "--quiet"
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: no space left on device: free space or choose another output folder"
    ]


def test_errors_module_does_not_import_onnx_ir():
    """A tool's --help and early errors do not pay onnx_ir's import (~1.5 s); PassInputError still works."""
    check = (
        "import sys, passes.errors as e; assert 'onnx_ir' not in sys.modules, 'imported onnx_ir'; "
        "import onnx_ir as ir; from passes.errors import PassInputError as P; "
        "assert issubclass(P, e.UserError) and issubclass(P, ir.passes.PreconditionError); "
        "assert P is e.PassInputError"
    )
    subprocess.run([sys.executable, "-c", check], check=True)
