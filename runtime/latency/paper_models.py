"""The paper's models as the latency model sees them (Llama-3.1-405B, Ultra-253B, Super-49B / Puzzle-49B):
dimensions, block tables, fused groups and the paper's measurements; predictions before and after fusion."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from exporters.spec import ffn_width, super49b_pattern
from runtime.latency.constants import value
from runtime.latency.predict import (
    Breakdown,
    Hardware,
    LayerShape,
    ParallelStep,
    fuse_blocks,
    predict_decode,
)


@dataclass(frozen=True)
class PaperModel:
    """One of the paper's models as the latency model sees it: dimensions, block table, the FFN groups
    that fusion joins, the paper's measurements, and the assumptions behind a reconstructed table."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    blocks: tuple[LayerShape, ...]
    groups: tuple[tuple[int, int], ...] = ()
    paper: dict[str, float] = field(default_factory=dict)
    assumptions: tuple[str, ...] = ()
    parallel: tuple[tuple[int, int], ...] = ()  # whole-block groups run side by side, beside `groups`
    parallel_series: tuple[ParallelStep, ...] = ()  # the paper's section-6 rows, where it has them


def param_count(spec: PaperModel, blocks: Sequence[LayerShape] | None = None) -> int:
    """Weights of the model (untied embedding and lm_head, norms included)."""
    h, head_dim = spec.hidden, spec.hidden // spec.heads
    total = 2 * spec.vocab * h + h
    for b in spec.blocks if blocks is None else blocks:
        if b.attention:
            kv = b.kv_heads or spec.kv_heads
            total += h * (spec.heads + 2 * kv) * head_dim + spec.heads * head_dim * h + h
        if b.ffn_width:
            total += 3 * h * b.ffn_width + h
    return total


def _split_even(total: int, parts: int, unit: int = 256) -> list[int]:
    """`total` split into `parts` multiples of `unit`, as even as possible, summing exactly to `total`."""
    units, rem = divmod(total // unit, parts)
    if total % unit:
        raise ValueError(f"{total} is not a multiple of {unit}")
    return [(units + (1 if p < rem else 0)) * unit for p in range(parts)]


def llama_405b() -> PaperModel:
    blocks = tuple(LayerShape(True, 53248) for _ in range(126))
    return PaperModel(
        "Llama-3.1-405B",
        16384,
        128,
        8,
        128256,
        blocks,
        paper={"tokens_per_s_before": value("paper.llama405b.tokens_per_s")},
    )


ULTRA_GROUPS = ((66, 73), (74, 85), (86, 100), (101, 114))
ULTRA_FUSED_WIDTHS = (399360, 425984, 343040, 301056)
ULTRA_ATTENTION_FREE = range(66, 116)
# Outside the fused groups the released per-block widths are not at hand here: one ffn_mult for all of
# them, the value on a 1/32 grid (Puzzle's multipliers are multiples of 1/32) that puts the total nearest
# 253B. See ultra_253b().assumptions.
ULTRA_OTHER_FFN_MULT = 3.21875


def ultra_253b() -> PaperModel:
    """Reconstructed pre-fusion Ultra-253B block table (126 blocks; paper numbering)."""
    hidden = 16384
    other = ffn_width(ULTRA_OTHER_FFN_MULT, hidden)
    widths = [other] * 126
    for (i, j), fused in zip(ULTRA_GROUPS, ULTRA_FUSED_WIDTHS, strict=True):
        widths[i : j + 1] = _split_even(fused, j - i + 1)
    blocks = tuple(LayerShape(k not in ULTRA_ATTENTION_FREE, widths[k]) for k in range(126))
    assumptions = (
        "126 blocks before fusion (81 released blocks + 45 removed by the four groups), hidden 16384, "
        "128 heads, 8 KV heads in every attention block, vocab 128256",
        "blocks 66-115 attention-free, every other block full GQA attention",
        "each fused width split evenly over its group's blocks in multiples of 256 (sums exact)",
        f"blocks outside the fused groups (and block 115): ffn_mult {ULTRA_OTHER_FFN_MULT} -> width {other}, "
        "one value for all, chosen so the total is near 253B",
    )
    assumptions += (
        f"parallel groups {', '.join(map(str, ULTRA_PARALLEL))}: two groups of 4 full blocks, as in "
        "the paper's first Puzzle-49B row (it ran none on Ultra); every full block outside the fused "
        "groups has one shape here, so the prediction depends on how many groups, not where",
    )
    paper = {
        "tokens_per_s_before": value("paper.ultra253b.before.tokens_per_s"),
        "tokens_per_s_after": value("paper.ultra253b.after.tokens_per_s"),
        "speedup": value("paper.ultra253b.speedup"),
    }
    return PaperModel(
        "Ultra-253B", hidden, 128, 8, 128256, blocks, ULTRA_GROUPS, paper, assumptions, ULTRA_PARALLEL
    )


ULTRA_PARALLEL = ((58, 61), (116, 119))
SUPER_GROUPS = ((42, 50), (53, 69))
# Paper section 6 on Puzzle-49B (= Super-49B): parallel groups as they were added, MMLU and MT-Bench.
SUPER_PARALLEL_SERIES = (
    ParallelStep((), 80.73, 8.87),
    ParallelStep(((38, 41), (71, 74)), 80.04, 8.67),
    ParallelStep(((32, 35), (38, 41), (71, 74)), 77.86, 8.20),
    ParallelStep(((26, 29), (32, 35), (38, 41), (71, 74)), 56.12, 6.62),
)


def super_49b() -> PaperModel:
    hidden = 8192
    blocks = [LayerShape(attention, ffn_width(m, hidden)) for attention, m in super49b_pattern()]
    return PaperModel(
        "Super-49B",
        hidden,
        64,
        8,
        128256,
        tuple(blocks),
        SUPER_GROUPS,
        assumptions=("docs/design.md §6 block table exactly; 8 KV heads in every attention block",),
        parallel=SUPER_PARALLEL_SERIES[1].groups,
        parallel_series=SUPER_PARALLEL_SERIES,
    )


def paper_models() -> list[PaperModel]:
    return [llama_405b(), ultra_253b(), super_49b()]


@dataclass
class ModelPrediction:
    spec: PaperModel
    before: Breakdown
    after: Breakdown  # FFN fusion (spec.groups)
    parallel: Breakdown | None = None  # FFN fusion and block parallelization (spec.parallel too)

    @property
    def speedup(self) -> float:
        return self.before.total_s / self.after.total_s


def predict_spec(
    spec: PaperModel, hw: Hardware, blocks: Sequence[LayerShape] | None = None, **options
) -> Breakdown:
    """predict_decode for `spec`'s dimensions, over its blocks or `blocks` (e.g. fused); `options` are
    predict_decode's keywords (tp, batch, context, weight_bytes, ...)."""
    blocks = spec.blocks if blocks is None else blocks
    return predict_decode(blocks, spec.hidden, spec.vocab, spec.heads, spec.kv_heads, hw, **options)


def predict_model(
    spec: PaperModel, hw: Hardware, tp: int = 8, batch: int = 1, context: int = 1024, weight_bytes: float = 1
) -> ModelPrediction:
    options = {"tp": tp, "batch": batch, "context": context, "weight_bytes": weight_bytes}
    fused = fuse_blocks(spec.blocks, spec.groups)
    both = fuse_blocks(spec.blocks, spec.groups, spec.parallel) if spec.parallel else None
    return ModelPrediction(
        spec,
        predict_spec(spec, hw, **options),
        predict_spec(spec, hw, fused, **options),
        None if both is None else predict_spec(spec, hw, both, **options),
    )
