"""Analytical decode latency model: one token at batch B, tensor parallel TP, FP8 weights, no GPU needed.

Per GPU and per token (docs/latency_model.md has the formulas):
- every GEMM is a roofline: max(bytes moved / (HBM bandwidth * bw_efficiency),
  FLOPs / (FP8 peak * flops_efficiency)); bytes = the rank's weight shard + activations in and out;
- decode attention reads the KV cache of `context` tokens for the rank's KV heads (same roofline);
- one all-reduce after each attention o_proj and after each FFN down_proj: latency + bytes / bandwidth;
  a fused group of k FFNs is one FFN, so it drops k - 1 all-reduces;
- a parallel group of k whole blocks (paper section 6) reads the same weights and KV cache but is one
  sequential step: one all-reduce for its k attention outputs (stacked, k times the bytes), one for the
  sum of its k FFN outputs, and one kernel sequence per sub-block kind (heads side by side, FFNs batched);
- a launch cost per non-collective kernel, and a calibrated fixed overhead per layer (block).

All constants live in runtime/bench/latency_constants.py with their sources. The two calibrated constants
(bandwidth efficiency, per-layer overhead) are fit by `calibrate()` on the paper's Llama-3.1-405B and
pre-fusion Ultra-253B measurements only; the fused 70.92 tokens/s is never used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from exporters.spec import ffn_width, super49b_pattern
from passes.errors import UserError
from runtime.bench.latency_constants import CONSTANTS, value

# --------------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class LayerShape:
    """One block of the residual stream: an optional attention sub-block, then an FFN of `ffn_width`.

    kv_heads None means the model's default; ffn_width 0 means no FFN sub-block."""

    attention: bool
    ffn_width: int
    kv_heads: int | None = None


@dataclass(frozen=True)
class ParallelGroup:
    """Whole blocks that run side by side (paper section 6): each reads the group's input stream, the group
    adds up their residual contributions. Every member has attention and an FFN."""

    blocks: tuple[LayerShape, ...]


@dataclass(frozen=True)
class ParallelStep:
    """One row of the paper's section-6 table: the parallel groups in use and the quality it measured."""

    groups: tuple[tuple[int, int], ...]
    mmlu: float
    mt_bench: float


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bandwidth: float  # B/s per GPU (datasheet)
    fp8_flops: float  # dense FLOP/s per GPU (datasheet)
    bw_efficiency: float  # calibrated fraction of hbm_bandwidth reached
    flops_efficiency: float
    allreduce_latency: float  # s
    allreduce_bandwidth: float  # B/s of message size
    launch_per_kernel: float  # s
    layer_overhead: float  # s per block (calibrated)


