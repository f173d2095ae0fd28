"""Healing fused groups: blockwise local distillation of each fused FFN (docs/design.md §8).

Fusion replaces a group's sequential blocks x -> FFN_i -> ... -> FFN_j by the parallel sum, one wide
SwiGLU (Theorem 3.1 makes the wide FFN exactly that sum; the sum itself is the approximation). Healing
fits the wide FFN's weights (gate, up, down and its norm weight), started from the exact concatenation,
to the *original sequential output* of the group's blocks on calibration tokens:

    minimize  sum_t ||x_t + FFN_fused(norm(x_t)) - y_t||^2 / sum_t ||y_t - x_t||^2

x_t: the stream entering the group's FFNs, y_t: the original model's stream after block j. The streams
come from ONNX Runtime (the original model's per-block subgraphs, passes/analysis.BlockRunner); only the
one group being fitted lives in torch, so memory holds one group's weights, gradients and Adam state.

Inputs ("--inputs"): "original" takes x_t from the original model; "healed" (the default) takes it from
the model healed so far, group after group, so that a later group is fitted on the stream it will see
(measured on the pruned SmolLM2: the same held-out KL either way, docs/heal.md).

The fit: optional Adam steps on all weights, then the down projection refitted in closed form (ridge
least squares); measured, the refit alone reaches what Adam does in a fraction of the time.

The reported error of a group is the relative squared error above (0: the original blocks exactly,
about 1: no better than leaving the group's contribution out), on the calibration tokens and on
held-out tokens, before (the exact concatenation) and after healing, on the same input streams.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from passes.analysis.dependency import BlockRunner
from passes.blocks import Block
from passes.errors import UserError
from passes.graph import strip_cast
from passes.io.model_io import commit_output, load_model, save_model, staged_output
from passes.model_map import find_blocks, vocab_size
from passes.plan import Plan
from passes.reference import norm_weight, parallel_sum
from passes.validate import contribution_error, exactness_tolerance, plan_from_metadata
from runtime.evaluate import QualityResult, evaluate, format_table
from runtime.text_sets import (
    LICENSES,
    STDLIB,
    TextSet,
    evaluation_sets,
    load_token_file,
    read_texts,
    text_tokens,
    windows,
)

HEAL_METADATA_KEY = "ffn_fusion.heal"
INPUT_MODES = ("healed", "original")
LOSSES = ("mse", "token")
CHUNK_WINDOWS = 8  # windows per whole-model capture run (bounds the logits held at once)


@dataclass(frozen=True)
class HealConfig:
    steps: int = 0  # Adam steps on all weights before the refit; measured: no gain over the refit alone
    lr: float = 3e-4
    batch_tokens: int = 1024  # tokens per Adam step (sampled from the calibration tokens)
    inputs: str = "healed"
    loss: str = "mse"  # "mse": squared error over all tokens; "token": each token's error over its target
    seed: int = 0
    ridge: float = 0.1  # closed-form refit of the down projection after Adam (0: none), see refit_down

    def check(self) -> None:
        if self.steps < 0 or self.batch_tokens < 1 or not self.lr > 0:
            raise UserError("--steps must be >= 0, --batch-tokens >= 1 and --lr > 0")
        if self.inputs not in INPUT_MODES or self.loss not in LOSSES:
            raise UserError(f"--inputs must be one of {INPUT_MODES}, --loss one of {LOSSES}")


@dataclass
class GroupHeal:
    group: tuple[int, int]
    width: int
    calib_before: float
    calib_after: float
    heldout_before: float
    heldout_after: float
    seconds: float
    norm_weight: str  # "norm weight" (fitted) or "fixed" (fold: its scale lies in the gate/up rows)

    def line(self) -> str:
        i, j = self.group
        return (
            f"group [{i}, {j}] (width {self.width}): relative squared error calibration "
            f"{self.calib_before:.4f} -> {self.calib_after:.4f}, held-out {self.heldout_before:.4f} -> "
            f"{self.heldout_after:.4f} ({self.seconds:.1f} s)"
        )


@dataclass
class HealResult:
    output: Path | None
    plan: Plan
    config: HealConfig
    groups: list[GroupHeal] = field(default_factory=list)
    calib_tokens: int = 0
    heldout_tokens: int = 0
    calib_source: str = ""
    nodes: int = 0
    seconds: float = 0.0

    def metadata(self) -> dict:
        return {
            "config": asdict(self.config),
            "calibration": self.calib_source,
            "calib_tokens": self.calib_tokens,
            "heldout_tokens": self.heldout_tokens,
            "groups": [
                {k: (list(v) if k == "group" else v) for k, v in asdict(g).items() if k != "seconds"}
                for g in self.groups
            ],
        }


# ---------------------------------------------------------------------------------------------- the pair


@dataclass
class HealPair:
    """An original model and its fused model, checked against each other."""

    original: Path
    fused: Path
    plan: Plan
    original_blocks: list[Block]
    fused_blocks: list[Block]

    def fused_index(self, group: tuple[int, int]) -> int:
        """The index of the fused model's block that holds `group` (shifted by the groups before it)."""
        return group[0] - sum(j - i for i, j in self.plan.groups if j < group[0])

    def fused_block(self, group: tuple[int, int]) -> Block:
        return self.fused_blocks[self.fused_index(group)]


