"""Healing a parallel group of a third-party export (Optimum, from the corpus of tests/corpora: Cast copies of
the stream before every residual add and norm): the group's error drops, the written graph is checked
against the fit, and its logits equal the Hugging Face model with the healed FFN weights loaded and the
group run in parallel (tests/torch_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from passes.error_measures import l2_relative_error
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from runtime.heal.distill import heal
from runtime.heal.ffn import GroupWeights
from tests.passes.test_parallel_models import IDS, torch_logits
from tests.run_graph import graph_logits

pytestmark = pytest.mark.slow
GROUP = (2, 5)  # full blocks in the corpus model (attention is dropped from 13-22)


def test_optimum_parallel_group_heals(third_party_corpus, corpus_hf, tmp_path):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the corpus reference needs it)

    original = third_party_corpus["optimum"]
    plan = parse_plan({"parallel_blocks": [list(GROUP)]})
    fused = fuse_file(original, plan, tmp_path / "fused.onnx").output
    ids = np.random.default_rng(4).integers(0, 49152, size=(12, 32))
    result = heal(original, fused, ids[:10], ids[10:], tmp_path / "healed.onnx")  # writing checks the file
    (group,) = result.groups
    assert group.group == GROUP and group.kind == "parallel"
    assert group.calib_after < 0.5 * group.calib_before, group.line()
    model = AutoModelForCausalLM.from_pretrained(corpus_hf, dtype=torch.float32).eval()
    blocks = find_blocks(load_model(result.output))
    for k in range(GROUP[0], GROUP[1] + 1):
        w, layer = GroupWeights.read(blocks[k]), model.model.layers[k]
        mlp = layer.mlp
        for linear, matrix in ((mlp.gate_proj, w.gate), (mlp.up_proj, w.up), (mlp.down_proj, w.down)):
            linear.weight.data = torch.from_numpy(np.ascontiguousarray(matrix.T))
        layer.post_attention_layernorm.weight.data = torch.from_numpy(w.norm.copy())
    reference = torch_logits(model, [list(GROUP)])
    assert l2_relative_error(graph_logits(result.output, IDS), reference) < 1e-4
    # the healed weights are what the reference runs
    assert l2_relative_error(graph_logits(fused, IDS), reference) > 1e-3
