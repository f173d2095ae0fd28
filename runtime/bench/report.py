"""The generation benchmark's report (runtime.bench.decode) as a Markdown table and a PNG of bars."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from passes.io.figures import pyplot

COLORS = {"original": "#7f8c8d", "fused": "#2e86de", "parallel": "#e67e22"}


def machine_line(m: dict) -> str:
    """The "Machine:" sentence every benchmark report opens with, from runtime.bench.decode.machine()."""
    return f"Machine: {m['cpu']}, {m['cores']} cores; ONNX Runtime {m['onnxruntime']}"


def markdown(data: dict) -> str:
    infos = data["models"]
    lines = [
        f"# Generation benchmark ({data['date']})",
        "",
        f"{machine_line(data['machine'])}, device {data['device']}, "
        f"TP {data['tp']}"
        + (f" ({data['tp_mode']})" if data["tp_mode"] else "")
        + f"; {data['reps']} timed repetitions after {data['warmup']} warm-up, models alternating.",
        "",
        "| model | blocks | attention | all-reduces / token | KV cache bytes / token | path |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, info in infos.items():
        reduces = str(info["allreduces_per_token"])
        if "collectives_per_forward" in info:
            reduces += f" ({info['collectives_per_forward']} DistCollective in the rank graph)"
        lines.append(
            f"| {name} | {info['blocks']} | {info['attention_blocks']} | {reduces} "
            f"| {info['kv_cache_bytes_per_token']} | `{Path(info['path']).name}` |"
        )
    lines += [
        "",
        "| batch | prompt | gen | model | TTFT ms | decode tok/s | token p50 ms | token p90 ms |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in data["results"]:
        lines.append(
            f"| {r['batch']} | {r['prompt_len']} | {r['gen_len']} | {r['model']} | {r['ttft_ms']:.2f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['token_latency_ms_p50']:.2f} "
            f"| {r['token_latency_ms_p90']:.2f} |"
        )
    lines += [
        "",
        "| batch | prompt | model | decode speedup | TTFT speedup | p50 latency speedup | greedy agreement |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for s in data["speedup"]:
        lines.append(
            f"| {s['batch']} | {s['prompt_len']} | {s.get('model', 'fused')} "
            f"| {s['decode_tokens_per_s']:.3f}x | {s['ttft']:.3f}x "
            f"| {s['token_latency_p50']:.3f}x | {s['greedy_token_agreement']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    plt = pyplot()

    results = data["results"]
    cases = list(dict.fromkeys((r["batch"], r["prompt_len"]) for r in results))
    labels = [f"batch {b}\nprompt {p}" for b, p in cases]
    get = {(r["model"], r["batch"], r["prompt_len"]): r for r in results}
    x = np.arange(len(cases))
    models = list(data["models"])
    width = 0.76 / len(models)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [
        ("decode_tokens_per_s", "decode tokens/s (higher is better)", None),
        ("token_latency_ms_p50", "per-token latency ms, p50 (bar) / p90 (tick)", "token_latency_ms_p90"),
        ("ttft_ms", "time to first token ms", None),
    ]
    for ax, (key, title, upper) in zip(axes, panels, strict=True):
        for k, name in enumerate(models):
            values = [get[(name, b, p)][key] for b, p in cases]
            tops = [get[(name, b, p)][upper] for b, p in cases] if upper else values
            offset = (k - (len(models) - 1) / 2) * width
            info = data["models"][name]
            ax.bar(
                x + offset,
                values,
                width,
                color=COLORS.get(name, "#8e44ad"),
                label=f"{name}: {info['blocks']} blocks, {info['allreduces_per_token']} all-reduces/token",
            )
            if upper:
                ax.errorbar(
                    x + offset,
                    values,
                    yerr=[[0] * len(values), np.subtract(tops, values)],
                    fmt="none",
                    ecolor="black",
                    capsize=4,
                    lw=1,
                )
            for xi, value, top in zip(x + offset, values, tops, strict=True):
                ax.annotate(
                    _short(value),
                    (xi, top),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax.set_xticks(x, labels, fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(models), fontsize=9, frameon=False)
    m = data["machine"]
    fig.suptitle(
        f"Greedy generation, {' vs '.join(models)} - TP {data['tp']}, gen {data['gen_len']} tokens, "
        f"{m['cores']}-core {m['cpu']}, {data['date']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"
