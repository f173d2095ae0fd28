"""Fusion end to end on exported models: the real SmolLM2 (pruned) and the Super-49B block pattern.

The reference is written here, in torch, independently of the ONNX rewrite: the pruned HF model with
each planned group's layers replaced by their parallel sum x + sum_k mlp_k(norm(x)).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from passes.error_measures import l2_relative_error
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import Plan
from tests.run_graph import graph_logits
from tests.torch_reference import parallel_model  # tests/torch_reference.py

SMOLLM2_GROUPS = ((13, 17), (18, 21))


def torch_parallel_logits(groups, mode: str, ids: np.ndarray) -> np.ndarray:
    from exporters import smollm2  # noqa: PLC0415 (imports transformers: only the SmolLM2 reference needs it)

    model = parallel_model(smollm2.load_pruned(range(13, 23)), groups, mode)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["last", "fold"])
def test_smollm2_pruned_fused_matches_torch_parallel_reference(smollm2_pruned_onnx, tmp_path, mode):
    blocks = find_blocks(load_model(smollm2_pruned_onnx))
    assert len(blocks) == 30 and [b.index for b in blocks if not b.attention] == list(range(13, 23))
    assert blocks[13].layer_name == "model.layers.13"
    result = fuse_file(smollm2_pruned_onnx, Plan(SMOLLM2_GROUPS, mode), tmp_path / f"{mode}.onnx")
    assert result.report.ok and max(g.rel_error for g in result.report.groups) < 1e-5
    assert result.blocks_after == 30 - 4 - 3
    ids = np.random.default_rng(1).integers(0, 49152, size=(2, 11))
    fused = graph_logits(result.output, ids)
    assert l2_relative_error(fused, torch_parallel_logits(SMOLLM2_GROUPS, mode, ids)) < 1e-4
    original = graph_logits(smollm2_pruned_onnx, ids)
    # fusion changed the function: the reference is not trivially equal
    assert l2_relative_error(fused, original) > 1e-3


@pytest.mark.slow
def test_smollm2_empty_plan_is_bit_identical(smollm2_pruned_onnx, tmp_path):
    out = fuse_file(smollm2_pruned_onnx, Plan((), "last"), tmp_path / "empty.onnx").output
    ids = np.arange(7).reshape(1, 7)
    assert np.array_equal(graph_logits(out, ids), graph_logits(smollm2_pruned_onnx, ids))


@pytest.mark.slow
def test_super49b_pattern_fuses_the_paper_groups(super49b_onnx, tmp_path):
    blocks = find_blocks(load_model(super49b_onnx))
    assert len(blocks) == 80
    assert [b.index for b in blocks if not b.attention] == [6, 7, 11, *range(42, 52), *range(53, 71)]
    for mode in ("last", "fold"):
        result = fuse_file(super49b_onnx, Plan(((42, 50), (53, 69)), mode), tmp_path / f"{mode}.onnx")
        assert result.report.ok, result.report.lines()
        fused = find_blocks(load_model(result.output))
        assert len(fused) == 80 - 8 - 16
        assert fused[42].width == sum(b.width for b in blocks[42:51])
        assert fused[53 - 8].width == sum(b.width for b in blocks[53:70])
