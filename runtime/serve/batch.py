"""Step-level batching of running sequences over one decode graph (runtime.generate.DecodeModel).

`CachedRunner` keeps the KV caches of every running sequence as ONE left-padded batch:

    mask   int64 [rows, T]                   1 = a real token of that row, 0 = left padding
    cache  name -> [rows, kv_heads, T, head_dim]

Each row is right-aligned, so every decode step feeds the batch as it is (one new token per row, a column
of ones appended to the mask) and the graph's present tensors are the next step's past: nothing is copied
between steps. A row is padded on the left only when the batch's composition changes (a sequence joins
with a different length, or leaves and the common left padding is trimmed). Padding slots have mask 0:
the decode graph gives them zero attention weight and computes positions as cumsum(mask) - 1, so a row's
logits do not depend on its neighbours (up to float summation order; greedy equality is tested).

Prefill: the sequences admitted in one scheduler iteration are prefilled together (`prefill_many`),
left-padded from an empty cache like a decode batch; their caches then join the running batch. A prefill
graph gives logits at every prompt position: for the sequences named in `scored` (echo with logprobs), the
prefill also returns their prompt tokens' logprobs (runtime.serve.logprobs.score_prompt), computed where
the logits are (in rank 0's process for a TP folder), so only the entries travel.

A decode step that fails for the whole batch is retried row by row (`RowsFailed`): the rows that fail
alone leave the batch, the others go on with their step done; when every row fails alone the error is the
backend's, and it is raised as it came.

`GroupedRunner` is for graphs whose attention cannot take left padding (ONNX Runtime GenAI's
GroupQueryAttention reads each row's length from the mask and assumes its tokens start at slot 0): every
sequence keeps its own cache, and a step batches only the sequences of equal length (no padding at all).

`RecomputeRunner` serves graphs without a KV cache: every step re-runs each sequence's whole token list,
left-padded together when the graph takes an attention_mask, else in groups of equal length.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.generate import DecodeModel, left_pad
from runtime.serve.logprobs import TokenLogprob, score_prompt

BATCH_AXIS, SEQ_AXIS = 0, 2  # of cache tensors [batch, kv_heads, past_len, head_dim]


Scored = Mapping[Hashable, int]  # key -> how many most likely tokens each prompt logprobs entry lists


@dataclass(frozen=True)
class Prefilled:
    """What a prefill gives one sequence: the next token's logits, and its prompt's logprobs when asked."""

    logits: np.ndarray  # [vocab], the last prompt position's
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (scored sequences only)


def _prefilled(logits: np.ndarray, prompt: Sequence[int], top: int | None) -> Prefilled:
    """From one row's logits [width, vocab] of a (left-padded) prefill of `prompt`."""
    scores = None if top is None else score_prompt(logits[logits.shape[0] - len(prompt) :], prompt, top)
    return Prefilled(logits[-1], scores)


class RowsFailed(Exception):
    """A batched call failed because of some rows only: `failed` maps their keys to the error (their rows
    have left the batch), `done` holds the other rows' results."""

    def __init__(self, done: dict[Hashable, np.ndarray], failed: dict[Hashable, str]) -> None:
        super().__init__(f"{len(failed)} row(s) failed: {next(iter(failed.values()), '')}")
        self.done, self.failed = done, failed


class Runner(Protocol):
    """What the scheduler drives: prefill new sequences, then decode all running ones a step at a time."""

    def prefill_many(
        self, prompts: dict[Hashable, Sequence[int]], scored: Scored | None = None
    ) -> dict[Hashable, Prefilled]: ...

    def decode(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]: ...  # key -> [vocab]

    def release(self, key: Hashable) -> None: ...

    def __len__(self) -> int: ...


def runner_for(model: DecodeModel, left_padding: bool = True) -> Runner:
    if not model.cached:
        return RecomputeRunner(model)
    return CachedRunner(model) if left_padding else GroupedRunner(model)


def _pad_left(array: np.ndarray, width: int, axis: int) -> np.ndarray:
    if width == 0:
        return array
    pad = [(0, 0)] * array.ndim
    pad[axis] = (width, 0)
    return np.pad(array, pad)


