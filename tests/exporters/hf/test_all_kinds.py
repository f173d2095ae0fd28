"""Every Nemotron-NAS layer kind through every graph stage: a tiny checkpoint with variable GQA, an
attention-free run with an identity layer, an attention-only layer, a Linear attention and a Linear FFN
(exporters.hf.synthetic.ALL_KINDS_BLOCKS), exported by exporters.hf and then shown, fused (both norm
modes, validated against the original and the float64 reference), analyzed, evaluated, FP8-quantized and
sharded at TP 2 over gloo, and healed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import ALL_KINDS_BLOCKS, write_all_kinds
from passes.error_measures import max_abs_relative_error
from passes.io.model_io import load_model, save_model
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from passes.shard import shard_file
from runtime.evaluate import evaluate
from runtime.heal.metadata import HealConfig
from runtime.heal.report import run_heal
from runtime.text_sets import TextSet
from tests.run_graph import graph_logits

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 96
ATTENTION = ["gqa kv=2", "none", "none", "none", "none", "gqa kv=1", "gqa kv=4", "linear"] + ["none"] * 3
FFNS = ["swiglu 256", "swiglu 256", "none", "swiglu 256", "swiglu 256", "none", "swiglu 256", "swiglu 256",
        "linear", "swiglu 256", "swiglu 256"]
# Group [1, 4] spans the identity layer 2; [9, 10] is the last run.
PLAN = {"groups": [[1, 4], [9, 10]], "norm": "fold"}


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("all_kinds")
    folder = write_all_kinds(base / "ckpt", seed=7, vocab=VOCAB)
    path = base / "onnx" / "model.onnx"
    export_hf(folder, path, dtype="float32")
    return path


def _ids(seed: int = 0, batch: int = 2, seq: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, seq)).astype(np.int64)


def test_block_table_lists_every_layer_with_its_two_parts(tool, all_kinds) -> None:
    assert len(ALL_KINDS_BLOCKS) == len(ATTENTION) == len(FFNS)
    table = tool("fuse_onnx", all_kinds, "--show-blocks", check=True).stdout
    lines = table.splitlines()[1 : 1 + len(ATTENTION)]
    for i, line in enumerate(lines):  # block numbers are the layer indices; both parts on every row
        assert line.startswith(f"{i:>5}  {ATTENTION[i]:<10}  {FFNS[i]:<12}  "), line
        assert line.rstrip().endswith(f"model.layers.{i}"), line
    assert "stream: A----AAL---" in table and "ffns:   FF-FF-FFLFF" in table
    assert "attention-free runs: 1-4 (4 blocks), 9-10 (2 blocks)" in table
    rows = json.loads(tool("fuse_onnx", all_kinds, "--show-blocks", "--json", check=True).stdout)["blocks"]
    assert [r["ffn"] for r in rows] == ["swiglu", "swiglu", "none", "swiglu", "swiglu", "none", "swiglu",
                                        "swiglu", "linear", "swiglu", "swiglu"]
    assert [r["kv_heads"] for r in rows if r["attention"]] == [2, 1, 4]


@pytest.mark.parametrize("norm", ["last", "fold"])
def test_attention_free_run_fuses_validated(all_kinds, tmp_path, norm) -> None:
    """The group across the identity layer fuses; validation runs the fused model against the original
    and every group against the float64 parallel-sum reference (fuse_file raises on a mismatch)."""
    fused = tmp_path / "fused.onnx"
    result = fuse_file(all_kinds, parse_plan({**PLAN, "norm": norm}), fused)
    assert result.report is not None and result.report.ok
    assert [g.group for g in result.report.groups] == [(1, 4), (9, 10)]
    assert all(g.rel_error <= 1e-5 for g in result.report.groups)
    blocks = find_blocks(load_model(fused))
    # Layers 2-4 and 10 are gone; the fused FFNs are 3 and 2 FFNs wide; every other layer keeps its parts.
    assert [b.layer_name for b in blocks] == [f"model.layers.{i}" for i in (0, 1, 5, 6, 7, 8, 9)]
    assert [b.width for b in blocks] == [256, 768, 0, 256, 256, 0, 512]
    assert [b.attention_kind for b in blocks] == ["attention", "none", "attention", "attention", "linear",
                                                  "none", "none"]


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ([4, 6], "error: group [4, 6] spans attention: block 5 has attention (layer model.layers.5;"),
        ([7, 9], "error: group [7, 9] spans a branch fusion cannot cross: block 8's FFN is residual branch"),
        ([6, 8], "error: group [6, 8] spans a branch fusion cannot cross: block 7 follows residual branch"),
        ([2, 3], "error: group [2, 3] has fewer than two SwiGLU FFNs to fuse (only block 3)"),
    ],
)
def test_group_across_an_attention_part_or_linear_is_refused(tool, all_kinds, tmp_path, group, message):
    _refused(tool, all_kinds, tmp_path, {"groups": [group]}, message)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ([6, 7], "error: parallel group [6, 7]: block 7 (layer model.layers.7) has no softmax attention: its "
                 "attention part is residual branch"),
        ([5, 6], "error: parallel group [5, 6]: block 5 (layer model.layers.5) has no FFN part"),
        ([0, 1], "error: parallel group [0, 1]: block 1 (layer model.layers.1) has no attention part"),
    ],
)
def test_parallel_group_over_a_puzzle_kind_is_refused(tool, all_kinds, tmp_path, group, message) -> None:
    """A Linear (replace_with_linear) attention, a no-op FFN, a no-op attention: no full block."""
    _refused(tool, all_kinds, tmp_path, {"groups": [], "parallel_blocks": [group]}, message)


def _refused(tool, all_kinds, tmp_path, data: dict, message: str) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    out = tmp_path / "fused.onnx"
    result = tool("fuse_onnx", all_kinds, plan, "-o", out)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not out.exists() and not list(tmp_path.glob("*.data"))


def test_analysis_proposes_a_plan(tool, all_kinds, tmp_path) -> None:
    ids = tmp_path / "ids.npy"
    np.save(ids, _ids(1).reshape(-1))
    out = tmp_path / "analysis"
    args = ("--tokens", ids, "--num-tokens", 18, "--window", 9, "--threshold", 100, "--norm", "auto")
    tool("analyze", all_kinds, "--out", out, *args, check=True)
    report = json.loads((out / "analysis.json").read_text())
    assert [b["index"] for b in report["blocks"]] == list(range(len(ALL_KINDS_BLOCKS)))
    dependency = np.array(report["dependency"], dtype=float)
    assert np.nanmax(dependency[:, 2]) < 1e-12 and np.nanmax(dependency[2]) < 1e-12  # the identity layer
    # Any dependency allowed: run 1-4 less its final FFN (block 4) is one group across the identity layer;
    # run 9-10 is too short once block 10 is left out.
    assert json.loads((out / "plan.json").read_text())["groups"] == [[1, 3]]


def test_fp8_evaluate_and_tp2_over_gloo(all_kinds, tmp_path) -> None:
    fused = tmp_path / "fused" / "model.onnx"
    fuse_file(all_kinds, parse_plan(PLAN), fused)
    ids = _ids(2)
    reference = graph_logits(fused, ids)

    # FP8: every linear layer of the blocks (SwiGLU, attention, the Linear replacements) gets Q/DQ.
    model = load_model(fused)
    report = quantize_fp8(model, calibrate(fused, [_ids(s) for s in range(2)], progress=False))
    linear = [n for n in report.quantized if "linear_attn" in n or "linear_mlp" in n]
    assert len(linear) == 2 and list(report.skipped) == ["lm_head/MatMul"], report.skipped
    assert len(report.quantized) == 3 * 4 + 2 + 5 * 3  # q/k/v/o of 3 GQA layers, 2 Linears, 5 SwiGLUs
    assert report.max_width == 768  # the fused [1, 4]
    fp8 = tmp_path / "fp8" / "model.onnx"
    fp8.parent.mkdir()
    save_model(model, fp8, external=True)
    assert 0 < max_abs_relative_error(graph_logits(fp8, ids), reference) < 0.3

    # Evaluation of the fused model against the original.
    (quality,) = evaluate(all_kinds, fused, [TextSet("random", _ids(3, 2, 16), ())], progress=False)
    assert quality.kl > 0 and 0 < quality.top1_agreement <= 1

    # TP 2 over gloo (one torchrun launch, both models) equals one device.
    sources = [all_kinds, fused]
    dirs = [tmp_path / "tp2_original", tmp_path / "tp2_fused"]
    for source, directory in zip(sources, dirs, strict=True):
        sharded = shard_file(source, 2, directory, progress=False)
        attention = [b for b in sharded.branches if b.kind == "attention"]
        assert [b.kv_heads for b in attention] == [2, 1, 4]  # each layer's own KV heads
    np.save(tmp_path / "ids.npy", ids)
    outs = [d.with_suffix(".npy") for d in dirs]
    command = [
        str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2",
        "--master-port", str(29300 + os.getpid() % 500), str(ROOT / "tools" / "run_tp.py"),
        *map(str, dirs), "--tokens", str(tmp_path / "ids.npy"), "--out", *map(str, outs),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    for source, out in zip(sources, outs, strict=True):
        assert max_abs_relative_error(np.load(out), graph_logits(source, ids)) <= 1e-5


def test_without_the_layer_map_blocks_are_numbered_as_seen(all_kinds) -> None:
    """A graph without the exporter's metadata: the identity layer is not seen, the attention-only layer
    before an attention layer is still a block of its own, and layer 8's Linear FFN, alone on an empty
    block, reads as the attention part of the block whose FFN is layer 9's (only the map can tell)."""
    model = load_model(all_kinds)
    del model.metadata_props["ffn_fusion.hf"]
    blocks = find_blocks(model)
    assert [b.index for b in blocks] == list(range(9))
    assert [(b.attention_kind, b.ffn_kind) for b in blocks] == [
        ("attention", "swiglu"), ("none", "swiglu"), ("none", "swiglu"), ("none", "swiglu"),
        ("attention", "none"), ("attention", "swiglu"), ("linear", "swiglu"), ("linear", "swiglu"),
        ("none", "swiglu"),
    ]
    assert [b.layer_name for b in blocks] == [f"model.layers.{i}" for i in (0, 1, 3, 4, 5, 6, 7, 9, 10)]


