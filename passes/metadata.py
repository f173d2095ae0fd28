"""Every metadata key the project writes into a graph (ONNX metadata_props) or a config.json, and the plan a
fused graph records, read one way.

A leaf module (the standard library and passes.plan only: no onnx_ir, no torch), so exporters.nas.early_copy
reads it before the graph libraries load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from passes.errors import UserError
from passes.plan import Plan, parse_plan

# ONNX metadata_props keys, by the stage that writes them.
HF_METADATA_KEY = "ffn_fusion.hf"  # exporters/hf/checkpoint.py: per source layer "attention+ffn" kinds, names
PLAN_METADATA_KEY = "ffn_fusion.plan"  # passes/fuse.py, passes/parallel.py: the plan a fused graph carries
DECODE_METADATA_KEY = "ffn_fusion.decode"  # exporters/decode_spec.py: the decode graph's cache layout
HEAL_METADATA_KEY = "ffn_fusion.heal"  # runtime/heal: what healing changed, and the hashes it started from
TP_METADATA_KEY = "ffn_fusion.tp"  # passes/shard: a rank graph's rank, world size and head split

# config.json key of a Hugging Face folder: the layers whose attention exporters.hf.folder dropped (o_proj
# zero); transformers ignores it, the project's exporters remove those sub-blocks.
DROPPED_ATTENTION_KEY = "ffn_fusion_dropped_attention"


def recorded_plan(metadata: Mapping[str, str], source: str = "graph metadata") -> Plan | None:
    """The plan a fused graph records under PLAN_METADATA_KEY (None when it records none); a UserError
    naming `source` when the record is not a plan."""
    text = metadata.get(PLAN_METADATA_KEY)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        raise UserError(f"{source}: {PLAN_METADATA_KEY!r} is not JSON") from None
    return parse_plan(data, source=f"{source} {PLAN_METADATA_KEY!r}")
