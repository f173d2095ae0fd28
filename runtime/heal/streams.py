"""The original model's residual streams on calibration and held-out windows: captured with ONNX Runtime
(BlockRunner) a chunk of windows at a time; the original blocks run on other streams (the model healed so
far); and what the weights healing fits for a group read (group_input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from passes.run.block_runner import BlockRunner
from runtime.heal.pair import HealPair
from runtime.heal.parallel import pack


@dataclass
class Chunk:
    """Some token windows: the side tensors of their capture and the streams kept from it."""

    tokens: np.ndarray
    side: dict[str, np.ndarray]
    streams: dict[str, np.ndarray]
    held_out: bool


class Streams:
    """The original model's streams on calibration and held-out windows, captured chunk by chunk (as many
    windows a run as the graphs accept: pair.shape)."""

    def __init__(self, runner: BlockRunner, pair: HealPair, calib: np.ndarray, heldout: np.ndarray):
        self.runner, self.pair = runner, pair
        blocks = pair.original_blocks
        self.keep = {blocks[i].ffn_input.name for i, _ in pair.plan.groups}
        # the stream leaving a group: the cut's name (a Skip*Normalization graph's last block has no
        # named residual sum; BlockRunner names it)
        self.keep |= {runner.cuts[j].output_name for _, j in pair.groups}
        self.keep |= {blocks[i].block_input.name for i, _ in pair.groups}
        self.chunks = [self._capture(t, False) for t in pair.shape.split(calib)]
        self.chunks += [self._capture(t, True) for t in pair.shape.split(heldout)]

    def _capture(self, tokens: np.ndarray, held_out: bool) -> Chunk:
        captured = self.runner.capture(tokens, extra=sorted(self.keep), only=True)
        return Chunk(tokens, dict(self.runner.side), {n: captured[n] for n in self.keep}, held_out)

    def run_blocks(self, chunk: Chunk, stream: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Original blocks start..stop-1 on `stream`, with the chunk's side tensors."""
        self.runner.side = chunk.side
        for k in range(start, stop):
            stream = self.runner.run_block(k, stream)
        return stream

    def ffn_input(self, chunk: Chunk, block: int, stream: np.ndarray) -> np.ndarray:
        """The stream entering block `block`'s FFN when `stream` enters the block."""
        if not self.pair.original_blocks[block].attention:
            return stream
        self.runner.side = chunk.side
        return self.runner.run_attention(block, stream)


    def group_input(self, chunk: Chunk, group: tuple[int, int], entering: np.ndarray | None) -> np.ndarray:
        """What the weights healing fits for `group` read when `entering` enters block `group[0]` (None: the
        original's stream): an FFN group, the stream entering its FFNs; a parallel group, that stream x and
        every member's h_k = x + a_k (the original block's attention run on x), packed (parallel.pack)."""
        first, last = group
        blocks = self.pair.original_blocks
        if not self.pair.is_parallel(group):
            if entering is None:
                return chunk.streams[blocks[first].ffn_input.name]
            return self.ffn_input(chunk, first, entering)
        x = chunk.streams[blocks[first].block_input.name] if entering is None else entering
        return pack(x, [self.ffn_input(chunk, k, x) for k in range(first, last + 1)])


def token_rows(arrays: Sequence[np.ndarray], dims: int = 1) -> np.ndarray:
    """Streams [..., hidden] as one float32 matrix of token rows; with dims=2, packed inputs
    [..., 1 + n, hidden] (parallel.pack) as token rows [N, 1 + n, hidden]."""
    return np.concatenate([a.reshape(-1, *a.shape[-dims:]) for a in arrays]).astype(np.float32)
