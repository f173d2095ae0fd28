"""Which layers lose their attention: an explicit list (--layers 5-7,25-27), the K cheapest by importance in
N runs (--remove K --runs N), or as many as a KL budget allows (--max-kl X). Every choice is checked
against the model before anything runs: in range, still with attention, and not every attention layer."""

from __future__ import annotations

import re

from passes.errors import UserError
from runtime.prune.model import PruneModel


def parse_layers(text: str) -> list[int]:
    """'5-7,25-27' -> [5, 6, 7, 25, 26, 27] (sorted, distinct)."""
    layers: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(-?\d+)\s*(?:-\s*(-?\d+)\s*)?", part)
        if match is None:
            raise UserError(f"--layers {text!r}: expected numbers and ranges like 5-7,25-27")
        first = int(match[1])
        last = first if match[2] is None else int(match[2])
        if first > last:
            raise UserError(f"--layers {text!r}: range {part} runs backwards")
        layers.update(range(first, last + 1))
    return sorted(layers)


def check_layers(model: PruneModel, layers: list[int]) -> list[int]:
    """`layers` if each can lose its attention; UserError naming the first that cannot."""
    if not layers:
        raise UserError("no layers chosen: name at least one layer to remove attention from")
    n = model.n_layers
    for layer in layers:
        if not 0 <= layer < n:
            raise UserError(f"layer {layer} is out of range: the model has layers 0-{n - 1}")
        if model.kinds[layer].attention == "none":
            raise UserError(f"layer {layer} already has no attention (block_configs no_op); choose others")
    if set(model.attention_layers()) <= set(layers):
        raise UserError(f"removing layers {format_layers(layers)} would remove every attention layer; "
                        "keep at least one")
    return layers


def format_layers(layers: list[int]) -> str:
    """[5, 6, 7, 25] -> '5-7,25'."""
    parts, start = [], None
    for k, layer in enumerate(layers):
        if start is None:
            start = layer
        if k + 1 == len(layers) or layers[k + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(parts)


def default_runs(count: int) -> int:
    """Runs of about three layers: fusion groups of 2-3 FFNs after each run's first block."""
    return max(1, count // 3)


def choose(importance: dict[int, float], count: int, runs: int | None = None) -> list[int]:
    """The `count` layers in exactly `runs` maximal runs of consecutive layers with the smallest summed
    importance (dynamic programming over the layers; runs separated by at least one kept layer)."""
    runs = default_runs(count) if runs is None else runs
    candidates = set(importance)
    if count < 1 or runs < 1 or runs > count:
        raise UserError(f"--remove {count} --runs {runs}: need 1 <= runs <= layers removed")
    if count >= len(candidates):
        raise UserError(f"--remove {count}: the model has {len(candidates)} attention layers; "
                        "keep at least one")
    best = _best(importance, count, runs)
    if best is None:
        raise UserError(f"cannot place {count} layers in {runs} separate runs of consecutive attention "
                        "layers")
    return best[1]


def _best(importance: dict[int, float], count: int, runs: int) -> tuple[float, list[int]] | None:
    top = max(importance) + 1
    inf = float("inf")
    # state: (layers taken, runs started, previous layer taken?) -> (cost, chosen list)
    states: dict[tuple[int, int, bool], tuple[float, list[int]]] = {(0, 0, False): (0.0, [])}
    for layer in range(top):
        nxt: dict[tuple[int, int, bool], tuple[float, list[int]]] = {}
        for (taken, started, prev), (cost, chosen) in states.items():
            options = [((taken, started, False), (cost, chosen))]
            if layer in importance and taken < count and started + (0 if prev else 1) <= runs:
                after = (taken + 1, started + (0 if prev else 1), True)
                options.append((after, (cost + importance[layer], [*chosen, layer])))
            for key, value in options:
                if value[0] < nxt.get(key, (inf, []))[0]:
                    nxt[key] = value
        states = nxt
    finals = [v for (t, r, _), v in states.items() if t == count and r == runs]
    return min(finals, key=lambda v: v[0]) if finals else None


def within_budget(importance: dict[int, float], max_kl: float, runs: int | None = None) -> list[int]:
    """The most layers whose summed importance stays within `max_kl` (runs as in `choose`)."""
    if not max_kl > 0:
        raise UserError("--max-kl must be > 0")
    chosen: list[int] = []
    for count in range(1, len(importance)):
        r = default_runs(count) if runs is None else runs
        if r > count:
            continue
        best = _best(importance, count, r)
        if best is None or best[0] > max_kl:
            break
        chosen = best[1]
    if not chosen:
        cheapest = min(importance.values())
        raise UserError(f"--max-kl {max_kl}: even the cheapest layer costs {cheapest:.4f}; raise the budget")
    return chosen
