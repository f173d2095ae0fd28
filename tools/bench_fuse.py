"""Scale benchmark of the fusion pass (issue 13): peak memory and time against copying the weights.

By default it measures both shapes of issue 13 in one run, each against a copy of its own files:
  fp32-24x2048x8192-groups-of-4   4.8 GB fp32, 24 FFNs of 2048 x 8192, fused in groups of 4
  fp16-3x8192x28672-one-group     3 fp16 FFNs of Llama-70B's shape, fused in one group
each with "fold" and "last", and, on the first, FP8 quantization, TP 8 sharding and tools/analyze.py
(--engine: also an FP8 TensorRT-RTX engine build). Each step runs in a fresh child process whose own
peak RSS is read (runtime/bench/peak_memory.py). Bounds: fusing <= 256 MB and <= 1.2x the copy; with
validation,
FP8, sharding and analysis <= 512 MB. Needs about 3x the model size of free disk in --workdir.
Times against the copy, three ways: best against best copy, median against median copy, and "paired": the
median over the rounds of each fusion's time over the mean of the copies just before and after its round
(the least sensitive to a host whose speed drifts within minutes).

  python tools/bench_fuse.py [--workdir DIR] [--repeat N] [--json]
  python tools/bench_fuse.py --no-stages --repeat 3    # fusion against copy only, 3 rounds
  python tools/bench_fuse.py --shape small:256:1024:4:2:float32 --no-stages    # a quick run
  python tools/bench_fuse.py --shape mid:1024:4096:8:4:float32 --engine         # with an engine build
  python tools/bench_fuse.py --no-stages --repeat 4 --against ../old   # side by side with another checkout

--against DIR runs the same fusions with DIR's code (a `git worktree` of an older commit) in the same
rounds, each right before or after ours, alternating; its rows are marked @DIR. (A checkout's own tools
run with this .venv import this checkout's `passes` unless PYTHONPATH says otherwise: the editable
install. The bench sets it and checks which package the child imports.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.bench import fuse as fuse_bench


def parse_shape(text: str) -> tuple[str, tuple]:
    """NAME:HIDDEN:FFN:BLOCKS:GROUP:DTYPE"""
    parts = text.split(":")
    if len(parts) != 6 or parts[5] not in ("float32", "float16", "bfloat16"):
        raise UserError(f"--shape {text!r}: expected NAME:HIDDEN:FFN:BLOCKS:GROUP:float32|float16|bfloat16")
    try:
        hidden, ffn, blocks, group = (int(p) for p in parts[1:5])
    except ValueError:
        raise UserError(f"--shape {text!r}: HIDDEN, FFN, BLOCKS and GROUP must be integers") from None
    if min(hidden, ffn, blocks) < 1 or group < 2:
        raise UserError(f"--shape {text!r}: sizes must be positive and GROUP at least 2")
    return parts[0], (hidden, ffn, blocks, group, parts[5])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", action="append", help="NAME:HIDDEN:FFN:BLOCKS:GROUP:DTYPE (repeatable)")
    parser.add_argument(
        "--no-stages", action="store_true", help="skip the FP8, sharding and analysis measurements"
    )
    parser.add_argument(
        "--engine", action="store_true", help="also build an FP8 TensorRT-RTX engine of the first shape"
    )
    parser.add_argument(
        "--workdir", type=Path, help="where to build the models (default: a temporary folder)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of copy, fold and last, alternating (best, median and paired reported; default 1)",
    )
    parser.add_argument(
        "--against", type=Path, help="another checkout whose fusions run side by side with ours"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.repeat < 1:
        raise UserError(f"--repeat {args.repeat}: give at least 1 round")
    against = _checkout(args.against) if args.against else None
    shapes = dict(parse_shape(s) for s in args.shape) if args.shape else fuse_bench.SHAPES
    if args.workdir:
        args.workdir = args.workdir.resolve()  # the fusions run in their checkout's folder
        args.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for index, (name, spec) in enumerate(shapes.items()):
            stages = index == 0 and not args.no_stages
            engine = index == 0 and args.engine
            result = fuse_bench.bench_shape(
                name, spec, Path(tmp), stages, log=_log, engine=engine, repeat=args.repeat, against=against
            )
            results.append(result)
    print(fuse_bench.as_json(results) if args.json else fuse_bench.report(results))
    return 0


def _checkout(path: Path) -> Path:
    """`path` as a checkout whose fusion imports its own code."""
    root = path.resolve()
    if not (root / "tools" / "fuse_onnx.py").is_file() or not (root / "passes").is_dir():
        raise UserError(f"--against {path}: not a checkout of this project (no tools/fuse_onnx.py, passes/)")
    imported = fuse_bench.imports_from(root)
    if imported != root / "passes":
        found = imported or "nowhere (import failed)"
        raise UserError(f"--against {path}: its tools import passes from {found}, not {root / 'passes'}")
    return root


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_cli(main)
