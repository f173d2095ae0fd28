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
import sys
import time
from pathlib import Path

import numpy as np

from passes.errors import UserError, run_cli
from passes.shard import rank_onnx_files

DEFAULT_CALIB_DIR = Path("/usr/share/common-licenses")
SMOLLM2_VOCAB = 49152

CALIB_HELP = """\
calibration (--fp8):
  --calib takes text files or one .npy of int64 token ids [batch, seq]. Text is tokenized with
  --tokenizer: 'smollm2' uses exporters.smollm2.load_tokenizer() (the SmolLM2 GGUF tokenizer); 'bytes'
  is a fallback that maps each UTF-8 byte to a token id, clipped to the model's vocabulary (fine for
  test models, crude for real ones); 'auto' (default) takes smollm2 when the model's vocabulary is
  SmolLM2's (49152) and the package is installed, else bytes. Without --calib the English prose in
  /usr/share/common-licenses is used. --scales FILE reuses saved scales (no calibration) when FILE
  exists, and saves them there when it does not.

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
    parser.add_argument("--tokenizer", choices=("auto", "smollm2", "bytes"), default="auto")
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


def step(message: str) -> None:
    print(f"[build_engines] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- inputs


def resolve_models(paths: list[Path], tp: int) -> list[Path]:
    """The ONNX files to build: the given files, or a sharded folder's rank graphs (rank 0 first)."""
    if len(paths) == 1 and paths[0].is_dir():
        paths = rank_files(paths[0])
    for path in paths:
        if not path.is_file():
            raise UserError(f"ONNX file not found: {path}")
    if tp > 1 and len(paths) not in (1, tp):
        raise UserError(f"--tp {tp} but {len(paths)} ONNX files were given")
    return paths


def rank_files(folder: Path) -> list[Path]:
    """tools/shard_tp.py's folder (tp.json + rank{r}/model.onnx), else the folder's rank*.onnx."""
    if (folder / "tp.json").is_file():
        return rank_onnx_files(folder)
    ranks = sorted(folder.glob("rank*.onnx"), key=lambda p: (len(p.stem), p.stem))
    if not ranks:
        raise UserError(f"{folder} holds neither tp.json (tools/shard_tp.py) nor rank*.onnx files")
    return ranks


def artifact_stem(path: Path) -> str:
    """Output name for a model: rank{r}/model.onnx -> 'rank{r}', otherwise the file's stem."""
    if path.stem == "model" and path.parent.name.startswith("rank"):
        return path.parent.name
    return path.stem


def shard_hook(model: Path, tp: int, out: Path) -> list[Path]:
    """Split one (already quantized) model into per-rank graphs with passes.shard (FP8 Q/DQ shards too)."""
    from passes.shard import shard_model

    step(f"sharding {model.name} over {tp} ranks into {out / 'ranks'}")
    return [Path(p) for p in shard_model(model, tp, out / "ranks")]


def vocab_size(model_path: Path) -> int:
    """Rows of the embedding Gather fed by a graph input, else the last dim of the first output."""
    from passes.model_io import load_model

    model = load_model(model_path)
    inputs = set(model.graph.inputs)
    for node in model.graph:
        if node.op_type == "Gather" and len(node.inputs) == 2 and node.inputs[1] in inputs:
            data = node.inputs[0]
            if data is not None and data.const_value is not None:
                return int(data.const_value.shape[0])
    shape = model.graph.outputs[0].shape
    if shape is not None and len(shape) and isinstance(shape[-1], int):
        return int(shape[-1])
    raise UserError(f"cannot tell the vocabulary size of {model_path}; pass --calib ids.npy")


