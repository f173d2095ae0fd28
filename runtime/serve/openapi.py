"""The server's OpenAPI document (/openapi.json): every status code and content type the routes answer, every
bound as JSON Schema's minimum/maximum, the app's own limits (token ids below the vocabulary, the served
model id, n and prompt lists up to the queue, token counts below the context). The limits on connections,
read time and body bytes are runtime/serve/connections.py's."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from runtime.serve.protocol import COMPLETION_MAX_TOKENS

# ------------------------------------------------------------------------------------ OpenAPI


def _error_schema() -> dict:
    nullable = {"anyOf": [{"type": "string"}, {"type": "null"}]}
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": nullable,
                    "code": nullable,
                },
            }
        },
    }


def _errors(*statuses: int) -> dict:
    reasons = {
        400: "a bad parameter, malformed JSON, or a limit the schema cannot state (context length, "
        "min_tokens above max_tokens)",
        404: "an unknown model or route",
        408: "the body did not arrive within --request-read-timeout (the connection is closed)",
        413: "the body exceeds --max-request-bytes",
        500: "a fault of this request's generation (named in the message)",
        503: "the queue is full, the server is draining or has --max-connections open (Retry-After), or the "
        "model is not served any more",
    }
    return {
        s: {"description": reasons[s], "content": {"application/json": {"schema": _error_schema()}}}
        for s in statuses
    }


# each server-sent event: a JSON chunk, an error object, or [DONE] as its data
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}


def _object(*required: str) -> dict:
    return {"type": "object", "required": list(required)}


def generation_responses(kind: str) -> dict:
    body = _object("id", "object", "created", "model", "choices")
    body["properties"] = {"object": {"const": kind}, "choices": {"type": "array"}}
    return {
        200: {
            "description": "the completion (JSON), or with stream: server-sent events of chunks, then [DONE]",
            "content": {
                "application/json": {"schema": body},
                "text/event-stream": {"schema": _EVENT},
            },
        },
        **_errors(400, 404, 408, 413, 500, 503),
    }


_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
HEALTH_RESPONSES = {
    200: {"description": "serving", "content": {"application/json": {"schema": _STATUS}}},
    503: {"description": "not serving (why)", "content": {"application/json": {"schema": _STATUS}}},
}
METRICS_RESPONSES = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
}
MODELS_RESPONSES = {
    200: {
        "description": "the served model",
        "content": {"application/json": {"schema": _object("object", "data")}},
    }
}
MODEL_RESPONSES = {
    200: {
        "description": "the model card",
        "content": {"application/json": {"schema": _object("id", "object")}},
    },
    **_errors(404),
}


@dataclass(frozen=True)
class Limits:
    """The served model's limits that the OpenAPI document states (beside the protocol's own bounds)."""

    model: str  # the one model id served
    vocab: int | None  # token ids lie below it
    max_queue: int  # n, and the prompts of one request, up to the queue
    max_context: int  # max_tokens / min_tokens below it; a token-id prompt up to it
    max_prompt: int | None = None  # an engine's bound on one prompt's tokens
    max_chars: int = 0  # a text prompt longer than this cannot fit the context (0: no bound)
    default_max_tokens: int | None = None  # chat's token limit when a request sends none


def openapi_document(app: FastAPI, limits: Limits) -> dict:
    """FastAPI's document, stating what this server answers: no 422 (validation errors are 400), and every
    bound as JSON Schema's minimum/maximum (pydantic's own, and the served model's: token ids below the
    vocabulary, the one model id, n and the prompt lists up to the queue, token counts below the context).
    What JSON Schema cannot state (a prompt plus max_tokens beyond the context, min_tokens above the
    max_tokens in effect, prompts x n above the queue) is the documented 400."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            if "requestBody" in operation:
                operation["requestBody"]["required"] = True
            for parameter in operation.get("parameters", []):
                if parameter.get("name") == "model_id":
                    parameter["schema"]["enum"] = [limits.model]
    schemas = schema.get("components", {}).get("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    tokens = limits.max_context - 1  # a prompt holds at least one token
    for name in ("CompletionRequest", "ChatRequest"):
        if name not in schemas:
            continue
        fields = schemas[name]["properties"]
        fields["model"]["enum"] = [limits.model]
        fields["n"]["maximum"] = limits.max_queue
        fields["min_tokens"]["maximum"] = tokens
        for count in ("max_tokens", "max_completion_tokens"):
            for alternative in fields.get(count, {}).get("anyOf", []):
                if alternative.get("type") == "integer":
                    alternative["maximum"] = tokens
        if "prompt" in fields:
            for alternative in fields["prompt"]["anyOf"]:
                _bound_prompt(alternative, limits, outer=True)
            fields["max_tokens"]["description"] = (
                f"default {COMPLETION_MAX_TOKENS}, capped by what the context leaves after the prompt"
            )
        elif limits.default_max_tokens is not None:
            fields["max_tokens"]["description"] = fields["max_completion_tokens"]["description"] = (
                f"default {limits.default_max_tokens} (--default-max-tokens), capped by what the context "
                "leaves after the prompt"
            )
    _bound_token_ids(schema, limits.vocab)
    app.openapi_schema = schema
    return schema


def _bound_prompt(node: dict, limits: Limits, outer: bool) -> None:
    """A prompt alternative: a text up to max_chars, token ids up to the prompt bound, a list of prompts up
    to the queue (each bounded as one prompt)."""
    if node.get("type") == "string" and limits.max_chars:
        node["maxLength"] = limits.max_chars
    elif node.get("type") == "array":
        items = node.get("items", {})
        if items.get("type") == "integer":
            node["maxItems"] = min(limits.max_context, limits.max_prompt or limits.max_context)
        elif outer:
            node["maxItems"] = limits.max_queue
            _bound_prompt(items, limits, outer=False)


def _bound_token_ids(node: object, vocab: int | None) -> None:
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and vocab is not None:
            node["maximum"] = vocab - 1
        for value in node.values():
            _bound_token_ids(value, vocab)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab)
