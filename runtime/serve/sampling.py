"""Next-token choice per request, with vLLM's sampling parameters and in vLLM's order:

1. penalties on the logits: `repetition_penalty` (tokens of the prompt or the output: positive logits
   divided by it, negative ones multiplied), then `frequency_penalty` (times the token's count in the
   output) and `presence_penalty` (once per token present in the output) subtracted;
2. `banned` tokens (end-of-sequence and stop_token_ids before `min_tokens`) get -inf;
3. temperature 0: the most likely token (greedy); else logits / temperature, then `min_p` (drop tokens less
   likely than min_p times the most likely one), `top_k` (keep the k most likely; 0 or -1: all) and
   `top_p` (the smallest set whose mass reaches top_p), and one draw.

Faults stay with their request: the request's own impossibility (every token banned) raises `NoTokenAllowed`
(a client error), logits or probabilities that are not finite raise `SamplingError` (the scheduler fails
that request alone). The API's ranges keep the arithmetic finite for finite logits: a temperature below
MIN_TEMPERATURE is greedy (as vLLM: dividing by 1e-308 overflows), repetition_penalty is at least 0.01.

Each request owns its random generator (seeded by the request's `seed`), so a seeded request draws the
same tokens whatever else shares its batch. Logprobs are not this module's business: they are the model's
own distribution (runtime.serve.logprobs), whatever the sampler does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: below it, sampling is greedy


class SamplingError(ArithmeticError):
    """No distribution to draw from (logits or probabilities that are not finite)."""


class NoTokenAllowed(ValueError):
    """The request banned every token (stop_token_ids and end-of-sequence ids before min_tokens)."""


@dataclass
class Sampler:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | Sequence[int] | None = None
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.seed
        if seed is not None:  # any int64 the API allows (numpy takes only non-negative ones)
            seed = [s % 2**64 for s in ([seed] if isinstance(seed, int) else seed)]
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __call__(
        self,
        logits: np.ndarray,
        prompt: Sequence[int] = (),
        output: Sequence[int] = (),
        banned: Collection[int] = (),
    ) -> int:
        scores = logits.astype(np.float64)
        if np.isnan(scores).any():
            raise SamplingError("the model's logits hold NaN")
        if self.penalized:
            scores = self._penalize(scores, prompt, output)
        if banned:
            scores[list(banned)] = -np.inf
        best = scores.max()
        if best == -np.inf and banned and np.isfinite(logits).any():
            raise NoTokenAllowed("stop_token_ids and end-of-sequence ids ban every token before min_tokens")
        if not np.isfinite(best):
            raise SamplingError(f"the model's logits are not finite (largest {best})")
        if self.greedy:
            return int(np.argmax(scores))
        scaled = scores / self.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if not np.isfinite(probs).all():
            raise SamplingError(f"the probabilities are not finite (temperature {self.temperature})")
        if self.min_p > 0.0:
            probs[probs < self.min_p * probs.max()] = 0.0
        if 0 < self.top_k < probs.size:
            probs[np.argsort(-probs, kind="stable")[self.top_k :]] = 0.0
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            mass = np.cumsum(probs[order]) / probs.sum()
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            probs[order[int(np.searchsorted(mass, self.top_p)) + 1 :]] = 0.0
        return int(self.rng.choice(probs.size, p=probs / probs.sum()))

    def _penalize(self, scores: np.ndarray, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=scores.size)[: scores.size]
        if self.repetition_penalty != 1.0:
            seen = counts > 0
            seen[np.asarray(prompt, dtype=np.int64)] = True
            p = self.repetition_penalty
            scores[seen] = np.where(scores[seen] > 0, scores[seen] / p, scores[seen] * p)
        return scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0)
