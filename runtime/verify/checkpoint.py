"""Nemotron-NAS checkpoint folders (tools/export_checkpoint.py, exporters/nas; config.json records
`ffn_fusion`): re-imported as `export_model.py --hf` reads a checkpoint (exporters.hf, float32, into a
temporary folder) and checked against ORIGINAL, the fused or healed ONNX the checkpoint was written from:

- block table: the re-import's layers (count, each layer's attention and FFN kind, FFN width: a fused
  group's summed width) equal ORIGINAL's, and config.json's layer count and plan are ORIGINAL's;
- checkpoint tensors: every tensor equals its ORIGINAL tensor in the checkpoint's dtype, bit for bit (a
  float32 export holds ORIGINAL's values, a bfloat16 export ORIGINAL's rounded to nearest even, as the
  exporter rounds); a fused layer's FFN is found by the block walk, every other tensor by its layer's
  first source layer (config.json's `source_layers`);
- logits: the re-import's logits against ORIGINAL's, max-abs relative error <= `checkpoint_tolerance`
  (1e-5). A rounded export is compared with ORIGINAL run with the same rounding of its weights: the
  rounding itself is what the tensor check proved, so the logits bound stays 1e-5 instead of what bf16
  weights cost (2.4e-3 on the test model, 2.8e-2 on SmolLM2-135M), and it still catches a config.json
  that reads the right tensors into the wrong model (rope, norms, the block table).

FP8 checkpoints (`--fp8`, runtime/verify/checkpoint_fp8.py): their float8 weights, scales and float tensors
are compared bit for bit with ORIGINAL (per channel: the FP8 ONNX of the graph they were exported from; per
tensor: that float graph), and a float32 copy with the weights dequantized is re-imported (the --hf export
reads float weights only) for the same logits bound against ORIGINAL holding exactly those weights.

Memory: one tensor at a time for the tensor checks (and for writing the rounded ORIGINAL); the logits run
block by block above block_runner.STREAMING_BYTES (common.logits). Disk: the re-import is a float32 copy of
the model in the system's temporary folder (and the rounded ORIGINAL another), removed at the end.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from exporters.hf.checkpoint import export_hf
from exporters.hf.safetensors_in import numpy_dtype, open_checkpoint
from exporters.nas.layout import PROVENANCE_KEY
from passes.blocks import Block
from passes.error_measures import max_abs_relative_error
from passes.io.model_io import load_model, save_model
from passes.metadata import recorded_plan
from passes.model_map import find_blocks
from passes.validate import default_tokens
from runtime.verify.checkpoint_fp8 import verify_fp8_checkpoint
from runtime.verify.common import logits, metadata, round_through
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport

CONFIG = "config.json"
QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's, written by export_checkpoint.py --fp8
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_checkpoint(folder: Path) -> bool:
    """A folder export_checkpoint.py wrote: config.json with its `ffn_fusion` record."""
    try:
        return PROVENANCE_KEY in json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


@dataclass
class _Pair:
    """A checkpoint tensor and the ORIGINAL tensor whose values it must hold, read when compared (one
    tensor in memory at a time)."""

    name: str
    checkpoint: Callable[[], np.ndarray]  # the re-import's float32 values (the checkpoint's, widened exactly)
    source: Callable[[], np.ndarray] | None  # None: ORIGINAL has no such tensor (a failure), or `ones`
    source_name: str | None
    ones: bool = False  # a norm "fold" fusion folded into the weights: ORIGINAL has none, the checkpoint ones


def verify_checkpoint(report: VerifyReport, options: VerifyOptions) -> None:
    folder = report.artifact
    config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    record = config[PROVENANCE_KEY]
    source_layers = record.get("source_layers") or []
    report.notes.append(
        f"Nemotron-NAS checkpoint of {record.get('source', '?')}: {len(source_layers)} layers, "
        f"{config.get('torch_dtype', '?')}, plan {json.dumps(record.get('plan'))}"
    )
    report.plan = record.get("plan")
    if (folder / QUANT_CONFIG).is_file() or "quantization_config" in config:
        verify_fp8_checkpoint(report, config, source_layers, options)
        return
    with tempfile.TemporaryDirectory(prefix="ffn_fusion_verify.") as tmp:
        back = Path(tmp) / "reimport" / "model.onnx"
        export_hf(folder, back, dtype="float32")
        source, reimport = load_model(report.original), load_model(back)
        source_blocks, back_blocks = find_blocks(source), find_blocks(reimport)
        if not block_table(report, config, source_blocks, back_blocks):
            return
        pairs = _pairs(source, reimport, source_blocks, back_blocks, source_layers)
        dtypes = _tensors(report, pairs, folder)
        tokens = default_tokens(source_blocks, report.original, options.seq)
        del reimport
        reference_path = report.original
        if dtypes:  # ORIGINAL with its weights rounded as the checkpoint holds them, one tensor at a time
            for name, dtype in dtypes.items():
                value = source.graph.initializers[name]
                value.const_value = round_through(value.const_value, dtype)
            reference_path = Path(tmp) / "rounded" / "model.onnx"
            reference_path.parent.mkdir()
            save_model(source, reference_path, external=True)
        del source
        _logits(report, options, logits(reference_path, tokens), logits(back, tokens), bool(dtypes))


def block_table(
    report: VerifyReport, config: dict, source_blocks: list[Block], back_blocks: list[Block]
) -> bool:
    """The "block table" check: layer count, kinds and FFN widths of `back_blocks` equal ORIGINAL's."""
    record = config[PROVENANCE_KEY]
    layers, listed = config.get("num_hidden_layers"), len(record.get("source_layers") or [])
    problem = None
    if not len(back_blocks) == len(source_blocks) == layers == listed:
        problem = (
            f"{len(back_blocks)} layers re-imported, config.json says {layers} ({listed} in its "
            f"source_layers), ORIGINAL has {len(source_blocks)}"
        )
    else:
        for i, (ours, theirs) in enumerate(zip(back_blocks, source_blocks, strict=True)):
            a = (ours.attention_kind, ours.ffn_kind, ours.width)
            b = (theirs.attention_kind, theirs.ffn_kind, theirs.width)
            if a != b:
                problem = f"layer {i}: attention {a[0]}, FFN {a[1]} of width {a[2]}; ORIGINAL's {b}"
                break
    fused_with = recorded_plan(metadata(report.original), source=str(report.original))
    plan = record.get("plan") or {}
    if problem is None and fused_with is not None:
        ours, theirs = plan.get("groups"), [list(g) for g in fused_with.groups]
        if ours != theirs:
            problem = f"config.json records the groups {ours}, ORIGINAL was fused with {theirs}"
    if problem is not None:
        report.add("block table", False, problem)
        return False
    fused = [
        f"layer {i} = {members[0]}-{members[-1]} width {back_blocks[i].width}"
        for i, members in enumerate(record["source_layers"])
        if len(members) > 1
    ]
    report.add(
        "block table",
        True,
        f"{len(back_blocks)} layers as ORIGINAL's; fused: {', '.join(fused) or 'none'}",
        layers=len(back_blocks),
    )
    return True


