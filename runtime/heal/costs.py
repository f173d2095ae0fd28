"""Healed costs of candidate groups of an unfused model: the error a group would keep after healing, for
passes/analysis/propose.py's `healed_cost` (tools/analyze.py --heal)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from passes.run.block_runner import BlockRunner
from runtime.heal.ffn import concatenated
from runtime.heal.fit import refit_down, relative_squared_error
from runtime.heal.input_limits import RunShape
from runtime.heal.metadata import HealConfig
from runtime.heal.streams import token_rows


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
        shape = RunShape.of([model])
        shape.window(calib.shape[-1])  # a graph with a fixed sequence length: one line naming --window
        self.streams = [
            (held, self.runner.capture(tokens, extra=names, only=True))
            for held, data in ((False, calib), (True, heldout))
            for tokens in shape.split(data)
        ]
        self.runner.close()
        self.costs: dict[tuple[int, int], GroupCost] = {}

    def _rows(self, name: str, held: bool) -> np.ndarray:
        return token_rows([c[name] for h, c in self.streams if h == held])

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
