"""Which output layer and which tensor comes from where: a fused (or healed) ONNX graph and its source
checkpoint -> the layers, block_configs and tensor list of a Nemotron-NAS checkpoint (docs/deploy.md).

A plan group [i, j] becomes ONE layer: layer i's attention part as it was, then one SwiGLU FFN whose
gate/up/down are the fused graph's (already concatenated, possibly healed) and whose norm weight is the
group's last norm ("last") or ones with the norms folded into gate/up ("fold": the graph's norm has no
weight). Layers i+1..j disappear and the others are renumbered. Every SwiGLU FFN is read through the
project's recognizer (passes.model_map), every other tensor by its checkpoint name (the --hf exporter names
initializers so); all of them from the ONNX, which is the model being deployed. The source checkpoint gives
the config, the dtype and a check that the ONNX is its model (layer kinds, widths, the first values of
every tensor read by name).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporters.hf.config import HfConfig, expected_tensors, layer_kinds, read_config
from exporters.hf.safetensors_in import Checkpoint, open_checkpoint, read_tensor_rows
from exporters.nas.ffn_mult import ffn_mult_for
from passes.blocks import Block
from passes.errors import UserError
from passes.io.stream_concat import read_columns, read_rows
from passes.matching import strip_cast
from passes.metadata import HF_METADATA_KEY, PLAN_METADATA_KEY
from passes.model_map import find_blocks
from passes.patterns.swiglu import Weight

NAS_ARCHITECTURE = "DeciLMForCausalLM"
NAS_MODEL_TYPE = "nemotron-nas"
# What released DeciLM configs name as their code (vLLM and TensorRT-LLM load the config through it with
# trust_remote_code; a Llama source's folder gets the same entry, the files to copy are in docs/deploy.md).
REMOTE_CODE = {
    "AutoConfig": "configuration_decilm.DeciLMConfig",
    "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
}
# config.json key (ignored by the engines) recording where each output layer came from.
PROVENANCE_KEY = "ffn_fusion"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Values compared per tensor read by name, and how close (the ONNX may hold another float dtype).
_FINGERPRINT_VALUES = 1024
_FINGERPRINT_RTOL = 2.0**-6


@dataclass(frozen=True)
class TensorSource:
    """One output tensor in the Hugging Face layout ([out, in] for linear weights), and where its values
    are: rows of an ONNX tensor (stored [out, in], or [in, out] and read by columns), or a constant."""

    name: str
    shape: tuple[int, ...]
    tensor: ir.TensorProtocol | None = None  # None: every value is `fill`
    transpose: bool = False  # stored [in, out]: output rows are stored columns
    rows: tuple[int, int] | None = None  # the output rows' range in the stored tensor's output axis
    fill: float = 1.0
    linear: bool = False  # a linear layer's weight (what --fp8 quantizes)

    @property
    def stored_2d(self) -> tuple[int, int]:
        dims = [int(d) for d in self.tensor.shape]
        return (dims[0], dims[1]) if len(dims) == 2 else (1, int(np.prod(dims)))

    @property
    def kernel_copyable(self) -> bool:
        """The output bytes are one contiguous range of the ONNX data file (a kernel copy keeps them)."""
        return isinstance(self.tensor, ir.ExternalTensor) and not self.transpose

    def byte_range(self) -> tuple[str, int, int]:
        """(file, offset, length) of the output rows in the ONNX data file (kernel_copyable only)."""
        rows, cols = self.stored_2d
        first, last = self.rows or (0, rows)
        row_bytes = cols * int(self.tensor.dtype.itemsize)
        start = (self.tensor.offset or 0) + first * row_bytes
        return str(self.tensor.path), start, (last - first) * row_bytes

    def read(self, start: int, stop: int) -> np.ndarray:
        """Output rows start:stop ([stop - start, in] for a matrix) in the stored dtype."""
        if self.tensor is None:
            return np.full((stop - start, self.shape[-1]), self.fill, np.float32)
        rows, cols = self.stored_2d
        first = (self.rows or (0, 0))[0]
        if self.transpose:
            return read_columns(self.tensor, rows, cols, first + start, first + stop).T
        return read_rows(self.tensor, rows, cols, first + start, first + stop)

    @property
    def height(self) -> int:
        return self.shape[0] if len(self.shape) == 2 else 1


@dataclass
class OutLayer:
    index: int
    source_layers: list[int]
    block_config: dict
    tensors: list[TensorSource] = field(default_factory=list)


@dataclass
class NasLayout:
    """Everything the writer needs: config.json, and the tensors in checkpoint order."""

    source: HfConfig
    checkpoint: Checkpoint
    config: dict
    layers: list[OutLayer]
    tensors: list[TensorSource]
    plan: dict

    @property
    def source_layers(self) -> list[list[int]]:
        return [layer.source_layers for layer in self.layers]


def plan_layout(model: ir.Model, source_folder: Path, onnx_path: Path) -> NasLayout:
    """The Nemotron-NAS layout of `model` (a graph exported from `source_folder` by export_model.py --hf,
    then fused and/or healed); UserError when the graph is not that checkpoint's model."""
    source = read_config(source_folder)
    if source.architecture not in ("LlamaForCausalLM", NAS_ARCHITECTURE):
        raise UserError(
            f"{source.path}: {source.architecture} has no Nemotron-NAS form here (Llama and DeciLM only)"
        )
    if source.qkv_bias or source.o_bias or any(layer.sliding_window for layer in source.layers):
        raise UserError(f"{source.path}: attention biases and sliding windows have no Nemotron-NAS form")
    checkpoint = open_checkpoint(source_folder)
    meta = _metadata(model, onnx_path)
    if meta.get("layer_kinds") != layer_kinds(source):
        raise UserError(
            f"{onnx_path} is not a graph of {source_folder}: its layers ({_short(meta.get('layer_kinds'))}) "
            f"differ from the checkpoint's ({_short(layer_kinds(source))})"
        )
    plan = _plan(model, onnx_path)
    groups = {first: last for first, last in plan["groups"]}
    blocks = _blocks_by_layer(model, onnx_path)
    names = expected_tensors(source)
    initializers = model.graph.initializers
    layers: list[OutLayer] = []
    skip_until = -1
    for i, layer in enumerate(source.layers):
        if i <= skip_until:
            continue
        last = groups.get(i, i)
        skip_until = last
        out = OutLayer(len(layers), list(range(i, last + 1)), _block_config(source, i, last))
        prefix = f"model.layers.{out.index}"
        block = blocks.get(i)
        _check_attention(block, layer.attention, i, onnx_path)
        for name in names:
            match = _LAYER.match(name)
            if match and int(match.group(1)) == i and match.group(2).split(".")[0] in (
                "input_layernorm",
                "self_attn",
            ):
                out_name = f"{prefix}.{match.group(2)}"
                out.tensors.append(_by_name(initializers, name, out_name, names, onnx_path))
        members = [source.layers[k] for k in range(i, last + 1)]
        if last > i or layer.ffn == "swiglu":
            out.tensors += _swiglu(block, i, last, members, source, prefix, onnx_path)
        elif layer.ffn == "linear":
            for part in ("post_attention_layernorm.weight", "mlp.linear_mlp.weight"):
                name = f"model.layers.{i}.{part}"
                out.tensors.append(_by_name(initializers, name, f"{prefix}.{part}", names, onnx_path))
        elif block is not None and block.ffn_kind != "none":
            raise UserError(f"{onnx_path}: layer {i} has an FFN ({block.ffn_kind}); {source.path} has none")
        layers.append(out)
    head = [n for n in names if not _LAYER.match(n)]
    tensors = [_by_name(initializers, head[0], head[0], names, onnx_path)]
    tensors += [t for layer in layers for t in layer.tensors]
    tensors += [_by_name(initializers, n, n, names, onnx_path) for n in head[1:]]
    _check_fingerprints(tensors, source, checkpoint, layers, onnx_path)
    config = nas_config(source, [layer.block_config for layer in layers])
    config[PROVENANCE_KEY] = {
        "source": source_folder.resolve().name,
        "source_layers": [layer.source_layers for layer in layers],
        "plan": plan,
    }
    return NasLayout(source, checkpoint, config, layers, tensors, plan)


