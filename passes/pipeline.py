"""The main job, start to finish: load, validate the plan, fuse (FFN groups, then parallel blocks), save
atomically, check by numbers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from passes.blocks import Block
from passes.errors import UserError
from passes.fuse import FuseFFNGroups
from passes.io.model_io import (
    EXTERNAL_DATA_THRESHOLD,
    commit_output,
    has_external_data,
    load_model,
    save_model,
    staged_output,
    weight_bytes,
)
from passes.model_map import find_blocks
from passes.parallel import ParallelizeBlocks
from passes.plan import Plan, validate_plan
from passes.validate import ValidationError, ValidationReport, validate


@dataclass
class FuseResult:
    output: Path
    blocks_before: list[Block]
    blocks_after: int
    nodes_before: int
    nodes_after: int
    external_data: bool
    report: ValidationReport | None


def default_output(model_path: Path) -> Path:
    return model_path.with_name(model_path.name.removesuffix(".onnx") + ".fused.onnx")


def fuse_file(
    model_path: Path,
    plan: Plan,
    output: Path | None = None,
    validate_output: bool = True,
    tokens: np.ndarray | None = None,
    log: Callable[[str], None] = lambda message: None,
    max_data_file_bytes: int | None = None,
) -> FuseResult:
    model_path = Path(model_path)
    output = Path(output) if output is not None else default_output(model_path)
    if output.resolve() == model_path.resolve():
        raise UserError(f"output {output} is the input model; choose another path with -o")
    model = load_model(model_path)
    blocks = find_blocks(model)
    validate_plan(plan, blocks)
    nodes_before = len(model.graph)
    log(f"fusing {len(plan.groups)} group(s) of {len(blocks)} blocks, norm={plan.norm}")
    # The stream is walked once per model: the original's table here, the fused one by FuseFFNGroups.ensures;
    # both are handed on to the next pass and to validation.
    fuse = FuseFFNGroups(plan, blocks)
    fuse(model)
    if plan.parallel:  # after the FFN groups: the block walk cannot read a parallelized graph
        log(f"parallelizing {len(plan.parallel)} group(s) of whole blocks")
        ParallelizeBlocks(plan, fuse.fused_blocks)(model)
    external = has_external_data(model_path) or weight_bytes(model) > EXTERNAL_DATA_THRESHOLD
    with staged_output(output) as staging:
        staged = staging / output.name
        log(f"writing {output}" + (" (+ its external data)" if external else ""))
        save_model(model, staged, external, max_data_file_bytes)
        report = None
        if validate_output:
            log("validating with ONNX Runtime against the original and the parallel-sum reference")
            # The original's records are read for weights only; a parallel plan's check also follows the
            # residual adds, which the rewrite rewired in memory: it walks the file again.
            known = {} if plan.parallel else {"original_blocks": blocks, "fused_blocks": fuse.fused_blocks}
            report = validate(model_path, staged, plan, tokens, **known)
            if not report.ok:
                raise ValidationError("; ".join(report.lines()) + " -- fused model not written")
        commit_output(staged, output)
    return FuseResult(
        output, blocks, len(blocks) - plan.removed_blocks, nodes_before, len(model.graph), external, report
    )