def load_pair(original: str | Path, fused: str | Path) -> HealPair:
    """The plan from the fused model's metadata, checked against both block tables."""
    original, fused = Path(original), Path(fused)
    for path in (original, fused):
        if not path.is_file():
            raise UserError(f"model {path} does not exist")
    plan = plan_from_metadata(fused)
    if not plan.groups:
        raise UserError(f"{fused}: its plan fuses no groups; there is nothing to heal")
    props = load_model(fused).metadata_props
    if HEAL_METADATA_KEY in props:
        raise UserError(f"{fused} is already healed ({HEAL_METADATA_KEY} metadata); heal the fused model")
    original_blocks = find_blocks(load_model(original))
    fused_blocks = find_blocks(load_model(fused))
    expected = len(original_blocks) - plan.removed_ffns
    mismatch = f"{original} does not match the fused model {fused}"
    if len(fused_blocks) != expected or max(j for _, j in plan.groups) >= len(original_blocks):
        raise UserError(
            f"{mismatch}: {len(original_blocks)} blocks, the plan {plan.to_json()} needs "
            f"{len(fused_blocks)} + {plan.removed_ffns}; pass the model that was fused"
        )
    pair = HealPair(original, fused, plan, original_blocks, fused_blocks)
    for first, last in plan.groups:
        width = sum(b.width for b in original_blocks[first : last + 1])
        if pair.fused_block((first, last)).width != width:
            raise UserError(f"{mismatch}: group [{first}, {last}] has width {width} in the original")
    return pair


# ---------------------------------------------------------------------------------------------- torch


