"""Block dependency analysis and a fusion plan: writes DIR/analysis.json, dependency.png and plan.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from passes.analysis.parallel_groups import DEFAULT_BLOCK_GROUP
from passes.analysis.propose import DEFAULT_THRESHOLD
from passes.errors import UserError, run_cli
from passes.plan import NORM_MODES
from runtime.analyze import HEAL_THRESHOLD, AnalyzeOptions, analyze_and_plan
from runtime.cli import add_token_source, parse, tool_parser
from runtime.frontier.pipeline import FrontierOptions, run_frontier
from runtime.frontier.target import TARGETS, WEIGHT_BYTES, TargetOptions

EPILOG = """\
examples:
  analyze.py model.onnx --out analysis/                     default calibration text, 128 tokens
  analyze.py model.onnx --out analysis/ --tokens ids.npy    your own token ids (any integer .npy)
  analyze.py model.onnx --out analysis/ --max-group 4 --threshold 0.15
  analyze.py model.onnx --out analysis/ --heal              bound each group's healed error (docs/heal.md)
  analyze.py model.onnx --out analysis/ --parallel-blocks   also run whole blocks side by side (paper 6):
                                                            groups of 4 full blocks, a quality table as
                                                            they are added, the first 2 in plan.json
  analyze.py model.onnx --out analysis/ --parallel-blocks --block-group 2 --parallel-count 3
  fuse_onnx.py model.onnx analysis/plan.json                then fuse with the proposed plan

the frontier of speed against quality (docs/frontier.md):
  analyze.py model.onnx --frontier --out fr/                every plan the greedy walks reach, measured
  analyze.py model.onnx --frontier --out fr/ --max-kl 0.1   and the fastest one within KL 0.1 -> plan.json
  analyze.py model.onnx --frontier --out fr/ --min-speedup 1.05 --target-tp 8 --target-gpu h200
  analyze.py puzzle49b.onnx --frontier --out fr/ --target super-49b   speed on Super-49B's dimensions
  analyze.py model.onnx --frontier --out fr/ --max-kl 0.1 --heal      heal the chosen plan, measure it
  a second run into the same --out reuses every measurement (fr/cache/)

