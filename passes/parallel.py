"""Full-block parallelization (paper section 6, design §10): each planned group of whole blocks i..j reads one
stream x, and the group adds up their residual branches:

    y = x + sum_k a_k + sum_k f_k,   a_k = Attn_k(norm1_k(x)),   f_k = FFN_k(norm2_k(x + a_k))

Graph form: every block k > i of the group reads x (block i's input) for its norm1 and its attention residual
add, instead of the previous block's output; the last block's FFN residual add then reads x and the sum of
the group's branches (attention branches summed, FFN branches summed, then the two: the order a tensor-
parallel form reduces them in), so its output is y for everything downstream. Branches are summed rather than
taking out_k - x, which would cancel. The residual adds of blocks i..j-1's FFNs are left without readers and
removed. The attention cores, their KV caches and the graph outputs are untouched: only stream inputs move.

Residual adds come in the forms passes.blocks.ResidualAdd abstracts: a plain Add, or ONNX Runtime's
SkipSimplifiedLayerNormalization (output 0 the next norm of the sum, output 3 the sum). In the latter, block
k's norm1 is computed by block k-1's FFN residual node; a block k > i gets its own
SimplifiedLayerNormalization of x with the same weight and epsilon. Other forms are refused in one line.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from passes.blocks import Block, ResidualAdd
from passes.errors import PassInputError, UserError
from passes.matching import attr
from passes.metadata import PLAN_METADATA_KEY, recorded_plan
from passes.model_map import find_blocks
from passes.plan import Plan, validate_plan

RESIDUAL_FORMS = ("Add", "SkipSimplifiedLayerNormalization")


class ParallelizeBlocks(ir.passes.InPlacePass):
    """Rewrite every parallel group of the plan into the parallel form; record the plan in the metadata.

    Block numbers are the layers of the model the plan was written for. When the plan also has FFN groups,
    FuseFFNGroups runs first (passes/pipeline.py) and records the plan in the metadata; this pass then finds
    block b at position b - (blocks the FFN groups before b removed).

    requires: a plan that fits the model (passes.plan.validate_plan: full blocks, no overlap) and residual
    adds of a form above; else a PassInputError (a UserError) before anything is rewritten.
    ensures: in each group, every block's attention residual reads x and the group's last residual add
    reads x and the branch sum.

    `blocks`: the model's block table when the caller has it (FuseFFNGroups.fused_blocks), so that the
    stream is not walked again.
    """

    def __init__(self, plan: Plan, blocks: list[Block] | None = None):
        super().__init__()
        self.plan = plan
        self._given = blocks
        self._checked: ir.Model | None = None  # the model `requires` found self._groups in
        self._groups: list[list[Block]] = []

    def requires(self, model: ir.Model) -> None:
        try:
            blocks = self._given if self._given is not None else find_blocks(model)
            shift = _applied_ffn_groups(model, self.plan)
            if not shift:
                validate_plan(self.plan, blocks)
            self._groups = [_members(blocks, group, shift) for group in self.plan.parallel]
            for group, members in zip(self.plan.parallel, self._groups, strict=True):
                _check_forms(group, members)
            self._checked = model
        except UserError as exc:
            raise PassInputError(str(exc)) from None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self._checked is not model:  # PassBase runs `requires` just before; a direct call does not
            self.requires(model)
        self._checked, self._given = None, None
        for group, members in zip(self.plan.parallel, self._groups, strict=True):
            _parallelize(model.graph, members, group)
        model.metadata_props[PLAN_METADATA_KEY] = self.plan.to_json()
        if self.plan.parallel:
            RemoveUnusedNodesPass()(model)
            model.graph.sort()
        return ir.passes.PassResult(model, modified=bool(self.plan.parallel))

    def ensures(self, model: ir.Model) -> None:
        for group, members in zip(self.plan.parallel, self._groups, strict=True):
            x = members[0].block_input
            last = members[-1].residual
            inputs = [b.attention_residual.stream_in for b in members] + [last.stream_in]
            if any(_through_copies(value) is not x for value in inputs):
                raise AssertionError(f"parallel group {list(group)}: a block does not read the group input")
        self._groups = []


def _through_copies(value: ir.Value) -> ir.Value:
    """The value a Cast/Identity copy copies (Optimum casts the stream before residual adds and norms)."""
    while (node := value.producer()) is not None and node.op_type in ("Cast", "Identity"):
        value = node.inputs[0]
    return value


def _applied_ffn_groups(model: ir.Model, plan: Plan) -> tuple[tuple[int, int], ...]:
    """The plan's FFN groups when FuseFFNGroups has applied them to `model` (its metadata says so)."""
    if not plan.groups:
        return ()
    recorded = recorded_plan(model.metadata_props)
    if (recorded.groups if recorded else ()) != plan.groups:
        raise UserError("the plan's FFN groups are not fused yet: run FuseFFNGroups before ParallelizeBlocks")
    return plan.groups


