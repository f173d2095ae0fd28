"""Heal a fused model: fit each fused group's wide FFN, and each parallel group's member FFNs, to the original
blocks' sequential output on calibration tokens (blockwise local distillation, torch), and write the healed
model."""

from __future__ import annotations

import argparse
from pathlib import Path

from passes.errors import run_cli
from runtime.cli import add_options, parse, tool_parser
from runtime.heal.metadata import INPUT_MODES, LOSSES, HealConfig
from runtime.heal.report import HEAL_DEFAULTS, run_heal

EPILOG = """\
examples:
  heal.py model.onnx model.fused.onnx -o model.healed.onnx             default calibration text
  heal.py model.onnx model.fused.onnx --calib a.txt b.txt --tokens 4096 --steps 300 -o healed.onnx
  heal.py model.onnx model.fused.onnx --calib ids.npy -o healed.onnx   token ids (any integer .npy)
  heal.py decode.onnx decode.fused.onnx -o decode.healed.onnx          heal the KV-cache decode graph
  heal.py decode.onnx decode.fused.onnx --weights-from model.healed.onnx -o decode.healed.onnx
                                             the prefill graph's healed weights into the decode graph

The plan comes from the fused model's metadata (ffn_fusion.plan): its FFN groups and its parallel groups
(parallel_blocks) are healed; the healed model has the same graph, only those groups' FFN weights change,
and records the healing in ffn_fusion.heal. Default calibration
text: license texts and Python standard-library modules that tools/evaluate.py never uses; per-group
held-out errors and the whole-model quality (perplexity, top-1 agreement, KL) use evaluate.py's texts.
Any graph fuse_onnx.py fuses can be healed (prefill or KV-cache decode, static or dynamic batch); a graph
that fixes its batch runs that many windows at a time, one that fixes its sequence length sets --window.
"""


def options() -> list[tuple[str, dict]]:
    """Every option but the paths, in --help order: (flag, add_argument settings)."""
    files = {"type": Path, "nargs": "+", "metavar": "FILE"}
    return [
        ("--calib", {**files, "help": "calibration text files or one ids .npy"}),
        ("--heldout", {**files, "help": "held-out text files or one ids .npy"}),
        ("--tokens", {"type": int, "default": HEAL_DEFAULTS.tokens, "help": "calibration tokens used"}),
        ("--steps", {"type": int, "default": HealConfig.steps, "help": "Adam steps per group"}),
        ("--lr", {"type": float, "default": HealConfig.lr, "help": "peak learning rate (cosine decay)"}),
        (
            "--ridge",
            {
                "type": float,
                "default": HealConfig.ridge,
                "help": "closed-form down-projection refit after Adam, regularization (0: none)",
            },
        ),
        ("--batch-tokens", {"type": int, "default": HealConfig.batch_tokens, "help": "tokens per step"}),
        (
            "--inputs",
            {
                "choices": INPUT_MODES,
                "default": HealConfig.inputs,
                "help": "group inputs from the model healed so far (default) or from the original",
            },
        ),
        (
            "--loss",
            {
                "choices": LOSSES,
                "default": HealConfig.loss,
                "help": "mse: squared error over all tokens (default); token: per-token normalized",
            },
        ),
        (
            "--heldout-tokens",
            {
                "type": int,
                "default": HEAL_DEFAULTS.heldout_tokens,
                "help": "held-out tokens per text set for the per-group errors",
            },
        ),
        (
            "--eval-tokens",
            {
                "type": int,
                "default": HEAL_DEFAULTS.eval_tokens,
                "help": "held-out tokens per text set for the whole-model quality (0: skip it)",
            },
        ),
        (
            "--window",
            {
                "type": int,
                "default": HEAL_DEFAULTS.window,
                "help": "tokens per window (default: the graph's fixed sequence length, else 128)",
            },
        ),
        (
            "--weights-from",
            {
                "type": Path,
                "metavar": "HEALED",
                "help": "fit nothing: write the healed weights of HEALED (heal.py's output for another graph "
                "of the same model and plan, e.g. the prefill graph) into FUSED (e.g. the decode graph)",
            },
        ),
        ("--json", {"action": "store_true", "help": "print the report as JSON"}),
        ("--quiet", {"action": "store_true", "help": "no progress messages"}),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser("heal.py", __doc__, EPILOG)
    parser.add_argument("original", type=Path, help="the original ONNX model (before fusion)")
    parser.add_argument("fused", type=Path, help="the fused model (fuse_onnx.py output)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the healed model to write")
    add_options(parser, options())
    args = parse(parser, argv, "tokens", "heldout_tokens", "batch_tokens")
    if args.steps < 0 or args.eval_tokens < 0 or not args.lr > 0:
        parser.error("--steps and --eval-tokens must be >= 0, --lr > 0")
    if args.window is not None and args.window < 1:
        parser.error("--window must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = HealConfig(args.steps, args.lr, args.batch_tokens, args.inputs, args.loss, ridge=args.ridge)
    quiet = args.quiet or args.json
    report = run_heal(
        args.original,
        args.fused,
        args.output,
        config,
        calib=args.calib,
        tokens=args.tokens,
        heldout_tokens=args.heldout_tokens,
        eval_tokens=args.eval_tokens,
        window=args.window,
        heldout=args.heldout,
        log=(lambda m: None) if quiet else print,
        weights_from=args.weights_from,
    )
    print(report.text(args.json))
    return 0


if __name__ == "__main__":
    run_cli(main)
