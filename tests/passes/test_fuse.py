"""The rewrite: Theorem 3.1 as a property, exactness against the reference, empty plans, determinism."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import passes.fuse
import passes.io.stream_concat
import passes.reference
import passes.validate
from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.fuse import ffn_members
from passes.io.model_io import load_model, load_proto
from passes.metadata import PLAN_METADATA_KEY
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.reference import group_ffns, swiglu
from passes.validate import ValidationError
from tests.run_graph import graph_logits

SPEC = SyntheticSpec(blocks=[(True, 48), (False, 64), (False, 40), (True, 32), (False, 56), (False, 24)])
IDS = np.arange(12).reshape(1, 12)


@settings(max_examples=40, deadline=None)
@given(
    hidden=st.integers(1, 24),
    widths=st.lists(st.integers(1, 40), min_size=2, max_size=5),
    tokens=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_theorem_3_1_wide_ffn_equals_sum_of_ffns(hidden, widths, tokens, seed):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((tokens, hidden))
    ffns = [
        (rng.standard_normal((hidden, w)), rng.standard_normal((hidden, w)), rng.standard_normal((w, hidden)))
        for w in widths
    ]
    summed = sum(swiglu(z, *ffn) for ffn in ffns)
    wide = swiglu(z, *(np.concatenate([f[k] for f in ffns], axis=1 if k < 2 else 0) for k in range(3)))
    np.testing.assert_allclose(wide, summed, rtol=1e-10, atol=1e-10)


def test_empty_plan_gives_bit_identical_logits(tmp_path):
    path = build_synthetic(SPEC, tmp_path / "model.onnx")
    out = fuse_file(path, Plan((), "last"), tmp_path / "fused.onnx").output
    assert np.array_equal(graph_logits(path, IDS), graph_logits(out, IDS))
    assert {p.key: p.value for p in load_proto(out).metadata_props}[
        PLAN_METADATA_KEY
    ] == '{"groups": [], "norm": "last"}'


def test_two_groups_fuse_exactly_and_shrink_the_graph(tmp_path):
    path = build_synthetic(SPEC, tmp_path / "model.onnx")
    for mode in ("last", "fold"):
        result = fuse_file(path, Plan(((0, 2), (3, 5)), mode), tmp_path / f"{mode}.onnx")
        assert result.report.ok and all(g.rel_error < 1e-5 for g in result.report.groups)
        assert result.nodes_after < result.nodes_before
        fused = find_blocks(load_model(result.output))
        assert [(b.attention, b.width) for b in fused] == [(True, 152), (True, 112)]
        assert 0.9 < result.report.logits_cosine < 1.0  # an approximation, not a no-op


def test_fold_and_last_differ_when_norm_weights_differ(tmp_path):
    path = build_synthetic(SPEC, tmp_path / "model.onnx")
    last = fuse_file(path, Plan(((0, 2),), "last"), tmp_path / "last.onnx").output
    fold = fuse_file(path, Plan(((0, 2),), "fold"), tmp_path / "fold.onnx").output
    assert not np.allclose(graph_logits(last, IDS), graph_logits(fold, IDS))


def test_same_model_and_plan_give_byte_identical_files(tmp_path):
    path = build_synthetic(SPEC, tmp_path / "model.onnx")
    digests = set()
    for name in ("a", "b"):
        out = fuse_file(
            path, Plan(((1, 2), (3, 5)), "fold"), tmp_path / name / "fused.onnx", validate_output=False
        )
        digests.add(hashlib.sha256(out.output.read_bytes()).hexdigest())
    assert len(digests) == 1


def test_external_data_stays_beside_the_output(tmp_path):
    path = build_synthetic(SPEC, tmp_path / "model.onnx", external=True)
    result = fuse_file(path, Plan(((1, 2),), "last"), tmp_path / "out" / "fused.onnx")
    assert result.external_data and result.report.ok
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["fused.onnx", "fused.onnx.data"]


def test_large_models_are_checked_group_by_group(tmp_path, monkeypatch):
    monkeypatch.setattr(passes.validate, "WHOLE_MODEL_LIMIT", 0)
    path = build_synthetic(SPEC, tmp_path / "model.onnx", external=True)
    report = fuse_file(path, Plan(((0, 2), (3, 5)), "fold"), tmp_path / "fused.onnx").report
    assert report.mode == "per group" and report.ok and len(report.groups) == 2
    assert report.logits_rel_error is None


def test_large_groups_are_checked_by_the_streamed_reference(tmp_path, monkeypatch):
    """Groups too large for an ONNX Runtime subgraph: the fused block, as read back from the fused file,
    is evaluated over row blocks in float64 against the original weights."""
    monkeypatch.setattr(passes.validate, "WHOLE_MODEL_LIMIT", 0)
    monkeypatch.setattr(passes.validate, "SUBGRAPH_WEIGHT_LIMIT", 0)
    monkeypatch.setattr(passes.reference, "ROW_BLOCK_BYTES", 8 * 64 * 5)  # a few rows per block
    path = build_synthetic(SPEC, tmp_path / "model.onnx", external=True)
    for mode in ("last", "fold"):
        report = fuse_file(path, Plan(((0, 2), (3, 5)), mode), tmp_path / f"{mode}.onnx").report
        assert report.mode == "per group" and report.ok and len(report.groups) == 2
        assert all(g.rel_error < 1e-6 for g in report.groups), report.lines()


def test_the_streamed_check_catches_a_wrong_fused_weight(tmp_path, monkeypatch):
    monkeypatch.setattr(passes.validate, "WHOLE_MODEL_LIMIT", 0)
    monkeypatch.setattr(passes.validate, "SUBGRAPH_WEIGHT_LIMIT", 0)
    float_part = passes.fuse._float_part
    monkeypatch.setattr(passes.fuse, "_float_part", lambda w, t, scale: float_part(w, t, None))  # fold lost
    path = build_synthetic(SPEC, tmp_path / "model.onnx", external=True)
    with pytest.raises(ValidationError, match="MISMATCH"):
        fuse_file(path, Plan(((0, 2),), "fold"), tmp_path / "fused.onnx")
    assert not (tmp_path / "fused.onnx").exists()


@pytest.mark.parametrize("ffn", ["transpose", "gemm", "gate_up_split"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_forms_stream_into_the_fused_file(tmp_path, monkeypatch, ffn, dtype):
    """[out, in] weights stay [out, in] (read through a Transpose); halves of a gate_up weight; bf16 rows;
    written in chunks of a few rows."""
    monkeypatch.setattr(passes.io.stream_concat, "CHUNK_BYTES", 100)
    spec = SyntheticSpec(blocks=SPEC.blocks, ffn=ffn, dtype=dtype, norm="cast_fp32")
    path = build_synthetic(spec, tmp_path / "model.onnx", external=True)
    for mode in ("last", "fold"):
        result = fuse_file(path, Plan(((0, 2),), mode), tmp_path / f"{mode}.onnx")
        assert result.report.ok, result.report.lines()
        fused = find_blocks(load_model(result.output))[0].ffn
        assert fused.width == 152 and fused.gate.transposed == (ffn in ("transpose", "gemm"))


def test_reference_finds_group_members_from_the_block_table(tmp_path):
    """passes.reference.group_ffns picks a group's FFNs on its own (not through the rewrite's ffn_members),
    and refuses a block table whose numbers are not positions."""
    blocks = find_blocks(load_model(build_synthetic(SPEC, tmp_path / "model.onnx")))
    for group in [(0, 5), (1, 2), (3, 3)]:
        assert [b.index for b in group_ffns(blocks, group)] == [b.index for b in ffn_members(blocks, group)]
    with pytest.raises(ValueError, match="numbered"):
        group_ffns([replace(b, index=b.index + 1) for b in blocks], (1, 2))