@dataclass
class Breakdown:
    """Predicted time of one decode step (seconds), per component, and what was counted."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    allreduce_s: float = 0.0  # all-reduces plus the one logits all-gather
    launch_s: float = 0.0
    overhead_s: float = 0.0  # calibrated per-layer fixed overhead
    n_layers: int = 0
    n_allreduce: int = 0
    n_allgather: int = 0
    n_kernels: int = 0
    weight_bytes_per_gpu: float = 0.0
    batch: int = 1

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.allreduce_s + self.launch_s + self.overhead_s

    @property
    def tokens_per_s(self) -> float:
        """Per-sequence decode speed (1 / step time), what the paper reports."""
        return 1.0 / self.total_s

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.batch / self.total_s

    def as_dict(self) -> dict[str, float]:
        out = asdict(self)
        out.update(
            total_s=self.total_s,
            tokens_per_s=self.tokens_per_s,
            throughput_tokens_per_s=self.throughput_tokens_per_s,
        )
        return out


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


# --------------------------------------------------------------------------------------------------------
# Hardware


def hardware(gpu: str, calibrated: bool = True) -> Hardware:
    """H100 SXM or H200 SXM from the constants file; `calibrated=False` leaves efficiency 1, overhead 0."""
    gpu = gpu.lower()
    if gpu not in ("h100", "h200"):
        raise UserError(f"unknown GPU {gpu!r}; use h100 or h200")
    return Hardware(
        name=gpu.upper(),
        hbm_bandwidth=value(f"{gpu}.hbm_bandwidth"),
        fp8_flops=value(f"{gpu}.fp8_flops"),
        bw_efficiency=value("calibrated.bw_efficiency") if calibrated else 1.0,
        flops_efficiency=value("efficiency.flops"),
        allreduce_latency=value("allreduce.latency"),
        allreduce_bandwidth=value("allreduce.bandwidth"),
        launch_per_kernel=value("launch.per_kernel"),
        layer_overhead=value("calibrated.layer_overhead") if calibrated else 0.0,
    )


# --------------------------------------------------------------------------------------------------------
# Cost primitives


def roofline_s(bytes_moved: float, flops: float, hw: Hardware) -> float:
    memory = bytes_moved / (hw.hbm_bandwidth * hw.bw_efficiency)
    compute = flops / (hw.fp8_flops * hw.flops_efficiency)
    return max(memory, compute)


def gemm_s(
    m: int, k: int, n: int, hw: Hardware, weight_bytes: float = 1, act_bytes: float | None = None
) -> float:
    """[m, k] @ [k, n] on one rank: weights k*n*weight_bytes, activations in m*k and out m*n."""
    act = value("bytes.activation") if act_bytes is None else act_bytes
    bytes_moved = k * n * weight_bytes + (m * k + m * n) * act
    return roofline_s(bytes_moved, 2.0 * m * k * n, hw)


def allreduce_s(message_bytes: float, hw: Hardware) -> float:
    return hw.allreduce_latency + message_bytes / hw.allreduce_bandwidth


# --------------------------------------------------------------------------------------------------------
# The model


def predict_decode(
    blocks: Sequence[LayerShape | ParallelGroup],
    hidden: int,
    vocab: int,
    heads: int,
    kv_heads: int,
    hw: Hardware,
    tp: int = 8,
    batch: int = 1,
    context: int = 1024,
    weight_bytes: float = 1,
    head_dim: int | None = None,
    kv_bytes: float | None = None,
) -> Breakdown:
    """Time of one decode step (one new token for each of `batch` sequences) on `tp` GPUs."""
    if tp < 1 or batch < 1 or context < 0:
        raise UserError(
            f"tp, batch must be >= 1 and context >= 0 (got tp={tp}, batch={batch}, context={context})"
        )
    if heads % tp:
        raise UserError(f"{heads} attention heads do not split over tp={tp}")
    step = _Step(
        hw=hw,
        hidden=hidden,
        heads=heads,
        head_dim=head_dim or hidden // heads,
        tp=tp,
        batch=batch,
        context=context,
        weight_bytes=weight_bytes,
        kv_bytes=value("bytes.kv_cache") if kv_bytes is None else kv_bytes,
        act_bytes=value("bytes.activation"),
    )
    out = Breakdown(batch=batch)
    for block in blocks:
        members = block.blocks if isinstance(block, ParallelGroup) else (block,)
        attention = [b for b in members if b.attention]
        ffns = [b for b in members if b.ffn_width > 0]
        if not (attention or ffns):
            continue  # a no-op block is no layer
        out.n_layers += 1  # one sequential step, however many blocks run side by side in it
        out.overhead_s += hw.layer_overhead
        if attention:
            for b in attention:
                _add_attention(out, step, b.kv_heads or kv_heads)
            step.allreduce(out, stacked=len(attention))  # the k attention outputs travel together
            _add_kernels(out, int(value("kernels.attention")), step.hw)
        if ffns:
            for b in ffns:
                _add_ffn(out, step, b.ffn_width)
            step.allreduce(out)  # the FFN outputs are summed before they travel
            _add_kernels(out, int(value("kernels.ffn")), step.hw)
    _add_head(out, step, vocab)
    return out


@dataclass(frozen=True)
class _Step:
    """What every sub-block's cost depends on, besides its own shape."""

    hw: Hardware
    hidden: int
    heads: int
    head_dim: int
    tp: int
    batch: int
    context: int
    weight_bytes: float
    kv_bytes: float
    act_bytes: float

    def gemm(self, out: Breakdown, k: int, n: int) -> None:
        out.gemm_s += gemm_s(self.batch, k, n, self.hw, self.weight_bytes, self.act_bytes)
        out.weight_bytes_per_gpu += k * n * self.weight_bytes

    def allreduce(self, out: Breakdown, stacked: int = 1) -> None:
        out.allreduce_s += allreduce_s(stacked * self.batch * self.hidden * self.act_bytes, self.hw)
        out.n_allreduce += 1


