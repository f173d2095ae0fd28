"""Benchmark greedy generation of an original and a fused decode graph, measured alternately.

    python tools/bench.py --original model_decode.onnx --fused model_decode.fused.onnx \
        [--parallel model_decode.parallel.onnx] [--tp N] [--batch 1 4] [--prompt-len 32 128] \
        [--gen-len 32] --out DIR

Writes DIR/bench.json, DIR/bench.md and DIR/bench.png: time to first token, decode tokens/s,
per-token latency p50/p90 and all-reduces per token (one per attention and per FFN sub-block, from the
block table; a parallel group of k blocks needs 2 instead of 2k). --parallel adds a third model: the
fused graph with parallel groups of blocks too (fuse_onnx.py with a plan that has "parallel_blocks").
With --tp N > 1 the graphs are sharded with passes.shard (or given as sharded folders) and run rank by
rank: --tp-mode gloo (default) puts every rank in its own process with gloo all-reduces, threads runs
them in one process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from passes.errors import run_cli
from runtime.bench.decode import BenchSettings, run_benchmark
from runtime.bench.report import markdown, plot


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--original", required=True, help="decode graph (.onnx) or sharded folder")
    p.add_argument("--fused", required=True, help="fused decode graph (.onnx) or sharded folder")
    p.add_argument("--parallel", type=Path, help="fused decode graph with parallel blocks too (optional)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (1, 2, 4, 8)")
    p.add_argument("--tp-mode", choices=("gloo", "threads"), default="gloo")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[32, 128])
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per model and case")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (per rank)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (ONNX Runtime provider)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = BenchSettings(
        tp=args.tp,
        tp_mode=args.tp_mode,
        batch=tuple(args.batch),
        prompt_len=tuple(args.prompt_len),
        gen_len=args.gen_len,
        reps=args.reps,
        warmup=args.warmup,
        threads=args.threads,
        device=args.device,
        seed=args.seed,
        progress=not args.quiet,
    )
    settings.check()
    args.out.mkdir(parents=True, exist_ok=True)
    data = run_benchmark(settings, Path(args.original), Path(args.fused), args.out, args.parallel)
    (args.out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "bench.md").write_text(markdown(data))
    plot(data, args.out / "bench.png")
    print(markdown(data))
    print(f"wrote {args.out / 'bench.json'}, bench.md, bench.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
