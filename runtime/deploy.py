"""FP8-quantize, shard and build TensorRT engines for ONNX files: what tools/build_engines.py runs.

`build_engines(request)` takes one model (optionally sharded into `tp` rank graphs after quantization:
calibration needs the whole model) or several per-rank files / a sharded folder, and writes into
`request.out`: `<name>_fp8.onnx` (+ data) and `<name>_fp8_scales.json` when FP8, then `<name>.engine`
with its JSON sidecar for each graph (exporters.tensorrt.build).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from exporters.tensorrt import shim as trt_shim
from exporters.tensorrt.build import EngineBuild, Profile, build_engine, parse_onnx
from exporters.tensorrt.check import check_engine
from passes.errors import UserError
from passes.graph_inputs import Signature
from passes.io.model_io import load_model, save_model
from passes.model_map import find_blocks, vocab_size
from passes.quant.calibrate import ActivationScales, calibrate, tokens_sha256
from passes.quant.fp8 import quantize_fp8
from passes.shard import rank_onnx_files, shard_model
from runtime import text_sets as text


@dataclass
class Calibration:
    """Where FP8 activation scales come from: text files or one ids .npy, or saved scales."""

    files: list[Path] = field(default_factory=list)  # empty: runtime.text_sets.CALIBRATION_FILES
    tokens: int = 4096
    seq: int = 128
    tokenizer: str = "auto"  # see runtime.text_sets.TOKENIZERS
    percentile: float | None = None
    scales: Path | None = None  # reused when the file exists, else written


@dataclass
class EngineRequest:
    models: list[Path]
    out: Path
    profile: Profile
    fp8: bool = False
    calibration: Calibration = field(default_factory=Calibration)
    quantize_lm_head: bool = False
    workspace_mb: int = 2048
    compute_capability: str | None = None
    timing_cache: Path | None = None
    tp: int = 1
    check: bool = False
    check_atol: float = 0.5
    check_rtol: float = 0.1


def step(message: str) -> None:
    print(f"[build_engines] {message}", file=sys.stderr, flush=True)


def build_engines(request: EngineRequest, log: Callable[[str], None] = step) -> list[EngineBuild]:
    if request.check:
        trt_shim.require_gpu_runtime()  # fail before the long steps
    trt = trt_shim.load()
    log(f"TensorRT {trt.version} ({trt.flavor})")
    models = resolve_models(request.models, request.tp)  # before --out is made: a refusal writes nothing
    request.out.mkdir(parents=True, exist_ok=True)
    shard_later = request.tp > 1 and len(models) == 1
    if request.fp8:
        check_fp8_source(trt, models[0], log)  # before the long steps: nothing written on refusal
        scales = activation_scales(request.calibration, models[0], len(models) == 1, log)
        scales.save(request.out / f"{artifact_stem(models[0])}_fp8_scales.json")
        models = [quantize_file(p, scales, request.out, request.quantize_lm_head, log) for p in models]
    if shard_later:  # quantize first (calibration needs the whole model), then shard the FP8 graph
        log(f"sharding {models[0].name} over {request.tp} ranks into {request.out / 'ranks'}")
        models = [Path(p) for p in shard_model(models[0], request.tp, request.out / "ranks")]
    return [build_one(request, model, log) for model in models]


def build_one(request: EngineRequest, model: Path, log: Callable[[str], None]) -> EngineBuild:
    profile = request.profile
    engine = request.out / f"{artifact_stem(model)}.engine"
    log(f"building {engine.name} from {model.name} (profile {profile.min}/{profile.opt}/{profile.max})")
    start = time.perf_counter()
    built = build_engine(
        model,
        engine,
        profile=profile,
        workspace_mb=request.workspace_mb,
        timing_cache=request.timing_cache or (request.out / "timing.cache"),
        compute_capability=request.compute_capability,
        progress=True,
    )
    log(
        f"wrote {engine} ({built.plan_bytes >> 10} KiB, {built.sidecar['compute_capability']}, "
        f"{time.perf_counter() - start:.1f} s) and {built.sidecar_path.name}"
    )
    if request.check:
        check(request, engine, model, log)
    return built


def check(request: EngineRequest, engine: Path, model: Path, log: Callable[[str], None]) -> None:
    profile = request.profile
    result = check_engine(
        engine,
        model,
        [profile.min, profile.opt, profile.max],
        vocab=model_vocab(model),
        atol=request.check_atol,
        rtol=request.check_rtol,
    )
    for o in result.outputs:
        log(
            f"check {o.name}: rel err {o.rel_error:.4g}, min cosine {o.min_cosine:.6f}, "
            f"max abs {o.max_abs_error:.4g} -> {'ok' if o.passed else 'FAILED'}"
        )
    if not result.passed:
        raise UserError(
            f"{engine.name} differs from ONNX Runtime beyond atol={request.check_atol}, "
            f"rtol={request.check_rtol}"
        )


def check_fp8_source(trt: trt_shim.Trt, model: Path, log: Callable[[str], None]) -> None:
    """Refuse what FP8 cannot quantize or TensorRT cannot parse before calibrating: int4 MatMulNBits
    weights (GenAI int4 exports), and ops TensorRT has no importer for (e.g. GroupQueryAttention)."""

    ops = {node.op_type for node in onnx.load(str(model), load_external_data=False).graph.node}
    if "MatMulNBits" in ops:
        raise UserError(
            f"{model} holds int4 MatMulNBits weights: FP8 quantizes float weights only; "
            "build from an fp32/fp16 export of the model (e.g. the GenAI builder's -p fp32)"
        )
    log(f"checking that TensorRT parses {model.name}")
    logger = trt.logger(False)
    try:
        parse_onnx(trt, trt.module.Builder(logger.handle), model, logger)
    except UserError as exc:  # TensorRT's messages span lines: one line for the user
        raise UserError(" ".join(str(exc).split())) from None


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


def model_vocab(model_path: Path) -> int:
    """The vocabulary: rows of the token embedding, else the last dim of the first output (rank graphs)."""

    model = load_model(model_path)
    try:
        return vocab_size(find_blocks(model))
    except UserError:
        pass
    shape = model.graph.outputs[0].shape
    if shape is not None and len(shape) and isinstance(shape[-1], int):
        return int(shape[-1])
    raise UserError(f"cannot tell the vocabulary size of {model_path}; pass --calib ids.npy")


# -------------------------------------------------------------------------------------- calibration


def calibration_batches(
    calib: Calibration, model_path: Path, log: Callable[[str], None] = step, rows_per_batch: int = 4
) -> list[np.ndarray | dict[str, np.ndarray]]:
    """The calibration windows (runtime.text_sets: the default text of analysis and healing, or --calib),
    in batches of `rows_per_batch` rows with feeds for the graph's other inputs."""
    ids, source = text.calibration_windows(
        model_vocab(model_path), calib.files, calib.tokens, calib.seq, calib.tokenizer, keep_rows=True
    )
    log(f"calibration tokens: {source}, {ids.shape[0]} x {ids.shape[1]}")
    batches = [ids[i : i + rows_per_batch] for i in range(0, len(ids), rows_per_batch)]
    return with_side_inputs(batches, model_path)


