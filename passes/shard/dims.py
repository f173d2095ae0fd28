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
    ATTENTION_OPS,
    ONE,
    REDUCE,
    UNKNOWN,
    Dim,
    Dims,
    Info,
    MaybeDim,
    World,
    align,
    attention_op,
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


@dataclass(frozen=True)
class HeadMap:
    """Query heads, KV heads and query heads per KV head of an attention block: the full model's and
    one rank's (planned by passes.shard.partition, zero heads included)."""

    full: tuple[int, int, int]
    rank: tuple[int, int, int]

    def candidates(self, d: MaybeDim, repeat: bool = False) -> list[MaybeDim]:
        """What a dim of the full model may become on the rank: a head count (times other factors)
        mapped to the rank's, KV heads first; a broadcast repeat axis (`repeat`) tries the group first."""
        if d is None or d == ONE or self.full == self.rank:
            return [d]
        order = (2, 0, 1) if repeat else (1, 0, 2)
        out: list[MaybeDim] = []
        for role in order:
            f, r = self.full[role], self.rank[role]
            if f > 1 and d.coef % f == 0:
                out.append(Dim(d.coef // f * r, d.syms))
        return [*dict.fromkeys(out), d]


@dataclass
class RankWorld:
    """The same graph as one rank sees it: `seeds` override the shapes of the projection weights.

    `heads(node)` gives, for nodes inside an attention branch, the branch's `HeadMap`: a Reshape maps
    head counts to the rank's, and an Expand that repeats KV heads for grouped-query attention repeats
    them as often as the rank's query heads need.
    `row_nodes` are the row-parallel MatMuls, whose contraction axis is sharded on purpose.
    `caches` are KV-cache graph inputs (decode graphs): each takes, on this rank, the shape of the new
    keys/values it is concatenated with (the rank's KV heads), except along the Concat axis.
    """

    full: World
    seeds: dict[ir.Value, Info]
    heads: Callable[[ir.Node], HeadMap | None]
    row_nodes: set[ir.Node]
    where: Callable[[ir.Node], str]
    caches: set[ir.Value] = field(default_factory=set)
    over: dict[ir.Value, Info] = field(default_factory=dict)
    rewrites: list[ShapeRewrite] = field(default_factory=list)
    attr_rewrites: list[tuple[ir.Node, str, int]] = field(default_factory=list)  # fused attention ops

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
            self.over, self.rewrites, self.attr_rewrites = {}, [], []
            self._run_once()
        return self

    def _run_once(self) -> None:
        self.over.update(self.seeds)
        for node in self.full.graph:
            if any(o in self.seeds for o in node.outputs):
                continue
            forced = node.op_type in ("Expand", "Tile") and self.heads(node) is not None
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
        if op in ATTENTION_OPS:
            return self._fused_attention(node, ins)
        if op == "RotaryEmbedding" and "num_heads" in node.attributes:
            self._rotary_heads(node, ins)
        if op == "Split" and self.heads(node) is not None and self._splits_changed_axis(node, ins):
            return self._split_packed(node, ins)
        self._check_axes(node, ins)
        if op == "Reshape":
            return [self._reshape(node, ins)]
        if op == "Expand":
            return [self._expand(node, ins)]
        if op == "Tile":
            return [self._tile(node, ins)]
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

    def _fused_attention(self, node: ir.Node, ins: Sequence[Info]) -> list[Info]:
        """A fused attention op runs the rank's heads: its head attributes and cache shapes change."""
        heads = self.heads(node)
        if heads is None:
            raise self._fail(node, "is a fused attention op outside an attention branch")
        q_r, kv_r, _ = heads.rank
        for value in node.inputs:
            full = self.full.get(value).shape if value in self.caches else None
            if full is not None and len(full) == 4 and value not in self.over:
                self.over[value] = Info((full[0], Dim(kv_r), full[2], full[3]))
        ins = [self.get(v) for v in node.inputs]
        names = (
            ("q_num_heads", "kv_num_heads") if node.op_type == "Attention" else ("num_heads", "kv_num_heads")
        )
        for name, value in zip(names, (q_r, kv_r), strict=True):
            if name in node.attributes:
                self.attr_rewrites.append((node, name, value))
        outs = attention_op(node, ins, q_r, kv_r)
        # present K/V: the full model's length (past + new), the rank's KV heads
        for k in range(1, len(outs)):
            full = self.full.get(node.outputs[k]).shape
            if full is not None and len(full) == 4:
                outs[k] = Info((full[0], Dim(kv_r), full[2], full[3]))
        return outs

    def _rotary_heads(self, node: ir.Node, ins: Sequence[Info]) -> None:
        """RotaryEmbedding on [b, s, heads * hd] names its heads: the rank's."""
        full, rank = self.full.get(node.inputs[0]).shape, ins[0].shape
        heads = int(node_attr(node, "num_heads", 0))
        if full is None or rank is None or len(full) != 3 or heads <= 0 or full[-1] == rank[-1]:
            return
        if full[-1] is None or rank[-1] is None or not (full[-1].is_int and rank[-1].is_int):
            raise self._fail(node, "rotates a sharded tensor of unknown width")
        head_dim = int(full[-1]) // heads
        self.attr_rewrites.append((node, "num_heads", int(rank[-1]) // head_dim))

    def _splits_changed_axis(self, node: ir.Node, ins: Sequence[Info]) -> bool:
        rank = len(ins[0].shape) if ins and ins[0].shape is not None else None
        changed = self._changed_axes(node.inputs[0])
        return rank is not None and node_attr(node, "axis", 0) % rank in changed

    def _split_packed(self, node: ir.Node, ins: Sequence[Info]) -> list[Info]:
        """A packed qkv projection split into q, k, v ([H*hd, K*hd, K*hd] columns): the rank's sizes."""
        heads = self.heads(node)
        assert heads is not None
        full_sizes = int_values(self.full.get(node.inputs[1])) if len(node.inputs) > 1 else None
        big, kv = heads.full[0], heads.full[1]
        if full_sizes is None or len(full_sizes) != 3 or sum(full_sizes) % (big + 2 * kv):
            raise self._fail(node, "splits a sharded axis into pieces that are not q, k and v")
        hd = sum(full_sizes) // (big + 2 * kv)
        if full_sizes != [big * hd, kv * hd, kv * hd]:
            raise self._fail(node, f"splits {full_sizes}, not q, k, v of {big}/{kv} heads of {hd}")
        sizes = [heads.rank[0] * hd, heads.rank[1] * hd, heads.rank[1] * hd]
        self.rewrites.append(ShapeRewrite(node, 1, list(sizes)))
        x = ins[0].shape
        assert x is not None
        axis = node_attr(node, "axis", 0) % len(x)
        return [Info(x[:axis] + (Dim(n),) + x[axis + 1 :]) for n in sizes]

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
            return Info(naive, ins[0].value)
        intended = _intended_reshape(full_in, full_out, ins[0].shape, self.heads(node))
        if intended is None:
            shapes = f"{fmt_dims(full_in)} -> {fmt_dims(full_out)}"
            raise self._fail(node, f"reshapes {shapes} in a way the pass cannot map")
        if naive == intended:
            return Info(naive, ins[0].value)
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

    def _tile(self, node: ir.Node, ins: Sequence[Info]) -> Info:
        """Tile over a size-1 axis repeats KV heads (TorchScript's repeat_interleave): as often as the
        rank's query heads need."""
        heads, x, repeats = self.heads(node), ins[0].shape, ins[1].value
        if heads is None or x is None or repeats is None or len(repeats) != len(x):
            return infer_node(node, ins)[0]  # type: ignore[index]
        values: list[int | None] = [None] * len(repeats)
        for k, (d, r) in enumerate(zip(x, repeats, strict=True)):
            if d == ONE and r is not None and r.is_int and int(r) > 1:
                new = heads.candidates(r, repeat=True)[0]
                if new != r and new is not None:
                    values[k] = int(new)
        if any(v is not None for v in values):
            self.rewrites.append(ShapeRewrite(node, 1, values))
        fixed = tuple(Dim(v) if v is not None else r for v, r in zip(values, repeats, strict=True))
        return infer_node(node, [ins[0], Info(ins[1].shape, fixed)])[0]  # type: ignore[index]

    def _expand(self, node: ir.Node, ins: Sequence[Info]) -> Info:
        data = node.inputs[0]
        target = ins[1].value
        x_full, x_rank = self.full.get(data).shape, ins[0].shape
        heads = self.heads(node)
        if (not self.changed(data) and heads is None) or target is None or x_full is None or x_rank is None:
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
        for k in range(offset, n):  # a repeat axis (x has 1 there): as many copies as the rank needs
            tk = t[k]
            if heads is not None and xf[k] == ONE and tk is not None and tk.is_int and int(tk) > 1:
                new = heads.candidates(tk, repeat=True)[0]
                if new != tk:
                    intended[k], values[k - offset] = new, int(new)
        if any(v is not None for v in values):
            self.rewrites.append(ShapeRewrite(node, 1, values))
        return Info(tuple(intended))


def _ratio(full: MaybeDim, rank: MaybeDim) -> int | None:
    if full is None or rank is None or not rank.divides(full):
        return None
    r = full // rank
    return int(r) if r.is_int else None


def _intended_reshape(
    full_in: Dims, full_out: Dims, rank_in: Dims, heads: HeadMap | None = None
) -> Dims | None:
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
        if heads is not None:
            found = _map_group([full_out[k] for k in gj], product(rank_in[k] for k in gi), heads)
            if found is None:
                return None
            for k, d in zip(gj, found, strict=True):
                out[k] = d
            continue
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


def _map_group(dims: list[MaybeDim], want: MaybeDim, heads: HeadMap) -> list[MaybeDim] | None:
    """Head-mapped dims whose product is `want`: the fewest changed dims, outer axes first (so a
    head_dim is never taken for a head count when changing the heads alone fits)."""
    if product(dims) == want:
        return dims
    if want is None:
        return None

    def search(k: int, chosen: list[MaybeDim], changes: int) -> list[MaybeDim] | None:
        if k == len(dims):
            return chosen if changes == 0 and product(chosen) == want else None
        for d in heads.candidates(dims[k]):
            left = changes - (d != dims[k])
            if left >= 0 and (found := search(k + 1, [*chosen, d], left)) is not None:
                return found
        return None

    for changes in range(1, len(dims) + 1):
        if (found := search(0, [], changes)) is not None:
            return found
    return None
