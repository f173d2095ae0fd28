"""The analysis pipeline of tools/analyze.py: calibration windows -> block dependency (passes/analysis) ->
proposed groups -> norm mode by measured error -> DIR/analysis.json, dependency.png and plan.json.

It lives in runtime/ because it reads calibration text (runtime/text_sets.py) and, with `heal`, measures
healed group errors (runtime/heal, torch); the steps themselves are passes/analysis's.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from passes.analysis.dependency import analyze
from passes.analysis.heatmap import plot_dependency
from passes.analysis.propose import DEFAULT_THRESHOLD, NormChoice, choose_norm, propose
from passes.analysis.runner import BlockRunner
from passes.errors import UserError
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.plan import validate_plan
from runtime.heal.calibration import calibration_windows
from runtime.text_sets import calibration_tokens, windows

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
    window: int = 128  # tokens per sequence
    threshold: float = DEFAULT_THRESHOLD  # largest pairwise dependency inside a group
    max_group: int | None = None
    max_width: int | None = None
    start_at_attention: bool = False
    norm: str = "auto"  # "auto" (fuse with each mode, keep the lower logits error) or a NORM_MODES entry
    heal: bool = False  # bound each group's healed error instead of its largest dependency
    heal_threshold: float = HEAL_THRESHOLD
    heal_tokens: int = 2048  # calibration tokens for the healed costs, 3/4 fitted and 1/4 held out


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
    out.mkdir(parents=True, exist_ok=True)
    runner = BlockRunner(model)
    vocab = runner.vocab
    ids, source = calibration_tokens(vocab, options.num_tokens, options.text, options.tokens)
    tokens = windows(ids, options.window)
    say(f"calibration: {source} ({tokens.shape[0]} x {tokens.shape[1]})")
    analysis = analyze(model, tokens, runner=runner, progress=progress)
    elapsed = time.perf_counter() - start
    say(
        f"analysis: {len(runner.blocks)} blocks, {analysis.tokens} tokens, "
        f"{analysis.block_evaluations} block evaluations in {elapsed:.1f} s"
    )
    reference_logits = runner.logits
    barriers = [b.fusion_barrier for b in runner.blocks]  # attention, or a Linear-replaced branch
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
        "plan": json.loads(plan.to_json()),
    }
    (out / "analysis.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "plan.json").write_text(plan.to_json() + "\n")
    shown = ", ".join(f"[{i}, {j}]" for i, j in groups) or "none"
    title = f"Block dependency: {model.name} ({analysis.tokens} tokens)\nproposed groups: {shown}"
    plot_dependency(analysis.dependency, barriers, groups, out / "dependency.png", title)
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
    # Here, not at the top: it imports torch, which only `heal` needs.
    from runtime.heal.costs import HealedCosts

    source = [options.tokens] if options.tokens else options.text
    data, where = calibration_windows(vocab, source, options.heal_tokens, options.window)
    if len(data) < 2:
        raise UserError(f"--heal needs at least 2 windows of calibration tokens, {where} gives {len(data)}")
    split = max(1, len(data) * 3 // 4)
    say(f"healed costs: {where}: {split} windows fitted, {len(data) - split} held out")
    mode = "last" if options.norm == "last" else "fold"
    return HealedCosts(model, data[:split], data[split:], mode, log=log)
