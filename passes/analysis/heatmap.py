"""The dependency matrix as a heatmap, like the paper's figure (dependency.png of tools/analyze.py): FFN
groups boxed with a solid outline, whole-block parallel groups (paper section 6) with a dashed magenta one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from passes.io.figures import pyplot


def plot_dependency(
    dependency: np.ndarray,
    attention: list[bool],
    groups: Iterable[tuple[int, int]],
    path: str | Path,
    title: str = "Block dependency",
    parallel: Iterable[tuple[int, int]] = (),
) -> Path:
    """A heatmap of the dependency matrix like the paper's figure: row i = skipped block, column j =
    block whose contribution is measured; attention-free blocks marked along both axes, FFN groups boxed
    (solid), parallel block groups boxed (dashed, labelled "P[i, j]")."""
    plt = pyplot()
    from matplotlib.colors import LogNorm  # noqa: PLC0415 (matplotlib: only the figure needs it)
    from matplotlib.patches import Patch, Rectangle  # noqa: PLC0415 (matplotlib: only the figure needs it)

    n = len(attention)
    values = np.asarray(dependency, dtype=np.float64)
    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    low = max(float(positive.min()) if positive.size else 1e-3, 1e-3)
    high = max(float(finite.max()) if finite.size else 1.0, low * 10)
    shown = np.where(np.isfinite(values), np.clip(values, low, None), np.nan)
    size = min(4.0 + 0.28 * n, 16.0)
    fig, ax = plt.subplots(figsize=(size + 1.6, size))
    cmap = plt.colormaps["viridis"].with_extremes(bad="#f2f2f2")
    image = ax.imshow(shown, cmap=cmap, norm=LogNorm(vmin=low, vmax=high), interpolation="nearest")
    free_color, attn_color = "#d62728", "#404040"
    step = 1 if n <= 40 else max(1, n // 40)
    ticks = list(range(0, n, step))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7, rotation=90 if n > 40 else 0)
    ax.set_yticks(ticks, [str(t) for t in ticks], fontsize=7)
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        for label in labels:
            free = not attention[int(label.get_text())]
            label.set_color(free_color if free else attn_color)
            label.set_fontweight("bold" if free else "normal")
    # A strip along the top and the left: one cell per block, red where the block has no attention.
    for k, has_attention in enumerate(attention):
        color = attn_color if has_attention else free_color
        ax.add_patch(Rectangle((k - 0.5, -1.6), 1, 0.8, color=color, clip_on=False))
        ax.add_patch(Rectangle((-1.6, k - 0.5), 0.8, 1, color=color, clip_on=False))
    group_color, parallel_color = "#ff7f0e", "#ff00ff"
    parallel = list(parallel)
    # FFN groups labelled right of the box's top; parallel groups inside its bottom-left corner, which lies
    # in the empty lower triangle (so that labels of adjacent groups of both kinds never collide).
    boxes = [(g, group_color, "-", "") for g in groups] + [(g, parallel_color, "--", "P") for g in parallel]
    for (first, last), color, style, prefix in boxes:
        ax.add_patch(
            Rectangle(
                (first - 0.5, first - 0.5),
                last - first + 1,
                last - first + 1,
                fill=False,
                edgecolor=color,
                linestyle=style,
                linewidth=2.4,
            )
        )
        x, y, va = (first - 0.35, last + 0.35, "bottom") if prefix else (last + 0.6, first - 0.2, "top")
        label = f"{prefix}[{first}, {last}]"
        ax.text(x, y, label, color=color, fontsize=8, fontweight="bold", va=va, ha="left")
    ax.set_xlim(-1.7, n - 0.5)
    ax.set_ylim(n - 0.5, -1.7)
    ax.set_xlabel("block j (contribution measured)")
    ax.set_ylabel("block i (skipped)")
    ax.set_title(title, fontsize=11)
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ticks = [m * 10.0**e for e in range(-4, 2) for m in (1, 2, 5) if low <= m * 10.0**e <= high]
    if ticks:
        bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.set_label("dependency: mean 1 - cos(h_j, h~_j)  (log scale)")
    legend = [
        Patch(color=free_color, label="attention-free block"),
        Patch(color=attn_color, label="block with attention"),
        Patch(facecolor="none", edgecolor=group_color, linewidth=2, label="proposed group"),
    ]
    if parallel:
        dashed = {"facecolor": "none", "edgecolor": parallel_color, "linestyle": "--", "linewidth": 2}
        legend.append(Patch(**dashed, label="parallel blocks"))
    ax.legend(
        handles=legend,
        loc="lower left",
        fontsize=8,
        framealpha=0.9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
