"""Calibration and evaluation text read at run time, and tokenization into fixed-length windows (design §5).

Two disjoint default sets, so that the plan is never chosen on the text it is judged on:
- calibration (analysis, norm-mode choice): /usr/share/common-licenses/Apache-2.0 (English prose);
- evaluation: other license texts (prose) and Python standard-library sources (code).
Token ids come from the model's own tokenizer: SmolLM2's (loaded from its GGUF) when the model's
vocabulary has SmolLM2's size; other models need --tokens ids.npy, or fall back to seeded random ids.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from passes.errors import UserError

LICENSES = Path("/usr/share/common-licenses")
STDLIB = Path(sysconfig.get_paths()["stdlib"])

CALIBRATION_FILES: tuple[Path, ...] = (LICENSES / "Apache-2.0",)
EVALUATION_FILES: dict[str, tuple[Path, ...]] = {
    "prose": tuple(LICENSES / n for n in ("GPL-3", "MPL-2.0", "Artistic", "CC0-1.0", "BSD")),
    "code": tuple(STDLIB / n for n in ("argparse.py", "textwrap.py", "json/decoder.py", "fractions.py")),
}
SMOLLM2_VOCAB = 49152


@dataclass(frozen=True)
class TextSet:
    """Named token windows, e.g. ("prose", [n, 128] int64) and the files they came from."""

    name: str
    windows: np.ndarray
    files: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return int(self.windows.size)


def read_texts(paths: Iterable[str | Path]) -> str:
    """The files' contents, joined by blank lines; a missing file is a UserError."""
    parts = []
    for path in map(Path, paths):
        if not path.is_file():
            raise UserError(f"text file {path} does not exist")
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts)


def tokenizer_for(vocab: int) -> Any | None:
    """The model's tokenizer when it can be told from the vocabulary size (SmolLM2); else None."""
    if vocab != SMOLLM2_VOCAB:
        return None
    from exporters.smollm2 import load_tokenizer  # imports transformers: only when needed

    return load_tokenizer()


def tokenize(text: str, tokenizer: Any) -> np.ndarray:
    """Token ids of `text` (no special tokens), int64."""
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def windows(ids: np.ndarray, length: int, max_tokens: int | None = None) -> np.ndarray:
    """Non-overlapping windows [n, length] from the start of `ids` (at most `max_tokens` tokens in all);
    a text shorter than one window gives one shorter window."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.size == 0:
        raise UserError("no tokens: the text is empty")
    if ids.size < length:
        return ids.reshape(1, -1)
    n = ids.size // length
    return ids[: n * length].reshape(n, length)


def random_tokens(vocab: int, count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=count, dtype=np.int64)


def load_token_file(path: str | Path) -> np.ndarray:
    """Token ids from a .npy file (any integer shape; flattened)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file {path} does not exist")
    ids = np.load(path)
    if not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{path}: token ids must be integers, got {ids.dtype}")
    return ids.astype(np.int64).reshape(-1)


def text_tokens(paths: Sequence[str | Path], vocab: int) -> np.ndarray:
    """Token ids of the files, with the model's tokenizer (UserError when it has none)."""
    tokenizer = tokenizer_for(vocab)
    if tokenizer is None:
        raise UserError(
            f"no tokenizer known for a vocabulary of {vocab} (only SmolLM2's, {SMOLLM2_VOCAB}); "
            "pass token ids with --tokens ids.npy"
        )
    return tokenize(read_texts(paths), tokenizer)


def calibration_tokens(
    vocab: int,
    count: int,
    text: Sequence[str | Path] | None = None,
    token_file: str | Path | None = None,
) -> tuple[np.ndarray, str]:
    """`count` calibration token ids and where they came from: a token file, text files, the default
    calibration text (when the model's tokenizer is known), or seeded random ids."""
    if token_file is not None:
        ids, source = load_token_file(token_file), f"token file {token_file}"
    elif text:
        ids, source = text_tokens(text, vocab), "text " + ", ".join(map(str, text))
    elif tokenizer_for(vocab) is not None:
        ids, source = text_tokens(CALIBRATION_FILES, vocab), "text " + ", ".join(map(str, CALIBRATION_FILES))
    else:
        ids, source = (
            random_tokens(vocab, count),
            f"random token ids (seed 0; no tokenizer for vocab {vocab})",
        )
    ids = ids[:count]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise UserError(f"{source}: token ids must lie in 0..{vocab - 1}")
    return ids, f"{source}, first {ids.size} tokens"


def evaluation_sets(
    vocab: int,
    length: int,
    max_tokens: int,
    text: Sequence[str | Path] | None = None,
    token_file: str | Path | None = None,
) -> list[TextSet]:
    """Evaluation windows: the given text files (one set "text"), a token file, or the default held-out
    sets ("prose", "code"), each capped at `max_tokens` tokens."""
    if token_file is not None:
        return [
            TextSet("tokens", windows(load_token_file(token_file), length, max_tokens), (str(token_file),))
        ]
    if text:
        ids = text_tokens(text, vocab)
        return [TextSet("text", windows(ids, length, max_tokens), tuple(map(str, text)))]
    sets = []
    for name, files in EVALUATION_FILES.items():
        present = [f for f in files if f.is_file()]
        if present:
            ids = text_tokens(present, vocab)
            sets.append(TextSet(name, windows(ids, length, max_tokens), tuple(map(str, present))))
    if not sets:
        raise UserError("none of the default evaluation texts exist on this machine; pass --text FILE")
    return sets
