"""exporters/smollm2_tokenizer.load_tokenizer: read from the GGUF once, then from the tokenizer folder
it saved under the cache; both give the same ids, chat template and special tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest

from exporters import smollm2_tokenizer
from runtime.text_sets import CALIBRATION_FILES, SMOLLM2_VOCAB, read_texts

TEXT = "Copyright (C) 1989, 1991 Free Software Foundation, Inc.\n  héllo 😀\n\tdef f(x): return x ** 2\n"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.slow  # the GGUF's tokenizer is parsed once (about 10 s of CPU)
def test_tokenizer_folder_cache_gives_the_same_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("FFN_FUSION_CACHE", str(tmp_path))
    load = smollm2_tokenizer.load_tokenizer.__wrapped__  # past the per-process cache
    from_gguf = load()
    (folder,) = (tmp_path / "tokenizers").iterdir()
    assert (folder / "tokenizer.json").is_file() and folder.name.startswith("smollm2-")
    from_folder = load()
    for tok in (from_gguf, from_folder):
        assert tok.decode(tok(TEXT, add_special_tokens=False)["input_ids"]) == TEXT
    assert from_folder(TEXT)["input_ids"] == from_gguf(TEXT)["input_ids"]
    chat = [t.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            for t in (from_gguf, from_folder)]
    assert chat[0] == chat[1] and "capital of France" in chat[0]
    assert (from_folder.eos_token_id, from_folder.all_special_ids, len(from_folder)) == (
        from_gguf.eos_token_id, from_gguf.all_special_ids, len(from_gguf))


def test_text_is_read_with_the_same_ids_and_without_transformers():
    """runtime/text_sets reads text with the bare `tokenizers` encoder: load_tokenizer's ids, in a process
    that imports neither transformers nor torch (each tool that reads text saved about 9 s of imports)."""
    tokenizer, encoder = smollm2_tokenizer.load_tokenizer(), smollm2_tokenizer.load_encoder()
    for text in (TEXT, read_texts(CALIBRATION_FILES[:1])):
        assert encoder.encode(text, add_special_tokens=False).ids == tokenizer(
            text, add_special_tokens=False)["input_ids"]
    script = ("import sys; from runtime.text_sets import encoder_for; "
              f"ids = encoder_for({SMOLLM2_VOCAB})({TEXT!r}); "
              "print(len(ids), 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(tokenizer(TEXT, add_special_tokens=False)["input_ids"])), "False", "False"]
