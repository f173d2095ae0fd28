"""Calibration windows for healing: a token file, or text files (by default license prose and stdlib
code that no evaluation set uses) tokenized and sampled file by file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from passes.errors import UserError
from runtime.text_sets import LICENSES, STDLIB, load_token_file, read_texts, text_tokens, windows

# Calibration text disjoint from runtime/text_sets.EVALUATION_FILES: license prose and stdlib code.
CALIBRATION_FILES: tuple[Path, ...] = (
    *(LICENSES / n for n in ("Apache-2.0", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1")),
    *(STDLIB / n for n in ("difflib.py", "calendar.py", "shlex.py", "tempfile.py", "heapq.py")),
)


def calibration_windows(
    vocab: int, calib: Sequence[str | Path] | None, count: int, window: int
) -> tuple[np.ndarray, str]:
    """Calibration windows [n, window] (at most `count` tokens): one token file (.npy), or text files
    (default CALIBRATION_FILES) tokenized one by one and taken in turn, so that every file is sampled."""
    calib = [Path(p) for p in calib or []]
    if len(calib) == 1 and calib[0].suffix == ".npy":
        ids = load_token_file(calib[0])
        if ids.size == 0:
            raise UserError(f"{calib[0]} holds no token ids; pass a calibration file with some")
        if ids.min() < 0 or ids.max() >= vocab:
            raise UserError(f"{calib[0]}: token ids must lie in 0..{vocab - 1}")
        return windows(ids, window, count), f"token file {calib[0]}"
    files = calib or [p for p in CALIBRATION_FILES if p.is_file()]
    if not files:
        raise UserError("no calibration text found on this machine; pass --calib FILE")
    for path in files:
        if not read_texts([path]).strip():
            raise UserError(f"calibration text {path} is empty; pass files with text in them")
    parts = [text_tokens([f], vocab) for f in files]
    per_file = [windows(ids, window) for ids in parts]
    length = min(w.shape[1] for w in per_file)
    rows = [w[k, :length] for k in range(max(len(w) for w in per_file)) for w in per_file if k < len(w)]
    chosen = np.stack(rows[: max(1, count // length)])
    return chosen, "text " + ", ".join(map(str, files))
