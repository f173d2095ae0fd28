"""Building TensorRT engines from FP8 ONNX (exporters/tensorrt/build.py).

On machines without a GPU this builds real engines ahead of time with TensorRT-RTX for sm89.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from exporters.tensorrt import build as te
from exporters.tensorrt import shim as trt_shim
from passes.errors import UserError
from tests import fp8_fixtures as fx

MODEL_KINDS = ["tiny_llama", "wide_ffn"]  # add a fused-model kind here once fx.MODELS has one
PROFILE = te.Profile(min=(1, 1), opt=(1, 16), max=(2, 64))


def _sha256_of_files(*paths: Path) -> str:
    digest = hashlib.sha256()
    digest.update(paths[0].read_bytes())
    for extra in paths[1:]:
        digest.update(extra.name.encode())
        digest.update(extra.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_fp8_engine_builds_ahead_of_time(kind, fp8_model, tmp_path):
    trt = trt_shim.load()
    onnx_path = fp8_model(kind)
    # the parser sees FP8: Quantize layers output FP8, Dequantize layers read it
    logger = trt.logger()
    builder = trt.module.Builder(logger.handle)
    network, _parser = te.parse_onnx(trt, builder, onnx_path, logger)
    kinds = Counter(
        (str(network.get_layer(i).type).split(".")[-1], network.get_layer(i).get_output(0).dtype.name)
        for i in range(network.num_layers)
    )
    ops = Counter(n.op_type for n in onnx.load(str(onnx_path), load_external_data=False).graph.node)
    assert kinds["QUANTIZE", "FP8"] == ops["QuantizeLinear"] > 0
    assert kinds["DEQUANTIZE", "FLOAT"] == ops["DequantizeLinear"] > ops["QuantizeLinear"]
    del network, _parser, builder

    start = time.perf_counter()
    built = te.build_engine(onnx_path, tmp_path / f"{kind}.engine", profile=PROFILE, workspace_mb=256)
    seconds = time.perf_counter() - start
    fx.log(
        f"TensorRT {trt.flavor} {trt.version}: {kind} FP8 engine in {seconds:.2f} s ({built.plan_bytes} B)"
    )
    assert seconds < 120  # measured ~1-2 s
    plan = built.engine_path.read_bytes()
    assert len(plan) == built.plan_bytes > 100_000

    side = json.loads(te.sidecar_path(built.engine_path).read_text())
    assert side == built.sidecar
    if trt.is_rtx:
        assert side["tensorrt"] == {"flavor": "tensorrt_rtx", "version": trt.module.__version__}
        assert side["compute_capability"] == "sm89"
        assert side["timing_cache"] is None
    assert side["strongly_typed"] is True and side["profiling_verbosity"] == "DETAILED"
    assert side["profile"] == {"input_ids": {"min": [1, 1], "opt": [1, 16], "max": [2, 64]}}
    assert side["inputs"] == [{"name": "input_ids", "dtype": "INT64", "shape": [-1, -1]}]
    assert side["outputs"] == [{"name": "logits", "dtype": "FLOAT", "shape": [-1, -1, fx.VOCAB]}]
    assert side["workspace_mb"] == 256 and side["engine_bytes"] == len(plan)
    assert side["dist_collective_layers"] == 0 and side["preview_features"] == []
    data = onnx_path.with_name(onnx_path.name + ".data")
    assert side["onnx_sha256"] == _sha256_of_files(onnx_path, data)


def test_onnx_sha256_covers_external_data(fp8_model, tmp_path):
    src = fp8_model("tiny_llama")
    copy = tmp_path / src.name
    copy.write_bytes(src.read_bytes())
    data = tmp_path / (src.name + ".data")
    data.write_bytes(src.with_name(src.name + ".data").read_bytes())
    first = te.onnx_sha256(copy)
    assert first == te.onnx_sha256(src)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert te.onnx_sha256(copy) != first
    data.unlink()
    with pytest.raises(UserError, match="missing"):
        te.onnx_sha256(copy)


def _unparseable(path: Path) -> Path:
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["c"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("FrobnicateA", ["c"], ["y"], domain="com.example", name="bad_a"),
        helper.make_node("FrobnicateB", ["c"], ["z"], domain="com.example", name="bad_b"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s"]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", "s"]),
        ],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)]
    onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
    return path


def test_every_parser_error_is_reported(tmp_path):
    bad = _unparseable(tmp_path / "bad.onnx")
    with pytest.raises(UserError) as info:
        te.build_engine(bad, tmp_path / "bad.engine", profile=PROFILE)
    message = str(info.value)
    assert "(2 errors)" in message and "bad_a (FrobnicateA)" in message and "bad_b (FrobnicateB)" in message
    assert "\n" not in message
    assert not (tmp_path / "bad.engine").exists()


def test_profile_must_be_ordered_and_cover_dynamic_inputs(fp8_model, tmp_path):
    with pytest.raises(UserError, match="min <= opt <= max"):
        te.Profile(min=(1, 64), opt=(1, 16), max=(2, 64))
    with pytest.raises(UserError, match="three numbers"):
        te.Profile.batch_seq((1, 2), (1, 2, 3))
    with pytest.raises(UserError, match="dynamic shape"):
        te.build_engine(
            fp8_model("tiny_llama"), tmp_path / "x.engine", profile={"other": te.Profile((1,), (1,), (1,))}
        )
