"""The server's OpenAPI document (/openapi.json): every status code and content type the routes answer, the
app's own limits (token ids below the vocabulary, the served model id, n up to the queue), and the request
body limit (413) enforced before a body is parsed."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.serve.protocol import ApiError

# ------------------------------------------------------------------------------------ body limit


class BodyLimit:
    """413 for a body above `limit` bytes: from Content-Length before anything is read, else (a chunked
    body) as soon as the bytes received pass it; either way before the body is parsed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            response = JSONResponse(self.error().body(), status_code=413, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI re-raises an HTTPException met while reading the body
                raise StarletteHTTPException(413, self.error().message)
            return message

        await self.app(scope, limited, send)

    def error(self) -> ApiError:
        return ApiError(
            413, f"the request body exceeds {self.limit} bytes (--max-request-bytes)", code="body_too_large"
        )


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
        413: "the body exceeds --max-request-bytes",
        500: "a fault of this request's generation (named in the message)",
        503: "the queue is full or the server is draining (Retry-After), or the model is not served any more",
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
        **_errors(400, 404, 413, 500, 503),
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


def openapi_document(app: FastAPI, vocab: int | None, model: str, max_queue: int) -> dict:
    """FastAPI's document, stating what this server answers: no 422 (validation errors are 400), token
    ids below the vocabulary, and the one model it serves (any other is a 404)."""
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
                    parameter["schema"]["enum"] = [model]
    schemas = schema.get("components", {}).get("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    for name in ("CompletionRequest", "ChatRequest"):
        if name in schemas:
            schemas[name]["properties"]["model"]["enum"] = [model]
            schemas[name]["properties"]["n"]["maximum"] = max_queue
    _bound_token_ids(schema, vocab)
    app.openapi_schema = schema
    return schema


def _bound_token_ids(node: object, vocab: int | None) -> None:
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and vocab is not None:
            node["maximum"] = vocab - 1
        for value in node.values():
            _bound_token_ids(value, vocab)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab)
