"""Healing fused groups: blockwise local distillation of each fused FFN (docs/design.md §8).

Fusion replaces a group's sequential blocks x -> FFN_i -> ... -> FFN_j by the parallel sum, one wide
SwiGLU (Theorem 3.1 makes the wide FFN exactly that sum; the sum itself is the approximation). Healing
fits the wide FFN's weights (gate, up, down and its norm weight), started from the exact concatenation,
to the *original sequential output* of the group's blocks on calibration tokens:

    minimize  sum_t ||x_t + FFN_fused(norm(x_t)) - y_t||^2 / sum_t ||y_t - x_t||^2

x_t: the stream entering the group's FFNs, y_t: the original model's stream after block j. A full-block
parallel group (Plan.parallel, design §10) is healed the same way on its members' FFNs (parallel.py):
x_t is the stream entering block i, each member's h_k = x_t + Attn_k(norm1_k(x_t)) comes from the
original block k run on x_t, and the target is again the original's stream after block j. The streams
come from ONNX Runtime (the original model's per-block subgraphs, BlockRunner, streams.py); only the
one group being fitted lives in torch, so memory holds one group's weights, gradients and Adam state.

Inputs ("--inputs"): "original" takes x_t from the original model; "healed" (the default) takes it from
the model healed so far, group after group, so that a later group is fitted on the stream it will see
(measured on the pruned SmolLM2: the same held-out KL either way, docs/heal.md).

The fit (fit.py): optional Adam steps on all weights, then the down projection refitted in closed form (ridge
least squares); measured, the refit alone reaches what Adam does in a fraction of the time.

The reported error of a group is the relative squared error above (0: the original blocks exactly,
about 1: no better than leaving the group's contribution out), on the calibration tokens and on
held-out tokens, before (the exact concatenation) and after healing, on the same input streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from passes.errors import UserError
from passes.io.model_io import commit_output, staged_output
from passes.run.block_runner import BlockRunner
from passes.validate import exactness_tolerance
from runtime.heal.ffn import FusedFFN, GroupWeights, fingerprint
from runtime.heal.fit import fit, relative_squared_error
from runtime.heal.metadata import DEFAULT_CONFIG, GroupHeal, HealConfig, HealResult
from runtime.heal.pair import HealPair, load_pair
from runtime.heal.parallel import ParallelFFNs
from runtime.heal.streams import Streams, token_rows
from runtime.heal.transplant import check_origin, read_healed
from runtime.heal.write import check_written, save_arrays, write_healed


def heal(
    original: str | Path,
    fused: str | Path,
    calib: np.ndarray,
    heldout: np.ndarray,
    output: str | Path | None,
    config: HealConfig = DEFAULT_CONFIG,
    calib_source: str = "",
    log: Callable[[str], None] = lambda message: None,
    pair: HealPair | None = None,
    weights_from: str | Path | None = None,
) -> HealResult:
    """Heal every fused group of `fused` against `original`; write the healed model to `output`
    (atomically; None: measure only). `calib` and `heldout` are token windows [n, length].
    With `weights_from` (a model heal wrote from another graph of the same model and plan) nothing is
    fitted: its healed weights are written into `fused` (runtime/heal/transplant.py)."""
    start = time.perf_counter()
    config.check()
    pair = pair or load_pair(original, fused)
    if calib.size == 0 or heldout.size == 0:
        raise UserError("no calibration or held-out tokens")
    for tokens in (calib, heldout):
        pair.shape.window(tokens.shape[-1])  # a graph with a fixed sequence length: one line naming --window
    inputs = (original, fused) if weights_from is None else (original, fused, weights_from)
    if output is not None and Path(output).resolve() in {Path(p).resolve() for p in inputs}:
        raise UserError(f"output {output} is an input model; choose another path with -o")
    result = HealResult(
        None,
        pair.plan,
        config,
        calib_tokens=int(calib.size),
        heldout_tokens=int(heldout.size),
        calib_source=calib_source,
    )
    target = Path(output) if output is not None else Path(pair.fused).with_name(".heal-measure.onnx")
    with staged_output(target) as staging:
        if weights_from is None:
            saved = _heal_groups(pair, calib, heldout, config, result, staging, log)
        else:
            log(f"taking the healed weights of {weights_from}; checking {pair.fused} against {pair.original}")
            check_origin(pair, calib[: pair.shape.batch])
            saved = read_healed(pair, Path(weights_from), result, staging)
        if output is not None:
            staged = staging / target.name
            log(f"writing {target} (+ its external data)")
            write_healed(pair, saved, result, staged)
            check_written(staged, pair, saved, calib[: pair.shape.batch])
            commit_output(staged, target)
            result.output = target
    result.seconds = time.perf_counter() - start
    return result


def _heal_groups(
    pair: HealPair,
    calib: np.ndarray,
    heldout: np.ndarray,
    config: HealConfig,
    result: HealResult,
    staging: Path,
    log: Callable[[str], None],
) -> dict[tuple[int, int], list[dict[str, Path]]]:
    """Fit the groups along the stream, each one's errors appended to `result`: its fitted arrays (one set
    per FFN it holds), saved under `staging`."""
    runner = BlockRunner(pair.original)
    log(
        f"capturing the original model's streams on {calib.size} + {heldout.size} tokens: "
        + pair.shape.describe(len(calib) + len(heldout))
    )
    streams = Streams(runner, pair, calib, heldout)
    blocks = pair.original_blocks
    tolerance = max(1e-4, 10 * exactness_tolerance(blocks))
    groups = pair.groups  # along the stream: the healed chain runs from group to group
    current = {id(c): c.streams[blocks[groups[0][0]].block_input.name] for c in streams.chunks}
    position = groups[0][0]  # the block whose input `current` is (healed model)
    saved = {}
    for first, last in groups:
        group_start = time.perf_counter()
        group, parallel = (first, last), pair.is_parallel((first, last))
        dims = 2 if parallel else 1  # a parallel group's inputs are packed (parallel.py)
        xs, ys = {}, {}
        for chunk in streams.chunks:
            if config.inputs == "original":
                xs[id(chunk)] = streams.group_input(chunk, group, None)
            else:
                entering = streams.run_blocks(chunk, current[id(chunk)], position, first)
                xs[id(chunk)] = streams.group_input(chunk, group, entering)
            ys[id(chunk)] = chunk.streams[runner.cuts[last].output_name]
        split = {held: [c for c in streams.chunks if c.held_out == held] for held in (False, True)}
        x_cal, x_held = (token_rows([xs[id(c)] for c in split[held]], dims) for held in (False, True))
        y_cal, y_held = (token_rows([ys[id(c)] for c in split[held]]) for held in (False, True))
        weights = [GroupWeights.read(b) for b in pair.weight_blocks(group)]
        start = fingerprint(weights)  # lets heal.py --weights-from find the same start in another graph
        if parallel:
            module = ParallelFFNs(weights)
            pair.check_parallel_start(group, weights)
        else:
            module = weights[0].module()
            probe = x_cal[:256]
            pair.check_start(blocks[first : last + 1], probe, module.apply(probe), tolerance)
        sets = ((x_cal, y_cal), (x_held, y_held))
        before = _errors(module, sets)
        log(
            f"{'parallel group' if parallel else 'group'} [{first}, {last}]: fitting "
            f"{sum(p.numel() for p in module.parameters() if p.requires_grad)} parameters, "
            f"{config.steps} steps on {len(x_cal)} tokens"
        )
        fit(module, x_cal, y_cal, config)
        after = _errors(module, sets)
        for chunk in streams.chunks:
            current[id(chunk)] = module.apply(xs[id(chunk)])
        position = last + 1
        if parallel:
            module.update(weights)
        else:
            weights[0].update(module)
        saved[group] = [save_arrays(staging, f"group{first}_{last}.{k}", w) for k, w in enumerate(weights)]
        own = all(w.own_norm for w in weights)
        kept = "norm weight" if own else "fixed (its scale lies in the gate/up rows)"
        heal = GroupHeal(
            group,
            sum(w.gate.shape[1] for w in weights),
            calib_before=before[0],
            calib_after=after[0],
            heldout_before=before[1],
            heldout_after=after[1],
            seconds=time.perf_counter() - group_start,
            norm_weight=kept,
            start_sha256=start,
            kind="parallel" if parallel else "ffn",
        )
        result.groups.append(heal)
        log(heal.line())
        del module, weights, xs, ys, sets
    runner.close()
    return saved


def _errors(module: FusedFFN | ParallelFFNs, sets: tuple[tuple[np.ndarray, np.ndarray], ...]) -> list[float]:
    """The relative squared error on each (inputs, target) set: relative to what the whole group adds to the
    stream x (for a parallel group x is the first of its packed inputs)."""
    return [
        relative_squared_error(module.apply(x), x[:, 0] if isinstance(module, ParallelFFNs) else x, y)
        for x, y in sets
    ]
