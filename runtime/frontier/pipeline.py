"""tools/analyze.py --frontier: which plan is fastest on a deployment for the quality a user can give up.

1. Moves (moves.py): every FFN group inside the attention-free runs in both norm modes, and every window
   of full blocks for a parallel group (paper section 6).
2. Each move's cost measured alone on calibration tokens (screen.py: KL of the final logits).
3. Greedy walks, one per norm mode (moves.py), by predicted speedup (target.py, the latency model) gained
   per unit of summed cost; a cheapest-first one below its first plan; with --max-kl one more per mode
   within it, with --min-speedup a cheapest-first one up to the floor; with a paper target, the paper's
   own plans join them.
4. Every plan of the walks fused and measured whole on held-out text (measure.py, cached), beside its
   whole-plan calibration cost, to show where summing the moves' costs was wrong.
5. The plans no other plan beats on both speed and KL form the frontier; a budget (--max-kl or
   --min-speedup) chooses one into plan.json; --heal heals the chosen plan (or every frontier plan) and
   measures it on the same text; --lm-eval scores the frontier's plans through the server.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from exporters.hf.checkpoint import SIDE_FILES
from passes.errors import UserError
from passes.fuse import FuseFFNGroups
from passes.io.model_io import load_model
from passes.model_map import find_blocks, vocab_size
from passes.pipeline import fuse_file
from passes.plan import NORM_MODES, Plan, validate_plan
from runtime.analyze import tp_counts
from runtime.frontier.bench import decode_ratios
from runtime.frontier.measure import PlanMeasurer, Quality
from runtime.frontier.moves import Move, dominated, ffn_moves, parallel_moves, walk
from runtime.frontier.report import Entry, FrontierReport
from runtime.frontier.screen import PlanCosts
from runtime.frontier.target import TargetOptions, resolve
from runtime.heal.input_limits import RunShape
from runtime.text_sets import calibration_windows, held_out_sets


@dataclass(frozen=True)
class FrontierOptions:
    target: TargetOptions = field(default_factory=TargetOptions)
    max_kl: float | None = None  # budget: the fastest frontier plan within this KL
    min_speedup: float | None = None  # budget: the lowest-KL frontier plan at least this fast
    text: Sequence[Path] | None = None  # calibration text for the move costs (default: text_sets')
    tokens: Path | None = None
    screen_tokens: int = 512  # calibration tokens for the move costs
    window: int | None = None  # tokens per window; None: the length the graph fixes, else 128
    eval_tokens: int = 1024  # held-out tokens per text set for each measured plan
    max_group: int | None = None
    start_at_attention: bool = False
    block_group: int = 4  # blocks per parallel move; 0: no parallel moves
    max_steps: int | None = None  # plans per walk
    heal: str | None = None  # "chosen" or "frontier"
    lm_eval: bool = False
    lm_eval_items: int = 100
    bench_tp: int | None = None  # also decode the frontier's plans over this many gloo ranks on the CPU

    def check(self) -> None:
        if self.max_kl is not None and self.min_speedup is not None:
            raise UserError("give one budget: --max-kl or --min-speedup")
        if self.max_kl is not None and not self.max_kl >= 0:
            raise UserError(f"--max-kl {self.max_kl}: a KL budget is 0 or more nats")
        if self.min_speedup is not None and not self.min_speedup > 0:
            raise UserError(f"--min-speedup {self.min_speedup}: a speedup is a positive ratio")
        if self.heal == "chosen" and self.max_kl is None and self.min_speedup is None:
            raise UserError("healing the chosen plan needs a budget (--max-kl or --min-speedup)")
        if self.bench_tp is not None and self.bench_tp < 2:
            raise UserError(f"--bench-tp {self.bench_tp}: tensor parallelism needs at least 2 ranks")
        if self.block_group == 1:
            raise UserError("--block-group 1: a parallel group holds at least 2 blocks (0: none)")


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def run_frontier(
    model: Path,
    out: Path,
    options: FrontierOptions,
    progress: bool = True,
    say: Callable[[str], None] = print,
    log: Callable[[str], None] = _to_stderr,
) -> FrontierReport:
    """Write out/frontier.json, frontier.md, frontier.png (and plan.json with a budget); return the report."""
    start = time.perf_counter()
    options.check()
    graph = load_model(model)
    blocks = find_blocks(graph)
    target = resolve(options.target, blocks)
    window = RunShape.of([model]).window(options.window)  # a graph that fixes its length sets the window
    moves = ffn_moves(blocks, options.max_group, options.start_at_attention)
    reasons = {m: _refusal(m, graph, blocks) for m in moves}  # e.g. "fold" on int4 MatMulNBits weights
    refused = [m for m in moves if reasons[m]]
    moves = [m for m in moves if not reasons[m]]
    if options.block_group:
        moves += parallel_moves(blocks, options.block_group)
    if not moves:
        raise UserError(
            f"{model}: nothing to fuse: no attention-free run with 2 or more SwiGLU FFNs and no "
            f"{options.block_group} consecutive full blocks for a parallel group"
        )
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    say(f"target: {target.describe()}")
    counts = {k: sum(m.kind == k for m in moves) for k in ("ffn", "parallel")}
    modes = " and ".join(n for n in NORM_MODES if any(m.norm == n for m in moves))
    ffn = f"{counts['ffn']} FFN groups" + (f" (norm {modes})" if modes else "")
    say(f"moves: {ffn}, {counts['parallel']} parallel groups")
    if refused:
        say(f"left out: {len(refused)} FFN groups the fusion refuses (first: {reasons[refused[0]]})")

    vocab = vocab_size(blocks)
    source = [options.tokens] if options.tokens else options.text
    calib, where = calibration_windows(vocab, source, options.screen_tokens, window)
    costs = PlanCosts(model, calib, cache)
    missing = [m for m in moves if not costs.known(m.plan)]
    cached = len(moves) - len(missing)
    say(f"move costs: {where} ({calib.shape[0]} x {calib.shape[1]} tokens), {cached} cached")
    started = lap = time.perf_counter()
    bar = tqdm(missing, desc="move costs", unit="move", disable=not progress, leave=False)
    for k, move in enumerate(bar):
        costs(move.plan)
        if k == 1:  # the first one also ran the original: time the second
            each = time.perf_counter() - lap
            log(f"a move's cost takes {each:.1f} s: about {each * (len(missing) - 2) / 60:.1f} min more")
        lap = time.perf_counter()
    if missing:
        log(f"move costs: {time.perf_counter() - started:.0f} s")
    costs.save()

    def cost(move: Move) -> float:
        return costs(move.plan)

    plans: dict[str, tuple[Plan, str, float]] = {}  # plan json -> (plan, label, summed cost)
    plans[Plan(()).to_json()] = (Plan(()), "original", 0.0)
    norms = [n for n in NORM_MODES if any(m.norm == n for m in moves)] or ["last"]
    for norm in norms:
        ratio = walk(moves, norm, cost, target.speedup, options.max_steps)
        below = ratio[0].summed_cost * (1 - 1e-9) if ratio else None
        cheap = walk(moves, norm, cost, target.speedup, options.max_steps, below, cheapest=True)
        walks = {"": ratio, "c": cheap}
        if options.max_kl is not None:
            walks["b"] = walk(moves, norm, cost, target.speedup, options.max_steps, options.max_kl)
        if options.min_speedup is not None:  # cheapest-first up to the floor: the least cost that reaches it
            floor = walk(moves, norm, cost, target.speedup, options.max_steps, cheapest=True,
                         until=options.min_speedup)
            reached = floor and floor[-1].predicted_speedup >= options.min_speedup
            walks["s"] = floor if reached else []  # a floor no walk reaches: nothing to measure for it
        for suffix, steps in walks.items():  # "c": cheapest-first walk, "b" / "s": a KL / speedup budget's
            for k, step in enumerate(steps, 1):
                plans.setdefault(step.plan.to_json(), (step.plan, f"{norm[0]}{k}{suffix}", step.summed_cost))
    if target.paper is not None:
        for label, plan in _paper_plans(target.paper, blocks).items():
            plans.setdefault(plan.to_json(), (plan, label, _summed(plan, costs)))

    for plan, _, _ in plans.values():  # each whole plan on the calibration tokens, beside its summed moves
        costs(plan)
    costs.close()  # the screener's sessions hold the original's weights: released before measuring
    # evaluate.py's default held-out text, so that `evaluate.py --max-tokens N --window W` reproduces a row.
    texts = held_out_sets(vocab, None, options.eval_tokens, window)
    entries = _measure_all(model, out, plans, texts, costs, target, cache, progress, say, log)
    flags = dominated([(e.predicted_speedup, e.quality.kl) for e in entries])
    entries = [e.with_frontier(not d) for e, d in zip(entries, flags, strict=True)]
    report = FrontierReport(str(model), target.describe(), where, texts_info(texts), entries,
                            options.max_kl, options.min_speedup)
    chosen = report.choose()
    if options.heal:
        report = _heal(model, out, report, chosen, options, texts, cache, say, log)
    if options.lm_eval:
        report = _lm_eval(model, out, report, options, say, log)
    if options.bench_tp:
        fusing = [e for e in report.frontier if e.fuses]
        ratios = decode_ratios(model, fusing, options.bench_tp, vocab, out, log=log)
        report = report.with_decode_ratios(ratios, options.bench_tp)
    report.write(out, target.paper)
    say("\n".join(report.lines()))
    if chosen is not None:
        (out / "plan.json").write_text(chosen.plan.to_json() + "\n")
        say(f"chosen for the budget: {chosen.label} {chosen.plan.to_json()}")
    written = ", ".join(str(out / f) for f in ("frontier.json", "frontier.md", "frontier.png"))
    say(f"wrote {written}" + (f", {out / 'plan.json'}" if chosen is not None else ""))
    say(f"total time {time.perf_counter() - start:.0f} s")
    return report


def texts_info(texts) -> dict[str, list[str]]:
    return {t.name: list(t.files) for t in texts}


def _refusal(move: Move, graph, blocks) -> str | None:
    """Why the fusion pass refuses the move's plan (its `requires`; nothing is rewritten), or None."""
    if move.kind != "ffn":
        return None
    try:
        FuseFFNGroups(move.plan, list(blocks)).requires(graph)
    except UserError as exc:
        return str(exc)
    return None


