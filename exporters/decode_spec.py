"""Per-layer kinds of a decode graph (no torch): what a Nemotron-NAS / Puzzle layer holds (design §7).

A `ModelSpec` block has softmax attention with the model's one KV-head count, or none, and a SwiGLU FFN.
Puzzle checkpoints also vary the KV-head count per layer, replace attention or the FFN by one
hidden x hidden Linear, and drop the FFN. `DecodeSpec` is a ModelSpec with one `LayerKind` per block
saying which; exporters/decode.py builds its torch model from it, and only "gqa" layers get a KV cache.

    spec = DecodeSpec(hidden=64, heads=4, kv_heads=2, vocab=96, blocks=[...],
                      kinds=[LayerKind("gqa", 2, "swiglu"), LayerKind("linear", 0, "none"), ...])
    spec.cache_layers, spec.layer_kv_heads(0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exporters.spec import ModelSpec
from passes.errors import UserError

# The decode graph's metadata (exporters/decode.py's torch export and exporters/hf/decode_graph.py write it).
FORMAT = "ffn-fusion-decode/2"  # /2: kv_heads lists each cached layer's count

ATTENTION_KINDS = ("gqa", "linear", "none")
FFN_KINDS = ("swiglu", "linear", "none")


@dataclass(frozen=True)
class LayerKind:
    """attention: "gqa" (softmax, `kv_heads` KV heads, a KV cache) | "linear" (one hidden x hidden Linear,
    no cache) | "none"; ffn: "swiglu" (the block's ffn_width) | "linear" | "none"."""

    attention: str = "gqa"
    kv_heads: int = 0  # gqa only
    ffn: str = "swiglu"


def default_kinds(spec: ModelSpec) -> list[LayerKind]:
    """A plain ModelSpec's kinds: GQA with the model's KV heads where a block has attention, SwiGLU FFNs."""
    return [
        LayerKind("gqa", spec.kv_heads, "swiglu") if b.attention else LayerKind("none", 0, "swiglu")
        for b in spec.blocks
    ]


@dataclass
class DecodeSpec(ModelSpec):
    """A ModelSpec with one LayerKind per block. `blocks[i].attention` is true for "gqa" and "linear";
    `blocks[i].ffn_width` is read for "swiglu" only. `kv_heads` is the first cached layer's count."""

    kinds: list[LayerKind] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kinds:
            self.kinds = default_kinds(self)
        if len(self.kinds) != self.n_blocks:
            raise UserError(f"decode spec: {len(self.kinds)} layer kinds for {self.n_blocks} blocks")
        for i, (kind, block) in enumerate(zip(self.kinds, self.blocks, strict=True)):
            if kind.attention not in ATTENTION_KINDS or kind.ffn not in FFN_KINDS:
                raise UserError(f"decode spec: layer {i} has unknown kinds {kind.attention!r}/{kind.ffn!r}")
            if block.attention != (kind.attention != "none"):
                raise UserError(f"decode spec: block {i}'s attention flag contradicts {kind.attention!r}")
            if kind.attention == "gqa" and (kind.kv_heads < 1 or self.heads % kind.kv_heads):
                raise UserError(
                    f"decode spec: layer {i}'s {kind.kv_heads} KV heads must divide {self.heads} heads"
                )

    @property
    def cache_layers(self) -> list[int]:
        return cache_layers(self)

    def layer_kv_heads(self, index: int) -> int:
        return self.kinds[index].kv_heads


def kinds_of(spec: ModelSpec) -> list[LayerKind]:
    """The layer kinds of any spec: a DecodeSpec's own, a plain ModelSpec's defaults."""
    return spec.kinds if isinstance(spec, DecodeSpec) else default_kinds(spec)


def cache_layers(spec: ModelSpec) -> list[int]:
    """The layers with a KV cache: softmax attention ("gqa") only."""
    return [i for i, kind in enumerate(kinds_of(spec)) if kind.attention == "gqa"]


def cache_kv_heads(spec: ModelSpec) -> list[int]:
    """KV heads of each cached layer, in cache_layers order."""
    kinds = kinds_of(spec)
    return [kinds[i].kv_heads for i in cache_layers(spec)]


def describe(spec: ModelSpec) -> dict:
    """The `ffn_fusion.decode` metadata: cached layers and each one's KV heads (they may differ per layer)."""
    return {
        "format": FORMAT,
        "cache_layers": cache_layers(spec),
        "kv_heads": cache_kv_heads(spec),
        "head_dim": spec.resolved_head_dim,
        "vocab": spec.vocab,
        "n_blocks": spec.n_blocks,
    }
