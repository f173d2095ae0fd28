"""Healed weights carried into another graph of the same model and plan (heal.py --weights-from): the
fitted groups of a healed model (a prefill graph, say) read and staged for writing into another fused graph
(the KV-cache decode graph that generation, engines and serving run), so that one heal serves every graph.

The two graphs must be the same model fused with the same plan: the plans must be equal, and each group of
the target (fused FFN or parallel) must hold the very weights the heal started from (the sha256 of its
starting weights, which the heal recorded in ffn_fusion.heal: runtime.heal.ffn.fingerprint)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from passes.errors import UserError
from passes.io.model_io import load_model
from passes.metadata import HEAL_METADATA_KEY
from passes.model_map import find_blocks
from passes.run.block_runner import BlockRunner
from passes.validate import exactness_tolerance, plan_from_metadata
from runtime.heal.ffn import GroupWeights, fingerprint
from runtime.heal.metadata import GroupHeal, HealConfig, HealResult
from runtime.heal.pair import HealPair
from runtime.heal.streams import token_rows
from runtime.heal.write import save_arrays


def healed_metadata(healed: Path) -> dict:
    """The ffn_fusion.heal record of a healed model (a UserError when it has none)."""
    if not healed.is_file():
        raise UserError(f"model {healed} does not exist")
    props = load_model(healed).metadata_props
    if HEAL_METADATA_KEY not in props:
        raise UserError(f"{healed} has no {HEAL_METADATA_KEY} metadata: pass a model that heal.py wrote")
    return json.loads(props[HEAL_METADATA_KEY])


def check_origin(pair: HealPair, tokens: np.ndarray) -> None:
    """Each fused group of `pair.fused` computes the parallel sum of `pair.original`'s blocks on the streams
    of one run of `tokens`, and each parallel group holds the original blocks' FFN weights (what healing
    checks before it fits; here no fit follows)."""
    for group in pair.plan.parallel:
        pair.check_parallel_start(group, [GroupWeights.read(b) for b in pair.weight_blocks(group)])
    if not pair.plan.groups:
        return
    blocks = pair.original_blocks
    runner = BlockRunner(pair.original)
    names = sorted({blocks[first].ffn_input.name for first, _ in pair.plan.groups})
    captured = runner.capture(tokens, extra=names, only=True)
    runner.close()
    tolerance = max(1e-4, 10 * exactness_tolerance(blocks))
    for first, last in pair.plan.groups:
        x = token_rows([captured[blocks[first].ffn_input.name]])[:256]
        module = GroupWeights.read(pair.fused_block((first, last))).module()
        pair.check_start(blocks[first : last + 1], x, module.apply(x), tolerance)


def read_healed(
    pair: HealPair, healed: Path, result: HealResult, staging: Path
) -> dict[tuple[int, int], list[dict[str, Path]]]:
    """The healed groups of `healed`, checked to fit `pair.fused`, staged under `staging` (as
    distill._heal_groups stages a fit); `result` takes the heal's configuration and group records."""
    record = healed_metadata(healed)
    plan = plan_from_metadata(healed)
    if plan != pair.plan:
        raise UserError(
            f"{healed} was healed with plan {plan.to_json()}, {pair.fused} is fused with "
            f"{pair.plan.to_json()}; pass a healed model of the same plan"
        )
    groups = {tuple(g["group"]): g for g in record.get("groups", [])}
    healed_blocks = find_blocks(load_model(healed))
    result.config = HealConfig(**record["config"])
    result.calib_source, result.calib_tokens = record["calibration"], record["calib_tokens"]
    result.heldout_tokens, result.weights_from = record["heldout_tokens"], healed
    saved = {}
    for group in pair.groups:
        entry = groups.get(group)
        start = fingerprint([GroupWeights.read(b) for b in pair.weight_blocks(group)])
        if entry is None or entry.get("start_sha256") != start:
            raise UserError(
                f"{pair.fused} is not the model {healed} was healed from: group {list(group)} starts from "
                "other weights (another original model, or a heal that recorded no starting weights); "
                "fuse the same original with the same plan, or heal this graph itself"
            )
        weights = [GroupWeights.read(b) for b in pair.weight_blocks(group, healed_blocks)]
        name = f"group{group[0]}_{group[1]}"
        saved[group] = [save_arrays(staging, f"{name}.{k}", w) for k, w in enumerate(weights)]
        result.groups.append(GroupHeal(**{**entry, "group": group, "seconds": 0.0}))
    return saved
