"""What an export wrote (no torch here: exporters.hf.checkpoint reads checkpoints before importing it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from passes.block_table import attention_free_runs


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
        return attention_free_runs(self.attention)
