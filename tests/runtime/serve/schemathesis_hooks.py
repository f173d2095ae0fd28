"""Schemathesis hooks for test_hostile's run (loaded through SCHEMATHESIS_HOOKS): keep schema-valid bodies
inside the limits JSON Schema cannot state, so that every one of them must be accepted (2xx).

The OpenAPI document states every bound it can (runtime/serve/openapi.py). What it cannot state is a
sum or a comparison across fields, the documented 400s: a prompt (after the tokenizer or the chat template)
plus the max_tokens in effect beyond the context, min_tokens above the max_tokens in effect, prompts x n
above the queue, every token banned before min_tokens, a text prompt the tokenizer turns into no token (the
tiny model's word-level tokenizer drops whitespace). Positive cases are brought inside them here (n,
max_tokens, min_tokens lowered; a prompt that alone cannot fit is dropped); negative cases are untouched.
The server's own tokenizer decides, read from SERVE_HOOK_FOLDER; the limits come from SERVE_HOOK_LIMITS
(JSON: context, queue, chars, vocab, eos, default_chat)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

COMPLETION_DEFAULT = 16  # OpenAI's default max_tokens for /v1/completions


@functools.cache
def _limits() -> dict[str, Any]:
    return json.loads(os.environ["SERVE_HOOK_LIMITS"])


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import; only when a chat prompt is generated)

    return AutoTokenizer.from_pretrained(os.environ["SERVE_HOOK_FOLDER"])


def _body(case: Any) -> dict | None:
    body = case.body
    if case.method.upper() != "POST" or not isinstance(body, dict) or case.meta is None:
        return None
    return body if case.meta.generation.mode == GenerationMode.POSITIVE else None


def _prompt_lengths(path: str, body: dict) -> list[int] | None:
    """Each prompt's tokens as the server counts them; None when one cannot fit (too many characters)."""
    tokenizer, chars = _tokenizer(), _limits()["chars"]
    if path.endswith("/chat/completions"):
        messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in body.get("messages", [])]
        if sum(len(m["content"]) for m in messages) > chars:
            return None
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)]
    prompt = body.get("prompt")
    one = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int | float))  # 4.0 is an id too
    prompts = [prompt] if one else prompt
    if any(isinstance(p, str) and len(p) > chars for p in prompts):
        return None
    return [len(tokenizer(p)["input_ids"]) if isinstance(p, str) else len(p) for p in prompts]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _fits(case: Any) -> tuple[list[int], int] | None:
    """(prompt lengths, tokens left by the longest) for a positive body whose prompts fit; else None."""
    body = _body(case)
    if body is None:
        return None
    lengths = _prompt_lengths(case.path, body)
    if lengths is None or not all(lengths):  # a text of only whitespace has no words for this tokenizer
        return None
    return lengths, _limits()["context"] - max(lengths)


@schemathesis.hook
def filter_case(context: Any, case: Any) -> bool:
    """Drop positive bodies whose prompt alone leaves no room (nothing else can bring them inside)."""
    if _body(case) is None:
        return True
    fit = _fits(case)
    if fit is None:
        return False
    left = fit[1]
    scoring = not case.path.endswith("/chat/completions") and case.body.get("echo") is True
    return left >= 1 or (left == 0 and scoring and case.body.get("max_tokens") == 0)


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    """Lower n, max_tokens and min_tokens of a positive body into the limits the schema cannot state."""
    fit = _fits(case)
    if fit is None:
        return case
    lengths, left = fit
    body, limits = case.body, _limits()
    body["n"] = max(1, min(body.get("n", 1), limits["queue"] // len(lengths)))
    chat = case.path.endswith("/chat/completions")
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            body[name] = min(body[name], left)
    # the max_tokens in effect (runtime/serve/app.py: an absent one is the default, capped by the context)
    wanted = (body.get("max_tokens") or body.get("max_completion_tokens")) if chat else body.get("max_tokens")
    if wanted is None:
        wanted = min(limits["default_chat"] if chat else COMPLETION_DEFAULT, left)
    ending = set(body.get("stop_token_ids", [])) | (set() if body.get("ignore_eos") else set(limits["eos"]))
    if len(ending) >= limits["vocab"]:
        body["min_tokens"] = 0
    if body.get("min_tokens", 0) > wanted:
        body["min_tokens"] = wanted
    return case
