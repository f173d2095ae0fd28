"""FP8 graphs (passes/quant/fp8.py): every float8 weight equals Q(source weight) with its recorded scale,
every recorded weight scale equals amax / 448 of its source's output channel, every other weight equals the
source's, and the logits are within `max_error` of the source's. The weights are compared band by band as
the pass wrote them, so memory stays near one band of rows. Above block_runner.STREAMING_BYTES of weights both
graphs' logits run block by block (streamed_logits), the FP8 graph cut between its source's stream names, and
a block above LARGE_FFN_BYTES of FFN weights (a fused group's) from its rows on both sides: the FP8 graph's
by passes/reference.py on FP8Weights that model its Q/DQ (_fp8_from_rows; the records of
passes/patterns/fp8.py, which recognizes the pass's form). Graph work is the passes'; this module compares."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from passes.blocks import Block
from passes.error_measures import cosine, l2_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, load_proto, weight_bytes
from passes.matching import NoMatch, graph_values, strip_cast
from passes.model_map import find_blocks
from passes.patterns.fp8 import match_fp8_swiglu, quantized_weights
from passes.patterns.linear import FloatWeight, find_linears

# The pass's own band reader, scale rule, rounding and naming: the check recomputes exactly what it wrote.
from passes.quant.fp8 import channel_scales, source_weight_name, to_fp8, weight_bands
from passes.reference import ffn, ffn_weight_bytes, rms_normalize
from passes.run import block_runner
from passes.run.block_runner import BlockRunner
from passes.validate import default_tokens
from runtime.verify.common import half_view, has_half_input, logits, same_initializers
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport

FP8 = ir.DataType.FLOAT8E4M3FN


def is_fp8(model: ir.Model) -> bool:
    return any(v.dtype == FP8 for v in model.graph.initializers.values())


def verify_fp8(report: VerifyReport, options: VerifyOptions) -> None:
    source, artifact = load_model(report.original), load_model(report.artifact)
    weights = {lin.weight.value.name: lin.weight for lin in find_linears(source.graph)}
    quantized = quantized_weights(artifact.graph)
    scale_bad, weight_bad, unknown = [], [], []
    for q, scale in quantized:
        weight = weights.get(source_weight_name(q.name))
        if weight is None or scale.const_value is None:
            unknown.append(q.name)
            continue
        problem = _check_scale(weight, scale)
        if problem is not None:
            scale_bad.append(problem)
        problem = _check_weight(weight, q, scale)
        if problem is not None:
            weight_bad.append(problem)
    report.notes.append(
        f"{len(quantized)} float8 weights; activation scales come from calibration (not checked)"
    )
    if unknown:
        report.add_mismatches(
            "source weights",
            [repr(n) for n in unknown],
            len(quantized),
            f"float8 tensors have no source weight in {report.original}",
            "",
        )
    report.add_mismatches(
        "weight scales",
        scale_bad,
        len(quantized),
        "scales differ",
        f"{len(quantized)} scales equal amax / 448 per output channel",
        sep="; ",
    )
    report.add_mismatches(
        "float8 weights",
        weight_bad,
        len(quantized),
        "float8 weights differ",
        f"{len(quantized)} weights equal Q(source, recorded scale)",
        sep="; ",
    )
    rewritten = {q.name for q, _ in quantized} | {s.name for _, s in quantized}
    same_initializers(report, source, artifact, rewritten, "unquantized weights")
    blocks = find_blocks(source)
    tokens = default_tokens(blocks, report.original, options.seq)
    stream = max(weight_bytes(source), weight_bytes(artifact)) > block_runner.STREAMING_BYTES
    del source, artifact
    streamed = streamed_logits(report, blocks, tokens) if stream else None
    if streamed is None:
        reference, fp8 = logits(report.original, tokens), logits(report.artifact, tokens)
    else:
        reference, fp8 = streamed
    how = "" if streamed is None else "; block by block"
    error = l2_relative_error(fp8, reference)
    report.add(
        "logits vs source",
        error <= options.max_error,
        f"relative error {error:.4g} (<= {options.max_error:g}), cosine {cosine(fp8, reference):.6f}{how}",
        rel_error=error,
        max_error=options.max_error,
    )


def streamed_logits(
    report: VerifyReport, blocks: list[Block], tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """(source logits, FP8 logits), both graphs run block by block (BlockRunner streaming: one block's weights
    in memory at a time). The block walk does not read an FP8 graph, but the FP8 pass renames no stream: its
    blocks are cut between the source's stream names (a parallel group of a parallel-block source as one cut,
    its members' weights together: BlockRunner whole_groups). None (the check then runs whole; a note says
    why) when the FP8 graph lacks one of those names or cannot be cut by them, or a graph has a
    half-precision input (common.logits). Half graphs run each block in its
    float32 view, as whole. A block whose source FFN holds more than LARGE_FFN_BYTES (a fused group's) runs
    from its rows on both sides: the source's by passes/reference.py, the FP8 graph's FFN by the same
    row-block reference modelling its Q/DQ (_fp8_from_rows; its attention part still runs in ONNX Runtime),
    so that no float8 matrix is dequantized whole. Where that block's FP8 structure is not the pass's, the
    block is loaded whole (a note says so)."""
    protos = [load_proto(p) for p in (report.original, report.artifact)]
    views = [half_view(p, proto) for p, proto in zip((report.original, report.artifact), protos, strict=True)]
    if any(has_half_input(proto) for proto in protos):
        report.notes.append("a half-precision graph input: the logits check runs whole (not block by block)")
        return None
    produced = {v.name for v in protos[1].graph.input} | {o for n in protos[1].graph.node for o in n.output}
    del protos
    source = BlockRunner(  # a parallel group of a parallel-block source: one cut, on both sides
        report.original, streaming=True, large_ffn_bytes=block_runner.LARGE_FFN_BYTES, view=views[0],
        whole_groups=True,
    )
    names = [c.input_name for c in source.cuts] + [source.cuts[-1].output_name]
    missing = [n for n in names if n not in produced]
    if missing:
        source.close()
        report.notes.append(
            f"the FP8 graph has no stream {missing[0]!r} of the source: the logits check runs whole"
        )
        return None
    from_rows = _fp8_from_rows(report, source.blocks)
    try:
        fp8 = BlockRunner(
            report.artifact, streaming=True, blocks=source.blocks, view=views[1], from_rows=from_rows,
            whole_groups=True,
        )
    except UserError as exc:
        source.close()
        cut = f"the FP8 graph cannot be cut by its source's blocks ({exc}): the logits check runs whole"
        report.notes.append(cut)
        return None
    source.capture(tokens)
    reference = source.logits
    source.close()
    fp8.capture(tokens)
    quantized = fp8.logits
    fp8.close()
    assert reference is not None and quantized is not None  # a full capture keeps the logits
    return reference, quantized


RowBlock = Callable[[np.ndarray], np.ndarray]  # a block's output from the stream after its attention part


def _fp8_from_rows(report: VerifyReport, blocks: list[Block]) -> dict[int, RowBlock]:
    """For each block (by position) whose source FFN holds more than LARGE_FFN_BYTES: its FP8 graph's output
    from the stream after its attention part, x + FFN8(rms_normalize(x) * w) in float64, the FFN read a
    row block at a time (passes/reference.ffn on FP8Weights: the pass's activation Q/DQ and dequantized
    float8 rows, scales read from the graph). A block whose FP8 form is not the pass's is left out (loaded
    whole), with a note."""
    large = [k for k, b in enumerate(blocks) if b.ffn is not None and b.parallel is None]  # a group: one cut
    large = [k for k in large if ffn_weight_bytes(blocks[k]) > block_runner.LARGE_FFN_BYTES]
    if not large:
        return {}
    graph = load_model(report.artifact).graph  # weights stay in the file: read a row block at a time
    values = {v.name: v for v in graph_values(graph)} | dict(graph.initializers)
    found, whole = {}, []
    for k in large:
        try:
            found[k] = _fp8_block(values, blocks[k])
        except NoMatch as exc:
            whole.append(f"block {blocks[k].index} ({exc})")
    if found:
        shown = ", ".join(str(blocks[k].index) for k in found)
        report.notes.append(f"the FP8 graph's FFN of block(s) {shown} runs from its rows (float64)")
    if whole:
        report.notes.append(f"not the FP8 pass's form, loaded whole in ONNX Runtime: {'; '.join(whole)}")
    return found


def _fp8_block(values: dict[str, ir.Value], block: Block) -> RowBlock:
    """The FP8 graph's block output from the stream after its attention part; NoMatch when the FP8 graph's
    FFN of `block` (the source's record, matched by its names) is not what passes/quant/fp8.py writes
    (passes/patterns/fp8.py)."""
    assert block.ffn is not None and block.norm is not None  # a SwiGLU FFN part has both
    if block.ffn_input.name not in values:
        raise NoMatch(f"no stream {block.ffn_input.name!r}")
    fp8_ffn = match_fp8_swiglu(values.get(block.ffn.output.name), block.ffn)
    weight = None
    if block.norm.weight is not None:  # the FP8 graph's own norm weight (unquantized; compared elsewhere)
        value = values.get(block.norm.weight.name)
        tensor = strip_cast(value).const_value if value is not None else None
        if tensor is None:
            raise NoMatch(f"no norm weight {block.norm.weight.name!r}")
        weight = tensor.numpy().astype(np.float64)
    eps = block.norm.eps

    def evaluate(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        z = rms_normalize(x, eps)
        return x + ffn(z if weight is None else z * weight, fp8_ffn)

    return evaluate


def _check_scale(weight: FloatWeight, scale: ir.Value) -> str | None:
    recorded = scale.const_value.numpy().astype(np.float32).reshape(-1)
    expected = channel_scales(weight.tensor, weight.transpose, weight.dtype)
    if recorded.shape != expected.shape:
        return f"{scale.name!r} has {recorded.size} channels, source {weight.value.name!r} {expected.size}"
    differ = np.flatnonzero(recorded != expected)
    if differ.size:
        c = int(differ[0])
        return (
            f"{scale.name!r} differs from amax / 448 of {weight.value.name!r} in {differ.size} channel(s) "
            f"(channel {c}: {recorded[c]:.6g}, expected {expected[c]:.6g})"
        )
    return None


def _check_weight(weight: FloatWeight, q: ir.Value, scale: ir.Value) -> str | None:
    stored = q.const_value.numpy().view(np.uint8)
    recorded = scale.const_value.numpy().astype(np.float32).reshape(-1)
    rows, bad, first = 0, 0, None
    for band in weight_bands(weight.tensor, weight.transpose):
        want = np.ascontiguousarray(to_fp8(band, recorded)).view(np.uint8)
        got = stored[rows : rows + len(band)]
        if got.shape != want.shape:
            return f"{q.name!r} has shape {list(stored.shape)}, Q({weight.value.name!r}) {list(want.shape)}"
        mismatch = np.argwhere(got != want)
        if mismatch.size and first is None:
            first = (rows + int(mismatch[0][0]), int(mismatch[0][1]))
        bad += len(mismatch)
        rows += len(band)
    if rows != len(stored):
        return f"{q.name!r} has {len(stored)} rows, Q({weight.value.name!r}) {rows}"
    if bad:
        where = f"first at row {first[0]}, column {first[1]}"
        return f"{q.name!r} differs from Q({weight.value.name!r}, {scale.name!r}) in {bad} values ({where})"
    return None