def _short(kinds) -> str:
    if not isinstance(kinds, list):
        return "none recorded"
    return f"{len(kinds)} layers: {', '.join(kinds[:3])}{', ...' if len(kinds) > 3 else ''}"


def _metadata(model: ir.Model, onnx_path: Path) -> dict:
    try:
        meta = json.loads(model.metadata_props[HF_METADATA_KEY])
    except (KeyError, json.JSONDecodeError):
        raise UserError(
            f"{onnx_path} has no {HF_METADATA_KEY!r} metadata: export_checkpoint takes graphs written by "
            "export_model.py --hf (fused or healed after), whose weights carry the checkpoint's names"
        ) from None
    return meta


def _plan(model: ir.Model, onnx_path: Path) -> dict:
    try:
        plan = json.loads(model.metadata_props.get(PLAN_METADATA_KEY, "{}"))
    except json.JSONDecodeError:
        raise UserError(f"{onnx_path}: metadata {PLAN_METADATA_KEY!r} is not JSON") from None
    if plan.get("parallel_blocks"):
        groups = ", ".join(str(g) for g in plan["parallel_blocks"])
        raise UserError(
            f"{onnx_path}: the plan has parallel blocks ({groups}); whole blocks side by side have no form "
            "in Nemotron-NAS block_configs (one layer is attention then FFN): export a model without "
            "\"parallel_blocks\""
        )
    return {"groups": [list(g) for g in plan.get("groups", [])], "norm": plan.get("norm", "last")}


