"""Token log-probabilities: computed from logits, and written in the OpenAI API's two formats.

The numbers are the log-softmax of the model's float32 logits: the model's own distribution, before
temperature, penalties, top-k or top-p (vLLM's default; what an evaluation harness sums). A generated
token's entry is computed in float64 with runtime/evaluate.py's function (the one perplexity uses). A
prompt's (echo) are computed chunk by chunk as the scheduler prefills it, on its scorer thread, in float32
ROWS rows at a time: the exponentials over the vocabulary in float32, each row's normalizer summed in
float64 and the reported values taken in float64 from the float32 logits, so they equal the float64
log-softmax within float32 rounding (about 1e-7 nats) without a [prompt, vocab] float64 array (a
2000-token prompt's was 786 MB on SmolLM2). A prompt's first token has no logprob (nothing predicts it);
token t of the prompt is scored by the logits at position t - 1.

    entries = score_chunk(logits[n, vocab], prompt[s + 1 : s + 1 + n], top=1)  # positions s.. of a prompt
    entry = score_token(logits[vocab], token, top=5)                          # one generated token
    completion_logprobs([first_token(prompt), *entries, entry], texts)  # /v1/completions' logprobs
    chat_logprobs([entry], texts)                                       # /v1/chat/completions' logprobs
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.evaluate import log_softmax  # the arithmetic perplexity uses

FLOOR = -9999.0  # JSON has no -inf: the lowest logprob reported (as vLLM)
ROWS = 32  # prompt positions scored at once: a few MB of float32 temporaries on a 49k vocabulary


@dataclass(frozen=True)
class TokenLogprob:
    """One token, its logprob (None for a prompt's first token) and the `top` most likely tokens there."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


def _entries(logprobs: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logprobs [n, vocab] (already normalized) and the n tokens they score."""
    chosen = logprobs[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)]
    top = min(top, logprobs.shape[-1])
    if top > 0:
        best = np.argpartition(-logprobs, top - 1, axis=-1)[:, :top]
        values = np.take_along_axis(logprobs, best, axis=-1)
        order = np.argsort(-values, axis=-1, kind="stable")
        best, values = np.take_along_axis(best, order, -1), np.take_along_axis(values, order, -1)
    out = []
    for row, token in enumerate(tokens):
        pairs = tuple(zip(best[row].tolist(), values[row].tolist(), strict=True)) if top > 0 else ()
        out.append(TokenLogprob(int(token), float(chosen[row]), pairs))
    return out


def score_token(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """A generated token's entry from the logits [vocab] it was chosen from."""
    return _entries(log_softmax(logits[None]), [token], top)[0]


def score_chunk(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Entries of `tokens` from the float32 logits [len(tokens), vocab] of the positions before them (row t
    predicts tokens[t]), in float32 ROWS rows at a time (module docstring). Logits that are not finite
    raise ValueError (the request fails, not the server)."""
    if logits.shape[0] < len(tokens):
        raise ValueError(
            f"the graph returned logits for {logits.shape[0]} of {len(tokens)} prompt positions: "
            "prompt logprobs (echo) need logits at every position"
        )
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), ROWS):
        ids = np.asarray(tokens[start : start + ROWS], dtype=np.int64)
        x = np.asarray(logits[start : start + len(ids)], dtype=np.float32)
        peak = x.max(axis=-1, keepdims=True)
        total = np.exp(x - peak).sum(axis=-1, dtype=np.float64)  # float32 exponentials, float64 sum
        if not (np.isfinite(peak).all() and np.isfinite(total).all()):
            raise ValueError("the prompt's logits are not finite (NaN or inf)")
        norm = peak[:, 0].astype(np.float64) + np.log(total)  # log-sum-exp of each row
        rows = np.arange(len(ids))
        chosen = x[rows, ids].astype(np.float64) - norm
        k = min(top, x.shape[-1])
        if k > 0:
            best = np.argpartition(-x, k - 1, axis=-1)[:, :k]
            values = np.take_along_axis(x, best, axis=-1).astype(np.float64) - norm[:, None]
            order = np.argsort(-values, axis=-1, kind="stable")
            best, values = np.take_along_axis(best, order, -1), np.take_along_axis(values, order, -1)
        for row, token in enumerate(ids.tolist()):
            pairs = tuple(zip(best[row].tolist(), values[row].tolist(), strict=True)) if k > 0 else ()
            out.append(TokenLogprob(token, float(chosen[row]), pairs))
    return out


class TokenTexts:
    """Each token id's own text (the tokenizer's decode of that id alone, special tokens kept), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.tokenizer.decode([token])
        return text


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict:
    """The /v1/completions `logprobs` object. `top_logprobs` maps token text -> logprob for the most likely
    tokens, with the token itself added when it is not among them (as vLLM); text_offset counts the
    characters of the tokens before, from `offset` (the characters already sent in a stream)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = texts(entry.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry.logprob is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_value(entry.logprob))
        top = {texts(t): _value(lp) for t, lp in entry.top}
        top.setdefault(text, _value(entry.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_token(token: int, logprob: float, texts: TokenTexts) -> dict:
    text = texts(token)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """The /v1/chat/completions `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in entries:
        item = _chat_token(entry.token, entry.logprob if entry.logprob is not None else FLOOR, texts)
        item["top_logprobs"] = [_chat_token(t, lp, texts) for t, lp in entry.top]
        content.append(item)
    return {"content": content}
