"""fuse -> FP8 -> one TP rank as onnx-ir passes in one PassManager, against the same steps one after another
(the files tests/passes/shard/test_shard.py builds: fuse_file, quantize_fp8 on the saved fused model,
shard_file),
and each pass's requires/ensures: bad input is a UserError, a broken post-condition an internal error."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes.errors import INTERNAL_ERROR_STATUS, PassInputError, UserError, run_cli
from passes.fuse import FuseFFNGroups
from passes.io.model_io import load_model, save_model
from passes.metadata import PLAN_METADATA_KEY
from passes.plan import Plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import QuantizeFP8
from passes.shard import COLLECTIVE_OP, ShardRank, count_allreduces, shard_file
from runtime.bench.sharders import SMALL_GROUPS
from runtime.tp.ort import run_simulated
from tests.passes.shard.test_shard import TpModels, build_models, single_device, tokens


@pytest.fixture(scope="module")
def models() -> TpModels:
    return build_models()


@pytest.fixture(scope="module")
def scales(models: TpModels):
    return calibrate(models.fused, [tokens(16, seed=5)], progress=False)  # as build_models calibrates


def _chain(models: TpModels, scales, *more: ir.passes.PassBase) -> ir.passes.PassManager:
    fuse = FuseFFNGroups(Plan(groups=SMALL_GROUPS))
    return ir.passes.PassManager([fuse, QuantizeFP8(scales, quantize_lm_head=True), *more])


def test_fuse_then_fp8_in_one_pass_manager_equals_them_one_after_another(models, scales, tmp_path):
    model = load_model(models.unfused)
    result = _chain(models, scales)(model)
    assert result.modified and result.model is model
    save_model(model, tmp_path / "chained.onnx", True)
    ids = tokens(seq=13, seed=3)
    chained, sequential = single_device(tmp_path / "chained.onnx", ids), single_device(models.fused_fp8, ids)
    np.testing.assert_array_equal(chained, sequential)  # the same graph and weights, bit for bit
    assert count_allreduces(model) == 9  # fused: 13 branches, two groups of 3 -> 9
    original = single_device(models.unfused, ids)
    assert not np.array_equal(chained, original)  # FP8 did change the numbers ...
    assert np.abs(chained - original).max() < 0.1 * np.abs(original).max()  # ... by FP8 rounding only


def test_fuse_fp8_and_rank_r_per_pass_manager_equal_shard_file(models, scales, tmp_path):
    files = []
    for rank in range(2):
        model = load_model(models.unfused)
        _chain(models, scales, ShardRank(2, rank))(model)
        files.append(tmp_path / f"rank{rank}.onnx")
        save_model(model, files[-1], True)
        del model
    shard_file(models.fused_fp8, 2, tmp_path / "sequential", progress=False)
    ids = tokens(seq=9, seed=4)
    np.testing.assert_array_equal(run_simulated(files, ids), run_simulated(tmp_path / "sequential", ids))


def test_requires_refuse_what_the_passes_do_not_understand(models, scales):
    fp8 = load_model(models.fused_fp8)
    with pytest.raises(PassInputError, match="FP8-quantized already"):
        QuantizeFP8(scales)(fp8)
    with pytest.raises(UserError, match="no activation scale for"):
        QuantizeFP8({})(load_model(models.unfused))
    rank = load_model(models.unfused)
    ShardRank(2, 0)(rank)
    with pytest.raises(PassInputError, match="already has DistCollective"):
        ShardRank(2, 1)(rank)
    with pytest.raises(UserError, match="rank 2 is outside 0..1"):
        ShardRank(2, 2)
    unfused = load_model(models.unfused)
    with pytest.raises(PassInputError, match=r"group \[0, 99\] is out of range: the model has blocks 0\.\."):
        FuseFFNGroups(Plan(groups=((0, 99),)))(unfused)
    assert PLAN_METADATA_KEY not in unfused.metadata_props  # refused before anything was touched


class _SkipsTheRewrite(QuantizeFP8):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=False)  # a bug: nothing quantized


class _DropsAnAllReduce(ShardRank):
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        result = super().call(model)
        node = next(n for n in model.graph if n.op_type == COLLECTIVE_OP)
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        model.graph.remove(node, safe=True)
        return result


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (lambda scales: _SkipsTheRewrite(scales), "linear layer(s) left in float"),
        (lambda scales: _DropsAnAllReduce(2, 1), "8 all-reduces, expected 9 (one per residual branch"),
    ],
    ids=["fp8", "shard"],
)
def test_broken_post_condition_is_an_internal_error(models, scales, broken, message, capsys):
    def main() -> int:
        broken(scales)(load_model(models.fused))  # the model the scales were calibrated on
        return 0

    with pytest.raises(SystemExit) as exit_:
        run_cli(main)
    error = capsys.readouterr().err
    assert exit_.value.code == INTERNAL_ERROR_STATUS, error
    assert error.startswith("error: internal error: PostconditionError") and message in error, error


@pytest.mark.parametrize(
    ("chain", "message"),
    [
        (
            lambda models, scales: ([QuantizeFP8(scales)], models.fused_fp8),
            "the model is FP8-quantized already",
        ),
        (
            lambda models, scales: (
                [FuseFFNGroups(Plan(groups=((0, 99),))), QuantizeFP8(scales)],
                models.unfused,
            ),
            "group [0, 99] is out of range",
        ),
    ],
    ids=["fp8", "fuse"],
)
def test_input_refused_inside_a_pass_manager_is_a_user_error(models, scales, chain, message, capsys):
    """A PassManager wraps a pass's errors in PassError; run_cli still finds the UserError behind it."""

    def main() -> int:
        passes, path = chain(models, scales)
        ir.passes.PassManager(passes)(load_model(path))
        return 0

    with pytest.raises(SystemExit) as exit_:
        run_cli(main)
    error = capsys.readouterr().err
    assert exit_.value.code == 2, error
    assert error.startswith(f"error: {message}") and error.count("\n") == 1, error


def test_rank_pass_reports_what_it_did(models: TpModels) -> None:
    model = load_model(models.fused)
    shard = ShardRank(4, 3, lm_head="vocab")
    assert shard(model).modified and shard.info is not None
    assert (shard.info.rank, shard.info.allreduces, shard.info.allgathers) == (3, 9, 1)
