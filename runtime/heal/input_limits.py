"""What the graphs being healed accept: how many token windows one run may hold (a static batch dim, e.g.
the fixed 1 many exporters write) and how long a window must be (a static sequence dim), read from the
graph inputs (passes.graph_inputs) of every model involved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from passes.errors import UserError
from passes.graph_inputs import Signature

WINDOWS_PER_RUN = 8  # windows per whole-model run when the graphs allow any batch (bounds the memory held)
DEFAULT_WINDOW = 128  # tokens per window when no graph fixes the sequence length


@dataclass(frozen=True)
class RunShape:
    """Windows per run and the sequence length every graph accepts (None: any)."""

    batch: int
    static_batch: int | None  # the batch dim some graph fixes, or None
    seq: int | None
    source: Path | None = None  # the graph that fixes the sequence length

    @classmethod
    def of(cls, paths: Sequence[str | Path]) -> RunShape:
        signatures = [(Path(p), Signature.of(p)) for p in paths]
        fixed = [s.batch for _, s in signatures if s.batch is not None]
        static_batch = min(fixed) if fixed else None
        seqs = {(s.fixed_seq, p) for p, s in signatures if s.fixed_seq is not None}
        if len({n for n, _ in seqs}) > 1:
            fixed = ", ".join(f"{p}: {n}" for n, p in sorted(seqs))
            raise UserError(f"the models fix different sequence lengths ({fixed}); export them alike")
        seq, source = min(seqs) if seqs else (None, None)
        batch = WINDOWS_PER_RUN if static_batch is None else min(WINDOWS_PER_RUN, static_batch)
        return cls(batch, static_batch, seq, source)

    def window(self, requested: int | None) -> int:
        """The window length: `requested` (--window), else the graph's fixed length, else DEFAULT_WINDOW.
        A graph with a fixed sequence length takes windows of exactly that length."""
        if self.seq is None:
            return requested or DEFAULT_WINDOW
        if requested not in (None, self.seq):
            shorter = "shorter than" if self.seq < requested else "other than"
            raise UserError(
                f"{self.source} takes exactly {self.seq} tokens per sequence, {shorter} the window of "
                f"{requested}: pass --window {self.seq} (or export the model with a dynamic sequence length)"
            )
        return self.seq

    def split(self, tokens: np.ndarray) -> list[np.ndarray]:
        """Token windows [n, length] in runs of `batch` windows."""
        return [tokens[s : s + self.batch] for s in range(0, len(tokens), self.batch)]

    def describe(self, windows: int) -> str:
        """The progress line that says how the windows are run."""
        runs = -(-windows // self.batch)
        if self.static_batch is None:
            return f"{windows} windows in {runs} runs of up to {self.batch}"
        return (
            f"the graph fixes its batch at {self.static_batch}: {windows} windows run {self.batch} at a "
            f"time ({runs} runs)"
        )
