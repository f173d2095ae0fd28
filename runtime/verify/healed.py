"""Healed graphs (heal.py): the fused structure of their plan (FFN groups' widths, parallel groups'
members), every healed tensor equal to what the heal recorded (sha256 per tensor in ffn_fusion.heal), every
other weight equal to the original's, and the quality against the original on held-out text (KL, top-1),
bounded by `max_kl`."""

from __future__ import annotations

import json

from passes.blocks import Block
from passes.errors import UserError
from passes.fuse import ffn_members
from passes.io.model_io import load_model
from passes.model_map import find_blocks, vocab_size
from passes.plan import Plan
from passes.validate import check_structure, plan_from_metadata
from runtime.evaluate import evaluate
from runtime.heal.metadata import HEAL_METADATA_KEY, TENSOR_HASHES_KEY
from runtime.text_sets import evaluation_sets
from runtime.verify.common import metadata_json, same_initializers, tensor_sha256
from runtime.verify.fused import fused_group_blocks, group_tensors
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport


def verify_healed(report: VerifyReport, options: VerifyOptions) -> None:
    artifact = report.artifact
    record = metadata_json(artifact, HEAL_METADATA_KEY) or {}
    hashes = record.get(TENSOR_HASHES_KEY)
    if not hashes:
        raise UserError(
            f"{artifact} was healed before heal.py recorded its tensors' hashes (no {TENSOR_HASHES_KEY} in "
            f"{HEAL_METADATA_KEY}); heal it again with this version to verify it"
        )
    plan = plan_from_metadata(artifact)
    report.notes.append(f"plan {plan.to_json()}; {len(hashes)} healed tensors recorded")
    report.plan = json.loads(plan.to_json())
    report.notes.extend(check_structure(artifact))
    original_model, healed_model = load_model(report.original), load_model(artifact)
    original_blocks = find_blocks(original_model)
    try:
        healed_blocks = find_blocks(healed_model)
    except UserError as exc:
        report.add("structure", False, f"the block walk cannot read the healed graph: {exc}")
        return
    if not _structure(report, plan, original_blocks, healed_blocks):
        return
    _hashes(report, healed_model, hashes)
    skip = set(hashes) | group_tensors(fused_group_blocks(plan, healed_blocks))
    same_initializers(report, original_model, healed_model, skip, "weights outside the healed groups")
    del original_model, healed_model
    _quality(report, options, vocab_size(original_blocks))


def _structure(
    report: VerifyReport, plan: Plan, original_blocks: list[Block], healed_blocks: list[Block]
) -> bool:
    """Block count, each FFN group's fused width, and each parallel group: its members, in place, marked
    as one group by the block walk (one stream in, one sum out), each with its original FFN width."""
    expected = len(original_blocks) - plan.removed_blocks
    if len(healed_blocks) != expected:
        report.add("structure", False, f"{len(healed_blocks)} blocks, the plan gives {expected}")
        return False
    fused = fused_group_blocks(plan, healed_blocks)
    for (first, last), block in zip(plan.groups, fused, strict=True):
        want = sum(b.width for b in ffn_members(original_blocks, (first, last)))
        if block.width != want:
            report.add(
                "structure", False, f"group [{first}, {last}] has width {block.width}, the plan gives {want}"
            )
            return False
    parallel = []
    for first, last in plan.parallel:
        problem = _parallel_problem(plan, (first, last), original_blocks, healed_blocks)
        if problem is not None:
            report.add("structure", False, f"parallel group [{first}, {last}] {problem}")
            return False
        parallel.append(f"{[first, last]} ({last - first + 1} blocks in parallel)")
    widths = ", ".join(f"{list(g)} {b.width}" for g, b in zip(plan.groups, fused, strict=True))
    message = f"{len(healed_blocks)} blocks; fused widths {widths or 'none'}"
    if parallel:
        message += f"; parallel groups {', '.join(parallel)}"
    report.add("structure", True, message)
    return True


def _parallel_problem(
    plan: Plan, group: tuple[int, int], original_blocks: list[Block], healed_blocks: list[Block]
) -> str | None:
    first, last = group
    start = first - sum(j - i for i, j in plan.groups if j < first)  # FFN groups before it removed blocks
    members = healed_blocks[start : start + last - first + 1]
    # Block.parallel is the group the walk read, numbered in the graph's block table: exactly this range
    if len(members) != last - first + 1 or {b.parallel for b in members} != {(start, start + last - first)}:
        return "is not one group of blocks reading one stream in the graph"
    for k, block in enumerate(members):
        want = original_blocks[first + k].width
        if block.width != want:
            return f"member {first + k} has FFN width {block.width}, the original's {want}"
    return None


def _hashes(report: VerifyReport, model, hashes: dict[str, str]) -> None:
    initializers = model.graph.initializers
    bad = []
    for name, digest in sorted(hashes.items()):
        value = initializers.get(name)
        if value is None or value.const_value is None:
            bad.append(f"{name!r} (missing)")
        elif tensor_sha256(value.const_value) != digest:
            bad.append(repr(name))
    report.add_mismatches(
        "healed weights",
        bad,
        len(hashes),
        "differ from what heal.py recorded",
        f"{len(hashes)} tensors equal what heal.py recorded (sha256)",
        tensors=len(hashes),
    )


def _quality(report: VerifyReport, options: VerifyOptions, vocab: int) -> None:
    texts = evaluation_sets(vocab, options.window, options.eval_tokens, text=list(options.text) or None)
    results = evaluate(report.original, report.artifact, texts, progress=False)
    pooled = results[-1]
    bound = options.max_kl
    ok = bound is None or pooled.kl <= bound
    limit = "unbounded: pass --max-kl" if bound is None else f"<= {bound:g}"
    report.add(
        "quality vs original",
        ok,
        f"KL(original||healed) {pooled.kl:.4g} nats ({limit}), top-1 agreement {pooled.top1_agreement:.4f} "
        f"on {pooled.tokens} held-out tokens ({', '.join(t.name for t in texts)})",
        kl=pooled.kl,
        top1=pooled.top1_agreement,
        tokens=pooled.tokens,
        **({} if bound is None else {"max_kl": bound}),
    )
