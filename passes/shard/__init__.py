"""Tensor-parallel sharding: split a Llama-family ONNX model into N rank graphs (Megatron layout).

Per residual branch (passes.shard.roles finds them by structure):

- attention (any form passes.patterns.attention knows): q/k/v (or one packed qkv) column-parallel by
  heads, o_proj row-parallel. Any head count at any N: heads are zero-padded to an equal share per rank
  (passes.shard.partition.HeadPlan), and with fewer KV heads than ranks each KV head is replicated on the
  ranks whose query heads use it.
- FFN (SwiGLU, and fused wide FFNs, which are just wider): gate/up column-parallel, down row-parallel;
  widths not divisible by N are padded with zero columns (gate/up) and zero rows (down), which is exact.
- after each row-parallel MatMul, exactly one all-reduce: a `DistCollective` node (domain "trt";
  TensorRT's ONNX parser matches the op by name and ignores the domain) with
  collective_operation="all_reduce", reduce_op="sum", root=-1, group_size=0, nb_rank=N.
- embeddings and lm_head replicated; `lm_head="vocab"` splits the lm_head by vocabulary and gathers the
  logits with one all_gather DistCollective.

Decode graphs (exporters/decode.py) shard too: a past K/V graph input concatenated with an attention
branch's new keys/values, and the present output that Concat makes, hold the rank's KV heads (split, or
the one replicated head its queries use), and their declared shapes say so (the TP runtimes read them).

FP8 Q/DQ graphs shard too: per-channel DequantizeLinear scales travel with their weight slices,
per-tensor scales are replicated. The Reshape/Expand shape constants that encode head counts are
rewritten per rank (passes.shard.dims works out which). Weights are sliced lazily from the memory-mapped
source while each rank's model is saved, one tensor at a time.

This package's __init__ is its public API; the work is split into roles.py (each branch's parallel roles),
partition.py (which heads/columns each rank keeps), dims.py (the rank world), rewrite.py (one rank graph),
value_types.py (types along a rank graph), rank_pass.py
(ShardRank: that rewrite as an onnx-ir pass, rank r of N a parameter, since a PassManager carries one
model and sharding makes N), collectives.py (DistCollective, counting) and files.py (rank files,
tp.json).
"""

from __future__ import annotations

from passes.shard.collectives import COLLECTIVE_DOMAIN, COLLECTIVE_OP, allreduce_line, count_allreduces
from passes.shard.files import (
    MANIFEST,
    MANIFEST_FORMAT,
    BranchSummary,
    ShardReport,
    branch_summaries,
    rank_onnx_files,
    read_manifest,
    shard_file,
    shard_model,
    write_manifest,
)
from passes.shard.partition import VALID_TP, HeadPlan, WeightSlice, check_tp, kv_layout, plan_slices
from passes.shard.rank_pass import ShardRank
from passes.shard.rewrite import LM_HEAD_MODES, RankInfo, shard_in_memory

__all__ = [
    "COLLECTIVE_DOMAIN",
    "COLLECTIVE_OP",
    "LM_HEAD_MODES",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "VALID_TP",
    "BranchSummary",
    "HeadPlan",
    "RankInfo",
    "ShardRank",
    "ShardReport",
    "WeightSlice",
    "allreduce_line",
    "check_tp",
    "count_allreduces",
    "kv_layout",
    "plan_slices",
    "rank_onnx_files",
    "read_manifest",
    "shard_file",
    "shard_in_memory",
    "shard_model",
    "branch_summaries",
    "write_manifest",
]
