"""The project's benchmarks, one subcommand each; each prints ratios measured side by side in one run.

  python tools/bench.py decode --original m_decode.onnx --fused m_decode.fused.onnx --out DIR
  python tools/bench.py serve http://127.0.0.1:8000 http://127.0.0.1:8001 --out DIR [--gguf M.gguf]
  python tools/bench.py fuse [--no-stages] [--repeat 3]       # fusion against a copy of the weights
  python tools/bench.py export [--convert]                    # export_model.py --hf against a copy
  python tools/bench.py export-checkpoint [--gguf f32,q8_0]   # export_checkpoint.py against a copy
  python tools/bench.py sharders                              # passes.shard against Polygraphy's sharder
  python tools/bench.py latency [--gpu h200]                  # the analytical 8-GPU decode latency model

`python tools/bench.py SUBCOMMAND --help` describes each one. The measuring code is runtime/bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.bench import export as export_bench
from runtime.bench import export_checkpoint as checkpoint_bench
from runtime.bench import fuse as fuse_bench
from runtime.bench import llama_server
from runtime.bench import serve as serve_bench
from runtime.bench.decode import BenchSettings, run_benchmark
from runtime.bench.report import markdown, plot
from runtime.bench.serve import Target
from runtime.bench.sharders import format_table, run_comparison
from runtime.latency.report import format_paper_report, paper_report

Subcommands = argparse._SubParsersAction  # noqa: SLF001 (argparse names no public type for it)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def subcommand(subs: Subcommands, name: str, doc: str, run: Callable[[argparse.Namespace], int]):
    parser = subs.add_parser(name, help=doc.split("\n")[0], description=doc,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=run)
    return parser


# ------------------------------------------------------------------------------------------------ decode

DECODE = """Greedy generation of an original and a fused decode graph, measured alternately.

    python tools/bench.py decode --original model_decode.onnx --fused model_decode.fused.onnx \\
        [--parallel model_decode.parallel.onnx] [--tp N] [--batch 1 4] [--prompt-len 32 128] \\
        [--gen-len 32] --out DIR

Writes DIR/bench.json, DIR/bench.md and DIR/bench.png: time to first token, decode tokens/s,
per-token latency p50/p90 and all-reduces per token (one per attention and per FFN sub-block, from the
block table; a parallel group of k blocks needs 2 instead of 2k). --parallel adds a third model: the
fused graph with parallel groups of blocks too (fuse_onnx.py with a plan that has "parallel_blocks").
With --tp N > 1 the graphs are sharded with passes.shard (or given as sharded folders) and run rank by
rank: --tp-mode gloo (default) puts every rank in its own process with gloo all-reduces, threads runs
them in one process.
"""


def add_decode(subs: Subcommands) -> None:
    p = subcommand(subs, "decode", DECODE, run_decode)
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


def run_decode(args: argparse.Namespace) -> int:
    settings = BenchSettings(
        tp=args.tp, tp_mode=args.tp_mode, batch=tuple(args.batch), prompt_len=tuple(args.prompt_len),
        gen_len=args.gen_len, reps=args.reps, warmup=args.warmup, threads=args.threads, device=args.device,
        seed=args.seed, progress=not args.quiet,
    )
    settings.check()
    args.out.mkdir(parents=True, exist_ok=True)
    data = run_benchmark(settings, Path(args.original), Path(args.fused), args.out, args.parallel)
    (args.out / "bench.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "bench.md").write_text(markdown(data))
    plot(data, args.out / "bench.png")
    print(markdown(data))
    log(f"wrote {args.out / 'bench.json'}, bench.md, bench.png")
    return 0


# ------------------------------------------------------------------------------------------------- serve

SERVE = """TTFT, inter-token latency p50/p90/p99 and output tokens/s of one or two OpenAI-API servers at
several concurrencies, the servers measured alternately in one run (runtime/bench/serve.py).

    python tools/bench.py serve http://127.0.0.1:8000 http://127.0.0.1:8001 \\
        --concurrency 1 2 4 8 --requests 32 [--labels original fused] [--max-tokens 32] \\
        [--prompt-words 48] [--rounds 2] --out bench_serve/

