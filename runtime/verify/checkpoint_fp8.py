"""FP8 Nemotron-NAS checkpoints (export_checkpoint.py --fp8, per-channel): the --hf export reads float weights
only, so they are not re-imported; instead every tensor is compared with ORIGINAL, the FP8 ONNX of the
graph they were exported from (build_engines.py --fp8: passes.quant.fp8, whose per-channel float8 weights
and scales the per-channel export writes to the bit):

- block table: config.json's layer count is its source_layers', its plan ORIGINAL's;
- checkpoint tensors: every float8 weight ([out, in]) equals ORIGINAL's `<tensor>_fp8` ([in, out]) bit for
  bit, its `weight_scale` ORIGINAL's `<tensor>_fp8_scale`; every float tensor (norms, embeddings, lm_head)
  equals ORIGINAL's rounded to the checkpoint's dtype, bit for bit.

ORIGINAL's tensor for a checkpoint tensor comes by name (an FP8 graph has no block walk): layer i's
tensors from its first source layer, a fused layer's FFN from the fusion's `ffn_fusion.<first>_<last>.*`
weights, its norm from the group's last member (plan norm "last") or all ones ("fold"). No logits check:
the per-token activation quantization the engines apply has no ONNX here to compare with.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx_ir as ir

from exporters.hf.safetensors_in import TensorEntry, numpy_dtype, open_checkpoint
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.model_map import PLAN_METADATA_KEY
from runtime.verify.common import metadata_json
from runtime.verify.fp8 import is_fp8
from runtime.verify.records import VerifyReport

PER_CHANNEL = "FP8_PER_CHANNEL_PER_TOKEN"
FLOAT8 = "F8_E4M3"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED_FFN = re.compile(r"^mlp\.(gate|up|down)_proj\.weight$")


def verify_fp8_checkpoint(report: VerifyReport, config: dict, source_layers: list[list[int]]) -> None:
    folder, original = report.artifact, report.original
    quant = json.loads((folder / "hf_quant_config.json").read_text(encoding="utf-8")).get("quantization", {})
    algo = quant.get("quant_algo")
    if algo != PER_CHANNEL:
        raise UserError(
            f"{folder} is an FP8 checkpoint in ModelOpt's {algo!r} form: only {PER_CHANNEL} checkpoints "
            "(export_checkpoint.py --fp8 per-channel) are verified, against the FP8 ONNX whose weights they "
            "hold"
        )
    model = load_model(original)
    if not is_fp8(model):
        raise UserError(
            f"{folder} is an FP8 checkpoint: verify it against the FP8 ONNX of the graph it was exported "
            f"from (build_engines.py --fp8), not {original}, which has no float8 weights"
        )
    plan = config["ffn_fusion"].get("plan") or {}
    if not _block_table(report, config, source_layers, plan):
        return
    initializers = model.graph.initializers
    entries = open_checkpoint(folder).tensors
    bad, compared, quantized, dtypes = [], 0, 0, set()
    for name, entry in entries.items():
        if name.endswith(("weight_scale", "input_scale")):
            continue  # compared with their weight
        compared += 1
        source = _source_name(name, source_layers, plan.get("norm"))
        if entry.dtype == FLOAT8:
            quantized += 1
            problem = _float8(name, entry, entries.get(f"{name}_scale"), source, initializers)
        else:
            dtypes.add(entry.numpy_name)
            problem = _float(name, entry, source, initializers)
        if problem is not None:
            bad.append(problem)
    report.notes.append("FP8 checkpoint: compared tensor by tensor with the FP8 ONNX, not re-imported")
    report.add_mismatches(
        "checkpoint tensors",
        bad,
        compared,
        "checkpoint tensors differ",
        f"{compared} tensors equal ORIGINAL's bit for bit: {quantized} float8 weights with their scales, "
        f"{compared - quantized} in {', '.join(sorted(dtypes)) or 'no float dtype'}",
        sep="; ",
    )


def _block_table(report: VerifyReport, config: dict, source_layers: list[list[int]], plan: dict) -> bool:
    layers = config.get("num_hidden_layers")
    recorded = metadata_json(report.original, PLAN_METADATA_KEY)
    if layers != len(source_layers):
        message = f"config.json says {layers} layers, its source_layers {len(source_layers)}"
        report.add("block table", False, message)
        return False
    if recorded is not None and recorded.get("groups") != plan.get("groups"):
        groups = plan.get("groups")
        message = f"config.json records the groups {groups}, ORIGINAL was fused with {recorded['groups']}"
        report.add("block table", False, message)
        return False
    fused = [f"layer {i} = {m[0]}-{m[-1]}" for i, m in enumerate(source_layers) if len(m) > 1]
    report.add("block table", True, f"{layers} layers; fused: {', '.join(fused) or 'none'}", layers=layers)
    return True


def _source_name(name: str, source_layers: list[list[int]], norm: str | None) -> str | None:
    """ORIGINAL's tensor for checkpoint tensor `name` (see the module docstring); None: all ones."""
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) >= len(source_layers):
        return name
    members, part = source_layers[int(match.group(1))], match.group(2)
    first, last = members[0], members[-1]
    if last > first and _FUSED_FFN.match(part):
        return f"ffn_fusion.{first}_{last}.{part.removeprefix('mlp.')}"
    if last > first and part == "post_attention_layernorm.weight":
        return None if norm == "fold" else f"model.layers.{last}.{part}"
    return f"model.layers.{first}.{part}"


