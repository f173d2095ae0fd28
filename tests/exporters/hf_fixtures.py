"""Tiny Hugging Face checkpoints written the way their publishers write them.

- `save_llama_family`: a random LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM saved by
  transformers' own `save_pretrained` (sharded with an index when `max_shard_size` is given).
- nemotron-nas (DeciLM) checkpoints in the published layout: exporters.hf.synthetic (re-exported here;
  tools/bench_export.py uses it too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from exporters.hf.synthetic import (  # noqa: F401  (re-exported for the tests)
    LLAMA3_ROPE,
    deci_block,
    nemotron_config,
    nemotron_shapes,
    write_nemotron,
)


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
    import transformers

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
        from exporters.hf.folder import DROPPED_ATTENTION_KEY

        path = Path(folder) / "config.json"
        path.write_text(
            json.dumps({**json.loads(path.read_text()), DROPPED_ATTENTION_KEY: list(drop_attention)})
        )
    return Path(folder)