class FusedFFN(torch.nn.Module):
    """x + down(silu(z gate) * (z up)), z = x / rms(x) * norm_weight: the fused block's FFN sub-block."""

    def __init__(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray, norm: np.ndarray, eps: float):
        super().__init__()

        def param(a: np.ndarray) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.tensor(np.asarray(a, dtype=np.float32)))

        self.gate, self.up, self.down, self.norm = param(gate), param(up), param(down), param(norm)
        self.eps = eps

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return torch.nn.functional.silu(z @ self.gate) * (z @ self.up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.hidden(x) @ self.down

    @torch.no_grad()
    def apply(self, x: np.ndarray, batch: int = 4096) -> np.ndarray:
        flat = x.reshape(-1, x.shape[-1])
        out = [
            self(torch.from_numpy(np.ascontiguousarray(flat[s : s + batch], np.float32))).numpy()
            for s in range(0, len(flat), batch)
        ]
        return np.concatenate(out).reshape(x.shape)


def relative_squared_error(pred: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """sum ||pred - y||^2 / sum ||y - x||^2, in float64."""
    p, x, y = (np.asarray(a, np.float64) for a in (pred, x, y))
    return float(((p - y) ** 2).sum() / max(((y - x) ** 2).sum(), 1e-300))


def fit(module: FusedFFN, x: np.ndarray, y: np.ndarray, config: HealConfig) -> None:
    """Adam steps on all weights, then (ridge > 0) the down projection refitted in closed form."""
    adam(module, x, y, config)
    if config.ridge > 0:
        refit_down(module, x, y, config.ridge)


def refit_down(module: FusedFFN, x: np.ndarray, y: np.ndarray, ridge: float, chunk: int = 2048) -> None:
    """The down projection that minimizes ||h D - (y - x)||^2 + lam ||D - D_0||^2 for the current gate
    and up (h: the SwiGLU hidden activations, N tokens x width W), lam = ridge * mean_t ||h_t||^2: least
    squares, regularized towards the current D. With N >= W the W x W Gram matrix is accumulated over
    token chunks; with fewer tokens the N x N form D_0 + h^T (h h^T + lam)^-1 r is solved instead."""
    rows, targets = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])

    def residuals(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = torch.from_numpy(np.ascontiguousarray(rows[s : s + chunk], np.float32))
        h = module.hidden(xs)
        ys = torch.from_numpy(np.ascontiguousarray(targets[s : s + chunk], np.float32))
        return h, ys - xs - h @ module.down

    with torch.no_grad():
        width, count = module.down.shape[0], len(rows)
        if count < width:
            h, r = (torch.cat(parts) for parts in zip(*map(residuals, range(0, count, chunk)), strict=True))
            kernel = h @ h.T
            lam = ridge * float(kernel.diagonal().sum()) / count
            kernel.diagonal().add_(lam)
            module.down.add_(h.T @ torch.cholesky_solve(r, torch.linalg.cholesky(kernel)))
            return
        gram = torch.zeros(width, width)
        rhs = torch.zeros_like(module.down)
        for s in range(0, count, chunk):
            h, r = residuals(s)
            gram.addmm_(h.T, h)
            rhs.addmm_(h.T, r)
        lam = ridge * float(gram.diagonal().sum()) / count
        gram.diagonal().add_(lam)
        module.down.add_(torch.cholesky_solve(rhs, torch.linalg.cholesky(gram)))


def adam(module: FusedFFN, x: np.ndarray, y: np.ndarray, config: HealConfig) -> None:
    """Adam with a cosine learning-rate decay on minibatches of calibration tokens."""
    if config.steps == 0:
        return
    generator = torch.Generator().manual_seed(config.seed)
    xs = torch.from_numpy(x.reshape(-1, x.shape[-1]).astype(np.float32))
    ys = torch.from_numpy(y.reshape(-1, y.shape[-1]).astype(np.float32))
    scale = (ys - xs).pow(2).sum(-1)  # each token's own target size ("token" loss)
    mean_scale = scale.mean()
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / config.steps))
    )
    count = xs.shape[0]
    for _ in range(config.steps):
        index = (
            torch.randperm(count, generator=generator)[: config.batch_tokens]
            if config.batch_tokens < count
            else slice(None)
        )
        error = (module(xs[index]) - ys[index]).pow(2).sum(-1)
        if config.loss == "token":
            loss = (error / scale[index].clamp_min(1e-12 * mean_scale)).mean()
        else:
            loss = error.mean() / mean_scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- streams


@dataclass
class _Chunk:
    """Some token windows: the side tensors of their capture and the streams kept from it."""

    tokens: np.ndarray
    side: dict[str, np.ndarray]
    streams: dict[str, np.ndarray]
    held_out: bool


class _Streams:
    """The original model's streams on calibration and held-out windows, captured chunk by chunk."""

    def __init__(self, runner: BlockRunner, pair: HealPair, calib: np.ndarray, heldout: np.ndarray):
        self.runner, self.pair = runner, pair
        blocks = pair.original_blocks
        self.keep = {blocks[i].ffn_input.name for i, _ in pair.plan.groups}
        # the stream leaving a group: the cut's name (a Skip*Normalization graph's last block has no
        # named residual sum; BlockRunner names it)
        self.keep |= {runner.cuts[j].output_name for _, j in pair.plan.groups}
        self.keep |= {blocks[i].block_input.name for i, _ in pair.plan.groups}
        self.chunks = [self._capture(t, False) for t in _split(calib)]
        self.chunks += [self._capture(t, True) for t in _split(heldout)]

    def _capture(self, tokens: np.ndarray, held_out: bool) -> _Chunk:
        captured = self.runner.capture(tokens, extra=sorted(self.keep), only=True)
        return _Chunk(tokens, dict(self.runner.side), {n: captured[n] for n in self.keep}, held_out)

    def run_blocks(self, chunk: _Chunk, stream: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Original blocks start..stop-1 on `stream`, with the chunk's side tensors."""
        self.runner.side = chunk.side
        for k in range(start, stop):
            stream = self.runner.run_block(k, stream)
        return stream

    def ffn_input(self, chunk: _Chunk, block: int, stream: np.ndarray) -> np.ndarray:
        """The stream entering block `block`'s FFN when `stream` enters the block."""
        if not self.pair.original_blocks[block].attention:
            return stream
        self.runner.side = chunk.side
        return self.runner.run_attention(block, stream)


def _split(tokens: np.ndarray) -> list[np.ndarray]:
    return [tokens[s : s + CHUNK_WINDOWS] for s in range(0, len(tokens), CHUNK_WINDOWS)]


def _rows(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrays]).astype(np.float32)


