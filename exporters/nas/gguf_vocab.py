"""The tokenizer of a Hugging Face folder as GGUF metadata (`tokenizer.ggml.*`), as llama.cpp's converter
(convert_hf_to_gguf.py, conversion/base.py and conversion/llama.py) writes it, for any vocabulary.

Which form, in the order of the converter's Llama `set_vocab` (its DeciLM class knows only Llama-3's
128256-token BPE and DeciLM-7B's tokenizer, DESIGN 13; this order covers both and the rest):

- `tokenizer.model` (sentencepiece): model "llama", pre "default", tokens, scores and token types of the
  pieces (`_create_vocab_sentencepiece`), then added_tokens.json and tokenizer_config.json's
  added_tokens_decoder. The pieces are read by a few lines of protobuf decoding below (the `sentencepiece`
  package is not needed).
- tokenizer.json with a byte-fallback BPE (a Llama-2 tokenizer converted by transformers): model "llama" by
  the gguf package's own `LlamaHfVocab` (`_set_vocab_llama_hf`).
- tokenizer.json with a byte-level BPE (GPT-2 style: Llama 3, SmolLM2, Qwen, ...): model "gpt2", the tokens
  and types of `get_vocab_base` (transformers' AutoTokenizer), the pre-tokenizer named by the hash of the
  tokenizer's ids for a fixed text (exporters.nas.gguf_pretokenizers, `get_vocab_base_pre`), and the merges.
- no tokenizer files: model "none" and the vocabulary size (llama.cpp loads it and runs token ids; its
  tools that read text need a tokenizer).

Special token ids, add_bos/add_eos, merges and the chat template come from the gguf package's
`SpecialVocab` (tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json), as the converter
takes them. Anything else is a one-line UserError.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import tempfile
from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf

from exporters.nas.gguf_pretokenizers import CHECK_TEXT, HASHES, LLAMA_CPP
from passes.errors import UserError

# The sentencepiece piece types (sentencepiece_model.proto), which are also the converter's
# SentencePieceTokenTypes values.
SP_NORMAL, SP_UNKNOWN, SP_CONTROL, SP_USER_DEFINED, SP_UNUSED, SP_BYTE = 1, 2, 3, 4, 5, 6


def add_vocab(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> str:
    """Write the tokenizer of `folder` into `writer` for an embedding of `vocab_size` rows; returns what was
    written ("gpt2 (pre smollm)", "llama (sentencepiece)", "none", ...)."""
    config = _json(folder / "tokenizer_config.json")
    if (add_prefix_space := config.get("add_prefix_space")) is not None:
        writer.add_add_space_prefix(add_prefix_space)  # LlamaModel.set_vocab does this first
    quiet = logging.getLogger("gguf").level
    logging.getLogger("gguf").setLevel(logging.ERROR)  # SpecialVocab logs every special token it sets
    try:
        if (folder / "tokenizer.model").is_file():
            return _sentencepiece(writer, folder, vocab_size)
        if (folder / "tokenizer.json").is_file():
            data = _json(folder / "tokenizer.json")
            model = data.get("model") or {}
            if model.get("type") != "BPE":
                raise UserError(
                    f"{folder / 'tokenizer.json'}: a {model.get('type')!r} tokenizer has no GGUF form here "
                    "(BPE tokenizer.json or sentencepiece tokenizer.model only)"
                )
            # LlamaHfVocab takes a byte-fallback BPE with a Sequence decoder; the converter falls back to
            # the GPT-2 form for every other BPE
            if model.get("byte_fallback") and (data.get("decoder") or {}).get("type") == "Sequence":
                return _llama_hf(writer, folder, vocab_size)
            return _gpt2(writer, folder, vocab_size)
    finally:
        logging.getLogger("gguf").setLevel(quiet)
    writer.add_tokenizer_model("none")
    return "none"


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: not JSON ({error})") from None
    return data if isinstance(data, dict) else {}


# ----------------------------------------------------------------------------------- byte-level BPE


def _gpt2(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> str:
    """`_set_vocab_gpt2`: get_vocab_base's tokens and types, the pre-tokenizer by hash, SpecialVocab."""
    tokens, types, pre = vocab_base(folder, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)
    return f"gpt2 (pre {pre})"


# The files transformers reads a tokenizer from (not config.json: for a DeciLM folder it would ask to run the
# folder's remote code, which a tokenizer does not need).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")


def _auto_tokenizer(folder: Path) -> Any:
    """transformers' AutoTokenizer of the folder's tokenizer files, as the converter loads it."""

    from transformers import AutoTokenizer  # noqa: PLC0415 (transformers: seconds to import; only for a BPE tokenizer.json)

    with tempfile.TemporaryDirectory(prefix="gguf_vocab_") as copy:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, Path(copy) / name)
        try:
            return AutoTokenizer.from_pretrained(copy, trust_remote_code=False)
        except Exception as error:  # transformers raises many kinds for a folder it cannot read
            raise UserError(f"{folder}: transformers cannot load its tokenizer ({error})") from None


