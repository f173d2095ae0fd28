"""The latency model's two fitted constants (bandwidth efficiency, per-layer overhead), fit to the paper's
Llama-3.1-405B and pre-fusion Ultra-253B measurements only (never the fused 70.92 tokens/s), and the
largest fused speedup any model of the same form could predict."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from passes.errors import UserError
from runtime.latency.constants import value
from runtime.latency.paper_models import llama_405b, predict_spec, ultra_253b
from runtime.latency.predict import hardware


@dataclass(frozen=True)
class OverheadFit:
    bw_efficiency: float
    layer_overhead: float  # s


def fit_overheads(gpu: str = "h100") -> OverheadFit:
    """Fit bw_efficiency and layer_overhead so Llama-405B and pre-fusion Ultra-253B hit the paper's numbers.

    For a trial efficiency, each target gives the per-layer overhead that closes its gap; bisect the
    efficiency until both targets agree. Uses only 41.44 and 63.38 tokens/s (never the fused 70.92)."""
    batch, context = int(value("calibration.batch")), int(value("calibration.context"))
    targets = [
        (llama_405b(), value("paper.llama405b.tokens_per_s")),
        (ultra_253b(), value("paper.ultra253b.before.tokens_per_s")),
    ]
    base = replace(hardware(gpu, calibrated=False), layer_overhead=0.0)

    def overheads(eta: float) -> list[float]:
        hw = replace(base, bw_efficiency=eta)
        out = []
        for spec, tokens_per_s in targets:
            b = predict_spec(spec, hw, batch=batch, context=context)
            out.append((1.0 / tokens_per_s - b.total_s) / b.n_layers)
        return out

    def gap(eta: float) -> float:
        first, second = overheads(eta)
        return first - second

    lo, hi = 0.05, 1.0
    if gap(lo) * gap(hi) > 0:
        raise UserError("the overhead fit has no solution with a bandwidth efficiency in (0.05, 1]")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gap(lo) * gap(mid) <= 0:
            hi = mid
        else:
            lo = mid
    eta = 0.5 * (lo + hi)
    return OverheadFit(eta, overheads(eta)[0])


@dataclass(frozen=True)
class SpeedupBound:
    per_attention_s: float  # fixed cost per attention sub-block at the bound
    per_ffn_s: float  # fixed cost per FFN sub-block at the bound: what fusing one FFN away saves
    speedup: float


def speedup_bound(gpu: str = "h100") -> SpeedupBound:
    """The largest fused Ultra-253B speedup that ANY model of the form
    time = weight-and-KV bytes / (eta * HBM) + a * (attention sub-blocks) + f * (FFN sub-blocks) + head
    can predict once fit to the two calibration targets (41.44, 63.38 tokens/s) with eta <= 1 and a >= 0.

    f grows as eta grows, so the bound is at eta = 1: solve the two targets for (a, f) there."""
    hw = replace(
        hardware(gpu, calibrated=False),
        allreduce_latency=0.0,
        allreduce_bandwidth=math.inf,
        launch_per_kernel=0.0,
        layer_overhead=0.0,
    )
    rows, rhs = [], []
    for spec, tokens_per_s in (
        (llama_405b(), value("paper.llama405b.tokens_per_s")),
        (ultra_253b(), value("paper.ultra253b.before.tokens_per_s")),
    ):
        batch, context = int(value("calibration.batch")), int(value("calibration.context"))
        b = predict_spec(spec, hw, batch=batch, context=context)
        rows.append([sum(x.attention for x in spec.blocks), sum(x.ffn_width > 0 for x in spec.blocks)])
        rhs.append(1.0 / tokens_per_s - b.total_s)
    a, f = np.linalg.solve(np.array(rows, dtype=float), np.array(rhs))
    if a < 0:
        raise UserError("speedup bound: the two targets need a negative attention cost even at eta = 1")
    ultra = ultra_253b()
    removed = sum(j - i for i, j in ultra.groups)
    before = 1.0 / value("paper.ultra253b.before.tokens_per_s")
    return SpeedupBound(float(a), float(f), float(before / (before - removed * f)))
