"""Check a built TensorRT engine against ONNX Runtime on the same ONNX, through Polygraphy's Comparator.

`check_engine` needs datacenter TensorRT and a GPU; `compare_runners` with two `onnxrt_runner`s runs the
same machinery (random token feeds, Comparator, per-output errors) on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exporters.tensorrt import shim as trt_shim
from exporters.tensorrt.build import DEFAULT_INPUT, read_sidecar
from passes.errors import UserError
from passes.io.sessions import open_session


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
    from polygraphy import comparator  # noqa: PLC0415 (Polygraphy: the [tensorrt]/test extras, only for engine checks)

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
    """A Polygraphy ONNX Runtime runner (CPU) that is safe for FP8 Q/DQ graphs (see passes.quant.fp8)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner  # noqa: PLC0415 (Polygraphy: the [tensorrt]/test extras, only for engine checks)

    def session() -> Any:
        return open_session(onnx_path)

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
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner  # noqa: PLC0415 (Polygraphy: the [tensorrt]/test extras, only for engine checks)

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
