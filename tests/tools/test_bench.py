"""tools/bench.py decode and tools/generate.py on tiny decode graphs (original vs fused, measured
alternately)."""

from __future__ import annotations

import json

import pytest

from tests import decode_fixtures as fx
from tests.passes.shard.test_parallel_groups import parallel_models

RESULT_KEYS = {
    "model",
    "batch",
    "prompt_len",
    "gen_len",
    "reps",
    "ttft_ms",
    "decode_tokens_per_s",
    "token_latency_ms_p50",
    "token_latency_ms_p90",
    "ttft_ms_all",
    "token_agreement",
}


@pytest.fixture(scope="module")
def models():
    return fx.decode_models


def run_bench(tool, original, fused, out, check: bool = True, **options):
    """tools/bench.py decode --quiet on two models; options as keywords: prompt_len=(4, 8) -> --prompt-len
    4 8."""
    flags = []
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", *(value if isinstance(value, tuple) else (value,))]
    return tool(
        "bench", "decode", "--original", original, "--fused", fused, *flags, "--out", out, "--quiet",
        check=check,
    )


def test_bench_writes_json_markdown_and_png(models, tool, tmp_path):
    out = tmp_path / "bench"
    original, fused = models("decode"), models("decode_fused")
    result = run_bench(
        tool, original, fused, out, batch=(1, 2), prompt_len=(4, 8), gen_len=5, reps=2, warmup=1
    )
    data = json.loads((out / "bench.json").read_text())
    assert data["format"] == "ffn-fusion-bench/1" and data["tp"] == 1 and data["reps"] == 2
    assert {"date", "machine", "models", "results", "speedup", "order"} <= set(data)
    original, fused = data["models"]["original"], data["models"]["fused"]
    # 7 FFN + 2 attention sub-blocks; fusing [0,2] and [4,6] leaves 3 FFNs: 5 all-reduces per token
    assert (original["blocks"], original["allreduces_per_token"]) == (7, 9)
    assert (fused["blocks"], fused["allreduces_per_token"]) == (3, 5)
    assert original["cache_layers"] == fused["cache_layers"] == 2
    assert original["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers x (K,V) x kv heads x dim x 4
    results = data["results"]
    assert len(results) == 8 and all(set(r) == RESULT_KEYS for r in results)
    assert {(r["batch"], r["prompt_len"], r["model"]) for r in results} == {
        (b, p, m) for b in (1, 2) for p in (4, 8) for m in ("original", "fused")
    }
    for r in results:
        assert r["ttft_ms"] > 0 and r["decode_tokens_per_s"] > 0
        assert 0 < r["token_latency_ms_p50"] <= r["token_latency_ms_p90"]
        assert len(r["ttft_ms_all"]) == 2
    assert all(r["token_agreement"] == 1.0 for r in results if r["model"] == "original")
    assert len(data["speedup"]) == 4
    markdown = (out / "bench.md").read_text()
    assert "| batch | prompt | gen | model | TTFT ms |" in markdown
    assert markdown.count("| fused |") == 1 + 4 + 4  # the model table, the results, the speedups
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode tok/s" in result.stdout


def test_bench_tp2_gloo_counts_collectives(models, tool, tmp_path):
    """TP 2, one process per rank (gloo all-reduces). passes.shard does not shard decode graphs yet, so the
    prefill-only exports run here (generation re-runs the sequence: no cache)."""
    out = tmp_path / "tp2"
    original, fused = models("prefill"), models("prefill_fused")
    run_bench(tool, original, fused, out, tp=2, batch=1, prompt_len=4, gen_len=3, reps=1, warmup=0)
    data = json.loads((out / "bench.json").read_text())
    assert data["tp"] == 2 and data["tp_mode"] == "gloo"
    assert data["models"]["original"]["collectives_per_forward"] == 9
    assert data["models"]["fused"]["collectives_per_forward"] == 5
    assert (out / "shards" / "fused_tp2" / "tp.json").is_file()


def test_bench_parallel_blocks_side_by_side(tool, tmp_path, tmp_path_factory):
    """--parallel: original, FFN-fused and FFN-fused + one parallel group of 3 blocks in one TP 2 run (gloo):
    10, 9 and 5 all-reduces per token, each counted in its rank graphs too, ratios to the original."""
    paths = parallel_models()
    out = tmp_path / "bench"
    run_bench(tool, paths["decode"], paths["decode_fused"], out, parallel=paths["decode_plan"], tp=2, batch=1,
              prompt_len=4, gen_len=3, reps=1, warmup=0)
    data = json.loads((out / "bench.json").read_text())
    models = data["models"]
    assert list(models) == ["original", "fused", "parallel"]
    counts = {name: (m["allreduces_per_token"], m["collectives_per_forward"]) for name, m in models.items()}
    assert counts == {"original": (10, 10), "fused": (9, 9), "parallel": (5, 5)}
    assert models["parallel"]["parallel_groups"] == [[0, 2]] and models["fused"]["parallel_groups"] == []
    assert [(s["model"], s["batch"]) for s in data["speedup"]] == [("fused", 1), ("parallel", 1)]
    assert all(s["decode_tokens_per_s"] > 0 for s in data["speedup"])
    markdown = (out / "bench.md").read_text()
    assert markdown.count("| parallel |") == 3 and "| 1 | 4 | parallel |" in markdown  # models, runs, ratios


def test_bench_bad_input_is_one_line_error(models, tool, tmp_path):
    result = run_bench(tool, tmp_path / "missing.onnx", models("decode_fused"), tmp_path / "x", check=False)
    assert result.returncode == 2 and result.stderr.startswith("error: --original")
    result = run_bench(tool, models("decode"), models("decode_fused"), tmp_path / "x", check=False, gen_len=1)
    assert result.returncode == 2 and "--gen-len" in result.stderr


def test_generate_tool_rejects_a_tokenizer_of_another_vocabulary(models, tool):
    """The SmolLM2 tokenizer's ids do not fit the tiny model's 96-token vocabulary: one-line error.
    (Text generation with SmolLM2 itself: tests/runtime/test_generate.py.)"""
    result = tool(
        "generate", models("decode_fused"), "--prompt", "Hello there", "--max-new-tokens", 4, "--raw"
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: prompt token id") and "vocabulary of 96" in result.stderr
