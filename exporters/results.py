"""What an export wrote (no torch here: exporters.hf.checkpoint reads checkpoints before importing it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ExportResult:
    """What an export wrote (exporters.onnx_export.export_onnx and the exports built on it)."""

    path: Path
    files: list[Path]
    bytes: int
    seconds: float
    parameters: int
    opset: int
    attention: list[bool] = field(default_factory=list)

    @property
    def attention_free_runs(self) -> list[tuple[int, int]]:
        from passes.blocks import attention_free_runs  # imports onnx_ir: on use, not with this module

        return attention_free_runs(self.attention)
