"""The prefill graph built without torch (exporters.hf.prefill_graph, exporters.hf.rope) and what that buys
the --hf export: no torch import, the weight copy started before onnx/onnx_ir are imported, half-precision
graphs.

Numerics against transformers' forward and the independent nemotron-nas reference are in
test_checkpoint.py; here: the rotary tables against transformers' own, float16/bfloat16 exports
against the float32 one, the converted weights against torch's `.to(dtype)`, and the opset range.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file

from exporters.hf.checkpoint import export_hf
from exporters.hf.config import read_config
from exporters.hf.data_file import copy_runs, place_weights
from exporters.hf.rope import rope_parameters
from exporters.hf.weight_sources import check_folder
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.metadata import HF_METADATA_KEY
from tests.exporters.hf.test_checkpoint import TOLERANCE, run_onnx, tokens, transformers_logits
from tests.exporters.hf_fixtures import (
    LLAMA3_ROPE,
    deci_block,
    nemotron_config,
    save_llama_family,
    write_nemotron,
)

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 96

# HF config overrides -> rope type, every type exporters.hf.rope computes (dynamic: its unscaled table).
ROPES = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama3": {"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 16}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn_mscale": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16.0,
            "truncate": False,
        }
    },
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
}


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("case", list(ROPES))
def test_rope_tables_match_transformers(tmp_path, case: str, head_dim: int) -> None:
    """config.json -> exporters.hf.config -> exporters.hf.rope (numpy) against transformers' torch tables."""
    from transformers import LlamaConfig  # noqa: PLC0415 (transformers: seconds to import; only the RoPE reference needs it)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415 (transformers: seconds to import; only the RoPE reference needs it)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: PLC0415 (transformers: seconds to import; only the RoPE reference needs it)

    hf = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_theta=500000.0,
        architectures=["LlamaForCausalLM"],
        **ROPES[case],
    )
    hf.save_pretrained(tmp_path)
    config = read_config(tmp_path)
    rope_type = config.rope.rope_type
    if rope_type == "default":
        expected, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    inv_freq, attention_factor = rope_parameters(config.rope, config.head_dim)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, expected.numpy(), rtol=2.5e-7, atol=0)  # float32 ulp
    assert attention_factor == pytest.approx(factor, rel=1e-12)


@pytest.fixture(scope="module")
def tiny_nemotron(tmp_path_factory) -> Path:
    """bf16 shards: attention with 2 KV-head counts, a Linear attention, an attention-free run, llama3."""
    blocks = [deci_block(2, 1.0), deci_block("no_op", 2.0), deci_block("linear", "no_op"), deci_block(4, 1.0)]
    config = nemotron_config(
        blocks,
        hidden=64,
        heads=4,
        vocab=VOCAB,
        rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 16},
    )
    return write_nemotron(tmp_path_factory.mktemp("tiny_nemotron") / "ckpt", config, shards=2, seed=7)


_NO_TORCH = """
import runpy, sys
from exporters.hf import checkpoint as hf_checkpoint
heavy = ("torch", "transformers", "safetensors", "onnx", "onnx_ir")
loaded_at_copy = []
staged_output = hf_checkpoint.staged_output

def recording_staged_output(path):  # entered right before the weight copy starts
    loaded_at_copy.extend(m for m in heavy if m in sys.modules)
    print("numpy when the copy started:", "numpy" in sys.modules)
    return staged_output(path)

hf_checkpoint.staged_output = recording_staged_output
sys.argv = ["export_model.py", *sys.argv[1:]]
try:
    runpy.run_path("tools/export_model.py", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
print("loaded when the copy started:", sorted(loaded_at_copy))
print("torch:", sorted(m for m in sys.modules if m.split(".")[0] in heavy[:3]))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # the kernel copy, and converted rows
def test_prefill_export_imports_no_torch(tiny_nemotron, tmp_path, dtype: str) -> None:
    """`export_model.py --hf` never imports torch, transformers or safetensors, and starts copying the
    weights before onnx and onnx_ir (seconds of imports) are loaded. A converting copy starts after numpy
    is imported: the writer thread and the main thread importing numpy at once can break its import."""
    out = tmp_path / "out" / "model.onnx"
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, "--hf", str(tiny_nemotron), "--dtype", dtype, "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "loaded when the copy started: []" in result.stdout, result.stdout
    assert "torch: []" in result.stdout, result.stdout
    assert f"numpy when the copy started: {dtype != 'bfloat16'}" in result.stdout, result.stdout
    assert f"{dtype}, opset 20" in result.stdout
    reference = tmp_path / "ref" / "model.onnx"
    export_hf(tiny_nemotron, reference, dtype=dtype)  # in this process, torch loaded: the same files
    for name in ("model.onnx", "model.onnx.data"):
        assert (out.parent / name).read_bytes() == (reference.parent / name).read_bytes(), name


@pytest.fixture(scope="module")
def qwen_exports(tmp_path_factory) -> dict[str, Path]:
    """A float32 Qwen2 checkpoint (q/k/v biases, a sliding-window layer, dynamic rope) exported in all three
    dtypes: float16 and bfloat16 weights converted from float32 by exporters.hf.dtype_convert."""
    base = tmp_path_factory.mktemp("qwen_dtypes")
    folder = save_llama_family(
        base / "ckpt",
        "Qwen2ForCausalLM",
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        max_position_embeddings=8,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    paths = {"checkpoint": folder}
    for dtype in ("float32", "float16", "bfloat16"):
        paths[dtype] = base / dtype / "model.onnx"
        export_hf(folder, paths[dtype], dtype=dtype)
    return paths


@pytest.mark.parametrize(("dtype", "tolerance"), [("float16", 5e-3), ("bfloat16", 5e-2)])
def test_half_exports_agree_with_float32(qwen_exports, dtype: str, tolerance: float) -> None:
    """Same weights rounded to `dtype` and activations in `dtype` (norms in float32 between casts): the
    logits stay within the dtype's precision of the float32 export's, and far from unrelated logits."""
    ids = tokens(seq=12)  # past the sliding window and the dynamic rope's max_position_embeddings
    half, full = run_onnx(qwen_exports[dtype], ids), run_onnx(qwen_exports["float32"], ids)
    scale = np.abs(full).max()
    assert np.isfinite(half).all()
    assert np.abs(half - full).max() <= tolerance * scale
    assert np.abs(run_onnx(qwen_exports[dtype], tokens(seq=12, seed=1)) - full).max() > 10 * tolerance * scale
    graph = onnx.load(str(qwen_exports[dtype]), load_external_data=False).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output]}
    half_type = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
    ops = {op: [n for n in graph.node if n.op_type == op] for op in ("Cast", "ReduceMean", "Softmax")}
    # Each of the 7 norms (input and post-attention in 3 layers, the final one) casts to float32 and back;
    # cos, sin and the logits are cast once each.
    assert len(ops["Cast"]) - 1 == 2 * 7 + 2 + 1  # the one more: the sequence length to float for positions
    assert {types[n.output[0]] for n in ops["ReduceMean"]} == {onnx.TensorProto.FLOAT}
    assert {types[n.output[0]] for n in ops["Softmax"]} == {half_type}
    assert types["logits"] == onnx.TensorProto.FLOAT


@pytest.mark.parametrize(
    ("source", "dtype"),
    [("qwen", "float16"), ("qwen", "bfloat16"), ("nemotron", "float16"), ("nemotron", "float32")],
)
def test_converted_weights_equal_torch(
    qwen_exports, tiny_nemotron, tmp_path, source: str, dtype: str
) -> None:
    """numpy/ml_dtypes conversion (float32 or bfloat16 shards) writes exactly torch's `.to(dtype)`."""
    if source == "qwen":
        folder, path = qwen_exports["checkpoint"], qwen_exports[dtype]
    else:
        folder, path = tiny_nemotron, export_hf(tiny_nemotron, tmp_path / "m.onnx", dtype=dtype).path
    model = load_model(path)
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    assert len(tensors) > 10 and tensors["model.embed_tokens.weight"].dtype != getattr(torch, dtype)
    for name, tensor in tensors.items():
        stored = model.graph.initializers[name].const_value.numpy()
        expected = tensor.to(getattr(torch, dtype))
        bits = {2: torch.int16, 4: torch.int32}[expected.element_size()]
        assert np.array_equal(stored.view(f"i{stored.itemsize}"), expected.view(bits).numpy()), name


