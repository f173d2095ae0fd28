"""The FFN Fusion rewrite: each planned group [i, j] becomes one wide SwiGLU FFN (paper Theorem 3.1).

    x_out = x + sum_k FFN_k(norm(x))  ==  x + W_down_cat (silu(z W_gate_cat) * (z W_up_cat))

with gate and up concatenated along the intermediate dimension and down along its input dimension.
"last" normalizes with the group's last norm weight (the paper); "fold" multiplies each block's own norm
weight into the rows of its W_gate and W_up, so every FFN sees exactly the input it saw in the parallel
form. Fused weights are `ConcatTensor`s (passes/io/stream_concat.py): written in row chunks straight from the
source weights while the model is saved, in the parts' own layout ([in, out], or [out, in] read through a
Transpose when every part is stored so), never whole in memory. int4 MatMulNBits weights are concatenated
as they are packed (along N for gate/up; along K for down, when block_size divides every part's K).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from passes.blocks import Block
from passes.errors import PassInputError, UserError
from passes.io.stream_concat import ConcatTensor, Part
from passes.matching import strip_cast
from passes.metadata import PLAN_METADATA_KEY
from passes.model_map import find_blocks
from passes.patterns import nbits
from passes.patterns.nbits import NBits
from passes.patterns.swiglu import Weight
from passes.plan import Plan, validate_plan


class FuseFFNGroups(ir.passes.InPlacePass):
    """Rewrite every group of the plan into one wide SwiGLU FFN; record the plan in the metadata.

    requires: SwiGLU blocks that the plan fits (passes.plan.validate_plan) and, in every group, weights that
    concatenate (int4 MatMulNBits: "last" only, one layout, a block size dividing every down K): else a
    PassInputError (a UserError) before anything is rewritten, so a refused plan leaves the model as it was.
    ensures: the plan's groups are one block each (blocks before - (j - i) per group); the fused model's
    block table is kept as `fused_blocks` for the next pass and validation.

    The stream is walked once per model (passes/model_map.py): a caller that has the model's block table
    passes it as `blocks`, and `requires` checks the plan against it instead of walking again.

    A group's FFN-free blocks (an attention-only first block, identity layers inside) stay as they are;
    its SwiGLU FFNs (`ffn_members`) become the one wide FFN, reading the stream its first one read.
    """

    def __init__(self, plan: Plan, blocks: list[Block] | None = None):
        super().__init__()
        self.plan = plan
        self._given = blocks
        self._checked: tuple[ir.Model, list[Block]] | None = None  # the blocks `requires` found, for `call`
        self.fused_blocks: list[Block] = []

    def requires(self, model: ir.Model) -> None:
        try:
            blocks = self._given if self._given is not None else find_blocks(model)
            validate_plan(self.plan, blocks)
            for group in self.plan.groups:
                _check_group(ffn_members(blocks, group), self.plan.norm)
        except UserError as exc:
            raise PassInputError(str(exc)) from None
        self._checked = (model, blocks)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self._checked is None or self._checked[0] is not model:  # PassBase runs `requires` just before
            self.requires(model)
        blocks, self._checked, self._given = self._checked[1], None, None  # stale once the graph changes
        self._expected_blocks = len(blocks) - self.plan.removed_blocks
        for group in self.plan.groups:
            _fuse_group(model.graph, ffn_members(blocks, group), self.plan.norm, group)
        model.metadata_props[PLAN_METADATA_KEY] = self.plan.to_json()
        if self.plan.groups:
            RemoveUnusedNodesPass()(model)
            model.graph.sort()
        return ir.passes.PassResult(model, modified=bool(self.plan.groups))

    def ensures(self, model: ir.Model) -> None:
        self.fused_blocks = find_blocks(model)
        if len(self.fused_blocks) != self._expected_blocks:
            raise AssertionError(
                f"fused model has {len(self.fused_blocks)} blocks, expected {self._expected_blocks}"
            )


def ffn_members(blocks: list[Block], group: tuple[int, int]) -> list[Block]:
    """The blocks of `group` (block numbers, inclusive) that have a SwiGLU FFN: what the group fuses."""
    first, last = group
    return [b for b in blocks if first <= b.index <= last and b.ffn is not None]


OUT, IN = "out", "in"  # gate/up are concatenated along their output dimension, down along its input
ROLES = (("gate", OUT), ("up", OUT), ("down", IN))


def _check_group(group: list[Block], mode: str) -> None:
    """A UserError when the group's weights cannot be concatenated into one FFN (checked before rewriting).
    `group`: its SwiGLU blocks."""
    first, last = group[0], group[-1]
    prefix = f"ffn_fusion.{first.index}_{last.index}"
    weights = {role: [getattr(b.ffn, role) for b in group] for role, _ in ROLES}
    if mode == "fold" and any(w.nbits is not None for role in weights.values() for w in role):
        raise UserError(
            f'group [{first.index}, {last.index}]: "fold" cannot fold norm weights into int4 MatMulNBits '
            'weights exactly; use "norm": "last"'
        )
    for role, along in ROLES:
        if any(w.nbits is not None for w in weights[role]):
            _check_nbits(f"{prefix}.{role}_proj", weights[role], along)


def _fuse_group(graph: ir.Graph, group: list[Block], mode: str, numbers: tuple[int, int]) -> None:
    """Fuse the SwiGLU blocks `group` of plan group `numbers` into one FFN at the last one's residual add."""
    first, last = group[0], group[-1]
    prefix = f"ffn_fusion.{numbers[0]}_{numbers[1]}"
    gates, ups, downs = ([getattr(b.ffn, role) for b in group] for role, _ in ROLES)
    z, row_scales = _shared_norm(graph, group, mode, prefix)
    gate = _fused_linear(graph, f"{prefix}.gate_proj", gates, OUT, row_scales)
    up = _fused_linear(graph, f"{prefix}.up_proj", ups, OUT, row_scales)
    down = _fused_linear(graph, f"{prefix}.down_proj", downs, IN, None)
    nodes, output = _swiglu_nodes(z, gate, up, down, prefix)
    residual = last.residual
    graph.insert_before(residual.node, nodes)
    residual.node.replace_input_with(residual.stream_slot, first.ffn_input)
    residual.node.replace_input_with(residual.branch_slot, output)


