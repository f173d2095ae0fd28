"""Tiny checkpoints for the pruning tests: a Hugging Face Llama saved by transformers itself (the reference
the torch model is checked against) and a Nemotron-NAS one with an attention-free layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from exporters.hf.synthetic import deci_block, nemotron_config, write_nemotron

VOCAB = 96
LAYERS = 6


def write_tiny_llama(folder: Path, seed: int = 0, layers: int = LAYERS) -> Path:
    """LlamaForCausalLM (hidden 64, 4 heads, 2 KV heads, SwiGLU 256, untied) with random weights, float32,
    written by save_pretrained (model.safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 (transformers: seconds to import; only when a Llama folder is written)

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that every layer matters
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[1]))
    model.save_pretrained(folder)
    return Path(folder)


def write_tiny_nemotron(folder: Path, seed: int = 0) -> Path:
    """Nemotron-NAS, 5 layers: layer 2 already without attention, layer 4 with 1 KV head."""
    blocks = [deci_block(2, 4.0), deci_block(2, 4.0), deci_block("no_op", 4.0), deci_block(2, 4.0),
              deci_block(4, 4.0)]
    return write_nemotron(folder, nemotron_config(blocks, hidden=64, heads=4, vocab=VOCAB), seed=seed,
                          dtype=torch.float32)


def token_file(path: Path, rows: int = 16, seq: int = 64, seed: int = 1) -> Path:
    np.save(path, np.random.default_rng(seed).integers(4, VOCAB, size=(rows, seq)))
    return path


def generation_config(folder: Path, eos: int) -> None:
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
