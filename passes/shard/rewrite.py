"""Rewriting one rank graph (passes.shard.shard_in_memory): lazy weight gathers, shape and attribute
rewrites from the rank world (passes.shard.dims), per-rank shapes, and the all-reduces.

Weights become `onnx_ir.LazyTensor` gathers of the memory-mapped source (PAD indices read as zeros, FP8
scales as ones), evaluated one at a time when the rank is saved.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.errors import UserError
from passes.metadata import TP_METADATA_KEY
from passes.patterns.linear import constant_tensor
from passes.shapes import Dim, Info, World, dims_to_ir
from passes.shard.collectives import (
    COLLECTIVE_DOMAIN,
    gather_logits,
    insert_collective,
    insert_stacked_allreduce,
    reject_rank_graph,
)
from passes.shard.dims import HeadMap, RankWorld, ShapeRewrite
from passes.shard.partition import PAD, HeadPlan, WeightSlice, check_tp, plan_slices, sliced_shape
from passes.shard.roles import Branch, TpStructure, find_structure
from passes.shard.value_types import walk_type

LM_HEAD_MODES = ("replicated", "vocab")




@dataclass
class RankInfo:
    """What sharding did to one rank's graph."""

    rank: int
    allreduces: int
    allgathers: int
    sliced_weights: int
    shape_rewrites: int


def shard_in_memory(model: ir.Model, tp: int, rank: int, lm_head: str = "replicated") -> RankInfo:
    """Turn `model` (in place) into rank `rank` of `tp`. Weights become lazy slices of the originals."""
    check_tp(tp)
    if lm_head not in LM_HEAD_MODES:
        raise UserError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
    if not 0 <= rank < tp:
        raise UserError(f"rank {rank} is outside 0..{tp - 1}")
    reject_rank_graph(model)
    graph = model.graph
    world = World(graph).run()
    structure = find_structure(model, world)
    if tp == 1:
        model.metadata_props[TP_METADATA_KEY] = json.dumps({"tp": 1, "rank": 0})
        return RankInfo(0, 0, 0, 0, 0)
    vocab = structure.lm_head.matrix_shape()[1] if structure.lm_head is not None else 0
    slices = plan_slices(structure, tp, rank, lm_head)
    rewriter = _Rewriter(model, tp, rank)
    for s in slices:
        if s.axis == 1:
            rewriter.slice_bias(s)  # before the rank world runs: it reads the new bias shapes
    inputs = dict(rewriter.split_features(b, world) for b in structure.branches if b.kind == "linear")
    rank_world = _rank_world(structure, world, slices, tp, lm_head, inputs)
    for s in slices:
        rewriter.slice_weight(s)
    for rw in rank_world.rewrites:
        rewriter.rewrite_shape(rw, rank_world)
    for node, name, value in rank_world.attr_rewrites:
        node.attributes[name] = ir.AttrInt64(name, value)
    _update_shapes(graph, rank_world)
    for branch in structure.branches:
        if branch.group is None:
            insert_collective(graph, branch.row.node.outputs[0], "all_reduce", tp)
    for group in structure.groups:  # two all-reduces per parallel group of blocks
        outputs = [b.row.node.outputs[0] for b in group.attention]
        name = f"parallel_group_{group.number}.attention"
        insert_stacked_allreduce(graph, outputs, group.hidden, tp, name)
        insert_collective(graph, group.ffn_sum, "all_reduce", tp)
    if structure.groups:
        graph.sort()  # the stacked all-reduce comes after every member's attention, before their FFNs
    gathers = 0
    if lm_head == "vocab":
        assert structure.lm_head is not None
        gather_logits(graph, structure.lm_head, vocab, tp)
        gathers = 1
    model.opset_imports.setdefault(COLLECTIVE_DOMAIN, 1)
    model.metadata_props[TP_METADATA_KEY] = json.dumps({"tp": tp, "rank": rank, "lm_head": lm_head})
    return RankInfo(rank, structure.allreduces, gathers, len(slices), len(rank_world.rewrites))


def _rank_world(
    structure: TpStructure,
    world: World,
    slices: list[WeightSlice],
    tp: int,
    lm_head: str,
    inputs: dict[ir.Value, Info],
) -> RankWorld:
    seeds: dict[ir.Value, Info] = dict(inputs)  # the per-rank inputs of one-Linear branches
    for s in slices:
        if len(s.ref.value.uses()) != 1:
            raise UserError(
                f"weight {s.ref.source.name!r} feeds several layers through one value; cannot shard"
            )
        if not s.ref.nbits:
            seeds[s.ref.value] = Info(tuple(Dim(d) for d in sliced_shape(s)))
        elif s.axis == 1:  # MatMulNBits: its N attribute is rewritten later; the output is the rank's
            out = s.ref.node.outputs[0]
            full = world.get(out).shape
            if full is None:
                raise UserError(f"MatMulNBits {s.ref.node.name!r}: output shape unknown; cannot shard it")
            seeds[out] = Info((*full[:-1], Dim(s.size)))
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
            value.type = walk_type(value)
        if value.type is not None:
            value.shape = dims_to_ir(info.shape)