def _members(blocks: list[Block], group: tuple[int, int], shift: tuple[tuple[int, int], ...]) -> list[Block]:
    """The blocks of parallel group `group` (original numbers) in `blocks`, whose FFN groups `shift` fused."""
    first, last = group
    position = first - sum(j - i for i, j in shift if j < first)
    return blocks[position : position + last - first + 1]


def _check_forms(group: tuple[int, int], members: list[Block]) -> None:
    """Refuse residual adds the rewrite does not know, naming the group and the block."""
    for block in members:
        if block.attention_residual is None or block.residual is None or block.ffn is None:
            raise UserError(f"parallel group {list(group)}: block {block.index} is not a full block")
        for residual in (block.attention_residual, block.residual):
            node = residual.node
            if node.op_type not in RESIDUAL_FORMS:
                raise UserError(
                    f"parallel group {list(group)}: block {block.index} adds a branch with {node.op_type} "
                    f"({node.name}); parallel blocks take Add and SkipSimplifiedLayerNormalization only"
                )
            if node.op_type != "Add" and len(node.inputs) > 3 and node.inputs[3] is not None:
                raise UserError(
                    f"parallel group {list(group)}: block {block.index}'s {node.op_type} ({node.name}) "
                    "adds a bias to the stream; parallel blocks take it without bias only"
                )
        stats = block.residual.node.outputs[1:3] if block.residual.node.op_type != "Add" else []
        if any(v.uses() for v in stats):
            raise UserError(
                f"parallel group {list(group)}: block {block.index}'s residual node's mean/inv_std_var "
                "outputs are read; parallel blocks cannot move them"
            )


def _parallelize(graph: ir.Graph, members: list[Block], group: tuple[int, int]) -> None:
    prefix = f"parallel_blocks.{group[0]}_{group[1]}"
    x = members[0].block_input
    for previous, block in zip(members, members[1:], strict=False):
        _read_group_input(graph, previous.residual, block, x, prefix)
    attention_nodes, attention = _sum(
        [b.attention_residual.branch for b in members], f"{prefix}.attention_sum"
    )
    ffn_nodes, ffn = _sum([b.residual.branch for b in members], f"{prefix}.ffn_sum")
    total_nodes, branches = _sum([attention, ffn], f"{prefix}.branch_sum")
    last = members[-1].residual
    # Every branch is computed before the last block's residual add (the graph is sorted again after).
    graph.insert_before(last.node, [*attention_nodes, *ffn_nodes, *total_nodes])
    last.node.replace_input_with(last.stream_slot, x)
    last.node.replace_input_with(last.branch_slot, branches)


def _read_group_input(graph: ir.Graph, previous: ResidualAdd, block: Block, x: ir.Value, prefix: str) -> None:
    """Make `block` read the group input x where it read `previous`'s sum (its norm1, its attention add)."""
    node = previous.node
    if node.op_type != "Add":  # Skip*Norm: output 0 is block's norm1 of the sum; give it a norm of x
        normalized = node.outputs[0]
        if normalized.uses():
            name = f"{prefix}.norm1_{block.index}"
            epsilon = ir.Attr("epsilon", ir.AttributeType.FLOAT, attr(node, "epsilon", 1e-5))
            axis = ir.Attr("axis", ir.AttributeType.INT, -1)
            norm = ir.Node(
                "",
                "SimplifiedLayerNormalization",
                [x, node.inputs[2]],
                attributes=[axis, epsilon],
                outputs=[ir.Value(name=name)],
                name=name,
            )
            graph.insert_before(node, norm)
            normalized.replace_all_uses_with(norm.outputs[0])
    block.block_input.replace_all_uses_with(x)


def _sum(values: list[ir.Value], name: str) -> tuple[list[ir.Node], ir.Value]:
    """Add nodes computing values[0] + values[1] + ..., and the total."""
    nodes, total = [], values[0]
    for k, value in enumerate(values[1:], start=1):
        node = ir.Node("", "Add", [total, value], outputs=[ir.Value(name=f"{name}_{k}")], name=f"{name}_{k}")
        nodes.append(node)
        total = node.outputs[0]
    return nodes, total
