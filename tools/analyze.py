"""Block dependency analysis and a fusion plan: writes DIR/analysis.json, dependency.png and plan.json."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from passes.analysis.dependency import BlockRunner, analyze, plot_dependency
from passes.analysis.propose import DEFAULT_THRESHOLD, NormChoice, choose_norm, propose
from passes.cli import add_token_source, parse, tool_parser
from passes.errors import UserError, run_cli
from passes.io.model_io import load_model
from passes.model_map import find_blocks, vocab_size
from passes.plan import NORM_MODES, validate_plan
from runtime.text_sets import calibration_tokens, windows

# Default bound on a group's held-out relative squared error after healing (--heal): the error the default
# unhealed proposal's group has on the pruned SmolLM2 ([17, 18]: 0.20; docs/heal.md).
HEAL_THRESHOLD = 0.2

EPILOG = """\
examples:
  analyze.py model.onnx --out analysis/                     default calibration text, 128 tokens
  analyze.py model.onnx --out analysis/ --tokens ids.npy    your own token ids (any integer .npy)
  analyze.py model.onnx --out analysis/ --max-group 4 --threshold 0.15
  analyze.py model.onnx --out analysis/ --heal              bound each group's healed error (docs/heal.md)
  fuse_onnx.py model.onnx analysis/plan.json                then fuse with the proposed plan

calibration text: --text FILE..., else /usr/share/common-licenses/Apache-2.0 when the model's tokenizer
is known (SmolLM2), else seeded random token ids. tools/evaluate.py uses other texts by default.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser("analyze.py", __doc__, EPILOG)
    parser.add_argument("model", type=Path, help="ONNX decoder (external data beside it is read in place)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    add_token_source(parser, "calibration")
    parser.add_argument("--num-tokens", type=int, default=128, help="calibration tokens used (default 128)")
    parser.add_argument("--window", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--max-group", type=int, help="most blocks in one group")
    parser.add_argument("--max-width", type=int, help="largest intermediate width of a fused FFN")
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help=f"largest pairwise dependency allowed inside a group (default {DEFAULT_THRESHOLD})",
    )
    parser.add_argument(
        "--start-at-attention",
        action="store_true",
        help="let a group start at the attention block before a run (its FFN joins; default: off)",
    )
    parser.add_argument(
        "--norm",
        choices=("auto", *NORM_MODES),
        default="auto",
        help="norm mode of the plan: auto (default) fuses with both and keeps the lower logits error",
    )
    parser.add_argument(
        "--heal",
        action="store_true",
        help="bound each group's healed error instead of its max dependency (runtime/heal/distill.py, torch)",
    )
    parser.add_argument(
        "--heal-threshold",
        type=float,
        default=HEAL_THRESHOLD,
        help=f"with --heal: largest held-out relative squared error after healing (default {HEAL_THRESHOLD})",
    )
    parser.add_argument(
        "--heal-tokens",
        type=int,
        default=2048,
        help="with --heal: calibration tokens for the healed costs, 3/4 fitted, 1/4 held out (default 2048)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parse(parser, argv, "num_tokens", "window", "heal_tokens")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    runner = BlockRunner(args.model)
    ids, source = calibration_tokens(runner.vocab, args.num_tokens, args.text, args.tokens)
    tokens = windows(ids, args.window)
    print(f"calibration: {source} ({tokens.shape[0]} x {tokens.shape[1]})")
    analysis = analyze(args.model, tokens, runner=runner, progress=not args.quiet)
    elapsed = time.perf_counter() - start
    print(
        f"analysis: {len(runner.blocks)} blocks, {analysis.tokens} tokens, "
        f"{analysis.block_evaluations} block evaluations in {elapsed:.1f} s"
    )
    reference_logits = runner.logits
    barriers = [b.fusion_barrier for b in runner.blocks]  # attention, or a Linear-replaced branch
    runner.close()
    del runner  # its subgraphs and sessions hold the weights; the trial fusions load them again
    gc.collect()
    healed = _healed_costs(args) if args.heal else None
    proposal = propose(
        barriers,
        [b.ffn_width for b in analysis.blocks],
        analysis.dependency,
        threshold=args.heal_threshold if healed else args.threshold,
        max_group=args.max_group,
        max_width=args.max_width,
        start_at_attention=args.start_at_attention,
        healed_cost=(lambda i, j: healed(i, j).heldout_after) if healed else None,
    )
    print("\n".join(proposal.lines()))
    groups = [g.group for g in proposal.groups]
    if args.norm == "auto":
        norm = choose_norm(
            args.model, groups, tokens, args.out, reference_logits, log=lambda m: print(m, file=sys.stderr)
        )
        print("\n".join(norm.lines()) if groups else "empty plan: norm mode 'last'")
    else:
        norm = NormChoice(chosen=args.norm)
    plan = proposal.plan(norm.chosen)
    validate_plan(plan, find_blocks(load_model(args.model)))
    report = {
        "model": str(args.model),
        "calibration": source,
        **analysis.to_json(),
        "seconds_analysis": round(elapsed, 2),
        "seconds_total": round(time.perf_counter() - start, 2),
        "proposal": proposal.to_json(),
        "norm_errors": norm.errors,
        **({"healed_costs": [c.row() for c in healed.costs.values()]} if healed else {}),
        "plan": json.loads(plan.to_json()),
    }
    (args.out / "analysis.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "plan.json").write_text(plan.to_json() + "\n")
    shown = ", ".join(f"[{i}, {j}]" for i, j in groups) or "none"
    title = f"Block dependency: {args.model.name} ({analysis.tokens} tokens)\nproposed groups: {shown}"
    plot_dependency(analysis.dependency, barriers, groups, args.out / "dependency.png", title)
    print(f"plan: {plan.to_json()}")
    print(f"wrote {args.out / 'analysis.json'}, {args.out / 'dependency.png'}, {args.out / 'plan.json'}")
    print(f"total time {time.perf_counter() - start:.1f} s")
    return 0


def _healed_costs(args: argparse.Namespace):
    """Healed errors of candidate groups, measured on demand (torch; runtime/heal/distill.py)."""
    from runtime.heal.distill import HealedCosts, calibration_windows

    vocab = vocab_size(find_blocks(load_model(args.model)))
    source = [args.tokens] if args.tokens else args.text
    data, where = calibration_windows(vocab, source, args.heal_tokens, args.window)
    if len(data) < 2:
        raise UserError(f"--heal needs at least 2 windows of calibration tokens, {where} gives {len(data)}")
    split = max(1, len(data) * 3 // 4)
    print(f"healed costs: {where}: {split} windows fitted, {len(data) - split} held out")
    mode = "last" if args.norm == "last" else "fold"
    return HealedCosts(args.model, data[:split], data[split:], mode, log=lambda m: print(m, file=sys.stderr))


if __name__ == "__main__":
    run_cli(main)
