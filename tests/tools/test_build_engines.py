"""tools/build_engines.py: FP8 quantization + TensorRT engine build, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from exporters.tensorrt import shim as trt_shim
from passes.errors import UserError
from passes.quant.calibrate import tokens_sha256
from tests import fp8_fixtures as fx

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ["--batch", "1,1,2", "--seq", "1,16,64", "--workspace-mb", "256"]


def _tool_module():
    spec = importlib.util.spec_from_file_location("build_engines_tool", ROOT / "tools" / "build_engines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def first_build(tmp_path_factory, tool):
    """One full CLI run on the tiny Llama: default calibration text, percentile 99.99."""
    src = fx.model_path("tiny_llama", tmp_path_factory)
    out = tmp_path_factory.mktemp("engines")
    result = tool(
        "build_engines",
        src,
        "--fp8",
        "--percentile",
        "99.99",
        "--calib-tokens",
        "1024",
        *SHAPES,
        "--out",
        out,
    )
    return src, out, result


def test_cli_quantizes_and_builds(first_build):
    src, out, result = first_build
    assert result.returncode == 0, result.stderr
    names = {p.name for p in out.iterdir()}
    assert {
        "tiny_llama_fp8.onnx",
        "tiny_llama_fp8.onnx.data",
        "tiny_llama_fp8.engine",
        "tiny_llama_fp8.engine.json",
        "tiny_llama_fp8_scales.json",
    } <= names
    err = result.stderr
    assert "UTF-8 bytes" in err and "calibrating tiny_llama.onnx on 1024 tokens (percentile=99.99)" in err
    assert "quantized 14 linear layers" in err and "wrote" in err
    side = json.loads((out / "tiny_llama_fp8.engine.json").read_text())
    assert side["profile"]["input_ids"] == {"min": [1, 1], "opt": [1, 16], "max": [2, 64]}
    assert side["tensorrt"]["flavor"] == trt_shim.load().flavor
    if trt_shim.load().is_rtx:
        assert side["compute_capability"] == "sm89"
    scales = json.loads((out / "tiny_llama_fp8_scales.json").read_text())
    assert scales["percentile"] == 99.99 and scales["num_tokens"] == 1024 and len(scales["scales"]) == 9
    assert (out / "tiny_llama_fp8.engine").stat().st_size == side["engine_bytes"] > 0


def test_saved_scales_rebuild_the_same_onnx(first_build, tmp_path, capsys):
    src, out, _ = first_build
    tool = _tool_module()
    assert tool.main([str(src), "--fp8", "--scales", str(out / "tiny_llama_fp8_scales.json"), *SHAPES,
                      "--out", str(tmp_path)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "using saved scales" in err and "calibrating" not in err
    again = json.loads((tmp_path / "tiny_llama_fp8.engine.json").read_text())
    first = json.loads((out / "tiny_llama_fp8.engine.json").read_text())
    assert again["onnx_sha256"] == first["onnx_sha256"]
    # the saved scales do not match other calibration settings: refuse instead of silently mixing
    with pytest.raises(UserError, match="percentile=99.99, not 99.9"):
        tool.main([str(src), "--fp8", "--scales", str(out / "tiny_llama_fp8_scales.json"), "--percentile",
                   "99.9", "--out", str(tmp_path / "x")])  # fmt: skip


def test_calibration_from_npy_ids(tmp_path, tmp_path_factory, capsys):
    src = fx.model_path("tiny_llama", tmp_path_factory)
    ids = np.random.default_rng(0).integers(0, fx.VOCAB, size=(6, 32), dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    tool = _tool_module()
    scales = tmp_path / "s.json"
    code = tool.main([str(src), "--fp8", "--calib", str(tmp_path / "ids.npy"), "--scales", str(scales),
                      "--quantize-lm-head", *SHAPES, "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0 and "calibrating tiny_llama.onnx on 192 tokens" in err
    assert "quantized 15 linear layers" in err and "skipped: none" in err

    saved = json.loads(scales.read_text())
    assert saved["calibration_tokens_sha256"] == tokens_sha256([ids[0:4], ids[4:6]])
    other = tmp_path / "other.npy"
    np.save(other, ids[::-1].copy())
    with pytest.raises(UserError, match="other tokens"):
        tool.main(
            [str(src), "--fp8", "--calib", str(other), "--scales", str(scales), "--out", str(tmp_path / "y")]
        )
    np.save(other, ids.astype(np.float32))
    with pytest.raises(UserError, match="token ids must be integers"):
        tool.main([str(src), "--fp8", "--calib", str(other), "--out", str(tmp_path / "z")])


def test_check_fails_fast_without_gpu(tmp_path, tmp_path_factory, tool):
    if not trt_shim.load().is_rtx and trt_shim.current_gpu_compute_capability() is not None:
        pytest.skip("datacenter TensorRT and a GPU are here")
    src = fx.model_path("tiny_llama", tmp_path_factory)
    result = tool("build_engines", src, "--fp8", "--check", "--out", tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("error: --check runs the engine")
    assert "datacenter TensorRT" in lines[-1]
    assert not any(tmp_path.iterdir())  # failed before calibrating or building


def test_one_engine_per_rank_file(tmp_path, tmp_path_factory, first_build):
    """The --tp hook: a folder of rank*.onnx (what passes.shard will write) builds one engine each."""
    src = fx.model_path("tiny_llama", tmp_path_factory)
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(2):
        shutil.copy(src, ranks / f"rank{r}.onnx")
    shutil.copy(src.with_name(src.name + ".data"), ranks / (src.name + ".data"))  # shared external data
    tool = _tool_module()
    with pytest.raises(UserError, match="needs --scales from the unsharded model"):
        tool.main([str(ranks), "--fp8", "--out", str(tmp_path / "a")])
    scales = first_build[1] / "tiny_llama_fp8_scales.json"
    assert (
        tool.main([str(ranks), "--fp8", "--scales", str(scales), *SHAPES, "--out", str(tmp_path / "b")]) == 0
    )
    built = sorted(p.name for p in (tmp_path / "b").glob("*.engine"))
    assert built == ["rank0_fp8.engine", "rank1_fp8.engine"]
    with pytest.raises(UserError, match="--tp 3 but 2 ONNX files"):
        tool.main([str(ranks), "--tp", "3", "--out", str(tmp_path / "c")])


def test_tp_quantizes_then_shards_then_builds_each_rank(tmp_path, tmp_path_factory, first_build, capsys):
    """--tp 2: FP8 on the whole model, passes.shard on the FP8 graph, one engine per rank."""
    src = fx.model_path("tiny_llama", tmp_path_factory)
    scales = first_build[1] / "tiny_llama_fp8_scales.json"
    args = [str(src), "--fp8", "--scales", str(scales), "--tp", "2", *SHAPES, "--out", str(tmp_path)]
    assert _tool_module().main(args) == 0
    assert "sharding tiny_llama_fp8.onnx over 2 ranks" in capsys.readouterr().err
    for rank in range(2):
        side = json.loads((tmp_path / f"rank{rank}.engine.json").read_text())
        assert side["onnx"] == f"ranks/rank{rank}/model.onnx"
        assert side["dist_collective_layers"] == 4  # o_proj and down_proj of 2 layers: one all-reduce each
        assert (tmp_path / f"rank{rank}.engine").stat().st_size == side["engine_bytes"] > 0


def test_missing_tensorrt_is_one_line(tmp_path, tmp_path_factory):
    src = fx.model_path("tiny_llama", tmp_path_factory)
    code = (
        "import runpy, sys; sys.modules['tensorrt'] = None; sys.modules['tensorrt_rtx'] = None; "
        f"sys.argv = ['build_engines.py', {str(src)!r}, '--out', {str(tmp_path)!r}]; "
        f"runpy.run_path({str(ROOT / 'tools' / 'build_engines.py')!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: TensorRT is not installed")
    assert "tensorrt-rtx-cu13" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_help_explains_the_byte_tokenizer_fallback(tool):
    result = tool("build_engines", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "'bytes' is a fallback" in text and "/usr/share/common-licenses" in text and "--tp" in text


def test_shape_options():
    tool = _tool_module()
    args = tool.build_parser().parse_args(
        ["m.onnx", "--out", "d", "--min-shape", "1x8", "--max-shape", "4x256"]
    )
    profile = tool.profile_from_args(args)
    assert (profile.min, profile.opt, profile.max) == ((1, 8), (1, 128), (4, 256))
    args = tool.build_parser().parse_args(["m.onnx", "--out", "d", "--batch", "1,2,8", "--seq", "1,64,1024"])
    profile = tool.profile_from_args(args)
    assert (profile.min, profile.opt, profile.max) == ((1, 1), (2, 64), (8, 1024))
    with pytest.raises(SystemExit):
        tool.build_parser().parse_args(["m.onnx", "--out", "d", "--batch", "1,2"])
    with pytest.raises(UserError, match="min <= opt <= max"):
        tool.profile_from_args(tool.build_parser().parse_args(["m.onnx", "--out", "d", "--min-shape", "8x8"]))
