"""Runs of consecutive blocks without attention, where FFN fusion groups can go (docs/design.md §2).

Pure functions of per-block flags with no graph library behind them, so that an exporter can print the
runs of a checkpoint before onnx_ir loads.
"""

from __future__ import annotations


def attention_free_runs(attention: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [i, j] (inclusive) of consecutive blocks without attention, from per-block flags."""
    runs: list[tuple[int, int]] = []
    for index, has_attention in enumerate(attention):
        if has_attention:
            continue
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def format_runs(runs: list[tuple[int, int]]) -> str:
    """'6-7, 11, 42-51' style text; 'none' when empty."""
    return ", ".join(f"{i}" if i == j else f"{i}-{j}" for i, j in runs) or "none"