class _Rewriter:
    def __init__(self, model: ir.Model, tp: int, rank: int) -> None:
        self.graph = model.graph
        self.tp, self.rank = tp, rank
        self.shape_consts: dict[tuple[int, ...], ir.Value] = {}
        self.concats: dict[tuple[int, tuple[int | None, ...]], ir.Value] = {}

    # one-Linear branches -------------------------------------------------------------------------

    def split_features(self, branch: Branch, world: World) -> tuple[ir.Value, Info]:
        """A one-Linear branch is row-parallel on a replicated input: before its projection, this rank
        gathers its share of the input features (a padding feature reads feature 0, which meets a zero
        weight row), so the all-reduce of the partial products is the full product. Returns the gathered
        value and its rank shape."""
        node, per = branch.row.node, math.ceil(branch.width / self.tp)
        x = node.inputs[0]
        full = world.get(x).shape
        if branch.row.nbits or full is None or not full:
            raise UserError(f"{branch.describe()}: a one-Linear branch on {node.op_type} with input shape "
                            f"{full}; cannot shard it row-parallel")
        features = [i if i < branch.width else 0 for i in range(self.rank * per, (self.rank + 1) * per)]
        name = f"{node.name or 'linear'}_tp_features"
        indices = self._initializer(f"{name}.tp{self.tp}_rank{self.rank}", ir.tensor(np.array(features)))
        out = ir.Value(name=f"{name}_rank{self.rank}", type=x.type)
        gather = ir.Node("", "Gather", [x, indices], attributes=[ir.AttrInt64("axis", -1)], outputs=[out],
                         name=f"{name}_rank{self.rank}")
        self.graph.insert_before(node, gather)
        node.replace_input_with(0, out)
        return out, Info((*full[:-1], Dim(per)))

    # weights ------------------------------------------------------------------------------------

    def slice_weight(self, s: WeightSlice) -> None:
        ref = s.ref
        if ref.nbits:
            self._slice_nbits(s)
            return
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

    def _slice_nbits(self, s: WeightSlice) -> None:
        """MatMulNBits: B [N, K blocks, blob] and its per-block scales are gathered by rows (N, column
        parallel) or by whole quantization blocks (K, row parallel); a padded row or block gets zero
        scales, so it dequantizes to zeros. The K and N attributes follow."""
        node = s.ref.node
        block = int(node.attributes["block_size"].value)
        if s.axis == 1:
            rows, axis, attr = s.indices, 0, "N"
        else:
            rows, axis, attr = _whole_blocks(s.indices, block, node), 1, "K"
        weight, scales = node.inputs[1], node.inputs[2]
        assert weight is not None and scales is not None
        tensor = constant_tensor(weight)
        shape = [int(d) for d in tensor.shape]
        shape[axis] = len(rows)
        lazy = ir.LazyTensor(
            _slicer(tensor, axis, tuple(rows), 0), dtype=tensor.dtype, shape=ir.Shape(shape), name=weight.name
        )
        node.replace_input_with(1, self._initializer(f"{weight.name}.tp{self.tp}_rank{self.rank}", lazy))
        scale_tensor = constant_tensor(scales)
        n, k_blocks = int(tensor.shape[0]), int(tensor.shape[1])
        table = scale_tensor.numpy().reshape(n, k_blocks)
        picked = _slicer(ir.Tensor(table), axis, tuple(rows), 0)().numpy()
        picked = picked.reshape(-1) if len(scale_tensor.shape) == 1 else picked
        name = f"{scales.name}.tp{self.tp}_rank{self.rank}"
        node.replace_input_with(2, self._initializer(name, ir.Tensor(picked, name=name)))
        node.attributes[attr] = ir.AttrInt64(attr, len(s.indices))
        bias = node.inputs[5] if len(node.inputs) > 5 else None
        if s.axis == 1 and bias is not None:
            sliced = _slicer(constant_tensor(bias), 0, s.indices, 0)()
            node.replace_input_with(5, self._initializer(f"{bias.name}.tp{self.tp}_rank{self.rank}", sliced))

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


def _whole_blocks(indices: tuple[int, ...], block: int, node: ir.Node) -> list[int]:
    """The source quantization blocks of a K split that falls on block boundaries (PAD: a zero block)."""
    if len(indices) % block:
        raise UserError(
            f"MatMulNBits {node.name!r}: a rank's {len(indices)} input rows are not whole blocks of {block}; "
            "use a tp that splits the heads/FFN width into whole quantization blocks"
        )
    out = []
    for start in range(0, len(indices), block):
        part = indices[start : start + block]
        if all(i == PAD for i in part):
            out.append(PAD)
        elif part[0] % block == 0 and list(part) == list(range(part[0], part[0] + block)):
            out.append(part[0] // block)
        else:
            raise UserError(
                f"MatMulNBits {node.name!r}: a rank's input rows {part[0]}..{part[-1]} cross a "
                f"quantization block of {block}; use a tp that splits on block boundaries"
            )
    return out


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
