"""Greedy text generation from a decode graph with a KV cache (exporters/decode.py), SmolLM2 tokenizer.

    python tools/generate.py model_decode.onnx --prompt "What is FFN Fusion?" --max-new-tokens 32

The model may be an ONNX file (ONNX Runtime; --device cuda with onnxruntime-gpu), a TensorRT engine
(*.engine, GPU machines), or a folder of tensor-parallel rank graphs (passes.shard): all ranks in this
process (--tp-mode threads), or one rank per process under torchrun (--tp-mode gloo, rank 0 prints).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

from passes.errors import UserError, run_cli
from runtime.generate import DecodeModel, generate_text
from runtime.tp.gloo import torchrun_group


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="decode graph (.onnx), TensorRT engine, or sharded folder")
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat for a (left-padded) batch"
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--raw", action="store_true", help="no chat template around the prompt")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (ONNX Runtime provider)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    p.add_argument("--tp-mode", choices=("threads", "gloo"), default="threads")
    p.add_argument("--stats", action="store_true", help="print timing statistics as JSON to stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model.exists():
        raise UserError(f"model {args.model} does not exist")
    gloo = args.tp_mode == "gloo" and args.model.is_dir()
    hint = "torchrun --nproc-per-node N tools/generate.py ... --tp-mode gloo"
    group = torchrun_group(hint) if gloo else nullcontext((0, 1))
    with group as (rank, world):
        model = DecodeModel.open(
            args.model, device=args.device, threads=args.threads, tp_mode=args.tp_mode, rank=rank, world=world
        )
        prompts = args.prompt[0] if len(args.prompt) == 1 else args.prompt
        text, stats = generate_text(args.model, prompts, args.max_new_tokens, chat=not args.raw, model=model)
        if rank == 0:
            for item in [text] if isinstance(text, str) else text:
                print(item)
            if args.stats:
                print(json.dumps(stats.to_dict()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