def test_opset_range(tiny_nemotron, tmp_path) -> None:
    ids = tokens(vocab=VOCAB)
    default = export_hf(tiny_nemotron, tmp_path / "default" / "model.onnx", dtype="float32")
    at_18 = export_hf(tiny_nemotron, tmp_path / "18" / "model.onnx", dtype="float32", opset=18)
    assert (default.opset, at_18.opset) == (20, 18)
    np.testing.assert_array_equal(run_onnx(at_18.path, ids), run_onnx(default.path, ids))
    with pytest.raises(UserError, match="--opset 17: the --hf graph is written at opset 18 to 23"):
        export_hf(tiny_nemotron, tmp_path / "17" / "model.onnx", opset=17)
    assert not (tmp_path / "17").exists()


def test_metadata_and_names(tiny_nemotron, tmp_path) -> None:
    """The graph's contract: input/output names, dims and dtypes, the metadata key, per-layer node names."""
    path = export_hf(tiny_nemotron, tmp_path / "m" / "model.onnx").path
    proto = onnx.load(str(path), load_external_data=False)
    graph = proto.graph

    def dims(value):
        return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]

    assert [(v.name, v.type.tensor_type.elem_type, dims(v)) for v in graph.input] == [
        ("input_ids", onnx.TensorProto.INT64, ["batch", "seq"])
    ]
    assert [(v.name, v.type.tensor_type.elem_type, dims(v)) for v in graph.output] == [
        ("logits", onnx.TensorProto.FLOAT, ["batch", "seq", VOCAB])
    ]
    meta = json.loads({p.key: p.value for p in proto.metadata_props}[HF_METADATA_KEY])
    assert meta["dtype"] == "bfloat16" and meta["layer_kinds"][2] == "linear+none"
    names = [n.name for n in graph.node]
    assert len(set(names)) == len(names)
    assert (
        "model.layers.3.self_attn.q_proj/MatMul" in names
        and "model.layers.2.self_attn.linear_attn/MatMul" in names
    )


def test_back_to_back_tensors_are_one_kernel_copy(tmp_path) -> None:
    """Tensors whose sizes are multiples of the 4096-byte alignment lie back to back in the data file as in
    their shard, so each shard's run is one copy (exporters.hf.data_file.copy_runs); every byte lands
    where its initializer points."""
    folder = save_llama_family(
        tmp_path / "ckpt", hidden_size=1024, intermediate_size=256, num_hidden_layers=2, max_shard_size="8MB"
    )
    _, sources, dtype = check_folder(folder)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and dtype == "float32"
    runs = copy_runs(sources, place_weights(sources, 4), dtype)
    assert len(runs) == len(shards) and all(r.convert is None for r in runs)
    path = export_hf(folder, tmp_path / "out" / "model.onnx").path
    model = load_model(path)
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            assert np.array_equal(model.graph.initializers[name].const_value.numpy(), tensor.numpy()), name
    ids = tokens()
    expected = transformers_logits(folder, ids)
    assert np.abs(run_onnx(path, ids) - expected).max() <= TOLERANCE * max(1.0, np.abs(expected).max())