def _shared_norm(
    graph: ir.Graph, group: list[Block], mode: str, prefix: str
) -> tuple[ir.Value, list[np.ndarray] | None]:
    """The fused FFN's input, and the per-block norm weights to fold into gate/up rows ("fold")."""
    norm = group[0].norm
    node, slot = norm.weight_slot
    if mode == "last":
        node.replace_input_with(slot, group[-1].norm.weight)
        return norm.output, None
    row_scales = [strip_cast(b.norm.weight).const_value.numpy().astype(np.float32) for b in group]
    if norm.unscaled is not None:
        return norm.unscaled, row_scales
    scale = strip_cast(norm.weight).const_value
    ones = ir.Value(
        name=f"{prefix}.norm_ones", const_value=ir.tensor(np.ones(scale.shape, scale.dtype.numpy()))
    )
    graph.register_initializer(ones)
    node.replace_input_with(slot, ones)
    return norm.output, row_scales


@dataclass(frozen=True)
class FusedLinear:
    """The fused weight of one projection: a float matrix (stored [in, out], or [out, in] when every part
    was), or a MatMulNBits weight (packed values, scales, zero points and the node's attributes)."""

    weight: ir.Value
    transposed: bool = False
    nbits: tuple[ir.Value, ir.Value | None, dict] | None = None  # scales, zero points, attributes


def _fused_linear(
    graph: ir.Graph, name: str, weights: list[Weight], along: str, scales: list[np.ndarray] | None
) -> FusedLinear:
    if any(w.nbits is not None for w in weights):
        return _fused_nbits(graph, name, weights, along)
    transposed = all(w.transposed for w in weights)
    # In the stored layout, the output dimension is the rows when transposed, else the columns.
    axis = int(transposed) if along == IN else 1 - int(transposed)
    parts = [_float_part(w, transposed, None if scales is None else scales[k]) for k, w in enumerate(weights)]
    return FusedLinear(_register(graph, f"{name}.weight", parts, axis, weights[0].dtype), transposed)


