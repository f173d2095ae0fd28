"""The bounds and inputs of a verification (the tool's options, the pytest fixture's keywords)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VerifyOptions:
    max_kl: float | None = None  # healed: bound on KL(original || healed) over held-out text; None: reported
    max_error: float = 0.15  # FP8: bound on the logits' relative L2 error (SmolLM2 measures 0.10-0.12)
    tp_tolerance: float = 1e-5  # TP: bound on the max-abs relative error of the ranks' logits
    checkpoint_tolerance: float = 1e-5  # exported checkpoint: its re-import's logits vs the source ONNX's
    decode_tolerance: float = 1e-4  # decode: cached vs uncached (and vs the source's prefill) logits
    window: int = 64  # held-out text windows (tokens)
    eval_tokens: int = 2048  # held-out tokens per text set
    text: tuple[Path, ...] = ()  # held-out text files or one ids .npy (default: the machine's prose and code)
    seq: int = 16  # tokens of the seeded prompt for the logits checks
