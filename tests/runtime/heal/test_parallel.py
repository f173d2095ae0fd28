"""Healing full-block parallel groups (runtime/heal/parallel.py) on the tiny project export of
tests/passes/test_parallel.py: a plan with a parallel group and an FFN group heals both (held-out KL and
every group's error drop), the healed graph's logits equal an independent torch model of the healed
formula, the decode graph takes the prefill heal's weights (--weights-from), a parallel-only plan heals,
and an original that was not the one parallelized is refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from exporters.llama import build_model
from exporters.spec import BlockSpec, ModelSpec
from passes.error_measures import l2_relative_error
from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from runtime.heal.distill import heal
from runtime.heal.ffn import GroupWeights
from runtime.heal.report import run_heal
from runtime.text_sets import windows
from tests.artifacts import spec_export
from tests.passes.test_parallel import PLAN, SEED, spec
from tests.run_graph import graph_logits
from tests.runtime.heal.synthetic import assert_one_line_error
from tests.torch_reference import parallel_blocks_model, parallel_model

IDS = np.random.default_rng(5).integers(0, 96, size=(2, 24))


@pytest.fixture(scope="module")
def healed(tmp_path_factory):
    """(folder, report): the tiny model (prefill and decode graphs) fused with PLAN, the prefill graph healed
    with the defaults (the closed-form refit) on 2048 random tokens."""
    folder = tmp_path_factory.mktemp("heal_parallel")
    spec_export(spec(), folder / "prefill.onnx", seed=SEED)
    spec_export(spec(), folder / "decode.onnx", seed=SEED, decode=True)
    for name in ("prefill", "decode"):
        fuse_file(folder / f"{name}.onnx", parse_plan(PLAN), folder / f"{name}.fused.onnx")
    rng = np.random.default_rng(1)
    np.save(folder / "calib.npy", rng.integers(0, 96, 2048))
    np.save(folder / "held.npy", rng.integers(0, 96, 512))
    report = run_heal(
        folder / "prefill.onnx",
        folder / "prefill.fused.onnx",
        folder / "prefill.healed.onnx",
        calib=[folder / "calib.npy"],
        heldout=[folder / "held.npy"],
        window=64,
        eval_tokens=256,
    )
    return folder, report


def test_both_kinds_of_group_heal(healed):
    folder, report = healed
    groups = report.result.groups
    assert [(g.group, g.kind) for g in groups] == [((0, 2), "parallel"), ((4, 5), "ffn")]
    assert groups[0].width == 96 + 64 + 80 and "parallel group [0, 2] (3 FFNs, width 240)" in groups[0].line()
    for group in groups:
        assert group.heldout_after < 0.9 * group.heldout_before, group.line()
        assert group.calib_after < 0.8 * group.calib_before, group.line()
    kl_before, kl_after = report.before[-1].kl, report.after[-1].kl
    assert kl_after < 0.8 * kl_before, (kl_before, kl_after)
    print("\n".join(report.lines()))
    recorded = json.loads(load_model(report.result.output).metadata_props[HEAL_METADATA_KEY])
    assert [g["kind"] for g in recorded["groups"]] == ["parallel", "ffn"]


def test_healed_logits_equal_torch_reference(healed):
    """The healed graph against the torch model of the plan (tests/torch_reference.py) with the healed FFN
    weights loaded: the parallel group's members and the fused group's halves ("last": layer 5's norm)."""
    folder, report = healed
    blocks = find_blocks(load_model(report.result.output))
    model = build_model(spec(), SEED)
    layers = model.model.layers

    def load(layer: int, gate, up, down, norm=None) -> None:
        mlp = layers[layer].mlp
        for linear, matrix in ((mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, down)):
            linear.weight.data = torch.from_numpy(np.ascontiguousarray(matrix.T))
        if norm is not None:
            layers[layer].post_attention_layernorm.weight.data = torch.from_numpy(norm.copy())

    for k in range(3):
        w = GroupWeights.read(blocks[k])
        load(k, w.gate, w.up, w.down, w.norm)
    fused = GroupWeights.read(blocks[4])
    width = layers[4].mlp.gate_proj.out_features
    load(4, fused.gate[:, :width], fused.up[:, :width], fused.down[:width])
    load(5, fused.gate[:, width:], fused.up[:, width:], fused.down[width:], fused.norm)
    parallel_model(model, [(4, 5)], "last")
    parallel_blocks_model(model, [(0, 2)])
    with torch.no_grad():
        reference = model(torch.from_numpy(IDS)).numpy()
    got = graph_logits(report.result.output, IDS)
    assert l2_relative_error(got, reference) < 1e-4
    unhealed = graph_logits(folder / "prefill.fused.onnx", IDS)
    assert l2_relative_error(unhealed, reference) > 1e-2  # healing changed the model


def test_decode_graph_takes_the_prefill_heal(healed, tool):
    folder, report = healed
    out = folder / "decode.healed.onnx"
    args = ["--heldout", folder / "held.npy", "--window", 64, "--eval-tokens", 0, "-o", out]
    result = tool("heal", folder / "decode.onnx", folder / "decode.fused.onnx", "--weights-from",
                  report.result.output, *args)
    assert result.returncode == 0, result.stderr
    assert "parallel group [0, 2]" in result.stdout and "weights taken from" in result.stdout
    assert l2_relative_error(graph_logits(out, IDS), graph_logits(report.result.output, IDS)) < 1e-5
    unhealed = graph_logits(folder / "decode.fused.onnx", IDS)
    assert l2_relative_error(unhealed, graph_logits(report.result.output, IDS)) > 1e-2


def test_parallel_only_plan_heals_and_wrong_original_is_refused(healed, tool, tmp_path):
    folder, _ = healed
    fused = fuse_file(folder / "prefill.onnx", parse_plan({"parallel_blocks": [[1, 3]]}), tmp_path / "p.onnx")
    calib, held = windows(np.load(folder / "calib.npy"), 64)[:16], windows(np.load(folder / "held.npy"), 64)
    (group,) = heal(folder / "prefill.onnx", fused.output, calib, held, None).groups
    assert group.group == (1, 3) and group.kind == "parallel"
    assert group.heldout_after < group.heldout_before, group.line()
    other = tmp_path / "other.onnx"
    spec_export(spec(), other, seed=SEED + 1)
    cases = {
        "wrong original": (
            [other, fused.output, "--calib", folder / "calib.npy"],
            "its parallel group [1, 3] holds other FFN weights than the original's block 1",
        )
    }
    assert_one_line_error(tool, folder, tmp_path, cases)


def test_parallel_group_after_an_ffn_group_heals(tmp_path):
    """The fused graph numbers a parallel group after an FFN group in its own blocks ([0, 1] fused -> the
    parallel [2, 4] is the fused graph's [1, 3]); healing finds it there."""
    attention, widths = [True, False, True, True, True], [64, 48, 80, 56, 72]
    blocks = [BlockSpec(a, w) for a, w in zip(attention, widths, strict=True)]
    model = tmp_path / "m.onnx"
    mixed = ModelSpec(hidden=32, heads=4, kv_heads=2, vocab=96, tie_embeddings=False, blocks=blocks)
    spec_export(mixed, model, seed=SEED)
    plan = parse_plan({"groups": [[0, 1]], "parallel_blocks": [[2, 4]]})
    fused = fuse_file(model, plan, tmp_path / "f.onnx")
    ids = windows(np.random.default_rng(3).integers(0, 96, 1024), 32)
    groups = heal(model, fused.output, ids[:24], ids[24:], None).groups
    assert [(g.group, g.kind) for g in groups] == [((0, 1), "ffn"), ((2, 4), "parallel")]
    assert all(g.heldout_after < g.heldout_before for g in groups), [g.line() for g in groups]
