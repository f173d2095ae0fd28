"""The OpenAI API's request bodies (pydantic), its error JSON, and incremental text with stop strings."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4  # as the OpenAI API
MAX_LOGPROBS = 5  # /v1/completions' `logprobs` (as OpenAI and vLLM)
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' `top_logprobs`
# Fields the service does not implement: accepted only at these (default) values, else 400 naming them.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "prompt_logprobs": (None,),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
}


class FieldError(ValueError):
    """A bad value of one request field (the error JSON's `param` names it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's sampling parameters included).
    Unknown fields are ignored; the fields of UNSUPPORTED are refused unless at their defaults."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] = Field(default_factory=list)
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes (benchmarks)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, defaults in UNSUPPORTED.items():
                if name in data and not any(data[name] == d for d in defaults):
                    raise FieldError(name, f"{name} is not supported by this server")
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return stops

    @property
    def token_limit(self) -> int | None:
        """max_tokens as sent (None: the endpoint's default)."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_count(self) -> int | None:
        """How many most likely tokens each logprobs entry lists; None: no logprobs."""
        return None


Prompt = str | list[int]


class CompletionRequest(_Generation):
    """`prompt`: a string, a list of strings, a list of token ids or a list of token-id lists (one choice
    per prompt and `n`). `echo` returns the prompt before the completion (with its logprobs when asked);
    `max_tokens` 0 with echo scores a prompt without generating."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and any(not p for p in value if isinstance(p, str | list)):
            raise ValueError("the prompt list holds an empty prompt")
        return value

    @model_validator(mode="after")
    def _scoring(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError(
                "max_tokens", "max_tokens 0 generates nothing: it needs echo (to score the prompt)"
            )
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts of the request: one per choice group, in `index` order."""
        value = self.prompt
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        return list(value)

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Generation):
    """`logprobs` (true/false) with `top_logprobs` (0-20); `echo` (vLLM's: the reply starts with the last
    message's content when that message is the assistant's) is not streamed."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _chat_combinations(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.echo and self.stream:
            raise FieldError("echo", "echo is not supported with stream for chat completions")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens or self.max_completion_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
