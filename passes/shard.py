"""Tensor-parallel sharding: split a Llama-family ONNX model into N rank graphs (Megatron layout).

Per residual branch (passes.shard_graph finds them by structure):

- attention: q/k/v column-parallel by heads, o_proj row-parallel. With fewer KV heads than ranks each
  rank keeps the one KV head its query heads use (KV replicated); head counts not divisible are an error.
- FFN (SwiGLU, and fused wide FFNs, which are just wider): gate/up column-parallel, down row-parallel;
  widths not divisible by N are padded with zero columns (gate/up) and zero rows (down), which is exact.
- after each row-parallel MatMul, exactly one all-reduce: a `DistCollective` node (domain "trt";
  TensorRT's ONNX parser matches the op by name and ignores the domain) with
  collective_operation="all_reduce", reduce_op="sum", root=-1, group_size=0, nb_rank=N.
- embeddings and lm_head replicated; `lm_head="vocab"` splits the lm_head by vocabulary and gathers the
  logits with one all_gather DistCollective.

Decode graphs (exporters/decode.py) shard too: a past K/V graph input concatenated with an attention
branch's new keys/values, and the present output that Concat makes, hold the rank's KV heads (split, or
the one replicated head its queries use), and their declared shapes say so (the TP runtimes read them).

FP8 Q/DQ graphs shard too: per-channel DequantizeLinear scales travel with their weight slices,
per-tensor scales are replicated. The Reshape/Expand shape constants that encode head counts are
rewritten per rank (passes.shard_dims works out which). Weights are sliced lazily from the memory-mapped
source while each rank's model is saved, one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from passes.errors import UserError
from passes.model_io import EXTERNAL_DATA_THRESHOLD, has_external_data, load_model, save_model, weight_bytes
from passes.shapes import Dim, Info, World, dims_to_ir
from passes.shard_dims import HeadMap, RankWorld, ShapeRewrite
from passes.shard_graph import Branch, TpStructure, WeightRef, constant_tensor, find_structure
from passes.shard_plan import (  # noqa: F401  (VALID_TP, kv_layout: re-exported)
    PAD,
    VALID_TP,
    HeadPlan,
    check_tp,
    head_columns,
    kv_layout,
    padded_range,
)

COLLECTIVE_OP = "DistCollective"
COLLECTIVE_DOMAIN = "trt"
LM_HEAD_MODES = ("replicated", "vocab")
MANIFEST = "tp.json"
MANIFEST_FORMAT = "ffn-fusion-tp/1"
METADATA_KEY = "ffn_fusion.tp"


@dataclass(frozen=True)
class WeightSlice:
    """Rows (axis 0) or columns (axis 1) of a linear layer's [in, out] weight, gathered by index.

    An index PAD reads as zeros (padding)."""

    ref: WeightRef
    axis: int
    indices: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.indices)


@dataclass
class RankInfo:
    """What sharding did to one rank's graph."""

    rank: int
    allreduces: int
    allgathers: int
    sliced_weights: int
    shape_rewrites: int


@dataclass
class BranchSummary:
    index: int
    kind: str
    width: int = 0
    padded_width: int = 0
    heads: int = 0
    kv_heads: int = 0
    kv_heads_per_rank: int = 0
    heads_per_rank: int = 0  # padded with zero heads when tp does not divide the heads
    cache_inputs: list[str] = field(default_factory=list)  # decode graphs: past K/V graph inputs
    cache_outputs: list[str] = field(default_factory=list)  # and the present outputs they become


@dataclass
class ShardReport:
    out_dir: Path
    tp: int
    rank_files: list[Path]
    allreduces_per_forward: int
    allgathers_per_forward: int
    lm_head: str
    branches: list[BranchSummary] = field(default_factory=list)
    seconds: float = 0.0
    external_data: bool = False

    def lines(self) -> list[str]:
        att = sum(b.kind == "attention" for b in self.branches)
        ffn = len(self.branches) - att
        padded = [b for b in self.branches if b.padded_width != b.width and b.kind == "ffn"]
        out = [
            f"tp={self.tp}: {len(self.rank_files)} rank graphs in {self.out_dir}",
            f"all-reduces per forward: {self.allreduces_per_forward} ({att} attention + {ffn} FFN)"
            + (f", all-gathers: {self.allgathers_per_forward}" if self.allgathers_per_forward else ""),
        ]
        if padded:
            shown = ", ".join(f"{b.width}->{b.padded_width}" for b in padded[:6])
            out.append(
                f"FFN widths padded with zeros to a multiple of {self.tp}: {shown}"
                + (" ..." if len(padded) > 6 else "")
            )
        cached = [b for b in self.branches if b.cache_inputs]
        if cached:
            per_rank = sorted({b.kv_heads_per_rank for b in cached})
            out.append(
                f"KV cache: {sum(len(b.cache_inputs) for b in cached)} past inputs in {len(cached)} "
                f"attention branches, {'/'.join(map(str, per_rank))} KV head(s) per rank"
            )
        out.append(f"lm_head: {self.lm_head}; {self.seconds:.1f} s")
        return out


