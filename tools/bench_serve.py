"""Serving benchmark: TTFT, inter-token latency p50/p90/p99 and output tokens/s of one or two OpenAI-API
servers at several concurrencies, the servers measured alternately in one run (runtime/bench/serve.py).

    python tools/bench_serve.py http://127.0.0.1:8000 http://127.0.0.1:8001 \\
        --concurrency 1 2 4 8 --requests 32 [--labels original fused] [--max-tokens 32] \\
        [--prompt-words 48] [--rounds 2] --out bench_serve/

llama.cpp beside this project's server on the same model: --gguf starts llama-server on each GGUF file
(free port, one slot per client of the highest concurrency) and stops it at the end
(runtime/bench/llama_server.py; `make llama-cpp` builds llama-server):

    python tools/bench_serve.py http://127.0.0.1:8000 --labels onnx-f32 \\
        --gguf model-f32.gguf model-q8_0.gguf [--llama-server PATH] \\
        --concurrency 1 8 --requests 16 --max-tokens 128 --out bench_llama/

Writes DIR/bench_serve.json, DIR/bench_serve.md and DIR/bench_serve.png (and DIR/llama-server-N.log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.bench import llama_server
from runtime.bench import serve as bench
from runtime.bench.serve import Target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> list:
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
        "--requests": [args.requests],
        "--max-tokens": [args.max_tokens],
        "--rounds": [args.rounds],
        "--prompt-words": [args.prompt_words],
        "--concurrency": args.concurrency,
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = check(args)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with contextlib.ExitStack() as servers:
        if args.gguf:
            args.out.mkdir(parents=True, exist_ok=True)
            targets += llama_server.start_peers(
                servers, args.llama_server, args.gguf, max(args.concurrency), args.out,
                context_per_slot=args.llama_context, threads=args.llama_threads, log=log)
        data = bench.run(
            targets,
            sorted(set(args.concurrency)),
            args.requests,
            args.max_tokens,
            args.prompt_words,
            args.rounds,
            args.warmup,
            log=log,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_serve.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (args.out / "bench_serve.md").write_text(bench.markdown(data), encoding="utf-8")
    bench.plot(data, args.out / "bench_serve.png")
    print(bench.markdown(data))
    print(f"wrote {args.out}/bench_serve.json, .md, .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
