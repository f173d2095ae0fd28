"""One tensor-parallel rank as an onnx-ir pass: `ShardRank(tp, rank)` turns a model into rank `rank` of `tp`.

Why a pass per rank and not one pass for the whole split: sharding makes N models of one, and onnx-ir's
PassManager hands one model from pass to pass (PassResult holds one model), so a pass cannot return N.
The per-rank rewrite is the pass, with rank r of N as a parameter; passes.shard.files.shard_file loads the
source once per rank, runs ShardRank on it and saves it before loading the next (one rank in memory at a
time). A chain such as fuse -> FP8 -> rank r is one PassManager per rank.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from passes.errors import PassInputError, UserError
from passes.metadata import TP_METADATA_KEY
from passes.model_map import find_embedding
from passes.shard.collectives import collective_op, collectives, reject_rank_graph
from passes.shard.partition import check_tp
from passes.shard.rewrite import LM_HEAD_MODES, RankInfo, shard_in_memory

ROW_OPS = ("MatMul", "Gemm", "MatMulNBits")  # what a row-parallel projection is


class ShardRank(ir.passes.InPlacePass):
    """Rewrite the model, in place, into rank `rank` of `tp` (Megatron layout; see passes.shard).

    requires: not a rank graph already (no DistCollective node) and a token embedding to start the stream
    from: else a PassInputError (a UserError). The residual branches are recognized once, by the rewrite
    (passes.shard.roles; a UserError says what it does not understand): recognizing them here too would
    double the cost of every rank (measured 2.2 s of 2.7 s on a 5210-node Optimum SmolLM2 graph).
    ensures: the tp metadata names this rank; tp > 1: one all_reduce per residual branch outside parallel
    groups and two per parallel group of blocks, each reading the output of a projection (MatMul, Gemm or
    MatMulNBits), a group's Concat of its attention projections, or a group's sum of its FFN projections;
    one all_gather when the lm_head is split by vocabulary, every collective for `tp` ranks; tp = 1: no
    collective. `info` holds the last RankInfo.
    """

    def __init__(self, tp: int, rank: int, lm_head: str = "replicated") -> None:
        super().__init__()
        check_tp(tp)
        if lm_head not in LM_HEAD_MODES:
            raise UserError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
        if not 0 <= rank < tp:
            raise UserError(f"rank {rank} is outside 0..{tp - 1}")
        self.tp, self.rank, self.lm_head = tp, rank, lm_head
        self.info: RankInfo | None = None

    def requires(self, model: ir.Model) -> None:
        try:
            reject_rank_graph(model)
        except UserError as exc:
            raise PassInputError(str(exc)) from None
        if find_embedding(model.graph) is None:
            raise PassInputError("no token embedding found: expected Gather(embedding weight, input_ids)")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.info = shard_in_memory(model, self.tp, self.rank, self.lm_head)
        return ir.passes.PassResult(model, modified=self.tp > 1)

    def ensures(self, model: ir.Model) -> None:
        recorded = json.loads(model.metadata_props.get(TP_METADATA_KEY, "{}"))
        if (recorded.get("tp"), recorded.get("rank")) != (self.tp, self.rank):
            raise AssertionError(f"{TP_METADATA_KEY} {recorded} does not name rank {self.rank} of {self.tp}")
        found = collectives(model)
        if self.tp == 1:
            if found:
                raise AssertionError(f"tp=1 rank graph has {len(found)} collective(s)")
            return
        reduced = [node.inputs[0].producer() for node in found if collective_op(node) == "all_reduce"]
        expected = self.info.allreduces if self.info is not None else -1
        if len(reduced) != expected or len({id(node) for node in reduced}) != len(reduced):
            raise AssertionError(
                f"{len(reduced)} all-reduces, expected {expected} "
                "(one per residual branch, two per parallel group)"
            )
        if odd := [node for node in reduced if not _reduces_projections(node)]:
            raise AssertionError(f"an all-reduce reads {odd[0].op_type if odd[0] else 'a graph input'}")
        gathers = sum(collective_op(node) == "all_gather" for node in found)
        if gathers != int(self.lm_head == "vocab"):
            raise AssertionError(f"{gathers} all-gathers with lm_head={self.lm_head!r}")
        ranks = {node.attributes["nb_rank"].as_int() for node in found}
        if ranks != {self.tp}:
            raise AssertionError(f"collectives for {sorted(ranks)} ranks in a tp={self.tp} graph")


def _reduces_projections(node: ir.Node | None) -> bool:
    """A projection, or a parallel group's Concat (stacked attention outputs) or Add (sum of FFN outputs)
    of two or more projections."""
    if node is None:
        return False
    if node.op_type in ROW_OPS:
        return True
    if node.op_type == "Concat":
        return len(node.inputs) > 1 and all(_reduces_projections(v.producer()) for v in node.inputs if v)
    if node.op_type == "Add":
        return all(v is not None and _reduces_projections(v.producer()) for v in node.inputs)
    return False
