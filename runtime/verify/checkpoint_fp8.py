"""FP8 Nemotron-NAS checkpoints (export_checkpoint.py --fp8, exporters/nas/fp8.py), in ModelOpt's two forms:

- per-channel (`FP8_PER_CHANNEL_PER_TOKEN`, the default): ORIGINAL is the FP8 ONNX of the graph they were
  exported from (build_engines.py --fp8: passes.quant.fp8, whose per-channel float8 weights and scales the
  export writes to the bit). Every float8 weight ([out, in]) equals ORIGINAL's `<tensor>_fp8` ([in, out]),
  its `weight_scale` ORIGINAL's `<tensor>_fp8_scale`.
- per-tensor (`FP8`, static activation scales): ORIGINAL is the float graph they were exported from (their
  weights were quantized from its weights, one scale per tensor, which no FP8 ONNX holds). Every float8
  weight equals Q(ORIGINAL's weight, amax / 448 of the whole tensor) and its `weight_scale` that scale, bit
  for bit, as the exporter computes them; the `input_scale`s come from a calibration file (not checked, as
  the FP8 graph check leaves the activation scales).

In both, every float tensor (norms, embeddings, lm_head) equals ORIGINAL's rounded to the checkpoint's dtype,
bit for bit, and config.json's layer count and plan are ORIGINAL's (the "block table" check).

Logits: the checkpoint is re-imported as the float checkpoints are (exporters.hf, float32), from a float32
copy with every float8 weight dequantized (float8 value x weight_scale in float32, what DequantizeLinear
computes), and compared with ORIGINAL made to hold exactly those weights: the FP8 ONNX without its activation
QuantizeLinear/DequantizeLinear pairs (per-channel), or the float graph with each quantized weight replaced by
its dequantized Q (per-tensor), float tensors rounded as the checkpoint holds them. Bound: max-abs relative
<= `checkpoint_tolerance` (1e-5): both sides then compute with the same float32 weights, so only the order of
float32 sums differs; the tensor check proved the quantization itself, and what is left to check is that
config.json makes the same model of those tensors. Activation quantization is left out of the bound on
purpose: the per-channel form quantizes activations per token at run time (engines), which the ONNX's static
per-tensor activation scales do not model. Reported, not bounded: the re-import against the FP8 ONNX as it
runs (activations quantized), or against the unquantized float graph (per-tensor).

ORIGINAL's tensor for a checkpoint tensor comes by name (an FP8 graph has no block walk): layer i's tensors
from its first source layer, a fused layer's FFN from the fusion's `ffn_fusion.<first>_<last>.*` weights,
its norm from the group's last member (plan norm "last") or all ones ("fold").

Memory: one tensor (a band of rows of it for float8 weights) at a time for the tensor checks and the
dequantized copy; the re-import's and a float reference's logits run block by block above
block_runner.STREAMING_BYTES (common.logits); the per-channel reference is the FP8 ONNX with its weights'
DequantizeLinear folded into float initializers (written band by band; passes/quant/dequantize.py), a float
graph that streams too, and ORIGINAL as it runs streams by its blocks (runtime/verify/fp8.py). Disk: the
dequantized copy, its re-import and the reference, float32, in the system's temporary folder.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx_ir as ir

from exporters.hf.checkpoint import export_hf
from exporters.hf.safetensors_in import TensorEntry, numpy_dtype, open_checkpoint
from exporters.nas.safetensors_out import OutTensor, band_rows, copied, write_bands, write_checkpoint
from passes.error_measures import l2_relative_error, max_abs_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, save_model, weight_bytes
from passes.metadata import PLAN_METADATA_KEY
from passes.model_map import find_blocks
from passes.patterns.linear import FloatWeight, find_linears
from passes.quant.calibrate import FP8_MAX
from passes.quant.dequantize import FoldWeightDequantization, StripActivationQuantization
from passes.quant.fp8 import BandedTensor, weight_bands
from passes.run import block_runner
from passes.validate import default_tokens
from runtime.verify.common import logits, metadata_json, round_through
from runtime.verify.fp8 import is_fp8, streamed_logits
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport

PER_CHANNEL = "FP8_PER_CHANNEL_PER_TOKEN"
PER_TENSOR = "FP8"
FLOAT8 = "F8_E4M3"
SCALES = ("weight_scale", "input_scale")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED_FFN = re.compile(r"^mlp\.(gate|up|down)_proj\.weight$")


def verify_fp8_checkpoint(
    report: VerifyReport, config: dict, source_layers: list[list[int]], options: VerifyOptions
) -> None:
    folder, original = report.artifact, report.original
    quant = json.loads((folder / "hf_quant_config.json").read_text(encoding="utf-8")).get("quantization", {})
    algo = quant.get("quant_algo")
    if algo not in (PER_CHANNEL, PER_TENSOR):
        raise UserError(
            f"{folder} is an FP8 checkpoint in ModelOpt's {algo!r} form: only {PER_CHANNEL} and {PER_TENSOR} "
            "checkpoints (export_checkpoint.py --fp8 per-channel / per-tensor) are verified"
        )
    per_tensor = algo == PER_TENSOR
    model = load_model(original)
    if per_tensor and is_fp8(model):
        raise UserError(
            f"{folder} is a per-tensor FP8 checkpoint: verify it against the float graph it was exported "
            f"from, not {original}, whose float8 weights are quantized per channel (not the checkpoint's)"
        )
    if not per_tensor and not is_fp8(model):
        raise UserError(
            f"{folder} is an FP8 checkpoint: verify it against the FP8 ONNX of the graph it was exported "
            f"from (build_engines.py --fp8), not {original}, which has no float8 weights"
        )
    plan = config["ffn_fusion"].get("plan") or {}
    if not _block_table(report, config, source_layers, plan):
        return
    initializers = model.graph.initializers
    linears = {lin.weight.value.name: lin.weight for lin in find_linears(model.graph)} if per_tensor else {}
    entries = open_checkpoint(folder).tensors
    bad, compared, quantized, dtypes = [], 0, 0, set()
    rounded: dict[str, np.dtype] = {}  # ORIGINAL's float tensors the checkpoint holds rounded
    scales: dict[str, np.ndarray] = {}  # per-tensor: ORIGINAL's quantized weight -> its scale
    for name, entry in entries.items():
        if name.endswith(SCALES):
            continue  # compared with their weight
        compared += 1
        source = _source_name(name, source_layers, plan.get("norm"))
        if entry.dtype == FLOAT8:
            quantized += 1
            scale = entries.get(f"{name}_scale")
            if per_tensor:
                problem = _float8_per_tensor(name, entry, scale, source, linears, scales)
            else:
                problem = _float8(name, entry, scale, source, initializers)
        else:
            dtypes.add(entry.numpy_name)
            problem = _float(name, entry, source, initializers, rounded)
        if problem is not None:
            bad.append(problem)
    form = "per tensor" if per_tensor else "per channel"
    report.notes.append(
        f"FP8 checkpoint ({algo}, weights quantized {form}): tensors compared bit for bit with "
        f"{'the float graph' if per_tensor else 'the FP8 ONNX'}, then re-imported, weights dequantized"
        + ("; input_scale comes from calibration (not checked)" if per_tensor else "")
    )
    report.add_mismatches(
        "checkpoint tensors",
        bad,
        compared,
        "checkpoint tensors differ",
        f"{compared} tensors equal ORIGINAL's bit for bit: {quantized} float8 weights with their scales "
        f"({'Q per tensor of ORIGINAL' if per_tensor else 'ORIGINAL'}'s), {compared - quantized} in "
        f"{', '.join(sorted(dtypes)) or 'no float dtype'}",
        sep="; ",
    )
    if bad:  # the re-import would read what the tensor check already failed: nothing more to learn
        return
    del model
    _logits(report, options, config, entries, per_tensor, rounded, scales)


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


def _raw(entry: TensorEntry, dtype: np.dtype, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor's stored values (rows start:stop of a matrix), as `dtype`."""
    shape = entry.shape
    start, length = entry.start, entry.end - entry.start
    if rows is not None:
        row_bytes = (entry.end - entry.start) // shape[0]
        start, length, shape = start + rows[0] * row_bytes, (rows[1] - rows[0]) * row_bytes, (
            rows[1] - rows[0], *shape[1:])
    with open(entry.file, "rb") as f:
        f.seek(start)
        return np.frombuffer(f.read(length), dtype=dtype).reshape(shape)


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


