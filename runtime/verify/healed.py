"""Healed graphs (heal.py): the fused structure of their plan, every healed tensor equal to what the heal
recorded (sha256 per tensor in ffn_fusion.heal), every other weight equal to the original's, and the
quality against the original on held-out text (KL, top-1), bounded by `max_kl`."""

from __future__ import annotations

import json

from passes.errors import UserError
from passes.fuse import ffn_members
from passes.io.model_io import load_model
from passes.model_map import find_blocks, vocab_size
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
    healed_blocks = None if plan.parallel else find_blocks(healed_model)
    if healed_blocks is not None and not _structure(report, plan, original_blocks, healed_blocks):
        return
    _hashes(report, healed_model, hashes)
    skip = set(hashes) | (group_tensors(fused_group_blocks(plan, healed_blocks)) if healed_blocks else set())
    same_initializers(report, original_model, healed_model, skip, "weights outside the healed groups")
    del original_model, healed_model
    _quality(report, options, vocab_size(original_blocks))


def _structure(report: VerifyReport, plan, original_blocks, healed_blocks) -> bool:
    expected = len(original_blocks) - plan.removed_blocks
    if len(healed_blocks) != expected:
        report.add("structure", False, f"{len(healed_blocks)} blocks, the plan gives {expected}")
        return False
    for (first, last), block in zip(plan.groups, fused_group_blocks(plan, healed_blocks), strict=True):
        want = sum(b.width for b in ffn_members(original_blocks, (first, last)))
        if block.width != want:
            report.add(
                "structure", False, f"group [{first}, {last}] has width {block.width}, the plan gives {want}"
            )
            return False
    fused = fused_group_blocks(plan, healed_blocks)
    widths = ", ".join(f"{list(g)} {b.width}" for g, b in zip(plan.groups, fused, strict=True))
    report.add("structure", True, f"{len(healed_blocks)} blocks; fused widths {widths or 'none'}")
    return True


def _hashes(report: VerifyReport, model, hashes: dict[str, str]) -> None:
    initializers = model.graph.initializers
    bad = []
    for name, digest in sorted(hashes.items()):
        value = initializers.get(name)
        if value is None or value.const_value is None:
            bad.append(f"{name!r} (missing)")
        elif tensor_sha256(value.const_value) != digest:
            bad.append(repr(name))
    if bad:
        shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
        report.add(
            "healed weights",
            False,
            f"{len(bad)} of {len(hashes)} differ from what heal.py recorded: {shown}",
            tensors=len(hashes),
            differing=len(bad),
        )
    else:
        report.add(
            "healed weights",
            True,
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