def _reader(value: ir.Value | None) -> Callable[[], np.ndarray] | None:
    if value is None or value.const_value is None:
        return None
    tensor = value.const_value
    return lambda: np.asarray(tensor.numpy())


def _pairs(
    source: ir.Model,
    reimport: ir.Model,
    source_blocks: list[Block],
    back_blocks: list[Block],
    source_layers: list[list[int]],
) -> list[_Pair]:
    """Each re-imported weight with the ORIGINAL tensor it came from: the SwiGLU weights and norms of the
    block at the same place (as [in, out] matrices), every other tensor by name, its layer renumbered to
    the layer's first source layer."""
    pairs, done = [], set()
    for ours, theirs in zip(back_blocks, source_blocks, strict=True):
        if ours.ffn is None or theirs.ffn is None:
            continue
        for role in ("gate", "up", "down"):
            a, b = getattr(ours.ffn, role), getattr(theirs.ffn, role)
            pairs.append(_Pair(a.source.name, a.matrix, b.matrix, b.source.name))
            done.add(a.source.name)
        if ours.norm is not None and ours.norm.weight is not None:
            weight = theirs.norm.weight if theirs.norm is not None else None
            name = ours.norm.weight.name
            read = _reader(ours.norm.weight)
            if weight is None:
                pairs.append(_Pair(name, read, None, None, ones=True))
            else:
                pairs.append(_Pair(name, read, _reader(weight), weight.name))
            done.add(name)
    initializers = source.graph.initializers
    for name, value in reimport.graph.initializers.items():
        if name in done or not name.startswith(("model.", "lm_head.")):
            continue  # the export's constants (eps, shapes, rope) are not checkpoint tensors
        match = _LAYER.match(name)
        source_name = name
        if match and int(match.group(1)) < len(source_layers):
            source_name = f"model.layers.{source_layers[int(match.group(1))][0]}.{match.group(2)}"
        pairs.append(_Pair(name, _reader(value), _reader(initializers.get(source_name)), source_name))
    return pairs


