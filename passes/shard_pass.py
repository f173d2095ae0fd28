"""One tensor-parallel rank as an onnx-ir pass: `ShardRank(tp, rank)` turns a model into rank `rank` of `tp`.

Why a pass per rank and not one pass for the whole split: sharding makes N models of one, and onnx-ir's
PassManager hands one model from pass to pass (PassResult holds one model), so a pass cannot return N.
The per-rank rewrite is the pass, with rank r of N as a parameter; passes.shard_files.shard_file loads the
source once per rank, runs ShardRank on it and saves it before loading the next (one rank in memory at a
time). A chain such as fuse -> FP8 -> rank r is one PassManager per rank.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from passes.errors import PassInputError, UserError
from passes.shard_collectives import collective_op, collectives, reject_rank_graph
from passes.shard_graph import find_structure
from passes.shard_plan import check_tp
from passes.shard_rewrite import LM_HEAD_MODES, METADATA_KEY, RankInfo, shard_in_memory


class ShardRank(ir.passes.InPlacePass):
    """Rewrite the model, in place, into rank `rank` of `tp` (Megatron layout; see passes.shard).

    requires: not a rank graph already (no DistCollective node), and a decoder whose residual
    branches passes.shard_graph recognizes: else a PassInputError (a UserError).
    ensures: the tp metadata names this rank; tp > 1: exactly one all_reduce after each branch's
    row-parallel projection and nowhere else, one all_gather when the lm_head is split by vocabulary, every
    collective for `tp` ranks; tp = 1: no collective. `info` holds the last call's RankInfo.
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
        self._rows: list[ir.Node] = []

    def requires(self, model: ir.Model) -> None:
        try:
            reject_rank_graph(model)
            structure = find_structure(model)
        except UserError as exc:
            raise PassInputError(str(exc)) from None
        self._rows = [branch.row.node for branch in structure.branches]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.info = shard_in_memory(model, self.tp, self.rank, self.lm_head)
        return ir.passes.PassResult(model, modified=self.tp > 1)

    def ensures(self, model: ir.Model) -> None:
        recorded = json.loads(model.metadata_props.get(METADATA_KEY, "{}"))
        if (recorded.get("tp"), recorded.get("rank")) != (self.tp, self.rank):
            raise AssertionError(f"{METADATA_KEY} {recorded} does not name rank {self.rank} of {self.tp}")
        found = collectives(model)
        if self.tp == 1:
            if found:
                raise AssertionError(f"tp=1 rank graph has {len(found)} collective(s)")
            return
        reduced = [node.inputs[0].producer() for node in found if collective_op(node) == "all_reduce"]
        if sorted(map(id, reduced)) != sorted(map(id, self._rows)):
            raise AssertionError(
                f"{len(reduced)} all-reduces for {len(self._rows)} residual branches: not exactly one after "
                "each row-parallel projection"
            )
        gathers = sum(collective_op(node) == "all_gather" for node in found)
        if gathers != int(self.lm_head == "vocab"):
            raise AssertionError(f"{gathers} all-gathers with lm_head={self.lm_head!r}")
        ranks = {node.attributes["nb_rank"].as_int() for node in found}
        if ranks != {self.tp}:
            raise AssertionError(f"collectives for {sorted(ranks)} ranks in a tp={self.tp} graph")
