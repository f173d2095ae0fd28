"""Verification of every artifact the project writes against its source, for other projects' CI.

`verify_artifact(original, artifact, options)` tells what `artifact` is from what each stage records, runs
that kind's check and returns a VerifyReport of typed Check records:

    a folder with tp.json (passes/shard/files.py)       -> tp.py      ranks run together == the source
    a checkpoint folder (exporters/nas, config.json's ffn_fusion) -> checkpoint.py  re-import == the source
    float8 initializers (passes/quant/fp8.py)            -> fp8.py     weights == Q(source), scales, logits
    ffn_fusion.heal metadata (runtime/heal/metadata.py)  -> healed.py  structure, tensor hashes, KL / top-1
    ffn_fusion.plan metadata (passes/model_map.py)       -> fused.py   each group exact (passes.validate)
    ffn_fusion.decode metadata (exporters/decode.py)     -> decode.py  cached decoding == prefill == source

A mismatch is a failed Check naming the tensor, group or output; input the checks cannot read (a missing
file, an artifact no stage wrote, a healed file without tensor hashes) is a UserError.
"""

from __future__ import annotations

from pathlib import Path

from passes.errors import UserError
from passes.io.model_io import load_model
from passes.metadata import DECODE_METADATA_KEY, HEAL_METADATA_KEY, PLAN_METADATA_KEY
from passes.shard import MANIFEST
from runtime.verify.checkpoint import is_checkpoint, verify_checkpoint
from runtime.verify.common import metadata
from runtime.verify.decode import verify_decode
from runtime.verify.fp8 import is_fp8, verify_fp8
from runtime.verify.fused import verify_fused
from runtime.verify.healed import verify_healed
from runtime.verify.options import VerifyOptions
from runtime.verify.records import Check, VerifyReport
from runtime.verify.tp import verify_tp

__all__ = ["KINDS", "Check", "VerifyOptions", "VerifyReport", "artifact_kind", "verify_artifact"]

KINDS = ("tp", "checkpoint", "fp8", "healed", "fused", "decode")


def artifact_kind(artifact: Path) -> str:
    """What `artifact` is, from what the stage that wrote it recorded (see the module docstring)."""
    if artifact.is_dir():
        if (artifact / MANIFEST).is_file():
            return "tp"
        if is_checkpoint(artifact):
            return "checkpoint"
        raise UserError(
            f"{artifact} is a folder without {MANIFEST} and without a config.json recording ffn_fusion: "
            "not a rank folder shard_tp.py wrote, nor a checkpoint export_checkpoint.py wrote"
        )
    if not artifact.is_file():
        raise UserError(f"model {artifact} does not exist")
    props = metadata(artifact)
    if is_fp8(load_model(artifact)):
        return "fp8"
    if HEAL_METADATA_KEY in props:
        return "healed"
    if PLAN_METADATA_KEY in props:
        return "fused"
    if DECODE_METADATA_KEY in props:
        return "decode"
    raise UserError(
        f"{artifact} records no stage that wrote it (no {PLAN_METADATA_KEY}, {HEAL_METADATA_KEY} or "
        f"{DECODE_METADATA_KEY} metadata, no float8 weights, no {MANIFEST}): nothing to verify it against"
    )


def verify_artifact(
    original: str | Path, artifact: str | Path, options: VerifyOptions | None = None
) -> VerifyReport:
    """`artifact` (written by a stage of this project from `original`) checked against `original`."""
    original, artifact = Path(original), Path(artifact)
    options = options or VerifyOptions()
    if not original.is_file():
        raise UserError(f"model {original} does not exist")
    kind = artifact_kind(artifact)
    report = VerifyReport(kind, original, artifact)
    if kind == "tp":
        verify_tp(report, options)
    elif kind == "checkpoint":
        verify_checkpoint(report, options)
    elif kind == "fp8":
        verify_fp8(report, options)
    elif kind == "healed":
        verify_healed(report, options)
    elif kind == "fused":
        verify_fused(report)
    else:
        verify_decode(report, options)
    return report