# ---------------------------------------------------------------------------------------------- weights


@dataclass
class _GroupWeights:
    """The fused block's FFN weights as [in, out] float32 arrays and where they live in the graph."""

    block: Block
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    norm: np.ndarray
    own_norm: bool  # the norm weight is an initializer only this norm reads (else it stays fixed)

    @classmethod
    def read(cls, block: Block) -> _GroupWeights:
        ffn = block.ffn
        gate, up, down = (w.matrix().astype(np.float32) for w in (ffn.gate, ffn.up, ffn.down))
        for w in (ffn.gate, ffn.up, ffn.down):
            w.release()
        weight = block.norm.weight
        if weight is None:
            return cls(block, gate, up, down, np.ones(gate.shape[0], np.float32), False)
        source = strip_cast(weight)
        norm = source.const_value.numpy().astype(np.float32)
        return cls(block, gate, up, down, norm, len(source.uses()) == 1 and weight is source)

    def module(self) -> FusedFFN:
        module = FusedFFN(self.gate, self.up, self.down, self.norm, self.block.norm.eps)
        # Without a norm weight of its own (fold: unit norm), the scale is left to the rows of gate and up,
        # which express it exactly: z diag(w) W_gate = z (diag(w) W_gate).
        module.norm.requires_grad_(self.own_norm)
        return module

    def update(self, module: FusedFFN) -> None:
        params = (module.gate, module.up, module.down, module.norm)
        self.gate, self.up, self.down, self.norm = (p.detach().numpy().copy() for p in params)


def _save_arrays(folder: Path, name: str, weights: _GroupWeights) -> dict[str, Path]:
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


def _write(pair: HealPair, saved: dict[tuple[int, int], dict[str, Path]], result: HealResult, staged: Path):
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


# ---------------------------------------------------------------------------------------------- heal


def heal(
    original: str | Path,
    fused: str | Path,
    calib: np.ndarray,
    heldout: np.ndarray,
    output: str | Path | None,
    config: HealConfig = HealConfig(),
    calib_source: str = "",
    log: Callable[[str], None] = lambda message: None,
    pair: HealPair | None = None,
) -> HealResult:
    """Heal every fused group of `fused` against `original`; write the healed model to `output`
    (atomically; None: measure only). `calib` and `heldout` are token windows [n, length]."""
    start = time.perf_counter()
    config.check()
    pair = pair or load_pair(original, fused)
    if calib.size == 0 or heldout.size == 0:
        raise UserError("no calibration or held-out tokens")
    if output is not None and Path(output).resolve() in {Path(p).resolve() for p in (original, fused)}:
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
        saved = _heal_groups(pair, calib, heldout, config, result, staging, log)
        if output is not None:
            staged = staging / target.name
            log(f"writing {target} (+ its external data)")
            _write(pair, saved, result, staged)
            check_written(staged, pair, saved, calib[:CHUNK_WINDOWS])
            commit_output(staged, target)
            result.output = target
    result.seconds = time.perf_counter() - start
    return result