llama.cpp beside this project's server on the same model: --gguf starts llama-server on each GGUF file
(free port, one slot per client of the highest concurrency) and stops it at the end
(runtime/bench/llama_server.py; `make llama-cpp` builds llama-server):

    python tools/bench.py serve http://127.0.0.1:8000 --labels onnx-f32 \\
        --gguf model-f32.gguf model-q8_0.gguf [--llama-server PATH] \\
        --concurrency 1 8 --requests 16 --max-tokens 128 --out bench_llama/

Writes DIR/bench_serve.json, DIR/bench_serve.md and DIR/bench_serve.png (and DIR/llama-server-N.log).
"""


def add_serve(subs: Subcommands) -> None:
    p = subcommand(subs, "serve", SERVE, run_serve)
    p.add_argument("urls", nargs="*", metavar="URL", help="server base URL(s), e.g. http://127.0.0.1:8000")
    p.add_argument("--labels", nargs="+", default=None, help="names of the servers (default: original fused)")
    p.add_argument("--model", nargs="+", default=None, help="model id per server (default: its first model)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=32, help="requests per server and concurrency")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--prompt-words", type=int, default=48, help="words per prompt (default 48)")
    p.add_argument("--rounds", type=int, default=2, help="turns per server and concurrency, ABBA (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (default 2)")
    p.add_argument("--out", type=Path, default=Path("bench_serve"), help="output folder")
    p.add_argument("--gguf", nargs="+", type=Path, default=[], metavar="GGUF",
                   help="also measure llama.cpp's llama-server on these GGUF files (e.g. an f32 and a q8_0 "
                   "file of the same model), started and stopped by the benchmark")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary for --gguf (default: llama-server on PATH)")
    p.add_argument("--llama-context", type=int, default=1024, metavar="TOKENS",
                   help="llama-server's context per slot (default 1024; -c is this times the slots)")
    p.add_argument("--llama-threads", type=int, default=None, metavar="T",
                   help="llama-server's --threads (default: its own choice)")


def serve_targets(args: argparse.Namespace) -> list[Target]:
    if len(args.urls) > 2:
        raise UserError("give one or two server URLs (original, then fused)")
    if not args.urls and not args.gguf:
        raise UserError("give one or two server URLs, or --gguf files for llama-server")
    labels = args.labels or ["original", "fused"][: len(args.urls)]
    models = args.model or [""] * len(args.urls)
    if len(labels) != len(args.urls) or len(models) != len(args.urls) or len(set(labels)) != len(labels):
        raise UserError("--labels and --model need one distinct entry per URL")
    for url in args.urls:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
    numbers = {
        "--requests": [args.requests], "--max-tokens": [args.max_tokens], "--rounds": [args.rounds],
        "--prompt-words": [args.prompt_words], "--concurrency": args.concurrency,
    }
    for flag, values in numbers.items():
        if any(v < 1 for v in values):
            raise UserError(f"{flag} must be at least 1")
    if args.requests < args.rounds:
        raise UserError("--requests must be at least --rounds")
    if args.llama_context < 1 or (args.llama_threads is not None and args.llama_threads < 1):
        raise UserError("--llama-context and --llama-threads must be at least 1")
    for path in args.gguf:
        llama_server.check_gguf(path)
    if args.gguf:
        args.llama_server = llama_server.find_binary(args.llama_server)
    return [Target(label, url, model) for label, url, model in zip(labels, args.urls, models, strict=True)]


def run_serve(args: argparse.Namespace) -> int:
    targets = serve_targets(args)
    with contextlib.ExitStack() as servers:
        if args.gguf:
            args.out.mkdir(parents=True, exist_ok=True)
            targets += llama_server.start_peers(
                servers, args.llama_server, args.gguf, max(args.concurrency), args.out,
                context_per_slot=args.llama_context, threads=args.llama_threads, log=log)
        data = serve_bench.run(targets, sorted(set(args.concurrency)), args.requests, args.max_tokens,
                               args.prompt_words, args.rounds, args.warmup, log=log)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_serve.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (args.out / "bench_serve.md").write_text(serve_bench.markdown(data), encoding="utf-8")
    serve_bench.plot(data, args.out / "bench_serve.png")
    print(serve_bench.markdown(data))
    log(f"wrote {args.out}/bench_serve.json, .md, .png")
    return 0


# -------------------------------------------------------------------------------------------------- fuse

FUSE = """Scale benchmark of the fusion pass (issue 13): peak memory and time against copying the weights.

