"""Checks of a fused model by numbers: against the original, and against the parallel-sum reference.

- structure: onnx.checker and shape inference (the path-based forms, which work above 2 GB);
- end to end: ONNX Runtime runs original and fused on a short input; logits relative error and cosine
  (fusion is an approximation: these are reported, not bounded);
- exactness: each fused group's output, given the input the fused model fed it, must equal the numpy
  parallel sum of the original FFNs (passes/reference.py) to `tolerance`; each full-block parallel group's
  output, run alone on the original's stream x, must equal x + sum_k (block_k(x) - x) with every original
  block run alone on x (passes/run/block_runner.py; its branches, summed in float64).
When the model is too large to run whole within the memory bound (fuse + validation at most 512 MB,
issue 13), each fused group is checked on its own subgraph with a random input instead, so memory stays
near one group's weights (and a group too large for that is evaluated over row blocks, in float64).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from passes.blocks import Block, ResidualAdd
from passes.error_measures import cosine, l2_relative_error
from passes.errors import UserError
from passes.graph_inputs import FeedError, Signature
from passes.io.model_io import load_model, load_proto, load_typed_proto, weight_bytes
from passes.io.sessions import open_session
from passes.metadata import PLAN_METADATA_KEY, recorded_plan
from passes.model_map import find_blocks, vocab_size
from passes.patterns.nbits import float_activations
from passes.plan import Plan
from passes.reference import ffn_weight_bytes, group_ffns, parallel_blocks_sum, parallel_sum
from passes.run.block_runner import STREAMING_BYTES, BlockRunner
from passes.run.cut import NameGraph, fill_stream_types, split_skip_norms, stream_names, value_types

# Above this many weight bytes the whole-model run is replaced by per-group subgraph checks. A whole-model
# run holds every weight in ONNX Runtime, on top of the ~150 MB of the fusing process: a 0.40 GB model
# peaked at 532 MB (docs/scale.md), so whole runs stop where the 512 MB bound would break.
WHOLE_MODEL_LIMIT = 256 << 20


class ValidationError(UserError):
    """The fused model does not compute what the plan says."""


@dataclass
class GroupCheck:
    group: tuple[int, int]
    rel_error: float  # ||fused - reference|| / ||reference - input||: error relative to the FFN sum
    kind: str = "ffn"  # "ffn" (an FFN group) or "parallel" (a full-block parallel group)


@dataclass
class ValidationReport:
    mode: str  # "whole model" or "per group"
    groups: list[GroupCheck] = field(default_factory=list)
    logits_rel_error: float | None = None
    logits_cosine: float | None = None
    tolerance: float = 1e-5
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(g.rel_error <= self.tolerance for g in self.groups)

    def lines(self) -> list[str]:
        out = list(self.notes)
        if self.logits_rel_error is not None:
            out.append(
                f"logits vs original: relative error {self.logits_rel_error:.4g}, "
                f"cosine {self.logits_cosine:.6f}"
            )
        for g in self.groups:
            verdict = "ok" if g.rel_error <= self.tolerance else "MISMATCH"
            what = "parallel group" if g.kind == "parallel" else "group"
            reference = "block-sum" if g.kind == "parallel" else "parallel-sum"
            out.append(
                f"{what} {list(g.group)} vs {reference} reference ({self.mode}): "
                f"relative error {g.rel_error:.3g} (<= {self.tolerance:g}) {verdict}"
            )
        return out


def check_structure(path: Path) -> list[str]:
    """onnx.checker and strict shape inference, by path so that models above 2 GB work.

    Contrib ops (ONNX Runtime's SimplifiedLayerNormalization and friends) have no ONNX schema: the
    checker cannot judge those graphs, so it is skipped for them, with a note; ONNX Runtime still runs them.
    """
    proto = load_proto(path)
    unknown = sorted({n.op_type for n in proto.graph.node if not onnx.defs.has(n.op_type, n.domain)})
    if unknown:
        return [f"onnx.checker skipped: contrib ops {', '.join(unknown)} have no ONNX schema"]
    try:
        onnx.checker.check_model(str(path))
        with tempfile.TemporaryDirectory() as tmp:
            onnx.shape_inference.infer_shapes_path(
                str(path), str(Path(tmp) / "inferred.onnx"), strict_mode=True
            )
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ValidationError(f"{path} fails the ONNX checker: {str(exc).splitlines()[0]}") from None
    return ["onnx.checker and strict shape inference: ok"]


def plan_from_metadata(path: Path) -> Plan:
    """The plan `path` records (passes.metadata.recorded_plan); a UserError when it records none."""
    plan = recorded_plan({p.key: p.value for p in load_proto(path).metadata_props}, source=str(path))
    if plan is None:
        raise UserError(f"{path} has no {PLAN_METADATA_KEY} metadata: it was not written by fuse_onnx.py")
    return plan


def validate(
    original: Path,
    fused: Path,
    plan: Plan,
    tokens: np.ndarray | None = None,
    tolerance: float | None = None,
    *,
    original_blocks: list[Block] | None = None,
    fused_blocks: list[Block] | None = None,
) -> ValidationReport:
    """`fused` (written from `original` with `plan`) against the original and the parallel-sum reference.
    `original_blocks` / `fused_blocks`: the block tables when the caller has walked the models already
    (passes/pipeline.py), so that no stream is walked twice (plans of FFN groups only: a parallel plan's
    check follows the original's residual adds in the file); else each file is walked here."""
    if plan.parallel:
        return _validate_parallel_plan(original, fused, plan, tokens, tolerance)
    notes = check_structure(fused)
    if original_blocks is None:
        original_blocks = find_blocks(load_model(original))
    fused_model = load_model(fused)
    if fused_blocks is None:
        fused_blocks = find_blocks(fused_model)
    expected = len(original_blocks) - plan.removed_blocks
    if len(fused_blocks) != expected:
        raise ValidationError(f"fused model has {len(fused_blocks)} blocks, the plan gives {expected}")
    # Each group's SwiGLU blocks (FFN-free blocks inside a group fuse nothing) and its fused block's place.
    pairs = [(g, group_ffns(original_blocks, g), _fused_index(plan, g)) for g in plan.groups]
    tolerance = tolerance if tolerance is not None else exactness_tolerance(original_blocks)
    for (first, last), group, k in pairs:
        if (width := fused_blocks[k].width) != sum(b.width for b in group):
            raise ValidationError(f"fused block for group [{first}, {last}] has width {width}")
    proto = load_proto(fused)
    # Each block's output stream, as the block-by-block runner cuts them (passes/run/cut.py): a last
    # block whose sum the final Skip*Normalization keeps internal (output 3 unnamed) gets it named in `proto`.
    ends = [end for _, end in stream_names(proto, fused_blocks)]
    checks = [(g, group, fused_blocks[k], ends[k]) for g, group, k in pairs]
    if weight_bytes(fused_model) > WHOLE_MODEL_LIMIT:
        report = ValidationReport("per group")
        # A group's FFN starting at a Skip*Normalization's sum gets its own norm of the sum (as the runner
        # cuts blocks): otherwise its subgraph would reach back through the node into the whole prefix.
        split_skip_norms(proto, [block.ffn_input.name for _, _, block, _ in checks])
        report.groups = [_check_group_alone(proto, fused, *check, plan.norm) for check in checks]
    else:
        report = _check_whole_model(original, fused, proto, checks, plan.norm, tokens, original_blocks)
    report.tolerance, report.notes = tolerance, notes
    return report


def exactness_tolerance(blocks: list[Block]) -> float:
    """1e-5 for fp32 weights. Half-precision weights are rounded once more when fused ("fold" scales
    their rows), so the bound there is two units in the last place of the weight dtype."""
    dtype = next((b.dtype for b in blocks if b.dtype is not None), None)
    ulp = {"FLOAT16": 2.0**-10, "BFLOAT16": 2.0**-7}.get(dtype.name if dtype is not None else "", 0.0)
    return max(1e-5, 2 * ulp)


def _fused_index(plan: Plan, group: tuple[int, int]) -> int:
    return group[0] - sum(j - i for i, j in plan.groups if j < group[0])


def default_tokens(blocks: list[Block], model: Path, length: int = 16) -> np.ndarray:
    """Seeded token ids for the checks: 1 x `length`, or the batch and sequence length `model` fixes (a
    graph traced with one example declares them)."""
    ids = Signature.of(model).ids
    batch, seq = (ids.static(0), ids.static(1)) if ids is not None else (None, None)
    shape = (batch or 1, seq or length)
    return np.random.default_rng(0).integers(0, vocab_size(blocks), size=shape, dtype=np.int64)


HALF_TYPES = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def float32_view(proto: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """The same graph computing in float32: ONNX Runtime's CPU kernels lack fp16/bf16 MatMul and Mul,
    so checks of half-precision models run in fp32 activations (weights are exact in fp32)."""
    graph = proto.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type in HALF_TYPES:
            array = onnx.numpy_helper.to_array(tensor, base_dir=str(folder)).astype(np.float32)
            graph.initializer[index].CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i in HALF_TYPES:
                attribute.i = onnx.TensorProto.FLOAT
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.tensor_type.elem_type in HALF_TYPES:
            info.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return proto


def _is_half(proto: onnx.ModelProto) -> bool:
    return any(t.data_type in HALF_TYPES for t in proto.graph.initializer)


def _session(proto: onnx.ModelProto, folder: Path) -> ort.InferenceSession:
    proto = float32_view(proto, folder) if _is_half(proto) else proto
    try:
        return open_session(proto, folder=folder, prepack=False)  # no second copy of the weights
    except Exception as exc:  # onnxruntime raises its own exception types, all plain Exceptions
        raise ValidationError(f"ONNX Runtime cannot load the model: {str(exc).splitlines()[0]}") from None


def _with_outputs(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    proto.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names
    )
    return proto


def _input_feed(proto: onnx.ModelProto, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Feeds for every graph input (passes/graph_inputs.py): the tokens, and for decode graphs an all-ones
    attention mask, positions and an empty KV cache (past length 0), so that prefill-only and decode
    exports are checked alike."""
    signature = Signature.of(proto)
    stream = None
    if signature.stream is not None and signature.ids is None:  # a pipeline stage: a seeded random stream
        hidden = signature.stream.static(-1)
        shape = tokens.shape if signature.stream.rank == 3 else tokens.shape[-1:]
        if hidden is not None:
            stream = np.random.default_rng(0).standard_normal((*shape, hidden)).astype(np.float32)
    try:
        return signature.feeds(tokens, stream=stream)
    except FeedError as exc:
        raise ValidationError(f"validation {exc}; use --no-validate") from None


def _run(proto: onnx.ModelProto, folder: Path, tokens: np.ndarray) -> list[np.ndarray]:
    """One ONNX Runtime run; the session (and its copy of the weights) is freed on return."""
    return _session(proto, folder).run(None, _input_feed(proto, tokens))


def _check_whole_model(original, fused, proto, checks, mode, tokens, original_blocks) -> ValidationReport:
    tokens = default_tokens(original_blocks, original) if tokens is None else tokens
    reference_logits = _run(load_proto(original), original.parent, tokens)[0]
    names = [n for _, _, block, end in checks for n in (block.ffn_input.name, end)]
    outputs = _run(_with_outputs(proto, names), fused.parent, tokens)
    logits, streams = outputs[0], outputs[len(outputs) - len(names) :]
    report = ValidationReport("whole model")
    report.logits_rel_error, report.logits_cosine = (
        l2_relative_error(logits, reference_logits),
        cosine(logits, reference_logits),
    )
    for index, (group_range, group, _, _) in enumerate(checks):
        x, y = streams[2 * index], streams[2 * index + 1]
        report.groups.append(GroupCheck(group_range, contribution_error(x, y, parallel_sum(x, group, mode))))
    return report


# A fused group whose weights fit this runs in ONNX Runtime on its own subgraph. A larger one (ONNX Runtime
# would hold all its weights) is evaluated as the recognizer reads the fused block, by the streamed float64
# evaluation of passes/reference.py over row blocks of the fused file: memory stays bounded whatever the
# group size, and the fused weights are still checked against the original ones.
SUBGRAPH_WEIGHT_LIMIT = 128 << 20


def _check_group_alone(
    proto: onnx.ModelProto, fused: Path, group_range, group: list[Block], block: Block, end: str, mode: str
) -> GroupCheck:
    """The fused group alone on a random stream, against the reference from the original weights. `proto`
    is the fused model's (external data on disk), `end` the name of the block's output stream in it."""
    hidden = group[0].ffn.gate.shape[0]
    rank = block.ffn_input.shape.rank() if block.ffn_input.shape is not None else 3
    x = np.random.default_rng(0).standard_normal((1, 8, hidden)[3 - rank :]).astype(np.float32)
    if ffn_weight_bytes(block) <= SUBGRAPH_WEIGHT_LIMIT:
        x_name = block.ffn_input.name
        sub = _subgraph(proto, x_name, end, rank)
        (y,) = _session(sub, fused.parent).run(None, {x_name: x})
    else:
        y = parallel_sum(x, [block], "last")  # the fused block itself: its own norm weight, if any
    return GroupCheck(group_range, contribution_error(x, y, parallel_sum(x, group, mode)))


def _subgraph(proto: onnx.ModelProto, x_name: str, y_name: str, rank: int) -> onnx.ModelProto:
    """The nodes between stream tensors x and y, with their initializers (external references kept)."""
    producers = {out: node for node in proto.graph.node for out in node.output}
    initializers = {t.name: t for t in proto.graph.initializer}
    nodes, used, frontier = {}, set(), [y_name]
    while frontier:
        name = frontier.pop()
        if name == x_name or name in used or name not in producers:
            used.add(name)
            continue
        used.add(name)
        node = producers[name]
        nodes[id(node)] = node
        frontier.extend(i for i in node.input if i)
    order = [n for n in proto.graph.node if id(n) in nodes]
    graph = onnx.helper.make_graph(
        order,
        "fused_group",
        [onnx.helper.make_tensor_value_info(x_name, onnx.TensorProto.FLOAT, [None] * rank)],
        [onnx.helper.make_tensor_value_info(y_name, onnx.TensorProto.FLOAT, None)],
        initializer=[initializers[n] for n in sorted(used) if n in initializers],
    )
    return onnx.helper.make_model(graph, opset_imports=proto.opset_import, ir_version=proto.ir_version)


def contribution_error(x: np.ndarray, fused: np.ndarray, reference: np.ndarray) -> float:
    """How far what a fused group adds to the stream x is from what the reference adds:
    ||fused - reference|| / ||reference - x|| (the group's own contribution, not the whole stream)."""
    return float(np.linalg.norm(fused - reference) / max(np.linalg.norm(reference - x), 1e-30))


# ------------------------------------------------------------------------------- plans with parallel groups


def _validate_parallel_plan(
    original: Path,
    fused: Path,
    plan: Plan,
    tokens: np.ndarray | None,
    tolerance: float | None,
) -> ValidationReport:
    """A plan with parallel groups (passes/parallel.py). The block walk cannot read a parallelized graph, so
    every group is found in the fused graph by the names of the original's streams (the rewrite keeps
    them), cut out from its input stream to its output and run alone on the ORIGINAL model's stream there.
    A parallel group is compared with x + sum_k (block_k(x) - x), each original block run alone on x
    (BlockRunner), an FFN group with the numpy parallel sum of its original FFNs."""
    notes = check_structure(fused)
    # Both sides on float activations: int4's int8 activation rounding would blur the check (nbits.py).
    runner = BlockRunner(original, float_activations=True)
    blocks = runner.blocks
    tokens = default_tokens(blocks, original) if tokens is None else tokens
    proto = load_typed_proto(fused)
    if float_activations(proto):
        notes.append("int4 groups checked with float activations (accuracy_level 0) on both sides")
    spans = [  # (kind, group, its input stream, its output stream)
        ("parallel", g, blocks[g[0]].block_input.name, _sum_name(proto, blocks[g[1]].last_residual))
        for g in plan.parallel
    ]
    for group in plan.groups:
        members = group_ffns(blocks, group)
        spans.append(("ffn", group, members[0].ffn_input.name, _sum_name(proto, members[-1].residual)))
    captured = runner.capture(tokens, extra=[x for _, _, x, _ in spans])
    report = ValidationReport("per group")
    for kind, group, x_name, y_name in spans:
        x = captured[x_name]
        y = _run_span(proto, fused.parent, x_name, y_name, x, captured)
        if kind == "parallel":
            branches = [runner.run_branches(k, x) for k in range(group[0], group[1] + 1)]
            reference = parallel_blocks_sum(x, branches)
        else:
            reference = parallel_sum(x, group_ffns(blocks, group), plan.norm)
        report.groups.append(GroupCheck(group, contribution_error(x, y, reference), kind))
    original_logits = runner.logits
    runner.close()
    if weight_bytes(load_model(fused)) <= STREAMING_BYTES:  # one whole-model session at a time
        logits = _run(load_proto(fused), fused.parent, tokens)[0]
        report.logits_rel_error = l2_relative_error(logits, original_logits)
        report.logits_cosine = cosine(logits, original_logits)
    else:
        notes.append("logits vs original: not compared (model too large to run whole; groups checked alone)")
    report.tolerance = tolerance if tolerance is not None else exactness_tolerance(blocks)
    report.notes = notes
    return report



def _sum_name(proto: onnx.ModelProto, residual: ResidualAdd) -> str:
    """The name in the fused `proto` of the stream a residual add of the original writes: its node keeps
    its output 0 through the rewrites. A Skip*Normalization's sum (output 3) is named if the graph left it
    unnamed (the final norm)."""
    output = residual.node.outputs[0].name
    node = next((n for n in proto.graph.node if n.output and n.output[0] == output), None)
    if node is None:
        raise ValidationError(f"the fused model has no node writing {output!r}: the rewrite lost a stream")
    if node.op_type == "Add":
        return output
    while len(node.output) < 4:
        node.output.append("")
    if not node.output[3]:
        node.output[3] = f"{node.name or output}/residual_sum"
    return node.output[3]


def _run_span(
    proto: onnx.ModelProto, folder: Path, x_name: str, y_name: str, x: np.ndarray, values: dict
) -> np.ndarray:
    """The fused graph from stream x_name to stream y_name, alone: x given, side tensors from `values`."""
    split_skip_norms(proto, [x_name])  # a Skip*Norm at x also computes the group's first norm: its own
    fill_stream_types(proto, [x_name, y_name])
    side = NameGraph(proto).block_side_inputs(x_name, y_name)
    missing = [name for name in side if name not in values]
    if missing:
        raise ValidationError(f"the group from {x_name!r} reads {missing[0]!r}, which the original lacks")
    types = value_types(proto)
    unknown = [name for name in side if name not in types]
    if unknown:
        raise ValidationError(f"the type of {unknown[0]!r} is unknown (shape inference failed)")
    sub = onnx.utils.Extractor(proto).extract_model([x_name, *side], [y_name])
    feed = {x_name: x, **{name: values[name] for name in side}}
    return _session(sub, folder).run(None, feed)[0]
