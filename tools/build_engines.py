"""Quantize an ONNX model to FP8 (explicit Q/DQ) and build TensorRT engines, one per ONNX file.

Examples:
  python tools/build_engines.py model.onnx --fp8 --out engines/
  python tools/build_engines.py model.onnx --fp8 --calib notes.txt more.txt --percentile 99.99 --out engines/
  python tools/build_engines.py model.onnx --fp8 --scales scales.json --batch 1,1,8 --seq 1,256,2048 --out e/
  python tools/build_engines.py rank0.onnx rank1.onnx --fp8 --scales full_model_scales.json --out e/

Writes into DIR: <name>_fp8.onnx (+ .data) beside the engine, <name>_fp8_scales.json, <name>.engine and
<name>.engine.json (the sidecar: TensorRT flavor/version, compute capability, profile, I/O, ONNX sha256).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from exporters.tensorrt.build import Profile
from passes.errors import run_cli
from runtime.deploy import Calibration, EngineRequest, build_engines
from runtime.text_sets import TOKENIZERS

CALIB_HELP = """\
calibration (--fp8):
  --calib takes text files or one .npy of int64 token ids [batch, seq]. Text is tokenized with
  --tokenizer: 'smollm2' uses the SmolLM2 GGUF tokenizer (exporters/smollm2_tokenizer.py); 'bytes'
  is a fallback that maps each UTF-8 byte to a token id, clipped to the model's vocabulary (fine for
  test models, crude for real ones); 'auto' (default) takes smollm2 when the model's vocabulary is
  SmolLM2's (49152) and the package is installed, else bytes. Without --calib the default calibration
  text of analysis and healing is used (license prose in /usr/share/common-licenses and Python
  standard-library code: runtime/text_sets.py CALIBRATION_FILES), files sampled in turn.
  --scales FILE reuses saved scales (no calibration) when FILE exists, and saves them there when it
  does not.

tensor parallelism:
  --tp N on one model quantizes it (calibrating the whole model), shards the FP8 graph with
  passes.shard (DIR/ranks/rank{r}/model.onnx) and builds DIR/rank{r}.engine for each rank. Several
  ONNX files, or a folder written by tools/shard_tp.py (tp.json) or holding rank*.onnx, build one engine
  each; with --fp8 they need --scales from the unsharded model (rank graphs with DistCollective do
  not run in ONNX Runtime, and the sharding pass keeps activation names)."""


def _triple(text: str) -> tuple[int, int, int]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected min,opt,max (three integers), got {text!r}")
    return values  # type: ignore[return-value]


def _shape(text: str) -> tuple[int, int]:
    try:
        batch, seq = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQ like 1x128, got {text!r}") from None
    return batch, seq


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="build_engines.py",
        description=__doc__,
        epilog=CALIB_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "onnx", nargs="+", type=Path, help="model.onnx, per-rank ONNX files, or a folder of rank*.onnx"
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    parser.add_argument("--fp8", action="store_true", help="insert FP8 Q/DQ (calibrated) before building")
    parser.add_argument("--calib", nargs="+", type=Path, metavar="FILE", help="text files or one ids .npy")
    parser.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    parser.add_argument("--calib-seq", type=int, default=128, help="tokens per calibration row (default 128)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="auto")
    parser.add_argument(
        "--percentile",
        type=float,
        help="activation amax at this percentile of |x| (e.g. 99.99; default: the max)",
    )
    parser.add_argument("--scales", type=Path, help="scales JSON: reused if it exists, else written")
    parser.add_argument("--quantize-lm-head", action="store_true", help="also quantize the lm_head")
    parser.add_argument("--batch", type=_triple, default=(1, 1, 4), help="min,opt,max batch (default 1,1,4)")
    parser.add_argument("--seq", type=_triple, default=(1, 128, 512), help="min,opt,max sequence (1,128,512)")
    parser.add_argument("--min-shape", type=_shape, help="BATCHxSEQ (overrides --batch/--seq minimum)")
    parser.add_argument("--opt-shape", type=_shape, help="BATCHxSEQ (overrides --batch/--seq optimum)")
    parser.add_argument("--max-shape", type=_shape, help="BATCHxSEQ (overrides --batch/--seq maximum)")
    parser.add_argument("--workspace-mb", type=int, default=2048, help="builder workspace limit (MiB)")
    parser.add_argument(
        "--compute-capability",
        metavar="SM",
        help="target GPU, e.g. sm89 (default: sm89 with TensorRT-RTX; "
        "datacenter TensorRT builds for its own GPU)",
    )
    parser.add_argument("--timing-cache", type=Path, help="timing cache file (default DIR/timing.cache)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one engine per rank)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare each engine with ONNX Runtime via Polygraphy (needs datacenter TensorRT and a GPU)",
    )
    parser.add_argument("--check-atol", type=float, default=0.5)
    parser.add_argument("--check-rtol", type=float, default=0.1)
    return parser


def profile_from_args(args: argparse.Namespace) -> Profile:
    lo = args.min_shape or (args.batch[0], args.seq[0])
    mid = args.opt_shape or (args.batch[1], args.seq[1])
    hi = args.max_shape or (args.batch[2], args.seq[2])
    return Profile(min=tuple(lo), opt=tuple(mid), max=tuple(hi))


def request_from_args(args: argparse.Namespace) -> EngineRequest:
    calibration = Calibration(
        files=list(args.calib or []),
        tokens=args.calib_tokens,
        seq=args.calib_seq,
        tokenizer=args.tokenizer,
        percentile=args.percentile,
        scales=args.scales,
    )
    return EngineRequest(
        models=list(args.onnx),
        out=args.out,
        profile=profile_from_args(args),
        fp8=args.fp8,
        calibration=calibration,
        quantize_lm_head=args.quantize_lm_head,
        workspace_mb=args.workspace_mb,
        compute_capability=args.compute_capability,
        timing_cache=args.timing_cache,
        tp=args.tp,
        check=args.check,
        check_atol=args.check_atol,
        check_rtol=args.check_rtol,
    )


def main(argv: list[str] | None = None) -> int:
    build_engines(request_from_args(build_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    run_cli(main)
