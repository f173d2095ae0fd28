"""The rank world of the tensor-parallel sharding pass: the graph as one rank sees it.

`RankWorld` re-runs the symbolic shape interpreter (passes.shapes) with the projection weights at their
per-rank shapes, re-evaluating only nodes downstream of a changed tensor. It checks that no reduction,
softmax, slice or concat runs over a sharded axis, and works out which Reshape/Expand shape arguments
must change (the constants that encode head counts), recording them as `ShapeRewrite`s for
passes.shard to apply.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx_ir as ir

from passes.errors import UserError
from passes.shapes import (
    ONE,
    REDUCE,
    UNKNOWN,
    Dim,
    Dims,
    Info,
    MaybeDim,
    World,
    align,
    axes_from,
    broadcast,
    contraction_dims,
    fmt_dims,
    infer_node,
    int_values,
    node_attr,
    product,
    reshape_dims,
)


@dataclass
class ShapeRewrite:
    """Node `node`'s input `index` (a shape vector) must hold `values` on this rank."""

    node: ir.Node
    index: int
    values: list[int | None]  # None: keep that element as it is computed now


@dataclass
class RankWorld:
    """The same graph as one rank sees it: `seeds` override the shapes of the projection weights.

    `head_ratio(node)` gives, for nodes inside an attention branch, how many times fewer query heads the
    rank has (tp); an Expand that repeats KV heads for grouped-query attention is fixed to match it.
    `row_nodes` are the row-parallel MatMuls, whose contraction axis is sharded on purpose.
    `caches` are KV-cache graph inputs (decode graphs): each takes, on this rank, the shape of the new
    keys/values it is concatenated with (the rank's KV heads), except along the Concat axis.
    """

    full: World
    seeds: dict[ir.Value, Info]
    head_ratio: Callable[[ir.Node], int | None]
    row_nodes: set[ir.Node]
    where: Callable[[ir.Node], str]
    caches: set[ir.Value] = field(default_factory=set)
    over: dict[ir.Value, Info] = field(default_factory=dict)
    rewrites: list[ShapeRewrite] = field(default_factory=list)

    def get(self, value: ir.Value | None) -> Info:
        if value is None:
            return UNKNOWN
        if value in self.over:
            return self.over[value]
        return self.full.get(value)

    def changed(self, value: ir.Value | None) -> bool:
        return value is not None and value in self.over

    def run(self) -> RankWorld:
        self._run_once()
        # A cache input gets its rank shape at its Concat; a Shape node that read it earlier in the graph
        # saw the full shape: run again with the cache shapes known from the start.
        early = {v: self.over[v] for v in self.caches if v in self.over and len(v.uses()) > 1}
        if early:
            self.seeds = {**self.seeds, **early}
            self.over, self.rewrites = {}, []
            self._run_once()
        return self

    def _run_once(self) -> None:
        self.over.update(self.seeds)
        for node in self.full.graph:
            if any(o in self.seeds for o in node.outputs):
                continue
            forced = node.op_type == "Expand" and self.head_ratio(node) is not None
            if not forced and not any(self.changed(v) for v in node.inputs):
                continue
            outs = self._infer(node)
            for k, out in enumerate(node.outputs):
                info = outs[k] if k < len(outs) else UNKNOWN
                if info != self.full.get(out):
                    self.over[out] = info

    # --------------------------------------------------------------------------------- per node

    def _fail(self, node: ir.Node, why: str) -> UserError:
        return UserError(f"cannot shard {self.where(node)}: {node.op_type} node {node.name!r} {why}")

    def _changed_axes(self, value: ir.Value | None) -> set[int]:
        if not self.changed(value):
            return set()
        full, rank = self.full.get(value).shape, self.get(value).shape
        if full is None or rank is None or len(full) != len(rank):
            return {-1}
        return {k for k, (f, r) in enumerate(zip(full, rank, strict=True)) if f != r}

    def _infer(self, node: ir.Node) -> list[Info]:
        op = node.op_type
        if op == "Concat" and any(v in self.caches for v in node.inputs):
            self._shape_caches(node)
        ins = [self.get(v) for v in node.inputs]
        self._check_axes(node, ins)
        if op == "Reshape":
            return [self._reshape(node, ins)]
        if op == "Expand":
            return [self._expand(node, ins)]
        if op in ("MatMul", "Gemm") and node not in self.row_nodes:
            full_k = contraction_dims(node, *(self.full.get(v).shape for v in node.inputs[:2]))
            rank_k = contraction_dims(node, ins[0].shape, ins[1].shape)
            if full_k != rank_k:
                raise self._fail(node, "contracts over a sharded axis (not the branch's last projection)")
        try:
            outs = infer_node(node, ins)
        except ValueError as exc:
            raise self._fail(node, f"gets shapes that no longer match on one rank ({exc})") from None
        if outs is None:
            raise self._fail(node, "is not supported on a sharded tensor")
        if op == "Concat":
            outs = [self._concat_axis_as_full(node, outs[0])]
        return outs

    def _concat_axis_as_full(self, node: ir.Node, out: Info) -> Info:
        """No input changed along the Concat axis (checked), so that dim is the full model's (which
        knows it from the annotation when it is a sum such as past_len + seq)."""
        full = self.full.get(node.outputs[0]).shape
        if out.shape is None or full is None or len(full) != len(out.shape):
            return out
        axis = node_attr(node, "axis", 0) % len(full)
        shape = tuple(full[k] if k == axis and full[k] is not None else d for k, d in enumerate(out.shape))
        return Info(shape, out.value)

    def _shape_caches(self, node: ir.Node) -> None:
        """The rank shape of each cache input of `node`: that of the computed input it is concatenated
        with (same KV heads), and the full model's length along the Concat axis."""
        computed = [v for v in node.inputs if v is not None and v not in self.caches]
        ref = self.get(computed[0]).shape if computed else None
        if ref is None:
            raise self._fail(node, "concatenates a cache input with a tensor whose rank shape is unknown")
        axis = node_attr(node, "axis", 0) % len(ref)
        for value in node.inputs:
            if value not in self.caches:
                continue
            full = self.full.get(value).shape
            if full is None or len(full) != len(ref):
                raise self._fail(node, f"reads the cache input {value.name!r}, whose rank is unknown")
            rank = tuple(full[k] if k == axis else ref[k] for k in range(len(ref)))
            if any(r is None and f is not None for r, f in zip(rank, full, strict=True)):
                raise self._fail(node, f"cannot tell the rank shape of the cache input {value.name!r}")
            if rank != full:
                self.over[value] = Info(rank)

    def _check_axes(self, node: ir.Node, ins: Sequence[Info]) -> None:
        op = node.op_type
        x = node.inputs[0] if node.inputs else None
        rank = len(ins[0].shape) if ins and ins[0].shape is not None else None
        if op == "Concat" and rank is not None:
            axis = node_attr(node, "axis", 0) % rank
            if any(axis in self._changed_axes(v) or -1 in self._changed_axes(v) for v in node.inputs):
                raise self._fail(node, "concatenates along a sharded axis")
            return
        changed = self._changed_axes(x)
        if not changed or rank is None:
            return
        if op in REDUCE:
            axes = axes_from(node, ins, 1)
            hit = axes is None or any(a % rank in changed for a in axes)
        elif op in ("Softmax", "LogSoftmax", "CumSum"):
            hit = -1 in changed or node_attr(node, "axis", -1) % rank in changed
        elif op in ("Split", "Gather"):
            hit = -1 in changed or node_attr(node, "axis", 0) % rank in changed
        elif op == "Slice":
            axes = int_values(ins[3]) if len(ins) > 3 and ins[3].shape is not None else None
            axes = axes if axes is not None else list(range(len(int_values(ins[1]) or [])))
            hit = -1 in changed or any(a % rank in changed for a in axes)
        elif op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
            hit = True
        else:
            hit = False
        if hit:
            raise self._fail(node, "works along a sharded axis")

    def _reshape(self, node: ir.Node, ins: Sequence[Info]) -> Info:
        allowzero = bool(node_attr(node, "allowzero", 0))
        data = node.inputs[0]
        target = ins[1].value
        naive = reshape_dims(ins[0].shape, target, allowzero)
        full_in, full_out = self.full.get(data).shape, self.full.get(node.outputs[0]).shape
        if not self.changed(data) or full_in is None or full_out is None or ins[0].shape is None:
            return Info(naive)
        intended = _intended_reshape(full_in, full_out, ins[0].shape)
        if intended is None:
            shapes = f"{fmt_dims(full_in)} -> {fmt_dims(full_out)}"
            raise self._fail(node, f"reshapes {shapes} in a way the pass cannot map")
        if naive == intended:
            return Info(naive)
        if target is None:
            raise self._fail(node, "has a shape argument the pass cannot follow")
        values: list[int | None] = [None] * len(target)
        for k, (t, want) in enumerate(zip(target, intended, strict=True)):
            if t is not None and t in (Dim(-1), Dim(0)):
                continue
            if t != want:
                if want is None or not want.is_int:
                    raise self._fail(node, f"needs shape element {k} = {want}, which is not a constant")
                values[k] = int(want)
        fixed = tuple(Dim(v) if v is not None else t for v, t in zip(values, target, strict=True))
        if reshape_dims(ins[0].shape, fixed, allowzero) != intended:
            raise self._fail(node, f"cannot be rewritten to produce {fmt_dims(intended)}")
        self.rewrites.append(ShapeRewrite(node, 1, values))
        return Info(intended)

    def _expand(self, node: ir.Node, ins: Sequence[Info]) -> Info:
        data = node.inputs[0]
        target = ins[1].value
        x_full, x_rank = self.full.get(data).shape, ins[0].shape
        want = self.head_ratio(node)
        if (not self.changed(data) and want is None) or target is None or x_full is None or x_rank is None:
            try:
                return Info(broadcast(x_rank, target) if target is not None else None)
            except ValueError as exc:
                raise self._fail(node, str(exc)) from None
        n = max(len(target), len(x_full))
        xf = (ONE,) * (n - len(x_full)) + tuple(x_full)
        xr = (ONE,) * (n - len(x_rank)) + tuple(x_rank)
        t = (None,) * (n - len(target)) + tuple(target)
        values: list[int | None] = [None] * len(target)
        offset = n - len(target)
        intended: list[MaybeDim] = []
        for k in range(n):
            if xf[k] != xr[k]:
                intended.append(xr[k])
                if k >= offset and t[k] not in (ONE, xr[k]):
                    values[k - offset] = 1
            else:
                intended.append(broadcast((xf[k],), (t[k],))[0] if t[k] is not None else xf[k])
        ratio_in = _ratio(product(xf), product(xr))
        if want is not None and ratio_in is not None and ratio_in != want:
            if want % ratio_in:
                raise self._fail(node, f"repeats heads {ratio_in}x fewer than the query heads ({want})")
            extra = want // ratio_in
            for k in range(offset, n):
                tk = t[k]
                if xf[k] == ONE and tk is not None and tk.is_int and int(tk) > 1 and int(tk) % extra == 0:
                    intended[k] = Dim(int(tk) // extra)
                    values[k - offset] = int(tk) // extra
                    break
            else:
                raise self._fail(node, "repeats KV heads in a way the pass cannot rescale")
        if any(v is not None for v in values):
            self.rewrites.append(ShapeRewrite(node, 1, values))
        return Info(tuple(intended))


def _ratio(full: MaybeDim, rank: MaybeDim) -> int | None:
    if full is None or rank is None or not rank.divides(full):
        return None
    r = full // rank
    return int(r) if r.is_int else None


def _intended_reshape(full_in: Dims, full_out: Dims, rank_in: Dims) -> Dims | None:
    """The rank's Reshape output: each axis group shrinks by its input's ratio, outermost axes first.

    Heads are outer to head_dim in every projection layout, so a split [H*hd] -> [H, hd] divides H; a
    grouped-query view [H] -> [KV, G] divides KV first and G with what is left (KV replicated)."""
    if len(full_in) != len(rank_in):
        return None
    groups = align(full_in, full_out)
    if groups is None:
        return None
    out = list(full_out)
    for gi, gj in groups:
        ratio = _ratio(product(full_in[k] for k in gi), product(rank_in[k] for k in gi))
        if ratio is None:
            return None
        for k in gj:
            if ratio == 1:
                break
            d = full_out[k]
            if d is None or d == ONE:
                continue
            g = math.gcd(d.coef, ratio)
            if g > 1:
                out[k] = Dim(d.coef // g, d.syms)
                ratio //= g
        if ratio != 1:
            return None
    return tuple(out)