def _blocks_by_layer(model: ir.Model, onnx_path: Path) -> dict[int, Block]:
    blocks: dict[int, Block] = {}
    for block in find_blocks(model):
        if block.parallel is not None:
            raise UserError(f"{onnx_path}: block {block.index} is in a parallel group; no block_configs form")
        match = re.fullmatch(r"model\.layers\.(\d+)", block.layer_name or "")
        if match is None:
            raise UserError(
                f"{onnx_path}: the graph's blocks do not follow the layers and plan its metadata records "
                f"(block {block.index} has no layer name): another plan, or a graph not written by --hf"
            )
        blocks[int(match.group(1))] = block
    return blocks


_ATTENTION_KINDS = {"gqa": "attention", "linear": "linear", "none": "none"}


def _check_attention(block: Block | None, kind: str, i: int, onnx_path: Path) -> None:
    found = block.attention_kind if block is not None else "none"
    if found != _ATTENTION_KINDS[kind]:
        raise UserError(f"{onnx_path}: layer {i} has attention part {found!r}; the checkpoint says {kind!r}")


def _swiglu(
    block: Block | None,
    first: int,
    last: int,
    members: list,
    source: HfConfig,
    prefix: str,
    onnx_path: Path,
) -> list[TensorSource]:
    """The (fused) SwiGLU FFN of layers first..last as the graph computes it: norm, gate, up, down."""
    width = sum(m.ffn_width for m in members if m.ffn == "swiglu")
    what = f"layers {first}-{last}" if last > first else f"layer {first}"
    if block is None or block.ffn is None:
        raise UserError(f"{onnx_path}: {what} should end in a SwiGLU FFN {width} wide; the graph has none")
    if block.width != width:
        raise UserError(
            f"{onnx_path}: the SwiGLU FFN of {what} is {block.width} wide; the checkpoint and the graph's "
            f"plan give {width} (another model or another plan)"
        )
    ffn = block.ffn
    if any(w.nbits is not None for w in (ffn.gate, ffn.up, ffn.down)):
        raise UserError(f"{onnx_path}: {what} has int4 (MatMulNBits) weights; export a float graph")
    norm = block.norm.weight if block.norm is not None else None
    hidden = source.hidden
    if norm is None:  # "fold": the norm weights live in gate/up rows; the layer's own norm is the unit
        norm_source = TensorSource(f"{prefix}.post_attention_layernorm.weight", (hidden,), fill=1.0)
    else:
        tensor = strip_cast(norm).const_value
        norm_source = TensorSource(f"{prefix}.post_attention_layernorm.weight", (hidden,), tensor)
    return [
        norm_source,
        _weight_source(f"{prefix}.mlp.gate_proj.weight", ffn.gate),
        _weight_source(f"{prefix}.mlp.up_proj.weight", ffn.up),
        _weight_source(f"{prefix}.mlp.down_proj.weight", ffn.down),
    ]


def _weight_source(name: str, weight: Weight) -> TensorSource:
    """A recognized [in, out] weight as the checkpoint's [out, in] tensor."""
    fan_in, fan_out = weight.shape
    return TensorSource(
        name,
        (fan_out, fan_in),
        weight.source.const_value,
        transpose=not weight.transposed,
        rows=weight.columns,
        linear=True,
    )


def _by_name(
    initializers, name: str, out_name: str, names: dict, onnx_path: Path
) -> TensorSource:
    shape = names[name][0]
    value = initializers.get(name)
    if value is None or value.const_value is None:
        raise UserError(
            f"{onnx_path} has no initializer {name!r}: not a graph of this checkpoint written by "
            "export_model.py --hf"
        )
    stored = tuple(int(d) for d in value.const_value.shape)
    linear = len(shape) == 2 and "embed_tokens" not in name
    if stored == shape:
        return TensorSource(out_name, shape, value.const_value, linear=linear)
    if len(shape) == 2 and stored == shape[::-1]:
        return TensorSource(out_name, shape, value.const_value, transpose=True, linear=linear)
    raise UserError(f"{onnx_path}: initializer {name!r} is {list(stored)}; the checkpoint's is {list(shape)}")


