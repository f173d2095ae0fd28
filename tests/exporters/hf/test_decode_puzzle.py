"""Decode graphs of a Puzzle (Nemotron-NAS) checkpoint with every layer kind (export_hf(decode=True),
tools/export_model.py --hf DIR --decode): variable GQA caches, Linear attention and FFN, no-op attention
and FFN. Checked token by token against the prefill graph (exporters.hf.prefill_graph, built without
torch) and against `reference_logits` (design §7 written in torch, without the exporter's code)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import write_all_kinds
from passes.error_measures import max_abs_relative_error
from passes.graph_inputs import Signature
from passes.metadata import DECODE_METADATA_KEY
from runtime.generate import DecodeModel, greedy_generate
from tests.exporters.hf.test_checkpoint import reference_logits, run_onnx
from tests.exporters.hf_fixtures import PUZZLE_CACHE_HEADS, PUZZLE_VOCAB, puzzle_models
from tests.exporters.test_decode import Runner

TOLERANCE = 1e-4  # float32 graphs against the float32 torch reference (measured ~1e-6)
PROMPTS = [[17, 41, 8, 60, 22, 9, 31], [90, 5, 33], [12, 13, 70, 4]]  # left-padded to 7


@pytest.fixture(scope="module")
def puzzle(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.getbasetemp()
    return lambda name: puzzle_models(base, name)


def ids(batch: int = 2, seq: int = 9, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, PUZZLE_VOCAB, (batch, seq)).astype(np.int64)


def test_one_cache_per_attention_layer_with_its_own_kv_heads(puzzle) -> None:
    """No cache for no-op or Linear attention; each GQA layer's cache has that layer's KV heads, in the
    graph's declared shapes (what every reader uses), in passes.graph_inputs and in the metadata."""
    path = puzzle("decode")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    kinds = ("key", "value")
    expected = {f"past_{k}_{layer}": kv for layer, kv in PUZZLE_CACHE_HEADS.items() for k in kinds}
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", *expected]
    assert {i.name: i.shape for i in session.get_inputs()[2:]} == {
        n: ["batch", kv, "past_len", 16] for n, kv in expected.items()
    }
    outputs = {o.name: o.shape for o in session.get_outputs()}
    assert outputs.pop("logits") == ["batch", "seq", PUZZLE_VOCAB]
    present = {n.replace("past_", "present_"): ["batch", kv, "total", 16] for n, kv in expected.items()}
    assert outputs == present
    signature = Signature.of(path)
    assert signature.cache_layers == list(PUZZLE_CACHE_HEADS)
    assert {i.name: i.static(1) for i in signature.cache_inputs} == expected
    metadata = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    meta = json.loads(metadata[DECODE_METADATA_KEY])
    assert meta["cache_layers"] == list(PUZZLE_CACHE_HEADS) and meta["kv_heads"] == [2, 1, 4]
    assert DecodeModel.open(path).cache_layers == list(PUZZLE_CACHE_HEADS)


def test_decode_logits_equal_prefill_graph_and_reference(puzzle) -> None:
    """Three tokens at once from an empty cache, then one token per step: every position's logits equal
    the prefill graph's and the independent reference's."""
    tokens = ids()
    decoded = Runner(puzzle("decode")).prefill_then_decode(tokens, prefill=3)
    prefill = run_onnx(puzzle("prefill"), tokens)
    reference = reference_logits(puzzle("ckpt"), tokens)
    assert decoded.shape == prefill.shape == (2, 9, PUZZLE_VOCAB)
    assert max_abs_relative_error(decoded, prefill) <= TOLERANCE
    assert max_abs_relative_error(decoded, reference) <= TOLERANCE
    assert max_abs_relative_error(prefill, reference) <= TOLERANCE


def test_greedy_decode_equals_the_prefill_graph_run_greedily(puzzle) -> None:
    """runtime/generate.py over the decode graph (left-padded batch, KV cache) generates the tokens the
    prefill graph generates re-running each whole sequence alone."""
    decode = DecodeModel.open(puzzle("decode"))
    prefill = DecodeModel.open(puzzle("prefill"))
    assert decode.cached and not prefill.cached
    batch = greedy_generate(decode, PROMPTS, 8)
    alone = [greedy_generate(prefill, [p], 8).tokens[0] for p in PROMPTS]
    assert batch.tokens == alone
    assert all(len(set(row)) > 1 for row in alone)  # not one token repeated
    # cache bytes: K and V x 3 rows x (2 + 1 + 4) KV heads x (7 + 7) positions x 16 dims x 4 bytes
    assert batch.stats.cache_bytes == 2 * 3 * 7 * 14 * 16 * 4


def test_export_model_cli_writes_the_decode_graph(puzzle, tool, tmp_path: Path) -> None:
    """tools/export_model.py --hf DIR --decode: the graph of export_hf, its caches named in the summary."""
    out = tmp_path / "decode" / "model.onnx"
    run = tool("export_model", "--hf", puzzle("ckpt"), "--decode", "-o", out, check=True)
    assert "decode graph: KV caches (layer: KV heads): 0: 2, 2: 1, 5: 4" in run.stdout, run.stdout
    assert {"tokenizer.json", "config.json", "model.onnx.data"} <= {p.name for p in out.parent.iterdir()}
    tokens = ids(seed=6)
    decoded = Runner(out).prefill_then_decode(tokens, prefill=7)
    assert max_abs_relative_error(decoded, run_onnx(puzzle("prefill"), tokens)) <= TOLERANCE


def test_decode_graph_of_the_all_kinds_checkpoint(tmp_path: Path) -> None:
    """exporters.hf.synthetic's ALL_KINDS_BLOCKS (also an identity layer with neither part, and an
    attention-only layer before another attention): prefill then decode equals the reference."""
    folder = write_all_kinds(tmp_path / "ckpt")
    path = tmp_path / "decode" / "model.onnx"
    result = export_hf(folder, path, decode=True)
    assert result.cache_layers == [0, 5, 6]
    assert [result.config.layers[i].kv_heads for i in result.cache_layers] == [2, 1, 4]
    tokens = ids(seed=7)
    decoded = Runner(path).prefill_then_decode(tokens, prefill=5)
    assert max_abs_relative_error(decoded, reference_logits(folder, tokens)) <= TOLERANCE
