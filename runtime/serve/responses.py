"""Responses in the OpenAI formats: what each choice of a request produced, as a whole body or as chunks.

A `Choice` turns its scheduler request's events into updates (text piece, logprob entries, finish reason):
text through protocol.TextStream (stop strings, whole UTF-8 characters; the text of an end-of-sequence or
stop_token_ids token is left out), an echoed prompt in front of the first update, and the prompt's (chunk by
chunk, before the tokens') and the tokens' logprob entries when the request asked for them. `Reply` writes
those updates as the /v1/completions or /v1/chat/completions body (`whole`) or stream chunks (`opening`,
`chunk`, `usage_chunk`); choices carry `index` in prompt-major order (prompt i, sample j -> i * n + j).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.serve.logprobs import TokenLogprob, TokenTexts, chat_logprobs, completion_logprobs
from runtime.serve.protocol import TextStream
from runtime.serve.scheduler import Event, GenerationRequest


@dataclass
class Update:
    text: str
    entries: list[TokenLogprob]
    reason: str | None  # "stop" or "length" when the choice ends here


@dataclass(eq=False)
class Choice:
    """One choice: its request in the scheduler and what has come back so far."""

    index: int
    job: GenerationRequest
    text: TextStream
    echo: str = ""  # returned before the completion (echo); prompt entries come with it
    logprobs: bool = False  # whether entries are reported
    prompt_scored: bool = False  # a "prompt" event came (the echo's entries go out as they come)
    finish: str | None = None
    tokens: int = 0  # completion tokens (usage)
    offset: int = 0  # characters of the token texts reported so far (text_offset)
    started: bool = False

    def take(self, event: Event) -> Update | None:
        """The update an event makes (None: nothing to send yet); error events are the caller's."""
        entries: list[TokenLogprob] = []
        piece, reason = "", None
        if event.kind == "prompt":  # one event per prefilled chunk; the first token has no logprob
            first = [] if self.prompt_scored else [TokenLogprob(self.job.prompt[0])]
            self.prompt_scored = True
            entries = [*first, *event.prompt] if self.logprobs else []
        elif event.kind == "token":
            self.tokens += 1
            if event.logprob is not None and self.logprobs:
                entries.append(event.logprob)
            if not event.stop:
                piece, stopped = self.text.push(event.token)
                reason = "stop" if stopped else None
        elif event.kind == "done":
            piece, reason = self.text.flush(), event.reason
        if not self.started:
            self.started = True
            piece = self.echo + piece
        if reason is not None:
            self.finish = reason
        if not (piece or entries or reason):
            return None
        return Update(piece, entries, reason)


class Reply:
    """Response bodies and stream chunks of one request, in the OpenAI formats."""

    def __init__(self, kind: str, model: str, prompt_tokens: int, texts: TokenTexts) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.model, self.created = model, int(time.time())
        self.prompt_tokens = prompt_tokens
        self.texts = texts
        self.choices: list[Choice] = []

    def usage(self) -> dict:
        completion = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, choice: Choice, entries: Sequence[TokenLogprob]) -> dict | None:
        if not choice.logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.texts)
        body = completion_logprobs(entries, self.texts, choice.offset)
        choice.offset += sum(len(t) for t in body["tokens"])
        return body

    def whole(self, results: dict[Choice, tuple[str, list[TokenLogprob]]]) -> dict:
        """The body of a request that is not streamed, from each choice's text and entries."""
        bodies = []
        for choice in self.choices:
            text, entries = results[choice]
            logprobs = self._logprobs(choice, entries)
            if self.chat:
                message = {"role": "assistant", "content": text}
                body = {"index": choice.index, "message": message, "finish_reason": choice.finish}
            else:
                body = {"index": choice.index, "text": text, "finish_reason": choice.finish}
            bodies.append({**body, "logprobs": logprobs})
        return {**self._head(False), "choices": bodies, "usage": self.usage()}

    def opening(self) -> list[dict]:
        """A chat stream starts with the assistant role for each choice (as OpenAI's does)."""
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [
            {
                **self._head(True),
                "choices": [{"index": c.index, "delta": delta, "finish_reason": None, "logprobs": None}],
            }
            for c in self.choices
        ]

    def chunk(self, choice: Choice, update: Update) -> dict:
        logprobs = self._logprobs(choice, update.entries)
        if self.chat:
            delta = {"content": update.text} if update.text else {}
            body = {"index": choice.index, "delta": delta, "finish_reason": update.reason}
        else:
            body = {"index": choice.index, "text": update.text, "finish_reason": update.reason}
        return {**self._head(True), "choices": [{**body, "logprobs": logprobs}]}

    def usage_chunk(self) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage()}
