"""A heal as tools/heal.py runs it (run_heal): calibration and held-out windows, healing, the whole-model
quality before and after, and the report of it all."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from passes.model_map import vocab_size
from runtime.evaluate import QualityResult, evaluate, format_table
from runtime.heal.distill import heal
from runtime.heal.metadata import DEFAULT_CONFIG, HealConfig, HealResult
from runtime.heal.pair import load_pair
from runtime.text_sets import calibration_windows, held_out_sets


@dataclass(frozen=True)
class HealDefaults:
    tokens: int = 8192  # calibration tokens
    heldout_tokens: int = 512  # per held-out text set, for the per-group errors
    eval_tokens: int = 1024  # per held-out text set, for the whole-model quality
    window: int | None = None  # tokens per window: the graph's fixed sequence length, else 128 (shapes.py)


HEAL_DEFAULTS = HealDefaults()


@dataclass
class HealReport:
    result: HealResult
    before: list[QualityResult]
    after: list[QualityResult]
    seconds: float

    def lines(self) -> list[str]:
        r, c = self.result, self.result.config
        out = [
            f"healed {len(r.groups)} group(s) of plan {r.plan.to_json()}: inputs {c.inputs}, loss {c.loss}, "
            f"{c.steps} Adam steps of {c.batch_tokens} tokens, lr {c.lr:g} (cosine), "
            f"{r.calib_tokens} calibration tokens, {r.heldout_tokens} held-out tokens",
            *(g.line() for g in r.groups),
        ]
        if r.weights_from is not None:
            out.insert(1, f"weights taken from {r.weights_from} (its heal's errors below; nothing fitted)")
        if self.before:
            out += ["quality on held-out text, fused (before healing):", format_table(self.before)]
            out += ["healed (after):", format_table(self.after)]
            kl_before, kl_after = self.before[-1].kl, self.after[-1].kl
            out.append(
                f"held-out KL {kl_before:.4f} -> {kl_after:.4f} ({kl_after / max(kl_before, 1e-30):.0%} "
                f"of the unhealed), top-1 agreement {self.before[-1].top1_agreement:.4f} -> "
                f"{self.after[-1].top1_agreement:.4f}"
            )
        out.append(
            f"wrote {r.output} ({r.nodes} nodes, as the fused model) in {self.seconds:.1f} s "
            f"(healing {r.seconds:.1f} s)"
        )
        return out

    def to_json(self) -> dict:
        return {
            "output": str(self.result.output),
            "plan": json.loads(self.result.plan.to_json()),
            **self.result.metadata(),
            "seconds_heal": round(self.result.seconds, 2),
            "seconds_total": round(self.seconds, 2),
            "quality_before": [q.row() for q in self.before],
            "quality_after": [q.row() for q in self.after],
        }

    def text(self, as_json: bool = False) -> str:
        """What heal.py prints: the report's lines, or (--json) its JSON."""
        return json.dumps(self.to_json(), indent=1) if as_json else "\n".join(self.lines())


def run_heal(
    original: str | Path,
    fused: str | Path,
    output: str | Path,
    config: HealConfig = DEFAULT_CONFIG,
    calib: Sequence[str | Path] | None = None,
    tokens: int = HEAL_DEFAULTS.tokens,
    heldout_tokens: int = HEAL_DEFAULTS.heldout_tokens,
    eval_tokens: int = HEAL_DEFAULTS.eval_tokens,
    window: int | None = HEAL_DEFAULTS.window,
    heldout: Sequence[str | Path] | None = None,
    log: Callable[[str], None] = lambda message: None,
    weights_from: str | Path | None = None,
) -> HealReport:
    """heal.py: calibration and held-out windows, healing, and the whole-model quality before and after.
    Held-out text: `heldout` (text files or one ids .npy), else evaluate.py's default sets. With
    `weights_from` (heal.py --weights-from), the healed weights of that model instead of a fit."""
    start = time.perf_counter()
    config.check()
    pair = load_pair(original, fused)
    vocab = vocab_size(pair.original_blocks)
    window = pair.shape.window(window)
    held = np.concatenate([s.windows for s in held_out_sets(vocab, heldout, heldout_tokens, window)])
    if weights_from is None:
        calib_windows, source = calibration_windows(vocab, calib, tokens, window)
        log(f"calibration: {source}: {calib_windows.shape[0]} x {calib_windows.shape[1]} tokens")
    else:  # nothing is fitted: the checks of the written model run on held-out windows
        calib_windows, source = held, ""
    result = heal(original, fused, calib_windows, held, output, config, source, log, pair, weights_from)
    del pair  # its block tables hold both models' weights (inline models); the evaluation loads them anew
    gc.collect()
    before, after = [], []
    if eval_tokens:
        sets = held_out_sets(vocab, heldout, eval_tokens, window)
        log("evaluating the fused and the healed model against the original on held-out text")
        before = evaluate(original, fused, sets, progress=False)
        after = evaluate(original, result.output, sets, progress=False)
    return HealReport(result, before, after, time.perf_counter() - start)