def _tokenize(texts: list[str], tokenizer: str, vocab: int) -> np.ndarray:
    if tokenizer == "auto":
        tokenizer = "smollm2" if vocab == SMOLLM2_VOCAB and _smollm2_available() else "bytes"
    if tokenizer == "smollm2":
        from exporters.smollm2 import load_tokenizer

        step("tokenizing calibration text with the SmolLM2 tokenizer")
        tok = load_tokenizer()
        ids = np.concatenate([np.asarray(tok(t)["input_ids"], dtype=np.int64) for t in texts])
        return np.minimum(ids, vocab - 1)
    step(f"tokenizing calibration text byte by byte (ids clipped to the vocabulary of {vocab})")
    raw = np.frombuffer("\n".join(texts).encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return np.minimum(raw, vocab - 1)


def _smollm2_available() -> bool:
    try:
        from exporters.smollm2 import gguf_folder

        gguf_folder()
    except (ImportError, UserError):
        return False
    return True


def calibration_batches(
    args: argparse.Namespace,
    model_path: Path,
    rows_per_batch: int = 4,
) -> list[np.ndarray]:
    files = args.calib or sorted(p for p in DEFAULT_CALIB_DIR.glob("*") if p.is_file())
    if not files:
        raise UserError(f"no calibration text: {DEFAULT_CALIB_DIR} is empty; pass --calib FILES")
    if len(files) == 1 and files[0].suffix == ".npy":
        ids = np.load(files[0])
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise UserError(
                f"{files[0]}: expected int64 token ids shaped [batch, seq], got {ids.dtype} {list(ids.shape)}"
            )
        ids = ids.astype(np.int64)
    else:
        texts = []
        for file in files:
            try:
                texts.append(file.read_text(errors="replace"))
            except OSError as exc:
                raise UserError(f"cannot read calibration file {file}: {exc.strerror}") from None
        stream = _tokenize(texts, args.tokenizer, vocab_size(model_path))
        rows = min(len(stream) // args.calib_seq, max(1, args.calib_tokens // args.calib_seq))
        if rows == 0:
            raise UserError(
                f"calibration text gives {len(stream)} tokens, fewer than --calib-seq {args.calib_seq}"
            )
        ids = stream[: rows * args.calib_seq].reshape(rows, args.calib_seq)
    return [ids[i : i + rows_per_batch] for i in range(0, len(ids), rows_per_batch)]


def profile_from_args(args: argparse.Namespace):
    from exporters.tensorrt_engine import Profile

    lo = args.min_shape or (args.batch[0], args.seq[0])
    mid = args.opt_shape or (args.batch[1], args.seq[1])
    hi = args.max_shape or (args.batch[2], args.seq[2])
    return Profile(min=tuple(lo), opt=tuple(mid), max=tuple(hi))


# ------------------------------------------------------------------------------------------- steps


def activation_scales(args: argparse.Namespace, model_path: Path, can_calibrate: bool):
    from passes.fp8 import ActivationScales, calibrate, tokens_sha256

    if args.scales is not None and args.scales.is_file():
        scales = ActivationScales.load(args.scales)
        step(
            f"using saved scales {args.scales} (percentile={scales.percentile}, "
            f"tokens sha256 {scales.tokens_sha256[:12]}..., {len(scales.scales)} tensors)"
        )
        if args.percentile is not None and args.percentile != scales.percentile:
            raise UserError(
                f"{args.scales} was calibrated with percentile={scales.percentile}, not "
                f"{args.percentile}; delete it to recalibrate or drop --percentile"
            )
        if args.calib:
            batches = calibration_batches(args, model_path)
            if tokens_sha256(batches) != scales.tokens_sha256:
                raise UserError(
                    f"{args.scales} was calibrated on other tokens than --calib gives; "
                    "delete it to recalibrate or drop --calib"
                )
        return scales
    if not can_calibrate:
        raise UserError(
            "FP8 on per-rank graphs needs --scales from the unsharded model "
            "(ONNX Runtime cannot run DistCollective); calibrate the full model first"
        )
    batches = calibration_batches(args, model_path)
    tokens = sum(b.size for b in batches)
    step(f"calibrating {model_path.name} on {tokens} tokens (percentile={args.percentile})")
    scales = calibrate(model_path, batches, percentile=args.percentile)
    if args.scales is not None:
        args.scales.parent.mkdir(parents=True, exist_ok=True)
        scales.save(args.scales)
    return scales


def quantize_file(model_path: Path, scales, out: Path, quantize_lm_head: bool) -> Path:
    from passes.fp8 import quantize_fp8
    from passes.model_io import load_model, save_model

    model = load_model(model_path)
    report = quantize_fp8(model, scales, quantize_lm_head=quantize_lm_head)
    target = out / f"{artifact_stem(model_path)}_fp8.onnx"
    step(
        f"quantized {len(report.quantized)} linear layers ({report.weights} weights, "
        f"{report.activations} activations, widest {report.max_width}; "
        f"weights {report.source_weight_bytes >> 10} KiB -> {report.fp8_weight_bytes >> 10} KiB; "
        f"opset {report.opset[0]} -> {report.opset[1]}); skipped: {', '.join(report.skipped) or 'none'}"
    )
    step(f"writing {target}")
    save_model(model, target, external=True)
    return target


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from exporters import tensorrt_engine, trt_shim

    if args.check:
        trt_shim.require_gpu_runtime()  # fail before the long steps
    trt = trt_shim.load()
    step(f"TensorRT {trt.version} ({trt.flavor})")
    profile = profile_from_args(args)
    args.out.mkdir(parents=True, exist_ok=True)
    inputs = resolve_models(list(args.onnx), args.tp)
    shard_later = args.tp > 1 and len(inputs) == 1
    if args.fp8:
        scales = activation_scales(args, inputs[0], can_calibrate=len(inputs) == 1)
        scales.save(args.out / f"{artifact_stem(inputs[0])}_fp8_scales.json")
        inputs = [quantize_file(p, scales, args.out, args.quantize_lm_head) for p in inputs]
    if shard_later:  # quantize first (calibration needs the whole model), then shard the FP8 graph
        inputs = shard_hook(inputs[0], args.tp, args.out)
    cache = args.timing_cache or (args.out / "timing.cache")
    for model_path in inputs:
        engine = args.out / f"{artifact_stem(model_path)}.engine"
        step(
            f"building {engine.name} from {model_path.name} "
            f"(profile {profile.min}/{profile.opt}/{profile.max})"
        )
        start = time.perf_counter()
        built = tensorrt_engine.build_engine(
            model_path,
            engine,
            profile=profile,
            workspace_mb=args.workspace_mb,
            timing_cache=cache,
            compute_capability=args.compute_capability,
            progress=True,
        )
        step(
            f"wrote {engine} ({built.plan_bytes >> 10} KiB, {built.sidecar['compute_capability']}, "
            f"{time.perf_counter() - start:.1f} s) and {built.sidecar_path.name}"
        )
        if args.check:
            shapes = [profile.min, profile.opt, profile.max]
            result = tensorrt_engine.check_engine(
                engine,
                model_path,
                shapes,
                vocab=vocab_size(model_path),
                atol=args.check_atol,
                rtol=args.check_rtol,
            )
            for o in result.outputs:
                step(
                    f"check {o.name}: rel err {o.rel_error:.4g}, min cosine {o.min_cosine:.6f}, "
                    f"max abs {o.max_abs_error:.4g} -> {'ok' if o.passed else 'FAILED'}"
                )
            if not result.passed:
                raise UserError(
                    f"{engine.name} differs from ONNX Runtime beyond atol={args.check_atol}, "
                    f"rtol={args.check_rtol}"
                )
    return 0


if __name__ == "__main__":
    run_cli(main)
