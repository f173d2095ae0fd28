"""tools/bench_fuse.py end to end at a small scale (the issue-13 shapes are measured in docs/scale.md)."""

from __future__ import annotations

import json


def test_bench_fuse_reports_memory_and_time(tool, tmp_path):
    result = tool(
        "bench_fuse",
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
    for shape in shapes:
        for step in shape["steps"]:
            assert step["seconds"] > 0 and step["vs_copy"] > 0 and step["peak_bytes"] > 0
            # Memory bounds hold at any size; the time bound only means something on GB-sized models.
            if step["bound_bytes"] is not None:
                assert step["peak_bytes"] <= step["bound_bytes"], step
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself


def test_bench_fuse_refuses_a_bad_shape(tool):
    result = tool("bench_fuse", "--shape", "x:1:2")
    assert result.returncode == 2 and result.stderr.startswith("error: --shape 'x:1:2'")
    result = tool("bench_fuse", "--repeat", "0")
    assert result.returncode == 2 and result.stderr.startswith("error: --repeat 0")
