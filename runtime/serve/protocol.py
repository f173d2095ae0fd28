"""The OpenAI API's request bodies (pydantic), its error JSON, and incremental text with stop strings.

The bodies are validated strictly (JSON `0` is not `false`, `1.0` is not an integer) so that the server
accepts what its OpenAPI schema states; what the schema cannot state (a prompt too long for the context,
min_tokens above max_tokens, token ids outside the vocabulary) is a 400 the schema documents. Numeric
ranges keep the sampler's arithmetic finite (runtime.serve.sampling).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4  # as the OpenAI API
MAX_STOP_CHARS = 512  # per stop string: lm-eval's are a few characters; bounds the hold-back work
MAX_STOP_TOKEN_IDS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_LOGPROBS = 5  # /v1/completions' `logprobs` (as OpenAI and vLLM)
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' `top_logprobs`
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI's)
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


def _surrogates(value: Any, where: str) -> str | None:
    """The first field (dotted path) holding a string with a lone surrogate ("\\ud800" in JSON), which no
    tokenizer can encode and no UTF-8 response can carry; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for key, item in value.items():
            if (found := _surrogates(item, f"{where}.{key}" if where else str(key))) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _surrogates(item, f"{where}[{i}]")) is not None:
                return found
    return None


def _whole(value: Any) -> Any:
    """JSON Schema's integer includes 50.0 (a number with no fraction): accept it as 50, nothing else."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(ge: int | None = None, le: int | None = None, **schema: Any) -> Any:
    """A strict integer (no "50", no true; 50.0 is 50) with its bounds. The bounds come before the
    validator: after it (or on an Optional of an annotated int) pydantic writes them as `ge`/`le`, which
    JSON Schema does not read, and the OpenAPI document would allow what the server refuses."""
    return Annotated[int, Field(ge=ge, le=le, json_schema_extra=schema or None), BeforeValidator(_whole)]


Int = _int()
TokenId = _int(ge=0, **{"x-token-id": True})  # maximum: the app's vocabulary (openapi.py)
TextPrompt = Annotated[str, Field(min_length=1)]
IdsPrompt = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Generation(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's sampling parameters included).
    Unknown fields are ignored; the fields of UNSUPPORTED are refused unless at their defaults."""

    model_config = _STRICT

    model: str
    max_tokens: _int(ge=1) | None = None
    # below runtime.serve.sampling.MIN_TEMPERATURE the sampler is greedy (as vLLM)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: _int(ge=-1) = 0
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # from 0.01: a logit divided by less overflows float64 (the sampler would draw from NaN)
    repetition_penalty: float | None = Field(None, ge=0.01, le=2.0)
    seed: Int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        None, validate_default=True
    )
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: _int(ge=0) = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: _int(ge=1) = 1
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever comes (benchmarks)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if (where := _surrogates(data, "")) is not None:
                field = where.split(".")[0].split("[")[0]
                raise FieldError(field, f"{where} is not valid Unicode (a lone surrogate)")
            for name, defaults in UNSUPPORTED.items():
                if name in data and not any(data[name] == d for d in defaults):
                    raise FieldError(name, f"{name} is not supported by this server")
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        return [value] if isinstance(value, str) else list(value or [])

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
    `max_tokens` 0 with echo scores a prompt without generating (the schema states it)."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
                    "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
                }
            ]
        },
    )
    prompt: (
        TextPrompt
        | IdsPrompt
        | Annotated[list[TextPrompt], Field(min_length=1)]
        | Annotated[list[IdsPrompt], Field(min_length=1)]
    )
    max_tokens: _int(ge=0) | None = None
    echo: bool = False
    logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None

    @model_validator(mode="before")
    @classmethod
    def _empty_prompt(cls, data: Any) -> Any:
        """A clearer message than the union's four alternatives for the commonest mistake."""
        if isinstance(data, dict) and data.get("prompt") in ("", []):
            raise FieldError("prompt", "the prompt is empty")
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and any(p in ("", []) for p in prompt):
            raise FieldError("prompt", "the prompt list holds an empty prompt")
        return data

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


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are read (others are refused)."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