def _heal_groups(pair, calib, heldout, config, result, staging, log) -> dict:
    runner = BlockRunner(pair.original)
    log(f"capturing the original model's streams on {calib.size} + {heldout.size} tokens")
    streams = _Streams(runner, pair, calib, heldout)
    blocks = pair.original_blocks
    tolerance = max(1e-4, 10 * exactness_tolerance(blocks))
    groups = sorted(pair.plan.groups)  # along the stream: the healed chain runs from group to group
    current = {id(c): c.streams[blocks[groups[0][0]].block_input.name] for c in streams.chunks}
    position = groups[0][0]  # the block whose input `current` is (healed model)
    saved = {}
    for first, last in groups:
        group_start = time.perf_counter()
        xs, ys = {}, {}
        for chunk in streams.chunks:
            if config.inputs == "original":
                xs[id(chunk)] = chunk.streams[blocks[first].ffn_input.name]
            else:
                entering = streams.run_blocks(chunk, current[id(chunk)], position, first)
                xs[id(chunk)] = streams.ffn_input(chunk, first, entering)
            ys[id(chunk)] = chunk.streams[runner.cuts[last].output_name]
        split = {held: [c for c in streams.chunks if c.held_out == held] for held in (False, True)}
        x_cal, y_cal = (_rows([d[id(c)] for c in split[False]]) for d in (xs, ys))
        x_held, y_held = (_rows([d[id(c)] for c in split[True]]) for d in (xs, ys))
        weights = _GroupWeights.read(pair.fused_block((first, last)))
        module = weights.module()
        _check_start(module, x_cal[:256], blocks[first : last + 1], pair, tolerance)
        before = [
            relative_squared_error(module.apply(x), x, y) for x, y in ((x_cal, y_cal), (x_held, y_held))
        ]
        log(
            f"group [{first}, {last}]: fitting {sum(p.numel() for p in module.parameters())} parameters, "
            f"{config.steps} steps on {len(x_cal)} tokens"
        )
        fit(module, x_cal, y_cal, config)
        after = [relative_squared_error(module.apply(x), x, y) for x, y in ((x_cal, y_cal), (x_held, y_held))]
        for chunk in streams.chunks:
            current[id(chunk)] = module.apply(xs[id(chunk)])
        position = last + 1
        weights.update(module)
        saved[(first, last)] = _save_arrays(staging, f"group{first}_{last}", weights)
        kept = "norm weight" if weights.own_norm else "fixed (its scale lies in the gate/up rows)"
        heal = GroupHeal(
            (first, last),
            weights.gate.shape[1],
            calib_before=before[0],
            calib_after=after[0],
            heldout_before=before[1],
            heldout_after=after[1],
            seconds=time.perf_counter() - group_start,
            norm_weight=kept,
        )
        result.groups.append(heal)
        log(heal.line())
        del module, weights, xs, ys
    runner.close()
    return saved


def _check_start(module: FusedFFN, x: np.ndarray, group: list[Block], pair: HealPair, tolerance: float):
    """The starting weights must compute the parallel sum of the original blocks (passes/reference.py):
    this catches an original that is not the one that was fused."""
    reference = parallel_sum(x, group, pair.plan.norm)
    got = module.apply(x).astype(np.float64)
    error = float(np.linalg.norm(got - reference) / max(np.linalg.norm(reference - x), 1e-30))
    if not error <= tolerance:
        first, last = group[0].index, group[-1].index
        raise UserError(
            f"{pair.original} does not match the fused model {pair.fused}: its group [{first}, {last}] "
            f"is not the parallel sum of the original's blocks (relative error {error:.3g}); "
            "pass the model that was fused"
        )


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


# ---------------------------------------------------------------------------------------------- the tool


@dataclass(frozen=True)
class HealDefaults:
    tokens: int = 8192  # calibration tokens
    heldout_tokens: int = 512  # per held-out text set, for the per-group errors
    eval_tokens: int = 1024  # per held-out text set, for the whole-model quality
    window: int = 128


