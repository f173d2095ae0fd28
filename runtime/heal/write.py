"""Writing healed weights: each group's fitted arrays staged on disk, then written into the fused model's
initializers (the same graph) with the heal's metadata, and the written file checked against the fit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from passes.blocks import Block
from passes.io.model_io import load_model, load_typed_proto, save_model
from passes.io.sessions import open_session
from passes.matching import strip_cast
from passes.metadata import HEAL_METADATA_KEY
from passes.model_map import find_blocks
from passes.run.block_runner import BlockRunner
from passes.run.cut import NameGraph, fill_stream_types, split_skip_norms, stream_names
from passes.validate import contribution_error
from runtime.heal.ffn import GroupWeights
from runtime.heal.metadata import HealResult
from runtime.heal.pair import HealPair
from runtime.heal.parallel import ParallelFFNs, pack


def save_arrays(folder: Path, name: str, weights: GroupWeights) -> dict[str, Path]:
    """The healed arrays on disk (staging folder), so that only one group is ever held in memory."""
    paths = {}
    for key in ("gate", "up", "down", "norm"):
        paths[key] = folder / f"{name}.{key}.npy"
        np.save(paths[key], getattr(weights, key))
    return paths


def _replace(value: ir.Value, array: np.ndarray, transposed: bool, hashes: dict[str, str]) -> None:
    """`value`'s initializer set to `array` (in its stored dtype and layout); its sha256 into `hashes`."""
    old = value.const_value
    data = (array.T if transposed else array).astype(old.dtype.numpy(), copy=False)
    value.const_value = ir.tensor(np.ascontiguousarray(data), dtype=old.dtype, name=value.name)
    hashes[value.name] = hashlib.sha256(value.const_value.tobytes()).hexdigest()


def write_healed(
    pair: HealPair, saved: dict[tuple[int, int], list[dict[str, Path]]], result: HealResult, staged: Path
) -> None:
    """The fused model with the saved arrays as its groups' weights and `result` as metadata, to `staged`."""
    model = load_model(pair.fused)
    blocks = find_blocks(model)
    nodes = len(model.graph)
    for group, members in saved.items():
        for block, paths in zip(pair.weight_blocks(group, blocks), members, strict=True):
            arrays = {k: np.load(p, mmap_mode="r") for k, p in paths.items()}
            for key in ("gate", "up", "down"):
                weight = getattr(block.ffn, key)
                _replace(weight.source, arrays[key], weight.transposed, result.tensors)
            norm = block.norm.weight
            if norm is not None and strip_cast(norm) is norm and len(norm.uses()) == 1:
                _replace(norm, arrays["norm"], False, result.tensors)
    model.metadata_props[HEAL_METADATA_KEY] = json.dumps(result.metadata(), sort_keys=True)
    save_model(model, staged, external=True)
    if len(model.graph) != nodes:
        raise AssertionError("healing changed the graph")
    result.nodes = nodes


def check_written(path: Path, pair: HealPair, saved: dict, tokens: np.ndarray) -> None:
    """The written model's groups compute what torch fitted: each group's span of the saved file (from the
    stream entering its healed weights to the stream leaving the group, alone, so that memory holds one
    group's weights) on the original's stream there, by ONNX Runtime. A parallel group's span also gives
    each member's h_k, which the fitted module reads."""
    blocks = pair.original_blocks
    starts = {g: (blocks[g[0]].block_input if pair.is_parallel(g) else blocks[g[0]].ffn_input) for g in saved}
    starts = {g: value.name for g, value in starts.items()}
    runner = BlockRunner(pair.original)
    values = {**runner.capture(tokens, extra=sorted(set(starts.values())), only=True), **runner.side}
    runner.close()
    proto = load_typed_proto(path)
    written = find_blocks(load_model(path))
    ends = stream_names(proto, written)
    split_skip_norms(proto, sorted(set(starts.values())))  # a span's own first norm (passes/run/cut.py)
    for group, members in saved.items():
        targets = pair.weight_blocks(group, written)
        x_name, y_name = starts[group], ends[pair.fused_index(group) + len(targets) - 1][1]
        inner = [b.ffn_input.name for b in targets] if pair.is_parallel(group) else []
        x, (y, *hs) = values[x_name], _run_span(proto, path.parent, x_name, [y_name, *inner], values)
        weights = [_saved_weights(block, paths) for block, paths in zip(targets, members, strict=True)]
        module = ParallelFFNs(weights) if pair.is_parallel(group) else weights[0].module()
        fitted = module.apply(pack(x, hs) if hs else x)
        error = contribution_error(x, y, fitted)
        if not error <= 1e-4:
            raise AssertionError(
                f"healed group {list(group)}: written model differs from the fit ({error:.3g})"
            )


def _saved_weights(block: Block, paths: dict[str, Path]) -> GroupWeights:
    arrays = {k: np.load(p) for k, p in paths.items()}
    return GroupWeights(block, arrays["gate"], arrays["up"], arrays["down"], arrays["norm"], own_norm=False)


def _run_span(
    proto: onnx.ModelProto, folder: Path, start: str, outputs: list[str], values: dict
) -> list[np.ndarray]:
    """The graph from stream `start` to `outputs` alone (onnx.utils.Extractor; weights stay on disk), fed
    `values[start]` and the side tensors it reads from `values`."""
    fill_stream_types(proto, [start, *outputs])
    side = NameGraph(proto).block_side_inputs(start, outputs[0])
    sub = onnx.utils.Extractor(proto).extract_model([start, *side], outputs)
    feed = {name: values[name] for name in [start, *side]}
    return [np.array(v) for v in open_session(sub, folder=folder, prepack=False).run(None, feed)]