class CachedRunner:
    """Running sequences of a decode graph with a KV cache, as one left-padded batch (module docstring)."""

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.keys: list[Hashable] = []
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self.cache: dict[str, np.ndarray] = model.empty_cache(0)

    def __len__(self) -> int:
        return len(self.keys)

    def prefill_many(
        self, prompts: dict[Hashable, Sequence[int]], scored: Scored | None = None
    ) -> dict[Hashable, Prefilled]:
        """The new sequences as one left-padded batch from an empty cache; their rows join the batch."""
        keys, scored = list(prompts), scored or {}
        ids, mask = left_pad([prompts[k] for k in keys])
        logits, cache = self.model.forward(ids, mask, self.model.empty_cache(len(keys)))
        out = {k: _prefilled(logits[row], prompts[k], scored.get(k)) for row, k in enumerate(keys)}
        self._join(keys, mask, cache)
        return out

    def _join(self, keys: list[Hashable], mask: np.ndarray, cache: dict[str, np.ndarray]) -> None:
        width = max(self.mask.shape[1], mask.shape[1])
        old, new = width - self.mask.shape[1], width - mask.shape[1]
        self.mask = np.concatenate([_pad_left(self.mask, old, 1), _pad_left(mask, new, 1)])
        for name, array in cache.items():
            merged = [_pad_left(self.cache[name], old, SEQ_AXIS), _pad_left(array, new, SEQ_AXIS)]
            self.cache[name] = np.concatenate(merged, axis=BATCH_AXIS)
        self.keys.extend(keys)

    def release(self, key: Hashable) -> None:
        if key not in self.keys:
            return
        row = self.keys.index(key)
        self.keys.pop(row)
        self.mask = np.delete(self.mask, row, axis=0)
        self.cache = {n: np.delete(a, row, axis=BATCH_AXIS) for n, a in self.cache.items()}
        self._trim()

    def _trim(self) -> None:
        """Drop the left columns that are padding in every row."""
        real = self.mask.any(axis=0)
        start = int(real.argmax()) if real.any() else self.mask.shape[1]
        if start:
            self.mask = self.mask[:, start:]
            self.cache = {n: np.ascontiguousarray(a[:, :, start:]) for n, a in self.cache.items()}

    def decode(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """One step for every running sequence: `tokens` holds each row's newest token."""
        if set(tokens) != set(self.keys):
            raise ValueError("decode needs exactly one new token per running sequence")
        ids = np.asarray([[tokens[k]] for k in self.keys], dtype=np.int64)
        mask = np.concatenate([self.mask, np.ones((len(self.keys), 1), dtype=np.int64)], axis=1)
        try:
            logits, cache = self.model.forward(ids, mask, self.cache)
        except Exception:
            if len(self.keys) < 2:
                raise
            self._rows_alone(ids, mask)  # raises RowsFailed, or the error when every row fails
        self.mask, self.cache = mask, cache
        return {k: logits[row, -1] for row, k in enumerate(self.keys)}

    def _rows_alone(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """The step again, one row at a time (its own left padding kept: the same arithmetic); the rows
        that still fail leave the batch."""
        done, failed, caches, kept = {}, {}, [], []
        error: Exception | None = None
        for row, key in enumerate(self.keys):
            part = {n: a[row : row + 1] for n, a in self.cache.items()}
            try:
                logits, cache = self.model.forward(ids[row : row + 1], mask[row : row + 1], part)
            except Exception as exc:  # noqa: BLE001 - this row fails alone
                failed[key], error = f"{type(exc).__name__}: {exc}", exc
                continue
            done[key] = logits[0, -1]
            caches.append(cache)
            kept.append(row)
        if not done:
            raise error  # type: ignore[misc] - every row fails: the backend's error, not a row's
        self.keys = [self.keys[r] for r in kept]
        self.mask = mask[kept]
        self.cache = {n: np.concatenate([c[n] for c in caches], axis=BATCH_AXIS) for n in caches[0]}
        self._trim()
        raise RowsFailed(done, failed)


class GroupedRunner:
    """Sequences with their own caches; each step runs one batch per distinct length (no padding)."""

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.caches: dict[Hashable, dict[str, np.ndarray]] = {}
        self.lengths: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self.caches)

    def prefill_many(
        self, prompts: dict[Hashable, Sequence[int]], scored: Scored | None = None
    ) -> dict[Hashable, Prefilled]:
        """One batch per distinct prompt length (no padding)."""
        scored = scored or {}
        groups: dict[int, list[Hashable]] = {}
        for key, prompt in prompts.items():
            groups.setdefault(len(prompt), []).append(key)
        out = {}
        for length, keys in groups.items():
            ids = np.asarray([prompts[k] for k in keys], dtype=np.int64)
            logits, cache = self.model.forward(ids, np.ones_like(ids), self.model.empty_cache(len(keys)))
            for row, key in enumerate(keys):
                self.caches[key] = {n: a[row : row + 1] for n, a in cache.items()}
                self.lengths[key] = length
                out[key] = _prefilled(logits[row], prompts[key], scored.get(key))
        return out

    def release(self, key: Hashable) -> None:
        self.caches.pop(key, None)
        self.lengths.pop(key, None)

    def decode(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        groups: dict[int, list[Hashable]] = {}
        for key in tokens:
            groups.setdefault(self.lengths[key], []).append(key)
        out = {}
        for length, keys in groups.items():
            ids = np.asarray([[tokens[k]] for k in keys], dtype=np.int64)
            cache = {n: np.concatenate([self.caches[k][n] for k in keys]) for n in self.caches[keys[0]]}
            logits, cache = self.model.forward(ids, np.ones((len(keys), length + 1), np.int64), cache)
            for row, key in enumerate(keys):
                self.caches[key] = {n: a[row : row + 1] for n, a in cache.items()}
                self.lengths[key] = length + 1
                out[key] = logits[row, -1]
        return out


class RecomputeRunner:
    """Sequences of a graph without a KV cache: each step re-runs every sequence in full."""

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.sequences: dict[Hashable, list[int]] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def prefill_many(
        self, prompts: dict[Hashable, Sequence[int]], scored: Scored | None = None
    ) -> dict[Hashable, Prefilled]:
        scored = scored or {}
        for key, prompt in prompts.items():
            self.sequences[key] = [int(t) for t in prompt]
        rows = self._run(list(prompts))
        return {k: _prefilled(rows[k], self.sequences[k], scored.get(k)) for k in prompts}

    def release(self, key: Hashable) -> None:
        self.sequences.pop(key, None)

    def decode(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        for key, token in tokens.items():
            self.sequences[key].append(int(token))
        return {k: rows[-1] for k, rows in self._run(list(tokens)).items()}

    def _run(self, keys: list[Hashable]) -> dict[Hashable, np.ndarray]:
        """Each sequence's logits [positions, vocab] (its row of a left-padded batch, padding included)."""
        groups: dict[int, list[Hashable]] = {}
        for key in keys:  # without a mask input only sequences of one length can share a batch
            groups.setdefault(0 if self.model.has_mask else len(self.sequences[key]), []).append(key)
        out = {}
        for group in groups.values():
            ids, mask = left_pad([self.sequences[k] for k in group])
            logits, _ = self.model.forward(ids, mask, None)
            out.update({k: logits[row] for row, k in enumerate(group)})
        return out
