"""tools/export_checkpoint.py as a user runs it: the summary it prints, and bad input (one `error:` line, exit
2, no traceback, nothing left beside the output), a full disk included (simulated: a subprocess whose
os.pwrite and os.copy_file_range raise ENOSPC once a byte budget is spent, the errno a full file system
gives; a real small file system needs root here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx as onnx_lib
import pytest

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import write_all_kinds
from passes.io.model_io import load_proto
from passes.pipeline import fuse_file
from passes.plan import parse_plan

ROOT = Path(__file__).resolve().parents[2]
PLAN = {"groups": [[1, 4], [9, 10]], "norm": "last"}

# Runs the tool with writes failing with ENOSPC after BUDGET bytes (argv: budget, then the tool's arguments).
FULL_DISK = """
import errno, os, runpy, sys
budget = [int(sys.argv[1])]
def spend(count):
    budget[0] -= count
    if budget[0] < 0:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
real_pwrite, real_copy = os.pwrite, os.copy_file_range
def pwrite(fd, data, offset):
    spend(len(memoryview(data).cast("B")))
    return real_pwrite(fd, data, offset)
def copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
    spend(count)
    return real_copy(src, dst, count, offset_src, offset_dst)
os.pwrite, os.copy_file_range = pwrite, copy_file_range
sys.argv = ["export_checkpoint.py", *sys.argv[2:]]
sys.path.insert(0, {root!r})
runpy.run_path({tool!r}, run_name="__main__")
"""


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("export_checkpoint")
    folder = write_all_kinds(base / "ckpt", seed=7)
    onnx = base / "onnx" / "model.onnx"
    export_hf(folder, onnx, dtype="float32")
    return folder, fuse_file(onnx, parse_plan(PLAN), base / "onnx" / "fused.onnx").output


def test_prints_the_layers_and_files(tool, fused, tmp_path) -> None:
    folder, onnx = fused
    result = tool("export_checkpoint", onnx, "--source", folder, "-o", tmp_path / "out", "--shard-gb",
                  "0.0001", check=True)
    assert "layers: 7 (source 11)" in result.stdout
    assert "layer 1: source layers 1-4 fused, ffn_mult 18.0" in result.stdout
    assert "layer 6: source layers 9-10 fused, ffn_mult 12.0" in result.stdout
    assert "model.safetensors.index.json" in result.stdout and "bfloat16" in result.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 7


def _edited(onnx: Path, name: str, key: str, value: dict) -> Path:
    proto = load_proto(onnx)
    for prop in proto.metadata_props:
        if prop.key == key:
            prop.value = json.dumps(value)
    target = onnx.with_name(name)
    onnx_lib.save(proto, str(target))
    return target


@pytest.mark.parametrize("case", ["parallel", "other_model", "other_plan", "missing", "not_empty", "scales"])
def test_bad_input_is_one_line_and_writes_nothing(tool, fused, tmp_path, case) -> None:
    folder, onnx = fused
    args: list[object] = ["--source", folder]
    expected = {
        "parallel": "parallel blocks",
        "other_model": "holds other values",
        "other_plan": "another plan",
        "missing": "not found",
        "not_empty": "not an empty folder",
        "scales": "--fp8-scales only applies to --fp8 per-tensor",
    }[case]
    if case == "parallel":
        plan = {"groups": [], "norm": "last", "parallel_blocks": [[0, 1]]}
        onnx = _edited(onnx, "parallel.onnx", "ffn_fusion.plan", plan)
    elif case == "other_plan":
        onnx = _edited(onnx, "other_plan.onnx", "ffn_fusion.plan", {"groups": [[1, 3]], "norm": "last"})
    elif case == "other_model":
        args = ["--source", write_all_kinds(tmp_path / "other", seed=8)]
    elif case == "missing":
        onnx = tmp_path / "absent.onnx"
    elif case == "not_empty":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("mine")
    elif case == "scales":
        args += ["--fp8-scales", tmp_path / "s.json"]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = tool("export_checkpoint", onnx, *args, "-o", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no staging folder
    if case == "not_empty":
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("budget", [100_000, 700_000])
def test_full_disk(fused, tmp_path, budget) -> None:
    """ENOSPC in the first shard or later (the every-kind checkpoint is ~1 MB at 0.0003 GB shards)."""
    folder, onnx = fused
    script = FULL_DISK.format(root=str(ROOT), tool=str(ROOT / "tools" / "export_checkpoint.py"))
    command = [sys.executable, "-c", script, str(budget), str(onnx), "--source", str(folder),
               "-o", str(tmp_path / "out"), "--dtype", "float32", "--shard-gb", "0.0003"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()  # the progress lines, then the one error line
    assert lines[-1].startswith("error: no space left on device") and "Traceback" not in result.stderr
    assert [line for line in lines if line.startswith("error")] == lines[-1:]
    assert list(tmp_path.iterdir()) == []
