"""A Llama-family or Nemotron-NAS checkpoint as a float32 torch model that pruning runs layer by layer.

The model is exporters.decode's DecodeLlama built from the checkpoint's own layer kinds
(exporters.hf.config.decode_spec), so parameter names are the checkpoint's and every Nemotron-NAS kind
(variable GQA, no-op or Linear attention, no-op or Linear FFN) runs. Pruning changes a layer in place:
attention removed (`no_op`: no input norm, no attention) or replaced by one hidden x hidden Linear.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from exporters.decode import AttentionInputs, DecodeLlama, LinearAttention
from exporters.decode_spec import LayerKind
from exporters.hf.config import HfConfig, decode_spec, expected_tensors, read_config
from exporters.hf.rope import rope_parameters
from exporters.hf.safetensors_in import open_checkpoint
from passes.errors import UserError


@dataclass
class PruneModel:
    """The checkpoint's model and its current layer kinds (changed by remove_attention / set_linear)."""

    folder: Path
    config: HfConfig
    net: DecodeLlama
    kinds: list[LayerKind]
    _steps: dict[tuple[int, int], AttentionInputs] = field(default_factory=dict, repr=False)

    @property
    def n_layers(self) -> int:
        return len(self.kinds)

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.net.model.layers

    def attention_layers(self) -> list[int]:
        """Layers with something in the attention slot (softmax attention or a Linear)."""
        return [i for i, k in enumerate(self.kinds) if k.attention != "none"]

    def copy(self) -> PruneModel:
        return PruneModel(self.folder, self.config, copy.deepcopy(self.net), list(self.kinds))

    def step(self, batch: int, seq: int) -> AttentionInputs:
        """Rotary cos/sin and the causal bias of a full window (no cache), as DecodeLlama.forward has them."""
        key = (batch, seq)
        if key not in self._steps:
            positions = torch.arange(seq, dtype=torch.float32)[None].expand(batch, seq)
            freqs = positions[:, :, None] * self.net.model.inv_freq[None, None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None].expand(batch, seq, seq)
            bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None, None]
            self._steps = {key: AttentionInputs(angles.cos()[:, None], angles.sin()[:, None], bias)}
        return self._steps[key]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net.model.embed_tokens(ids)

    def attention(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """What layer `index`'s attention slot adds to the stream x [batch, seq, hidden] (zero when none)."""
        layer = self.layers[index]
        kind = self.kinds[index].attention
        if kind == "none":
            return torch.zeros_like(x)
        z = layer.input_layernorm(x)
        if kind == "linear":
            return layer.self_attn(z)
        b, s = x.shape[:2]
        attn = layer.self_attn
        empty = x.new_zeros(b, attn.kv_heads, 0, attn.head_dim)
        return attn(z, self.step(b, s), (empty, empty))[0]

    def ffn(self, index: int, h: torch.Tensor) -> torch.Tensor:
        """What layer `index`'s FFN slot adds to the stream h entering it (zero when none)."""
        layer = self.layers[index]
        if self.kinds[index].ffn == "none":
            return torch.zeros_like(h)
        return layer.mlp(layer.post_attention_layernorm(h))

    def run_layer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(index, x)
        return h + self.ffn(index, h)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.lm_head(self.net.model.norm(x)).float()

    def stream(self, ids: torch.Tensor, skip_attention: int | None = None) -> torch.Tensor:
        """The stream after the last layer; with `skip_attention`, that layer's attention left out."""
        x = self.embed(ids)
        for i in range(self.n_layers):
            x = x + self.ffn(i, x) if i == skip_attention else self.run_layer(i, x)
        return x

    def forward(self, ids: torch.Tensor, skip_attention: int | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab]; with `skip_attention`, that layer's attention slot left out."""
        return self.logits(self.stream(ids, skip_attention))

    def remove_attention(self, index: int) -> None:
        """Attention no_op: the layer keeps only its FFN (and that FFN's norm)."""
        layer = self.layers[index]
        for name in ("self_attn", "input_layernorm"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.attention, layer.has_attention, layer.cached = "none", False, False
        self.kinds[index] = LayerKind("none", 0, self.kinds[index].ffn)

    def set_linear(self, index: int, weight: torch.Tensor) -> None:
        """Puzzle's replace_with_linear: attention -> one Linear `weight` [out, in] after the layer's own
        input norm (kept)."""
        layer = self.layers[index]
        linear = LinearAttention(self.config.hidden)
        linear.linear_attn.weight.data.copy_(weight)
        layer.self_attn = linear
        layer.attention, layer.has_attention, layer.cached = "linear", True, False
        self.kinds[index] = LayerKind("linear", 0, self.kinds[index].ffn)


def load_checkpoint(folder: str | Path) -> PruneModel:
    """The checkpoint in `folder` (config.json + safetensors) as a float32 PruneModel; UserError for a model
    not Llama-family or Nemotron-NAS, or with a layer kind the torch model lacks (biases, sliding window)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: pass a Hugging Face checkpoint folder (config.json, "
                        "*.safetensors)")
    config = read_config(folder)
    spec = decode_spec(config)
    checkpoint = open_checkpoint(folder)
    state = {}
    handles: dict[Path, object] = {}
    for name, (shape, where) in expected_tensors(config).items():
        entry = checkpoint.tensors.get(name)
        if entry is None:
            raise UserError(f"{folder}: tensor {name} is missing from the checkpoint ({where})")
        if tuple(entry.shape) != tuple(shape):
            raise UserError(f"{folder}: tensor {name} has shape {list(entry.shape)}, config.json "
                            f"({where}) says {list(shape)}")
        if entry.file not in handles:
            handles[entry.file] = safe_open(str(entry.file), framework="pt")
        state[name] = handles[entry.file].get_tensor(name).to(torch.float32)
    with torch.device("meta"):
        net = DecodeLlama(spec)
    net.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    inv_freq, _ = rope_parameters(config.rope, config.head_dim)
    net.model.inv_freq = torch.from_numpy(inv_freq.copy())
    left = [n for n, p in net.named_parameters() if p.is_meta]
    if left:
        raise UserError(f"{folder}: the checkpoint does not hold {left[0]}")
    net.eval().requires_grad_(False)
    return PruneModel(folder, config, net, list(spec.kinds))
