"""Fused and parallel-block graphs: exact per group (passes.validate), and every weight outside the fused
groups unchanged."""

from __future__ import annotations

import json

from passes.blocks import Block
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.plan import Plan
from passes.validate import ValidationError, plan_from_metadata, validate
from runtime.verify.common import same_initializers
from runtime.verify.records import VerifyReport


def group_tensors(blocks: list[Block]) -> set[str]:
    """Names of the initializers any block's FFN or norm reads (what fusion and healing rewrite)."""
    names = set()
    for block in blocks:
        if block.ffn is not None:
            for weight in (block.ffn.gate, block.ffn.up, block.ffn.down):
                names.add(weight.source.name)
        if block.norm is not None and block.norm.weight is not None:
            names.add(block.norm.weight.name)
    return names


def fused_group_blocks(plan: Plan, blocks: list[Block]) -> list[Block]:
    """The fused blocks of `plan`'s FFN groups in the fused model's block table `blocks`."""
    return [blocks[first - sum(j - i for i, j in plan.groups if j < first)] for first, _ in plan.groups]


def verify_fused(report: VerifyReport) -> None:
    original, artifact = report.original, report.artifact
    plan = plan_from_metadata(artifact)
    report.notes.append(f"plan {plan.to_json()}")
    report.plan = json.loads(plan.to_json())
    try:
        result = validate(original, artifact, plan)
    except ValidationError as exc:  # the structure itself is wrong (block count, a group's width, ...)
        report.add("structure", False, str(exc))
        return
    report.notes.extend(result.notes)
    report.add("structure", True, "block table and group widths as the plan gives")
    if result.logits_rel_error is not None:
        report.notes.append(
            f"logits vs original: relative error {result.logits_rel_error:.4g}, cosine "
            f"{result.logits_cosine:.6f} (fusion approximates: reported, not bounded)"
        )
    for group in result.groups:
        what = "parallel group" if group.kind == "parallel" else "group"
        report.add(
            f"{what} {list(group.group)} exact",
            group.rel_error <= result.tolerance,
            f"relative error {group.rel_error:.3g} vs the reference sum of the original blocks "
            f"(<= {result.tolerance:g}, {result.mode})",
            rel_error=group.rel_error,
            tolerance=result.tolerance,
        )
    _unchanged(report, plan)


def _unchanged(report: VerifyReport, plan: Plan) -> None:
    original, artifact = load_model(report.original), load_model(report.artifact)
    # A parallel plan's graph cannot be walked into blocks; its rewrite keeps every weight's name and value.
    skip = set() if plan.parallel else group_tensors(fused_group_blocks(plan, find_blocks(artifact)))
    same_initializers(report, original, artifact, skip, "weights outside the fused FFNs")
