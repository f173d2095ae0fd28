"""Split an ONNX model into tensor-parallel rank graphs, or count its all-reduces per forward pass.

Examples:
  python tools/shard_tp.py model.onnx --tp 8 --out tp8/
  python tools/shard_tp.py model.fused.onnx --tp 8 --out tp8/ --lm-head vocab
  python tools/shard_tp.py model.onnx model.fused.onnx --count

Writes DIR/rank{r}/model.onnx (+ model.onnx.data, or numbered data files with --max-data-file-gb) for
r = 0..N-1 and DIR/tp.json (N, the rank files, all-reduces per forward). Run the ranks on CPU with
  torchrun --nproc-per-node N tools/run_tp.py DIR --tokens ids.npy --out logits.npy
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from passes.errors import UserError, run_cli
from passes.shard import allreduce_line, shard_file
from runtime.cli import add_data_file_size, data_file_bytes, tool_parser


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("shard_tp.py", __doc__)
    parser.add_argument("models", nargs="+", type=Path, help="ONNX model(s); one unless --count")
    parser.add_argument("--tp", type=int, help="number of ranks: 1, 2, 4 or 8")
    parser.add_argument("--out", type=Path, help="output folder for the rank graphs and tp.json")
    parser.add_argument(
        "--lm-head",
        choices=("replicated", "vocab"),
        default="replicated",
        help="replicate the lm_head (default) or split it by vocabulary with an all-gather",
    )
    parser.add_argument(
        "--external-data",
        choices=("auto", "yes", "no"),
        default="auto",
        help="weights in model.onnx.data: auto = when the source has external data or is large",
    )
    add_data_file_size(parser, "DIR/rank{r}/model.onnx")
    parser.add_argument("--count", action="store_true", help="only print all-reduces per forward pass")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.count:
        for path in args.models:
            if not path.is_file():
                raise UserError(f"model {path} does not exist")
            print(allreduce_line(path))
        return 0
    if len(args.models) != 1:
        raise UserError("give one model to shard (several only with --count)")
    if args.tp is None or args.out is None:
        raise UserError("sharding needs --tp N and --out DIR")
    model = args.models[0]
    if not model.is_file():
        raise UserError(f"model {model} does not exist")
    external = {"auto": None, "yes": True, "no": False}[args.external_data]
    max_data_file_bytes = data_file_bytes(args)
    print(allreduce_line(model))
    report = shard_file(
        model,
        args.tp,
        args.out,
        lm_head=args.lm_head,
        external_data=external,
        max_data_file_bytes=max_data_file_bytes,
        progress=not args.quiet and sys.stderr.isatty(),
    )
    for line in report.lines():
        print(line)
    return 0


if __name__ == "__main__":
    run_cli(main)