def vocab_base(folder: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """The converter's `get_vocab_base`: every id below vocab_size as (token, type) and the pre-tokenizer
    name; ids the tokenizer does not have are "[PAD{i}]" UNUSED."""
    tokenizer = _auto_tokenizer(folder)
    vocab = tokenizer.vocab
    if max(vocab.values()) >= vocab_size:
        raise UserError(
            f"{folder}: the tokenizer has token id {max(vocab.values())}, the model's vocabulary has "
            f"{vocab_size} rows"
        )
    pre = pretokenizer_name(tokenizer, folder)
    reverse = {i: token for token, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            # llama.cpp assumes CONTROL and USER_DEFINED tokens pre-normalized, as the converter makes them
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")  # pre-normalize user-defined spaces
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types, pre


def pretokenizer_hash(tokenizer: Any) -> str:
    """SHA-256 of the ids of CHECK_TEXT, as the converter's `get_vocab_base_pre` computes it."""

    return sha256(str(tokenizer.encode(CHECK_TEXT)).encode()).hexdigest()


def pretokenizer_name(tokenizer: Any, folder: Path) -> str:

    digest = pretokenizer_hash(tokenizer)
    if digest not in HASHES:
        raise UserError(
            f"{folder}: llama.cpp does not know this tokenizer's BPE pre-tokenizer (hash {digest[:16]}..., "
            f"not among the {len(HASHES)} of {LLAMA_CPP}): its GGUF would tokenize text differently"
        )
    return HASHES[digest]


def looks_special(token: str) -> bool:
    """The converter's `does_token_look_special`."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


# ------------------------------------------------------------------------------ byte-fallback BPE (HF)


def _llama_hf(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> str:
    """`_set_vocab_llama_hf` with the gguf package's LlamaHfVocab; padded to vocab_size with "[PAD{i}]"
    UNUSED tokens (llama.cpp sizes the embedding by the token count)."""
    try:
        vocab = gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError) as error:
        raise UserError(f"{folder / 'tokenizer.json'}: not a Llama byte-fallback BPE ({error})") from None
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    _pad(folder, tokens, scores, types, vocab_size)
    _add_llama_vocab(writer, folder, tokens, scores, types)
    return "llama (tokenizer.json)"


def _add_llama_vocab(writer: gguf.GGUFWriter, folder: Path, tokens: list, scores: list, types: list) -> None:
    """A sentencepiece-style vocabulary (llama.cpp's "llama" tokenizer model) and the folder's special
    tokens, as the converter's sentencepiece and byte-fallback BPE paths both write them."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _pad(folder: Path, tokens: list, scores: list, types: list, vocab_size: int) -> None:
    if len(tokens) > vocab_size:
        raise UserError(
            f"{folder}: the tokenizer has {len(tokens)} tokens, the model's vocabulary {vocab_size}"
        )
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(SP_UNUSED)


# -------------------------------------------------------------------------------------- sentencepiece


def _sentencepiece(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> str:
    """`_set_vocab_sentencepiece`."""
    tokens, scores, types = sentencepiece_vocab(folder, vocab_size)
    _add_llama_vocab(writer, folder, tokens, scores, types)
    return "llama (sentencepiece)"


def sentencepiece_vocab(folder: Path, vocab_size: int) -> tuple[list[bytes], list[float], list[int]]:
    """The converter's `_create_vocab_sentencepiece`: tokens, scores and types of tokenizer.model's pieces,
    then the added tokens of added_tokens.json and of tokenizer_config.json's added_tokens_decoder."""
    pieces = read_sentencepiece(folder / "tokenizer.model")
    vocab_size = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [SP_UNUSED] * vocab_size
    for i, (piece, score, kind) in enumerate(pieces[:vocab_size]):
        tokens[i] = piece.encode()
        scores[i] = score
        # IsUnknown / IsControl / IsUnused / IsByte keep their type; NORMAL and USER_DEFINED are NORMAL
        types[i] = kind if kind in (SP_UNKNOWN, SP_CONTROL, SP_UNUSED, SP_BYTE) else SP_NORMAL
    for text, i in _json(folder / "added_tokens.json").items():
        if isinstance(i, int) and 0 <= i < vocab_size:
            tokens[i], scores[i], types[i] = text.encode(), -1000.0, SP_USER_DEFINED
    decoder = _json(folder / "tokenizer_config.json").get("added_tokens_decoder") or {}
    for key, data in decoder.items():
        i, text = int(key), data["content"]
        if i >= vocab_size:
            continue
        if data.get("special") or looks_special(text):
            types[i] = SP_CONTROL
        else:
            text = text.replace("\u2581", " ")
            types[i] = SP_USER_DEFINED
        scores[i] = -1000.0
        tokens[i] = text.encode()
    return tokens, scores, types


def read_sentencepiece(path: Path) -> list[tuple[str, float, int]]:
    """(piece, score, type) of every piece of a sentencepiece ModelProto: its field 1, each a SentencePiece
    message {1: piece (string), 2: score (float), 3: type (enum, default NORMAL)}; other fields skipped."""
    data = path.read_bytes()
    pieces = []
    try:
        for field, value in _fields(data):
            if field == 1:
                piece, score, kind = "", 0.0, SP_NORMAL
                for sub, sub_value in _fields(value):
                    if sub == 1:
                        piece = sub_value.decode()
                    elif sub == 2:
                        score = struct.unpack("<f", sub_value)[0]
                    elif sub == 3:
                        kind = sub_value
                pieces.append((piece, score, kind))
    except (IndexError, ValueError, struct.error, UnicodeDecodeError):
        raise UserError(f"{path}: not a sentencepiece model") from None
    if not pieces:
        raise UserError(f"{path}: not a sentencepiece model (no pieces)")
    return pieces


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 1:
            value, at = data[at : at + 8], at + 8
        elif wire == 2:
            length, at = _varint(data, at)
            value, at = data[at : at + length], at + length
        elif wire == 5:
            value, at = data[at : at + 4], at + 4
        else:
            raise ValueError(f"wire type {wire}")
        if at > len(data):
            raise ValueError("truncated")
        yield field, value