HEAL_DEFAULTS = HealDefaults()
# Calibration text disjoint from runtime/text.EVALUATION_FILES: license prose and stdlib code.
CALIBRATION_FILES: tuple[Path, ...] = (
    *(LICENSES / n for n in ("Apache-2.0", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1")),
    *(STDLIB / n for n in ("difflib.py", "calendar.py", "shlex.py", "tempfile.py", "heapq.py")),
)


def calibration_windows(
    vocab: int, calib: Sequence[str | Path] | None, count: int, window: int
) -> tuple[np.ndarray, str]:
    """Calibration windows [n, window] (at most `count` tokens): one token file (.npy), or text files
    (default CALIBRATION_FILES) tokenized one by one and taken in turn, so that every file is sampled."""
    calib = [Path(p) for p in calib or []]
    if len(calib) == 1 and calib[0].suffix == ".npy":
        ids = load_token_file(calib[0])
        if ids.size == 0:
            raise UserError(f"{calib[0]} holds no token ids; pass a calibration file with some")
        if ids.min() < 0 or ids.max() >= vocab:
            raise UserError(f"{calib[0]}: token ids must lie in 0..{vocab - 1}")
        return windows(ids, window, count), f"token file {calib[0]}"
    files = calib or [p for p in CALIBRATION_FILES if p.is_file()]
    if not files:
        raise UserError("no calibration text found on this machine; pass --calib FILE")
    for path in files:
        if not read_texts([path]).strip():
            raise UserError(f"calibration text {path} is empty; pass files with text in them")
    parts = [text_tokens([f], vocab) for f in files]
    per_file = [windows(ids, window) for ids in parts]
    length = min(w.shape[1] for w in per_file)
    rows = [w[k, :length] for k in range(max(len(w) for w in per_file)) for w in per_file if k < len(w)]
    chosen = np.stack(rows[: max(1, count // length)])
    return chosen, "text " + ", ".join(map(str, files))


@dataclass
class HealReport:
    result: HealResult
    before: list[QualityResult]
    after: list[QualityResult]
    seconds: float

    def lines(self) -> list[str]:
        r, c = self.result, self.result.config
        out = [
            f"healed {len(r.groups)} group(s) of plan {r.plan.to_json()}: inputs {c.inputs}, loss {c.loss}, "
            f"{c.steps} Adam steps of {c.batch_tokens} tokens, lr {c.lr:g} (cosine), "
            f"{r.calib_tokens} calibration tokens, {r.heldout_tokens} held-out tokens",
            *(g.line() for g in r.groups),
        ]
        if self.before:
            out += ["quality on held-out text, fused (before healing):", format_table(self.before)]
            out += ["healed (after):", format_table(self.after)]
            kl_before, kl_after = self.before[-1].kl, self.after[-1].kl
            out.append(
                f"held-out KL {kl_before:.4f} -> {kl_after:.4f} ({kl_after / max(kl_before, 1e-30):.0%} "
                f"of the unhealed), top-1 agreement {self.before[-1].top1_agreement:.4f} -> "
                f"{self.after[-1].top1_agreement:.4f}"
            )
        out.append(
            f"wrote {r.output} ({r.nodes} nodes, as the fused model) in {self.seconds:.1f} s "
            f"(healing {r.seconds:.1f} s)"
        )
        return out

    def to_json(self) -> dict:
        return {
            "output": str(self.result.output),
            "plan": json.loads(self.result.plan.to_json()),
            **self.result.metadata(),
            "seconds_heal": round(self.result.seconds, 2),
            "seconds_total": round(self.seconds, 2),
            "quality_before": [q.row() for q in self.before],
            "quality_after": [q.row() for q in self.after],
        }


def run_heal(
    original: str | Path,
    fused: str | Path,
    output: str | Path,
    config: HealConfig = HealConfig(),
    calib: Sequence[str | Path] | None = None,
    tokens: int = HEAL_DEFAULTS.tokens,
    heldout_tokens: int = HEAL_DEFAULTS.heldout_tokens,
    eval_tokens: int = HEAL_DEFAULTS.eval_tokens,
    window: int = HEAL_DEFAULTS.window,
    heldout: Sequence[str | Path] | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> HealReport:
    """heal.py: calibration and held-out windows, healing, and the whole-model quality before and after.
    Held-out text: `heldout` (text files or one ids .npy), else evaluate.py's default sets."""
    start = time.perf_counter()
    config.check()
    pair = load_pair(original, fused)
    vocab = vocab_size(pair.original_blocks)
    calib_windows, source = calibration_windows(vocab, calib, tokens, window)
    log(f"calibration: {source}: {calib_windows.shape[0]} x {calib_windows.shape[1]} tokens")

    def held_out(count: int) -> list[TextSet]:
        files = [Path(p) for p in heldout or []]
        if len(files) == 1 and files[0].suffix == ".npy":
            return evaluation_sets(vocab, window, count, token_file=files[0])
        return evaluation_sets(vocab, window, count, text=files or None)

    held = np.concatenate([s.windows for s in held_out(heldout_tokens)])
    result = heal(original, fused, calib_windows, held, output, config, source, log, pair)
    del pair  # its block tables hold both models' weights (inline models); the evaluation loads them anew
    gc.collect()
    before, after = [], []
    if eval_tokens:
        sets = held_out(eval_tokens)
        log("evaluating the fused and the healed model against the original on held-out text")
        before = evaluate(original, fused, sets, progress=False)
        after = evaluate(original, result.output, sets, progress=False)
    return HealReport(result, before, after, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- analysis


def concatenated(group: list[Block], mode: str) -> FusedFFN:
    """The exact wide FFN that fusing `group` with norm `mode` gives (as passes/fuse.py builds it), read
    from the original blocks: gate/up concatenated along the width (rows scaled by each block's own norm
    weight for "fold", unit norm), down along its input dimension."""
    parts = {"gate": [], "up": [], "down": []}
    for block in group:
        scale = norm_weight(block) if mode == "fold" else None
        for key, part in parts.items():
            weight = getattr(block.ffn, key)
            matrix = weight.matrix().astype(np.float32)
            weight.release()
            part.append(
                matrix * scale[:, None].astype(np.float32) if scale is not None and key != "down" else matrix
            )
    hidden = parts["gate"][0].shape[0]
    last = norm_weight(group[-1]) if mode == "last" else None
    norm = np.ones(hidden, np.float32) if last is None else last.astype(np.float32)
    gate, up = (np.concatenate(parts[k], axis=1) for k in ("gate", "up"))
    return FusedFFN(gate, up, np.concatenate(parts["down"]), norm, group[-1].norm.eps)


@dataclass(frozen=True)
class GroupCost:
    """A candidate group's relative squared error (calibration, held-out), exact fusion and healed."""

    group: tuple[int, int]
    calib_before: float
    calib_after: float
    heldout_before: float
    heldout_after: float

    def row(self) -> dict:
        return {**asdict(self), "group": list(self.group)}


class HealedCosts:
    """Healed errors of candidate groups of an unfused model, measured on demand (and cached): the exact
    concatenation, its down projection refitted in closed form (refit_down) on calibration windows with
    inputs from the original model, then scored on the held-out windows. One capture of the streams."""

    def __init__(
        self,
        model: str | Path,
        calib: np.ndarray,
        heldout: np.ndarray,
        mode: str = "fold",
        ridge: float = HealConfig.ridge,
        log: Callable[[str], None] = lambda message: None,
    ):
        self.runner = BlockRunner(model)
        self.blocks, self.mode, self.ridge, self.log = self.runner.blocks, mode, ridge, log
        # The stream leaving each block, as BlockRunner's cuts name it: the last block of a
        # Skip*Normalization graph has no named residual sum of its own (the cut names it).
        self.outputs = [c.output_name for c in self.runner.cuts]
        names = sorted({b.ffn_input.name for b in self.blocks} | set(self.outputs))
        self.streams = [
            (held, self.runner.capture(tokens, extra=names, only=True))
            for held, data in ((False, calib), (True, heldout))
            for tokens in _split(data)
        ]
        self.runner.close()
        self.costs: dict[tuple[int, int], GroupCost] = {}

    def _rows(self, name: str, held: bool) -> np.ndarray:
        return _rows([c[name] for h, c in self.streams if h == held])

    def __call__(self, first: int, last: int) -> GroupCost:
        if (first, last) not in self.costs:
            start = time.perf_counter()
            x_in, y_out = self.blocks[first].ffn_input.name, self.outputs[last]
            (x, y), (xh, yh) = ((self._rows(x_in, h), self._rows(y_out, h)) for h in (False, True))
            module = concatenated(self.blocks[first : last + 1], self.mode)
            before = (
                relative_squared_error(module.apply(x), x, y),
                relative_squared_error(module.apply(xh), xh, yh),
            )
            refit_down(module, x, y, self.ridge)
            after = (
                relative_squared_error(module.apply(x), x, y),
                relative_squared_error(module.apply(xh), xh, yh),
            )
            cost = GroupCost((first, last), before[0], after[0], before[1], after[1])
            self.log(
                f"healed cost of [{first}, {last}]: held-out relative squared error "
                f"{cost.heldout_before:.3f} "
                f"-> {cost.heldout_after:.3f} ({time.perf_counter() - start:.1f} s)"
            )
            self.costs[(first, last)] = cost
        return self.costs[(first, last)]
