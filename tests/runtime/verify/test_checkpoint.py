"""runtime/verify/checkpoint.py: a Nemotron-NAS checkpoint written by export_checkpoint.py is re-imported and
checked against the fused ONNX it came from (block table, every tensor bit for bit in the checkpoint's dtype,
logits); a changed tensor in the safetensors or a config.json that records another plan fails naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from passes.errors import UserError
from passes.run import block_runner
from runtime.verify import artifact_kind, verify_artifact
from tests.runtime.verify.artifacts import tampered_checkpoint


def test_float32_and_bfloat16_exports_verify(checkpoints):
    assert artifact_kind(checkpoints["float32"]) == "checkpoint"
    report = verify_artifact(checkpoints["fused"], checkpoints["float32"])
    assert report.ok and report.kind == "checkpoint", report.lines()
    found = {c.name: c for c in report.checks}
    assert list(found) == ["block table", "checkpoint tensors", "logits vs source"]
    assert "layer 1 = 1-4 width 768, layer 6 = 9-10 width 512" in found["block table"].message
    assert found["checkpoint tensors"].numbers["compared"] > 30 and "bit for bit" in found[
        "checkpoint tensors"].message
    assert found["logits vs source"].numbers["max_abs_rel_error"] <= 1e-5
    assert report.plan == {"groups": [[1, 4], [9, 10]], "norm": "fold"}
    # bfloat16: the folded weights are rounded; the logits are compared with the same rounding applied
    report = verify_artifact(checkpoints["fused"], checkpoints["bfloat16"])
    assert report.ok, report.lines()
    tensors = next(c for c in report.checks if c.name == "checkpoint tensors").message
    assert "in bfloat16 (4 rounded" in tensors
    # against the unfused graph it came from, the block table fails first
    against_unfused = verify_artifact(checkpoints["graph"], checkpoints["float32"])
    assert [c.name for c in against_unfused.failures] == ["block table"]


def test_a_tampered_tensor_or_plan_fails_naming_it(checkpoints, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"  # the fused group's, written by the exporter

    def bump(array: np.ndarray) -> np.ndarray:
        array[7] = array[7] * 1.01 + 1e-3
        return array

    bad = tampered_checkpoint(checkpoints["float32"], tmp_path / "bad", name, bump)
    report = verify_artifact(checkpoints["fused"], bad)
    failed = {c.name: c.message for c in report.failures}
    assert "checkpoint tensors" in failed and "logits vs source" in failed
    assert failed["checkpoint tensors"].startswith("1 of ") and repr(name) in failed["checkpoint tensors"]
    assert "'ffn_fusion.1_4.down_proj.weight'" in failed["checkpoint tensors"]  # the ONNX tensor it is from
    other = tmp_path / "other_plan"
    shutil.copytree(checkpoints["float32"], other)
    config = json.loads((other / "config.json").read_text())
    config["ffn_fusion"]["plan"]["groups"] = [[1, 4], [8, 9]]
    (other / "config.json").write_text(json.dumps(config))
    report = verify_artifact(checkpoints["fused"], other)
    assert [c.name for c in report.failures] == ["block table"]
    assert "[[1, 4], [8, 9]]" in report.failures[0].message


def test_fp8_checkpoint_against_the_fp8_onnx_bit_for_bit(checkpoints, tmp_path):
    report = verify_artifact(checkpoints["fused_fp8"], checkpoints["fp8"])
    assert report.ok and report.kind == "checkpoint", report.lines()
    found = {c.name: c for c in report.checks}
    assert list(found) == ["block table", "checkpoint tensors", "logits vs source"]
    assert "29 float8 weights with their scales" in found["checkpoint tensors"].message  # 4 x 3 attention,
    # 2 Linear, 5 x 3 FFN; the logits: the re-import (weights dequantized) against the FP8 ONNX without its
    # activation quantization; as the FP8 ONNX runs (activations quantized) they differ by 0.07 (reported)
    logits = found["logits vs source"]
    assert logits.numbers["max_abs_rel_error"] <= 1e-5 and "without its 18 activation" in logits.message
    assert 1e-3 < logits.numbers["rel_error_as_run"] < 0.2
    name = "model.layers.6.mlp.up_proj.weight"  # a fused group's float8 weight

    def flip(array: np.ndarray) -> np.ndarray:
        array[3] ^= 0x01  # one float8 value, one bit
        return array

    bad = verify_artifact(checkpoints["fused_fp8"], tampered_checkpoint(
        checkpoints["fp8"], tmp_path / "bad", name, flip))
    [failure] = bad.failures
    assert failure.name == "checkpoint tensors" and repr(name) in failure.message
    assert "ffn_fusion.9_10.up_proj.weight_fp8" in failure.message
    scale = tampered_checkpoint(checkpoints["fp8"], tmp_path / "scale", f"{name}_scale", lambda a: a * 1.05)
    [failure] = verify_artifact(checkpoints["fused_fp8"], scale).failures
    assert f"{name!r}_scale" in failure.message
    with pytest.raises(UserError) as caught:  # against the float graph: refused in one line
        verify_artifact(checkpoints["fused"], checkpoints["fp8"])
    assert "verify it against the FP8 ONNX" in str(caught.value) and "\n" not in str(caught.value)


def edited_config(source: Path, target: Path, change) -> Path:
    """A copy of the checkpoint folder `source` whose config.json holds change(config)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(change(config)))
    return target