def _tensors(report: VerifyReport, pairs: list[_Pair], folder: Path) -> dict[str, np.dtype]:
    """The "checkpoint tensors" check; returns {ORIGINAL tensor: dtype} for the tensors the checkpoint
    holds rounded (a narrower dtype than ORIGINAL's)."""
    entries = open_checkpoint(folder).tensors
    bad, rounded = [], {}
    compared = 0
    for pair in pairs:
        entry = entries.get(pair.name)
        if entry is None:
            continue  # a re-import initializer that is no checkpoint tensor
        compared += 1
        dtype = numpy_dtype(entry.numpy_name)
        if pair.source is None and not pair.ones:
            bad.append(f"{pair.name!r} (ORIGINAL has no {pair.source_name!r})")
            continue
        checkpoint = pair.checkpoint()
        ours = checkpoint.astype(dtype)
        wide = np.ones_like(checkpoint) if pair.ones else pair.source().astype(np.float32)
        theirs = wide.astype(dtype)
        if ours.shape != theirs.shape:
            shapes = f"shape {list(ours.shape)}, ORIGINAL's {pair.source_name!r} {list(theirs.shape)}"
            bad.append(f"{pair.name!r} ({shapes})")
            continue
        width = f"u{dtype.itemsize}"
        differ = np.flatnonzero(ours.view(width) != theirs.view(width))
        if differ.size:
            where = f"{differ.size} of {ours.size} values differ"
            bad.append(f"{pair.name!r} ({where} from ORIGINAL's {pair.source_name or 'ones'!r})")
        if pair.source_name is not None and not np.array_equal(theirs.astype(np.float32), wide):
            rounded[pair.source_name] = dtype
    unread = sorted(set(entries) - {p.name for p in pairs})
    if unread:  # the --hf export refuses tensors config.json has no place for: none expected here
        shown = ", ".join(repr(n) for n in unread[:5]) + (" ..." if len(unread) > 5 else "")
        bad.append(f"{len(unread)} tensor(s) the re-import does not read: {shown}")
    dtypes = sorted({entries[p.name].numpy_name for p in pairs if p.name in entries})
    report.add_mismatches(
        "checkpoint tensors",
        bad,
        compared,
        "checkpoint tensors differ",
        f"{compared} tensors equal ORIGINAL's in {', '.join(dtypes)}"
        + (f" ({len(rounded)} rounded from ORIGINAL's dtype, nearest even)" if rounded else " (bit for bit)"),
        sep="; ",
    )
    return rounded


def _logits(
    report: VerifyReport, options: VerifyOptions, reference: np.ndarray, back: np.ndarray, rounded: bool
) -> None:
    bound = options.checkpoint_tolerance
    if back.shape != reference.shape:
        shapes = f"re-import {list(back.shape)}, ORIGINAL {list(reference.shape)}"
        report.add("logits vs source", False, shapes)
        return
    error = max_abs_relative_error(back, reference)
    against = "ORIGINAL with its weights rounded as the checkpoint's" if rounded else "ORIGINAL"
    report.add(
        "logits vs source",
        error <= bound,
        f"re-import (export_model.py --hf, float32) against {against}: max-abs relative error {error:.3g} "
        f"(<= {bound:g}) on {reference.shape[-2]} tokens",
        max_abs_rel_error=error,
        tolerance=bound,
    )