def _summed(plan: Plan, costs: PlanCosts) -> float:
    """The sum of the plan's moves' costs, each measured alone."""
    moves = [Move("ffn", g, plan.norm) for g in plan.groups] + [Move("parallel", g) for g in plan.parallel]
    return sum(costs(m.plan) for m in moves)


def _paper_plans(spec, blocks) -> dict[str, Plan]:
    """The paper's own choices for a paper model: its FFN groups, and each section-6 row beside them."""
    plans = {"paper": Plan(tuple(spec.groups), "last")}
    for k, row in enumerate(spec.parallel_series[1:], 1):
        plans[f"paper+s6.{k}"] = Plan(tuple(spec.groups), "last", tuple(row.groups))
    valid = {}
    for label, plan in plans.items():
        try:
            validate_plan(plan, list(blocks))
        except UserError:
            continue
        valid[label] = plan
    return valid


def _measure_all(model, out, plans, texts, costs, target, cache, progress, say, log) -> list[Entry]:
    """Every plan measured whole (held-out, cached) and screened whole (calibration)."""
    measurer = PlanMeasurer(model, texts, cache, out, progress=False)
    todo = [p for p, _, _ in plans.values() if p.groups or p.parallel]
    uncached = [p for p in todo if measurer.cached(p) is None]
    say(f"plans to measure: {len(todo)} ({len(todo) - len(uncached)} cached); held-out text: "
        + ", ".join(f"{t.name} {t.tokens} tokens" for t in texts))
    entries, started, done = [], time.perf_counter(), 0
    bar = tqdm(total=len(todo), desc="plans", unit="plan", disable=not progress, leave=False)
    for plan, label, summed in plans.values():
        if not (plan.groups or plan.parallel):
            unmeasured = Quality(0.0, float("nan"), float("nan"), 1.0, 0, 0)
            entries.append(Entry(label, plan, 1.0, 0.0, 0.0, unmeasured,
                                 *tp_counts(target.shapes, plan)))
            continue
        fresh = measurer.cached(plan) is None
        quality = measurer.measure(plan)
        if fresh:
            done += 1
            if done == 1 and len(uncached) > 1:
                each = time.perf_counter() - started
                rest = each * (len(uncached) - 1) / 60
                log(f"first plan measured in {each:.0f} s: about {rest:.1f} min more")
        entries.append(Entry(label, plan, target.speedup(plan), summed, costs(plan), quality,
                             *tp_counts(target.shapes, plan)))
        bar.update()
    bar.close()
    first = next((e.quality for e in entries if e.quality.positions), None)
    if first is not None:  # the original's own row: its perplexity, measured beside every plan
        entries[0] = entries[0].with_quality(Quality(0.0, first.ppl_original, first.ppl_original, 1.0,
                                                     first.positions, 0.0))
    return entries