def test_fp8_checkpoint_logits_catch_a_config_that_reads_the_tensors_wrongly(checkpoints, tmp_path):
    """Every tensor still equals its source; only the re-imported logits can see a wrong rope theta."""
    for original, folder in (("fused_fp8", "fp8"), ("fused", "fp8_tensor")):
        rope = edited_config(checkpoints[folder], tmp_path / folder, lambda c: {**c, "rope_theta": 10000.0})
        report = verify_artifact(checkpoints[original], rope)
        assert [c.name for c in report.failures] == ["logits vs source"], (folder, report.lines())
        assert report.failures[0].numbers["max_abs_rel_error"] > 1e-3


def test_per_tensor_fp8_checkpoint_against_the_float_graph(checkpoints, tmp_path):
    """export_checkpoint.py --fp8 per-tensor: each float8 weight is Q(the float graph's weight, amax / 448 of
    the tensor), bit for bit; the re-import (dequantized) equals the float graph with those weights."""
    report = verify_artifact(checkpoints["fused"], checkpoints["fp8_tensor"])
    assert report.ok, report.lines()
    found = {c.name: c for c in report.checks}
    assert "29 float8 weights with their scales (Q per tensor" in found["checkpoint tensors"].message
    assert found["logits vs source"].numbers["max_abs_rel_error"] <= 1e-5
    assert any("input_scale comes from calibration (not checked)" in n for n in report.notes)
    name = "model.layers.1.mlp.gate_proj.weight"  # a fused group's, quantized from ffn_fusion.1_4's

    def flip(array: np.ndarray) -> np.ndarray:
        array[5] ^= 0x01
        return array

    bad = tampered_checkpoint(checkpoints["fp8_tensor"], tmp_path / "bad", name, flip)
    [failure] = verify_artifact(checkpoints["fused"], bad).failures
    assert failure.name == "checkpoint tensors" and repr(name) in failure.message
    assert "1 of 49152 float8 values differ from Q('ffn_fusion.1_4.gate_proj.weight', per tensor)" in (
        failure.message)
    scale = tampered_checkpoint(checkpoints["fp8_tensor"], tmp_path / "scale", f"{name}_scale",
                                lambda a: a * 1.05)
    [failure] = verify_artifact(checkpoints["fused"], scale).failures
    assert f"{name!r}_scale" in failure.message and "amax / 448 of ORIGINAL's" in failure.message
    with pytest.raises(UserError) as caught:  # against the per-channel FP8 ONNX: refused in one line
        verify_artifact(checkpoints["fused_fp8"], checkpoints["fp8_tensor"])
    assert "against the float graph it was exported from" in str(caught.value)
    other = tmp_path / "nvfp4"
    shutil.copytree(checkpoints["fp8_tensor"], other)
    quant = json.loads((other / "hf_quant_config.json").read_text())
    quant["quantization"]["quant_algo"] = "NVFP4"
    (other / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(UserError, match="'NVFP4' form: only FP8_PER_CHANNEL_PER_TOKEN and FP8") as caught:
        verify_artifact(checkpoints["fused"], other)
    assert "\n" not in str(caught.value)


def test_a_folder_no_stage_wrote_is_refused(checkpoints):
    with pytest.raises(UserError, match="nor a checkpoint export_checkpoint.py wrote"):
        verify_artifact(checkpoints["fused"], checkpoints["source"])


def test_logits_run_block_by_block_above_the_streaming_bound(checkpoints, monkeypatch):
    """Above block_runner.STREAMING_BYTES of weights (here: any), both logits runs stream one block at a
    time (model_logits) and still agree within 1e-5."""
    streamed = []

    class Recorded(block_runner.BlockRunner):
        def __init__(self, path, *args, **kwargs) -> None:
            streamed.append((Path(path).parent.name, kwargs.get("streaming")))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(block_runner, "BlockRunner", Recorded)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    report = verify_artifact(checkpoints["fused"], checkpoints["bfloat16"])
    assert report.ok, report.lines()
    assert streamed == [("rounded", True), ("reimport", True)]


def test_per_channel_fp8_checkpoint_logits_stream_above_the_bound(checkpoints, monkeypatch):
    """The per-channel reference (the FP8 ONNX without activation Q/DQ, its weights' DequantizeLinear folded
    into float initializers written band by band) is a float graph: above STREAMING_BYTES (here: any) it
    runs block by block like the re-import, in one pass with ORIGINAL as it runs (cut by the reference's
    blocks); the check passes with the same bound, nothing runs whole."""
    opened = []

    class Recorded(block_runner.BlockRunner):
        def __init__(self, path, *args, **kwargs) -> None:
            opened.append((Path(path).parent.name, Path(path).name))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(block_runner, "BlockRunner", Recorded)
    monkeypatch.setattr("runtime.verify.fp8.BlockRunner", Recorded)
    monkeypatch.setattr(block_runner, "STREAMING_BYTES", 0)
    report = verify_artifact(checkpoints["fused_fp8"], checkpoints["fp8"])
    assert report.ok, report.lines()
    assert not any("whole" in note for note in report.notes), report.notes
    folders = [folder for folder, _ in opened]
    assert "reimport" in folders and folders.count("reference") == 1  # with ORIGINAL cut by it
    assert any(name == checkpoints["fused_fp8"].name for _, name in opened)  # ORIGINAL streamed, by blocks
