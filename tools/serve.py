"""Serve a decode graph, TensorRT engine or TP folder over the OpenAI HTTP API (continuous batching).

    python tools/serve.py MODEL [--host 127.0.0.1] [--port 8000] [--backend ort|tensorrt|tp] [--max-batch N]

MODEL: an ONNX file, a folder with model.onnx + tokenizer.json (+ config.json, generation_config.json)
as Optimum, ONNX Runtime GenAI or tools/export_model.py leave it, an engines folder from
tools/build_engines.py, or a sharded folder from tools/shard_tp.py (one process per rank, gloo all-reduces;
--tp-comm nccl on GPUs). Routes: /v1/models,
/v1/completions, /v1/chat/completions, /health, /metrics. See docs/serving.md.

SIGTERM drains (no new requests; running ones finish within --drain-timeout, the rest end with an error)
and exits 0. A fault the server cannot contain (a TP rank that died or hung) exits 1 with --on-fatal exit
(the default: let a supervisor restart it), or keeps answering 503 with --on-fatal serve.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.serve.loading import BACKENDS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="ONNX file, engine file, or model / engines / TP folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="default: from what MODEL is")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 503 (default 64)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: MODEL's name)")
    p.add_argument(
        "--max-context", type=int, default=None, help="prompt + generated tokens (default: config)"
    )
    p.add_argument("--device", default="cpu", help="ONNX Runtime device: cpu, cuda or auto")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (per TP rank)")
    p.add_argument(
        "--tp-comm", choices=("gloo", "nccl"), default="gloo", help="TP collectives: gloo (CPU), nccl (GPUs)"
    )
    p.add_argument(
        "--rank-timeout", type=float, default=120.0, help="seconds before a silent TP rank counts as hung"
    )
    p.add_argument(
        "--rank-heartbeat",
        type=float,
        default=5.0,
        help="seconds without a TP rank's heartbeat before it counts as hung (default 5)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 before they are parsed (default 4 MiB)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=64,
        help="tokens per scheduler step: each running sequence's next token, then prompt tokens; a longer "
        "prompt is prefilled in chunks between decode steps (default 64, for CPUs; larger on GPUs)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        help="a chat request's token limit when it sends none, capped by the context (default 512)",
    )
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=10.0,
        help="seconds for a request's headers, then for its body, else 408 and close (default 10)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open connections; a request beyond them is answered 503 (default 512)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="seconds running requests may take to finish after SIGTERM (default 20)",
    )
    p.add_argument(
        "--on-fatal",
        choices=("exit", "serve"),
        default="exit",
        help="after a fault the server cannot contain: exit 1 (default) or keep answering 503",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    at_least_one = ("max_batch", "max_queue", "port", "rank_timeout", "rank_heartbeat", "max_request_bytes")
    for flag in (*at_least_one, "default_max_tokens", "max_connections", "prefill_chunk"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("request_read_timeout", "keep_alive_timeout"):
        if not 0 < getattr(args, flag) < float("inf"):  # NaN fails too
            raise UserError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    if not args.drain_timeout >= 0:
        raise UserError("--drain-timeout must be at least 0")
    from runtime.serve.server import serve  # noqa: PLC0415 (the web stack loads after the arguments are checked)

    return serve(
        args.model,
        host=args.host,
        port=args.port,
        backend=args.backend,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        name=args.model_name,
        max_context=args.max_context,
        device=args.device,
        threads=args.threads,
        tp_comm=args.tp_comm,
        rank_timeout_s=args.rank_timeout,
        rank_heartbeat_s=args.rank_heartbeat,
        log_level=args.log_level,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        on_fatal=args.on_fatal,
        default_max_tokens=args.default_max_tokens,
        request_read_timeout=args.request_read_timeout,
        keep_alive_s=args.keep_alive_timeout,
        max_connections=args.max_connections,
        prefill_chunk=args.prefill_chunk,
    )


if __name__ == "__main__":
    run_cli(main)
