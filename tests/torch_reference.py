"""The independent torch reference of a fused model: the HF model with each planned group of layers
replaced by its parallel sum x + sum_k mlp_k(norm(x)) (design §2; the paper's FFN Fusion, in torch), and
each parallel group of whole layers by x + sum_k (layer_k(x) - x) (design §10, block parallelization)."""

from __future__ import annotations

import torch


class ParallelGroup(torch.nn.Module):
    """Layers i..j of a group as one parallel step: x + sum_k mlp_k(norm(x))."""

    def __init__(self, layers: list[torch.nn.Module], mode: str):
        super().__init__()
        self.group, self.mode = torch.nn.ModuleList(layers), mode

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states
        for layer in self.group:
            norm = (self.group[-1] if self.mode == "last" else layer).post_attention_layernorm
            out = out + layer.mlp(norm(hidden_states))
        return out


class Passthrough(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def parallel_model(model: torch.nn.Module, groups, mode: str) -> torch.nn.Module:
    """Replace each group [i, j] of `model.model.layers` by its parallel sum, in place; returns model."""
    layers = model.model.layers
    for first, last in groups:
        group = [layers[k] for k in range(first, last + 1)]
        layers[first] = ParallelGroup(group, mode)
        for k in range(first + 1, last + 1):
            layers[k] = Passthrough()
    return model


class ParallelBlocks(torch.nn.Module):
    """Whole layers i..j of a parallel group (design §10) reading one stream: x + sum_k (layer_k(x) - x)."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.group = torch.nn.ModuleList(layers)

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states
        for layer in self.group:
            result = layer(hidden_states, *args, **kwargs)
            result = result[0] if isinstance(result, tuple) else result  # older transformers return tuples
            out = out + (result - hidden_states)
        return out


def parallel_blocks_model(model: torch.nn.Module, groups) -> torch.nn.Module:
    """Replace each parallel group [i, j] of `model.model.layers` by ParallelBlocks in place."""
    layers = model.model.layers
    for first, last in groups:
        layers[first] = ParallelBlocks([layers[k] for k in range(first, last + 1)])
        for k in range(first + 1, last + 1):
            layers[k] = Passthrough()
    return model