def _add_attention(out: Breakdown, step: _Step, kv_heads: int) -> None:
    """One attention sub-block's GEMMs and KV-cache reads (its all-reduce and kernels: predict_decode)."""
    q_heads = step.heads // step.tp
    kv_local = max(1, math.ceil(kv_heads / step.tp))  # fewer KV heads than ranks: replicated
    step.gemm(out, step.hidden, (q_heads + 2 * kv_local) * step.head_dim)  # QKV
    step.gemm(out, q_heads * step.head_dim, step.hidden)  # o_proj
    kv_read = 2 * step.batch * step.context * kv_local * step.head_dim * step.kv_bytes
    attn_flops = 4.0 * step.batch * q_heads * step.context * step.head_dim
    out.attention_s += roofline_s(kv_read, attn_flops, step.hw)


def _add_ffn(out: Breakdown, step: _Step, width: int) -> None:
    local = math.ceil(width / step.tp)
    step.gemm(out, step.hidden, 2 * local)  # gate + up
    step.gemm(out, local, step.hidden)  # down


def _add_head(out: Breakdown, step: _Step, vocab: int) -> None:
    local = math.ceil(vocab / step.tp)
    step.gemm(out, step.hidden, local)  # lm_head, vocab-parallel
    out.allreduce_s += allreduce_s(step.batch * local * step.act_bytes, step.hw)  # logits all-gather
    out.n_allgather += 1
    _add_kernels(out, int(value("kernels.head")), step.hw)


def _add_kernels(out: Breakdown, n: int, hw: Hardware) -> None:
    out.n_kernels += n
    out.launch_s += n * hw.launch_per_kernel


# --------------------------------------------------------------------------------------------------------
# Fusion and model descriptions


def fuse_blocks(
    blocks: Sequence[LayerShape], groups: Sequence[Sequence[int]], parallel: Sequence[Sequence[int]] = ()
) -> list[LayerShape | ParallelGroup]:
    """Block table after a plan: each FFN group [i, j] becomes one block with block i's attention and the
    summed FFN width; each parallel group [i, j] becomes one ParallelGroup of its whole blocks."""
    ffn = sorted((int(i), int(j)) for i, j in groups)
    whole = sorted((int(i), int(j)) for i, j in parallel)
    for i, j in ffn:
        _check_range("group", i, j, len(blocks))
        if any(b.attention for b in blocks[i + 1 : j + 1]):
            raise UserError(f"group [{i}, {j}] has attention inside it (only block {i} may have attention)")
    for i, j in whole:
        _check_range("parallel group", i, j, len(blocks))
        partial = [k for k in range(i, j + 1) if not (blocks[k].attention and blocks[k].ffn_width > 0)]
        if partial:
            raise UserError(
                f"parallel group [{i}, {j}]: block {partial[0]} lacks attention or an FFN "
                "(a parallel group takes whole blocks only)"
            )
    previous = -1
    for i, j in sorted(ffn + whole):
        if i <= previous:
            raise UserError(f"group [{i}, {j}] overlaps the group before it")
        previous = j
    ends = {i: (j, "ffn") for i, j in ffn} | {i: (j, "parallel") for i, j in whole}
    out: list[LayerShape | ParallelGroup] = []
    k = 0
    while k < len(blocks):
        if k not in ends:
            out.append(blocks[k])
            k += 1
            continue
        j, kind = ends[k]
        if kind == "ffn":
            out.append(replace(blocks[k], ffn_width=sum(b.ffn_width for b in blocks[k : j + 1])))
        else:
            out.append(ParallelGroup(tuple(blocks[k : j + 1])))
        k = j + 1
    return out


