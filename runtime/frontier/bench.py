"""The frontier's plans decoded for real beside the prediction: each frontier plan fused and sharded into
`tp` rank graphs, every rank its own process with gloo all-reduces (runtime/bench/decode.py), all models
alternating within every repetition, and each plan's decode tokens/s as a ratio to the original's. On
these shared CPUs this measures the all-reduces and per-layer overheads fusion removes, not a GPU's
speed."""

from __future__ import annotations

import tempfile
from pathlib import Path

from passes.pipeline import fuse_file
from passes.shard import shard_file
from runtime.bench.decode import BenchCase, bench_tp_gloo, speedups
from runtime.frontier.report import Entry

CASE = BenchCase(batch=1, prompt_len=32, gen_len=16)


def decode_ratios(model: Path, entries: list[Entry], tp: int, vocab: int, workdir: Path, reps: int = 3,
                  log=lambda message: None) -> dict[str, float]:
    """label -> the plan's decode tokens/s over the original's, TP `tp` over gloo on this machine's CPUs."""
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".bench-tp.") as tmp:
        dirs = {"original": Path(tmp) / "original"}
        shard_file(model, tp, dirs["original"], progress=False)
        for entry in entries:
            fused = Path(tmp) / entry.label / "model.onnx"
            fused.parent.mkdir()
            fuse_file(model, entry.plan, fused, validate_output=False)  # fuse_onnx.py validates a kept plan
            dirs[entry.label] = Path(tmp) / f"{entry.label}-tp{tp}"
            shard_file(fused, tp, dirs[entry.label], progress=False)
        log(f"decoding the original and {len(entries)} plan(s) over TP {tp} (gloo), {reps} repetitions")
        results = bench_tp_gloo(dirs, tp, [CASE], vocab, reps=reps, warmup=1, threads=1)
    return {row["model"]: row["decode_tokens_per_s"] for row in speedups(results)}
