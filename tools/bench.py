"""Benchmark greedy generation of an original and a fused decode graph, measured alternately.

    python tools/bench.py --original model_decode.onnx --fused model_decode.fused.onnx \
        [--tp N] [--batch 1 4] [--prompt-len 32 128] [--gen-len 32] --out DIR

Writes DIR/bench.json, DIR/bench.md and DIR/bench.png: time to first token, decode tokens/s,
per-token latency p50/p90 and all-reduces per token (one per attention and per FFN sub-block, from the
block table). With --tp N > 1 the two graphs are sharded with passes.shard (or given as sharded
folders) and run rank by rank: --tp-mode gloo (default) puts every rank in its own process with gloo
all-reduces, threads runs them in one process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.generate import BenchCase, BenchResult, DecodeModel, bench_models, bench_tp_gloo, model_info

FORMAT = "ffn-fusion-bench/1"
MODELS = ("original", "fused")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--original", required=True, help="decode graph (.onnx) or sharded folder")
    p.add_argument("--fused", required=True, help="fused decode graph (.onnx) or sharded folder")
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
    args = p.parse_args(argv)
    if args.gen_len < 2:
        raise UserError("--gen-len must be at least 2 (one prefill token and at least one decode step)")
    if min(args.batch) < 1 or min(args.prompt_len) < 1 or args.reps < 1 or args.warmup < 0:
        raise UserError("--batch, --prompt-len and --reps must be positive, --warmup not negative")
    return args


def prepare(args: argparse.Namespace) -> dict[str, Path]:
    """The two targets; with --tp > 1, .onnx files are sharded into DIR/shards/<name>_tp<N>."""
    targets = {"original": Path(args.original), "fused": Path(args.fused)}
    for name, path in targets.items():
        if not path.exists():
            raise UserError(f"--{name} {path} does not exist")
        if args.tp > 1 and not path.is_dir():
            from passes.shard import shard_file

            out = args.out / "shards" / f"{name}_tp{args.tp}"
            shard_file(path, args.tp, out, progress=not args.quiet)
            targets[name] = out
        elif args.tp == 1 and path.is_dir():
            raise UserError(f"--{name} {path} is a sharded folder; pass --tp with its rank count")
    return targets


def measure(args: argparse.Namespace, targets: dict[str, Path], vocab: int) -> list[BenchResult]:
    cases = [BenchCase(b, p, args.gen_len) for b in args.batch for p in args.prompt_len]
    if args.tp > 1 and args.tp_mode == "gloo":
        return bench_tp_gloo(targets, args.tp, cases, vocab, args.reps, args.warmup, args.threads or 1)
    models = {
        name: DecodeModel.open(path, device=args.device, threads=args.threads, tp_mode="threads")
        for name, path in targets.items()
    }
    return bench_models(models, cases, vocab, args.reps, args.warmup, args.seed, progress=not args.quiet)


def machine() -> dict:
    import onnxruntime

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def speedups(results: list[BenchResult]) -> list[dict]:
    by_case: dict[tuple[int, int], dict[str, BenchResult]] = {}
    for r in results:
        by_case.setdefault((r.batch, r.prompt_len), {})[r.model] = r
    rows = []
    for (batch, prompt), pair in by_case.items():
        a, b = pair["original"], pair["fused"]
        rows.append(
            {
                "batch": batch,
                "prompt_len": prompt,
                "decode_tokens_per_s": b.decode_tokens_per_s / a.decode_tokens_per_s,
                "ttft": a.ttft_ms / b.ttft_ms,
                "token_latency_p50": a.token_latency_ms_p50 / b.token_latency_ms_p50,
                "greedy_token_agreement": b.token_agreement,
            }
        )
    return rows


def report(
    args: argparse.Namespace, targets: dict[str, Path], infos: dict[str, dict], results: list[BenchResult]
) -> dict:
    return {
        "format": FORMAT,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "tp": args.tp,
        "tp_mode": args.tp_mode if args.tp > 1 else None,
        "device": args.device,
        "threads": args.threads,
        "reps": args.reps,
        "warmup": args.warmup,
        "gen_len": args.gen_len,
        "order": "alternating (ABBA) within every repetition",
        "models": infos,
        "results": [asdict(r) for r in results],
        "speedup": speedups(results),
    }


def markdown(data: dict) -> str:
    infos, m = data["models"], data["machine"]
    lines = [
        f"# Generation benchmark ({data['date']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; ONNX Runtime {m['onnxruntime']}, device {data['device']}, "
        f"TP {data['tp']}"
        + (f" ({data['tp_mode']})" if data["tp_mode"] else "")
        + f"; {data['reps']} timed repetitions after {data['warmup']} warm-up, models alternating.",
        "",
        "| model | blocks | attention | all-reduces / token | KV cache bytes / token | path |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, info in infos.items():
        reduces = str(info["allreduces_per_token"])
        if "collectives_per_forward" in info:
            reduces += f" ({info['collectives_per_forward']} DistCollective in the rank graph)"
        lines.append(
            f"| {name} | {info['blocks']} | {info['attention_blocks']} | {reduces} "
            f"| {info['kv_cache_bytes_per_token']} | `{Path(info['path']).name}` |"
        )
    lines += [
        "",
        "| batch | prompt | gen | model | TTFT ms | decode tok/s | token p50 ms | token p90 ms |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['batch']} | {r['prompt_len']} | {r['gen_len']} | {r['model']} | {r['ttft_ms']:.2f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['token_latency_ms_p50']:.2f} "
            f"| {r['token_latency_ms_p90']:.2f} |"
        )
    lines += [
        "",
        "| batch | prompt | decode speedup | TTFT speedup | p50 latency speedup | greedy agreement |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in data["speedup"]:
        lines.append(
            f"| {s['batch']} | {s['prompt_len']} | {s['decode_tokens_per_s']:.3f}x | {s['ttft']:.3f}x "
            f"| {s['token_latency_p50']:.3f}x | {s['greedy_token_agreement']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = data["results"]
    cases = list(dict.fromkeys((r["batch"], r["prompt_len"]) for r in results))
    labels = [f"batch {b}\nprompt {p}" for b, p in cases]
    get = {(r["model"], r["batch"], r["prompt_len"]): r for r in results}
    x = np.arange(len(cases))
    width = 0.38
    colors = {"original": "#7f8c8d", "fused": "#2e86de"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [
        ("decode_tokens_per_s", "decode tokens/s (higher is better)", None),
        ("token_latency_ms_p50", "per-token latency ms, p50 (bar) / p90 (tick)", "token_latency_ms_p90"),
        ("ttft_ms", "time to first token ms", None),
    ]
    for ax, (key, title, upper) in zip(axes, panels, strict=True):
        for k, name in enumerate(MODELS):
            values = [get[(name, b, p)][key] for b, p in cases]
            tops = [get[(name, b, p)][upper] for b, p in cases] if upper else values
            offset = (k - 0.5) * width
            info = data["models"][name]
            ax.bar(
                x + offset,
                values,
                width,
                color=colors[name],
                label=f"{name}: {info['blocks']} blocks, {info['allreduces_per_token']} all-reduces/token",
            )
            if upper:
                ax.errorbar(
                    x + offset,
                    values,
                    yerr=[[0] * len(values), np.subtract(tops, values)],
                    fmt="none",
                    ecolor="black",
                    capsize=4,
                    lw=1,
                )
            for xi, value, top in zip(x + offset, values, tops, strict=True):
                ax.annotate(
                    _short(value),
                    (xi, top),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(x, labels, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=2, fontsize=9, frameon=False)
    m = data["machine"]
    fig.suptitle(
        f"Greedy generation, original vs fused - TP {data['tp']}, gen {data['gen_len']} tokens, "
        f"{m['cores']}-core {m['cpu']}, {data['date']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    targets = prepare(args)
    infos = {name: model_info(path) for name, path in targets.items()}
    vocab = infos["original"]["vocab"]
    if not vocab:
        raise UserError(f"cannot tell the vocabulary size of {args.original} (no static logits dim)")
    results = measure(args, targets, vocab)
    data = report(args, targets, infos, results)
    (args.out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "bench.md").write_text(markdown(data))
    plot(data, args.out / "bench.png")
    print(markdown(data))
    print(f"wrote {args.out / 'bench.json'}, bench.md, bench.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
