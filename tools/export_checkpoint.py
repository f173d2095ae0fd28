"""Write a fused or healed ONNX model as a Nemotron-NAS (DeciLM) Hugging Face checkpoint that vLLM and
TensorRT-LLM serve, or with --gguf as one GGUF file of llama.cpp's `deci` architecture that llama.cpp
(llama-cli, llama-server) and Ollama run (docs/deploy.md).

Examples:
  python tools/export_checkpoint.py fused/model.onnx --source Llama-3_3-Nemotron-Super-49B-v1 -o s49_fused
  python tools/export_checkpoint.py fused/model.onnx --source smollm2_hf --dtype bfloat16 -o smollm2_nas
  python tools/export_checkpoint.py fused/model.onnx --source CKPT --fp8 -o ckpt_fp8
  python tools/export_checkpoint.py fused/model.onnx --source CKPT --fp8 per-tensor --fp8-scales s.json -o out
  python tools/export_checkpoint.py fused/model.onnx --source smollm2_hf --gguf --dtype q8_0 -o fused.gguf

--dtype: for a checkpoint float32, float16 or bfloat16 (default: the source's); with --gguf f32, f16, bf16
or q8_0 (default f32; norms stay float32 either way).
"""

from __future__ import annotations

import argparse
import sys

from exporters.hf.config import DTYPES
from exporters.nas.export import FP8_MODES, export_checkpoint, export_gguf
from exporters.nas.safetensors_out import DEFAULT_SHARD_BYTES
from passes.errors import UserError, run_cli

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")  # exporters.nas.gguf_out.GGUF_DTYPES (that module loads numpy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="export_checkpoint.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("onnx", metavar="FUSED_ONNX",
                        help="a graph written by export_model.py --hf from --source, then fused/healed")
    parser.add_argument("--source", required=True, metavar="CKPT",
                        help="the Hugging Face folder the graph was exported from (Llama or DeciLM)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT",
                        help="the checkpoint folder to write (must not exist, or be empty); with --gguf the "
                             ".gguf file (must not exist)")
    parser.add_argument("--gguf", action="store_true",
                        help="write one GGUF file for llama.cpp / Ollama (architecture deci) instead of a "
                             "checkpoint folder")
    parser.add_argument("--dtype", default=None, metavar="DTYPE",
                        help=f"weight dtype: {', '.join(DTYPES)} (default: the source checkpoint's); with "
                             f"--gguf {', '.join(GGUF_DTYPES)} (default f32)")
    parser.add_argument("--fp8", nargs="?", const="per-channel", choices=FP8_MODES, default=None,
                        help="linear layers in FP8 as NVIDIA ModelOpt's HF export writes them: per-channel "
                             "(default; FP8_PER_CHANNEL_PER_TOKEN, the FP8 ONNX's weights to the bit) or "
                             "per-tensor (FP8, static activation scales from --fp8-scales)")
    parser.add_argument("--fp8-scales", metavar="SCALES_JSON", default=None,
                        help="with --fp8 per-tensor: this project's FP8 calibration file for this graph")
    parser.add_argument("--shard-gb", type=float, default=None,
                        help=f"largest safetensors shard in GB (default {DEFAULT_SHARD_BYTES / 1e9:g}, as "
                             "save_pretrained)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.gguf:
        return _gguf(args)
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UserError(f"--dtype {args.dtype}: choose one of {', '.join(DTYPES)} for a checkpoint "
                        f"(with --gguf: {', '.join(GGUF_DTYPES)})")
    if args.fp8_scales and args.fp8 != "per-tensor":
        raise UserError("--fp8-scales only applies to --fp8 per-tensor")
    if args.shard_gb is None:
        args.shard_gb = DEFAULT_SHARD_BYTES / 1e9
    if not args.shard_gb > 0:
        raise UserError(f"--shard-gb {args.shard_gb}: must be positive")
    result = export_checkpoint(
        args.onnx, args.source, args.output, dtype=args.dtype, fp8=args.fp8, fp8_scales=args.fp8_scales,
        max_shard_bytes=int(args.shard_gb * 1e9),
        log=lambda message: print(message, file=sys.stderr, flush=True))
    fused = [layers for layers in result.source_layers if len(layers) > 1]
    print(f"wrote {result.output} ({result.bytes / 2**20:.1f} MiB, {result.dtype}"
          f"{f', FP8 {result.fp8}' if result.fp8 else ''}, {result.seconds:.1f} s)")
    print(f"  layers: {result.layers} (source {sum(len(s) for s in result.source_layers)})")
    for layers in fused:
        index = result.source_layers.index(layers)
        mult = result.block_configs[index]["ffn"]["ffn_mult"]
        print(f"  layer {index}: source layers {layers[0]}-{layers[-1]} fused, ffn_mult {mult}")
    print(f"  files: {', '.join(f.name for f in result.files)}")
    return 0


def _gguf(args: argparse.Namespace) -> int:
    fp8 = "llama.cpp has no FP8 weights; --dtype q8_0 is the GGUF's 8-bit form"
    others = {"--fp8": (args.fp8, fp8), "--fp8-scales": (args.fp8_scales, fp8),
              "--shard-gb": (args.shard_gb, "the GGUF is one file")}
    for name, (given, why) in others.items():
        if given is not None:
            raise UserError(f"{name} does not apply to --gguf: {why}")
    dtype = args.dtype or "f32"
    if dtype not in GGUF_DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(GGUF_DTYPES)} with --gguf "
                        f"(for a checkpoint: {', '.join(DTYPES)})")
    result = export_gguf(args.onnx, args.source, args.output, dtype=dtype,
                         log=lambda message: print(message, file=sys.stderr, flush=True))
    print(f"wrote {result.output} ({result.bytes / 2**20:.1f} MiB, {result.dtype}, tokenizer {result.vocab}, "
          f"{result.seconds:.1f} s)")
    print(f"  layers: {result.layers} (source {result.source_layer_count})")
    for index, layers in enumerate(result.source_layers):
        if len(layers) > 1:
            print(f"  layer {index}: source layers {layers[0]}-{layers[-1]} fused")
    for index, note in result.notes.items():
        print(f"  layer {index} (source layer {result.source_layers[index][0]}): {note}")
    print(f"  run it: llama-cli -m {result.output}   |   llama-server -m {result.output} --port 8080")
    return 0


if __name__ == "__main__":
    run_cli(main)
