"""Each layer's attention importance: the mean KL(original || model without that layer's attention) per
position, on token windows; and the contiguous runs that are cheapest to remove (fusion needs runs).

One pass per batch: the original streams entering every layer are kept, and for each attention layer i
the rest of the model (i..N-1) is run with i's attention left out, so the cost is about N^2 / 2 layer
passes, not N full forwards from the embedding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from passes.io.figures import pyplot
from runtime.prune.model import PruneModel


@dataclass(frozen=True)
class Run:
    first: int
    last: int
    kl: float  # the sum of its layers' single-layer KLs (an additive estimate)

    @property
    def label(self) -> str:
        return f"{self.first}-{self.last}"


def kl_per_position(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(reference) || softmax(logits)) summed over positions (float64 sum)."""
    return kl_from(torch.log_softmax(reference.float(), -1), logits)


def kl_from(reference_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """kl_per_position with the reference's log-probabilities given (computed once for many variants).
    Each position's KL in float32, their sum in float64: 5x cheaper than float64 throughout (3 s -> 0.6 s
    CPU for 1024 positions of a 49152-token vocabulary) and equal to 1e-5 relative."""
    logp = torch.log_softmax(logits.float(), -1)
    return (reference_logp.exp() * (reference_logp - logp)).sum(-1).double().sum()


@torch.no_grad()
def attention_importance(
    model: PruneModel, windows: np.ndarray, batch: int = 4, log: Callable[[str], None] = lambda m: None
) -> dict[int, float]:
    """{layer: mean KL per position with that layer's attention slot left out} for every attention layer."""
    layers = model.attention_layers()
    sums = dict.fromkeys(layers, 0.0)
    positions = 0
    for start in range(0, len(windows), batch):
        ids = torch.from_numpy(np.ascontiguousarray(windows[start : start + batch]))
        x = model.embed(ids)
        entering = []
        for i in range(model.n_layers):
            entering.append(x)
            x = model.run_layer(i, x)
        reference = torch.log_softmax(model.logits(x), -1)
        for i in layers:
            y = entering[i] + model.ffn(i, entering[i])
            for k in range(i + 1, model.n_layers):
                y = model.run_layer(k, y)
            sums[i] += float(kl_from(reference, model.logits(y)))
        positions += ids.numel()
        log(f"importance: {min(start + batch, len(windows))}/{len(windows)} windows")
    return {i: s / positions for i, s in sums.items()}


def cheapest_runs(importance: dict[int, float], lengths: range = range(2, 7)) -> list[Run]:
    """For each length, the run of consecutive attention layers with the smallest summed importance."""
    runs = []
    for length in lengths:
        best = None
        for first in importance:
            members = range(first, first + length)
            if all(k in importance for k in members):
                run = Run(first, first + length - 1, sum(importance[k] for k in members))
                best = run if best is None or run.kl < best.kl else best
        if best is not None:
            runs.append(best)
    return runs


def format_importance(importance: dict[int, float], runs: list[Run]) -> str:
    """The table: layer, KL, rank (1 = cheapest to remove), and the cheapest runs per length."""
    order = sorted(importance, key=importance.get)
    rank = {layer: k + 1 for k, layer in enumerate(order)}
    marked = {k for r in runs[:2] for k in range(r.first, r.last + 1)}
    lines = [f"{'layer':>5} {'KL':>9} {'rank':>5}", "-" * 21]
    for layer in sorted(importance):
        mark = "  *" if layer in marked else ""
        lines.append(f"{layer:>5} {importance[layer]:>9.4f} {rank[layer]:>5}{mark}")
    lines.append("cheapest contiguous runs (summed single-layer KL; * marks the two shortest):")
    lines += [f"  {r.last - r.first + 1} layers: {r.label} (KL sum {r.kl:.4f})" for r in runs]
    return "\n".join(lines)


def plot_importance(importance: dict[int, float], runs: list[Run], path: Path, title: str,
                    chosen: list[int] | None = None) -> None:
    """A bar chart of the KL per layer (log scale), the cheapest run of each length shaded, the layers
    `chosen` for removal in orange."""
    plt = pyplot()

    layers = sorted(importance)
    fig, ax = plt.subplots(figsize=(10, 4))
    picked = set(chosen or ())
    colors = ["tab:orange" if k in picked else "tab:blue" for k in layers]
    ax.bar(layers, [max(importance[k], 1e-6) for k in layers], color=colors)
    ax.set_yscale("log")
    shades = ["tab:green", "tab:olive", "tab:red", "tab:purple", "tab:brown"]
    for run, color in zip(runs, shades, strict=False):
        ax.axvspan(run.first - 0.45, run.last + 0.45, color=color, alpha=0.15,
                   label=f"cheapest {run.last - run.first + 1}: {run.label}")
    ax.set_xlabel("layer")
    ax.set_ylabel("KL(original || without its attention)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
