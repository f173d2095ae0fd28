"""Healed graphs (heal.py): the fused structure of their plan (FFN groups' widths, parallel groups'
members), every healed tensor equal to what the heal recorded (sha256 per tensor in ffn_fusion.heal), every
other weight equal to the original's, and the quality against the original on held-out text (KL, top-1),
bounded by `max_kl`. Above block_runner.STREAMING_BYTES of weights the quality check runs both models block by
block (_streamed_quality), as fusion's validation does, a parallel group of a parallel-block plan as one unit;
below it, whole (runtime/evaluate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from passes.blocks import Block
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.model_io import load_model, load_proto, weight_bytes
from passes.metadata import HEAL_METADATA_KEY
from passes.model_map import find_blocks, vocab_size
from passes.plan import Plan
from passes.reference import group_ffns
from passes.run import block_runner
from passes.run.block_runner import BlockRunner
from passes.validate import check_structure, plan_from_metadata
from runtime.evaluate import evaluate, kl_total
from runtime.heal.metadata import TENSOR_HASHES_KEY
from runtime.text_sets import TextSet, held_out_sets
from runtime.verify.common import half_view, metadata_json, release, same_initializers, tensor_sha256
from runtime.verify.fused import fused_group_blocks, group_tensors
from runtime.verify.options import VerifyOptions
from runtime.verify.records import VerifyReport

# A streamed quality check runs as many windows at once as keep both models' logits within this (float32).
STREAMED_LOGITS_BYTES = 256 << 20


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
    # above STREAMING_BYTES of weights, block by block (a parallel group as one unit)
    stream = max(weight_bytes(original_model), weight_bytes(healed_model)) > block_runner.STREAMING_BYTES
    del original_model, healed_model
    _quality(report, options, vocab_size(original_blocks), stream)


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
        want = sum(b.width for b in group_ffns(original_blocks, (first, last)))
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
        if value is not None and value.const_value is not None:
            release(value.const_value)
    report.add_mismatches(
        "healed weights",
        bad,
        len(hashes),
        "differ from what heal.py recorded",
        f"{len(hashes)} tensors equal what heal.py recorded (sha256)",
        tensors=len(hashes),
    )


def _quality(report: VerifyReport, options: VerifyOptions, vocab: int, stream: bool) -> None:
    # text files, or one .npy of token ids as heal.py --heldout takes them (no tokenizer needed)
    texts = held_out_sets(vocab, options.text, options.eval_tokens, options.window)
    streamed = _streamed_quality(report, texts) if stream else None
    if streamed is not None:
        (kl, top1, tokens), how = streamed, "; block by block"
    else:
        if stream:
            whole = "the quality check runs whole (a graph fixes its batch, or its tail reads side tensors)"
            report.notes.append(whole)
        pooled = evaluate(report.original, report.artifact, texts, progress=False)[-1]
        kl, top1, tokens, how = pooled.kl, pooled.top1_agreement, pooled.tokens, ""
    bound = options.max_kl
    ok = bound is None or kl <= bound
    limit = "unbounded: pass --max-kl" if bound is None else f"<= {bound:g}"
    report.add(
        "quality vs original",
        ok,
        f"KL(original||healed) {kl:.4g} nats ({limit}), top-1 agreement {top1:.4f} "
        f"on {tokens} held-out tokens ({', '.join(t.name for t in texts)}{how})",
        kl=kl,
        top1=top1,
        tokens=tokens,
        **({} if bound is None else {"max_kl": bound}),
    )


def _fixed_batch(path: Path) -> bool:
    ids = Signature.of(path).ids
    return ids is not None and ids.static(0) is not None


def _final_stream(runner: BlockRunner, windows: np.ndarray) -> np.ndarray:
    """The stream leaving the last block for `windows`, one block (or parallel group) loaded at a time: the
    prefix (embedding, rotary tables, masks: the side tensors every block reads), then each cut on the stream
    of the last."""
    first = runner.cuts[0].input_name
    x = runner.capture(windows, only=True)[first]  # the prefix alone (asking for `first` also ran block 0)
    for k in range(len(runner.cuts)):
        x = runner.run_block(k, x)
    return x


def _streamed_quality(report: VerifyReport, texts: list[TextSet]) -> tuple[float, float, int] | None:
    """KL(original || healed) and top-1 agreement pooled over every window, both models run block by block
    (BlockRunner streaming: one block's weights in memory at a time, a fused group's block above
    LARGE_FFN_BYTES from its rows, a parallel group's members together as one unit), then the tail (final
    norm, lm_head) on as many windows at a time as keep both models' logits within STREAMED_LOGITS_BYTES.
    Memory: one block's (a parallel group's, or the lm_head's) weights, both models' last streams of one
    text set, and those logits. None when a graph fixes its batch, or a model's tail reads side tensors
    (none seen: the tail is the final norm and the lm_head), which the streamed capture does not keep: the
    check then runs whole."""
    paths = (report.original, report.artifact)
    if any(_fixed_batch(path) for path in paths):
        return None  # every window of a set runs at once: a graph that fixes its batch runs whole
    runners = [  # a half graph: each block in its float32 view (ONNX Runtime's CPU lacks bfloat16 MatMul)
        BlockRunner(p, streaming=True, large_ffn_bytes=block_runner.LARGE_FFN_BYTES,
                    view=half_view(p, load_proto(p)), whole_groups=True)
        for p in paths
    ]
    if any(runner.tail_inputs() for runner in runners):
        return None
    kl, agree, positions = 0.0, 0, 0
    for text in texts:
        windows = text.windows
        streams = [_final_stream(runner, windows) for runner in runners]
        at_once = max(1, STREAMED_LOGITS_BYTES // (2 * windows.shape[-1] * runners[0].vocab * 4))
        for start in range(0, len(windows), at_once):
            rows = slice(start, start + at_once)
            a, b = (runner.run_tail(x[rows]) for runner, x in zip(runners, streams, strict=True))
            if a.shape != b.shape:
                raise UserError(f"the models' logits differ in shape: {a.shape} vs {b.shape}")
            kl += kl_total(a, b)
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            positions += int(np.prod(a.shape[:-1]))
            del a, b
        del streams
    for runner in runners:
        runner.close()
    return kl / max(positions, 1), agree / max(positions, 1), positions
