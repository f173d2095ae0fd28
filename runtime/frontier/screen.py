"""What a plan costs on calibration tokens, computed cheaply without fusing: the original model runs once
(passes/run/block_runner.py keeps every block's input stream); a plan's model is then the original
stream up to its first group, each FFN group as passes/reference.py's independent parallel sum of its
FFNs (in the plan's norm mode), each parallel group as the sum of its blocks' branches on one input, the
blocks between them and the tail run by ONNX Runtime. The cost is KL(original || plan) on the final
logits, nats per position. Used to rank moves (each alone) and to show where their costs do not add up
(a whole plan, the same tokens)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from passes.graph_inputs import Signature
from passes.plan import Plan
from passes.reference import parallel_blocks_sum, parallel_sum
from passes.run.block_runner import BlockRunner
from runtime.evaluate import kl_total
from runtime.frontier.measure import model_key


@dataclass
class _Chunk:
    """The original on one run's windows: the stream entering each block, the side tensors, the logits."""

    inputs: list[np.ndarray]
    side: dict[str, np.ndarray]
    logits: np.ndarray


class Screener:
    """The original model on `tokens`, captured once; `kl(plan)` runs only the blocks a plan changes and
    those after them."""

    def __init__(self, model: Path, tokens: np.ndarray):
        self.runner = BlockRunner(model, threads=1)
        self.blocks = self.runner.blocks
        step = Signature.of(model).batch_size(len(tokens))  # a graph that fixes its batch: that many at once
        self.chunks: list[_Chunk] = []
        for start in range(0, len(tokens), step):
            outputs = self.runner.capture(tokens[start : start + step], extra=self.runner.tail_inputs())
            inputs = [outputs[c.input_name] for c in self.runner.cuts]  # the stream entering each block
            self.chunks.append(_Chunk(inputs, dict(self.runner.side), self.runner.logits))
        self.positions = int(np.prod(tokens.shape))
        self.runs = 0

    def kl(self, plan: Plan) -> float:
        starts = {i: ("ffn", j) for i, j in plan.groups} | {i: ("parallel", j) for i, j in plan.parallel}
        if not starts:
            return 0.0
        self.runs += 1
        total = 0.0
        for chunk in self.chunks:
            self.runner.side = chunk.side
            total += kl_total(chunk.logits, self._variant(starts, chunk.inputs, plan.norm))
        return total / self.positions

    def _variant(self, starts: dict[int, tuple[str, int]], inputs: list[np.ndarray], norm: str) -> np.ndarray:
        """The plan's logits: the original stream up to its first group, then its groups and the blocks
        between them."""
        k = min(starts)
        x = inputs[k]
        while k < len(self.blocks):
            if k not in starts:
                x, k = self.runner.run_block(k, x), k + 1
                continue
            kind, j = starts[k]
            members = self.blocks[k : j + 1]
            if kind == "ffn":
                ffn_in = x if members[0].attention_kind == "none" else self.runner.run_attention(k, x)
                y = parallel_sum(ffn_in, members, norm)
            else:
                y = parallel_blocks_sum(x, [self.runner.run_branches(m, x) for m in range(k, j + 1)])
            x, k = y.astype(x.dtype), j + 1
        return self.runner.run_tail(x)

    def close(self) -> None:
        self.runner.close()


class PlanCosts:
    """Calibration KL of plans, screened on demand and kept in one JSON file per model and token set
    (`cache`), so that a second run screens nothing."""

    def __init__(self, model: Path, tokens: np.ndarray, cache: Path):
        digest = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:12]
        self.file = cache / f"costs-{model_key(model)}-{digest}.json"
        self.values: dict[str, float] = json.loads(self.file.read_text()) if self.file.exists() else {}
        self.model, self.tokens = model, tokens
        self._screener: Screener | None = None

    def known(self, plan: Plan) -> bool:
        return plan.to_json() in self.values

    def __call__(self, plan: Plan) -> float:
        key = plan.to_json()
        if key not in self.values:
            if self._screener is None:  # the original runs only when some plan is not cached
                self._screener = Screener(self.model, self.tokens)
            self.values[key] = self._screener.kl(plan)
        return self.values[key]

    def save(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.file.write_text(json.dumps(self.values, indent=0) + "\n")

    def close(self) -> None:
        self.save()
        if self._screener is not None:
            self._screener.close()
            self._screener = None
