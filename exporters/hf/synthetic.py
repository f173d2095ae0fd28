"""Random nemotron-nas (DeciLMForCausalLM) checkpoints in the published layout, for tests and benchmarks.

config.json with block_configs (every field the published configs carry), safetensors shards in bf16 and
model.safetensors.index.json (design §7). Written tensor by tensor, one shard in memory at a time, so it
also makes the multi-GB checkpoints of tools/bench.py export.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def deci_block(attention: str | int = 1, ffn: str | float = 1.0) -> dict:
    """A block_configs entry. attention: "no_op" | "linear" | n_heads_in_group; ffn: "no_op" | "linear" |
    ffn_mult.

    Written with every field the published configs carry (the unsupported ones at their neutral values).
    """
    attn = {
        "no_op": attention == "no_op",
        "replace_with_linear": attention == "linear",
        "n_heads_in_group": attention if isinstance(attention, int) else None,
        "num_sink_tokens": None,
        "sparsify": None,
        "unshifted_sink": False,
        "use_prefill_window_in_sink_attention": False,
        "window_length": None,
    }
    mlp = {
        "no_op": ffn == "no_op",
        "replace_with_linear": ffn == "linear",
        "ffn_mult": ffn if isinstance(ffn, float | int) and not isinstance(ffn, bool) else None,
        "sparsify": None,
    }
    return {"attention": attn, "ffn": mlp}


def nemotron_config(
    block_configs: list[dict],
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 96,
    rope_scaling: dict | None = None,
    tie: bool = False,
    rope_theta: float = 500000.0,
) -> dict:
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "auto_map": {
            "AutoConfig": "configuration_decilm.DeciLMConfig",
            "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
        },
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": len(block_configs),
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "block_configs": block_configs,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def nemotron_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of a nemotron-nas checkpoint (docs/design.md §7), in checkpoint order."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i, block in enumerate(config["block_configs"]):
        prefix = f"model.layers.{i}"
        attn, ffn = block["attention"], block["ffn"]
        if not attn["no_op"]:
            shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
            if attn["replace_with_linear"]:
                shapes[f"{prefix}.self_attn.linear_attn.weight"] = (hidden, hidden)
            else:
                kv = heads // attn["n_heads_in_group"]
                shapes[f"{prefix}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
                shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv * head_dim, hidden)
                shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv * head_dim, hidden)
                shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if not ffn["no_op"]:
            shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
            if ffn["replace_with_linear"]:
                shapes[f"{prefix}.mlp.linear_mlp.weight"] = (hidden, hidden)
            else:
                width = math.ceil(int(2 * ffn["ffn_mult"] * hidden / 3) / 256) * 256
                shapes[f"{prefix}.mlp.gate_proj.weight"] = (width, hidden)
                shapes[f"{prefix}.mlp.up_proj.weight"] = (width, hidden)
                shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, width)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if len(shape) == 1:
        return 1 + 0.1 * noise
    if "embed_tokens" in name:
        return noise
    return noise / math.sqrt(shape[1])


def write_nemotron(
    folder: Path, config: dict, shards: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Random weights in `shards` safetensors files plus the index, tensor by tensor (bounded memory)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n"
    )
    shapes = nemotron_shapes(config)
    names = list(shapes)
    per_shard = math.ceil(len(names) / shards)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        group = names[s * per_shard : (s + 1) * per_shard]
        tensors = {n: _random(n, shapes[n], gen).to(dtype) for n in group}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        weight_map.update({n: file for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


# Every Nemotron-NAS layer kind in one tiny checkpoint (hidden 64, 4 heads; every SwiGLU 256 wide):
# variable GQA (2, 1 and 4 KV heads), an attention-free run with an identity layer inside (1-4; layer 2 has
# neither part, so the graph has no nodes for it), an attention-only layer (5, FFN no_op) right before
# another attention layer, a Linear attention (7), a Linear FFN (8) and a last attention-free run (9-10).
ALL_KINDS_BLOCKS = [
    deci_block(2, 1.0),
    deci_block("no_op", 1.0),
    deci_block("no_op", "no_op"),
    deci_block("no_op", 2.0),
    deci_block("no_op", 1.0),
    deci_block(4, "no_op"),
    deci_block(1, 1.0),
    deci_block("linear", 1.0),
    deci_block("no_op", "linear"),
    deci_block("no_op", 1.0),
    deci_block("no_op", 1.0),
]


def write_all_kinds(folder: Path, seed: int = 0, vocab: int = 96) -> Path:
    """The ALL_KINDS_BLOCKS checkpoint (bf16, two shards and the index, llama3 rope scaling) in `folder`."""
    config = nemotron_config(ALL_KINDS_BLOCKS, hidden=64, heads=4, vocab=vocab, rope_scaling=LLAMA3_ROPE)
    return write_nemotron(folder, config, shards=2, seed=seed)
