"""The deployment a plan's speed is predicted for: the latency model (runtime/latency/) on the model's own
dimensions, or on a paper model's that the model stands in for (same block table, e.g. the synthetic
Puzzle-49B layout for Super-49B), with a TP degree, a GPU, FP8 or bf16 weights and a batch size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from passes.blocks import Block
from passes.errors import UserError
from passes.model_map import vocab_size
from passes.plan import Plan
from runtime.latency.paper_models import PaperModel, super_49b, ultra_253b
from runtime.latency.predict import LayerShape, fuse_blocks, hardware, layer_shapes, predict_decode

PAPER_TARGETS = {"super-49b": super_49b, "ultra-253b": ultra_253b}
TARGETS = ("own", *PAPER_TARGETS)
WEIGHT_BYTES = {"fp8": 1.0, "bf16": 2.0}
MAX_TP = 8  # one node


@dataclass(frozen=True)
class TargetOptions:
    name: str = "own"  # "own" (the model's dimensions) or a PAPER_TARGETS key
    gpu: str = "h100"
    tp: int | None = None  # default: 8, or the largest TP below 8 that divides the query heads
    dtype: str = "fp8"
    batch: int = 1
    context: int = 1024


@dataclass(frozen=True)
class Target:
    """A resolved deployment: dimensions and block table, and predicted decode speedups of plans."""

    options: TargetOptions
    tp: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    shapes: tuple[LayerShape, ...]
    paper: PaperModel | None = None

    def step_s(self, plan: Plan) -> float:
        blocks = fuse_blocks(self.shapes, plan.groups, plan.parallel)
        o = self.options
        return predict_decode(
            blocks, self.hidden, self.vocab, self.heads, self.kv_heads, hardware(o.gpu), tp=self.tp,
            batch=o.batch, context=o.context, weight_bytes=WEIGHT_BYTES[o.dtype],
        ).total_s

    def speedup(self, plan: Plan) -> float:
        return self.step_s(Plan(())) / self.step_s(plan)

    def describe(self) -> str:
        o = self.options
        own = f"its own dimensions (hidden {self.hidden}, {self.heads} heads)"
        dims = self.paper.name if self.paper else own
        return f"{dims}, TP {self.tp}, {o.gpu.upper()}, {o.dtype}, batch {o.batch}, context {o.context}"


def resolve(options: TargetOptions, blocks: Sequence[Block]) -> Target:
    """The target for a model's blocks; a paper target must have the model's block table (attention
    where the paper model has it)."""
    if options.name not in TARGETS:
        raise UserError(f"unknown target {options.name!r}; use one of {', '.join(TARGETS)}")
    if options.gpu not in ("h100", "h200"):
        raise UserError(f"unknown GPU {options.gpu!r}; use h100 or h200")
    if options.dtype not in WEIGHT_BYTES:
        raise UserError(f"unknown weight type {options.dtype!r}; use fp8 or bf16")
    if options.batch < 1 or options.context < 0:
        raise UserError("--target-batch must be at least 1 and --target-context not negative")
    if options.name != "own":
        spec = PAPER_TARGETS[options.name]()
        mine = [b.attention_kind != "none" for b in blocks]
        theirs = [s.attention for s in spec.blocks]
        if mine != theirs:
            raise UserError(
                f"--target {options.name}: the model has {len(blocks)} blocks with attention in "
                f"{sum(mine)}; {spec.name} has {len(theirs)} with attention in {sum(theirs)}, and plans "
                "must name the same blocks: use --target own"
            )
        tp = options.tp or 8
        _check_tp(tp, spec.heads)
        return Target(options, tp, spec.hidden, spec.vocab, spec.heads, spec.kv_heads, spec.blocks, spec)
    attention = [b for b in blocks if b.heads]
    if not attention:
        raise UserError("the model has no softmax attention whose heads can be read: use a paper --target")
    heads, kv_heads = attention[0].heads, attention[0].kv_heads or attention[0].heads
    hidden = next((b.ffn.gate.shape[0] for b in blocks if b.ffn is not None), None)
    if hidden is None:
        raise UserError("the model has no SwiGLU FFN to read its hidden size from")
    tp = options.tp or max(t for t in range(1, MAX_TP + 1) if heads % t == 0)
    _check_tp(tp, heads)
    return Target(options, tp, int(hidden), vocab_size(list(blocks)), heads, kv_heads,
                  tuple(layer_shapes(blocks)))


def _check_tp(tp: int, heads: int) -> None:
    if tp < 1 or heads % tp:
        raise UserError(f"--tp {tp}: {heads} attention heads do not split over it")
