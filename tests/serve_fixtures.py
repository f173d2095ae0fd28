"""Model folders for the serving tests: the tiny decode graph of decode_fixtures with a real (word-level)
Hugging Face tokenizer, config.json and generation_config.json beside it, as exporters leave a folder.

Token i of the tiny model's 96 is the word "w<i>" (0-3 are <pad>, <bos>, <eos>, <unk>), so a text is
"w17 w41 w8" and the chat template is "<bos> content ... w5" (w5 opens the assistant's turn).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests import decode_fixtures

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
EOS = 2
CONTEXT = 128
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)
# prompts of different lengths (token ids of the tiny model; 0-3 are special)
PROMPTS = [
    [17, 41, 8, 60, 22, 9],
    [90, 5, 33],
    [12, 13],
    [44, 45, 46, 47, 48, 49, 50, 51],
    [70],
    [8, 8, 8, 8],
    [30, 31, 32, 33, 34],
    [66, 77, 88],
]


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def save_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (tokenizers: only when a tokenizer is written)
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 (transformers: seconds to import; only when a tokenizer is written)

    table = {name: i for i, name in enumerate(SPECIALS)} | {f"w{i}": i for i in range(len(SPECIALS), vocab)}
    core = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def tiny_folder(base: Path, name: str = "decode") -> Path:
    """A model folder around decode_fixtures' tiny model `name` ("decode", "decode_fused", "prefill")."""
    folder = base / "serve_models" / f"tiny_{name}"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(decode_fixtures.decode_models(name), folder / "model.onnx")
    save_tokenizer(folder, decode_fixtures.tiny_spec().vocab)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": CONTEXT})
    )
    return folder