def tensor_scale(weight: FloatWeight) -> np.float32:
    """amax / 448 of the whole weight in float32 (1 for an all-zero one): exporters/nas/fp8.py's rule."""
    amax = max(float(np.abs(band).max()) for band in weight_bands(weight.tensor, weight.transpose))
    scale = np.float32(np.float32(amax) / np.float32(FP8_MAX))
    return np.float32(scale if scale > 0 and np.isfinite(scale) else 1.0)


def _float8_per_tensor(
    name: str,
    entry: TensorEntry,
    scale: TensorEntry | None,
    source: str | None,
    linears: dict[str, FloatWeight],
    scales: dict[str, np.ndarray],
) -> str | None:
    """Q(ORIGINAL's weight, its tensor scale) against the stored float8 [out, in], band by band."""
    weight = linears.get(source) if source is not None else None
    if weight is None or scale is None:
        return f"{name!r} (no linear weight {source!r} in ORIGINAL, or no weight_scale here)"
    expected = tensor_scale(weight)
    recorded = _raw(scale, np.dtype(np.float32)).reshape(-1)
    if recorded.size != 1 or recorded.view("u4")[0] != np.array(expected).view("u4"):
        return f"{name!r}_scale ({recorded.tolist()}, amax / 448 of ORIGINAL's {source!r} is {expected:.6g})"
    scales[source] = expected
    rows, cols = (int(d) for d in weight.tensor.shape)
    seen = [cols, rows] if weight.transpose else [rows, cols]  # [in, out], as the MatMul sees it
    stored = _raw(entry, np.dtype(np.uint8)).T  # the checkpoint's [out, in] as [in, out]
    if list(stored.shape) != seen:
        return f"{name!r} (shape {list(entry.shape)}, ORIGINAL's {source!r} [out, in] {seen[::-1]})"
    rows, bad = 0, 0
    for band in weight_bands(weight.tensor, weight.transpose):  # rows of the [in, out] matrix
        want = np.clip(band / expected, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        bad += int(np.count_nonzero(want != stored[rows : rows + len(band)]))
        rows += len(band)
    if bad:
        return f"{name!r} ({bad} of {stored.size} float8 values differ from Q({source!r}, per tensor))"
    return None


def _float(
    name: str, entry: TensorEntry, source: str | None, initializers, rounded: dict[str, np.dtype]
) -> str | None:
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
    if source is not None and not np.array_equal(theirs.astype(np.float32), wide):
        rounded[source] = dtype
    return None


def _dequantized(entry: TensorEntry, scale: TensorEntry) -> OutTensor:
    """The float8 [out, in] weight times its weight_scale ([out, 1] or one value), float32, band by band."""
    factor = _raw(scale, np.dtype(np.float32)).reshape(-1, 1)

    def write(fd: int, offset: int) -> int:
        step = band_rows(entry.shape[1])

        def bands():
            for first in range(0, entry.shape[0], step):
                stop = min(first + step, entry.shape[0])
                q = _raw(entry, np.dtype(ml_dtypes.float8_e4m3fn), (first, stop)).astype(np.float32)
                yield q * (factor if factor.size == 1 else factor[first:stop])

        return write_bands(fd, offset, bands())

    return OutTensor(entry.name, "float32", entry.shape, write)


def dequantized_copy(folder: Path, config: dict, entries: dict[str, TensorEntry], target: Path) -> Path:
    """A float32-weight copy of the FP8 checkpoint in `target`, as exporters.hf reads one: every float8 weight
    dequantized (float8 x weight_scale, float32), the scales dropped, every other tensor copied as it is, and
    config.json without its quantization."""
    target.mkdir(parents=True)
    tensors = []
    for name, entry in entries.items():
        if name.endswith(SCALES):
            continue
        if entry.dtype == FLOAT8:
            tensors.append(_dequantized(entry, entries[f"{name}_scale"]))
        else:
            length = entry.end - entry.start
            tensors.append(copied(name, entry.numpy_name, entry.shape, str(entry.file), entry.start, length))
    write_checkpoint(target, tensors)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    (target / "config.json").write_text(json.dumps(plain, indent=2) + "\n", encoding="utf-8")
    return target


def _quantized(tensor: ir.TensorProtocol, scale: np.float32) -> ir.LazyTensor:
    """`tensor` replaced by its dequantized per-tensor Q: Q(w, scale) x scale, in its dtype, band by band."""

    def bands() -> Iterator[np.ndarray]:
        for band in weight_bands(tensor, False, stored=True):
            q = np.clip(band / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            yield (q * scale).astype(tensor.dtype.numpy())

    return BandedTensor(tensor.name, tensor.dtype, tensor.shape, bands)


def _reference_and_as_run(
    report: VerifyReport, reference: Path, tokens: np.ndarray, per_tensor: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The float reference's logits, and ORIGINAL's as it runs (reported, not bounded). An FP8 ORIGINAL above
    STREAMING_BYTES of weights is cut by its float reference's blocks (the same stream names:
    runtime/verify/fp8.py's streamed check), which runs the reference in the same pass."""
    if not per_tensor and weight_bytes(load_model(report.original)) > block_runner.STREAMING_BYTES:
        sub = VerifyReport("fp8", reference, report.original)
        streamed = streamed_logits(sub, find_blocks(load_model(reference)), tokens)
        report.notes.extend(f"ORIGINAL as it runs: {note}" for note in sub.notes)
        if streamed is not None:
            return streamed
    return logits(reference, tokens), logits(report.original, tokens)


def _logits(
    report: VerifyReport,
    options: VerifyOptions,
    config: dict,
    entries: dict[str, TensorEntry],
    per_tensor: bool,
    rounded: dict[str, np.dtype],
    scales: dict[str, np.float32],
) -> None:
    """The "logits vs source" check (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="ffn_fusion_verify.") as tmp:
        plain = dequantized_copy(report.artifact, config, entries, Path(tmp) / "dequantized")
        back = Path(tmp) / "reimport" / "model.onnx"
        export_hf(plain, back, dtype="float32")
        # the seeded prompt of every logits check, sized by the re-import (an FP8 graph has no block walk)
        tokens = default_tokens(find_blocks(load_model(back)), back, options.seq)
        reference = load_model(report.original)
        initializers = reference.graph.initializers
        for name, dtype in rounded.items():
            initializers[name].const_value = round_through(initializers[name].const_value, dtype)
        if per_tensor:
            for name, scale in scales.items():
                initializers[name].const_value = _quantized(initializers[name].const_value, scale)
            what = "ORIGINAL with its weights quantized per tensor as the checkpoint's"
        else:
            strip = StripActivationQuantization()
            # then a float graph holding the FP8 weights: its logits stream like any other's
            ir.passes.PassManager([strip, FoldWeightDequantization()])(reference)
            what = f"ORIGINAL without its {strip.removed} activation quantizations"
        if rounded:
            what += f", {len(rounded)} float tensors rounded as the checkpoint's"
        reference_path = Path(tmp) / "reference" / "model.onnx"
        reference_path.parent.mkdir()
        save_model(reference, reference_path, external=True)
        del reference
        ours = logits(back, tokens)
        theirs, as_run = _reference_and_as_run(report, reference_path, tokens, per_tensor)
    bound = options.checkpoint_tolerance
    if ours.shape != theirs.shape:
        report.add("logits vs source", False, f"re-import {list(ours.shape)}, ORIGINAL {list(theirs.shape)}")
        return
    error = max_abs_relative_error(ours, theirs)
    drift = l2_relative_error(ours, as_run)
    if per_tensor:
        against = "the float graph (weights unquantized)"
    else:
        against = "the FP8 ONNX as it runs (activations quantized)"
    report.notes.append(f"re-import vs {against}: relative L2 error {drift:.4g} (reported, not bounded)")
    report.add(
        "logits vs source",
        error <= bound,
        f"re-import (float8 weights dequantized, export_model.py --hf, float32) against {what}: max-abs "
        f"relative error {error:.3g} (<= {bound:g}) on {theirs.shape[-2]} tokens",
        max_abs_rel_error=error,
        tolerance=bound,
        rel_error_as_run=drift,
    )
