"""The latency model's report on the paper's models: predicted tokens/s before and after fusion, speedups,
all-reduce counts, the paper's numbers and the constants table (tools/bench.py latency)."""

from __future__ import annotations

from runtime.latency.constants import CONSTANTS
from runtime.latency.fit import speedup_bound
from runtime.latency.paper_models import PaperModel, paper_models, param_count, predict_model, predict_spec
from runtime.latency.predict import Breakdown, Hardware, fuse_blocks, hardware


def paper_report(gpu: str = "h100", batch: int = 1, context: int = 1024, tp: int = 8) -> dict[str, dict]:
    """Per model: predicted tokens/s before and after fusion, speedup, all-reduce counts, paper numbers."""
    hw = hardware(gpu)
    out: dict[str, dict] = {}
    for spec in paper_models():
        p = predict_model(spec, hw, tp=tp, batch=batch, context=context)
        entry = {
            "tokens_per_s_before": p.before.tokens_per_s,
            "tokens_per_s_after": p.after.tokens_per_s,
            "speedup": p.speedup,
            "allreduces_before": p.before.n_allreduce,
            "allreduces_after": p.after.n_allreduce,
            "layers_before": p.before.n_layers,
            "layers_after": p.after.n_layers,
            "groups": [list(g) for g in spec.groups],
            "params_billion": param_count(spec) / 1e9,
            "gpu": hw.name,
            "tp": tp,
            "batch": batch,
            "context": context,
            "breakdown_before": p.before.as_dict(),
            "breakdown_after": p.after.as_dict(),
            "assumptions": list(spec.assumptions),
        }
        if p.parallel is not None:
            entry |= {
                "parallel_blocks": [list(g) for g in spec.parallel],
                "tokens_per_s_parallel": p.parallel.tokens_per_s,
                "speedup_parallel": p.before.total_s / p.parallel.total_s,
                "allreduces_parallel": p.parallel.n_allreduce,
                "layers_parallel": p.parallel.n_layers,
                "breakdown_parallel": p.parallel.as_dict(),
            }
        if spec.parallel_series:
            options = {"tp": tp, "batch": batch, "context": context}
            entry["parallel_series"] = _series_rows(spec, hw, p.before, **options)
        if spec.paper:
            entry["paper_measured"] = {**spec.paper, "gpu": "8xH100 FP8 TP8"}
        out[spec.name] = entry
    return out


def _series_rows(spec: PaperModel, hw: Hardware, before: Breakdown, **options) -> list[dict]:
    """The paper's section-6 rows (quality as parallel groups are added) beside the predicted speed, the
    speed it never measured. Like the paper's experiment, without FFN fusion: the quality is of these
    block tables."""
    rows = []
    for step in spec.parallel_series:
        b = predict_spec(spec, hw, fuse_blocks(spec.blocks, (), step.groups), **options)
        rows.append(
            {
                "parallel_blocks": [list(g) for g in step.groups],
                "tokens_per_s": b.tokens_per_s,
                "speedup": before.total_s / b.total_s,
                "allreduces": b.n_allreduce,
                "layers": b.n_layers,
                "paper_mmlu": step.mmlu,
                "paper_mt_bench": step.mt_bench,
            }
        )
    return rows


def format_paper_report(rep: dict[str, dict]) -> str:
    """The readable table the tool prints by default."""
    first = next(iter(rep.values()))
    lines = [
        f"Analytical decode model (no GPU): 8x{first['gpu']} x TP {first['tp']}, FP8 weights, "
        f"batch {first['batch']}, context {first['context']}; tokens/s per sequence",
        "",
        f"{'model':<16}{'params':>8}{'layers':>10}{'all-reduces':>13}{'tok/s before':>14}{'tok/s after':>13}"
        f"{'speedup':>9}   paper (8xH100)",
    ]
    for name, e in rep.items():
        paper = e.get("paper_measured", {})
        measured = " -> ".join(
            f"{paper[k]:.2f}" for k in ("tokens_per_s_before", "tokens_per_s_after") if k in paper
        )
        if "speedup" in paper:
            measured += f" ({paper['speedup']:.2f}x)"
        lines.append(
            f"{name:<16}{e['params_billion']:>7.1f}B{e['layers_before']:>5}->{e['layers_after']:<3}"
            f"{e['allreduces_before']:>7}->{e['allreduces_after']:<4}{e['tokens_per_s_before']:>13.2f}"
            f"{e['tokens_per_s_after']:>13.2f}{e['speedup']:>8.3f}x   {measured or '-'}"
        )
    lines += [
        "",
        "FFN fusion + block parallelization (paper section 6: whole blocks side by side; never measured):",
        f"{'model':<16}{'parallel groups':<22}{'layers':>8}{'all-reduces':>13}{'tok/s':>9}{'speedup':>9}",
    ]
    for name, e in rep.items():
        if "parallel_blocks" in e:
            groups = " ".join(f"[{i},{j}]" for i, j in e["parallel_blocks"])
            lines.append(
                f"{name:<16}{groups:<22}{e['layers_parallel']:>8}{e['allreduces_parallel']:>13}"
                f"{e['tokens_per_s_parallel']:>9.2f}{e['speedup_parallel']:>8.3f}x"
            )
    for name, e in rep.items():
        if e.get("parallel_series"):
            lines += [
                "",
                f"{name}, parallel blocks only: the paper's section-6 rows (its quality), predicted speed",
                f"{'parallel groups':<32}{'MMLU':>7}{'MT-Bench':>10}{'all-reduces':>13}{'tok/s':>9}"
                f"{'speedup':>9}",
            ]
            for r in e["parallel_series"]:
                groups = " ".join(f"[{i},{j}]" for i, j in r["parallel_blocks"]) or "none (the base model)"
                lines.append(
                    f"{groups:<32}{r['paper_mmlu']:>7.2f}{r['paper_mt_bench']:>10.2f}{r['allreduces']:>13}"
                    f"{r['tokens_per_s']:>9.2f}{r['speedup']:>8.3f}x"
                )
    c, b = CONSTANTS, speedup_bound()
    lines += [
        "",
        f"calibrated on Llama-405B 41.44 and pre-fusion Ultra-253B 63.38 tok/s (8xH100; never on 70.92): "
        f"bandwidth efficiency {c['calibrated.bw_efficiency'].value:.3f}, "
        f"per-layer overhead {c['calibrated.layer_overhead'].value * 1e6:.2f} us",
        f"bound: any bytes + per-sub-block-cost model fit to those two numbers predicts at most "
        f"{b.speedup:.3f}x for fused Ultra-253B (fusing one FFN away saves <= {b.per_ffn_s * 1e6:.1f} us)",
    ]
    return "\n".join(lines)
