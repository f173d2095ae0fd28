"""Dependency statistics of a decoder's blocks (paper sections 3 and 5.4), measured with ONNX Runtime.

Definitions (all means are over tokens; "cos" is the cosine over the hidden dimension of one token):

- dependency[i][j] (i < j): mean of 1 - cos(h_j, h~_j), where h_j is block j's output minus its input in
  the unchanged model and h~_j the same with block i skipped entirely (attention and FFN); None where
  i >= j. A pair of zero vectors counts as distance 0.
- io_cosine_distance: mean of 1 - cos(block input, block output);
- residual_norm_ratio: mean of ||output - input|| / ||input||.
Block input is the residual stream entering the block (before its attention), block output the stream
after its last part (passes/run/cut.py): an FFN-free block is its attention part, an identity block
changes nothing.

How: BlockRunner (passes/run/) runs the model's blocks one at a time. Skipping block i does not
change the stream before it, so row i starts from the stored input of block i and runs blocks i+1..N-1
forward: N(N-1)/2 block evaluations for the whole matrix, plus N for the unchanged chain.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from passes.errors import UserError
from passes.run.block_runner import BlockRunner

# The block-by-block chain must reproduce the whole model's last stream to this relative error.
CHAIN_TOLERANCE = 1e-3


def _rows(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over tokens of 1 - cos(a_t, b_t); a pair of zero vectors counts as 0."""
    a, b = _rows(a), _rows(b)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dots = np.einsum("td,td->t", a, b)
    both_zero = (na == 0) & (nb == 0)
    cos = np.where(both_zero, 1.0, dots / np.maximum(na * nb, 1e-300))
    return float(np.mean(np.clip(1.0 - cos, 0.0, 2.0)))  # clip: rounding of identical vectors


def norm_ratio(delta: np.ndarray, x: np.ndarray) -> float:
    """Mean over tokens of ||delta_t|| / ||x_t||."""
    return float(
        np.mean(np.linalg.norm(_rows(delta), axis=1) / np.maximum(np.linalg.norm(_rows(x), axis=1), 1e-300))
    )


@dataclass
class BlockStats:
    """One block's statistics: how much it changes the stream it reads."""

    index: int  # the block number (the source layer, docs/design.md §2)
    attention: bool
    ffn_width: int  # 0: no SwiGLU FFN
    io_cosine_distance: float
    residual_norm_ratio: float

    def row(self) -> dict:
        return {
            "index": self.index,
            "attention": self.attention,
            "ffn_width": self.ffn_width,
            "io_cosine_distance": self.io_cosine_distance,
            "residual_norm_ratio": self.residual_norm_ratio,
        }


@dataclass
class Analysis:
    """The block statistics and dependency matrix of one model on one set of tokens."""

    blocks: list[BlockStats]
    dependency: np.ndarray  # N x N, NaN where i >= j
    tokens: int
    seconds: float
    block_evaluations: int
    chain_rel_error: float  # block-by-block chain vs whole-model run, last stream

    def dependency_json(self) -> list[list[float | None]]:
        return [[None if np.isnan(v) else float(v) for v in row] for row in self.dependency]

    def to_json(self) -> dict:
        return {
            "blocks": [b.row() for b in self.blocks],
            "dependency": self.dependency_json(),
            "tokens": self.tokens,
            "seconds_block_evaluations": round(self.seconds, 2),
            "block_evaluations": self.block_evaluations,
            "chain_rel_error": self.chain_rel_error,
        }


def analyze(
    model_path: str | Path,
    tokens: np.ndarray,
    rows: Iterable[int] | None = None,
    progress: bool = True,
    runner: BlockRunner | None = None,
) -> Analysis:
    """Block statistics and the dependency matrix of the model at `model_path` on `tokens` ([batch, seq]).

    `rows` limits which rows i of the matrix are computed (default: all); others stay NaN.
    """
    start = time.perf_counter()
    runner = runner or BlockRunner(model_path)
    n = len(runner.blocks)
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size == 0:
        raise UserError("no tokens to analyze")
    if tokens.min() < 0 or tokens.max() >= runner.vocab:
        raise UserError(f"token ids must lie in 0..{runner.vocab - 1} (the model's vocabulary)")
    captured = runner.capture(tokens)
    rows = list(range(n)) if rows is None else sorted(set(rows))
    total = n + sum(n - 1 - i for i in rows)
    bar = tqdm(total=total, desc="block evaluations", unit="blk", disable=not progress, leave=False)
    # The unchanged chain, block by block, from the embedding output.
    inputs, outputs, deltas = [], [], []
    x = captured[runner.cuts[0].input_name]
    for k in range(n):
        y = runner.run_block(k, x)
        inputs.append(x)
        outputs.append(y)
        deltas.append(y - x)
        x = y
        bar.update()
    whole = captured[runner.cuts[-1].output_name]
    chain_error = float(np.linalg.norm(x.astype(np.float64) - whole) / max(np.linalg.norm(whole), 1e-30))
    if chain_error > CHAIN_TOLERANCE:
        bar.close()
        raise UserError(
            f"running the model block by block does not reproduce it (relative error {chain_error:.3g}); "
            "the block cut missed a tensor"
        )
    stats = [
        BlockStats(
            runner.blocks[k].index,
            runner.cuts[k].attention,
            runner.cuts[k].width,
            cosine_distance(inputs[k], outputs[k]),
            norm_ratio(deltas[k], inputs[k]),
        )
        for k in range(n)
    ]
    dependency = np.full((n, n), np.nan)
    if runner.streaming:  # column by column, so that each block's weights are loaded once
        streams = {i: inputs[i] for i in rows}  # block i skipped: block i+1 reads block i's input
        for j in range(n):
            for i in (r for r in rows if r < j):
                y = runner.run_block(j, streams[i])
                dependency[i, j] = cosine_distance(deltas[j], y - streams[i])
                streams[i] = y
                bar.update()
    else:
        for i in rows:
            x = inputs[i]  # block i skipped: block i+1 reads block i's input
            for j in range(i + 1, n):
                y = runner.run_block(j, x)
                dependency[i, j] = cosine_distance(deltas[j], y - x)
                x = y
                bar.update()
    bar.close()
    return Analysis(stats, dependency, int(tokens.size), time.perf_counter() - start, total, chain_error)
