"""The whole run behind tools/prune_attention.py: load the checkpoint, choose the layers (given, or by
measured attention importance), remove their attention (or replace it by a Linear), distill each such
layer locally (and optionally end to end), report the quality of unpruned / surgery / distilled on
held-out text, and write the Nemotron-NAS checkpoint. Every check on the input runs before the work."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from passes.errors import UserError
from runtime.prune.checkpoint import DTYPES, check_output, write_checkpoint
from runtime.prune.distill import LayerFit, distill_local, end_to_end
from runtime.prune.importance import attention_importance, cheapest_runs, format_importance, plot_importance
from runtime.prune.model import PruneModel, load_checkpoint
from runtime.prune.report import QualityRow, format_report, rows_record, score
from runtime.prune.selection import check_layers, choose, format_layers, within_budget
from runtime.prune.tradeoff import TradeoffPoint, format_tradeoff, measure_tradeoff, plot_tradeoff
from runtime.text_sets import calibration_windows, held_out_sets

Log = Callable[[str], None]


@dataclass(frozen=True)
class PruneOptions:
    layers: list[int] | None = None  # exactly these (--layers)
    remove: int | None = None  # this many, by importance (--remove)
    runs: int | None = None  # in this many runs (--runs; default selection.default_runs)
    max_kl: float | None = None  # as many as the summed importance allows (--max-kl)
    linear: bool = False  # replace_with_linear instead of no_op
    e2e_steps: int = 0
    e2e_lr: float = 5e-5
    ridge: float = 0.1  # heal's refit regularization (runtime.heal.fit.refit_down)
    calib: tuple[Path, ...] = ()
    heldout: tuple[Path, ...] = ()
    tokens: int = 8192  # calibration tokens for the local fit
    window: int = 256
    importance_tokens: int = 512  # calibration tokens for the importance ranking
    eval_tokens: int = 2048  # held-out tokens per text set for the report (0: no report)
    task_items: int = 100  # license_mc items (0: none)
    dtype: str | None = None  # of the written checkpoint; None: the source's
    importance_from: Path | None = None  # a pruning.json (or --importance --json output) to reuse

    def check(self) -> None:
        chosen = [self.layers is not None, self.remove is not None, self.max_kl is not None]
        if sum(chosen) != 1:
            raise UserError("choose the layers one way: --layers, --remove K or --max-kl X")
        if self.runs is not None and self.runs < 1:
            raise UserError("--runs must be >= 1")
        if self.remove is not None and self.remove < 1:
            raise UserError("--remove must be >= 1")
        if self.e2e_steps < 0 or self.ridge < 0 or self.tokens < 1 or self.window < 2:
            raise UserError("--e2e-steps and --ridge must be >= 0, --tokens >= 1, --window >= 2")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")


@dataclass
class PruneResult:
    output: Path | None
    layers: list[int]
    kind: str
    importance: dict[int, float] = field(default_factory=dict)
    fits: list[LayerFit] = field(default_factory=list)
    e2e_losses: list[float] = field(default_factory=list)
    rows: list[QualityRow] = field(default_factory=list)
    seconds: float = 0.0  # pruning and distillation (not the report)
    calibration: str = ""

    def record(self) -> dict:
        return {
            "removed_attention": self.layers,
            "kind": self.kind,
            "calibration": self.calibration,
            "importance": {str(k): v for k, v in self.importance.items()},
            "fits": [f.__dict__ for f in self.fits],
            "e2e_losses": self.e2e_losses,
            "quality": rows_record(self.rows),
            "prune_seconds": self.seconds,
        }


def _calibration(model: PruneModel, options: PruneOptions, count: int) -> tuple[np.ndarray, str]:
    return calibration_windows(model.config.vocab, list(options.calib) or None, count, options.window)


def read_importance(path: Path, model: PruneModel) -> dict[int, float]:
    """{layer: KL} from a pruning.json or the JSON of --importance --json; its layers must be the model's
    attention layers."""
    try:
        table = json.loads(Path(path).read_text())["importance"]
        importance = {int(k): float(v) for k, v in table.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"--importance-from {path}: cannot read an 'importance' table ({exc})") from None
    if sorted(importance) != model.attention_layers():
        raise UserError(f"--importance-from {path}: its layers are not this model's attention layers")
    return importance


def measure_importance(model: PruneModel, options: PruneOptions, log: Log) -> dict[int, float]:
    if options.importance_from is not None:
        return read_importance(options.importance_from, model)
    windows, _ = _calibration(model, options, options.importance_tokens)
    start = time.perf_counter()
    importance = attention_importance(model, windows, log=log)
    log(f"importance of {len(importance)} attention layers on {windows.size} calibration tokens "
        f"({time.perf_counter() - start:.0f} s)")
    return importance


def show_importance(source: Path, plot: Path | None, options: PruneOptions, log: Log,
                    as_json: bool = False) -> dict[int, float]:
    """Measure, print the table, and plot it (--importance without a pruning choice)."""
    model = load_checkpoint(source)
    importance = measure_importance(model, options, log)
    runs = cheapest_runs(importance)
    log(format_importance(importance, runs))
    if as_json:
        print(json.dumps({"importance": {str(k): v for k, v in importance.items()}}, indent=2))
    if plot is not None:
        plot_importance(importance, runs, plot, f"attention importance, {source.name}")
        log(f"wrote {plot}")
    return importance


def run_tradeoff(source: Path, counts: list[int], plot: Path | None, options: PruneOptions,
                 log: Log) -> list[TradeoffPoint]:
    """Layers removed against held-out perplexity, surgery and distilled (--tradeoff)."""
    if not counts or min(counts) < 1:
        raise UserError("--tradeoff takes counts >= 1, e.g. 2,4,6,8")
    model = load_checkpoint(source)
    if max(counts) >= len(model.attention_layers()):
        raise UserError(f"--tradeoff {max(counts)}: the model has {len(model.attention_layers())} attention "
                        "layers; keep at least one")
    calib, _ = _calibration(model, options, options.tokens)
    held_out = held_out_sets(model.config.vocab, options.heldout, options.eval_tokens, options.window)
    importance = measure_importance(model, options, log)
    points = measure_tradeoff(model, importance, counts, options.runs, calib, held_out, options.ridge, log)
    log(format_tradeoff(points))
    if plot is not None:
        plot_tradeoff(points, plot, f"attention pruning trade-off, {source.name}")
        log(f"wrote {plot}")
    return points


def choose_layers(model: PruneModel, options: PruneOptions, log: Log) -> tuple[list[int], dict[int, float]]:
    if options.layers is not None:
        return check_layers(model, options.layers), {}
    importance = measure_importance(model, options, log)
    log(format_importance(importance, cheapest_runs(importance)))
    if options.remove is not None:
        if options.remove >= len(importance):
            raise UserError(f"--remove {options.remove} would remove every attention layer "
                            f"({len(importance)}); keep at least one")
        layers = choose(importance, options.remove, options.runs)
    else:
        assert options.max_kl is not None
        layers = within_budget(importance, options.max_kl, options.runs)
    return check_layers(model, layers), importance


def prune_checkpoint(source: Path, out: Path | None, options: PruneOptions, log: Log = lambda m: None,
                     plot: Path | None = None) -> PruneResult:
    """The run in the module docstring; `out` None measures only."""
    options.check()
    if out is not None:
        check_output(out)
    torch.manual_seed(0)
    model = load_checkpoint(source)
    if options.layers is not None:
        check_layers(model, options.layers)  # before any text is read or anything measured
    calib, calibration = _calibration(model, options, options.tokens)
    held_out = []
    if options.eval_tokens > 0:
        held_out = held_out_sets(model.config.vocab, options.heldout, options.eval_tokens, options.window)
    layers, importance = choose_layers(model, options, log)
    if plot is not None and importance:
        title = f"attention importance, {source.name} (removed: orange)"
        plot_importance(importance, cheapest_runs(importance), plot, title, layers)
    kind = "linear" if options.linear else "no_op"
    log(f"removing attention ({kind}) from layers {format_layers(layers)}; calibration: {calib.size} tokens "
        f"of {calibration}")
    start = time.perf_counter()
    distilled = model.copy()
    fits = distill_local(model, distilled, layers, calib, options.ridge, options.linear, log)
    losses = end_to_end(model, distilled, layers, calib, options.e2e_steps, options.e2e_lr, log=log)
    result = PruneResult(out, layers, kind, importance, fits, losses, seconds=time.perf_counter() - start,
                         calibration=f"{calib.size} tokens of {calibration}")
    log(f"pruned and distilled in {result.seconds:.0f} s")
    if held_out:
        surgery = model.copy()
        for i in layers:
            surgery.remove_attention(i)
        result.rows = score(model, {"surgery": surgery, "distilled": distilled}, held_out,
                            task_items=options.task_items)
        tokens = sum(t.tokens for t in held_out)
        log(f"held-out quality ({tokens} tokens of {', '.join(t.name for t in held_out)}):\n"
            + format_report(result.rows))
    if out is not None:
        write_checkpoint(distilled, out, options.dtype or model.config.dtype, result.record())
        log(f"wrote {out} (Nemotron-NAS, attention removed from {format_layers(layers)})")
    return result