def with_side_inputs(batches: list[np.ndarray], model_path: Path) -> list[np.ndarray | dict[str, np.ndarray]]:
    """Id batches as they are for a graph that takes only ids; else a feed for every input from
    passes/graph_inputs.py (an all-ones mask, positions, empty KV caches: Optimum and GenAI graphs)."""
    signature = Signature.of(model_path)
    if len(signature.inputs) == 1:
        return batches
    ids = signature.ids.name
    return [{ids: batch, **signature.feeds(batch)} for batch in batches]  # the ids first (token counts)


def _tokens(batch: np.ndarray | dict[str, np.ndarray]) -> int:
    return int(next(iter(batch.values())).size if isinstance(batch, dict) else batch.size)


def activation_scales(
    calib: Calibration, model_path: Path, can_calibrate: bool, log: Callable[[str], None] = step
) -> ActivationScales:
    """Saved scales when `calib.scales` exists (checked against the other settings), else calibrated."""
    if calib.scales is not None and calib.scales.is_file():
        scales = ActivationScales.load(calib.scales)
        log(
            f"using saved scales {calib.scales} (percentile={scales.percentile}, "
            f"tokens sha256 {scales.tokens_sha256[:12]}..., {len(scales.scales)} tensors)"
        )
        if calib.percentile is not None and calib.percentile != scales.percentile:
            raise UserError(
                f"{calib.scales} was calibrated with percentile={scales.percentile}, not "
                f"{calib.percentile}; delete it to recalibrate or drop --percentile"
            )
        if calib.files and tokens_sha256(calibration_batches(calib, model_path, log)) != scales.tokens_sha256:
            raise UserError(
                f"{calib.scales} was calibrated on other tokens than --calib gives; "
                "delete it to recalibrate or drop --calib"
            )
        return scales
    if not can_calibrate:
        raise UserError(
            "FP8 on per-rank graphs needs --scales from the unsharded model "
            "(ONNX Runtime cannot run DistCollective); calibrate the full model first"
        )
    batches = calibration_batches(calib, model_path, log)
    tokens = sum(_tokens(b) for b in batches)
    log(f"calibrating {model_path.name} on {tokens} tokens (percentile={calib.percentile})")
    scales = calibrate(model_path, batches, percentile=calib.percentile)
    if calib.scales is not None:
        calib.scales.parent.mkdir(parents=True, exist_ok=True)
        scales.save(calib.scales)
    return scales


def quantize_file(
    model_path: Path, scales: ActivationScales, out: Path, quantize_lm_head: bool, log: Callable[[str], None]
) -> Path:
    model = load_model(model_path)
    report = quantize_fp8(model, scales, quantize_lm_head=quantize_lm_head)
    target = out / f"{artifact_stem(model_path)}_fp8.onnx"
    log(
        f"quantized {len(report.quantized)} linear layers ({report.weights} weights, "
        f"{report.activations} activations, widest {report.max_width}; "
        f"weights {report.source_weight_bytes >> 10} KiB -> {report.fp8_weight_bytes >> 10} KiB; "
        f"opset {report.opset[0]} -> {report.opset[1]}); skipped: {', '.join(report.skipped) or 'none'}"
    )
    log(f"writing {target}")
    save_model(model, target, external=True)
    return target
