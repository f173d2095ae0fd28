"""Analytical decode latency model: calibration targets, fusion effects, roofline, tool JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from passes.errors import UserError
from runtime.latency.constants import CONSTANTS
from runtime.latency.fit import fit_overheads, speedup_bound
from runtime.latency.paper_models import llama_405b, param_count, predict_model, super_49b, ultra_253b
from runtime.latency.predict import (
    LayerShape,
    ParallelGroup,
    allreduce_s,
    fuse_blocks,
    gemm_s,
    hardware,
    predict_decode,
)

ROOT = Path(__file__).resolve().parents[3]


def test_calibration_targets_are_met():
    hw = hardware("h100")
    llama = predict_model(llama_405b(), hw).before.tokens_per_s
    ultra = predict_model(ultra_253b(), hw).before.tokens_per_s
    assert llama == pytest.approx(41.44, rel=0.02)
    assert ultra == pytest.approx(63.38, rel=0.02)


def test_stored_calibration_matches_a_refit():
    fit = fit_overheads("h100")
    assert 0.3 < fit.bw_efficiency <= 1.0
    assert fit.layer_overhead >= 0.0
    assert CONSTANTS["calibrated.bw_efficiency"].value == pytest.approx(fit.bw_efficiency, rel=1e-6)
    assert CONSTANTS["calibrated.layer_overhead"].value == pytest.approx(fit.layer_overhead, rel=1e-6)


def test_fused_ultra_is_faster_and_drops_sum_k_minus_1_allreduces():
    spec = ultra_253b()
    p = predict_model(spec, hardware("h100"))
    assert p.speedup > 1.0
    removed = sum(j - i for i, j in spec.groups)  # sum(k - 1) with k = j - i + 1
    assert removed == 45
    assert p.before.n_allreduce - p.after.n_allreduce == removed
    assert p.after.n_layers == 81  # the released model's real blocks
    assert p.after.weight_bytes_per_gpu == pytest.approx(p.before.weight_bytes_per_gpu, rel=1e-4)
    # the prediction never reached the (uncalibrated) paper number: the linear bound says why
    bound = speedup_bound("h100")
    assert p.speedup <= bound.speedup < 1.12


def test_super_49b_plan():
    spec = super_49b()
    assert len(spec.blocks) == 80
    assert param_count(spec) / 1e9 == pytest.approx(49.9, abs=0.3)
    fused = fuse_blocks(spec.blocks, spec.groups)
    assert len(fused) == 80 - 8 - 16
    widths = [b.ffn_width for b in spec.blocks]
    assert fused[42].ffn_width == sum(widths[42:51])
    assert not fused[42].attention
    p = predict_model(spec, hardware("h200"))
    assert p.before.n_allreduce - p.after.n_allreduce == 24
    assert p.speedup > 1.0


def test_param_counts_are_near_the_names():
    assert param_count(llama_405b()) / 1e9 == pytest.approx(405.9, abs=0.5)
    assert param_count(ultra_253b()) / 1e9 == pytest.approx(253.0, abs=1.5)


def test_fused_group_keeps_first_blocks_attention():
    blocks = [LayerShape(True, 512), LayerShape(False, 256), LayerShape(False, 768), LayerShape(True, 512)]
    fused = fuse_blocks(blocks, [[0, 2]])
    assert fused == [LayerShape(True, 1536), LayerShape(True, 512)]
    with pytest.raises(UserError, match="attention inside"):
        fuse_blocks(blocks, [[1, 3]])
    with pytest.raises(UserError, match="overlaps"):
        fuse_blocks(blocks, [[0, 1], [1, 2]])


def test_doubling_bandwidth_halves_a_memory_bound_gemm():
    hw = hardware("h100")
    fast = replace(hw, hbm_bandwidth=2 * hw.hbm_bandwidth)
    slow_t, fast_t = gemm_s(1, 16384, 6656, hw), gemm_s(1, 16384, 6656, fast)
    assert fast_t == pytest.approx(slow_t / 2, rel=1e-12)
    # a compute-bound GEMM (batch 4096) does not care
    assert gemm_s(4096, 16384, 6656, fast) == pytest.approx(gemm_s(4096, 16384, 6656, hw), rel=1e-12)


def test_context_adds_kv_reads_and_h200_is_faster():
    spec = llama_405b()
    h100, h200 = hardware("h100"), hardware("h200")
    args = (spec.blocks, spec.hidden, spec.vocab, spec.heads, spec.kv_heads)
    short = predict_decode(*args, h100, context=1024)
    long = predict_decode(*args, h100, context=32768)
    assert long.attention_s == pytest.approx(32 * short.attention_s, rel=1e-9)
    assert long.gemm_s == short.gemm_s
    assert predict_decode(*args, h200).total_s < short.total_s


def test_every_constant_has_a_source():
    kinds = ("datasheet", "paper", "measured", "assumption", "calibrated")
    for name, c in CONSTANTS.items():
        assert c.source.split(":")[0].split(" ")[0] in kinds, name
        assert c.unit, name


def test_tool_json_schema():
    run = subprocess.run(
        [
            sys.executable,
            "tools/bench.py",
            "latency",
            "--gpu",
            "h200",
            "--batch",
            "2",
            "--context",
            "2048",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    data = json.loads(run.stdout)
    assert set(data) == {"Llama-3.1-405B", "Ultra-253B", "Super-49B"}
    for entry in data.values():
        for key in ("tokens_per_s_before", "tokens_per_s_after", "speedup"):
            assert isinstance(entry[key], float) and entry[key] > 0
        for key in ("allreduces_before", "allreduces_after"):
            assert isinstance(entry[key], int)
        assert entry["speedup"] == pytest.approx(entry["tokens_per_s_after"] / entry["tokens_per_s_before"])
        assert (entry["gpu"], entry["batch"], entry["context"]) == ("H200", 2, 2048)
    ultra = data["Ultra-253B"]
    assert ultra["allreduces_before"] - ultra["allreduces_after"] == 45
    assert ultra["paper_measured"]["tokens_per_s_after"] == 70.92
    assert ultra["paper_measured"]["speedup"] == 1.12
    assert data["Llama-3.1-405B"]["paper_measured"]["tokens_per_s_before"] == 41.44
    assert "paper_measured" not in data["Super-49B"]
    super49 = data["Super-49B"]
    assert super49["parallel_blocks"] == [[38, 41], [71, 74]]
    assert super49["allreduces_after"] - super49["allreduces_parallel"] == 12  # 2 x (8 - 2)
    assert super49["speedup_parallel"] > super49["speedup"]
    rows = super49["parallel_series"]
    assert [r["paper_mmlu"] for r in rows] == [80.73, 80.04, 77.86, 56.12]
    assert [r["allreduces"] for r in rows] == [129, 117, 111, 105]
    assert "parallel_blocks" not in data["Llama-3.1-405B"]


def test_tool_table_and_bad_input():
    ok = subprocess.run(
        [sys.executable, "tools/bench.py", "latency"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0
    assert "Ultra-253B" in ok.stdout and "70.92" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "tools/bench.py", "latency", "--batch", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ")


def test_parallel_group_is_one_step_with_two_allreduces():
    """k whole blocks side by side: the same bytes, one step, one stacked attention all-reduce and one FFN
    all-reduce instead of 2k, one kernel sequence per sub-block kind."""
    hw, hidden = hardware("h100"), 8192
    blocks = [LayerShape(True, 28672) for _ in range(4)]
    args = (hidden, 128256, 64, 8, hw)
    sequential = predict_decode(blocks, *args)
    parallel = predict_decode(fuse_blocks(blocks, [], [[0, 3]]), *args)
    assert fuse_blocks(blocks, [], [[0, 3]]) == [ParallelGroup(tuple(blocks))]
    assert (sequential.n_allreduce, parallel.n_allreduce) == (8, 2)
    assert (sequential.n_layers, parallel.n_layers) == (4, 1)
    assert parallel.weight_bytes_per_gpu == sequential.weight_bytes_per_gpu
    assert parallel.gemm_s == pytest.approx(sequential.gemm_s)
    assert parallel.attention_s == sequential.attention_s
    message = hidden * 2  # batch 1, bf16 activations
    logits = allreduce_s(int(np.ceil(128256 / 8)) * 2, hw)
    expected = allreduce_s(4 * message, hw) + allreduce_s(message, hw) + logits  # stacked, then summed
    assert parallel.allreduce_s == pytest.approx(expected)
    assert parallel.total_s < sequential.total_s


def test_parallel_groups_take_whole_blocks_and_do_not_overlap():
    blocks = [LayerShape(True, 512), LayerShape(True, 512), LayerShape(False, 256), LayerShape(True, 512)]
    with pytest.raises(UserError, match=r"block 2 lacks attention or an FFN"):
        fuse_blocks(blocks, [], [[1, 2]])
    with pytest.raises(UserError, match="out of range"):
        fuse_blocks(blocks, [], [[3, 3]])  # a group of one block
    with pytest.raises(UserError, match="overlaps"):
        fuse_blocks(blocks, [[1, 2]], [[0, 1]])
    mixed = fuse_blocks(blocks + [LayerShape(True, 512)], [[1, 2]], [[3, 4]])
    assert mixed == [blocks[0], LayerShape(True, 768), ParallelGroup((blocks[3], LayerShape(True, 512)))]
