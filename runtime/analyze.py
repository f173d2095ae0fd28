"""The analysis pipeline of tools/analyze.py: calibration windows -> block dependency (passes/analysis) ->
proposed groups -> norm mode by measured error -> DIR/analysis.json, dependency.png and plan.json.

With `parallel_blocks` (paper section 6), whole-block parallel groups are selected greedily from the same
matrix (passes/analysis/parallel_groups.py), and a quality table is measured as they are added one by one:
each variant fused by passes.pipeline.fuse_file and compared with the original on held-out text
(runtime/evaluate.py), beside its tensor-parallel all-reduces and sequential block steps counted by the
latency model (runtime/latency/).

It lives in runtime/ because it reads calibration text (runtime/text_sets.py) and, with `heal`, measures
healed group errors (runtime/heal, torch); the steps themselves are passes/analysis's.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from passes.analysis.dependency import analyze
from passes.analysis.heatmap import plot_dependency
from passes.analysis.parallel_groups import (
    DEFAULT_BLOCK_GROUP,
    ParallelCandidate,
    ParallelSelection,
    full_block_windows,
    select_parallel_groups,
)
from passes.analysis.propose import DEFAULT_THRESHOLD, NormChoice, choose_norm, propose
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import Plan, validate_plan
from passes.run.block_runner import BlockRunner
from runtime.evaluate import QualityResult, evaluate
from runtime.heal.input_limits import RunShape
from runtime.latency.predict import LayerShape, fuse_blocks, hardware, layer_shapes, predict_decode
from runtime.text_sets import calibration_windows, held_out_sets

if TYPE_CHECKING:
    from runtime.heal.costs import HealedCosts

# Default bound on a group's held-out relative squared error after healing (`heal`): the error the default
# unhealed proposal's group has on the pruned SmolLM2 ([17, 18]: 0.20; docs/heal.md).
HEAL_THRESHOLD = 0.2


@dataclass(frozen=True)
class AnalyzeOptions:
    """What to analyze on and how to propose groups; the defaults are tools/analyze.py's."""

    text: Sequence[Path] | None = None  # calibration text files (default: runtime/text_sets.py's)
    tokens: Path | None = None  # calibration token ids (.npy) instead of text
    num_tokens: int = 128
    window: int | None = None  # tokens per sequence (None: the graph's fixed length, else 128)
    threshold: float = DEFAULT_THRESHOLD  # largest pairwise dependency inside a group
    max_group: int | None = None
    max_width: int | None = None
    start_at_attention: bool = False
    norm: str = "auto"  # "auto" (fuse with each mode, keep the lower logits error) or a NORM_MODES entry
    heal: bool = False  # bound each group's healed error instead of its largest dependency
    heal_threshold: float = HEAL_THRESHOLD
    heal_tokens: int = 2048  # calibration tokens for the healed costs, 3/4 fitted and 1/4 held out
    parallel_blocks: bool = False  # also select whole-block parallel groups (paper section 6)
    block_group: int = DEFAULT_BLOCK_GROUP  # blocks per parallel group
    parallel_count: int = 2  # parallel groups the plan takes (the paper's first operating point)
    eval_tokens: int = 2048  # held-out tokens per text set for the parallel-blocks quality table
    parallel_max_kl: float = 0.5  # a parallel group may raise the held-out KL by at most this (nats)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def analyze_and_plan(
    model: Path,
    out: Path,
    options: AnalyzeOptions,
    progress: bool = True,
    say: Callable[[str], None] = print,
    log: Callable[[str], None] = _to_stderr,
) -> dict:
    """Analyze `model`, propose a plan and write out/analysis.json, out/dependency.png and out/plan.json.
    Results go to `say` (stdout), the progress of long steps to `log` (stderr). Returns the report
    (analysis.json's content)."""
    start = time.perf_counter()
    if options.parallel_blocks:
        check_parallel_options(options)
    # a graph that fixes its sequence length takes exactly that window (and one that fixes its batch runs
    # the windows in chunks of it: BlockRunner)
    options = replace(options, window=RunShape.of([model]).window(options.window))
    runner = BlockRunner(model)
    full = [b.full for b in runner.blocks]
    if options.parallel_blocks and not full_block_windows(full, options.block_group):
        runner.close()
        raise UserError(
            f"{model}: no {options.block_group} consecutive full blocks (softmax attention and a SwiGLU "
            "FFN) to run side by side; try a smaller --block-group"
        )
    out.mkdir(parents=True, exist_ok=True)
    vocab = runner.vocab
    source = [options.tokens] if options.tokens else options.text
    tokens, source = calibration_windows(vocab, source, options.num_tokens, options.window)
    say(f"calibration: {source} ({tokens.shape[0]} x {tokens.shape[1]})")
    analysis = analyze(model, tokens, runner=runner, progress=progress)
    elapsed = time.perf_counter() - start
    say(
        f"analysis: {len(runner.blocks)} blocks, {analysis.tokens} tokens, "
        f"{analysis.block_evaluations} block evaluations in {elapsed:.1f} s"
    )
    reference_logits = runner.logits
    barriers = [b.fusion_barrier for b in runner.blocks]  # attention, or a Linear-replaced branch
    shapes = layer_shapes(runner.blocks)
    runner.close()
    del runner  # its subgraphs and sessions hold the weights; the trial fusions load them again
    gc.collect()
    healed = healed_costs(model, vocab, options, say, log) if options.heal else None
    proposal = propose(
        barriers,
        [b.ffn_width for b in analysis.blocks],
        analysis.dependency,
        threshold=options.heal_threshold if healed else options.threshold,
        max_group=options.max_group,
        max_width=options.max_width,
        start_at_attention=options.start_at_attention,
        healed_cost=(lambda i, j: healed(i, j).heldout_after) if healed else None,
    )
    say("\n".join(proposal.lines()))
    groups = [g.group for g in proposal.groups]
    if options.norm == "auto":
        norm = choose_norm(model, groups, tokens, out, reference_logits, log=log)
        say("\n".join(norm.lines()) if groups else "empty plan: norm mode 'last'")
    else:
        norm = NormChoice(chosen=options.norm)
    plan = proposal.plan(norm.chosen)
    parallel = None
    if options.parallel_blocks:
        selection = select_parallel_groups(full, analysis.dependency, options.block_group, plan.groups)
        say("parallel block candidates (best first):")
        say("\n".join(f"  {c.line()}" for c in selection.candidates))
        parallel = parallel_table(model, out, plan, selection, shapes, tokens, vocab, options, log, progress)
        say("\n".join(parallel.lines()))
        plan = replace(plan, parallel=parallel.plan_groups)
    validate_plan(plan, find_blocks(load_model(model)))
    report = {
        "model": str(model),
        "calibration": source,
        **analysis.to_json(),
        "seconds_analysis": round(elapsed, 2),
        "seconds_total": round(time.perf_counter() - start, 2),
        "proposal": proposal.to_json(),
        "norm_errors": norm.errors,
        **({"healed_costs": [c.row() for c in healed.costs.values()]} if healed else {}),
        **({"parallel_blocks": parallel.to_json()} if parallel else {}),
        "plan": json.loads(plan.to_json()),
    }
    (out / "analysis.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "plan.json").write_text(plan.to_json() + "\n")
    shown = ", ".join(f"[{i}, {j}]" for i, j in groups) or "none"
    title = f"Block dependency: {model.name} ({analysis.tokens} tokens)\nproposed groups: {shown}"
    if plan.parallel:
        title += "; parallel blocks: " + ", ".join(f"[{i}, {j}]" for i, j in plan.parallel)
    plot_dependency(analysis.dependency, barriers, groups, out / "dependency.png", title, plan.parallel)
    say(f"plan: {plan.to_json()}")
    say(f"wrote {out / 'analysis.json'}, {out / 'dependency.png'}, {out / 'plan.json'}")
    say(f"total time {time.perf_counter() - start:.1f} s")
    return report


def healed_costs(
    model: Path,
    vocab: int,
    options: AnalyzeOptions,
    say: Callable[[str], None] = print,
    log: Callable[[str], None] = _to_stderr,
) -> HealedCosts:
    """Healed errors of candidate groups, measured on demand (runtime/heal/costs.py): healed on the first
    3/4 of the calibration windows, scored on the last 1/4."""
    from runtime.heal.costs import HealedCosts  # noqa: PLC0415 (imports torch, which only `heal` needs)

    source = [options.tokens] if options.tokens else options.text
    data, where = calibration_windows(vocab, source, options.heal_tokens, options.window)
    if len(data) < 2:
        raise UserError(f"--heal needs at least 2 windows of calibration tokens, {where} gives {len(data)}")
    split = max(1, len(data) * 3 // 4)
    say(f"healed costs: {where}: {split} windows fitted, {len(data) - split} held out")
    mode = "last" if options.norm == "last" else "fold"
    return HealedCosts(model, data[:split], data[split:], mode, log=log)


# --------------------------------------------------------------------------------------------------------
# Parallel blocks (paper section 6)


def check_parallel_options(options: AnalyzeOptions) -> None:
    """The parallel-blocks settings, checked before anything runs or is written."""
    if options.block_group < 2:
        raise UserError(f"--block-group {options.block_group}: a parallel group holds at least 2 blocks")
    if options.parallel_count < 1:
        raise UserError(
            f"--parallel-count {options.parallel_count}: the plan takes at least 1 parallel group"
        )
    if not options.parallel_max_kl >= 0:
        raise UserError(f"--parallel-max-kl {options.parallel_max_kl}: a KL bound is 0 or more nats")
    if options.eval_tokens < 2:
        raise UserError(f"--eval-tokens {options.eval_tokens}: perplexity needs at least 2 tokens")


def tp_counts(shapes: Sequence[LayerShape], plan: Plan) -> tuple[int, int]:
    """All-reduces per token under tensor parallelism and sequential block steps of the model after `plan`,
    counted as the latency model counts them (one all-reduce per attention part and per FFN part; a fused
    FFN group is one FFN; a parallel group is one step with one all-reduce for its attention outputs and
    one for its FFN outputs). Only the counts are read: the dimensions passed only scale the times."""
    step = predict_decode(
        fuse_blocks(shapes, plan.groups, plan.parallel), 1, 1, 1, 1, hardware("h100", calibrated=False), tp=1
    )
    return step.n_allreduce, step.n_layers


# Candidates refused by the KL bound before the table stops trying (each one is a fused and measured model).
MAX_REFUSED = 4


@dataclass(frozen=True)
class ParallelRow:
    """One row of the section-6 table: the plan's FFN groups plus the groups accepted so far plus, in the
    last place, the candidate this row tries (`accepted`: whether it stays)."""

    parallel: tuple[tuple[int, int], ...]
    added_max_dependency: float | None  # the max dependency inside the group this row adds
    perplexity: float
    top1_agreement: float  # with the original
    kl: float  # KL(original || variant), nats per position
    allreduces: int  # per token under tensor parallelism
    steps: int  # sequential block steps
    accepted: bool = True  # False: the group raised the KL by more than --parallel-max-kl and is dropped

    def row(self) -> dict:
        return {**asdict(self), "parallel": [list(g) for g in self.parallel]}


@dataclass(frozen=True)
class ParallelTable:
    """The selection, the quality rows as groups are added in greedy order, and how many the plan takes."""

    selection: ParallelSelection
    rows: tuple[ParallelRow, ...]
    count: int  # --parallel-count
    texts: dict[str, list[str]]  # held-out text set -> its files
    positions: int  # positions compared per row
    ppl_original: float

    max_kl: float  # --parallel-max-kl

    @property
    def accepted(self) -> tuple[tuple[int, int], ...]:
        """The groups the KL bound kept, in the order they were added."""
        return tuple(r.parallel[-1] for r in self.rows[1:] if r.accepted)

    @property
    def plan_groups(self) -> tuple[tuple[int, int], ...]:
        return self.accepted[: self.count]

    def to_json(self) -> dict:
        return {
            **self.selection.to_json(),
            "max_kl": self.max_kl,
            "accepted": [list(g) for g in self.accepted],
            "count": self.count,
            "plan": [list(g) for g in self.plan_groups],
            "texts": self.texts,
            "positions": self.positions,
            "ppl_original": self.ppl_original,
            "rows": [r.row() for r in self.rows],
        }

    def lines(self) -> list[str]:
        header = (
            f"{'row':>3}  {'parallel group added':<22}{'max dep':>9}{'ppl':>10}{'top-1':>8}{'KL(o||v)':>10}"
            f"{'all-reduces':>13}{'steps':>7}"
        )
        texts = ", ".join(self.texts)
        lines = [
            f"parallel blocks (paper section 6): held-out {texts}, {self.positions} positions; "
            f"original perplexity {self.ppl_original:.3f}",
            header,
            "-" * len(header),
        ]
        for k, r in enumerate(self.rows):
            added = (
                f"+ [{r.parallel[-1][0]}, {r.parallel[-1][1]}]" if r.parallel else "none (FFN groups only)"
            )
            dep = "-" if r.added_max_dependency is None else f"{r.added_max_dependency:.4f}"
            refused = "" if r.accepted else f"  refused: KL rises > {self.max_kl:g}"
            lines.append(
                f"{k:>3}  {added:<22}{dep:>9}{r.perplexity:>10.3f}{r.top1_agreement:>8.4f}{r.kl:>10.4f}"
                f"{r.allreduces:>13}{r.steps:>7}{refused}"
            )
        taken = ", ".join(f"[{i}, {j}]" for i, j in self.plan_groups) or "none"
        if len(self.plan_groups) < self.count:
            lines.append(f"plan takes all {len(self.plan_groups)} accepted parallel group(s): {taken}")
        else:
            lines.append(f"plan takes the first {self.count} accepted parallel group(s): {taken}")
        return lines


def parallel_table(
    model: Path,
    out: Path,
    plan: Plan,
    selection: ParallelSelection,
    shapes: Sequence[LayerShape],
    tokens: np.ndarray,
    vocab: int,
    options: AnalyzeOptions,
    log: Callable[[str], None] = _to_stderr,
    progress: bool = True,
) -> ParallelTable:
    """Row 0 = `plan` (its FFN groups only). Then the candidates in the paper's order (best first), each not
    overlapping the groups accepted so far, are added one at a time and measured: a group that raises the
    held-out KL by more than --parallel-max-kl is refused (the row stays in the table) and its blocks stay
    free for the next candidates. The walk stops at --parallel-count + 2 accepted groups or MAX_REFUSED
    refusals. Each variant is fused from the original into a temporary folder inside `out` (validated on
    the calibration `tokens`), compared with the original on held-out text and removed; only two models
    are open at a time."""
    # evaluate.py's held-out texts; a model whose tokenizer is unknown: seeded random ids
    sets = held_out_sets(vocab, None, options.eval_tokens, options.window, random_without_tokenizer=True)

    def measure(variant: Plan, added: ParallelCandidate | None) -> tuple[ParallelRow, QualityResult]:
        with tempfile.TemporaryDirectory(dir=out, prefix=".parallel-blocks.") as tmp:
            path = model
            if variant.groups or variant.parallel:  # else the variant is the original itself
                path = Path(tmp) / "variant.onnx"
                log(f"fusing {variant.to_json()} to measure it")
                fuse_file(model, variant, path, validate_output=True, tokens=tokens)
            quality = evaluate(model, path, sets, progress=progress)[-1]  # pooled over the sets
        allreduces, steps = tp_counts(shapes, variant)
        dependency = added.max_dependency if added is not None else None
        row = ParallelRow(variant.parallel, dependency, quality.ppl_fused, quality.top1_agreement, quality.kl,
                          allreduces, steps)
        return row, quality

    first, quality = measure(plan, None)
    rows, accepted, refused = [first], [], 0
    for candidate in selection.candidates:
        if len(accepted) >= options.parallel_count + 2 or refused >= MAX_REFUSED:
            break
        i, j = candidate.group
        if any(i <= last and first_block <= j for first_block, last in accepted):
            continue
        row, quality = measure(replace(plan, parallel=(*accepted, candidate.group)), candidate)
        kept = next(r for r in reversed(rows) if r.accepted)  # row 0 counts as accepted
        ok = row.kl - kept.kl <= options.parallel_max_kl
        rows.append(replace(row, accepted=ok))
        if ok:
            accepted.append(candidate.group)
        else:
            refused += 1
    texts = {s.name: list(s.files) for s in sets}
    return ParallelTable(
        selection, tuple(rows), options.parallel_count, texts, quality.tokens, quality.ppl_original,
        options.parallel_max_kl,
    )