# ------------------------------------------------------------------------------------------- planning


def plan_slices(structure: TpStructure, tp: int, rank: int, lm_head: str) -> list[WeightSlice]:
    slices: list[WeightSlice] = []
    for branch in structure.branches:
        if branch.kind == "attention":
            slices += _attention_slices(branch, HeadPlan(branch.heads, branch.kv_heads, tp), rank)
        else:
            per = math.ceil(branch.width / tp)
            cols = tuple(padded_range(rank * per, (rank + 1) * per, branch.width))
            slices += [WeightSlice(c, 1, cols) for c in branch.columns]
            slices.append(WeightSlice(branch.row, 0, cols))
    if lm_head == "vocab":
        if structure.lm_head is None:
            raise UserError("lm_head='vocab': no lm_head (final linear layer reaching an output) found")
        vocab = structure.lm_head.matrix_shape()[1]
        per = math.ceil(vocab / tp)
        slices.append(
            WeightSlice(structure.lm_head, 1, tuple(padded_range(rank * per, (rank + 1) * per, vocab)))
        )
    return slices


def _attention_slices(branch: Branch, plan: HeadPlan, rank: int) -> list[WeightSlice]:
    """q/k/v columns and o_proj rows of this rank's heads (a packed qkv weight: one gathered slice)."""
    assert branch.q is not None and branch.k is not None and branch.v is not None
    hd = branch.head_dim
    q_heads, kv_heads = plan.q_sources(rank), plan.kv_sources(rank)
    q = head_columns(q_heads, hd)
    row = WeightSlice(branch.row, 0, tuple(q))
    if branch.packed:
        q_off, k_off, v_off = branch.offsets
        cols = head_columns(q_heads, hd, q_off) + head_columns(kv_heads, hd, k_off)
        cols += head_columns(kv_heads, hd, v_off)
        return [WeightSlice(branch.q, 1, tuple(cols)), row]
    kv = tuple(head_columns(kv_heads, hd))
    return [
        WeightSlice(branch.q, 1, tuple(q)),
        WeightSlice(branch.k, 1, kv),
        WeightSlice(branch.v, 1, kv),
        row,
    ]


def _sliced_shape(s: WeightSlice) -> tuple[int, int]:
    rows, cols = s.ref.matrix_shape()
    n = s.size
    shape = (n, cols) if s.axis == 0 else (rows, n)
    return (shape[1], shape[0]) if s.ref.transposed else shape


# ------------------------------------------------------------------------------------------ rewriting


def shard_in_memory(model: ir.Model, tp: int, rank: int, lm_head: str = "replicated") -> RankInfo:
    """Turn `model` (in place) into rank `rank` of `tp`. Weights become lazy slices of the originals."""
    check_tp(tp)
    if lm_head not in LM_HEAD_MODES:
        raise UserError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
    if not 0 <= rank < tp:
        raise UserError(f"rank {rank} is outside 0..{tp - 1}")
    _reject_rank_graph(model)
    graph = model.graph
    world = World(graph).run()
    structure = find_structure(model, world)
    if tp == 1:
        model.metadata_props[METADATA_KEY] = json.dumps({"tp": 1, "rank": 0})
        return RankInfo(0, 0, 0, 0, 0)
    vocab = structure.lm_head.matrix_shape()[1] if structure.lm_head is not None else 0
    slices = plan_slices(structure, tp, rank, lm_head)
    rewriter = _Rewriter(model, tp, rank)
    for s in slices:
        if s.axis == 1:
            rewriter.slice_bias(s)  # before the rank world runs: it reads the new bias shapes
    rank_world = _rank_world(structure, world, slices, tp, lm_head)
    for s in slices:
        rewriter.slice_weight(s)
    for rw in rank_world.rewrites:
        rewriter.rewrite_shape(rw, rank_world)
    for node, name, value in rank_world.attr_rewrites:
        node.attributes[name] = ir.AttrInt64(name, value)
    _update_shapes(graph, rank_world)
    for branch in structure.branches:
        _insert_collective(graph, branch.row.node.outputs[0], "all_reduce", tp)
    gathers = 0
    if lm_head == "vocab":
        assert structure.lm_head is not None
        _gather_logits(graph, structure.lm_head, vocab, tp)
        gathers = 1
    model.opset_imports.setdefault(COLLECTIVE_DOMAIN, 1)
    model.metadata_props[METADATA_KEY] = json.dumps({"tp": tp, "rank": rank, "lm_head": lm_head})
    return RankInfo(rank, len(structure.branches), gathers, len(slices), len(rank_world.rewrites))