By default it measures both shapes of issue 13 in one run, each against a copy of its own files:
  fp32-24x2048x8192-groups-of-4   4.8 GB fp32, 24 FFNs of 2048 x 8192, fused in groups of 4
  fp16-3x8192x28672-one-group     3 fp16 FFNs of Llama-70B's shape, fused in one group
each with "fold" and "last", and, on the first, FP8 quantization, TP 8 sharding and tools/analyze.py
(--engine: also an FP8 TensorRT-RTX engine build). Each step runs in a fresh child process whose own
peak RSS is read (runtime/bench/peak_memory.py). Bounds: fusing <= 256 MB and <= 1.2x the copy; with
validation, FP8, sharding and analysis <= 512 MB. Needs about 3x the model size of free disk in --workdir.
Times against the copy, three ways: best against best copy, median against median copy, and "paired": the
median over the rounds of each fusion's time over the mean of the copies just before and after its round
(the least sensitive to a host whose speed drifts within minutes).

  python tools/bench.py fuse [--workdir DIR] [--repeat N] [--json]
  python tools/bench.py fuse --no-stages --repeat 3    # fusion against copy only, 3 rounds
  python tools/bench.py fuse --shape small:256:1024:4:2:float32 --no-stages    # a quick run
  python tools/bench.py fuse --shape mid:1024:4096:8:4:float32 --engine         # with an engine build
  python tools/bench.py fuse --no-stages --repeat 4 --against ../old   # side by side with another checkout

--against DIR runs the same fusions with DIR's code (a `git worktree` of an older commit) in the same
rounds, each right before or after ours, alternating; its rows are marked @DIR. (A checkout's own tools
run with this .venv import this checkout's `passes` unless PYTHONPATH says otherwise: the editable
install. The bench sets it and checks which package the child imports.)
"""


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


def add_fuse(subs: Subcommands) -> None:
    p = subcommand(subs, "fuse", FUSE, run_fuse)
    p.add_argument("--shape", action="append", help="NAME:HIDDEN:FFN:BLOCKS:GROUP:DTYPE (repeatable)")
    p.add_argument("--no-stages", action="store_true",
                   help="skip the FP8, sharding and analysis measurements")
    p.add_argument("--engine", action="store_true",
                   help="also build an FP8 TensorRT-RTX engine of the first shape")
    p.add_argument("--workdir", type=Path, help="where to build the models (default: a temporary folder)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of copy, fold and last, alternating (best, median and paired reported; "
                   "default 1)")
    p.add_argument("--against", type=Path, help="another checkout whose fusions run side by side with ours")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def run_fuse(args: argparse.Namespace) -> int:
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
            stages, engine = index == 0 and not args.no_stages, index == 0 and args.engine
            results.append(fuse_bench.bench_shape(name, spec, Path(tmp), stages, log=log, engine=engine,
                                                  repeat=args.repeat, against=against))
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


# ------------------------------------------------------------------------------------------------ export

EXPORT = """Streaming benchmark of `export_model.py --hf` on a generated multi-GB nemotron-nas checkpoint.

