"""exporters.nas: fused / healed ONNX -> Nemotron-NAS checkpoint, read back by export_model.py --hf's library
and by an independent torch DeciLM forward (deci_reference.py) that reads only the exported folder."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx as onnx_lib
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import write_all_kinds
from exporters.nas import safetensors_out as st
from exporters.nas.export import export_checkpoint
from exporters.nas.ffn_mult import ffn_mult_for, ffn_width
from exporters.nas.layout import plan_layout
from exporters.nas.onnx_proto import read_model
from exporters.spec import super49b_pattern
from passes.error_measures import max_abs_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, load_proto
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import parse_plan
from passes.quant.calibrate import calibrate
from passes.quant.fp8 import quantize_fp8
from runtime.heal.metadata import HealConfig
from runtime.heal.report import run_heal
from tests.exporters.hf.deci_reference import deci_logits, load_weights
from tests.run_graph import graph_logits

VOCAB = 96
PLAN = {"groups": [[1, 4], [9, 10]]}
# ALL_KINDS_BLOCKS fused by PLAN: layer 1 is source 1-4 (identity layer 2 inside), layer 6 is 9-10.
SOURCE_LAYERS = [[0], [1, 2, 3, 4], [5], [6], [7], [8], [9, 10]]
WIDTHS = [256, 768, 0, 256, 256, 0, 512]
ULTRA = {399360: 36.5625, 425984: 39.0, 343040: 31.40625, 301056: 27.5625}  # design §6, hidden 16384


def _ids(seed: int = 0, batch: int = 2, seq: int = 9, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq)).astype(np.int64)


@pytest.fixture(scope="module")
def all_kinds(tmp_path_factory) -> tuple[Path, Path]:
    """The every-kind Nemotron-NAS checkpoint (bf16 shards) and its float32 graph."""
    base = tmp_path_factory.mktemp("nas_all_kinds")
    folder = write_all_kinds(base / "ckpt", seed=7, vocab=VOCAB)
    onnx = base / "onnx" / "model.onnx"
    export_hf(folder, onnx, dtype="float32")
    return folder, onnx


# ------------------------------------------------------------------------------------------- ffn_mult


def test_ffn_mult_gives_back_every_width() -> None:
    """The chosen ffn_mult maps to the width by the engines' rule: the fixtures' widths (the every-kind
    checkpoint at hidden 64, SmolLM2's 1536 and its fused 5 x and 4 x 1536 at 576), Super-49B's at 8192
    (design §6) and their sums, and the paper's Ultra-253B groups, whose values are exact."""
    cases = [(w, 64) for w in (256, 512, 768)] + [(w, 576) for w in (1536, 7680, 6144)]
    super_widths = sorted({ffn_width(m, 8192) for _, m in super49b_pattern()})
    cases += [(w, 8192) for w in super_widths] + [(sum(super_widths[:k]), 8192) for k in range(2, 6)]
    cases += [(w, 16384) for w in ULTRA] + [(256 * k, h) for k in range(1, 400, 7) for h in (96, 1000, 5120)]
    for width, hidden in cases:
        mult = ffn_mult_for(width, hidden)
        assert ffn_width(mult, hidden) == width, (width, hidden, mult)
        assert abs(2 * mult * hidden / 3 - width) <= 0.5  # the exact value, not one ceil256 rounds up to it
    for width, mult in ULTRA.items():
        assert ffn_mult_for(width, 16384) == mult
    assert ffn_mult_for(1536, 576) == 4.0
    with pytest.raises(UserError, match="multiples of 256"):
        ffn_mult_for(300, 64)


# ---------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("norm", ["last", "fold"])
def test_fused_all_kinds_round_trip(all_kinds, tmp_path, norm) -> None:
    """Both norm modes: the checkpoint has one layer per group with the summed width, the block table of
    its re-import shows it, and its logits equal the fused graph's (ONNX Runtime) and the torch reference."""
    folder, onnx = all_kinds
    fused = fuse_file(onnx, parse_plan({**PLAN, "norm": norm}), tmp_path / "fused" / "model.onnx").output
    out = tmp_path / "nas"
    result = export_checkpoint(fused, folder, out, dtype="float32", max_shard_bytes=60_000)
    assert result.source_layers == SOURCE_LAYERS
    assert result.early_copy  # every tensor a kernel copy (or ones): written from the confirmed guess
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == len(config["block_configs"]) == 7
    assert config["ffn_fusion"]["source_layers"] == SOURCE_LAYERS
    assert config["block_configs"][1]["ffn"]["ffn_mult"] == 18.0 and config["block_configs"][6]["ffn"][
        "ffn_mult"] == 12.0
    assert config["block_configs"][1]["attention"]["no_op"] is True
    source = json.loads((folder / "config.json").read_text())["block_configs"]
    for layer, members in zip(config["block_configs"], SOURCE_LAYERS, strict=True):
        if len(members) == 1:  # unfused layers keep the released spelling, field for field
            assert layer == source[members[0]]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert (out / "generation_config.json").is_file()
    weights = load_weights(out)
    norm_weight = weights["model.layers.1.post_attention_layernorm.weight"].numpy()
    assert np.all(norm_weight == 1.0) if norm == "fold" else not np.all(norm_weight == 1.0)
    back = tmp_path / "back" / "model.onnx"
    export_hf(out, back, dtype="float32")
    assert [b.width for b in find_blocks(load_model(back))] == WIDTHS
    ids = _ids()
    expected = graph_logits(fused, ids)
    assert max_abs_relative_error(graph_logits(back, ids), expected) <= 1e-5
    assert max_abs_relative_error(deci_logits(out, ids), expected) <= 1e-4


def test_unfused_round_trip_is_the_source(all_kinds, tmp_path) -> None:
    """An unfused graph comes back as its source checkpoint: the same config fields, every tensor equal to
    the bit in the source's bf16 (the default dtype)."""
    folder, onnx = all_kinds
    out = tmp_path / "nas"
    result = export_checkpoint(onnx, folder, out)
    assert not result.early_copy  # float32 -> bfloat16: converted, no early copy
    assert result.dtype == "bfloat16" and result.source_layers == [[i] for i in range(11)]
    config, source = (json.loads((f / "config.json").read_text()) for f in (out, folder))
    assert config["block_configs"] == source["block_configs"]
    assert {k: v for k, v in config.items() if k != "ffn_fusion"} == source
    ours = load_file(str(out / "model.safetensors"))
    theirs = {}
    for shard in folder.glob("*.safetensors"):
        theirs.update(load_file(str(shard)))
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == ml_dtypes.bfloat16 and np.array_equal(tensor.view(np.uint16),
                                                                      theirs[name].view(np.uint16)), name


@pytest.mark.slow  # heals two groups (~8 s)
def test_healed_round_trip(all_kinds, tmp_path) -> None:
    """A healed model (runtime.heal, 10 Adam steps a group) round-trips exactly: the healed weights are the
    checkpoint's, and they differ from the plain concatenation's."""
    folder, onnx = all_kinds
    fused = fuse_file(onnx, parse_plan({**PLAN, "norm": "fold"}), tmp_path / "fused.onnx").output
    np.save(tmp_path / "calib.npy", _ids(3, 1, 512))
    np.save(tmp_path / "held.npy", _ids(4, 1, 128))
    healed = tmp_path / "healed" / "model.onnx"
    healed.parent.mkdir()
    run_heal(onnx, fused, healed, HealConfig(steps=10, lr=3e-3, batch_tokens=256),
             calib=[tmp_path / "calib.npy"], heldout=[tmp_path / "held.npy"], window=32, eval_tokens=0)
    out, plain = tmp_path / "nas", tmp_path / "nas_plain"
    export_checkpoint(healed, folder, out, dtype="float32")
    export_checkpoint(fused, folder, plain, dtype="float32")
    name = "model.layers.1.mlp.down_proj.weight"
    assert not np.array_equal(load_weights(out)[name], load_weights(plain)[name])
    back = tmp_path / "back" / "model.onnx"
    export_hf(out, back, dtype="float32")
    ids = _ids(1)
    assert max_abs_relative_error(graph_logits(back, ids), graph_logits(healed, ids)) <= 1e-5
    assert max_abs_relative_error(deci_logits(out, ids), graph_logits(healed, ids)) <= 1e-4


def test_bf16_graph_gives_the_same_checkpoint(all_kinds, tmp_path) -> None:
    """A bf16 graph (the --hf default for this checkpoint; every tensor kernel-copied) and the float32 graph
    of the same model and plan ("last": the fused weights are concatenations, exact in bf16) give the same
    bf16 checkpoint, byte for byte."""
    folder, onnx = all_kinds
    bf16 = tmp_path / "bf16" / "model.onnx"
    export_hf(folder, bf16)
    plan = parse_plan({**PLAN, "norm": "last"})
    outs = []
    for name, graph in (("from_bf16", bf16), ("from_fp32", onnx)):
        fused = fuse_file(graph, plan, tmp_path / name / "fused.onnx", validate_output=False).output
        outs.append(tmp_path / name / "nas")
        export_checkpoint(fused, folder, outs[-1])
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()
    assert (outs[0] / "config.json").read_text() == (outs[1] / "config.json").read_text()


def test_decode_graph_gives_the_same_checkpoint(all_kinds, tmp_path) -> None:
    """A fused decode graph (export_model.py --hf --decode, KV caches) gives the checkpoint its fused
    prefill graph gives, byte for byte."""
    folder, onnx = all_kinds
    plan = parse_plan({**PLAN, "norm": "fold"})
    decode = tmp_path / "decode" / "model.onnx"
    export_hf(folder, decode, decode=True)
    outs = []
    for name, graph in (("decode", decode), ("prefill", onnx)):
        fused = fuse_file(graph, plan, tmp_path / name / "fused.onnx").output
        outs.append(tmp_path / name / "nas")
        export_checkpoint(fused, folder, outs[-1], dtype="float32")
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()


def test_a_wrong_early_guess_is_rewritten(all_kinds, tmp_path) -> None:
    """The early copy guesses tensors by name: a graph whose fused gate and up initializers swapped names
    (the same computation) makes the guess wrong; the recognizer's layout disagrees, the guessed files are
    dropped and the checkpoint is the one the unswapped graph gives, byte for byte."""
    folder, onnx = all_kinds
    fused = fuse_file(onnx, parse_plan({**PLAN, "norm": "last"}), tmp_path / "g" / "fused.onnx").output
    proto = load_proto(fused)
    swap = {"ffn_fusion.1_4.gate_proj.weight": "ffn_fusion.1_4.up_proj.weight"}
    swap.update({v: k for k, v in swap.items()})
    for tensor in proto.graph.initializer:
        tensor.name = swap.get(tensor.name, tensor.name)
    for node in proto.graph.node:
        node.input[:] = [swap.get(name, name) for name in node.input]
    swapped = tmp_path / "g" / "swapped.onnx"
    onnx_lib.save(proto, str(swapped))
    plain = export_checkpoint(fused, folder, tmp_path / "plain", dtype="float32")
    result = export_checkpoint(swapped, folder, tmp_path / "swapped", dtype="float32")
    assert plain.early_copy and not result.early_copy
    ours, theirs = (tmp_path / n / "model.safetensors" for n in ("swapped", "plain"))
    assert ours.read_bytes() == theirs.read_bytes()
    assert sorted(p.name for p in (tmp_path / "swapped").iterdir()) == sorted(
        p.name for p in (tmp_path / "plain").iterdir())


def test_the_early_guess_reads_the_onnx_file_as_onnx_does(all_kinds, tmp_path) -> None:
    """exporters.nas.onnx_proto (the standard-library reader the early copy uses instead of `import onnx`)
    gives the metadata and every initializer's name, dtype, dims, raw bytes and external place that onnx's
    own parser gives: on the float32 graph (norms inline) and on a fused bf16 graph."""
    folder, onnx = all_kinds
    bf16 = tmp_path / "bf16" / "model.onnx"
    export_hf(folder, bf16)
    fused = fuse_file(bf16, parse_plan(PLAN), tmp_path / "fused" / "model.onnx", validate_output=False).output
    for path in (onnx, fused):
        proto, header = load_proto(path), read_model(path)
        assert header.metadata == {p.key: p.value for p in proto.metadata_props}
        assert list(header.initializers) == [t.name for t in proto.graph.initializer]
        inline = 0
        for tensor in proto.graph.initializer:
            ours = header.initializers[tensor.name]
            assert (ours.data_type, ours.dims, ours.data_location) == (
                tensor.data_type, list(tensor.dims), tensor.data_location)
            assert ours.raw_data == tensor.raw_data
            assert ours.external == {e.key: e.value for e in tensor.external_data}
            inline += bool(tensor.raw_data)
        assert inline and len(header.initializers) > inline  # both kinds were compared


def test_contiguous_copies_are_one_kernel_copy(tmp_path, monkeypatch) -> None:
    """Tensors whose bytes follow each other in the source file are written by one copy_file_range run (a
    thread copying beside the recognizer takes the GIL back once per call); the file is the same as when
    each tensor is copied on its own, and a tensor from elsewhere starts a new run."""
    source = tmp_path / "weights.bin"
    source.write_bytes(np.random.default_rng(0).integers(0, 256, 64 * 6, dtype=np.uint8).tobytes())
    spans = [(0, 64), (64, 128), (256, 64), (128, 128)]  # the third is not right after the second
    tensors = [st.copied(f"t{k}", "float16", (n // 2,), str(source), a, n) for k, (a, n) in enumerate(spans)]
    calls = []
    real = st.copy_range
    monkeypatch.setattr(st, "copy_range", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    (tmp_path / "runs").mkdir()
    st.write_checkpoint(tmp_path / "runs", tensors)
    assert calls == [192, 64, 128]
    loaded = load_file(tmp_path / "runs" / "model.safetensors")
    data = source.read_bytes()
    for k, (at, n) in enumerate(spans):
        assert loaded[f"t{k}"].tobytes() == data[at : at + n]


# ------------------------------------------------------------------------------------------------- FP8


def test_fp8_weights_are_the_fp8_onnx_weights(all_kinds, tmp_path) -> None:
    """--fp8 (per-channel): every linear weight and scale is the project's FP8 ONNX's (passes.quant.fp8) to
    the bit; lm_head and norms stay bf16; the ModelOpt configs name the algorithm; the dequantized
    checkpoint's logits are as close to the float ones as the FP8 ONNX's are."""
    folder, onnx = all_kinds
    fused = fuse_file(onnx, parse_plan({**PLAN, "norm": "fold"}), tmp_path / "fused" / "model.onnx").output
    out = tmp_path / "nas_fp8"
    export_checkpoint(fused, folder, out, fp8="per-channel")
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN" and quant["exclude_modules"] == ["lm_head"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    tensors = load_torch(str(out / "model.safetensors"))
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    scales = calibrate(fused, [_ids(5, 2, 16)], progress=False)
    model = load_model(fused)
    layout = plan_layout(model, folder, fused)
    sources = {t.name: t.tensor.name for t in layout.tensors if t.linear and t.name != "lm_head.weight"}
    quantize_fp8(model, scales)
    initializers = model.graph.initializers
    assert len(sources) == 3 * 4 + 2 + 5 * 3  # GQA q/k/v/o, two Linear parts, five SwiGLUs
    for name, onnx_name in sources.items():
        ours = tensors[name]
        assert ours.dtype == torch.float8_e4m3fn
        theirs = initializers[f"{onnx_name}_fp8"].const_value.numpy()  # [in, out]
        assert np.array_equal(ours.view(torch.uint8).numpy(), theirs.T.view(np.uint8)), name
        scale = initializers[f"{onnx_name}_fp8_scale"].const_value.numpy()
        assert tensors[name.removesuffix("weight") + "weight_scale"].reshape(-1).tolist() == scale.tolist()
    ids = _ids(2)
    reference = graph_logits(fused, ids)
    assert 1e-4 < max_abs_relative_error(deci_logits(out, ids), reference) < 0.15


def test_fp8_per_tensor_writes_calibrated_input_scales(all_kinds, tmp_path) -> None:
    """--fp8 per-tensor: ModelOpt's "FP8" (scalar weight_scale and input_scale); the input scales are the
    calibration file's for the activation each layer reads."""
    folder, onnx = all_kinds
    scales = calibrate(onnx, [_ids(5, 2, 16)], progress=False)
    scales.save(tmp_path / "scales.json")
    out = tmp_path / "nas"
    export_checkpoint(onnx, folder, out, fp8="per-tensor", fp8_scales=tmp_path / "scales.json")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    tensors = {k: v.numpy() for k, v in load_file_torch(out / "model.safetensors").items()
               if v.dtype == torch.float32}
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.weight_scale"].shape == () and tensors[f"{q}.input_scale"].shape == ()
    # q, k and v read the same normalized input: one activation scale for the three
    assert tensors[f"{q}.input_scale"] == tensors["model.layers.0.self_attn.k_proj.input_scale"]
    assert float(tensors[f"{q}.input_scale"]) in {np.float32(v) for v in scales.scales.values()}
    assert max_abs_relative_error(deci_logits(out, _ids(2)), graph_logits(onnx, _ids(2))) < 0.15


# ------------------------------------------------------------------------------------------- refusals


def load_file_torch(path: Path) -> dict[str, torch.Tensor]:
    return load_torch(str(path))


def _with_metadata(onnx: Path, target: Path, key: str, value: dict) -> Path:
    proto = load_proto(onnx)
    entries = {p.key: p for p in proto.metadata_props}
    if key in entries:
        entries[key].value = json.dumps(value)
    else:
        proto.metadata_props.add(key=key, value=json.dumps(value))
    onnx_lib.save(proto, str(target))
    return target


def test_refusals(all_kinds, tmp_path) -> None:
    """A parallel-blocks plan, a plan the graph does not have, another model, an existing output folder:
    UserError, nothing written."""
    folder, onnx = all_kinds
    fused = fuse_file(onnx, parse_plan({**PLAN, "norm": "last"}), onnx.parent / "fused_last.onnx").output
    out = tmp_path / "out"
    parallel = _with_metadata(fused, onnx.parent / "parallel.onnx", "ffn_fusion.plan",
                              {"groups": [], "norm": "last", "parallel_blocks": [[0, 1]]})
    with pytest.raises(UserError, match="parallel blocks .* no form in Nemotron-NAS block_configs"):
        export_checkpoint(parallel, folder, out)
    other_plan = _with_metadata(fused, onnx.parent / "other_plan.onnx", "ffn_fusion.plan",
                                {"groups": [[1, 3], [9, 10]], "norm": "last"})
    with pytest.raises(UserError, match="another plan"):
        export_checkpoint(other_plan, folder, out)
    other = write_all_kinds(tmp_path / "other_ckpt", seed=8, vocab=VOCAB)
    with pytest.raises(UserError, match="holds other values"):
        export_checkpoint(fused, other, out)
    (out / "x").mkdir(parents=True)
    with pytest.raises(UserError, match="not an empty folder"):
        export_checkpoint(fused, folder, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_ckpt", "out"]
    assert [p.name for p in out.iterdir()] == ["x"]


# ---------------------------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_hf, tmp_path_factory) -> tuple[Path, Path]:
    """SmolLM2-135M as a Hugging Face folder with attention dropped from layers 13-22, and its graph."""
    onnx = tmp_path_factory.mktemp("nas_smollm2") / "onnx" / "model.onnx"
    export_hf(smollm2_hf, onnx, dtype="float32")
    return smollm2_hf, onnx


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["last", "fold"])
def test_smollm2_fused_round_trip(smollm2, tmp_path, norm) -> None:
    """The real SmolLM2 (a Llama source) fused [[13, 17], [18, 21]] becomes a 23-layer Nemotron-NAS
    checkpoint (layers 13-22 attention no_op, layer 13 ffn_mult 20.0 = 5 x 1536, layer 14 16.0): its
    re-import's logits equal the fused graph's, and the torch reference's too."""
    folder, onnx = smollm2
    plan = {"groups": [[13, 17], [18, 21]], "norm": norm}
    fused = fuse_file(onnx, parse_plan(plan), tmp_path / "fused" / "model.onnx").output
    out = tmp_path / "nas"
    assert export_checkpoint(fused, folder, out, max_shard_bytes=200_000_000).early_copy
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 23 and config["torch_dtype"] == "float32"
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None
    blocks = config["block_configs"]
    assert [b["ffn"]["ffn_mult"] for b in blocks] == [4.0] * 13 + [20.0, 16.0] + [4.0] * 8
    assert [b["attention"]["no_op"] for b in blocks] == [False] * 13 + [True] * 3 + [False] * 7
    assert {b["attention"]["n_heads_in_group"] for b in blocks if not b["attention"]["no_op"]} == {3}
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()
    back = tmp_path / "back" / "model.onnx"
    export_hf(out, back, dtype="float32")
    widths = [b.width for b in find_blocks(load_model(back))]
    assert widths == [1536] * 13 + [7680, 6144] + [1536] * 8
    ids = _ids(0, 2, 12, vocab=49152)
    expected = graph_logits(fused, ids)
    assert max_abs_relative_error(graph_logits(back, ids), expected) <= 1e-5
    assert max_abs_relative_error(deci_logits(out, ids), expected) <= 1e-4
