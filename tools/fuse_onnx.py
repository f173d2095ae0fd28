"""FFN Fusion on an exported ONNX decoder: fuse each planned group of FFN blocks into one wide SwiGLU."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from passes.block_table import format_block_table
from passes.errors import UserError, run_cli
from passes.fuse import ffn_members
from passes.io.model_io import load_model
from passes.model_map import find_blocks
from passes.pipeline import fuse_file
from passes.plan import load_plan
from runtime.cli import add_data_file_size, data_file_bytes, tool_parser
from runtime.verify import VerifyOptions, verify_artifact

EPILOG = """\
examples:
  fuse_onnx.py model.onnx --show-blocks          print the block table (add --json for machines)
  fuse_onnx.py model.onnx plan.json              write model.fused.onnx beside the input, validated
  fuse_onnx.py --verify model.onnx model.fused.onnx   re-check a fused model (exit 1 on mismatch)
  fuse_onnx.py --verify model.onnx model.healed.onnx --max-kl 0.5 --junit verify.xml
                                       a healed model: structure, healed tensors, KL on held-out text
  fuse_onnx.py --verify model.healed.onnx fp8/model.healed_fp8.onnx   FP8 weights = Q(source), logits
  fuse_onnx.py --verify model.healed.onnx tp2/   a rank folder (tp.json): ranks run together = the source
  fuse_onnx.py --verify model.healed.onnx nas/   export_checkpoint.py's folder: re-imported = the source
  fuse_onnx.py --verify model.onnx model.decode.onnx   cached decoding = prefill = the source

plan.json: {"groups": [[13, 17], [18, 21]], "norm": "last"}   (block numbers = source layers, inclusive;
  blocks i+1..j of a group must have no attention part and no group a Linear FFN; norm "last" (paper)
  or "fold")
  optional "parallel_blocks": [[4, 7]]: whole blocks i..j (each softmax attention + SwiGLU FFN) read one
  stream, y = x + sum_k (block_k(x) - x); not overlapping the FFN groups
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = tool_parser("fuse_onnx.py", __doc__, EPILOG)
    parser.add_argument("model", type=Path, help="ONNX model (external data beside it is read in place)")
    parser.add_argument(
        "plan", type=Path, nargs="?", help="plan.json with the groups to fuse (--verify: the fused model)"
    )
    parser.add_argument(
        "-o", "--output", type=Path, help="output path (default: MODEL.fused.onnx beside the input)"
    )
    parser.add_argument("--no-validate", action="store_true", help="skip the checker and the numeric checks")
    add_data_file_size(parser)
    parser.add_argument("--show-blocks", action="store_true", help="print the block table and exit")
    parser.add_argument(
        "--json", action="store_true", help="machine-readable output (with --show-blocks/--verify)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="MODEL ARTIFACT: check ARTIFACT (fused, healed, FP8, decode graph, TP rank folder or "
        "exported checkpoint, told from its metadata) against its source MODEL; exit 1 when a check fails",
    )
    parser.add_argument(
        "--max-kl", type=float, help="--verify of a healed model: bound on KL(original || healed), nats"
    )
    parser.add_argument(
        "--max-error", type=float, default=0.15, help="--verify of an FP8 model: bound on the logits' "
        "relative error against the source (default 0.15)"
    )
    parser.add_argument(
        "--text", type=Path, nargs="+", help="--verify of a healed model: held-out text files, or "
        "one .npy of token ids as heal.py --heldout takes (default: the machine's prose and code)"
    )
    parser.add_argument("--junit", type=Path, help="--verify: also write the checks as JUnit XML to FILE")
    # Intermixed, so that `--verify MODEL FUSED` and `MODEL --verify FUSED` both read as two paths.
    args = parser.parse_intermixed_args(argv)
    if args.verify and args.plan is None:
        parser.error("--verify needs two models: --verify original.onnx fused.onnx")
    if not args.verify and (args.max_kl is not None or args.junit or args.text):
        parser.error("--max-kl, --text and --junit go with --verify")
    if args.max_kl is not None and not args.max_kl >= 0 or not args.max_error > 0:
        parser.error("--max-kl must be >= 0 and --max-error > 0")
    if not (args.show_blocks or args.verify) and args.plan is None:
        parser.error("a plan.json is required (or --show-blocks / --verify MODEL FUSED)")
    args.max_data_file_bytes = data_file_bytes(args)
    args.fused = args.plan if args.verify else None
    return args


def show_blocks(args: argparse.Namespace) -> int:
    blocks = find_blocks(load_model(args.model))
    if args.json:
        print(json.dumps({"blocks": [b.row() for b in blocks]}, indent=1))
    else:
        print(format_block_table(blocks))
    return 0


def verify(args: argparse.Namespace) -> int:
    if args.junit is not None and not args.junit.parent.is_dir():
        raise UserError(f"--junit {args.junit}: folder {args.junit.parent} does not exist")
    options = VerifyOptions(max_kl=args.max_kl, max_error=args.max_error, text=tuple(args.text or ()))
    report = verify_artifact(args.model, args.fused, options)
    if args.junit is not None:
        report.write_junit(args.junit)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print("\n".join(report.lines()))
        print("verified" if report.ok else "MISMATCH")
    return 0 if report.ok else 1


def fuse(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    plan = load_plan(args.plan)
    result = fuse_file(
        args.model,
        plan,
        args.output,
        validate_output=not args.no_validate,
        log=lambda m: print(m, file=sys.stderr),
        max_data_file_bytes=args.max_data_file_bytes,
    )
    members = [ffn_members(result.blocks_before, group) for group in plan.groups]
    groups = (
        ", ".join(
            f"[{i}, {j}] ({len(ffns)} FFNs, width {sum(b.width for b in ffns)})"
            for (i, j), ffns in zip(plan.groups, members, strict=True)
        )
        or "none (empty plan)"
    )
    print(f"fused groups: {groups}")
    if plan.parallel:
        parallel = ", ".join(f"[{i}, {j}] ({j - i + 1} blocks read one stream)" for i, j in plan.parallel)
        print(f"parallel groups: {parallel}")
    print(f"blocks: {len(result.blocks_before)} -> {result.blocks_after}")
    print(f"nodes: {result.nodes_before} -> {result.nodes_after}")
    if result.report is not None:
        print("\n".join(result.report.lines()))
    print(f"wrote {result.output} in {time.perf_counter() - start:.2f} s")
    return 0


def main() -> int:
    args = parse_args()
    if args.verify:
        return verify(args)
    if args.show_blocks:
        return show_blocks(args)
    if not args.plan:
        raise UserError("a plan.json is required")
    return fuse(args)


if __name__ == "__main__":
    run_cli(main)
