"""The pruning trade-off (`prune_attention.py --tradeoff`): attention layers removed (chosen by
importance, in runs) against held-out perplexity, by surgery alone and after local distillation; a table
and a picture (docs/pruning.md)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from passes.io.figures import pyplot
from runtime.prune.distill import distill_local
from runtime.prune.model import PruneModel
from runtime.prune.report import score
from runtime.prune.selection import choose, default_runs, format_layers
from runtime.text_sets import TextSet


@dataclass(frozen=True)
class TradeoffPoint:
    removed: int
    layers: str
    unpruned: float
    surgery: float
    distilled: float
    seconds: float  # the local distillation

    def line(self) -> str:
        return (f"| {self.removed} | {self.layers} | {self.surgery:.2f} ({self._pct(self.surgery)}) | "
                f"{self.distilled:.2f} ({self._pct(self.distilled)}) | {self.seconds:.0f} s |")

    def _pct(self, ppl: float) -> str:
        return f"{100 * (ppl / self.unpruned - 1):+.0f}%"


def measure_tradeoff(model: PruneModel, importance: dict[int, float], counts: Sequence[int], runs: int | None,
                     calib, held_out: Sequence[TextSet], ridge: float,
                     log: Callable[[str], None] = lambda m: None) -> list[TradeoffPoint]:
    points = []
    for count in counts:
        layers = choose(importance, count, runs if runs is not None else default_runs(count))
        surgery, distilled = model.copy(), model.copy()
        for i in layers:
            surgery.remove_attention(i)
        start = time.perf_counter()
        distill_local(model, distilled, layers, calib, ridge)
        seconds = time.perf_counter() - start
        rows = score(model, {"surgery": surgery, "distilled": distilled}, held_out, task_items=0)
        points.append(TradeoffPoint(count, format_layers(layers), rows[0].perplexity, rows[1].perplexity,
                                    rows[2].perplexity, seconds))
        log(points[-1].line())
    return points


def format_tradeoff(points: Sequence[TradeoffPoint]) -> str:
    head = ("| removed | layers | surgery ppl | distilled ppl | distillation |\n"
            "| --- | --- | --- | --- | --- |")
    base = f"unpruned perplexity {points[0].unpruned:.2f}" if points else ""
    return "\n".join([base, head, *(p.line() for p in points)])


def plot_tradeoff(points: Sequence[TradeoffPoint], path: Path, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p.removed for p in points]
    ax.plot(xs, [p.surgery for p in points], "o-", label="surgery")
    ax.plot(xs, [p.distilled for p in points], "o-", label="local distillation")
    if points:
        base = points[0].unpruned
        ax.axhline(base, color="gray", lw=1, label=f"unpruned ({base:.1f})")
        ax.axhline(1.2 * base, color="gray", lw=1, ls="--", label="unpruned +20%")
    ax.set_xlabel("attention layers removed")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
