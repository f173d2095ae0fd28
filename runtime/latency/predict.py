"""Analytical decode latency: one token at batch B, tensor parallel TP, FP8 weights, no GPU needed.

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

All constants live in runtime/latency/constants.py with their sources. The two fitted constants
(bandwidth efficiency, per-layer overhead) come from `runtime.latency.fit.fit_overheads()` on the paper's
Llama-3.1-405B and pre-fusion Ultra-253B measurements only; the fused 70.92 tokens/s is never used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from passes.errors import UserError
from runtime.latency.constants import value

if TYPE_CHECKING:  # the latency model itself needs no graph library
    from passes.blocks import Block

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


def layer_shapes(blocks: Sequence[Block]) -> list[LayerShape]:
    """A recognized block table as the latency model sees it: an attention part of any kind ends in an
    all-reduce, and so does an FFN part of any kind (a Linear FFN has no width: 1 marks it present)."""
    return [
        LayerShape(b.attention_kind != "none", b.width or int(b.ffn_kind != "none"), b.kv_heads)
        for b in blocks
    ]
