"""ONNX -> TensorRT engine (strongly typed: the Q/DQ in the graph decide the precision), with a JSON sidecar.

`build_engine` parses from file (so external data works), adds one optimization profile for the dynamic
batch and sequence of `input_ids` (other rank-2 dynamic inputs, e.g. attention_mask, get the same
shapes), limits the workspace, loads and saves a timing cache (datacenter TensorRT; TensorRT-RTX has
none), builds with detailed profiling verbosity, and writes `<engine>.json`: TensorRT flavor and
version, compute capability, profile, input and output names and dtypes, sha256 of the ONNX including
its external data. `check_engine` compares an engine with ONNX Runtime through Polygraphy's Comparator.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from exporters import trt_shim
from passes.errors import UserError

SIDECAR_FORMAT = "ffn-fusion-trt-engine/1"
DEFAULT_INPUT = "input_ids"


@dataclass(frozen=True)
class Profile:
    """min/opt/max shapes of one input (for input_ids: (batch, seq))."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.min) == len(self.opt) == len(self.max):
            raise UserError(f"profile shapes differ in rank: {self.min} {self.opt} {self.max}")
        for lo, mid, hi in zip(self.min, self.opt, self.max, strict=True):
            if not 1 <= lo <= mid <= hi:
                raise UserError(
                    f"profile needs 1 <= min <= opt <= max per dim, got {self.min}/{self.opt}/{self.max}"
                )

    @classmethod
    def batch_seq(cls, batch: Sequence[int], seq: Sequence[int]) -> Profile:
        if len(batch) != 3 or len(seq) != 3:
            raise UserError("batch and seq ranges take three numbers: min,opt,max")
        return cls(min=(batch[0], seq[0]), opt=(batch[1], seq[1]), max=(batch[2], seq[2]))


@dataclass
class EngineBuild:
    engine_path: Path
    sidecar_path: Path
    sidecar: dict[str, Any]
    build_seconds: float
    plan_bytes: int
    warnings: list[str] = field(default_factory=list)


def sidecar_path(engine_path: str | Path) -> Path:
    engine_path = Path(engine_path)
    return engine_path.with_name(engine_path.name + ".json")


def onnx_sha256(path: str | Path) -> str:
    """sha256 over the .onnx bytes and then each external data file it references (sorted, once each)."""
    path = Path(path)
    digest = hashlib.sha256()
    _hash_file(digest, path)
    model = onnx.load(str(path), load_external_data=False)
    locations = set()
    for tensor in _all_tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(e.value for e in tensor.external_data if e.key == "location")
    for location in sorted(locations):
        file = path.parent / location
        if not file.is_file():
            raise UserError(f"{path} references external data {location!r}, which is missing")
        digest.update(location.encode())
        _hash_file(digest, file)
    return digest.hexdigest()


def _hash_file(digest: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)


def _all_tensors(graph: onnx.GraphProto) -> Iterable[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            for sub in [attr.g, *attr.graphs] if attr.type in (5, 10) else []:
                yield from _all_tensors(sub)


def _format_parser_error(error: Any) -> str:
    where = []
    if error.node() >= 0:
        where.append(f"node {error.node()}")
    if error.node_name():
        where.append(error.node_name())
    if error.node_operator():
        where.append(f"({error.node_operator()})")
    prefix = " ".join(where)
    return f"{prefix}: {error.desc()}" if prefix else str(error.desc())


def parse_onnx(trt: trt_shim.Trt, builder: Any, onnx_path: Path, logger: trt_shim.Logger) -> tuple[Any, Any]:
    """Parse into a strongly typed network; every parser error goes into one UserError.

    Returns (network, parser): keep the parser alive until the build, it owns the weights.
    """
    network = builder.create_network(trt.network_flags())
    parser = trt.module.OnnxParser(network, logger.handle)
    ok = parser.parse_from_file(str(onnx_path))
    errors = [_format_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
    if not ok or errors:
        errors = errors or logger.errors or ["parse_from_file returned False without an error"]
        raise UserError(
            f"TensorRT {trt.version} ({trt.flavor}) could not parse {onnx_path} "
            f"({len(errors)} error{'s' * (len(errors) != 1)}): " + " | ".join(errors)
        )
    return network, parser


def _io(network: Any, count: int, get: Any) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "dtype": t.dtype.name, "shape": [int(d) for d in t.shape]}
        for t in (get(i) for i in range(count))
    ]


def _add_profile(builder: Any, network: Any, profiles: Mapping[str, Profile]) -> tuple[dict, Any]:
    profile = builder.create_optimization_profile()
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    main = profiles.get(DEFAULT_INPUT) or next(iter(profiles.values()))
    used: dict[str, Profile] = {}
    for tensor in inputs:
        shape = [int(d) for d in tensor.shape]
        if all(d >= 0 for d in shape):
            continue
        chosen = profiles.get(tensor.name)
        if chosen is None and len(shape) == len(main.min):
            chosen = main
        if chosen is None:
            raise UserError(f"input {tensor.name} has dynamic shape {shape}; give it a profile")
        for dim, lo, hi in zip(shape, chosen.min, chosen.max, strict=True):
            if dim >= 0 and not lo == hi == dim:
                raise UserError(f"input {tensor.name} has static dim {dim}; the profile must keep it")
        profile.set_shape(tensor.name, chosen.min, chosen.opt, chosen.max)
        used[tensor.name] = chosen
    record = {name: {"min": list(p.min), "opt": list(p.opt), "max": list(p.max)} for name, p in used.items()}
    return record, profile