Content = Annotated[str, Field(min_length=1)] | Annotated[list[ContentPart], Field(min_length=1)]


class _Message(BaseModel):
    model_config = _STRICT

    name: str | None = None

    def text(self) -> str:
        content = getattr(self, "content", None)
        if isinstance(content, list):
            return "".join(p.text for p in content)
        return content or ""

    def for_template(self) -> dict[str, Any]:
        """What the chat template reads: role and text (never None), and the tool fields when present."""
        message = self.model_dump(exclude_none=True)
        message["content"] = self.text()
        return message


class InstructionMessage(_Message):
    """system, developer and user messages: content required, not empty (as OpenAI validates)."""

    role: Literal["system", "developer", "user"]
    content: Content


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _STRICT

    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Message):
    """An assistant turn of the history: its content may be null (or absent) only with tool calls."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
            ]
        },
    )

    role: Literal["assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise FieldError("messages", "an assistant message needs content or tool_calls")
        return self


ChatMessage = Annotated[InstructionMessage | ToolMessage | AssistantMessage, Field(discriminator="role")]


class ChatRequest(_Generation):
    """`logprobs` (true/false) with `top_logprobs` (0-20); `echo` (vLLM's: the reply starts with the last
    message's content when that message is the assistant's) is not streamed. The schema states both
    combinations (`top_logprobs` above 0 needs `logprobs: true`; `echo` excludes `stream: true`)."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={
            "allOf": [
                {
                    "if": {
                        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                        "required": ["top_logprobs"],
                    },
                    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
                },
                {
                    "if": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
                    "then": {"properties": {"stream": {"const": False}}},
                },
            ]
        },
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: _int(ge=0, le=MAX_TOP_LOGPROBS) | None = None
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
    (new text, stopped); after a stop string the text ends just before it.

    Linear time in the output: detokenization is incremental (vLLM's prefix/read offsets: each push decodes
    a window of the last few tokens, not the whole output), and each stop string is matched by a KMP
    automaton that reads every new character once; its state is the longest stop-string prefix the text
    ends with, which is what must be held back."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters handed out
        self.prefix = 0  # tokens[prefix:read] decode to the text already taken (the window's left context)
        self.read = 0
        self.failure = [_failure(s) for s in stops]
        self.states = [0] * len(stops)  # matched prefix length of each stop string
        self.stopped: int | None = None  # where the first complete stop string starts

    def push(self, token: int) -> tuple[str, bool]:
        self.tokens.append(token)
        if self.stopped is not None:
            return "", True
        before = self._decode(self.tokens[self.prefix : self.read])
        after = self._decode(self.tokens[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return "", False  # inside a character (or a token with no text yet)
        start = len(self.text)
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        found = []  # where each stop string completed in the new text starts (the earliest one cuts)
        for i, stop in enumerate(self.stops):
            for position in range(start, len(self.text)):
                if self._advance(i, stop, self.text[position]):
                    found.append(position + 1 - len(stop))
                    break
        if found:
            self.stopped = min(found)
            return self._upto(self.stopped), True
        return self._upto(len(self.text) - max(self.states, default=0)), False

    def flush(self) -> str:
        """The rest (a held-back stop prefix that never completed) at the end of generation."""
        return self._upto(len(self.text) if self.stopped is None else self.stopped)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""

    def _advance(self, i: int, stop: str, char: str) -> bool:
        """Feed one character to stop string i's automaton; True when the whole string matched."""
        k, failure = self.states[i], self.failure[i]
        while k and stop[k] != char:
            k = failure[k - 1]
        if stop[k] == char:
            k += 1
        self.states[i] = k
        return k == len(stop)

    def _upto(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


def _failure(pattern: str) -> list[int]:
    """KMP's failure function: for each prefix, the length of its longest proper border."""
    table, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table
