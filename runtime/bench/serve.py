"""Serving benchmark: OpenAI-API servers under concurrent streaming clients (tools/bench.py serve).

For each concurrency C, every server gets `requests` streamed completions from C concurrent clients (the
official `openai` async client); the servers take turns, in ABBA order over `rounds`, so that machine noise
hits them alike. Each request asks for exactly `max_tokens` tokens (temperature 0, `ignore_eos`, the vLLM
extension this project's server accepts) with a prompt cut from real English text.

Per server and concurrency: time to first token (request sent -> first text chunk), inter-token latency
(between consecutive text chunks) p50/p90/p99, output tokens/s (completion tokens of all requests / wall
time of the waves), requests/s, failures. Writes JSON, a Markdown table and a PNG.

Any OpenAI-compatible server is a target; tools/bench.py serve --gguf also starts llama.cpp's llama-server
on GGUF files as peers (runtime/bench/llama_server.py) and stops them at the end.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from passes.errors import UserError
from passes.io.figures import pyplot
from runtime.bench.decode import machine
from runtime.bench.report import machine_line

FORMAT = "ffn-fusion-bench-serve/1"
PROMPT_TEXT = Path("/usr/share/common-licenses/Apache-2.0")


@dataclass(frozen=True)
class Target:
    label: str
    url: str  # base URL; "/v1" is added when missing
    model: str = ""
    engine: str = ""  # what serves it, when the benchmark started it (runtime/bench/llama_server.py)

    @property
    def api(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class Summary:
    label: str
    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p90: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p90: float
    itl_ms_p99: float
    latency_ms_p50: float
    errors: list[str] = field(default_factory=list)  # the failed requests' distinct errors (first 3)


def prompts(count: int, words: int, seed: int = 0) -> list[str]:
    """`count` prompts of `words` words each, from seeded offsets into the Apache-2.0 license text."""
    if PROMPT_TEXT.is_file():
        text = PROMPT_TEXT.read_text(encoding="utf-8", errors="replace").split()
    else:  # a machine without the license texts: any English prose will do
        text = (
            "the quick brown fox jumps over the lazy dog while the model serves many clients " * 64
        ).split()
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, max(1, len(text) - words), count)
    return [" ".join(text[s : s + words]) for s in starts]


async def _one(client, model: str, prompt: str, max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    if first is None:
        return RequestResult(False, error="no text in the stream")
    return RequestResult(True, first - start, gaps, time.perf_counter() - start, tokens)


async def _wave(target: Target, concurrency: int, texts: Sequence[str], max_tokens: int):
    import httpx  # noqa: PLC0415 (the client side of the benchmark: the test extras)
    from openai import AsyncOpenAI  # noqa: PLC0415 (the client side of the benchmark: the test extras)

    # A new connection per request, as vLLM's benchmark (one aiohttp session per request): llama-server
    # closes some kept-alive connections after a stream, and a request sent on one fails at once ("Server
    # disconnected without sending a response"; measured: 1 request in 3 sent right after a stream).
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600)
    client = AsyncOpenAI(base_url=target.api, api_key="none", max_retries=0, timeout=600, http_client=http)
    queue = list(texts)
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            results.append(await _one(client, target.model, queue.pop(), max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return results, wall


def _percentiles(values: list[float], scale: float = 1e3) -> tuple[float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0
    p = np.percentile(np.asarray(values) * scale, [50, 90, 99])
    return float(p[0]), float(p[1]), float(p[2])


def summarize_wave(label: str, concurrency: int, results: list[RequestResult], wall: float) -> Summary:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttft = _percentiles([r.ttft_s for r in ok])
    itl = _percentiles([g for r in ok for g in r.itl_s])
    return Summary(
        label=label,
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(ok),
        output_tokens=tokens,
        wall_s=wall,
        output_tokens_per_s=tokens / wall if wall else 0.0,
        requests_per_s=len(ok) / wall if wall else 0.0,
        ttft_ms_p50=ttft[0],
        ttft_ms_p90=ttft[1],
        ttft_ms_p99=ttft[2],
        itl_ms_p50=itl[0],
        itl_ms_p90=itl[1],
        itl_ms_p99=itl[2],
        latency_ms_p50=_percentiles([r.latency_s for r in ok])[0],
        errors=list(dict.fromkeys(r.error for r in results if not r.ok))[:3],
    )


def discover(target: Target) -> Target:
    """The target with its model id (the first of GET /v1/models) when none was given."""
    import httpx  # noqa: PLC0415 (as in _wave)

    try:
        response = httpx.get(target.api + "/models", timeout=30)
        response.raise_for_status()
        models = [m["id"] for m in response.json()["data"]]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise UserError(f"cannot list the models of {target.url}: {exc} (is the server running?)") from None
    if not models:
        raise UserError(f"{target.url} serves no model")
    if target.model and target.model not in models:
        raise UserError(f"{target.url} does not serve {target.model!r} (it serves {', '.join(models)})")
    return Target(target.label, target.url, target.model or models[0], target.engine)


def run(
    targets: Sequence[Target],
    concurrencies: Sequence[int],
    requests: int,
    max_tokens: int = 32,
    prompt_words: int = 48,
    rounds: int = 2,
    warmup: int = 2,
    seed: int = 0,
    log=print,
) -> dict:
    """Measure every target at every concurrency, the targets alternating; returns the report dict."""
    targets = [discover(t) for t in targets]
    load = [os.getloadavg()[0]]
    texts = prompts(requests, prompt_words, seed)
    per_round = [texts[i::rounds] for i in range(rounds)]
    summaries = []
    for target in targets:  # warm-up: sessions, allocator, first-request costs
        asyncio.run(_wave(target, 1, prompts(warmup, prompt_words, seed + 1), max_tokens))
    for concurrency in concurrencies:
        collected = {t.label: ([], 0.0) for t in targets}
        for index, batch in enumerate(per_round):
            for target in targets if index % 2 == 0 else targets[::-1]:
                results, wall = asyncio.run(_wave(target, concurrency, batch, max_tokens))
                done, total = collected[target.label]
                collected[target.label] = (done + results, total + wall)
        for target in targets:
            summary = summarize_wave(target.label, concurrency, *collected[target.label])
            summaries.append(summary)
            log(
                f"concurrency {concurrency:3d} {target.label:>10}: {summary.output_tokens_per_s:8.1f} tok/s, "
                f"TTFT p50 {summary.ttft_ms_p50:8.1f} ms, ITL p50 {summary.itl_ms_p50:7.2f} ms"
                + (f", {summary.failed} failed ({summary.errors[0]})" if summary.failed else "")
            )
    load.append(os.getloadavg()[0])
    return report(targets, concurrencies, requests, max_tokens, prompt_words, rounds, summaries, load)


def report(targets, concurrencies, requests, max_tokens, prompt_words, rounds, summaries, load=()) -> dict:
    by = {(s.label, s.concurrency): s for s in summaries}
    labels = [t.label for t in targets]
    scaling = {
        label: by[(label, max(concurrencies))].output_tokens_per_s
        / by[(label, min(concurrencies))].output_tokens_per_s
        for label in labels
        if by[(label, min(concurrencies))].output_tokens_per_s
    }
    ratios = []  # every other target over the first
    for label in labels[1:]:
        for c in concurrencies:
            base, other = by[(labels[0], c)], by[(label, c)]
            if base.output_tokens_per_s:
                ratios.append(
                    {
                        "label": label,
                        "concurrency": c,
                        "throughput_ratio": other.output_tokens_per_s / base.output_tokens_per_s,
                    }
                )
    return {
        "format": FORMAT,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": [round(x, 2) for x in load],  # 1-minute load at the start and at the end
        "targets": [asdict(t) for t in targets],
        "settings": {
            "concurrency": list(concurrencies),
            "requests": requests,
            "max_tokens": max_tokens,
            "prompt_words": prompt_words,
            "rounds": rounds,
        },
        "results": [asdict(s) for s in summaries],
        "throughput_scaling": {"from": min(concurrencies), "to": max(concurrencies), **scaling},
        "throughput_ratio": ratios,  # every other target / the first, per concurrency
    }


def markdown(data: dict) -> str:
    s = data["settings"]
    lines = [
        f"# Serving benchmark ({data['date']})",
        "",
        f"{machine_line(data['machine'])}. {s['requests']} streamed completions per server and "
        f"concurrency, {s['max_tokens']} output tokens each (ignore_eos), prompts of {s['prompt_words']} "
        f"words; servers alternating over {s['rounds']} rounds"
        + (f"; load average {data['load_average'][0]:.1f} at the start, {data['load_average'][-1]:.1f} at "
           "the end" if data.get("load_average") else "")
        + ".",
        "",
        "| server | model | URL | engine |",
        "|---|---|---|---|",
        *[f"| {t['label']} | {t['model']} | {t['url']} | {t.get('engine') or ''} |" for t in data["targets"]],
        "",
        "| concurrency | server | output tok/s | req/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
        "| failed |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['concurrency']} | {r['label']} | {r['output_tokens_per_s']:.1f} "
            f"| {r['requests_per_s']:.2f} "
            f"| {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p90']:.1f} / {r['ttft_ms_p99']:.1f} "
            f"| {r['itl_ms_p50']:.2f} / {r['itl_ms_p90']:.2f} / {r['itl_ms_p99']:.2f} | {r['failed']} |"
        )
    scaling = {k: v for k, v in data["throughput_scaling"].items() if k not in ("from", "to")}
    if scaling:
        lines += [
            "",
            f"Output throughput at concurrency {data['throughput_scaling']['to']} over "
            f"{data['throughput_scaling']['from']}: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in scaling.items())
            + ".",
        ]
    first = data["targets"][0]["label"]
    for target in data["targets"][1:]:
        rows = [r for r in data["throughput_ratio"] if r.get("label", target["label"]) == target["label"]]
        if rows:
            lines += [
                "",
                f"{target['label']} / {first} output throughput: "
                + ", ".join(f"{r['throughput_ratio']:.2f}x at {r['concurrency']}" for r in rows)
                + ".",
            ]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()

    labels = [t["label"] for t in data["targets"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("output_tokens_per_s", "output tokens/s"),
        ("ttft_ms", "time to first token, ms"),
        ("itl_ms", "inter-token latency, ms"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for label in labels:
            rows = [r for r in data["results"] if r["label"] == label]
            x = [r["concurrency"] for r in rows]
            if key == "output_tokens_per_s":
                ax.plot(x, [r[key] for r in rows], marker="o", label=label)
            else:
                line = ax.plot(x, [r[f"{key}_p50"] for r in rows], marker="o", label=f"{label} p50")[0]
                ax.plot(
                    x,
                    [r[f"{key}_p99"] for r in rows],
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{label} p99",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["settings"]["concurrency"], [str(c) for c in data["settings"]["concurrency"]])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Serving benchmark, {data['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
