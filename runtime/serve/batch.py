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

Prefill, in chunks (`prefill`): each call takes the next tokens of some prompts (`Chunk`), as many as the
scheduler's token budget for that step allows (runtime/serve/scheduler.py). Whole prompts that start and end
in the call are prefilled together, left-padded from an empty cache like a decode batch; a prompt cut into
chunks keeps its own cache between calls (CachedRunner: mask and cache of one row, grown by each chunk, its
positions counted from the mask), outside the decode batch. A sequence whose prompt is done joins the
decode batch at its first decode step (one that ends at its prompt, a scoring request, never pads the
running rows to its length). A chunk's logits are the unchunked prefill's up to float summation order
(tested). A call that raises has changed nothing. A prefill graph gives logits at every prompt position:
a chunk that asks (`positions`, prompt scoring for echo) gets its positions' float32 logits back, and the
scheduler's scorer thread turns them into logprobs (runtime.serve.logprobs.score_chunk), off the model's
thread.

Row isolation, in every runner: a decode step that fails is retried one row at a time (`decode_alone`);
the rows that fail alone leave the runner and the call raises `RowsFailed`, the others go on with their
step done. When every row fails alone the error is the backend's, and it is raised as it came. A decode
that raises anything but RowsFailed has changed nothing (the caches and sequences are committed only when
every row's step is done), so `decode(tokens, isolate=False)` followed by `decode_alone(tokens)` is the
same step: runtime.serve.tp_ranks runs them as two calls, so that no rank retries alone while another
still waits in the batched step's all-reduce.

`GroupedRunner` is for graphs whose attention cannot take left padding (ONNX Runtime GenAI's
GroupQueryAttention reads each row's length from the mask and assumes its tokens start at slot 0): every
sequence keeps its own cache, and a step batches only the sequences of equal length (no padding at all).

`RecomputeRunner` serves graphs without a KV cache: every step re-runs each sequence's whole token list,
left-padded together when the graph takes an attention_mask, else in groups of equal length.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from runtime.generate import DecodeModel, left_pad

BATCH_AXIS, SEQ_AXIS = 0, 2  # of cache tensors [batch, kv_heads, past_len, head_dim]


@dataclass(frozen=True)
class Chunk:
    """The next tokens of one sequence's prompt, for a prefill call."""

    tokens: Sequence[int]
    last: bool = True  # the prompt ends here: the sequence then joins the decode batch
    positions: bool = False  # return the logits of every position of the chunk (prompt scoring)


@dataclass(frozen=True)
class Prefilled:
    """What a prefill call gives one sequence: after its prompt's last chunk the next token's logits, and
    the chunk's positions' logits when the chunk asked for them."""

    logits: np.ndarray | None  # [vocab], the last prompt position's (None before the last chunk)
    positions: np.ndarray | None = None  # [len(chunk.tokens), vocab] float32


def _prefilled(logits: np.ndarray, chunk: Chunk) -> Prefilled:
    """From one row's logits [width, vocab] of a (left-padded) prefill call holding `chunk`."""
    rows = logits[logits.shape[0] - len(chunk.tokens) :]
    positions = np.array(rows, dtype=np.float32) if chunk.positions else None
    return Prefilled(np.array(rows[-1]) if chunk.last else None, positions)


def _whole(prompts: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, Chunk]:
    return {key: Chunk(prompt) for key, prompt in prompts.items()}


def _check_whole(chunks: Mapping[Hashable, Chunk], running: Mapping[Hashable, Any]) -> None:
    if any(not c.last or k in running for k, c in chunks.items()):
        raise ValueError("this runner prefills whole prompts only (chunked is False)")


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


Step = Callable[[list[Hashable]], dict[Hashable, Any]]  # the rows' outcomes, committed by the caller


def _isolated(groups: list[list[Hashable]], step: Step, isolate: bool) -> tuple[dict, dict[Hashable, str]]:
    """`step` on each group; a group that fails is run again one row at a time (isolate) or the error is
    raised (not isolate). (done, failed); the error of the last failure when no row is done."""
    done: dict[Hashable, Any] = {}
    failed: dict[Hashable, str] = {}
    error: Exception | None = None
    for keys in groups:
        try:
            done.update(step(keys))
            continue
        except Exception as exc:  # noqa: BLE001 - retried below, or raised
            if not isolate:
                raise
            error = exc
            if len(keys) == 1:
                failed[keys[0]] = _why(exc)
                continue
        for key in keys:
            try:
                done.update(step([key]))
            except Exception as exc:  # noqa: BLE001 - this row fails alone
                failed[key], error = _why(exc), exc
    if failed and not done:
        raise error  # type: ignore[misc] - every row fails: the backend's error, not a row's
    return done, failed


class RowsFailed(Exception):
    """A batched call failed because of some rows only: `failed` maps their keys to the error (their rows
    have left the batch), `done` holds the other rows' results."""

    def __init__(self, done: dict[Hashable, np.ndarray], failed: dict[Hashable, str]) -> None:
        super().__init__(f"{len(failed)} row(s) failed: {next(iter(failed.values()), '')}")
        self.done, self.failed = done, failed


class Runner(Protocol):
    """What the scheduler drives: prefill new sequences (in chunks where `chunked`), then decode all running
    ones a step at a time. `prefill_many(prompts)` is `prefill` of whole prompts."""

    chunked: bool  # False: every chunk must be a whole prompt (last, and the sequence's first)

    def prefill(self, chunks: dict[Hashable, Chunk]) -> dict[Hashable, Prefilled]: ...

    def prefill_many(self, prompts: dict[Hashable, Sequence[int]]) -> dict[Hashable, Prefilled]: ...

    def decode(  # key -> [vocab]; isolate: a failed step is retried row by row (RowsFailed)
        self, tokens: dict[Hashable, int], isolate: bool = True
    ) -> dict[Hashable, np.ndarray]: ...

    def decode_alone(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]: ...  # row by row

    def release(self, key: Hashable) -> None: ...

    def __len__(self) -> int: ...


def runner_for(model: DecodeModel, left_padding: bool = True) -> Runner:
    if not model.cached:
        return RecomputeRunner(model)
    return CachedRunner(model) if left_padding else GroupedRunner(model)


def _trimmed(mask: np.ndarray, cache: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Without the left columns that are padding in every row."""
    real = mask.any(axis=0)
    start = int(real.argmax()) if real.any() else mask.shape[1]
    if not start:
        return mask, cache
    return mask[:, start:], {n: np.ascontiguousarray(a[:, :, start:]) for n, a in cache.items()}


def _pad_left(array: np.ndarray, width: int, axis: int) -> np.ndarray:
    if width == 0:
        return array
    pad = [(0, 0)] * array.ndim
    pad[axis] = (width, 0)
    return np.pad(array, pad)


class CachedRunner:
    """Running sequences of a decode graph with a KV cache, as one left-padded batch (module docstring)."""

    chunked = True

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.keys: list[Hashable] = []
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self.cache: dict[str, np.ndarray] = model.empty_cache(0)
        self.partial: dict[Hashable, tuple[np.ndarray, dict[str, np.ndarray]]] = {}  # prompts cut in chunks
        # prefilled rows (mask, cache) that join the batch at their first decode step: a request that ends at
        # its prompt (scoring, max_tokens 1) never pads the running rows to its length and back
        self.pending: list[tuple[list[Hashable], np.ndarray, dict[str, np.ndarray]]] = []

    def __len__(self) -> int:
        return len(self.keys) + len(self.partial) + sum(len(keys) for keys, _, _ in self.pending)

    def prefill_many(self, prompts: dict[Hashable, Sequence[int]]) -> dict[Hashable, Prefilled]:
        return self.prefill(_whole(prompts))

    def prefill(self, chunks: dict[Hashable, Chunk]) -> dict[Hashable, Prefilled]:
        """Whole prompts as one left-padded batch from an empty cache; each other chunk on its prompt's own
        cache (one row). Committed when every forward is done: sequences whose prompt ended join the batch at
        their first decode step."""
        whole = [k for k, c in chunks.items() if c.last and k not in self.partial]
        out: dict[Hashable, Prefilled] = {}
        joining: list[tuple[list[Hashable], np.ndarray, dict[str, np.ndarray]]] = []
        partial: dict[Hashable, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
        if whole:
            ids, mask = left_pad([chunks[k].tokens for k in whole])
            logits, cache = self.model.forward(ids, mask, self.model.empty_cache(len(whole)))
            out.update((k, _prefilled(logits[row], chunks[k])) for row, k in enumerate(whole))
            joining.append((whole, mask, cache))
        for key in [k for k in chunks if k not in out]:
            chunk = chunks[key]
            past_mask, past = self.partial.get(key) or (np.zeros((1, 0), np.int64), self.model.empty_cache(1))
            ids = np.asarray([chunk.tokens], dtype=np.int64)
            mask = np.concatenate([past_mask, np.ones_like(ids)], axis=1)
            logits, cache = self.model.forward(ids, mask, past)
            out[key] = _prefilled(logits[0], chunk)
            if chunk.last:
                joining.append(([key], mask, cache))
            else:
                partial[key] = (mask, cache)
        for key in chunks:
            self.partial.pop(key, None)
        self.partial.update(partial)
        self.pending.extend(joining)
        return out

    def _join_pending(self) -> None:
        for keys, mask, cache in self.pending:
            self._join(keys, mask, cache)
        self.pending = []

    def _join(self, keys: list[Hashable], mask: np.ndarray, cache: dict[str, np.ndarray]) -> None:
        width = max(self.mask.shape[1], mask.shape[1])
        old, new = width - self.mask.shape[1], width - mask.shape[1]
        self.mask = np.concatenate([_pad_left(self.mask, old, 1), _pad_left(mask, new, 1)])
        for name, array in cache.items():
            merged = [_pad_left(self.cache[name], old, SEQ_AXIS), _pad_left(array, new, SEQ_AXIS)]
            self.cache[name] = np.concatenate(merged, axis=BATCH_AXIS)
        self.keys.extend(keys)

    def release(self, key: Hashable) -> None:
        self.partial.pop(key, None)
        for i, (keys, mask, cache) in enumerate(self.pending):
            if key in keys:
                row = keys.index(key)
                rest = _trimmed(
                    np.delete(mask, row, axis=0),
                    {n: np.delete(a, row, axis=BATCH_AXIS) for n, a in cache.items()},
                )
                self.pending[i] = ([k for k in keys if k != key], *rest)
                self.pending = [group for group in self.pending if group[0]]
                return
        if key not in self.keys:
            return
        row = self.keys.index(key)
        self.keys.pop(row)
        self.mask = np.delete(self.mask, row, axis=0)
        self.cache = {n: np.delete(a, row, axis=BATCH_AXIS) for n, a in self.cache.items()}
        self._trim()

    def _trim(self) -> None:
        self.mask, self.cache = _trimmed(self.mask, self.cache)

    def _step(self, tokens: dict[Hashable, int]) -> tuple[np.ndarray, np.ndarray]:
        if set(tokens) != set(self.keys):
            raise ValueError("decode needs exactly one new token per running sequence")
        ids = np.asarray([[tokens[k]] for k in self.keys], dtype=np.int64)
        return ids, np.concatenate([self.mask, np.ones((len(self.keys), 1), dtype=np.int64)], axis=1)

    def decode(self, tokens: dict[Hashable, int], isolate: bool = True) -> dict[Hashable, np.ndarray]:
        """One step for every running sequence: `tokens` holds each row's newest token."""
        self._join_pending()
        ids, mask = self._step(tokens)
        try:
            logits, cache = self.model.forward(ids, mask, self.cache)
        except Exception:
            if not isolate or len(self.keys) < 2:
                raise
            return self.decode_alone(tokens)
        self.mask, self.cache = mask, cache
        return {k: logits[row, -1] for row, k in enumerate(self.keys)}

    def decode_alone(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        """The step one row at a time (its own left padding kept: the same arithmetic); the rows that fail
        leave the batch (RowsFailed)."""
        self._join_pending()
        ids, mask = self._step(tokens)
        if not self.keys:
            return {}

        def step(keys: list[Hashable]) -> dict[Hashable, Any]:
            row = self.keys.index(keys[0])
            part = {n: a[row : row + 1] for n, a in self.cache.items()}
            logits, cache = self.model.forward(ids[row : row + 1], mask[row : row + 1], part)
            return {keys[0]: (logits[0, -1], cache)}

        done, failed = _isolated([[k] for k in self.keys], step, isolate=True)
        kept = [row for row, k in enumerate(self.keys) if k in done]
        caches = [done[self.keys[row]][1] for row in kept]
        self.keys = [self.keys[r] for r in kept]
        self.mask = mask[kept]
        self.cache = {n: np.concatenate([c[n] for c in caches], axis=BATCH_AXIS) for n in caches[0]}
        self._trim()
        logits = {k: out[0] for k, out in done.items()}
        if failed:
            raise RowsFailed(logits, failed)
        return logits


class GroupedRunner:
    """Sequences with their own caches; each step runs one batch per distinct length (no padding). A prompt
    cut in chunks grows its own cache chunk by chunk (GenAI's GroupQueryAttention takes a multi-token step
    on a past: checked equal to the whole prompt's logits on the corpus' GenAI export)."""

    chunked = True

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.caches: dict[Hashable, dict[str, np.ndarray]] = {}
        self.lengths: dict[Hashable, int] = {}
        self.partial: dict[Hashable, tuple[dict[str, np.ndarray], int]] = {}  # prompts cut in chunks

    def __len__(self) -> int:
        return len(self.caches) + len(self.partial)

    def prefill_many(self, prompts: dict[Hashable, Sequence[int]]) -> dict[Hashable, Prefilled]:
        return self.prefill(_whole(prompts))

    def prefill(self, chunks: dict[Hashable, Chunk]) -> dict[Hashable, Prefilled]:
        """Whole prompts in one batch per distinct length (no padding); each other chunk on its prompt's own
        cache. Committed when every forward is done."""
        groups: dict[int, list[Hashable]] = {}
        for key, chunk in chunks.items():
            if chunk.last and key not in self.partial:
                groups.setdefault(len(chunk.tokens), []).append(key)
        out: dict[Hashable, Prefilled] = {}
        done: dict[Hashable, tuple[dict[str, np.ndarray], int]] = {}
        for length, keys in groups.items():
            ids = np.asarray([chunks[k].tokens for k in keys], dtype=np.int64)
            logits, cache = self.model.forward(ids, np.ones_like(ids), self.model.empty_cache(len(keys)))
            for row, key in enumerate(keys):
                done[key] = ({n: a[row : row + 1] for n, a in cache.items()}, length)
                out[key] = _prefilled(logits[row], chunks[key])
        for key in [k for k in chunks if k not in out]:
            chunk = chunks[key]
            past, length = self.partial.get(key) or (self.model.empty_cache(1), 0)
            ids = np.asarray([chunk.tokens], dtype=np.int64)
            logits, cache = self.model.forward(ids, np.ones((1, length + ids.shape[1]), np.int64), past)
            out[key] = _prefilled(logits[0], chunk)
            done[key] = (cache, length + ids.shape[1])
        for key, (cache, length) in done.items():
            self.partial.pop(key, None)
            if chunks[key].last:
                self.caches[key], self.lengths[key] = cache, length
            else:
                self.partial[key] = (cache, length)
        return out

    def release(self, key: Hashable) -> None:
        self.partial.pop(key, None)
        self.caches.pop(key, None)
        self.lengths.pop(key, None)

    def decode(self, tokens: dict[Hashable, int], isolate: bool = True) -> dict[Hashable, np.ndarray]:
        """One batch per distinct length; a batch that fails is retried row by row (isolate)."""
        groups: dict[int, list[Hashable]] = {}
        for key in tokens:
            groups.setdefault(self.lengths[key], []).append(key)
        return self._commit(*_isolated(list(groups.values()), self._stepper(tokens), isolate))

    def decode_alone(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        return self._commit(*_isolated([[k] for k in tokens], self._stepper(tokens), isolate=True))

    def _stepper(self, tokens: dict[Hashable, int]) -> Step:
        def step(keys: list[Hashable]) -> dict[Hashable, Any]:
            length = self.lengths[keys[0]]
            ids = np.asarray([[tokens[k]] for k in keys], dtype=np.int64)
            cache = {n: np.concatenate([self.caches[k][n] for k in keys]) for n in self.caches[keys[0]]}
            logits, cache = self.model.forward(ids, np.ones((len(keys), length + 1), np.int64), cache)
            rows = enumerate(keys)
            return {k: (logits[row, -1], {n: a[row : row + 1] for n, a in cache.items()}) for row, k in rows}

        return step

    def _commit(self, done: dict[Hashable, Any], failed: dict[Hashable, str]) -> dict[Hashable, np.ndarray]:
        """Every row's step at once (a step that raises changed nothing); the failed rows leave."""
        for key, (_, cache) in done.items():
            self.caches[key] = cache
            self.lengths[key] += 1
        for key in failed:
            self.release(key)
        logits = {k: out[0] for k, out in done.items()}
        if failed:
            raise RowsFailed(logits, failed)
        return logits


class RecomputeRunner:
    """Sequences of a graph without a KV cache: each step re-runs every sequence in full."""

    chunked = False

    def __init__(self, model: DecodeModel) -> None:
        self.model = model
        self.sequences: dict[Hashable, list[int]] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def prefill_many(self, prompts: dict[Hashable, Sequence[int]]) -> dict[Hashable, Prefilled]:
        return self.prefill(_whole(prompts))

    def prefill(self, chunks: dict[Hashable, Chunk]) -> dict[Hashable, Prefilled]:
        """Whole prompts only (`chunked` is False: every step re-runs the whole sequence anyway)."""
        _check_whole(chunks, self.sequences)
        sequences = {k: [int(t) for t in c.tokens] for k, c in chunks.items()}
        step, rows = self._stepper(sequences), {}
        for group in self._groups(sequences):
            rows.update(step(group))
        self.sequences.update(sequences)
        return {k: _prefilled(rows[k], chunks[k]) for k in chunks}

    def release(self, key: Hashable) -> None:
        self.sequences.pop(key, None)

    def decode(self, tokens: dict[Hashable, int], isolate: bool = True) -> dict[Hashable, np.ndarray]:
        """Every sequence again with its new token; a batch that fails is retried row by row (isolate)."""
        grown = {k: [*self.sequences[k], int(t)] for k, t in tokens.items()}
        return self._commit(grown, *_isolated(self._groups(grown), self._stepper(grown), isolate))

    def decode_alone(self, tokens: dict[Hashable, int]) -> dict[Hashable, np.ndarray]:
        grown = {k: [*self.sequences[k], int(t)] for k, t in tokens.items()}
        return self._commit(grown, *_isolated([[k] for k in grown], self._stepper(grown), isolate=True))

    def _commit(
        self, grown: dict[Hashable, list[int]], done: dict[Hashable, np.ndarray], failed: dict[Hashable, str]
    ) -> dict[Hashable, np.ndarray]:
        for key in done:
            self.sequences[key] = grown[key]
        for key in failed:
            self.release(key)
        logits = {k: rows[-1] for k, rows in done.items()}
        if failed:
            raise RowsFailed(logits, failed)
        return logits

    def _groups(self, sequences: Mapping[Hashable, list[int]]) -> list[list[Hashable]]:
        """Without a mask input only sequences of one length can share a batch."""
        groups: dict[int, list[Hashable]] = {}
        for key, tokens in sequences.items():
            groups.setdefault(0 if self.model.has_mask else len(tokens), []).append(key)
        return list(groups.values())

    def _stepper(self, sequences: Mapping[Hashable, list[int]]) -> Step:
        """Each sequence's logits [positions, vocab] (its row of a left-padded batch, padding included)."""

        def step(keys: list[Hashable]) -> dict[Hashable, Any]:
            ids, mask = left_pad([sequences[k] for k in keys])
            logits, _ = self.model.forward(ids, mask, None)
            return {k: logits[row] for row, k in enumerate(keys)}

        return step