def _rank_world(
    structure: TpStructure, world: World, slices: list[WeightSlice], tp: int, lm_head: str
) -> RankWorld:
    seeds: dict[ir.Value, Info] = {}
    for s in slices:
        if len(s.ref.value.uses()) != 1:
            raise UserError(
                f"weight {s.ref.source.name!r} feeds several layers through one value; cannot shard"
            )
        seeds[s.ref.value] = Info(tuple(Dim(d) for d in _sliced_shape(s)))
    owner = structure.branch_of()

    maps = {}
    for b in structure.attention:
        plan = HeadPlan(b.heads, b.kv_heads, tp)
        rank = (plan.heads_per_rank, plan.kv_per_rank, plan.group_per_rank)
        maps[b.index] = HeadMap((b.heads, b.kv_heads, b.heads // b.kv_heads), rank)

    def heads(node: ir.Node) -> HeadMap | None:
        branch = owner.get(node)
        return maps.get(branch.index) if branch is not None else None

    def where(node: ir.Node) -> str:
        branch = owner.get(node)
        return branch.describe() if branch is not None else "the graph"

    rows = {b.row.node for b in structure.branches}
    if lm_head == "vocab" and structure.lm_head is not None:
        rows.discard(structure.lm_head.node)
    caches = {c.past for b in structure.branches for c in b.caches}
    return RankWorld(world, seeds, heads, rows, where, caches).run()


def _update_shapes(graph: ir.Graph, world: RankWorld) -> None:
    for value, info in world.over.items():
        if value.is_initializer() or value.const_value is not None:
            continue
        if value.type is None:
            value.type = _walk_type(value)
        if value.type is not None:
            value.shape = dims_to_ir(info.shape)


_TYPE_KEEPING = {
    "MatMul",
    "Gemm",
    "Mul",
    "Add",
    "Sub",
    "Div",
    "Sigmoid",
    "Neg",
    "Identity",
    "Reshape",
    "Transpose",
    "Expand",
    "Concat",
    "Slice",
    "Squeeze",
    "Unsqueeze",
    "Softmax",
    "Where",
}


def _walk_type(value: ir.Value, depth: int = 0) -> ir.TypeProtocol | None:
    """The element type of an untyped value, from the op that made it (types the fusion pass leaves out)."""
    if value.type is not None or depth > 32:
        return value.type
    node = value.producer()
    if node is None or node.op_type not in _TYPE_KEEPING:
        return None
    inputs = node.inputs[1:] if node.op_type == "Where" else node.inputs
    for v in inputs:
        if v is not None and (found := _walk_type(v, depth + 1)) is not None:
            return found
    return None


class _Rewriter:
    def __init__(self, model: ir.Model, tp: int, rank: int) -> None:
        self.graph = model.graph
        self.tp, self.rank = tp, rank
        self.shape_consts: dict[tuple[int, ...], ir.Value] = {}
        self.concats: dict[tuple[int, tuple[int | None, ...]], ir.Value] = {}

    # weights ------------------------------------------------------------------------------------

    def slice_weight(self, s: WeightSlice) -> None:
        ref = s.ref
        axis = ref.source_axis(s.axis)
        tensor = ref.tensor
        shape = list(int(d) for d in tensor.shape)
        shape[axis] = s.size
        lazy = ir.LazyTensor(
            _slicer(tensor, axis, s.indices, 0),
            dtype=tensor.dtype,
            shape=ir.Shape(shape),
            name=ref.source.name,
        )
        first = ref.chain[0] if ref.chain else ref.node
        slot = 0 if ref.chain else 1
        source = ref.source
        if source.is_initializer() and len(source.uses()) == 1:
            source.const_value = lazy
            source.shape = ir.Shape(shape)
        else:
            new = self._initializer(f"{source.name}.tp{self.tp}_rank{self.rank}", lazy)
            first.replace_input_with(slot, new)
        current_axis = axis
        for node in ref.chain:
            if node.op_type == "Transpose":
                perm = (
                    [int(p) for p in node.attributes["perm"].value] if "perm" in node.attributes else [1, 0]
                )
                current_axis = perm.index(current_axis)
            elif node.op_type == "DequantizeLinear":
                self._slice_scales(node, current_axis, s)
        for node in ref.chain:
            for out in node.outputs:
                out.shape = None

    def slice_bias(self, s: WeightSlice) -> None:
        """A column-parallel layer's bias (a constant [.., out] added right after it) gets its columns."""
        cols = s.ref.matrix_shape()[1]
        uses = s.ref.node.outputs[0].uses()
        if len(uses) != 1 or uses[0].node.op_type != "Add":
            return
        node, slot = uses[0].node, 1 - uses[0].idx
        tensor = constant_tensor(node.inputs[slot])
        if tensor is None or not tensor.shape or int(tensor.shape[-1]) != cols or cols == 1:
            return
        axis = len(tensor.shape) - 1
        sliced = _slicer(tensor, axis, s.indices, 0)()
        name = node.inputs[slot].name or f"{node.name}_bias"
        node.replace_input_with(slot, self._initializer(f"{name}.tp{self.tp}_rank{self.rank}", sliced))

    def _slice_scales(self, node: ir.Node, axis: int, s: WeightSlice) -> None:
        block = node.attributes.get("block_size")
        if block is not None and int(block.value) > 0:
            raise UserError(f"DequantizeLinear {node.name!r}: blocked quantization cannot be sharded yet")
        dq_axis = int(node.attributes["axis"].value) if "axis" in node.attributes else 1
        dq_axis %= 2
        for slot, pad in ((1, 1), (2, 0)):
            if len(node.inputs) <= slot or node.inputs[slot] is None:
                continue
            tensor = constant_tensor(node.inputs[slot])
            if tensor is None:
                raise UserError(f"DequantizeLinear {node.name!r}: its scale/zero point is not a constant")
            if math.prod(tensor.shape) <= 1 or dq_axis != axis:
                continue  # per-tensor, or per-channel along the other axis: replicated
            sliced = _slicer(tensor, 0, s.indices, pad)()
            value = node.inputs[slot]
            name = value.name if value.name else f"{node.name}_scale"
            node.replace_input_with(slot, self._initializer(f"{name}.tp{self.tp}_rank{self.rank}", sliced))

    def _initializer(self, name: str, tensor: ir.TensorProtocol) -> ir.Value:
        base, n = name, 1
        while name in self.graph.initializers:
            name, n = f"{base}_{n}", n + 1
        tensor.name = name
        value = ir.Value(
            name=name,
            shape=ir.Shape(list(tensor.shape)),
            type=ir.TensorType(tensor.dtype),
            const_value=tensor,
        )
        self.graph.register_initializer(value)
        return value

    # shape constants ------------------------------------------------------------------------------

    def rewrite_shape(self, rw: ShapeRewrite, world: RankWorld) -> None:
        value = rw.node.inputs[rw.index]
        assert value is not None
        new = self._shape_value(rw.node, value, rw.values, world)
        rw.node.replace_input_with(rw.index, new)

    def _shape_value(
        self, node: ir.Node, value: ir.Value, values: list[int | None], world: RankWorld
    ) -> ir.Value:
        current = world.full.get(value).value
        if _is_static(value):
            ints = [v if v is not None else int(c) for v, c in zip(values, current, strict=True)]
            return self._shape_const(ints)
        producer = value.producer()
        key = (id(producer), tuple(values))
        if key in self.concats:
            return self.concats[key]
        if producer is not None and producer.op_type in ("Where", "Reshape", "Identity", "Cast"):
            return self._shape_through(node, producer, values, world, key)
        if producer is None or producer.op_type != "Concat":
            raise UserError(
                f"cannot rewrite the shape argument {value.name!r} of {node.op_type} {node.name!r}: "
                "it is neither a constant nor a Concat"
            )
        pieces: list[ir.Value] = []
        offset = 0
        changed = False
        for piece in producer.inputs:
            info = world.full.get(piece)
            length = 1 if info.shape == () else int(info.shape[0]) if info.shape and info.shape[0] else None
            if length is None or info.value is None:
                raise UserError(f"cannot follow the shape piece {piece.name!r} of {node.name!r}")
            wanted = values[offset : offset + length]
            offset += length
            if all(w is None for w in wanted):
                pieces.append(piece)
                continue
            if not _is_static(piece):
                raise UserError(
                    f"{node.op_type} {node.name!r}: shape element from {piece.name!r} encodes a head "
                    "count but is computed at run time; cannot rewrite it"
                )
            ints = [w if w is not None else int(c) for w, c in zip(wanted, info.value, strict=True)]
            pieces.append(self._shape_const(ints))
            changed = True
        if not changed:
            return value
        n = len(self.concats)
        out = ir.Value(name=f"{value.name}_tp_rank{self.rank}_{n}", type=value.type, shape=value.shape)
        concat = ir.Node(
            "",
            "Concat",
            pieces,
            attributes=[ir.AttrInt64("axis", 0)],
            outputs=[out],
            name=f"{producer.name or 'concat'}_tp_rank{self.rank}_{n}",
        )
        self.graph.insert_before(node, concat)
        self.concats[key] = out
        return out

    def _shape_through(
        self, node: ir.Node, producer: ir.Node, values: list[int | None], world: RankWorld, key: tuple
    ) -> ir.Value:
        """A shape vector passed through Reshape/Identity/Cast, or TorchScript's expand idiom
        Where(Equal(shape, -1), 1, shape): rewrite the vector inside and copy the node onto it."""
        slot = 2 if producer.op_type == "Where" else 0
        inner = producer.inputs[slot]
        assert inner is not None
        new = self._shape_value(node, inner, values, world)
        if new is inner:
            return producer.outputs[0]
        inputs = [new if k == slot else v for k, v in enumerate(producer.inputs)]
        out = producer.outputs[0]
        n = len(self.concats)
        copy = ir.Value(name=f"{out.name}_tp_rank{self.rank}_{n}", type=out.type, shape=out.shape)
        clone = ir.Node(
            producer.domain,
            producer.op_type,
            inputs,
            attributes=list(producer.attributes.values()),
            outputs=[copy],
            name=f"{producer.name or producer.op_type}_tp_rank{self.rank}_{n}",
        )
        self.graph.insert_before(node, clone)
        self.concats[key] = copy
        return copy

    def _shape_const(self, ints: list[int]) -> ir.Value:
        key = tuple(ints)
        if key not in self.shape_consts:
            name = "tp_shape_" + "_".join(str(i).replace("-", "m") for i in ints)
            tensor = ir.tensor(np.array(ints, dtype=np.int64), name=name)
            self.shape_consts[key] = self._initializer(name, tensor)
        return self.shape_consts[key]


def _is_static(value: ir.Value | None, depth: int = 0) -> bool:
    """True when `value` is computed from constants only (so a new constant can replace it)."""
    if value is None or depth > 8 or value.is_graph_input():
        return False
    if constant_tensor(value) is not None:
        return True
    node = value.producer()
    if node is None or node.op_type in ("Shape", "Size"):
        return False
    return all(_is_static(v, depth + 1) for v in node.inputs if v is not None)


def _slicer(
    tensor: ir.TensorProtocol, axis: int, indices: tuple[int, ...], pad: float
) -> Callable[[], ir.Tensor]:
    """Gather `indices` along `axis` (PAD reads as `pad`); a contiguous run reads as one slice."""

    def make() -> ir.Tensor:
        array = tensor.numpy()
        idx = np.asarray(indices, dtype=np.int64)
        real = idx != PAD
        if real.all() and len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
            index = [slice(None)] * array.ndim
            index[axis] = slice(int(idx[0]), int(idx[0]) + len(idx))
            part = np.array(array[tuple(index)], copy=True, order="C")
        else:
            shape = list(array.shape)
            shape[axis] = len(idx)
            part = np.full(shape, pad, dtype=array.dtype) if pad else np.zeros(shape, dtype=array.dtype)
            where = [slice(None)] * array.ndim
            where[axis] = np.flatnonzero(real)
            part[tuple(where)] = np.take(array, idx[real], axis=axis)
        del array
        release = getattr(tensor, "release", None)
        if release is not None:
            with contextlib.suppress(BufferError):  # another view of the mapping is still alive
                release()
        return ir.Tensor(part, dtype=tensor.dtype, name=tensor.name)

    return make


def _collective_node(inputs: list[ir.Value], output: ir.Value, operation: str, tp: int, name: str) -> ir.Node:
    attributes = [
        ir.AttrString("collective_operation", operation),
        ir.AttrString("reduce_op", "sum" if operation == "all_reduce" else "none"),
        ir.AttrInt64("root", -1),
        ir.AttrInt64("group_size", 0),
        ir.AttrInt64("nb_rank", tp),
    ]
    return ir.Node(
        COLLECTIVE_DOMAIN, COLLECTIVE_OP, inputs, attributes=attributes, outputs=[output], name=name
    )


def _insert_collective(graph: ir.Graph, value: ir.Value, operation: str, tp: int) -> ir.Value:
    """Insert value -> DistCollective -> new value, moving every use of `value` to the new value."""
    if value.type is None:
        value.type = _walk_type(value)
    reduced = ir.Value(name=f"{value.name}_{operation}", type=value.type, shape=value.shape)
    for use in list(value.uses()):
        use.node.replace_input_with(use.idx, reduced)
    for i, out in enumerate(graph.outputs):
        if out is value:
            graph.outputs[i] = reduced
    node = _collective_node([value], reduced, operation, tp, name=f"{value.name}/{operation}")
    graph.insert_after(value.producer(), node)
    return reduced


def _gather_logits(graph: ir.Graph, head: WeightRef, vocab: int, tp: int) -> None:
    """logits_r [.., V/tp] -> transpose to axis 0 -> all_gather -> transpose back -> slice to V."""
    value = head.node.outputs[0]
    rank = value.shape.rank() if value.shape is not None else 3
    perm = list(range(rank))
    perm[0], perm[-1] = perm[-1], perm[0]
    name = value.name
    value.name = f"{name}_vocab_shard"
    uses = list(value.uses())
    outputs = [i for i, o in enumerate(graph.outputs) if o is value]
    t1 = ir.node("Transpose", [value], attributes={"perm": perm})
    t1.outputs[0].name = f"{name}_vocab_shard_t"
    gathered = ir.Value(name=f"{name}_gathered_t", type=value.type)
    gather = _collective_node([t1.outputs[0]], gathered, "all_gather", tp, name=f"{name}/all_gather")
    t2 = ir.node("Transpose", [gathered], attributes={"perm": perm})
    nodes = [t1, gather, t2]
    last = t2.outputs[0]
    padded = math.ceil(vocab / tp) * tp
    if padded != vocab:
        t2.outputs[0].name = f"{name}_padded"
        starts = ir.tensor(np.array([0], np.int64), name=f"{name}_slice_start")
        ends = ir.tensor(np.array([vocab], np.int64), name=f"{name}_slice_end")
        axes = ir.tensor(np.array([-1], np.int64), name=f"{name}_slice_axis")
        consts = []
        for t in (starts, ends, axes):
            v = ir.Value(
                name=t.name, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64), const_value=t
            )
            graph.register_initializer(v)
            consts.append(v)
        sl = ir.node("Slice", [last, *consts])
        nodes.append(sl)
        last = sl.outputs[0]
    last.name = name
    last.type = value.type
    last.shape = None
    graph.insert_after(head.node, nodes)
    for use in uses:
        use.node.replace_input_with(use.idx, last)
    for i in outputs:
        graph.outputs[i] = last
    value.shape = None


def _collectives(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == COLLECTIVE_OP]


# ------------------------------------------------------------------------------------------ counting


def count_allreduces(model: ir.Model | str | Path) -> int:
    """All-reduces per forward pass under tensor parallelism.

    For a rank graph: its all_reduce DistCollective nodes. For a single-device model: one per residual
    branch (every attention and every FFN ends in a row-parallel projection), so a fused group of k FFNs
    counts 1 instead of k.
    """
    if not isinstance(model, ir.Model):
        model = load_model(Path(model))
    collectives = _collectives(model)
    if collectives:
        return sum(_collective_op(n) == "all_reduce" for n in collectives)
    return len(find_structure(model).branches)


def _collective_op(node: ir.Node) -> str:
    attr = node.attributes.get("collective_operation")
    value = attr.value if attr is not None else ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _reject_rank_graph(model: ir.Model) -> None:
    if _collectives(model):
        raise UserError("the model already has DistCollective nodes (it is a rank graph); shard the original")


def summarize(model: ir.Model, tp: int) -> list[BranchSummary]:
    _reject_rank_graph(model)
    structure = find_structure(model)
    out = []
    for b in structure.branches:
        padded = math.ceil(b.width / tp) * tp if b.kind == "ffn" else 0
        summary = BranchSummary(b.index, b.kind, b.width, padded, b.heads, b.kv_heads)
        if b.kind == "attention":
            plan = HeadPlan(b.heads, b.kv_heads, tp)
            summary.kv_heads_per_rank = plan.kv_per_rank
            summary.heads_per_rank = plan.heads_per_rank
            summary.cache_inputs = [c.past.name for c in b.caches]
            summary.cache_outputs = [c.present.name for c in b.caches if c.present is not None]
        out.append(summary)
    return out


# ------------------------------------------------------------------------------------------- files


def shard_file(
    model_path: str | Path,
    tp: int,
    out_dir: str | Path,
    *,
    lm_head: str = "replicated",
    external_data: bool | None = None,
    progress: bool = True,
) -> ShardReport:
    """Write DIR/rank{r}/model.onnx (+ model.onnx.data) for every rank and DIR/tp.json."""
    check_tp(tp)
    model_path, out_dir = Path(model_path), Path(out_dir)
    if out_dir.resolve() == model_path.parent.resolve():
        raise UserError(f"--out {out_dir} is the model's own folder; choose a new folder")
    start = time.perf_counter()
    source_external = has_external_data(model_path)
    summary = summarize(load_model(model_path), tp)
    files: list[Path] = []
    infos: list[RankInfo] = []
    external = False
    bar = _progress(tp, progress)
    for rank in range(tp):
        model = load_model(model_path)
        infos.append(shard_in_memory(model, tp, rank, lm_head))
        path = out_dir / f"rank{rank}" / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        big = weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
        external = external_data if external_data is not None else (source_external or big)
        if not external:
            path.with_name("model.onnx.data").unlink(missing_ok=True)
        save_model(model, path, external)
        files.append(path)
        del model
        bar(rank)
    report = ShardReport(
        out_dir,
        tp,
        files,
        infos[0].allreduces,
        infos[0].allgathers,
        lm_head,
        summary,
        time.perf_counter() - start,
        external,
    )
    write_manifest(report, model_path)
    return report


def shard_model(model_path: str | Path, tp: int, out_dir: str | Path, **kwargs) -> list[Path]:
    """The rank ONNX files (rank 0 first) of `model_path` sharded over `tp` ranks into `out_dir`."""
    return shard_file(model_path, tp, out_dir, **kwargs).rank_files


def _progress(total: int, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda rank: None
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda rank: None
    bar = tqdm(total=total, desc="sharding", unit="rank", file=sys.stderr, leave=False)

    def step(rank: int) -> None:
        bar.update(1)
        if rank == total - 1:
            bar.close()

    return step


def write_manifest(report: ShardReport, source: Path) -> Path:
    data = {
        "format": MANIFEST_FORMAT,
        "tp": report.tp,
        "ranks": [str(p.relative_to(report.out_dir)) for p in report.rank_files],
        "allreduces_per_forward": report.allreduces_per_forward,
        "allgathers_per_forward": report.allgathers_per_forward,
        "lm_head": report.lm_head,
        "collective": {"op": COLLECTIVE_OP, "domain": COLLECTIVE_DOMAIN},
        "external_data": report.external_data,
        "source": str(source),
        "branches": [asdict(b) for b in report.branches],
    }
    path = report.out_dir / MANIFEST
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory} has no {MANIFEST}; write it with tools/shard_tp.py")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    if data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("ranks"), list):
        raise UserError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    return data


def rank_onnx_files(directory: str | Path) -> list[Path]:
    """The rank graphs of a sharded folder, rank 0 first (one TensorRT engine is built per file)."""
    directory = Path(directory)
    data = read_manifest(directory)
    files = [directory / r for r in data["ranks"]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{directory}: rank graph(s) missing: {', '.join(missing)}")
    if len(files) != data["tp"]:
        raise UserError(f"{directory / MANIFEST}: tp={data['tp']} but {len(files)} rank files listed")
    return files