def test_heal_a_group_across_the_identity_layer(all_kinds, tmp_path) -> None:
    """Healing refits the group [1, 4] (its identity layer 2 adds no FFN) and the last run: the healed
    model is written, each group's fit lowers its calibration error, and the block table is kept. (Random
    tokens on random weights: the held-out error is not a quality measure here.)"""
    fused = fuse_file(all_kinds, parse_plan(PLAN), tmp_path / "fused.onnx").output
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(1, 1024)).astype(np.int64)
    held = np.random.default_rng(4).integers(0, VOCAB, size=(1, 256)).astype(np.int64)
    np.save(tmp_path / "calib.npy", ids)
    np.save(tmp_path / "held.npy", held)
    report = run_heal(
        all_kinds, fused, tmp_path / "healed.onnx", HealConfig(steps=10, lr=3e-3, batch_tokens=256),
        calib=[tmp_path / "calib.npy"], heldout=[tmp_path / "held.npy"], window=32, eval_tokens=0,
    )
    assert [g.group for g in report.result.groups] == [(1, 4), (9, 10)]
    for g in report.result.groups:
        assert g.calib_after < 0.9 * g.calib_before, g
    healed = find_blocks(load_model(tmp_path / "healed.onnx"))
    assert [b.width for b in healed] == [256, 768, 0, 256, 256, 0, 512]
