"""The frontier's records and outputs: one Entry per measured plan, the choice for a budget, frontier.json
(a list, one object per plan), frontier.md (the table) and frontier.png (predicted speedup against KL)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from passes.errors import UserError  # noqa: E402
from passes.io.figures import pyplot
from passes.plan import Plan  # noqa: E402
from runtime.frontier.measure import Quality  # noqa: E402

# Summing the moves' costs "was wrong" for a plan when it misses the whole plan's cost by more than this.
SUM_TOLERANCE = 0.25


@dataclass(frozen=True)
class Entry:
    label: str  # "original", "l3" (3rd plan of the walk with norm "last"), "f2", "paper", ...
    plan: Plan
    predicted_speedup: float
    summed_cost: float  # calibration KL, the sum of the plan's moves measured alone
    whole_cost: float  # calibration KL of the whole plan
    quality: Quality  # held-out, the plan fused and run
    allreduces: int
    steps: int
    on_frontier: bool = False
    healed: Quality | None = None
    lm_eval: float | None = None
    cpu_tp_decode: float | None = None  # decode tokens/s / the original's, ranks over gloo (bench.py)

    def with_frontier(self, on: bool) -> Entry:
        return replace(self, on_frontier=on)

    def with_quality(self, quality: Quality) -> Entry:
        return replace(self, quality=quality)

    @property
    def fuses(self) -> bool:
        return bool(self.plan.groups or self.plan.parallel)

    @property
    def sum_error(self) -> float | None:
        """(summed - whole) / whole on the calibration tokens; None where the whole cost is ~0."""
        if not self.fuses or self.whole_cost <= 1e-12 or math.isnan(self.summed_cost):
            return None
        return (self.summed_cost - self.whole_cost) / self.whole_cost

    def groups_text(self) -> str:
        ffn = " ".join(f"[{i},{j}]" for i, j in self.plan.groups)
        par = " ".join(f"P[{i},{j}]" for i, j in self.plan.parallel)
        return " ".join(t for t in (ffn, par) if t) or "-"

    def to_json(self) -> dict:
        q = self.quality
        return {
            "label": self.label,
            "plan": json.loads(self.plan.to_json()),
            "predicted_speedup": self.predicted_speedup,
            "kl": q.kl,
            "ppl": q.ppl,
            "top1": q.top1,
            "on_frontier": self.on_frontier,
            "allreduces": self.allreduces,
            "steps": self.steps,
            "calibration_kl": {"summed_moves": self.summed_cost, "whole_plan": self.whole_cost},
            "positions": q.positions,
            "seconds": q.seconds,
            **({"healed": asdict(self.healed)} if self.healed else {}),
            **({"lm_eval_acc": self.lm_eval} if self.lm_eval is not None else {}),
            **({"cpu_tp_decode_ratio": self.cpu_tp_decode} if self.cpu_tp_decode is not None else {}),
        }


@dataclass(frozen=True)
class FrontierReport:
    model: str
    target: str
    calibration: str
    texts: dict[str, list[str]]
    entries: list[Entry]
    max_kl: float | None = None
    min_speedup: float | None = None
    bench_tp: int | None = None  # the TP degree of the measured CPU decode ratios

    @property
    def frontier(self) -> list[Entry]:
        return sorted((e for e in self.entries if e.on_frontier), key=lambda e: e.quality.kl)

    def choose(self) -> Entry | None:
        """The budget's plan among the frontier's fusing plans: the fastest within --max-kl, or the lowest
        KL at --min-speedup or faster. UserError naming the best achievable when none meets it."""
        plans = [e for e in self.frontier if e.fuses]
        if self.max_kl is not None:
            within = [e for e in plans if e.quality.kl <= self.max_kl]
            if not within:
                best = min(plans, key=lambda e: e.quality.kl)
                raise UserError(
                    f"no plan stays within --max-kl {self.max_kl:g}: the smallest KL of a plan that fuses "
                    f"anything is {best.quality.kl:.4g} ({best.label} {best.plan.to_json()})"
                )
            return max(within, key=lambda e: (e.predicted_speedup, -e.quality.kl))
        if self.min_speedup is not None:
            fast = [e for e in plans if e.predicted_speedup >= self.min_speedup]
            if not fast:
                best = max(plans, key=lambda e: e.predicted_speedup)
                raise UserError(
                    f"no plan reaches --min-speedup {self.min_speedup:g}: the fastest measured plan predicts "
                    f"{best.predicted_speedup:.4g}x ({best.label} {best.plan.to_json()})"
                )
            return min(fast, key=lambda e: (e.quality.kl, -e.predicted_speedup))
        return None

    def with_healed(self, healed: dict[str, Quality]) -> FrontierReport:
        return replace(self, entries=[replace(e, healed=healed.get(e.label)) for e in self.entries])

    def with_lm_eval(self, accuracy: dict[str, float]) -> FrontierReport:
        return replace(self, entries=[replace(e, lm_eval=accuracy.get(e.label)) for e in self.entries])

    def with_decode_ratios(self, ratios: dict[str, float], tp: int) -> FrontierReport:
        entries = [replace(e, cpu_tp_decode=ratios.get(e.label)) for e in self.entries]
        return replace(self, entries=entries, bench_tp=tp)

    # ----------------------------------------------------------------------------------------------------
    # Outputs

    def columns(self) -> list[str]:
        cols = ["plan", "groups", "norm", "all-reduces", "steps", "pred. speedup", "KL", "ppl", "top-1",
                "calib KL sum/whole", "frontier"]
        if any(e.healed for e in self.entries):
            cols += ["healed KL", "healed ppl"]
        if any(e.lm_eval is not None for e in self.entries):
            cols.append("lm-eval acc")
        if self.bench_tp:
            cols.append(f"CPU TP{self.bench_tp} decode")
        return cols

    def rows(self) -> list[list[str]]:
        rows = []
        for e in sorted(self.entries, key=lambda e: (e.predicted_speedup, -e.quality.kl)):
            q = e.quality
            calib = f"{e.summed_cost:.3g}/{e.whole_cost:.3g}" if e.fuses else "-"
            row = [e.label, e.groups_text(), e.plan.norm if e.plan.groups else "-", str(e.allreduces),
                   str(e.steps), f"{e.predicted_speedup:.4f}", f"{q.kl:.4g}", f"{q.ppl:.4g}", f"{q.top1:.4f}",
                   calib, "yes" if e.on_frontier else ""]
            if any(x.healed for x in self.entries):
                row += [f"{e.healed.kl:.4g}", f"{e.healed.ppl:.4g}"] if e.healed else ["", ""]
            if any(x.lm_eval is not None for x in self.entries):
                row.append("" if e.lm_eval is None else f"{e.lm_eval:.3f}")
            if self.bench_tp:
                row.append("" if e.cpu_tp_decode is None else f"{e.cpu_tp_decode:.3f}x")
            rows.append(row)
        return rows

    def summing_lines(self) -> list[str]:
        off = [e for e in self.entries if e.sum_error is not None and abs(e.sum_error) > SUM_TOLERANCE]
        compared = sum(e.sum_error is not None for e in self.entries)
        lines = [
            f"summing the moves' costs (each measured alone) missed the whole plan's calibration KL by more "
            f"than {SUM_TOLERANCE:.0%} for {len(off)} of {compared} plans"
        ]
        for e in sorted(off, key=lambda e: -abs(e.sum_error or 0)):
            lines.append(
                f"  {e.label} {e.groups_text()}: sum {e.summed_cost:.4g} vs whole {e.whole_cost:.4g} "
                f"({e.sum_error:+.0%})"
            )
        return lines

    def lines(self) -> list[str]:
        cols, rows = self.columns(), self.rows()
        widths = [max(len(c), *(len(r[k]) for r in rows)) for k, c in enumerate(cols)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        head = [f"frontier: {self.model}", f"target: {self.target}", fmt.format(*cols),
                "-" * (sum(widths) + 2 * len(widths))]
        return head + [fmt.format(*r) for r in rows] + self.summing_lines()

    def markdown(self) -> str:
        cols = self.columns()
        out = [
            f"# Frontier of {Path(self.model).name}",
            "",
            f"Target: {self.target}. Held-out text: {', '.join(self.texts)}; "
            f"calibration: {self.calibration}.",
            "KL(original || plan) in nats per position on held-out text; the plan fused and run. "
            "'calib KL sum/whole': the moves' costs measured alone and summed, against the whole plan, on "
            "the calibration tokens.",
            "",
            "| " + " | ".join(cols) + " |",
            "|" + "|".join("---" for _ in cols) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in self.rows()]
        out += ["", *self.summing_lines()]
        return "\n".join(out) + "\n"

    def write(self, out: Path, paper=None) -> None:
        (out / "frontier.json").write_text(json.dumps([e.to_json() for e in self.entries], indent=1) + "\n")
        (out / "frontier.md").write_text(self.markdown())
        self.plot(out / "frontier.png", paper)

    def plot(self, path: Path, paper=None) -> None:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(9, 6))
        for e in self.entries:
            marker = "*" if e.label.startswith("paper") else "o"
            color = "tab:red" if e.on_frontier else "tab:gray"
            ax.scatter(e.quality.kl, e.predicted_speedup, marker=marker, s=80 if marker == "*" else 30,
                       color=color, zorder=3)
            ax.annotate(e.label, (e.quality.kl, e.predicted_speedup), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
            if e.healed is not None:
                ax.scatter(e.healed.kl, e.predicted_speedup, marker="D", s=30, color="tab:green", zorder=3)
                ax.annotate("", (e.healed.kl, e.predicted_speedup), (e.quality.kl, e.predicted_speedup),
                            arrowprops={"arrowstyle": "->", "color": "tab:green"})
        front = self.frontier
        ax.step([e.quality.kl for e in front], [e.predicted_speedup for e in front], where="post",
                color="tab:red", label="frontier (no plan both faster and closer)")
        if any(e.healed for e in self.entries):
            ax.scatter([], [], marker="D", color="tab:green", label="healed")
        if any(e.label.startswith("paper") for e in self.entries):
            name = paper.name if paper is not None else "the paper"
            ax.scatter([], [], marker="*", color="tab:gray", s=80, label=f"{name}'s own plans")
        if self.max_kl is not None:
            ax.axvline(self.max_kl, color="tab:blue", linestyle=":", label=f"--max-kl {self.max_kl:g}")
        if self.min_speedup is not None:
            label = f"--min-speedup {self.min_speedup:g}"
            ax.axhline(self.min_speedup, color="tab:blue", linestyle=":", label=label)
        ax.set_xlabel("KL(original || plan), nats per position, held-out text")
        ax.set_ylabel("predicted decode speedup")
        ax.set_title(f"{Path(self.model).name}: speed against quality\n{self.target}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