Measures, side by side and each in a fresh child process (peak RSS from /proc VmHWM): a plain copy of the
checkpoint's safetensors files, the bf16 export (weights copied by the kernel in a second thread while the
graph is built with onnx-ir, no torch), and with --convert the float16 export, alternating for
--rounds rounds after one untimed copy (the page cache in the same state for each; `sync` before each).
Bounds: peak RSS <= 1 GB + the largest single tensor, time within 2x of the copy (runtime/bench/export.py).
Default: hidden 2048, 72 layers (every other one attention-free), vocab 32000: about 3.8 GB bf16; needs
about 2.5x that of free disk in --workdir (default /tmp); everything is deleted afterwards.

  python tools/bench.py export [--workdir DIR] [--rounds 2] [--convert] [--json]
  python tools/bench.py export --hidden 256 --layers 4 --vocab 1000     # a quick run
"""


def add_checkpoint_shape(p: argparse.ArgumentParser) -> None:
    """The generated checkpoint's shape and the rounds: export and export-checkpoint share them."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=72)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="copy/export rounds, alternating (default 2)")
    p.add_argument("--workdir", type=Path, help="where to write (default: a temporary folder in /tmp)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def add_export(subs: Subcommands) -> None:
    p = subcommand(subs, "export", EXPORT, run_export)
    add_checkpoint_shape(p)
    p.add_argument("--convert", action="store_true", help="also export with --dtype float16")


def run_export(args: argparse.Namespace) -> int:
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir or "/tmp") as tmp:
        result = export_bench.bench(Path(tmp), args.hidden, args.heads, args.layers, args.vocab, args.shards,
                                    args.convert, args.rounds, log=log)
    print(result.as_json() if args.json else result.report())
    return 0


# ------------------------------------------------------------------------------------- export-checkpoint

EXPORT_CHECKPOINT = """Streaming benchmark of `export_checkpoint.py` on a generated multi-GB fused model.

Side by side, each in a fresh child process (peak RSS from /proc VmHWM): a plain copy of the fused graph's
data file, and tools/export_checkpoint.py writing it as a Nemotron-NAS checkpoint (bf16 kept) and, with
--gguf, as a GGUF file of each dtype asked for; alternating for --rounds rounds after one untimed copy
(`sync` before each step). Bounds (issues 36 and 47): at most 1.2x the copy's time, at most 256 MB peak RSS
(runtime/bench/export_checkpoint.py). Default: hidden 2048, 72 layers (every other one attention-free), vocab
32000, 8 fused pairs: about 3.8 GB bf16; needs about 4x that of free disk in --workdir (default /tmp; 6x with
--gguf f32); everything is deleted afterwards.

  python tools/bench.py export-checkpoint [--workdir DIR] [--rounds 2] [--json]
  python tools/bench.py export-checkpoint --layers 92 --gguf f32,q8_0 [--no-checkpoint]
  python tools/bench.py export-checkpoint --hidden 256 --layers 4 --vocab 1000 --groups 2    # a quick run
"""


def add_export_checkpoint(subs: Subcommands) -> None:
    p = subcommand(subs, "export-checkpoint", EXPORT_CHECKPOINT, run_export_checkpoint)
    add_checkpoint_shape(p)
    p.add_argument("--groups", type=int, default=8, help="fused pairs [2k, 2k + 1] (default 8)")
    p.add_argument("--gguf", nargs="?", const="f32,q8_0", default="", metavar="DTYPES",
                   help="also time export_checkpoint.py --gguf for these dtypes (default f32,q8_0)")
    p.add_argument("--no-checkpoint", action="store_true", help="time the GGUF writer only (with --gguf)")


