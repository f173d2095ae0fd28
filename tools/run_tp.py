"""Run tensor-parallel rank graphs: one process per rank under torchrun, all-reduces through gloo.

Examples:
  torchrun --nproc-per-node 2 tools/run_tp.py tp2/ --tokens ids.npy --out logits.npy
  torchrun --nproc-per-node 2 tools/run_tp.py tp2/ --tokens ids.npy --out logits.npy --reference model.onnx
  torchrun --nproc-per-node 2 tools/run_tp.py a_tp2/ b_tp2/ --tokens ids.npy --out a.npy b.npy   # one launch
  python tools/run_tp.py tp2/ --tokens ids.npy --out logits.npy --simulate       # all ranks in one process
  torchrun --nproc-per-node 8 tools/run_tp.py tp8/ --tokens ids.npy --out logits.npy --backend trt   # GPUs

--tokens is an int64 .npy of token ids [batch, seq]; rank 0 writes float32 logits to --out. The ORT
backend runs each rank graph in ONNX Runtime, cut at its DistCollective nodes (runtime/tp/ort.py); the trt
backend runs one TensorRT engine per rank with an NCCL communicator (runtime/tp/trt.py, needs GPUs;
engines default to DIR/rank{r}/model.engine, or --engines 'engines/rank{rank}.engine').
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from passes.errors import UserError, run_cli
from runtime.text_sets import load_token_file
from runtime.tp.gloo import torchrun_group
from runtime.tp.ort import reference_error, run_distributed, run_simulated
from runtime.tp.trt import run_distributed_trt

HINT = "torchrun --nproc-per-node N tools/run_tp.py DIR ... (or --simulate)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="folder(s) written by tools/shard_tp.py (tp.json)")
    parser.add_argument("--tokens", type=Path, required=True, help="int64 .npy token ids [batch, seq]")
    parser.add_argument(
        "--out",
        type=Path,
        nargs="+",
        required=True,
        help="where rank 0 writes the float32 logits (.npy), one per folder",
    )
    parser.add_argument("--backend", choices=("ort", "trt"), default="ort")
    parser.add_argument("--engines", default=None, help="trt: engine path pattern with {rank}")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads per rank")
    parser.add_argument("--simulate", action="store_true", help="run every rank in this one process")
    parser.add_argument(
        "--reference",
        type=Path,
        nargs="+",
        help="single-device model(s), one per folder: rank 0 prints the relative error",
    )
    return parser


def run_one(args: argparse.Namespace, directory: Path, tokens: np.ndarray) -> np.ndarray | None:
    if args.simulate:
        return run_simulated(directory, tokens, threads=args.threads)
    if args.backend == "trt":
        return run_distributed_trt(directory, tokens, engine_pattern=args.engines)
    return run_distributed(directory, tokens, threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.out) != len(args.dirs):
        raise UserError(f"give one --out per folder ({len(args.dirs)} folders, {len(args.out)} outputs)")
    if args.reference is not None and len(args.reference) != len(args.dirs):
        raise UserError(f"give one --reference per folder ({len(args.dirs)} folders)")
    tokens = load_token_file(args.tokens, rows=True)
    with nullcontext((0, 1)) if args.simulate else torchrun_group(HINT) as (rank, _):
        for k, (directory, out) in enumerate(zip(args.dirs, args.out, strict=True)):
            logits = run_one(args, directory, tokens)
            if rank == 0 and logits is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                np.save(out, logits.astype(np.float32))
                print(f"rank 0: {directory}: logits {list(logits.shape)} -> {out}")
                if args.reference is not None:
                    error = reference_error(args.reference[k], tokens, logits)
                    print(f"relative error vs {args.reference[k]}: {error:.3e}")
    return 0


if __name__ == "__main__":
    run_cli(main)
