"""How the serving tests talk to a server: the official `openai` client, completions (whole or streamed),
OpenAI error JSON, and tools/serve.py started as a user starts it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from runtime.ports import free_port
from runtime.serve.server import ServerThread

ROOT = Path(__file__).resolve().parents[3]


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def complete(api: openai.OpenAI, prompt, max_tokens: int = 8, **kw) -> openai.types.Completion:
    return api.completions.create(
        model="tiny_decode", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def streamed(api: openai.OpenAI, prompt, max_tokens: int = 8, **kw) -> tuple[str, str, list]:
    chunks = list(complete(api, prompt, max_tokens, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons[-1], chunks


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def start_cli(*args: str) -> tuple[subprocess.Popen, str, list[str]]:
    """tools/serve.py as a user starts it, once /health answers 200: (process, base URL, command)."""
    return wait_healthy(*launch_cli(*args))


def launch_cli(*args: str) -> tuple[subprocess.Popen, str, list[str]]:
    """tools/serve.py started (not yet serving: see wait_healthy), at a free port."""
    port = free_port()
    command = [sys.executable, str(ROOT / "tools" / "serve.py"), *args, "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return process, f"http://127.0.0.1:{port}", command


def wait_healthy(
    process: subprocess.Popen, url: str, command: list[str]
) -> tuple[subprocess.Popen, str, list[str]]:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url, command
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError(f"{command} did not become healthy")


def raw_stream(url: str, body: dict, route: str = "completions", timeout: float = 60) -> list[str]:
    """A streamed request read as a client library would: every `data:` payload, in order (status 200)."""
    payloads = []
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                payloads.append(line.removeprefix("data:").strip())
    return payloads


def stream_outcome(payloads: list[str]) -> tuple[str, dict | None]:
    """(finish_reason of the last choice chunk or "", the error object or None); asserts [DONE] ends it."""
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return next((r for r in reversed(reasons) if r), ""), (errors[-1] if errors else None)