def run_export_checkpoint(args: argparse.Namespace) -> int:
    gguf = [d for d in args.gguf.split(",") if d]
    if bad := [d for d in gguf if d not in ("f32", "f16", "bf16", "q8_0")]:
        raise UserError(f"--gguf {','.join(bad)}: choose among f32, f16, bf16, q8_0")
    if args.no_checkpoint and not gguf:
        raise UserError("--no-checkpoint leaves nothing to time without --gguf")
    if not 0 <= 2 * args.groups <= args.layers:
        raise UserError(f"--groups {args.groups}: between 0 and layers / 2 ({args.layers // 2})")
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir or "/tmp") as tmp:
        result = checkpoint_bench.bench(
            Path(tmp), args.hidden, args.heads, args.layers, args.vocab, args.shards, args.groups,
            args.rounds, log=log, gguf=gguf, checkpoint_step=not args.no_checkpoint)
    print(result.as_json() if args.json else result.table())
    return 0


# ---------------------------------------------------------------------------------------------- sharders

SHARDERS = """Side by side: passes.shard (tools/shard_tp.py) and Polygraphy's `polygraphy multi-device shard`.

Both sharders run on the same models, each in its own process (wall time and that process's peak RSS
are measured), and every set of rank graphs is then run on CPU by runtime.tp.ort.run_simulated and compared
with the single-device model (max |tp - ref| / max |ref|; <= 1e-5 counts as correct). Polygraphy is fed
a hints file made by `polygraphy template shard-hints --parallelism TP --nb-rank N`.

Examples:
  python tools/bench.py sharders                         # small models, tp 2 4 8, plus a ~0.6 GB model
  python tools/bench.py sharders --big-hidden 0          # small models only
  python tools/bench.py sharders --work /tmp/cmp --json results.json

Models (exported by exporters.onnx_export, fused by passes.pipeline, FP8 by passes.quant.fp8):
  m49        Super-49B pattern, 8 heads / 1 KV head, hidden 64, 9 blocks (4 attention), FFN widths
             60/100/44 that 8 does not divide
  m49-fused  the same with groups [1,3] and [5,7] fused (one FFN of 384 and one of 212)
  m49-fp8    m49-fused with FP8 Q/DQ (per-channel weights, per-tensor activations)
  gqa        12 heads / 2 KV heads, hidden 96, untied lm_head
  big-fused  Super-49B pattern at hidden 1024 (8 heads / 2 KV heads, vocab 32000), 13 blocks with two
             groups fused, external data
"""


def add_sharders(subs: Subcommands) -> None:
    p = subcommand(subs, "sharders", SHARDERS, run_sharders)
    p.add_argument("--work", type=Path, default=None,
                   help="folder for models and outputs (default: a temp dir)")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--big-hidden", type=int, default=1024, help="hidden size of big-fused (0: skip it)")
    p.add_argument("--big-tp", type=int, nargs="+", default=[8], help="tp values for big-fused")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")


def run_sharders(args: argparse.Namespace) -> int:
    work = args.work or Path(tempfile.mkdtemp(prefix="compare_sharders_"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work folder: {work}")
    rows = run_comparison(work, args.tp, args.big_hidden, args.big_tp)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------- latency

LATENCY = """Predicted decode tokens/s before and after FFN Fusion (the analytical model, no GPU).

  python tools/bench.py latency [--gpu h100|h200] [--batch 1] [--context 1024] [--json]
"""


def add_latency(subs: Subcommands) -> None:
    p = subcommand(subs, "latency", LATENCY, run_latency)
    p.add_argument("--gpu", choices=("h100", "h200"), default="h100", help="8x this GPU (default h100)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--context", type=int, default=1024, help="tokens in the KV cache (default 1024)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run_latency(args: argparse.Namespace) -> int:
    rep = paper_report(args.gpu, batch=args.batch, context=args.context, tp=args.tp)
    print(json.dumps(rep, indent=2) if args.json else format_paper_report(rep))
    return 0


# ------------------------------------------------------------------------------------------------------

SUBCOMMANDS = (add_decode, add_serve, add_fuse, add_export, add_export_checkpoint, add_sharders, add_latency)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for add in SUBCOMMANDS:
        add(subs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    run_cli(main)
