"""tools/bench.py fuse end to end at a small scale (the issue-13 shapes are measured in docs/scale.md)."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.bench import fuse as fuse_bench
from tests.conftest import ROOT


@pytest.mark.slow  # a benchmark run: 13-19 s
def test_bench_fuse_reports_memory_and_time(tool, tmp_path):
    result = tool(
        "bench", "fuse",
        "--shape",
        "small:256:1024:4:2:float32",
        "--shape",
        "half:128:512:3:3:float16",
        "--json",
        "--workdir",
        tmp_path,
        "--repeat",
        "2",
        check=True,
    )
    shapes = json.loads(result.stdout)
    assert [s["shape"] for s in shapes] == ["small", "half"]
    assert shapes[0]["group_weight_bytes"] == 3 * 256 * 1024 * 4 * 2
    steps = {s["name"]: s for s in shapes[0]["steps"]}
    fuse_steps = ["copy", "fuse (fold)", "fuse (last)", "fuse + validation"]
    assert list(steps) == [*fuse_steps, "FP8 quantization", "TP 8 sharding", "analysis"]
    assert [s["name"] for s in shapes[1]["steps"]] == fuse_steps
    # Two rounds alternate copy, fold and last (and a last copy); the best of each is reported.
    assert [len(steps[name]["samples"]) for name in fuse_steps[:3]] == [3, 2, 2]
    assert all(steps[name]["seconds"] == min(steps[name]["samples"]) for name in fuse_steps[:3])
    copies = steps["copy"]["samples"]
    for name in fuse_steps[1:3]:  # each round against the copies before and after it
        rounds = zip(steps[name]["samples"], copies[:-1], copies[1:], strict=True)
        ratios = sorted(s / ((a + b) / 2) for s, a, b in rounds)
        assert steps[name]["paired_vs_copy"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert steps["copy"]["paired_vs_copy"] is None
    for shape in shapes:
        for step in shape["steps"]:
            assert step["seconds"] > 0 and step["vs_copy"] > 0 and step["peak_bytes"] > 0
            # Memory bounds hold at any size; the time bound only means something on GB-sized models.
            if step["bound_bytes"] is not None:
                assert step["peak_bytes"] <= step["bound_bytes"], step
        assert shape["direct_reclaim_bytes"] >= 0  # Linux: read from /proc/vmstat
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


def test_paired_ratio_compares_each_round_with_the_copies_around_it():
    # Every round took 1.2x its copies, while the host slowed down; best against best says 1.8 (1.8 / 1.0).
    assert fuse_bench.paired_ratio([1.8, 2.4, 3.6], [2.0, 1.0, 3.0, 3.0]) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="2 rounds need 3 copies"):
        fuse_bench.paired_ratio([1.0, 1.0], [1.0, 1.0])


def test_bench_fuse_refuses_a_bad_shape(tool):
    result = tool("bench", "fuse", "--shape", "x:1:2")
    assert result.returncode == 2 and result.stderr.startswith("error: --shape 'x:1:2'")
    result = tool("bench", "fuse", "--repeat", "0")
    assert result.returncode == 2 and result.stderr.startswith("error: --repeat 0")


@pytest.mark.slow  # a benchmark run: 13-19 s
def test_bench_fuse_runs_another_checkout_side_by_side(tool, tmp_path):
    """--against: the other checkout's own code runs (its `passes`, not this checkout's editable install),
    in the same rounds, and its rows carry no bound."""
    other = tmp_path / "older"
    for folder in ("passes", "tools"):
        shutil.copytree(ROOT / folder, other / folder, ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "ran"
    init = other / "passes" / "__init__.py"
    init.write_text(init.read_text() + f"\nopen({str(marker)!r}, 'a').write('x')\n")
    work = tmp_path / "work"
    args = ["--shape", "small:128:256:2:2:float32", "--no-stages", "--repeat", "2", "--workdir", work]
    result = tool("bench", "fuse", *args, "--against", other, "--json", check=True)
    steps = {s["name"]: s for s in json.loads(result.stdout)[0]["steps"]}
    names = ["copy", "fuse (fold)", "  fold @older", "fuse (last)", "  last @older", "fuse + validation"]
    assert list(steps) == names
    assert [len(steps[name]["samples"]) for name in names[1:5]] == [2, 2, 2, 2]
    assert steps["  fold @older"]["bound_bytes"] is None and steps["  fold @older"]["time_bound"] is None
    # Four runs of the other checkout's fusion, and the probe of which package it imports.
    assert marker.read_text() == "x" * 5


def test_bench_fuse_refuses_what_is_not_a_checkout(tool, tmp_path):
    result = tool("bench", "fuse", "--against", tmp_path)
    assert result.returncode == 2 and "not a checkout of this project" in result.stderr
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "fuse_onnx.py").write_text("")
    (tmp_path / "passes").mkdir()
    (tmp_path / "passes" / "__init__.py").write_text("raise ImportError('broken checkout')\n")
    result = tool("bench", "fuse", "--against", tmp_path)
    assert result.returncode == 2 and "its tools import passes from nowhere" in result.stderr, result.stderr


def test_direct_reclaim_is_read_from_vmstat_and_reported(tmp_path):
    """pgsteal_direct from /proc/vmstat (None without it); a run during which the kernel reclaimed in the
    writers' own path says so in its header, since memory that ran short makes every write slower."""
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 10\npgsteal_kswapd 7\npgsteal_direct 2515161\npgscan_direct 9\n")
    assert fuse_bench.direct_reclaim_pages(vmstat) == 2515161
    assert fuse_bench.direct_reclaim_pages(tmp_path / "missing") is None
    result = fuse_bench.ShapeResult("s", 1 << 30, 1 << 20, direct_reclaim_bytes=3 << 20)
    assert "direct reclaim 3 MB (memory ran short" in fuse_bench.report([result])
    assert "direct reclaim" not in fuse_bench.report([fuse_bench.ShapeResult("s", 1 << 30, 1 << 20)])
