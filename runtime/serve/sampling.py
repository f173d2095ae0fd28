"""Next-token choice per request: greedy at temperature 0, else temperature + nucleus (top_p) sampling.

Each request owns its random generator (seeded by the request's `seed`), so a seeded request draws the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sampler:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(probs[order]), self.top_p)) + 1
            kept = order[:keep]
            return int(kept[self.rng.choice(keep, p=probs[kept] / probs[kept].sum())])
        return int(self.rng.choice(probs.size, p=probs))