def _raw(entry: TensorEntry, dtype: np.dtype) -> np.ndarray:
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        return np.frombuffer(f.read(entry.end - entry.start), dtype=dtype).reshape(entry.shape)


def _float8(
    name: str, entry: TensorEntry, scale: TensorEntry | None, source: str | None, initializers
) -> str | None:
    q, q_scale = initializers.get(f"{source}_fp8"), initializers.get(f"{source}_fp8_scale")
    if q is None or q_scale is None or q.const_value is None or q_scale.const_value is None or scale is None:
        return f"{name!r} (no float8 {source}_fp8 with its scale in ORIGINAL, or no weight_scale here)"
    ours = _raw(entry, np.dtype(np.uint8))
    theirs = np.asarray(q.const_value.numpy()).view(np.uint8).T  # stored [in, out]
    if ours.shape != theirs.shape:
        return f"{name!r} (shape {list(ours.shape)}, ORIGINAL's {source}_fp8 {list(theirs.shape)})"
    differ = int(np.count_nonzero(ours != theirs))
    if differ:
        return f"{name!r} ({differ} of {ours.size} float8 values differ from ORIGINAL's {source}_fp8)"
    ours_scale = _raw(scale, np.dtype(np.float32)).reshape(-1)
    theirs_scale = np.asarray(q_scale.const_value.numpy()).astype(np.float32).reshape(-1)
    if ours_scale.shape != theirs_scale.shape or np.any(ours_scale.view("u4") != theirs_scale.view("u4")):
        return f"{name!r}_scale (differs from ORIGINAL's {source}_fp8_scale)"
    return None


def _float(name: str, entry: TensorEntry, source: str | None, initializers) -> str | None:
    dtype = numpy_dtype(entry.numpy_name)
    ours = _raw(entry, dtype)
    value: ir.Value | None = initializers.get(source) if source is not None else None
    if source is None:
        wide = np.ones(ours.shape, np.float32)
    elif value is None or value.const_value is None:
        return f"{name!r} (ORIGINAL has no {source!r})"
    else:
        wide = np.asarray(value.const_value.numpy()).astype(np.float32)
    theirs = wide.astype(dtype)
    if ours.shape != theirs.shape:
        return f"{name!r} (shape {list(ours.shape)}, ORIGINAL's {source!r} {list(theirs.shape)})"
    width = f"u{dtype.itemsize}"
    differ = int(np.count_nonzero(ours.view(width) != theirs.view(width)))
    if differ:
        return f"{name!r} ({differ} of {ours.size} values differ from ORIGINAL's {source or 'ones'!r})"
    return None
