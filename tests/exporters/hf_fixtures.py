"""Tiny Hugging Face checkpoints written the way their publishers write them.

- `save_llama_family`: a random LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM saved by
  transformers' own `save_pretrained` (sharded with an index when `max_shard_size` is given).
- nemotron-nas (DeciLM) checkpoints in the published layout: exporters.hf.synthetic (re-exported here;
  tools/bench.py export uses it too).
- `puzzle_models`: one tiny checkpoint with every Puzzle layer kind (PUZZLE_BLOCKS) and its exports
  (prefill graph, decode graph, TP 2 decode folder), made once per session and shared by
  tests/exporters, tests/runtime and tests/runtime/tp.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from exporters.hf.checkpoint import export_hf
from exporters.hf.synthetic import (  # noqa: F401  (re-exported for the tests)
    LLAMA3_ROPE,
    deci_block,
    nemotron_config,
    nemotron_shapes,
    write_nemotron,
)
from passes.metadata import DROPPED_ATTENTION_KEY
from passes.shard import shard_file
from tests.serve_fixtures import save_tokenizer

# Every Puzzle layer kind in six layers (hidden 128, 8 heads of 16): GQA with 2, 1 and 4 KV heads (variable
# GQA: caches of three shapes), attention no_op (1, 4), attention replaced by a Linear (3), FFN no_op (2),
# FFN replaced by a Linear (4), SwiGLU of widths 256 and 512.
PUZZLE_BLOCKS = [
    deci_block(4, 1.0),
    deci_block("no_op", 5.25),
    deci_block(8, "no_op"),
    deci_block("linear", 1.0),
    deci_block("no_op", "linear"),
    deci_block(2, 0.5),
]
PUZZLE_CACHE_HEADS = {0: 2, 2: 1, 5: 4}  # cached layer -> its KV heads
PUZZLE_VOCAB = 96
PUZZLE_ROPE = {**LLAMA3_ROPE, "original_max_position_embeddings": 16}  # short, so that scaling shows


def puzzle_models(base: Path, name: str) -> Path:
    """The Puzzle checkpoint (`name` "ckpt": bf16 shards, a word-level tokenizer) or, exported from it,
    "prefill" (float32 graph), "decode" (decode graph) or "decode_tp2" (the decode graph sharded for 2
    ranks). Each is made on first use under `base/puzzle_models`."""
    folder = base / "puzzle_models"
    paths = {
        "ckpt": folder / "ckpt",
        "prefill": folder / "prefill" / "model.onnx",
        "decode": folder / "decode" / "model.onnx",
        "decode_tp2": folder / "decode_tp2",
    }
    path = paths[name]
    if path.exists():
        return path
    if name == "ckpt":
        config = nemotron_config(
            PUZZLE_BLOCKS, hidden=128, heads=8, vocab=PUZZLE_VOCAB, rope_scaling=PUZZLE_ROPE, rope_theta=1e4
        )
        write_nemotron(path, config, shards=2, seed=3)
        save_tokenizer(path, PUZZLE_VOCAB)
    elif name in ("prefill", "decode"):
        export_hf(puzzle_models(base, "ckpt"), path, dtype="float32", decode=name == "decode")
    else:
        shard_file(puzzle_models(base, "decode"), 2, path, progress=False)
    return path


def save_llama_family(
    folder: Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    max_shard_size: str | None = None,
    drop_attention: tuple[int, ...] = (),
    **overrides: Any,
) -> Path:
    """A tiny random model of `architecture` saved with save_pretrained (float32 unless dtype given).

    `drop_attention` zeroes those layers' o_proj and lists them in config.json the way
    exporters.hf.folder.save_smollm2 does (transformers then computes h + mlp(norm(h)) there).
    """
    import transformers  # noqa: PLC0415 (transformers: seconds to import; only when a Llama-family folder is written)

    kinds = {
        "LlamaForCausalLM": "LlamaConfig",
        "MistralForCausalLM": "MistralConfig",
        "Qwen2ForCausalLM": "Qwen2Config",
    }
    settings = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    settings.update(overrides)
    dtype = settings.pop("dtype", torch.float32)
    config = getattr(transformers, kinds[architecture])(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(dtype).eval()
    with torch.no_grad():  # norms away from 1, so that a wrong norm weight shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
        for layer in drop_attention:
            model.model.layers[layer].self_attn.o_proj.weight.zero_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if drop_attention:
        path = Path(folder) / "config.json"
        path.write_text(
            json.dumps({**json.loads(path.read_text()), DROPPED_ATTENTION_KEY: list(drop_attention)})
        )
    return Path(folder)


# Llama-family checkpoints of every rope kind and attention variant the exporters cover: architecture and
# save_pretrained overrides (sharded where max_shard_size says so).
FAMILY_CASES = {
    "llama_llama3_tied": (
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 16},
        },
    ),
    "mistral_yarn_window": (
        "MistralForCausalLM",
        {
            "sliding_window": 4,
            "max_shard_size": "40KB",
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        },
    ),
    "qwen2_bias_window_dynamic": (
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
            "max_position_embeddings": 8,  # the decode calls pass it: dynamic NTK grows its base
            "max_shard_size": "40KB",
            "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
        },
    ),
}
