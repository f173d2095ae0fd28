"""tools/bench_fuse.py end to end at a small scale (the 4.8 GB run is in the README)."""

from __future__ import annotations

import json


def test_bench_fuse_reports_memory_and_time(tool, tmp_path):
    result = tool(
        "bench_fuse",
        "--hidden",
        256,
        "--ffn",
        1024,
        "--blocks",
        4,
        "--group",
        2,
        "--json",
        "--workdir",
        tmp_path,
        check=True,
    )
    numbers = json.loads(result.stdout)
    assert numbers["largest_group_bytes"] == 3 * 256 * 1024 * 4 * 2
    for step in ("fuse", "fuse_validate"):
        assert 0 < numbers[f"{step}_peak_rss"] < numbers["bound_bytes"]
        assert numbers[f"{step}_s"] > 0 and numbers[f"{step}_vs_copy"] > 0
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
