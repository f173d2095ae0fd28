"""FP8 graphs (passes/quant/fp8.py): every float8 weight equals Q(source weight) with its recorded scale,
every recorded weight scale equals amax / 448 of its source's output channel, every other weight equals the
source's, and the logits are within `max_error` of the source's. The weights are compared band by band as
the pass wrote them, so memory stays near one band of rows. Above block_runner.STREAMING_BYTES of weights both
graphs' logits run block by block (streamed_logits), the FP8 graph cut between its source's stream names, and
a block above LARGE_FFN_BYTES of FFN weights (a fused group's) from its rows on both sides: the FP8 graph's
by passes/reference.py on FP8Weights that model its Q/DQ (_fp8_from_rows)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from passes.blocks import Block
from passes.error_measures import cosine, l2_relative_error
from passes.errors import UserError
from passes.io.model_io import load_model, load_proto, weight_bytes
from passes.matching import NoMatch, attr, graph_values, producer, strip_cast
from passes.model_map import find_blocks
from passes.patterns.linear import FloatWeight, find_linears
from passes.patterns.swiglu import SwiGLU, Weight

# The pass's own band reader, scale rule and rounding: the check recomputes exactly what it wrote.
from passes.quant.fp8 import channel_scales, to_fp8, weight_bands
from passes.reference import FP8SwiGLU, FP8Weight, ffn, ffn_weight_bytes, rms_normalize
from passes.run import block_runner
from passes.run.block_runner import BlockRunner
from passes.validate import default_tokens
from runtime.verify.common import half_view, has_half_input, logits, same_initializers
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport

FP8 = ir.DataType.FLOAT8E4M3FN


def is_fp8(model: ir.Model) -> bool:
    return any(v.dtype == FP8 for v in model.graph.initializers.values())


def _quantized_weights(model: ir.Model) -> list[tuple[ir.Value, ir.Value]]:
    """(float8 weight, its scale) of every DequantizeLinear of a float8 initializer."""
    found, seen = [], set()
    for node in model.graph:
        if node.op_type != "DequantizeLinear" or len(node.inputs) < 2:
            continue
        q, scale = node.inputs[0], node.inputs[1]
        if q is None or scale is None or q.dtype != FP8 or q.const_value is None or q.name in seen:
            continue
        seen.add(q.name)
        found.append((q, scale))
    return found


def _source_name(fp8_name: str) -> str:
    """The pass names a weight's float8 tensor `<source>_fp8` (`_fp8_<k>` on a name clash)."""
    base, _, tail = fp8_name.rpartition("_fp8")
    return base if tail == "" or tail.lstrip("_").isdigit() else fp8_name


