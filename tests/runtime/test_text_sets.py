"""held_out_sets (runtime/text_sets.py), the one door to held-out text of evaluate.py, analyze.py, the
frontier, heal.py, prune_attention.py, fuse_onnx.py --verify and quality.py: one token file, text files or
the default sets, each with the tokenizer encoder_for loads (a tokenizer folder's ids as they are);
analyze's random ids for a model without a known tokenizer. No SmolLM2 here (test_evaluate.py reads it)."""

from __future__ import annotations

import numpy as np
import pytest

from exporters.synthetic import SyntheticSpec, build_synthetic
from passes.errors import UserError
from runtime import text_sets as text
from runtime.text_sets import held_out_sets
from tests.serve_fixtures import save_tokenizer

VOCAB = 64


def test_one_token_file_is_one_set_of_its_ids(tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(100).reshape(4, 25) % VOCAB)
    (held,) = held_out_sets(VOCAB, [ids], 90, 32)
    assert (held.name, held.files) == ("tokens", (str(ids),))
    np.testing.assert_array_equal(held.windows, (np.arange(64) % VOCAB).reshape(2, 32))  # 90: 2 windows
    with pytest.raises(UserError, match=r"ids.npy: token ids must lie in 0..9"):
        held_out_sets(10, [ids], 90, 32)


def test_text_files_are_one_set_and_the_defaults_two(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("held out " * 10, encoding="utf-8")
    b.write_text("more text " * 10, encoding="utf-8")
    (held,) = held_out_sets(VOCAB, [a, b], 100, 16)
    assert (held.name, held.files, held.windows.shape) == ("text", (str(a), str(b)), (6, 16))
    bytes_of = np.frombuffer(text.read_texts([a, b]).encode("utf-8"), np.uint8).astype(np.int64)
    np.testing.assert_array_equal(held.windows.reshape(-1), np.minimum(bytes_of[:96], VOCAB - 1))
    defaults = held_out_sets(VOCAB, None, 64, 32)
    assert [(s.name, s.windows.shape) for s in defaults] == [("prose", (2, 32)), ("code", (2, 32))]
    assert defaults[0].files == tuple(map(str, text.EVALUATION_FILES["prose"]))
    with pytest.raises(UserError, match="text file .*missing.txt does not exist"):
        held_out_sets(VOCAB, [tmp_path / "missing.txt"], 64, 32)


def test_random_ids_without_a_tokenizer_only_where_asked(tmp_path):
    """analyze.py's parallel-blocks table: seeded random ids (seed 1) for a model whose tokenizer is unknown;
    given text is still read."""
    (held,) = held_out_sets(VOCAB, None, 100, 32, random_without_tokenizer=True)
    assert held.name == "random"
    assert held.files == (f"random token ids (seed 1; no tokenizer for vocab {VOCAB})",)
    np.testing.assert_array_equal(held.windows, text.windows(text.random_tokens(VOCAB, 100, seed=1), 32))
    assert [s.name for s in held_out_sets(VOCAB, None, 100, 32)] == ["prose", "code"]
    given = tmp_path / "given.txt"
    given.write_text("given " * 20, encoding="utf-8")
    assert [s.name for s in held_out_sets(VOCAB, [given], 100, 32, random_without_tokenizer=True)] == ["text"]


def test_a_tokenizer_folder_reads_text_with_its_own_ids(tmp_path):
    """quality.py: the tokenizer folder lm-eval reads, no vocabulary (the model is never loaded)."""
    save_tokenizer(tmp_path, 96)  # token i is the word "w<i>"
    words = tmp_path / "words.txt"
    words.write_text(" ".join(f"w{i}" for i in range(4, 94)), encoding="utf-8")
    (held,) = held_out_sets(None, [words], 80, 20, tokenizer=tmp_path)
    np.testing.assert_array_equal(held.windows.reshape(-1), np.arange(4, 84))
    assert text.encoder_name(None, tmp_path) == f"the tokenizer in {tmp_path}"
    with pytest.raises(UserError, match="holds no tokenizer.json or tokenizer_config.json"):
        held_out_sets(None, [words], 80, 20, tokenizer=tmp_path / "nothing")
    with pytest.raises(UserError, match="unknown tokenizer 'gpt2'"):
        held_out_sets(VOCAB, [words], 80, 20, tokenizer="gpt2")


def test_evaluate_tool_takes_token_ids_in_an_npy_file_only(tool, tmp_path):
    """--tokens is told from --text by its .npy suffix (held_out_sets reads one .npy as token ids): another
    suffix is refused, not read as text."""
    model = build_synthetic(SyntheticSpec(), tmp_path / "m.onnx")
    ids = tmp_path / "ids.bin"
    np.save(tmp_path / "ids.npy", np.arange(40) % VOCAB)
    (tmp_path / "ids.npy").rename(ids)
    result = tool("evaluate", model, model, "--tokens", ids, "--window", 8)
    assert result.returncode == 2 and f"--tokens {ids}: token ids come in an .npy file" in result.stderr
