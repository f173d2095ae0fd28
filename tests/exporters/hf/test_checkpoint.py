"""Hugging Face checkpoints in (exporters.hf.checkpoint, tools/export_model.py --hf).

Llama-family checkpoints are written by transformers' save_pretrained and checked against transformers'
own forward; nemotron-nas checkpoints are written in the published layout (tests/exporters/hf_fixtures.py)
and checked against `reference_logits` below, written from design §7 without the exporter's model code.
Both kinds then go through the block table, fusion with validation, FP8 and tensor-parallel sharding.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file

from exporters.export_record import ExportResult
from exporters.hf import checkpoint as hf_checkpoint
from exporters.hf.checkpoint import export_hf
from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, load_proto, save_model
from passes.metadata import HF_METADATA_KEY
from passes.model_map import layer_name
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from passes.shard import shard_file
from passes.validate import _session
from runtime.tp.ort import run_simulated
from tests.exporters.hf_fixtures import (
    FAMILY_CASES,
    LLAMA3_ROPE,
    deci_block,
    nemotron_config,
    save_llama_family,
    write_nemotron,
)

TOLERANCE = 1e-4
VOCAB = 96

# Ten layers with every block_configs field at work: GQA with 1, 2 and 4 KV heads of 8, three ffn_mult
# widths (256, 512, 1024 at hidden 256), attention-free runs, a no_op FFN (layer 4: its attention then
# belongs to layer 5's FFN), attention replaced by a Linear (6), the FFN replaced by a Linear (7).
NEMOTRON_BLOCKS = [
    deci_block(4, 2.625),
    deci_block("no_op", 1.0),
    deci_block("no_op", 5.25),
    deci_block("no_op", 2.625),
    deci_block(8, "no_op"),
    deci_block("no_op", 1.0),
    deci_block("linear", 1.0),
    deci_block("no_op", "linear"),
    deci_block(2, 0.5),
    deci_block("no_op", 1.3125),
    deci_block("no_op", 2.625),
]
# A second, smaller checkpoint without Linear replacements (passes.shard cannot shard a one-Linear branch):
# KV heads 4, 1 and 2 of 8, a no_op FFN, tied embeddings. Blocks (= layers): 0, 1-2 free, 3 (attention, no
# FFN), 4 free, 5.
SHARDABLE_BLOCKS = [
    deci_block(2, 2.625),
    deci_block("no_op", 1.0),
    deci_block("no_op", 5.25),
    deci_block(8, "no_op"),
    deci_block("no_op", 1.0),
    deci_block(4, 0.5),
]
SHARDABLE_PLAN = {"groups": [[1, 2]], "norm": "fold"}
NEMOTRON_ROPE = {**LLAMA3_ROPE, "original_max_position_embeddings": 16}  # short, so that scaling shows
# Block numbers are the layer indices (docs/design.md §2): 1-3 and 9-10 are attention-free SwiGLU runs.
NEMOTRON_PLAN = {"groups": [[1, 3], [9, 10]], "norm": "fold"}
LLAMA_PLAN = {"groups": [[1, 3]], "norm": "last"}


def tokens(batch: int = 2, seq: int = 11, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)).astype(np.int64)


def run_onnx(path: Path, ids: np.ndarray) -> np.ndarray:
    """Logits from ONNX Runtime; half-precision graphs run in float32 activations (passes.validate's view)."""
    return _session(load_proto(path), path.parent).run(None, {"input_ids": ids})[0]


# ------------------------------------------------------------------------------ independent reference


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _llama3_frequencies(theta: float, dim: int, rope: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling, per frequency: keep the high ones, divide the low ones, blend between."""
    out = []
    for i in range(0, dim, 2):
        f = theta ** (-i / dim)
        wavelen = 2 * math.pi / f
        original = rope["original_max_position_embeddings"]
        if wavelen < original / rope["high_freq_factor"]:
            out.append(f)
        elif wavelen > original / rope["low_freq_factor"]:
            out.append(f / rope["factor"])
        else:
            smooth = (original / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            out.append((1 - smooth) * f / rope["factor"] + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on [b, s, heads, d], pairing channel i with i + d/2 (the HF Llama layout)."""
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * freqs[None, :]  # s, d/2
    cos, sin = angles.cos()[None, :, None].float(), angles.sin()[None, :, None].float()
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _attention(x, weights, prefix, heads, kv_heads, freqs) -> torch.Tensor:
    b, s, _ = x.shape
    q = (x @ weights[f"{prefix}.q_proj.weight"].T).view(b, s, heads, -1)
    k = (x @ weights[f"{prefix}.k_proj.weight"].T).view(b, s, kv_heads, -1)
    v = (x @ weights[f"{prefix}.v_proj.weight"].T).view(b, s, kv_heads, -1)
    q, k = _rotate(q, freqs), _rotate(k, freqs)
    group = heads // kv_heads
    out = torch.empty_like(q)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for h in range(heads):  # query head h reads KV head h // group
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[:, :, h] = probs @ v[:, :, h // group]
    return out.reshape(b, s, -1) @ weights[f"{prefix}.o_proj.weight"].T


def reference_logits(folder: Path, ids: np.ndarray, rope_factor: float | None = None) -> np.ndarray:
    """nemotron-nas forward from docs/design.md §7, in float32, reading every shard the index lists."""
    config = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weights = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update({k: v.float() for k, v in load_file(str(folder / shard)).items()})
    hidden, heads, eps = config["hidden_size"], config["num_attention_heads"], config["rms_norm_eps"]
    rope = dict(config["rope_scaling"], **({"factor": rope_factor} if rope_factor else {}))
    freqs = _llama3_frequencies(config["rope_theta"], hidden // heads, rope)
    h = weights["model.embed_tokens.weight"][torch.from_numpy(ids)]
    for i, block in enumerate(config["block_configs"]):
        p = f"model.layers.{i}"
        attention, ffn = block["attention"], block["ffn"]
        if not attention["no_op"]:
            x = _rms(h, weights[f"{p}.input_layernorm.weight"], eps)
            if attention["replace_with_linear"]:
                h = h + x @ weights[f"{p}.self_attn.linear_attn.weight"].T
            else:
                kv_heads = heads // attention["n_heads_in_group"]
                h = h + _attention(x, weights, f"{p}.self_attn", heads, kv_heads, freqs)
        if not ffn["no_op"]:
            x = _rms(h, weights[f"{p}.post_attention_layernorm.weight"], eps)
            if ffn["replace_with_linear"]:
                h = h + x @ weights[f"{p}.mlp.linear_mlp.weight"].T
            else:
                gate = x @ weights[f"{p}.mlp.gate_proj.weight"].T
                up = x @ weights[f"{p}.mlp.up_proj.weight"].T
                h = h + (gate * torch.sigmoid(gate) * up) @ weights[f"{p}.mlp.down_proj.weight"].T
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return (_rms(h, weights["model.norm.weight"], eps) @ head.T).numpy()


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def nemotron_folder(tmp_path_factory) -> Path:
    config = nemotron_config(
        NEMOTRON_BLOCKS, hidden=256, heads=8, vocab=VOCAB, rope_scaling=NEMOTRON_ROPE, rope_theta=10000.0
    )
    return write_nemotron(tmp_path_factory.mktemp("nemotron") / "ckpt", config, shards=3)


@pytest.fixture(scope="session")
def shardable_nemotron(tmp_path_factory) -> tuple[Path, Path]:
    config = nemotron_config(
        SHARDABLE_BLOCKS, hidden=256, heads=8, vocab=VOCAB, rope_scaling=NEMOTRON_ROPE, tie=True
    )
    base = tmp_path_factory.mktemp("nemotron_shardable")
    folder = write_nemotron(base / "ckpt", config, shards=1, seed=1)
    path = base / "onnx" / "model.onnx"
    export_hf(folder, path, dtype="float32")
    return folder, path


@pytest.fixture(scope="session")
def nemotron_fp32(nemotron_folder, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nemotron_fp32") / "model.onnx"
    export_hf(nemotron_folder, path, dtype="float32")
    return path


@pytest.fixture(scope="session")
def nemotron_bf16(nemotron_folder, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nemotron_bf16") / "model.onnx"
    export_hf(nemotron_folder, path)  # the checkpoint's dtype
    return path


@pytest.fixture(scope="session")
def llama_exports(tmp_path_factory):
    cache: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in cache:
            architecture, overrides = FAMILY_CASES[case]
            base = tmp_path_factory.mktemp(case)
            folder = save_llama_family(base / "ckpt", architecture, vocab_size=VOCAB, **overrides)
            export_hf(folder, base / "onnx" / "model.onnx", dtype="float32")
            cache[case] = folder, base / "onnx" / "model.onnx"
        return cache[case]

    return get


@pytest.fixture(scope="session")
def llama_dropped(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama without attention in layers 1-3, made as exporters.hf.folder does (zero o_proj, config key)."""
    base = tmp_path_factory.mktemp("llama_dropped")
    folder = save_llama_family(
        base / "ckpt", "LlamaForCausalLM", vocab_size=VOCAB, num_hidden_layers=5, drop_attention=(1, 2, 3)
    )
    path = base / "onnx" / "model.onnx"
    export_hf(folder, path)
    return folder, path


def transformers_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the transformers reference needs it)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


# ------------------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_llama_family_matches_transformers(llama_exports, case: str) -> None:
    folder, path = llama_exports(case)
    ids = tokens()
    expected = transformers_logits(folder, ids)
    got = run_onnx(path, ids)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())


def test_sliding_window_and_rope_scaling_matter(llama_exports) -> None:
    """The reference comparisons above would catch a missing window or rope scaling: both change logits."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only the transformers reference needs it)

    folder, path = llama_exports("mistral_yarn_window")
    ids = tokens()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.config.sliding_window = None
    with torch.no_grad():
        unwindowed = model(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(run_onnx(path, ids) - unwindowed).max() > 1e-3


def test_tied_nemotron_matches_independent_reference(shardable_nemotron) -> None:
    folder, path = shardable_nemotron
    ids = tokens()
    expected = reference_logits(folder, ids)
    assert np.abs(run_onnx(path, ids) - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())


def test_nemotron_matches_independent_reference(nemotron_folder, nemotron_fp32) -> None:
    ids = tokens()
    expected = reference_logits(nemotron_folder, ids)
    got = run_onnx(nemotron_fp32, ids)
    assert np.abs(got - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())
    # The comparison sees rope scaling: without llama3 scaling the reference moves well past the tolerance.
    unscaled = reference_logits(nemotron_folder, ids, rope_factor=1.0)
    assert np.abs(unscaled - expected).max() > 100 * TOLERANCE * max(1.0, np.abs(expected).max())


def test_nemotron_bf16_export_runs(nemotron_bf16, nemotron_fp32) -> None:
    graph = onnx.load(str(nemotron_bf16), load_external_data=False).graph
    weights = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert weights and all(t.data_type == onnx.TensorProto.BFLOAT16 for t in weights)
    ids = tokens()
    bf16, fp32 = run_onnx(nemotron_bf16, ids), run_onnx(nemotron_fp32, ids)
    # The same bf16 weights; the bf16 graph rounds activations to bf16 where the fp32 one does not.
    assert np.isfinite(bf16).all()
    assert np.abs(bf16 - fp32).max() <= 0.05 * np.abs(fp32).max()


# Every kind of layer, some repeated: GQA with two KV-head counts, attention-free runs, a no_op FFN, a Linear
# attention with a Linear FFN, an all-no_op layer (no nodes at all), and SwiGLU widths 256 (= hidden),
# 512 and 1024 (hidden 256: ffn_mult 1.0, 2.0, 5.25).
LAYER_KINDS_BLOCKS = [
    deci_block(4, 2.0),
    deci_block("no_op", 5.25),
    deci_block("no_op", 1.0),
    deci_block(4, 5.25),
    deci_block("linear", "linear"),
    deci_block("no_op", 2.0),
    deci_block("no_op", "no_op"),
    deci_block(2, "no_op"),
    deci_block("no_op", 1.0),
    deci_block(4, 2.0),
]


def _layer_ops(path: Path) -> dict[str, dict[str, int]]:
    """Per source layer as passes.model_map.layer_name reads it from the graph: op type -> count."""
    layers: dict[str, Counter] = {}
    for node in load_model(path).graph:
        layers.setdefault(layer_name(node) or "", Counter())[node.op_type] += 1
    return {name: dict(ops) for name, ops in layers.items()}


def test_every_layer_kind_matches_reference(tmp_path) -> None:
    """exporters.hf.prefill_graph writes each layer from its own LayerConfig: the logits match the independent
    reference, each layer holds the ops of its kind under its own name, and each SwiGLU its own width."""
    config = nemotron_config(LAYER_KINDS_BLOCKS, hidden=256, heads=4, vocab=VOCAB, rope_scaling=NEMOTRON_ROPE)
    folder = write_nemotron(tmp_path / "ckpt", config, shards=2, seed=3)
    result = export_hf(folder, tmp_path / "onnx" / "model.onnx", dtype="float32")
    assert isinstance(result, ExportResult) and result.attention_free_runs == [(1, 2), (5, 6), (8, 8)]
    ids = tokens()
    expected = reference_logits(folder, ids)
    assert np.abs(run_onnx(result.path, ids) - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())
    ops = _layer_ops(result.path)
    # Two norms of 7 ops; q/k/v/o and gate/up/down read through Transpose -> MatMul; attention: 3 head
    # Transposes + k^T + the output's, 6 Reshapes, 2 MatMuls, rotary Slice/Neg/Concat on q and k.
    norms = {"Pow": 2, "ReduceMean": 2, "Sqrt": 2, "Reciprocal": 2}
    full = norms | {"Softmax": 1, "Sigmoid": 1, "MatMul": 9, "Transpose": 12, "Reshape": 6, "Neg": 2}
    for layer in (0, 3, 9):
        assert {op: ops[f"model.layers.{layer}"].get(op, 0) for op in full} == full, layer
    linear = norms | {"Add": 4, "Mul": 4, "Transpose": 2, "MatMul": 2}  # eps Adds, residual Adds
    assert ops["model.layers.4"] == linear
    assert "model.layers.6" not in ops  # attention and FFN no_op: no nodes
    assert ops["model.layers.7"]["Softmax"] == 1 and "Sigmoid" not in ops["model.layers.7"]
    graph = onnx.load(str(result.path), load_external_data=False).graph
    widths = {
        int(v.name.split(".")[2]): v.type.tensor_type.shape.dim[-1].dim_value
        for v in graph.value_info
        if v.name.endswith(".mlp.gate_proj/MatMul")
    }
    assert widths == {0: 512, 1: 1024, 2: 256, 3: 1024, 5: 512, 8: 256, 9: 512}
    external = {t.name for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert external == set(index["weight_map"])


def test_llama_with_dropped_attention_matches_transformers(llama_dropped) -> None:
    """hf_folder's zero-o_proj layers become attention-free blocks; logits match the folder's transformers."""
    folder, path = llama_dropped
    ids = tokens()
    expected = transformers_logits(folder, ids)
    assert np.abs(run_onnx(path, ids) - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert "Softmax" in ops


def test_smollm2_folder_matches_transformers(smollm2_hf, tmp_path) -> None:
    """The real SmolLM2-135M saved by transformers (exporters.hf.folder), attention dropped from 13-22."""
    folder = smollm2_hf
    path = tmp_path / "onnx" / "model.onnx"
    result = export_hf(folder, path)  # the folder's own dtype: float32
    assert result.dtype == "float32" and result.attention == [not 13 <= i <= 22 for i in range(30)]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {p.name for p in result.side_files}
    ids = tokens(vocab=49152)
    expected = transformers_logits(folder, ids)
    assert np.abs(run_onnx(path, ids) - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())


# ------------------------------------------------------------------------------------------ decode graphs

DECODE_BLOCKS = [
    deci_block(2, 1.0),
    deci_block("no_op", 2.625),
    deci_block("no_op", 0.5),
    deci_block(2, 5.25),
]


def prefill_then_decode(path: Path, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Logits of ids[:, :prefill] from an empty cache, then of the rest from the returned cache."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pasts = session.get_inputs()[2:]
    past = {i.name: np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    first = session.run(
        None, {"input_ids": ids[:, :prefill], "attention_mask": np.ones_like(ids[:, :prefill]), **past}
    )
    cache = dict(zip(past, first[1:], strict=True))
    second = session.run(None, {"input_ids": ids[:, prefill:], "attention_mask": np.ones_like(ids), **cache})
    return np.concatenate([first[0], second[0]], axis=1)


def test_decode_graph_llama_matches_transformers(llama_dropped, tmp_path) -> None:
    folder, _ = llama_dropped
    path = tmp_path / "decode" / "model.onnx"
    result = export_hf(folder, path, decode=True)
    assert result.cache_layers == [0, 4]  # layers 1-3 have no attention and no cache
    ids = tokens()
    expected = transformers_logits(folder, ids)
    got = prefill_then_decode(path, ids, prefill=7)
    assert np.abs(got - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())


def test_decode_graph_nemotron_matches_reference(tmp_path) -> None:
    config = nemotron_config(
        DECODE_BLOCKS, hidden=256, heads=8, vocab=VOCAB, rope_scaling=NEMOTRON_ROPE, rope_theta=10000.0
    )
    folder = write_nemotron(tmp_path / "ckpt", config, shards=2, seed=2)
    path = tmp_path / "decode" / "model.onnx"
    export_hf(folder, path, decode=True)  # float32 from the bf16 checkpoint
    ids = tokens()
    expected = reference_logits(folder, ids)
    got = prefill_then_decode(path, ids, prefill=5)
    assert np.abs(got - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())


def test_decode_refuses_half_precision_and_other_opsets(tmp_path) -> None:
    """The decode graph (and its cache) is float32, at the prefill graph's opsets; yarn rope, which the
    torch-traced decode graph lacked, exports (tests/exporters/hf/test_decode_graph.py checks it)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    config = nemotron_config(DECODE_BLOCKS, hidden=64, heads=4, vocab=VOCAB, rope_scaling=yarn)
    folder = write_nemotron(tmp_path / "ckpt", config, shards=1)
    out = tmp_path / "out"
    with pytest.raises(UserError, match="float32"):
        export_hf(folder, out / "m.onnx", decode=True, dtype="bfloat16")
    with pytest.raises(UserError, match="--opset 17: the --hf graph is written at opset 18 to 23"):
        export_hf(folder, out / "m.onnx", decode=True, opset=17)
    assert not out.exists()
    assert export_hf(folder, out / "m.onnx", decode=True, opset=23).opset == 23


# ------------------------------------------------------------------------------------------ the folder


def test_deployable_folder_and_metadata(nemotron_folder, nemotron_bf16) -> None:
    out = nemotron_bf16.parent
    assert {p.name for p in out.iterdir()} == {
        "model.onnx",
        "model.onnx.data",
        "config.json",
        "generation_config.json",
    }
    assert (out / "config.json").read_text() == (nemotron_folder / "config.json").read_text()
    proto = onnx.load(str(nemotron_bf16), load_external_data=False)
    meta = json.loads({p.key: p.value for p in proto.metadata_props}[HF_METADATA_KEY])
    config = json.loads((nemotron_folder / "config.json").read_text())
    assert meta["block_configs"] == config["block_configs"]
    assert meta["layer_names"] == [f"model.layers.{i}" for i in range(len(NEMOTRON_BLOCKS))]
    assert meta["layer_kinds"][4] == "gqa(kv=1)+none" and meta["layer_kinds"][7] == "none+linear"
    # Initializers carry the checkpoint's names, point into the one data file, page-aligned.
    names = {t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    index = json.loads((nemotron_folder / "model.safetensors.index.json").read_text())
    assert names == set(index["weight_map"])
    for tensor in proto.graph.initializer:
        info = {e.key: e.value for e in tensor.external_data}
        if info:
            assert info["location"] == "model.onnx.data" and int(info["offset"]) % 4096 == 0


def test_weights_are_copied_bit_exact(nemotron_folder, nemotron_bf16) -> None:
    model = load_model(nemotron_bf16)
    shard = sorted(nemotron_folder.glob("model-*.safetensors"))[1]
    for name, tensor in load_file(str(shard)).items():
        stored = model.graph.initializers[name].const_value.numpy()
        assert np.array_equal(stored.view(np.uint16), tensor.view(torch.int16).numpy().view(np.uint16)), name


def test_weights_copied_before_the_graph_and_nothing_left_on_failure(nemotron_folder, tmp_path, monkeypatch):
    """The weight copy starts before the graph is built (in a thread); a failed graph stops it and the
    staging folder goes, so nothing of the export stays."""
    out = tmp_path / "out" / "model.onnx"

    def failing_graph(*args, **kwargs):
        deadline = time.monotonic() + 60
        while not any(out.parent.rglob("model.onnx.data")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any(out.parent.rglob("model.onnx.data")), "the weight copy had not started"
        raise RuntimeError("graph failed")

    monkeypatch.setattr(hf_checkpoint, "build_graph", failing_graph)
    with pytest.raises(RuntimeError, match="graph failed"):
        export_hf(nemotron_folder, out)
    assert not any(out.parent.rglob("*"))


# ------------------------------------------------------------------------------------------ passes


def _block_table(tool, path: Path) -> list[dict]:
    result = tool("fuse_onnx", path, "--show-blocks", "--json", check=True)
    return json.loads(result.stdout)["blocks"]


def test_nemotron_block_table(tool, nemotron_fp32) -> None:
    rows = _block_table(tool, nemotron_fp32)
    # One block per layer: layer 4 is attention with no FFN, 6 a Linear attention, 7 a Linear FFN.
    assert [r["ffn_width"] for r in rows] == [512, 256, 1024, 512, 0, 256, 256, 0, 256, 256, 512]
    assert [i for i, r in enumerate(rows) if r["attention"]] == [0, 4, 8]
    assert [i for i, r in enumerate(rows) if r["ffn"] != "swiglu"] == [4, 7]
    assert rows[6]["attention_kind"] == "linear"
    assert [r["kv_heads"] for r in rows if r["attention"]] == [2, 1, 4]
    assert [r["layer"] for r in rows] == [f"model.layers.{i}" for i in range(len(NEMOTRON_BLOCKS))]


@pytest.mark.parametrize("kind", ["nemotron_linear", "nemotron", "llama"])
def test_fuse_fp8_and_shard(kind, nemotron_fp32, shardable_nemotron, llama_dropped, tmp_path) -> None:
    source, plan = {
        "nemotron_linear": (nemotron_fp32, NEMOTRON_PLAN),
        "nemotron": (shardable_nemotron[1], SHARDABLE_PLAN),
        "llama": (llama_dropped[1], LLAMA_PLAN),
    }[kind]
    plan = parse_plan(plan)
    fused = tmp_path / "fused" / "model.onnx"
    result = fuse_file(source, plan, fused)  # validates against the original and the parallel sum
    assert result.report is not None and result.report.ok
    ids = tokens()
    reference = run_onnx(fused, ids)

    scales = calibrate(fused, [tokens(seed=s) for s in range(2)], progress=False)
    model = load_model(fused)
    report = quantize_fp8(model, scales)
    assert report.quantized
    fp8 = tmp_path / "fp8" / "model.onnx"
    fp8.parent.mkdir()
    save_model(model, fp8, external=True)
    # FP8 e4m3 on random tiny models moves logits by ~5-20%; unrelated logits would be ~140% apart.
    assert max_abs_relative_error(run_onnx(fp8, ids), reference) < 0.3

    shard_file(fused, 2, tmp_path / "tp2", progress=False)
    assert max_abs_relative_error(run_simulated(tmp_path / "tp2", ids), reference) <= 1e-5


# ------------------------------------------------------------------------------------------ bad input


def _bad_checkpoint(tmp_path: Path, nemotron_folder: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(nemotron_folder, folder)
    return folder


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


BAD_INPUTS = {
    "missing shard": (
        lambda f: (f / "model-00002-of-00003.safetensors").unlink(),
        ["model.safetensors.index.json", "model-00002-of-00003.safetensors", "weight_map"],
    ),
    "shape contradicts config": (
        lambda f: _edit_config(f, lambda c: c["block_configs"][2]["ffn"].update(ffn_mult=2.625)),
        ["model-00001-of-00003.safetensors", "model.layers.2.mlp", "block_configs[2].ffn.ffn_mult"],
    ),
    "unknown architecture": (
        lambda f: _edit_config(f, lambda c: c.update(architectures=["GPT2LMHeadModel"])),
        ["config.json", "architectures", "GPT2LMHeadModel"],
    ),
    "unknown block_configs field": (
        lambda f: _edit_config(f, lambda c: c["block_configs"][3]["attention"].update(mystery=1)),
        ["config.json", "block_configs[3].attention.mystery"],
    ),
    "unsupported block_configs value": (
        lambda f: _edit_config(f, lambda c: c["block_configs"][0]["attention"].update(window_length=4)),
        ["config.json", "block_configs[0].attention.window_length"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(tool, nemotron_folder, tmp_path, case: str) -> None:
    folder = _bad_checkpoint(tmp_path, nemotron_folder)
    breaks, expected = BAD_INPUTS[case]
    breaks(folder)
    before = sorted(p.name for p in folder.iterdir())
    out = tmp_path / "out" / "model.onnx"
    result = tool("export_model", "--hf", folder, "-o", out)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()  # no progress line either: input is checked first
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert not out.parent.exists() or not any(out.parent.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == before


def test_cli_linear_rope_float16(tool, tmp_path) -> None:
    """The command line, a float16 checkpoint written by save_pretrained, linear rope scaling."""
    folder = save_llama_family(
        tmp_path / "ckpt",
        vocab_size=VOCAB,
        num_hidden_layers=1,
        dtype=torch.float16,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    result = tool("export_model", "--hf", folder, "-o", tmp_path / "out" / "m.onnx", check=True)
    assert "LlamaForCausalLM" in result.stdout and "float16" in result.stdout
    path = tmp_path / "out" / "m.onnx"
    graph = onnx.load(str(path), load_external_data=False).graph
    assert {t.data_type for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL} == {
        onnx.TensorProto.FLOAT16
    }
    ids = tokens()
    expected = transformers_logits(folder, ids)  # float16 weights, float32 compute
    assert np.abs(run_onnx(path, ids) - expected).max() <= 1e-2 * max(1.0, np.abs(expected).max())
