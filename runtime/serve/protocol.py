"""The OpenAI API's request bodies (pydantic), its error JSON, and incremental text with stop strings."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4  # as the OpenAI API


class ApiError(Exception):
    """An error answered as OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes (benchmarks)
    # accepted only at their defaults (the service does not implement them)
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return stops

    @model_validator(mode="after")
    def _supported(self) -> _Generation:
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of several prompts is not supported)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class TextStream:
    """The text of the tokens generated so far, handed out in pieces that never end inside a UTF-8
    character (the tokenizer's U+FFFD) and never show any part of a stop string. `push` returns
    (new text, stopped); after a stop string the text ends just before it."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters handed out

    def push(self, token: int) -> tuple[str, bool]:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return "", False
        self.text = text
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            return self._upto(min(found)), True
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._upto(len(text) - held), False

    def flush(self) -> str:
        """The rest (a held-back stop prefix that never completed) at the end of generation."""
        return self._upto(len(self.text))

    def _upto(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece
