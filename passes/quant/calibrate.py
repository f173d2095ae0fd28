"""FP8 calibration: per-tensor activation scales (amax, or a percentile of |x|, over calibration tokens run
through ONNX Runtime, divided by 448) for the inputs of every linear layer, and their scales file."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
from tqdm import tqdm

from passes.errors import UserError
from passes.io.model_io import load_model
from passes.io.sessions import open_session
from passes.matching import graph_values
from passes.patterns.linear import find_linears

FP8_MAX = 448.0
SCALES_FORMAT = "ffn-fusion-fp8-scales/1"
_HIST_BINS = 4096


@dataclass
class ActivationScales:
    """Per-tensor activation scales (tensor name -> scale) and how they were obtained."""

    scales: dict[str, float]
    amax: dict[str, float] = field(default_factory=dict)
    percentile: float | None = None
    tokens_sha256: str = ""
    num_tokens: int = 0

    def save(self, path: str | Path) -> None:
        record = {
            "format": SCALES_FORMAT,
            "fp8_max": FP8_MAX,
            "percentile": self.percentile,
            "calibration_tokens_sha256": self.tokens_sha256,
            "num_tokens": self.num_tokens,
            "scales": self.scales,
            "amax": self.amax,
        }
        Path(path).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ActivationScales:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read FP8 scales file {path}: {exc}") from None
        if not isinstance(record, dict) or record.get("format") != SCALES_FORMAT:
            raise UserError(f"{path} is not an FP8 scales file (expected format {SCALES_FORMAT!r})")
        scales = record.get("scales")
        if not isinstance(scales, dict) or not all(
            isinstance(v, int | float) and v > 0 and math.isfinite(v) for v in scales.values()
        ):
            raise UserError(f"{path}: 'scales' must map tensor names to positive numbers")
        return cls(
            scales={str(k): float(v) for k, v in scales.items()},
            amax={str(k): float(v) for k, v in record.get("amax", {}).items()},
            percentile=record.get("percentile"),
            tokens_sha256=str(record.get("calibration_tokens_sha256", "")),
            num_tokens=int(record.get("num_tokens", 0)),
        )


class _AbsStats:
    """Running max of |x| and, for percentiles, a histogram whose range doubles as the max grows."""

    def __init__(self, keep_histogram: bool) -> None:
        self.amax = 0.0
        self.keep_histogram = keep_histogram
        self.hist: np.ndarray | None = None
        self.hi = 0.0

    def update(self, x: np.ndarray) -> None:
        absx = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        absx = absx[np.isfinite(absx)]
        if absx.size == 0:
            return
        batch_max = float(absx.max())
        self.amax = max(self.amax, batch_max)
        if not self.keep_histogram:
            return
        if self.hist is None:
            self.hist = np.zeros(_HIST_BINS, dtype=np.int64)
            self.hi = batch_max if batch_max > 0 else 1e-12
        while batch_max > self.hi:
            merged = self.hist.reshape(-1, 2).sum(axis=1)
            self.hist = np.concatenate([merged, np.zeros_like(merged)])
            self.hi *= 2.0
        self.hist += np.histogram(absx, bins=_HIST_BINS, range=(0.0, self.hi))[0]

    def value(self, percentile: float | None) -> float:
        if percentile is None or self.hist is None:
            return self.amax
        cdf = np.cumsum(self.hist) / max(int(self.hist.sum()), 1)
        index = int(np.searchsorted(cdf, percentile / 100.0))
        return min(self.amax, (index + 1) * self.hi / _HIST_BINS)


def tokens_sha256(token_batches: Iterable[np.ndarray | Mapping[str, np.ndarray]]) -> str:
    """sha256 of the calibration batches (arrays, or dicts of feeds), in order; saved with the scales."""
    digest = hashlib.sha256()
    for batch in token_batches:
        feeds = batch if isinstance(batch, Mapping) else {"": batch}
        for key in sorted(feeds):
            array = np.ascontiguousarray(feeds[key], dtype=np.int64)
            digest.update(f"{key}{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def scale_from_amax(amax: float) -> float:
    return amax / FP8_MAX if amax > 0 and math.isfinite(amax) else 1.0


def _calibration_session(model_path: Path, names: list[str]):
    model = load_model(model_path)
    by_name = {v.name: v for v in graph_values(model.graph)}
    outputs = {v.name for v in model.graph.outputs}
    for name in names:
        if name not in outputs:
            model.graph.outputs.append(by_name[name])
    return open_session(ir.to_proto(model), folder=model_path.parent)


def _feeds(session, batch) -> dict[str, np.ndarray]:
    if isinstance(batch, Mapping):
        return {k: np.asarray(v) for k, v in batch.items()}
    inputs = session.get_inputs()
    if len(inputs) != 1:
        names = ", ".join(i.name for i in inputs)
        raise UserError(f"the model has several inputs ({names}); pass calibration batches as dicts of feeds")
    return {inputs[0].name: np.asarray(batch, dtype=np.int64)}


def calibrate(
    model_path: str | Path,
    token_batches: Iterable[np.ndarray | Mapping[str, np.ndarray]],
    percentile: float | None = None,
    *,
    progress: bool = True,
) -> ActivationScales:
    """Run calibration batches through ONNX Runtime and return per-tensor activation scales.

    The inputs of every linear layer (the lm_head's included, so one file serves both settings of
    `quantize_lm_head`) become extra outputs of a temporary copy of the model; the weights stay where
    they are (external data is read from the model's folder). `percentile` (e.g. 99.99) clips the
    amax to that percentile of |x| over all calibration tokens and channels.
    """

    if percentile is not None and not 0 < percentile <= 100:
        raise UserError(f"percentile must be in (0, 100], got {percentile}")
    model_path = Path(model_path)
    if not model_path.is_file():
        raise UserError(f"model not found: {model_path}")
    names = list(dict.fromkeys(lin.activation.name for lin in find_linears(load_model(model_path).graph)))
    if not names:
        raise UserError(f"{model_path} has no linear layers (MatMul with a constant weight) to calibrate")
    session = _calibration_session(model_path, names)
    stats = {name: _AbsStats(percentile is not None) for name in names}
    num_tokens = 0
    batches = list(token_batches)
    if not batches:
        raise UserError("no calibration tokens given")
    for batch in tqdm(batches, desc="calibrate", unit="batch", file=sys.stderr, disable=not progress):
        feeds = _feeds(session, batch)
        num_tokens += int(next(iter(feeds.values())).size)
        for name, value in zip(names, session.run(names, feeds), strict=True):
            stats[name].update(value)
    amax = {name: s.value(percentile) for name, s in stats.items()}
    return ActivationScales(
        scales={name: scale_from_amax(a) for name, a in amax.items()},
        amax=amax,
        percentile=percentile,
        tokens_sha256=tokens_sha256(batches),
        num_tokens=num_tokens,
    )