def _float_part(weight: Weight, transposed: bool, scale: np.ndarray | None) -> Part:
    """The part of a float weight, in the fused layout; `scale` multiplies its input dimension ("fold")."""
    tensor = weight.source.const_value
    rows, cols = (int(d) for d in tensor.shape)
    columns = weight.columns  # a range of the [in, out] output dimension: stored rows when transposed
    row_range, col_range = (columns, None) if weight.transposed else (None, columns)
    return Part(
        tensor,
        rows,
        cols,
        row_range,
        col_range,
        transpose=weight.transposed != transposed,
        scale=scale,
        scale_axis=1 if transposed else 0,
    )


def _check_nbits(name: str, weights: list[Weight], along: str) -> None:
    """MatMulNBits parts concatenate along N when they share bits, block size and K; along K when they
    share N and block_size divides every part's K; and either way when they store zero points alike."""
    if any(w.nbits is None for w in weights):
        raise UserError(f"{name}: the group mixes int4 MatMulNBits and float weights; fuse them apart")
    first = weights[0].nbits
    same = {"bits": lambda w: w.nbits.bits, "block_size": lambda w: w.nbits.block_size}
    same |= {"K": lambda w: w.shape[0]} if along == OUT else {"N": lambda w: w.shape[1]}
    for attribute, get in same.items():
        if len({get(w) for w in weights}) != 1:
            raise UserError(
                f"{name}: the MatMulNBits parts differ in {attribute}; they cannot be concatenated"
            )
    if along == IN and (odd := [w.shape[0] for w in weights if w.shape[0] % first.block_size]):
        raise UserError(
            f"{name}: block_size {first.block_size} does not divide the down projections' K {odd}: their "
            "int4 blocks cannot be concatenated exactly along K; re-quantize with a block size that divides "
            "every FFN width"
        )
    types = {w.nbits.zero_points.const_value.dtype for w in weights if w.nbits.zero_points is not None}
    if len(types) > 1:
        raise UserError(f"{name}.zero_points: the MatMulNBits parts store zero points in different types")


