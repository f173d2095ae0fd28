"""Decode graphs with a KV cache (exporters/decode.py): interface, exactness vs torch, fusion, FP8, TP."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from exporters.decode import decode_model_from_spec, empty_past, trace_inputs
from exporters.llama import build_model
from exporters.onnx_export import dynamo_export, without_slices_split
from exporters.tensorrt import shim as trt_shim
from exporters.tensorrt.build import DimRanges, build_engine, input_profiles
from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, save_model
from passes.metadata import DECODE_METADATA_KEY
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import Plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from passes.shard import shard_file
from runtime.backends import TpThreadsBackend
from tests import decode_fixtures as fx

TOL = 1e-4


@pytest.fixture(scope="module")
def models():
    return fx.decode_models


class Runner:
    """ONNX Runtime over a decode graph with the cache kept here (independent of runtime/generate.py)."""

    def __init__(self, path: Path) -> None:
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def empty(self, batch: int) -> dict[str, np.ndarray]:
        return {
            n: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32)
            for n, i in self.inputs.items()
            if n.startswith("past_")
        }

    def step(self, ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]):
        out = dict(
            zip(
                self.outputs,
                self.session.run(None, {"input_ids": ids, "attention_mask": mask, **past}),
                strict=True,
            )
        )
        present = {n: out["present_" + n.removeprefix("past_")] for n in past}
        return out["logits"], present

    def prefill_then_decode(self, ids: np.ndarray, prefill: int) -> np.ndarray:
        """Logits for every position: `prefill` tokens at once, then one token per step from the cache."""
        batch, total = ids.shape
        logits, past = self.step(ids[:, :prefill], np.ones((batch, prefill), np.int64), self.empty(batch))
        parts = [logits]
        for t in range(prefill, total):
            logits, past = self.step(ids[:, t : t + 1], np.ones((batch, t + 1), np.int64), past)
            parts.append(logits)
        return np.concatenate(parts, axis=1)


def tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, fx.tiny_spec().vocab, (batch, length), dtype=np.int64)


def torch_logits(ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return build_model(fx.tiny_spec(), fx.TINY_SEED)(torch.from_numpy(ids)).numpy()


def test_interface_has_cache_only_for_attention_layers(models):
    session = ort.InferenceSession(str(models("decode")), providers=["CPUExecutionProvider"])
    cache = [f"{kind}_{layer}" for layer in fx.TINY_CACHE_LAYERS for kind in ("key", "value")]
    assert [i.name for i in session.get_inputs()] == [
        "input_ids",
        "attention_mask",
        *[f"past_{c}" for c in cache],
    ]
    assert [o.name for o in session.get_outputs()] == ["logits", *[f"present_{c}" for c in cache]]
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["input_ids"] == ["batch", "seq"]
    assert shapes["attention_mask"] == ["batch", "total"]
    assert shapes["past_key_4"] == ["batch", 2, "past_len", 16]
    assert session.get_outputs()[0].shape == ["batch", "seq", 96]
    assert DECODE_METADATA_KEY in session.get_modelmeta().custom_metadata_map
    # 7 blocks, 2 with attention: the cache holds 2 layers, not 7 (attention-free blocks have none).
    assert len(shapes) - 2 == 2 * len(fx.TINY_CACHE_LAYERS)


def test_torch_wrapper_equals_spec_llama():
    ids = tokens(2, 9)
    wrapper = decode_model_from_spec(fx.tiny_spec(), fx.TINY_SEED)
    with torch.no_grad():
        out = wrapper(
            torch.from_numpy(ids), torch.ones_like(torch.from_numpy(ids)), *empty_past(fx.tiny_spec(), 2)
        )
    assert max_abs_relative_error(out[0].numpy(), torch_logits(ids)) < 1e-6
    assert len(out) == 1 + 2 * len(fx.TINY_CACHE_LAYERS)


def test_prefill_then_three_decode_steps_equal_full_rerun(models):
    ids = tokens(2, 9, seed=1)
    runner = Runner(models("decode"))
    reference = torch_logits(ids)
    prefill = runner.step(ids[:, :6], np.ones((2, 6), np.int64), runner.empty(2))[0]
    assert max_abs_relative_error(prefill, reference[:, :6]) < TOL
    assert max_abs_relative_error(runner.prefill_then_decode(ids, 6), reference) < TOL


def test_chunk_after_cache_equals_full_rerun(models):
    """seq > 1 with past_len > 0 (chunked prefill) is the same graph."""
    ids = tokens(1, 10, seed=2)
    runner = Runner(models("decode"))
    _, past = runner.step(ids[:, :4], np.ones((1, 4), np.int64), runner.empty(1))
    logits, present = runner.step(ids[:, 4:], np.ones((1, 10), np.int64), past)
    assert max_abs_relative_error(logits, torch_logits(ids)[:, 4:]) < TOL
    assert present["past_key_0"].shape == (1, 2, 10, 16)


def test_left_padding_gives_each_row_its_own_positions(models):
    runner = Runner(models("decode"))
    long, short = tokens(1, 7, seed=3)[0], tokens(1, 4, seed=4)[0]
    ids = np.stack([long, np.concatenate([np.zeros(3, np.int64), short])])
    mask = np.array([[1] * 7, [0, 0, 0, 1, 1, 1, 1]], np.int64)
    logits, past = runner.step(ids, mask, runner.empty(2))
    assert max_abs_relative_error(logits[1, 3:], torch_logits(short[None])[0]) < TOL
    assert max_abs_relative_error(logits[0], torch_logits(long[None])[0]) < TOL
    step = np.array([[5], [6]], np.int64)
    logits, _ = runner.step(step, np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1), past)
    assert max_abs_relative_error(logits[1, 0], torch_logits(np.append(short, 6)[None])[0, -1]) < TOL
    assert np.isfinite(logits).all()


def test_block_table_equals_prefill_export(models):
    decode = [b.row() for b in find_blocks(load_model(models("decode")))]
    prefill = [b.row() for b in find_blocks(load_model(models("prefill")))]
    assert decode == prefill
    assert [r["attention"] for r in decode] == [b.attention for b in fx.tiny_spec().blocks]


def test_fused_decode_graph_equals_fused_prefill_model(models):
    fused = load_model(models("decode_fused"))
    rows = [b.row() for b in find_blocks(fused)]
    assert rows == [b.row() for b in find_blocks(load_model(models("prefill_fused")))]
    assert [r["ffn_width"] for r in rows] == [96 + 64 + 80, 48, 72 + 56 + 40]
    ids = tokens(2, 9, seed=5)
    prefill_only = ort.InferenceSession(str(models("prefill_fused")), providers=["CPUExecutionProvider"])
    expected = prefill_only.run(None, {"input_ids": ids})[0]
    got = Runner(models("decode_fused")).prefill_then_decode(ids, 6)
    assert max_abs_relative_error(got, expected) < TOL
    # fusion is an approximation: it did change the model
    assert max_abs_relative_error(expected, torch_logits(ids)) > 1e-3


def test_fuse_file_validates_decode_graph(models, tmp_path):
    result = fuse_file(models("decode"), Plan(fx.TINY_GROUPS, "fold"), tmp_path / "v.onnx")
    assert result.report is not None and result.report.ok


def test_fp8_decode_graph_keeps_cache_semantics(models, tmp_path):
    """FP8 Q/DQ (static per-tensor scales) on a decode graph: decode from the cache still equals a full
    re-run of the same FP8 graph, and stays close to fp32."""
    path = models("decode_fused")
    ids = tokens(2, 9, seed=6)
    empty = Runner(path).empty(2)
    batches = [{"input_ids": ids, "attention_mask": np.ones_like(ids), **empty}]
    scales = calibrate(path, batches, progress=False)
    model = load_model(path)
    report = quantize_fp8(model, scales)
    assert report.quantized
    out = tmp_path / "fp8.onnx"
    save_model(model, out, False)
    runner = Runner(out)
    full = runner.step(ids, np.ones_like(ids), runner.empty(2))[0]
    stepped = runner.prefill_then_decode(ids, 6)
    assert max_abs_relative_error(stepped, full) < 1e-3
    fp32 = Runner(path).prefill_then_decode(ids, 6)
    cos = float((stepped * fp32).sum() / np.linalg.norm(stepped) / np.linalg.norm(fp32))
    assert cos > 0.99


def test_tp2_decode_graph_equals_single_device(models, tmp_path):
    """Rank graphs of a decode graph (KV cache split by heads): prefill + 3 cached decode steps."""
    shard_file(models("decode"), 2, tmp_path / "tp2", progress=False)
    backend = TpThreadsBackend(tmp_path / "tp2")
    ids = tokens(2, 8, seed=7)
    past = {
        i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), np.float32)
        for i in backend.inputs
        if i.name.startswith("past_")
    }
    parts = []
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
        feeds = {"input_ids": ids[:, start:stop], "attention_mask": np.ones((2, stop), np.int64), **past}
        out = backend.run(feeds)
        parts.append(out["logits"])
        past = {n: out["present_" + n.removeprefix("past_")] for n in past}
    assert max_abs_relative_error(np.concatenate(parts, axis=1), torch_logits(ids)) < TOL
    assert past["past_key_4"].shape == (2, 2, 8, 16)


def test_tensorrt_builds_decode_engine_with_empty_cache_profile(models, tmp_path):
    """TensorRT's ONNX parser and builder accept the fused decode graph, past_len from 0 (TensorRT-RTX here,
    ahead of time for sm89; the engine runs through runtime.backends.TrtBackend on a GPU)."""
    try:
        trt_shim.load()
    except UserError:
        pytest.skip("no TensorRT installed")
    ranges = DimRanges.decode(max_batch=2, max_total=64)
    profiles = input_profiles(models("decode_fused"), ranges)
    profile = {name: (p.min, p.opt, p.max) for name, p in profiles.items()}
    assert profile["past_key_4"] == ((1, 2, 0, 16), (1, 2, 63, 16), (2, 2, 63, 16))
    assert profile["attention_mask"] == ((1, 1), (1, 64), (2, 64))
    built = build_engine(models("decode_fused"), tmp_path / "decode.engine", profile=ranges)
    assert built.plan_bytes > 0 and (tmp_path / "decode.engine").stat().st_size == built.plan_bytes


@pytest.mark.slow  # a torch export of the tiny model: about 10 s
def test_optimizer_without_slices_split_writes_the_same_graph():
    """exporters.onnx_export.without_slices_split drops a quadratic rewrite rule that never fires on these
    graphs (rotate_half's second Slice ends at INT64_MAX): the optimized graph must stay byte for byte the
    same, or the rule did fire and dropping it changed the graph."""
    model = decode_model_from_spec(fx.tiny_spec(), fx.TINY_SEED)
    example = trace_inputs(model.spec)
    program = dynamo_export(model, example.args, opset=None, optimize=False, input_names=example.input_names,
                            output_names=example.output_names, dynamic_shapes=example.dynamic_shapes)
    assert sum(n.op_type == "Slice" for n in program.model.graph) >= 4  # rotate_half of q and k: pairs
    unoptimized = ir.serde.serialize_model(program.model)
    written = []
    for dropped in (False, True):
        program.model = ir.serde.deserialize_model(unoptimized)
        with without_slices_split() if dropped else contextlib.nullcontext():
            program.optimize()
        written.append(ir.serde.serialize_model(program.model).SerializeToString())
    assert written[0] == written[1]
    assert not any(n.op_type == "Split" for n in program.model.graph)
