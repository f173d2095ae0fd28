"""Planning for tensor-parallel sharding: which heads and columns of each weight every rank keeps.

Any head count shards at any tp by zero padding, which is exact:

- KV heads are grouped in "slots" of one KV head and its G = heads / kv_heads query heads. When there are
  at least as many KV heads as ranks, the slots are padded with empty ones to a multiple of tp and each
  rank takes a contiguous share. A padded slot has zero k, v and q columns and zero o_proj rows: its
  queries average zero values, and the zero rows drop the result.
- With fewer KV heads than ranks, the slots are padded to a divisor of tp and each slot is replicated on
  tp / slots ranks, which split its query heads (padded with zero query heads to a multiple of that).
  A zero query head attends uniformly; its zero o_proj rows drop the result.
- FFN widths are padded to a multiple of tp with zero gate/up columns and zero down rows
  (silu(0) * 0 = 0).

So every rank has the same number of query heads, KV heads and FFN columns; the rank graphs differ
only in their weights. `HeadPlan` says which source head each rank's head is (None: a zero head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from passes.errors import UserError
from passes.shard.roles import Branch, TpStructure, WeightRef

VALID_TP = (1, 2, 4, 8)
PAD = -1  # an index that reads as zero (padding)


def check_tp(tp: int) -> None:
    if tp not in VALID_TP:
        raise UserError(f"--tp must be one of {', '.join(map(str, VALID_TP))}, got {tp}")


@dataclass(frozen=True)
class HeadPlan:
    """How the heads of one attention block are laid out over `tp` ranks (padded with zero heads)."""

    heads: int
    kv_heads: int
    tp: int

    def __post_init__(self) -> None:
        if self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise UserError(f"{self.heads} query heads cannot be grouped over {self.kv_heads} KV heads")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def slots(self) -> int:
        """KV heads after padding (real ones first)."""
        if self.kv_heads >= self.tp:
            return math.ceil(self.kv_heads / self.tp) * self.tp
        return next(d for d in (1, 2, 4, 8) if d >= self.kv_heads and self.tp % d == 0)

    @property
    def replicas(self) -> int:
        """Ranks that share one KV slot (1 when the KV heads are split)."""
        return max(1, self.tp // self.slots)

    @property
    def padded_group(self) -> int:
        return math.ceil(self.group / self.replicas) * self.replicas

    @property
    def kv_per_rank(self) -> int:
        return self.slots // self.tp if self.replicas == 1 else 1

    @property
    def group_per_rank(self) -> int:
        return self.padded_group // self.replicas

    @property
    def heads_per_rank(self) -> int:
        return self.kv_per_rank * self.group_per_rank

    @property
    def padded(self) -> bool:
        return self.heads_per_rank * self.tp != self.heads

    def kv_sources(self, rank: int) -> list[int | None]:
        """The source KV head of each of this rank's KV heads (None: a zero padding head)."""
        first = rank * self.kv_per_rank if self.replicas == 1 else rank // self.replicas
        return [s if s < self.kv_heads else None for s in range(first, first + self.kv_per_rank)]

    def q_sources(self, rank: int) -> list[int | None]:
        """The source query head of each of this rank's query heads, KV slot by slot."""
        part = rank % self.replicas if self.replicas > 1 else 0
        out: list[int | None] = []
        for slot in self.kv_sources(rank) if self.replicas == 1 else [rank // self.replicas]:
            for j in range(part * self.group_per_rank, (part + 1) * self.group_per_rank):
                real = slot is not None and slot < self.kv_heads and j < self.group
                out.append(slot * self.group + j if real else None)
        return out


def head_columns(sources: list[int | None], head_dim: int, offset: int = 0) -> list[int]:
    """Column indices of these heads in a [.., heads * head_dim] projection (PAD for a zero head)."""
    out: list[int] = []
    for h in sources:
        out += (
            [PAD] * head_dim if h is None else list(range(offset + h * head_dim, offset + (h + 1) * head_dim))
        )
    return out


def padded_range(start: int, stop: int, size: int) -> list[int]:
    """[start, stop) with indices at or past `size` as PAD."""
    return [i if i < size else PAD for i in range(start, stop)]


def kv_layout(heads: int, kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, KV heads) a rank keeps (real heads only, for callers that check cache shares)."""
    plan = HeadPlan(heads, kv_heads, tp)
    sources = plan.kv_sources(rank)
    real = [s for s in sources if s is not None]
    return (real[0] if real else 0), len(sources)


@dataclass(frozen=True)
class WeightSlice:
    """Rows (axis 0) or columns (axis 1) of a linear layer's [in, out] weight, gathered by index.

    An index PAD reads as zeros (padding)."""

    ref: WeightRef
    axis: int
    indices: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.indices)


def plan_slices(structure: TpStructure, tp: int, rank: int, lm_head: str) -> list[WeightSlice]:
    slices: list[WeightSlice] = []
    for branch in structure.branches:
        if branch.kind == "attention":
            slices += _attention_slices(branch, HeadPlan(branch.heads, branch.kv_heads, tp), rank)
        else:
            per = math.ceil(branch.width / tp)
            cols = tuple(padded_range(rank * per, (rank + 1) * per, branch.width))
            slices += [WeightSlice(c, 1, cols) for c in branch.columns]
            slices.append(WeightSlice(branch.row, 0, cols))
    if lm_head == "vocab":
        if structure.lm_head is None:
            raise UserError("lm_head='vocab': no lm_head (final linear layer reaching an output) found")
        vocab = structure.lm_head.matrix_shape()[1]
        per = math.ceil(vocab / tp)
        slices.append(
            WeightSlice(structure.lm_head, 1, tuple(padded_range(rank * per, (rank + 1) * per, vocab)))
        )
    return slices


def _attention_slices(branch: Branch, plan: HeadPlan, rank: int) -> list[WeightSlice]:
    """q/k/v columns and o_proj rows of this rank's heads (a packed qkv weight: one gathered slice)."""
    assert branch.q is not None and branch.k is not None and branch.v is not None
    hd = branch.head_dim
    q_heads, kv_heads = plan.q_sources(rank), plan.kv_sources(rank)
    q = head_columns(q_heads, hd)
    row = WeightSlice(branch.row, 0, tuple(q))
    if branch.packed:
        q_off, k_off, v_off = branch.offsets
        cols = head_columns(q_heads, hd, q_off) + head_columns(kv_heads, hd, k_off)
        cols += head_columns(kv_heads, hd, v_off)
        return [WeightSlice(branch.q, 1, tuple(cols)), row]
    kv = tuple(head_columns(kv_heads, hd))
    return [
        WeightSlice(branch.q, 1, tuple(q)),
        WeightSlice(branch.k, 1, kv),
        WeightSlice(branch.v, 1, kv),
        row,
    ]


def sliced_shape(s: WeightSlice) -> tuple[int, int]:
    rows, cols = s.ref.matrix_shape()
    n = s.size
    shape = (n, cols) if s.axis == 0 else (rows, n)
    return (shape[1], shape[0]) if s.ref.transposed else shape
