"""tools/bench.py serve against two real servers on 127.0.0.1 (the tiny decode graph, original and fused)."""

from __future__ import annotations

import json

import pytest

from runtime.serve import loading
from runtime.serve.server import ServerThread
from tests import serve_fixtures as sf


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    original = loading.load(sf.tiny_folder(base, "decode"))
    fused = loading.load(sf.tiny_folder(base, "decode_fused"))
    with ServerThread(original) as a, ServerThread(fused) as b:
        yield a, b


def test_bench_serve_measures_both_servers_side_by_side(servers, tool, tmp_path):
    a, b = servers
    out = tmp_path / "bench"
    result = tool(
        "bench", "serve",
        a.url,
        b.url + "/v1",
        "--concurrency",
        "1",
        "4",
        "--requests",
        "8",
        "--max-tokens",
        "6",
        "--prompt-words",
        "12",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--out",
        out,
        check=True,
        timeout=600,
    )
    data = json.loads((out / "bench_serve.json").read_text())
    assert data["format"] == "ffn-fusion-bench-serve/1"
    assert [(t["label"], t["model"]) for t in data["targets"]] == [
        ("original", "tiny_decode"),
        ("fused", "tiny_decode_fused"),
    ]
    assert [(r["concurrency"], r["label"]) for r in data["results"]] == [
        (1, "original"),
        (1, "fused"),
        (4, "original"),
        (4, "fused"),
    ]
    for r in data["results"]:
        assert r["requests"] == 8 and r["failed"] == 0
        assert r["output_tokens"] == 8 * 6  # ignore_eos: every request generates max_tokens
        assert r["output_tokens_per_s"] > 0 and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p90"] <= r["ttft_ms_p99"]
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
    assert set(data["throughput_scaling"]) == {"from", "to", "original", "fused"}
    assert [r["concurrency"] for r in data["throughput_ratio"]] == [1, 4]
    markdown = (out / "bench_serve.md").read_text()
    assert "| 4 | fused |" in markdown and markdown in result.stdout
    assert "cores; ONNX Runtime " in markdown  # runtime.bench.report.machine_line, as the generation report
    assert (out / "bench_serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_bad_input(servers, tool, tmp_path):
    a, _ = servers
    for args, message in [
        (["localhost:1"], "not an http"),
        ([a.url, a.url, a.url], "one or two"),
        ([a.url, "--requests", "0"], "--requests"),
        ([a.url, "--labels", "x", "y"], "--labels"),
        ([a.url, "--model", "other"], "does not serve"),
        (["http://127.0.0.1:9"], "cannot list the models"),
    ]:
        result = tool("bench", "serve", *args, "--out", tmp_path / "never", timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, args
    assert not (tmp_path / "never").exists()
