"""Sharding graphs the project did not write (tests/shard_forms.py) and head counts no tp divides.

Each graph has SmolLM2's heads (9 query heads, 3 KV heads); tp=2, 4 and 8 pad them with zero heads
(passes.shard.partition), which must be exact: the rank graphs, run in one process
(runtime.tp.ort.run_simulated), give the single-device logits, and those match an independent float64 torch
run of the same model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.matching import NoMatch
from passes.model_map import walk_stream
from passes.patterns.attention import match_attention
from passes.shard import shard_file
from passes.shard.partition import PAD, HeadPlan, head_columns
from passes.shard.roles import find_structure
from runtime.tp.ort import run_simulated
from tests import shard_forms

ROOT = Path(__file__).resolve().parents[3]

TOLERANCE = 1e-5


@pytest.fixture(scope="session")
def form():
    return shard_forms.forms_model


def tokens(seq: int = 7, batch: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, shard_forms.VOCAB, (batch, seq)).astype(np.int64)


def single_device(model: Path, ids: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


# ------------------------------------------------------------------------------------------ planning


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (12, 2), (8, 1), (8, 8), (6, 6), (15, 5)])
def test_head_plan_covers_every_head_once(heads: int, kv_heads: int, tp: int) -> None:
    plan = HeadPlan(heads, kv_heads, tp)
    queries = [h for r in range(tp) for h in plan.q_sources(r)]
    assert len(queries) == plan.heads_per_rank * tp >= heads
    assert sorted(h for h in queries if h is not None) == list(range(heads))  # each real head once
    for rank in range(tp):
        kv = plan.kv_sources(rank)
        assert len(kv) == plan.kv_per_rank
        group = plan.group_per_rank
        for i, h in enumerate(plan.q_sources(rank)):  # a query head sits with the KV head it uses
            if h is not None:
                assert kv[i // group] == h // (heads // kv_heads)


def test_smollm2_head_layouts() -> None:
    # tp=2: 3 KV heads padded to 4 slots, 2 per rank; tp=8: 4 slots on 2 ranks each, 3 queries -> 4
    assert [(HeadPlan(9, 3, tp).heads_per_rank, HeadPlan(9, 3, tp).kv_per_rank) for tp in (2, 4, 8)] == [
        (6, 2),
        (3, 1),
        (2, 1),
    ]
    assert HeadPlan(9, 3, 2).q_sources(1) == [6, 7, 8, None, None, None]
    assert HeadPlan(9, 3, 8).q_sources(5) == [8, None] and HeadPlan(9, 3, 8).kv_sources(7) == [None]
    assert head_columns([1, None], 2) == [2, 3, PAD, PAD]


# ------------------------------------------------------------------------------------------ recognizer


RECORDS = {  # form: (form, mask, IsNaN guard, packed)
    "dynamo_where": ("decomposed", "where", True, False),
    "dynamo_repeat": ("decomposed", "additive", False, False),
    "dynamo_packed": ("decomposed", "where", True, True),
    "opset23_attention": ("Attention", "causal", False, False),
}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_attention_records(form, name: str) -> None:
    model = ir.load(form(name))
    records = []
    for branch in find_structure(model).attention:
        add = branch.residual
        value = add.inputs[1] if add.inputs[0] is branch.stream else add.inputs[0]
        records.append(match_attention(value, branch.stream))
    assert len(records) == 2
    for r in records:
        assert (r.heads, r.kv_heads, r.head_dim, r.group) == (9, 3, 8, 3)
        assert (r.form, r.mask, r.nan_guard, r.packed) == RECORDS[name]
        assert r.rotary == "decomposed" and r.caches == ()
        assert r.q.out_features == 72 and r.k.out_features == r.v.out_features == 24


def test_recognizer_refuses_an_ffn(form) -> None:
    model = ir.load(form("dynamo_where"))
    ffn = find_structure(model).ffns[0]
    add = ffn.residual
    with pytest.raises(NoMatch, match="Softmax"):
        match_attention(add.inputs[1] if add.inputs[0] is ffn.stream else add.inputs[0], ffn.stream)


# ------------------------------------------------------------------------------------------ numerics


SHARDED_FORMS = [
    "dynamo_where",  # masked_fill (Where) mask, IsNaN -> Where guard, repeat_kv by Expand/Reshape
    "dynamo_repeat",  # repeat_interleave, additive mask
    "dynamo_packed",  # one qkv projection split into q, k, v (split sizes rewritten per rank)
    "opset23_attention",  # the opset-23 Attention op (q_num_heads/kv_num_heads rewritten per rank)
    "torchscript",  # TorchScript (dynamo=False, opset 17): shape vectors built at run time
    "torchscript_repeat",  # TorchScript repeat_interleave: Tile
    "ort_optimized",  # ORT transformers optimizer: SkipSimplifiedLayerNormalization residual stream
]


@pytest.mark.parametrize("name", SHARDED_FORMS)
def test_forms_shard_exactly_at_any_tp(form, tmp_path: Path, name: str) -> None:
    model = form(name)
    ids = tokens()
    want = single_device(model, ids)
    attention = shard_forms.FORMS[name][0]
    reference = shard_forms.torch_logits(attention, ids)
    assert max_abs_relative_error(want, reference) <= TOLERANCE  # the export is the model
    for tp in (2, 4, 8):
        report = shard_file(model, tp, tmp_path / f"tp{tp}", progress=False)
        assert report.allreduces_per_forward == 5
        plan = HeadPlan(9, 3, tp)
        line = f"9 heads / 3 KV heads -> {plan.heads_per_rank} per rank x {tp} = {plan.heads_per_rank * tp}"
        assert any(line in x for x in report.lines())
        assert {b.heads_per_rank for b in report.branches if b.kind == "attention"} == {
            HeadPlan(9, 3, tp).heads_per_rank
        }
        error = max_abs_relative_error(run_simulated(tmp_path / f"tp{tp}", ids), want)
        assert error <= TOLERANCE, f"{name} tp={tp}: relative error {error:.2e}"


def test_fused_attention_op_gets_rank_heads(form, tmp_path: Path) -> None:
    report = shard_file(form("opset23_attention"), 8, tmp_path / "tp8", progress=False)
    rank = ir.load(report.rank_files[3])
    ops = [n for n in rank.graph if n.op_type == "Attention"]
    assert len(ops) == 2
    assert all(n.attributes["q_num_heads"].value == 2 for n in ops if "q_num_heads" in n.attributes)


# ------------------------------------------------------------------------------------------ errors


def _cli_error(model: Path, out: Path) -> str:
    run = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "shard_tp.py"), str(model), "--tp", "4", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, (
        run.stderr
    )
    assert not out.exists() or not any(out.iterdir())  # no partial output
    return run.stderr


def test_branch_reading_a_graph_input_is_one_line_error(form, tmp_path: Path) -> None:
    """An FFN that reads a graph input (not a KV cache) cannot be split: one line, exit 2, no output."""
    model = ir.load(form("dynamo_repeat"))
    sigmoid = next(n for n in model.graph if n.op_type == "Sigmoid")
    scale = ir.Value(name="scale", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))
    model.graph.inputs.append(scale)
    mul = ir.node("Mul", [sigmoid.inputs[0], scale])
    model.graph.insert_before(sigmoid, mul)
    sigmoid.replace_input_with(0, mul.outputs[0])
    path = tmp_path / "reads_input.onnx"
    ir.save(model, path)
    with pytest.raises(UserError, match="reads the graph input 'scale', which is not a KV cache"):
        shard_file(path, 2, tmp_path / "a", progress=False)
    assert "not a KV cache" in _cli_error(path, tmp_path / "b")


def test_linear_layers_outside_the_walked_branches_are_refused(form, tmp_path: Path) -> None:
    """A Mul by one in the stream after branch 1 ends the walk there: the later branches' linear layers are
    in no walked branch and are not the lm_head (found from the logits), so sharding refuses in one line
    rather than leave them whole."""
    model = ir.load(form("dynamo_repeat"))
    stream = walk_stream(model).branches[1].residual.output
    one = ir.Value(name="one", const_value=ir.tensor(np.ones((1,), np.float32)))
    model.graph.register_initializer(one)
    uses = list(stream.uses())
    mul = ir.node("Mul", [stream, one])
    model.graph.insert_after(stream.producer(), mul)
    for use in uses:
        use.node.replace_input_with(use.idx, mul.outputs[0])
    path = tmp_path / "broken_stream.onnx"
    ir.save(model, path)
    with pytest.raises(
        UserError, match=r"walk ended at .* after 2 branches, but linear layer\(s\) '.*' are in none"
    ):
        find_structure(ir.load(path))
    assert "are in none of them and are not the lm_head" in _cli_error(path, tmp_path / "b")


@pytest.mark.parametrize(
    ("symmetric", "why"), [(False, "with zero points"), (True, "are not whole blocks of 32")]
)
def test_matmulnbits_misfits_are_one_line(form, tmp_path: Path, symmetric: bool, why: str) -> None:
    """int4 weights from ONNX Runtime's own MatMulNBits quantizer: zero points are refused, and so is a
    K split (o_proj: 6 heads of 8 rows at tp=2) that does not fall on 32-row quantization blocks."""
    quantizer = MatMulNBitsQuantizer(
        str(form("dynamo_repeat")), bits=4, block_size=32, is_symmetric=symmetric
    )
    quantizer.process()
    path = tmp_path / "int4.onnx"
    quantizer.model.save_model_to_file(str(path))
    assert "MatMulNBits" in {n.op_type for n in ir.load(path).graph}
    with pytest.raises(UserError, match=f"MatMulNBits .* {why}"):
        shard_file(path, 2, tmp_path / "a", progress=False)
    assert "MatMulNBits" in _cli_error(path, tmp_path / "b")
