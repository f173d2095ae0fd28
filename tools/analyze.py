"""Block dependency analysis and a fusion plan: writes DIR/analysis.json, dependency.png and plan.json."""

from __future__ import annotations

import argparse
from pathlib import Path

from passes.analysis.parallel_groups import DEFAULT_BLOCK_GROUP
from passes.analysis.propose import DEFAULT_THRESHOLD
from passes.cli import add_token_source, parse, tool_parser
from passes.errors import run_cli
from passes.plan import NORM_MODES
from runtime.analyze import HEAL_THRESHOLD, AnalyzeOptions, analyze_and_plan

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
        default=2048,
        metavar="N",
        help="held-out tokens per text set for the table (default 2048; evaluate.py's texts)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parse(parser, argv, "num_tokens", "window", "heal_tokens")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
        eval_tokens=args.eval_tokens,
    )
    analyze_and_plan(args.model, args.out, options, progress=not args.quiet)
    return 0


if __name__ == "__main__":
    run_cli(main)
