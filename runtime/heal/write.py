"""Writing healed weights: each group's fitted arrays staged on disk, then written into the fused model's
initializers (the same graph) with the heal's metadata, and the written file checked against the fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir

from passes.analysis.runner import BlockRunner
from passes.graph import strip_cast
from passes.io.model_io import load_model, save_model
from passes.model_map import find_blocks
from passes.validate import contribution_error
from runtime.heal.ffn import FusedFFN, GroupWeights
from runtime.heal.pair import HealPair
from runtime.heal.records import HEAL_METADATA_KEY, HealResult


def save_arrays(folder: Path, name: str, weights: GroupWeights) -> dict[str, Path]:
    """The healed arrays on disk (staging folder), so that only one group is ever held in memory."""
    paths = {}
    for key in ("gate", "up", "down", "norm"):
        paths[key] = folder / f"{name}.{key}.npy"
        np.save(paths[key], getattr(weights, key))
    return paths


def _replace(value: ir.Value, array: np.ndarray, transposed: bool) -> None:
    old = value.const_value
    data = (array.T if transposed else array).astype(old.dtype.numpy(), copy=False)
    value.const_value = ir.tensor(np.ascontiguousarray(data), dtype=old.dtype, name=value.name)


def write_healed(
    pair: HealPair, saved: dict[tuple[int, int], dict[str, Path]], result: HealResult, staged: Path
) -> None:
    """The fused model with the saved arrays as its groups' weights and `result` as metadata, to `staged`."""
    model = load_model(pair.fused)
    blocks = find_blocks(model)
    nodes = len(model.graph)
    for group, paths in saved.items():
        block = blocks[pair.fused_index(group)]
        arrays = {k: np.load(p, mmap_mode="r") for k, p in paths.items()}
        for key in ("gate", "up", "down"):
            weight = getattr(block.ffn, key)
            _replace(weight.source, arrays[key], weight.transposed)
        norm = block.norm.weight
        if norm is not None and strip_cast(norm) is norm and len(norm.uses()) == 1:
            _replace(norm, arrays["norm"], False)
    model.metadata_props[HEAL_METADATA_KEY] = json.dumps(result.metadata(), sort_keys=True)
    save_model(model, staged, external=True)
    if len(model.graph) != nodes:
        raise AssertionError("healing changed the graph")
    result.nodes = nodes


def check_written(path: Path, pair: HealPair, saved: dict, tokens: np.ndarray) -> None:
    """The written model's fused blocks compute what torch fitted (ONNX Runtime on the saved file)."""
    runner = BlockRunner(path)
    blocks = runner.blocks
    names = [b.ffn_input.name for b in blocks]
    captured = runner.capture(tokens, extra=names)
    for group, paths in saved.items():
        block = blocks[pair.fused_index(group)]
        arrays = {k: np.load(p) for k, p in paths.items()}
        module = FusedFFN(arrays["gate"], arrays["up"], arrays["down"], arrays["norm"], block.norm.eps)
        x = captured[block.ffn_input.name]
        y = captured[runner.cuts[block.index].output_name]
        error = contribution_error(x, y, module.apply(x))
        if not error <= 1e-4:
            raise AssertionError(
                f"healed group {list(group)}: written model differs from the fit ({error:.3g})"
            )
    runner.close()