def _check_range(what: str, i: int, j: int, n: int) -> None:
    if not 0 <= i < j < n:
        raise UserError(f"{what} [{i}, {j}] is out of range for {n} blocks (and needs i < j)")


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


# --------------------------------------------------------------------------------------------------------
# Predictions and calibration


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


@dataclass(frozen=True)
class Calibration:
    bw_efficiency: float
    layer_overhead: float  # s


def calibrate(gpu: str = "h100") -> Calibration:
    """Fit bw_efficiency and layer_overhead so Llama-405B and pre-fusion Ultra-253B hit the paper's numbers.

    For a trial efficiency, each target gives the per-layer overhead that closes its gap; bisect the
    efficiency until both targets agree. Uses only 41.44 and 63.38 tokens/s (never the fused 70.92)."""
    batch, context = int(value("calibration.batch")), int(value("calibration.context"))
    targets = [
        (llama_405b(), value("paper.llama405b.tokens_per_s")),
        (ultra_253b(), value("paper.ultra253b.before.tokens_per_s")),
    ]
    base = replace(hardware(gpu, calibrated=False), layer_overhead=0.0)

    def overheads(eta: float) -> list[float]:
        hw = replace(base, bw_efficiency=eta)
        out = []
        for spec, tokens_per_s in targets:
            b = predict_spec(spec, hw, batch=batch, context=context)
            out.append((1.0 / tokens_per_s - b.total_s) / b.n_layers)
        return out

    def gap(eta: float) -> float:
        first, second = overheads(eta)
        return first - second

    lo, hi = 0.05, 1.0
    if gap(lo) * gap(hi) > 0:
        raise UserError("calibration has no solution with a bandwidth efficiency in (0.05, 1]")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gap(lo) * gap(mid) <= 0:
            hi = mid
        else:
            lo = mid
    eta = 0.5 * (lo + hi)
    return Calibration(eta, overheads(eta)[0])


@dataclass(frozen=True)
class SpeedupBound:
    per_attention_s: float  # fixed cost per attention sub-block at the bound
    per_ffn_s: float  # fixed cost per FFN sub-block at the bound: what fusing one FFN away saves
    speedup: float


def speedup_bound(gpu: str = "h100") -> SpeedupBound:
    """The largest fused Ultra-253B speedup that ANY model of the form
    time = weight-and-KV bytes / (eta * HBM) + a * (attention sub-blocks) + f * (FFN sub-blocks) + head
    can predict once fit to the two calibration targets (41.44, 63.38 tokens/s) with eta <= 1 and a >= 0.

    f grows as eta grows, so the bound is at eta = 1: solve the two targets for (a, f) there."""
    hw = replace(
        hardware(gpu, calibrated=False),
        allreduce_latency=0.0,
        allreduce_bandwidth=math.inf,
        launch_per_kernel=0.0,
        layer_overhead=0.0,
    )
    rows, rhs = [], []
    for spec, tokens_per_s in (
        (llama_405b(), value("paper.llama405b.tokens_per_s")),
        (ultra_253b(), value("paper.ultra253b.before.tokens_per_s")),
    ):
        batch, context = int(value("calibration.batch")), int(value("calibration.context"))
        b = predict_spec(spec, hw, batch=batch, context=context)
        rows.append([sum(x.attention for x in spec.blocks), sum(x.ffn_width > 0 for x in spec.blocks)])
        rhs.append(1.0 / tokens_per_s - b.total_s)
    a, f = np.linalg.solve(np.array(rows, dtype=float), np.array(rhs))
    if a < 0:
        raise UserError("speedup bound: the two targets need a negative attention cost even at eta = 1")
    ultra = ultra_253b()
    removed = sum(j - i for i, j in ultra.groups)
    before = 1.0 / value("paper.ultra253b.before.tokens_per_s")
    return SpeedupBound(float(a), float(f), float(before / (before - removed * f)))


def report(gpu: str = "h100", batch: int = 1, context: int = 1024, tp: int = 8) -> dict[str, dict]:
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


def constants_table() -> list[tuple[str, float, str, str]]:
    return [(name, c.value, c.unit, c.source) for name, c in CONSTANTS.items()]


def format_report(rep: dict[str, dict]) -> str:
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