calibration text: --text FILE..., else the project's default calibration text (license prose from
/usr/share/common-licenses and Python standard-library code; runtime/text_sets.py CALIBRATION_FILES, the
same for heal.py and build_engines.py), with the model's tokenizer when it is known (SmolLM2), else one id
per UTF-8 byte. tools/evaluate.py uses other texts by default.
--parallel-blocks judges its table on those held-out texts (evaluate.py's defaults, --eval-tokens each),
else on other seeded random ids.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser("analyze.py", __doc__, EPILOG)
    parser.add_argument("model", type=Path, help="ONNX decoder (external data beside it is read in place)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    add_token_source(parser, "calibration")
    parser.add_argument("--num-tokens", type=int, default=128, help="calibration tokens used (default 128)")
    parser.add_argument("--window", type=int, help="tokens per sequence (default: the length the graph "
                        "fixes, if it fixes one, else 128)")
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
        help="bound each group's healed error instead of its max dependency (runtime/heal/costs.py, torch)",
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
    parallel = parser.add_argument_group("parallel blocks (paper section 6, docs/analysis.md)")
    parallel.add_argument(
        "--parallel-blocks",
        action="store_true",
        help="also select groups of consecutive full blocks to run side by side (greedy by the smallest max "
        "dependency inside), measure the quality as they are added, and put the first ones in plan.json",
    )
    parallel.add_argument(
        "--block-group",
        type=int,
        default=DEFAULT_BLOCK_GROUP,
        metavar="N",
        help=f"blocks per parallel group (default {DEFAULT_BLOCK_GROUP}, the paper's)",
    )
    parallel.add_argument(
        "--parallel-count",
        type=int,
        default=2,
        metavar="K",
        help="parallel groups plan.json takes (default 2); the table goes on to K + 2 groups",
    )
    parallel.add_argument(
        "--parallel-max-kl",
        type=float,
        default=0.5,
        metavar="NATS",
        help="refuse a group that raises the held-out KL by more than this (default 0.5; SmolLM2's last "
        "blocks: 0.84 and 7.0) and try the next candidate",
    )
    parallel.add_argument(
        "--eval-tokens",
        type=int,
        metavar="N",
        help="held-out tokens per text set for the table (default 2048; with --frontier 1024 per plan; "
        "evaluate.py's texts)",
    )
    frontier = parser.add_argument_group("frontier of speed against quality (docs/frontier.md)")
    frontier.add_argument(
        "--frontier",
        action="store_true",
        help="instead of one proposal: walk plans greedily by predicted speedup per unit of measured "
        "quality lost, fuse and measure each on held-out text; frontier.json/.md/.png (and plan.json with a "
        "budget). With --heal: heal the chosen plan (with a budget) or every frontier plan",
    )
    budget = frontier.add_mutually_exclusive_group()
    budget.add_argument("--max-kl", type=float, metavar="NATS", help="budget: the fastest plan within it")
    budget.add_argument("--min-speedup", type=float, metavar="X", help="budget: the closest plan this fast")
    frontier.add_argument(
        "--target", default="own", choices=TARGETS,
        help="dimensions the speed is predicted for: the model's own (default) or a paper model with the "
        "model's block table",
    )
    frontier.add_argument("--target-tp", type=int, metavar="N",
                          help="TP degree (default 8, or the largest below dividing the heads: SmolLM2 3)")
    frontier.add_argument("--target-gpu", choices=("h100", "h200"), default="h100", help="default h100")
    frontier.add_argument("--target-dtype", choices=tuple(WEIGHT_BYTES), default="fp8", help="default fp8")
    frontier.add_argument("--target-batch", type=int, default=1, metavar="B", help="decode batch (default 1)")
    frontier.add_argument("--screen-tokens", type=int, default=512, metavar="N",
                          help="calibration tokens for each move's cost (default 512)")
    frontier.add_argument("--max-steps", type=int, metavar="K", help="plans per greedy walk (default: all)")
    frontier.add_argument("--bench-tp", type=int, metavar="N",
                          help="also decode the original and the frontier's plans as N rank graphs over gloo "
                          "on this machine's CPUs, and report each plan's decode tokens/s ratio")
    frontier.add_argument("--lm-eval", action="store_true",
                          help="also score the original and the frontier's plans with lm-eval (license_mc, "
                          "through the server; slow)")
    frontier.add_argument("--lm-eval-items", type=int, default=100, metavar="N",
                          help="license_mc items for --lm-eval (default 100)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parse(parser, argv, "num_tokens", "heal_tokens", "screen_tokens", "lm_eval_items")
    if args.window is not None and args.window < 1:
        parser.error("--window must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not Path(args.model).is_file():  # before --out is made: a bad path leaves nothing behind
        raise UserError(f"model {args.model} does not exist")
    if args.frontier:
        target = TargetOptions(
            args.target, args.target_gpu, args.target_tp, args.target_dtype, args.target_batch
        )
        options = FrontierOptions(
            target=target,
            max_kl=args.max_kl,
            min_speedup=args.min_speedup,
            text=args.text,
            tokens=args.tokens,
            screen_tokens=args.screen_tokens,
            window=args.window,
            eval_tokens=args.eval_tokens or 1024,
            max_group=args.max_group,
            start_at_attention=args.start_at_attention,
            block_group=args.block_group,
            max_steps=args.max_steps,
            heal=("chosen" if args.max_kl is not None or args.min_speedup is not None else "frontier")
            if args.heal else None,
            lm_eval=args.lm_eval,
            lm_eval_items=args.lm_eval_items,
            bench_tp=args.bench_tp,
        )
        run_frontier(args.model, args.out, options, progress=not args.quiet)
        return 0
    if args.max_kl is not None or args.min_speedup is not None:
        raise UserError("--max-kl and --min-speedup are budgets of --frontier")
    options = AnalyzeOptions(
        text=args.text,
        tokens=args.tokens,
        num_tokens=args.num_tokens,
        window=args.window,
        threshold=args.threshold,
        max_group=args.max_group,
        max_width=args.max_width,
        start_at_attention=args.start_at_attention,
        norm=args.norm,
        heal=args.heal,
        heal_threshold=args.heal_threshold,
        heal_tokens=args.heal_tokens,
        parallel_blocks=args.parallel_blocks,
        block_group=args.block_group,
        parallel_count=args.parallel_count,
        parallel_max_kl=args.parallel_max_kl,
        eval_tokens=args.eval_tokens or 2048,
    )
    analyze_and_plan(args.model, args.out, options, progress=not args.quiet)
    return 0


if __name__ == "__main__":
    run_cli(main)