def verify_fp8(report: VerifyReport, options: VerifyOptions) -> None:
    source, artifact = load_model(report.original), load_model(report.artifact)
    weights = {lin.weight.value.name: lin.weight for lin in find_linears(source.graph)}
    quantized = _quantized_weights(artifact)
    scale_bad, weight_bad, unknown = [], [], []
    for q, scale in quantized:
        weight = weights.get(_source_name(q.name))
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
    FFN of `block` (the source's record, matched by its names) is not what passes/quant/fp8.py writes."""
    assert block.ffn is not None and block.norm is not None  # a SwiGLU FFN part has both
    if block.ffn_input.name not in values:
        raise NoMatch(f"no stream {block.ffn_input.name!r}")
    fp8_ffn = _fp8_swiglu(values, block.ffn)
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


def _fp8_swiglu(values: dict[str, ir.Value], swiglu: SwiGLU) -> FP8SwiGLU:
    """down(silu(z @ gate) * (z @ up)) of the FP8 graph, each MatMul reading DQ(Q(x)) and DQ(W8) with W8
    `<source>_fp8`, z the source's normalized stream; NoMatch naming what differs."""
    hidden, down = _projection("down projection", values.get(swiglu.output.name), swiglu.down)
    mul = producer(hidden, "Mul")
    for i in (0, 1):
        gate_out, up_out = mul.inputs[i], mul.inputs[1 - i]
        silu = gate_out.producer() if gate_out is not None else None
        if silu is None or silu.op_type != "Mul":
            continue
        g = next((v for j, v in enumerate(silu.inputs) if _is_sigmoid_of(silu.inputs[1 - j], v)), None)
        if g is not None:
            break
    else:
        raise NoMatch("no silu(gate) * up before the down projection")
    z, gate = _projection("gate projection", g, swiglu.gate)
    z_up, up = _projection("up projection", up_out, swiglu.up)
    if z is not z_up or z.name != swiglu.input.name:
        raise NoMatch(f"gate and up do not both quantize the normalized stream {swiglu.input.name!r}")
    return FP8SwiGLU(gate, up, down)


def _is_sigmoid_of(value: ir.Value | None, x: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    return node is not None and node.op_type == "Sigmoid" and x is not None and node.inputs[0] is x


def _projection(role: str, value: ir.Value | None, weight: Weight) -> tuple[ir.Value, FP8Weight]:
    """The MatMul behind `value` (a gate or up half: through the unchanged Split/Slice of a gate_up weight)
    as _quantized reads it; NoMatch saying which `role` differs and how."""
    try:
        if weight.columns is not None:
            value = producer(value, "Split", "Slice").inputs[0]
        return _quantized(producer(value, "MatMul"), weight)
    except NoMatch as exc:
        raise NoMatch(f"{role}: {exc}") from None


def _quantized(matmul: ir.Node, source: Weight) -> tuple[ir.Value, FP8Weight]:
    """(x, the FP8Weight) of MatMul(DQ(Q(x)), DQ(W8, scale)) as the pass writes it, W8 quantized from
    `source`: a per-tensor float8 activation Q/DQ (one scale, zero point 0, saturating) and W8 a float8
    [in, out] initializer with per-output-channel (axis 1) or per-tensor scales."""
    a, b = matmul.inputs[0], matmul.inputs[1]
    dq = producer(a, "DequantizeLinear")
    q = producer(dq.inputs[0], "QuantizeLinear")
    act_scale, dq_scale = (_constant(n.inputs[1] if len(n.inputs) > 1 else None) for n in (q, dq))
    if act_scale is None or act_scale.size != 1 or dq_scale is None or dq_scale.size != 1:
        raise NoMatch("its input's Q/DQ has no constant per-tensor scale")
    if act_scale.item() != dq_scale.item() or not (_fp8_zero(q) and _fp8_zero(dq)):
        raise NoMatch("its input's Q/DQ is not one float8 pair (same scale, zero point 0)")
    if int(attr(q, "saturate", 1)) != 1:
        raise NoMatch("its input's QuantizeLinear does not saturate")
    wdq = producer(b, "DequantizeLinear")
    w8 = wdq.inputs[0]
    if w8 is None or w8.dtype != FP8 or w8.const_value is None or len(w8.const_value.shape) != 2:
        raise NoMatch("its weight is not a 2-D float8 initializer")
    if _source_name(w8.name) != source.source.name:
        raise NoMatch(f"it reads {w8.name!r}, not the float8 form of {source.source.name!r}")
    stored = tuple(int(d) for d in source.source.const_value.shape)
    if tuple(int(d) for d in w8.const_value.shape) != (stored[::-1] if source.transposed else stored):
        raise NoMatch(f"{w8.name!r} has another shape than {source.source.name!r}")
    scale = _constant(wdq.inputs[1] if len(wdq.inputs) > 1 else None)
    per_channel = scale is not None and scale.size == int(w8.const_value.shape[1]) and scale.ndim == 1
    if scale is None or not (scale.size == 1 or (per_channel and int(attr(wdq, "axis", 1)) == 1)):
        raise NoMatch(f"{w8.name!r}: its scale is neither per output channel (axis 1) nor per tensor")
    if len(wdq.inputs) > 2 and wdq.inputs[2] is not None and not _fp8_zero(wdq):
        raise NoMatch(f"{w8.name!r}: a zero point other than 0")
    weight = Weight(w8, transposed=False, columns=source.columns)
    return q.inputs[0], FP8Weight(weight, scale.astype(np.float64).reshape(-1), float(act_scale.item()))


def _constant(value: ir.Value | None) -> np.ndarray | None:
    return value.const_value.numpy() if value is not None and value.const_value is not None else None


def _fp8_zero(node: ir.Node) -> bool:
    """A Q/DQ node's zero point is a float8e4m3fn zero (the pass writes one: it also types Q's output)."""
    zero = node.inputs[2] if len(node.inputs) > 2 else None
    return (
        zero is not None
        and zero.dtype == FP8
        and zero.const_value is not None
        and not np.any(zero.const_value.numpy().astype(np.float32))
    )


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