class _Progress:
    """Prints the builder's top-level phases to stderr (TensorRT's IProgressMonitor)."""

    @staticmethod
    def create(trt: Any) -> Any:
        class Monitor(trt.IProgressMonitor):
            def __init__(self) -> None:
                trt.IProgressMonitor.__init__(self)

            def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
                if parent_phase is None:
                    print(f"[build] {phase_name} ...", file=sys.stderr, flush=True)

            def step_complete(self, phase_name: str, step: int) -> bool:
                return True

            def phase_finish(self, phase_name: str) -> None:
                pass

        return Monitor()


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path | None = None,
    *,
    profile: Profile | Mapping[str, Profile],
    workspace_mb: int = 2048,
    timing_cache: str | Path | None = None,
    compute_capability: str | None = None,
    progress: bool = False,
    verbose: bool = False,
) -> EngineBuild:
    """Build a TensorRT engine from an ONNX file and write it with its JSON sidecar."""
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise UserError(f"ONNX file not found: {onnx_path}")
    engine_path = Path(engine_path) if engine_path else onnx_path.with_suffix(".engine")
    profiles = {DEFAULT_INPUT: profile} if isinstance(profile, Profile) else dict(profile)
    trt = trt_shim.load()
    logger = trt.logger(verbose)
    builder = trt.module.Builder(logger.handle)
    network, _parser = parse_onnx(trt, builder, onnx_path, logger)
    config = builder.create_builder_config()
    target = trt.set_target(config, compute_capability)
    config.set_memory_pool_limit(trt.module.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)
    config.profiling_verbosity = trt.module.ProfilingVerbosity.DETAILED
    profile_record, trt_profile = _add_profile(builder, network, profiles)
    config.add_optimization_profile(trt_profile)
    collectives, preview = _dist_collective(trt, network, config)
    cache_record = _load_timing_cache(trt, config, timing_cache)
    if progress:
        config.progress_monitor = _Progress.create(trt.module)
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if plan is None or plan.nbytes == 0:
        detail = " | ".join(logger.errors) or "no error message from TensorRT"
        raise UserError(f"TensorRT could not build an engine from {onnx_path}: {detail}")
    _save_timing_cache(trt, config, timing_cache)
    engine_path.parent.mkdir(parents=True, exist_ok=True)
    engine_path.write_bytes(plan)
    sidecar = {
        "format": SIDECAR_FORMAT,
        "engine": engine_path.name,
        "engine_bytes": int(plan.nbytes),
        "onnx": os.path.relpath(onnx_path.resolve(), engine_path.parent.resolve()),
        "onnx_sha256": onnx_sha256(onnx_path),
        "tensorrt": {"flavor": trt.flavor, "version": trt.version},
        "compute_capability": target,
        "strongly_typed": trt.network_flags() != 0,
        "profiling_verbosity": "DETAILED",
        "workspace_mb": int(workspace_mb),
        "profile": profile_record,
        "inputs": _io(network, network.num_inputs, network.get_input),
        "outputs": _io(network, network.num_outputs, network.get_output),
        "dist_collective_layers": collectives,
        "preview_features": ["MULTIDEVICE_RUNTIME_10_16"] if preview else [],
        "timing_cache": cache_record,
        "build_seconds": round(seconds, 3),
    }
    side = sidecar_path(engine_path)
    side.write_text(json.dumps(sidecar, indent=2) + "\n")
    return EngineBuild(engine_path, side, sidecar, seconds, int(plan.nbytes))


def _dist_collective(trt: trt_shim.Trt, network: Any, config: Any) -> tuple[int, bool]:
    """(number of DistCollective layers, whether a preview feature was switched on for them)."""
    kind = trt.dist_collective_layer_type()
    count = 0 if kind is None else sum(network.get_layer(i).type == kind for i in range(network.num_layers))
    return count, bool(count) and trt.enable_dist_collective(config)


def _load_timing_cache(trt: trt_shim.Trt, config: Any, path: str | Path | None) -> str | None:
    if path is None or not trt.supports_timing_cache:
        return None
    path = Path(path)
    data = path.read_bytes() if path.is_file() else b""
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, ignore_mismatch=False)
    return str(path)


def _save_timing_cache(trt: trt_shim.Trt, config: Any, path: str | Path | None) -> None:
    if path is None or not trt.supports_timing_cache:
        return
    cache = config.get_timing_cache()
    if cache is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(memoryview(cache.serialize()))