def _heal(model, out, report, chosen, options, texts, cache, say, log) -> FrontierReport:
    """Heal the chosen plan (or every frontier plan) and measure the healed model on the same text."""
    from runtime.heal.report import run_heal  # noqa: PLC0415 (imports torch: only --heal needs it)

    which = [chosen] if options.heal == "chosen" else [e for e in report.entries if e.on_frontier]
    which = [e for e in which if e is not None and (e.plan.groups or e.plan.parallel)]
    measurer = PlanMeasurer(model, texts, cache, out, progress=False)
    healed = {}
    with tempfile.TemporaryDirectory(dir=out, prefix=".heal.") as tmp:
        for entry in which:
            fused = Path(tmp) / f"{entry.label}.onnx"
            measurer.fuse(entry.plan, fused)  # measured already; the healing needs the file
            target = out / "healed" / f"{entry.label}.onnx"
            say(f"healing {entry.label} {entry.plan.to_json()} -> {target}")
            run_heal(model, fused, target, eval_tokens=0, log=log)
            healed[entry.label] = measurer.quality_of(target)
    return report.with_healed(healed)


def _lm_eval(model, out, report, options, say, log) -> FrontierReport:
    """lm-eval accuracy (the offline license_mc task, through the server) of the original and every frontier
    plan."""
    from runtime.quality import quality  # noqa: PLC0415 (starts servers (httpx, the serving stack); only --lm-eval needs it)

    chosen = [e for e in report.entries if e.on_frontier and e.fuses]
    with tempfile.TemporaryDirectory(dir=out, prefix=".lm-eval.") as tmp:
        for name in SIDE_FILES:  # the server reads the tokenizer and generation files beside each model
            if (model.parent / name).is_file():
                shutil.copy(model.parent / name, Path(tmp) / name)
        variants = [Path(tmp) / f"{e.label}.onnx" for e in chosen]  # lm-eval's names: the labels
        for entry, path in zip(chosen, variants, strict=True):
            fuse_file(model, entry.plan, path, validate_output=True)
        rows = quality(model, variants, out / "lm_eval", items=options.lm_eval_items, log=log)
    accuracy = {"original": rows[0].scores[0].acc}
    accuracy.update({e.label: r.scores[0].acc for e, r in zip(chosen, rows[1:], strict=True)})
    say("lm-eval: " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
    return report.with_lm_eval(accuracy)