def _fused_nbits(graph: ir.Graph, name: str, weights: list[Weight], along: str) -> FusedLinear:
    """MatMulNBits parts concatenated along N (gate/up: their packed rows one after the other) or along K
    (down: each row's blocks side by side, exact when block_size divides every part's K; _check_nbits)."""
    first = weights[0].nbits
    axis = 0 if along == OUT else 1
    k = first.k if along == OUT else sum(w.shape[0] for w in weights)
    n = sum(w.shape[1] for w in weights) if along == OUT else weights[0].shape[1]
    blocks, blob = -(-k // first.block_size), first.block_size * first.bits // 8
    packed = [_nbits_part(w, w.source.const_value, w.nbits.blocks * blob) for w in weights]
    packed = _register(graph, f"{name}.weight_q", packed, axis, ir.DataType.UINT8, (n, blocks, blob))
    scales = [_nbits_part(w, w.nbits.scales.const_value, w.nbits.blocks) for w in weights]
    scale_shape = (n, blocks) if len(first.scales.const_value.shape) == 2 else (n * blocks,)
    scales = _register(graph, f"{name}.scales", scales, axis, weights[0].dtype, scale_shape)
    zero_points = _fused_zero_points(graph, f"{name}.zero_points", weights, axis, n, blocks)
    attributes = {a.name: a.value for a in first.node.attributes.values()} | {"K": k, "N": n}
    return FusedLinear(packed, True, (scales, zero_points, attributes))


def _nbits_part(weight: Weight, tensor, per_row: int, transform=None, width=None) -> Part:
    """Rows of a MatMulNBits input ([N, per_row] viewed), those of the weight's N range for a gate_up half."""
    q = weight.nbits
    return Part(tensor, q.n, per_row, row_range=weight.columns, transform=transform, width=width)


def _fused_zero_points(graph, name, weights: list[Weight], axis: int, n: int, blocks: int) -> ir.Value | None:
    quants = [w.nbits for w in weights]
    if all(q.zero_points is None for q in quants):
        return None
    dtype = next(q.zero_points.const_value.dtype for q in quants if q.zero_points is not None)
    bits = quants[0].bits
    if dtype != ir.DataType.UINT8:  # zero points in the scales' type, one per block
        parts = [
            _nbits_part(w, _zero_points(w.nbits, w.nbits.blocks, dtype), w.nbits.blocks) for w in weights
        ]
        return _register(graph, name, parts, axis, dtype, (n * blocks,))
    per_row = -(-blocks * bits // 8)
    packed = [(w, _zero_points(w.nbits, -(-w.nbits.blocks * bits // 8), dtype)) for w in weights]
    if axis == 0:  # along N: whole packed rows, one part after the other
        parts = [_nbits_part(w, t, -(-w.nbits.blocks * bits // 8)) for w, t in packed]
        return _register(graph, name, parts, axis, dtype, (n * per_row,))
    # Along K a part may end mid-byte: unpack each row chunk to one field per block, then pack again.
    parts = [
        _nbits_part(w, t, -(-w.nbits.blocks * bits // 8), _unpacker(bits, w.nbits.blocks), w.nbits.blocks)
        for w, t in packed
    ]
    return _register(graph, name, parts, axis, dtype, (n * per_row,), finish=lambda c: nbits.pack(c, bits))


def _zero_points(q: NBits, per_row: int, dtype: ir.DataType):
    """The stored zero points, or the default 2^(bits - 1) in every field when the part has none."""
    if q.zero_points is not None:
        return q.zero_points.const_value
    if dtype != ir.DataType.UINT8:
        return np.full((q.n, per_row), 2.0 ** (q.bits - 1), dtype.numpy())
    byte = sum((1 << (q.bits - 1)) << shift for shift in range(0, 8, q.bits))
    return np.full((q.n, per_row), byte, np.uint8)


def _unpacker(bits: int, fields: int):
    return lambda chunk: nbits.unpack(chunk, bits)[:, :fields]


def _register(
    graph: ir.Graph,
    name: str,
    parts: list[Part],
    axis: int,
    dtype: ir.DataType,
    shape: tuple[int, ...] | None = None,
    finish=None,
) -> ir.Value:
    rows = sum(p.shape[0] for p in parts) if axis == 0 else parts[0].shape[0]
    cols = parts[0].shape[1] if axis == 0 else sum(p.shape[1] for p in parts)
    shape = shape if shape is not None else (rows, cols)
    tensor = ConcatTensor(parts, axis, dtype, shape, name, finish=finish)
    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def _swiglu_nodes(
    z: ir.Value, gate: FusedLinear, up: FusedLinear, down: FusedLinear, prefix: str
) -> tuple[list[ir.Node], ir.Value]:
    nodes: list[ir.Node] = []

    def node(op: str, inputs: list[ir.Value | None], suffix: str, **kwargs) -> ir.Value:
        out = ir.Value(name=f"{prefix}.{suffix}")
        nodes.append(
            ir.Node(kwargs.pop("domain", ""), op, inputs, outputs=[out], name=f"{prefix}/{suffix}", **kwargs)
        )
        return out

    def linear(x: ir.Value, fused: FusedLinear, suffix: str) -> ir.Value:
        if fused.nbits is not None:
            scales, zero_points, attributes = fused.nbits
            inputs = [x, fused.weight, scales] + ([zero_points] if zero_points is not None else [])
            attrs = [ir.Attr(k, _attribute_type(v), v) for k, v in sorted(attributes.items())]
            return node("MatMulNBits", inputs, suffix, domain="com.microsoft", attributes=attrs)
        weight = fused.weight
        if fused.transposed:
            perm = [ir.Attr("perm", ir.AttributeType.INTS, [1, 0])]
            weight = node("Transpose", [weight], f"{suffix}_weight_t", attributes=perm)
        return node("MatMul", [x, weight], suffix)

    gate_out = linear(z, gate, "gate")
    silu = node("Mul", [gate_out, node("Sigmoid", [gate_out], "sigmoid")], "silu")
    product = node("Mul", [silu, linear(z, up, "up")], "product")
    return nodes, linear(product, down, "down")


def _attribute_type(value) -> ir.AttributeType:
    if isinstance(value, int):
        return ir.AttributeType.INT
    if isinstance(value, float):
        return ir.AttributeType.FLOAT
    return ir.AttributeType.STRING