def read_sidecar(engine_path: str | Path) -> dict[str, Any]:
    path = sidecar_path(engine_path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read engine sidecar {path}: {exc}") from None
    if record.get("format") != SIDECAR_FORMAT:
        raise UserError(f"{path} is not an engine sidecar ({SIDECAR_FORMAT})")
    return record


# ------------------------------------------------------------------------------------------- checking


@dataclass
class OutputComparison:
    name: str
    max_abs_error: float
    rel_error: float  # ||a - b|| / ||b||
    min_cosine: float  # over the rows of the last dimension (tokens, for logits)
    passed: bool  # Polygraphy's verdict with the tolerances given


@dataclass
class CheckResult:
    runners: list[str]
    outputs: list[OutputComparison]
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def token_feeds(
    shapes: Sequence[tuple[int, int]], vocab: int, *, seed: int = 0, input_name: str = DEFAULT_INPUT
) -> list[dict[str, np.ndarray]]:
    """A Polygraphy data loader: one feed dict of random int64 token ids per (batch, seq) shape."""
    rng = np.random.default_rng(seed)
    return [{input_name: rng.integers(0, vocab, size=shape, dtype=np.int64)} for shape in shapes]


def compare_runners(
    runners: Sequence[Any], feeds: Sequence[Mapping[str, np.ndarray]], *, atol: float, rtol: float
) -> CheckResult:
    """Run Polygraphy runners on the same feeds; the first runner is the reference."""
    from polygraphy import comparator

    results = comparator.Comparator.run(list(runners), data_loader=list(feeds))
    simple = getattr(comparator, "SimpleCompareFunc", None) or comparator.CompareFunc.simple
    verdict = comparator.Comparator.compare_accuracy(
        results, compare_func=simple(atol=atol, rtol=rtol, check_shapes=True)
    )
    # One AccuracyResult (runner pair -> per-iteration {output: match}), or a list of them (newer Polygraphy)
    accuracies = [verdict] if isinstance(verdict, Mapping) else list(verdict)
    (ref_name, ref_runs), (test_name, test_runs) = results[0], results[1]
    outputs = []
    for name in ref_runs[0]:
        errs, refs, cosines, max_abs = 0.0, 0.0, [], 0.0
        for ref, test in zip(ref_runs, test_runs, strict=True):
            a = np.asarray(test[name], dtype=np.float64)
            b = np.asarray(ref[name], dtype=np.float64)
            errs += float(np.sum((a - b) ** 2))
            refs += float(np.sum(b**2))
            max_abs = max(max_abs, float(np.max(np.abs(a - b))) if a.size else 0.0)
            cosines.append(_min_row_cosine(a, b))
        pair_ok = all(
            bool(run[name]) for acc in accuracies for runs in acc.values() for run in runs if name in run
        )
        outputs.append(
            OutputComparison(name, max_abs, (errs / refs) ** 0.5 if refs else 0.0, min(cosines), pair_ok)
        )
    return CheckResult(runners=[ref_name, test_name], outputs=outputs, passed=bool(verdict))


def _min_row_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a2 = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
    b2 = b.reshape(-1, b.shape[-1]) if b.ndim else b.reshape(1, 1)
    num = np.sum(a2 * b2, axis=1)
    den = np.linalg.norm(a2, axis=1) * np.linalg.norm(b2, axis=1)
    return float(np.min(np.where(den > 0, num / np.maximum(den, 1e-300), 1.0)))


def onnxrt_runner(onnx_path: str | Path, name: str | None = None) -> Any:
    """A Polygraphy ONNX Runtime runner (CPU) that is safe for FP8 Q/DQ graphs (see passes.fp8)."""
    import onnxruntime as ort
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from passes.fp8 import ORT_DISABLED_OPTIMIZERS

    def session() -> Any:
        return ort.InferenceSession(
            str(onnx_path), providers=["CPUExecutionProvider"], disabled_optimizers=ORT_DISABLED_OPTIMIZERS
        )

    return OnnxrtRunner(session, name=name or f"onnxrt:{Path(onnx_path).name}")


def check_engine(
    engine_path: str | Path,
    onnx_path: str | Path,
    shapes: Sequence[tuple[int, int]],
    *,
    vocab: int,
    atol: float = 0.5,
    rtol: float = 0.1,
    seed: int = 0,
) -> CheckResult:
    """Compare a TensorRT engine with ONNX Runtime on the same ONNX (needs datacenter TensorRT and a GPU)."""
    trt_shim.require_gpu_runtime()
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    engine = TrtRunner(EngineFromBytes(Path(engine_path).read_bytes()), name=f"trt:{Path(engine_path).name}")
    feeds = token_feeds(shapes, vocab, seed=seed, input_name=_engine_input(engine_path))
    return compare_runners([onnxrt_runner(onnx_path), engine], feeds, atol=atol, rtol=rtol)


def _engine_input(engine_path: str | Path) -> str:
    try:
        inputs = read_sidecar(engine_path)["inputs"]
    except UserError:
        return DEFAULT_INPUT
    names = [i["name"] for i in inputs]
    return DEFAULT_INPUT if DEFAULT_INPUT in names or not names else names[0]