def _check_fingerprints(
    tensors: list[TensorSource], source: HfConfig, checkpoint: Checkpoint, layers: list[OutLayer],
    onnx_path: Path,
) -> None:
    """The first values of every tensor read by name must be the checkpoint's (to the coarser dtype): a
    graph of another model with the same shapes is refused before anything is written."""
    renamed = {}
    for layer in layers:
        for tensor in layer.tensors:
            match = _LAYER.match(tensor.name)
            renamed[tensor.name] = f"model.layers.{layer.source_layers[0]}.{match.group(2)}"
    for tensor in tensors:
        if tensor.tensor is None or ".mlp." in tensor.name or "post_attention_layernorm" in tensor.name:
            continue  # FFNs are fused or healed: the graph's own
        name = renamed.get(tensor.name, tensor.name)
        entry = checkpoint.tensors.get(name)
        if entry is None:
            continue
        cols = tensor.shape[-1]
        rows = max(1, min(tensor.height, _FINGERPRINT_VALUES // cols))
        ours = tensor.read(0, rows).astype(np.float32).reshape(-1)[:_FINGERPRINT_VALUES]
        theirs = read_tensor_rows(entry, 0, rows).astype(np.float32).reshape(-1)[: ours.size]
        scale = float(np.abs(theirs).max()) or 1.0
        if not np.allclose(ours, theirs, rtol=_FINGERPRINT_RTOL, atol=_FINGERPRINT_RTOL * scale):
            raise UserError(
                f"{onnx_path} is not a graph of {checkpoint.folder}: tensor {name!r} holds other values "
                "(another model?)"
            )


# ------------------------------------------------------------------------------------------ config.json


def block_config(attention: str | int, ffn: str | float) -> dict:
    """A block_configs entry as the released Nemotron configs spell it (every field, the ones without a
    meaning here at their neutral values). attention: "no_op" | "linear" | n_heads_in_group; ffn: "no_op"
    | "linear" | ffn_mult."""
    return {
        "attention": {
            "n_heads_in_group": attention if isinstance(attention, int) else None,
            "no_op": attention == "no_op",
            "num_sink_tokens": None,
            "replace_with_linear": attention == "linear",
            "sparsify": None,
            "unshifted_sink": False,
            "use_prefill_window_in_sink_attention": False,
            "window_length": None,
        },
        "ffn": {
            "ffn_mult": ffn if isinstance(ffn, float | int) and not isinstance(ffn, bool) else None,
            "no_op": ffn == "no_op",
            "replace_with_linear": ffn == "linear",
            "sparsify": None,
        },
    }


def _block_config(source: HfConfig, first: int, last: int) -> dict:
    """Layer first's entry; for a group, its FFN widened to the members' summed width."""
    layer = source.layers[first]
    if source.is_deci:
        entry = copy.deepcopy(source.raw["block_configs"][first])
    else:
        attention = {"gqa": source.heads // max(layer.kv_heads, 1), "linear": "linear", "none": "no_op"}
        entry = block_config(attention[layer.attention], 1.0)  # "none": exporters.hf.folder dropped it
    members = source.layers[first : last + 1]
    kind = "swiglu" if last > first else layer.ffn
    if kind == "swiglu" and (last > first or not source.is_deci):  # a DeciLM layer keeps its own ffn_mult
        width = sum(m.ffn_width for m in members if m.ffn == "swiglu")
        ffn = entry["ffn"]
        ffn.update(no_op=False, replace_with_linear=False, ffn_mult=ffn_mult_for(width, source.hidden))
    elif not source.is_deci:
        entry["ffn"] = block_config(0, "no_op" if kind == "none" else "linear")["ffn"]
    return entry


def nas_config(source: HfConfig, block_configs: list[dict]) -> dict:
    """config.json of the output: the source's (a DeciLM config keeps its fields), with block_configs and
    num_hidden_layers replaced; a Llama config becomes DeciLM (rope_theta and rope_scaling at the top)."""
    raw = copy.deepcopy(source.raw)
    for key in ("ffn_fusion_dropped_attention", "intermediate_size", "num_key_value_heads", PROVENANCE_KEY):
        raw.pop(key, None)
    if not source.is_deci:
        params = raw.pop("rope_parameters", None) or {}
        scaling = raw.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
        raw["rope_theta"] = source.rope.theta
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        raw["rope_scaling"] = scaling if kind != "default" else None
        raw.pop("layer_types", None)
        raw.pop("pretraining_tp", None)
        if source.head_dim == source.hidden // source.heads:
            raw.pop("head_dim", None)
        raw["auto_map"] = REMOTE_CODE  # transformers needs NVIDIA's DeciLM code beside it (docs/deploy.md)
    raw["architectures"] = [NAS_ARCHITECTURE]
    raw["model_type"] = NAS_MODEL_TYPE
    raw["num_hidden_layers"] = len(block_configs)
    raw["block_configs"] = block_configs
    raw.setdefault("hidden_act", "silu")
    raw.setdefault("attention_bias", False)
    raw.setdefault("mlp_bias", False)
    return raw
