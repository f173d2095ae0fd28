"""Model specifications: the per-block shape of a Llama/DeciLM-style model (no torch needed).

A `ModelSpec` lists its blocks in residual-stream order (docs/design.md §2). Each block has an FFN of its own
width and, optionally, an attention sub-block before it. `super49b_spec` builds the shape of
Llama-3.3-Nemotron-Super-49B (Puzzle-49B, docs/design.md §6) at any hidden size.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from passes.errors import UserError

# The paper's rounding granularity for FFN widths (docs/design.md §6: ceil256).
PAPER_FFN_GRANULARITY = 256
# Used by `super49b_spec` below this hidden size, so that small models keep distinct, small widths.
SMALL_HIDDEN = 1024
SMALL_FFN_GRANULARITY = 8


@dataclass
class BlockSpec:
    """One block: an optional attention sub-block, then a SwiGLU FFN of intermediate width `ffn_width`."""

    attention: bool
    ffn_width: int


@dataclass
class ModelSpec:
    """Shape of a Llama-family model whose blocks may lack attention and differ in FFN width."""

    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    blocks: list[BlockSpec] = field(default_factory=list)
    eps: float = 1e-5
    rope_theta: float = 1e5
    tie_embeddings: bool = True
    head_dim: int | None = None

    def __post_init__(self) -> None:
        self.blocks = [b if isinstance(b, BlockSpec) else BlockSpec(**b) for b in self.blocks]
        validate_spec(self)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def attention_flags(self) -> list[bool]:
        return [b.attention for b in self.blocks]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        if not isinstance(data, dict):
            raise UserError("model spec must be a JSON object")
        known = {"hidden", "heads", "kv_heads", "vocab", "blocks", "eps", "rope_theta", "tie_embeddings",
                 "head_dim"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"model spec: unknown keys {unknown}; allowed keys are {sorted(known)}")
        missing = sorted({"hidden", "heads", "kv_heads", "vocab", "blocks"} - set(data))
        if missing:
            raise UserError(f"model spec: missing keys {missing}")
        blocks = data["blocks"]
        if not isinstance(blocks, list):
            raise UserError("model spec: 'blocks' must be a list of "
                            "{\"attention\": bool, \"ffn_width\": int}")
        parsed = [_block_from_dict(i, b) for i, b in enumerate(blocks)]
        return cls(**{**data, "blocks": parsed})


def _block_from_dict(index: int, data: Any) -> BlockSpec:
    if not isinstance(data, dict) or set(data) != {"attention", "ffn_width"}:
        raise UserError(f"model spec: block {index} must be {{\"attention\": bool, \"ffn_width\": int}}, "
                        f"got {data!r}")
    return BlockSpec(attention=data["attention"], ffn_width=data["ffn_width"])


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"model spec: {name} must be an integer >= {minimum}, got {value!r}")


def validate_spec(spec: ModelSpec) -> None:
    """Raise UserError when the spec cannot describe a model."""
    for name in ("hidden", "heads", "kv_heads", "vocab"):
        _check_int(name, getattr(spec, name))
    if spec.head_dim is not None:
        _check_int("head_dim", spec.head_dim)
        if spec.head_dim % 2:
            raise UserError(f"model spec: head_dim must be even (rotary), got {spec.head_dim}")
    elif spec.hidden % spec.heads or (spec.hidden // spec.heads) % 2:
        raise UserError(f"model spec: hidden {spec.hidden} must split into {spec.heads} heads of even size "
                        "(or give head_dim)")
    if spec.heads % spec.kv_heads:
        raise UserError(f"model spec: heads {spec.heads} must be a multiple of kv_heads {spec.kv_heads}")
    if not spec.blocks:
        raise UserError("model spec: 'blocks' is empty")
    for i, block in enumerate(spec.blocks):
        if not isinstance(block.attention, bool):
            raise UserError(f"model spec: block {i} attention must be true or false, got {block.attention!r}")
        _check_int(f"block {i} ffn_width", block.ffn_width)
    if not isinstance(spec.eps, int | float) or spec.eps <= 0:
        raise UserError(f"model spec: eps must be a positive number, got {spec.eps!r}")
    if not isinstance(spec.rope_theta, int | float) or spec.rope_theta <= 0:
        raise UserError(f"model spec: rope_theta must be a positive number, got {spec.rope_theta!r}")
    if not isinstance(spec.tie_embeddings, bool):
        raise UserError(f"model spec: tie_embeddings must be true or false, got {spec.tie_embeddings!r}")


def load_spec(path: str | os.PathLike) -> ModelSpec:
    """Read a ModelSpec from a JSON file (the format `save_spec` writes)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise UserError(f"model spec file not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise UserError(f"model spec {path} is not valid JSON: {exc}") from exc
    return ModelSpec.from_dict(data)


def save_spec(spec: ModelSpec, path: str | os.PathLike) -> None:
    """Write a ModelSpec as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec.to_dict(), f, indent=1)
        f.write("\n")



def ffn_width(ffn_mult: float, hidden: int, granularity: int = PAPER_FFN_GRANULARITY) -> int:
    """DeciLM's FFN width: int(2 * ffn_mult * hidden / 3) rounded up to a multiple of `granularity`."""
    return math.ceil(int(2 * ffn_mult * hidden / 3) / granularity) * granularity


# design §6, Llama-3.3-Nemotron-Super-49B-v1: (first block, last block, attention, ffn_mult per block).
_SUPER49B_RUNS: list[tuple[int, int, bool, list[float]]] = [
    (0, 0, True, [2.625]),
    (1, 5, True, [5.25]),
    (6, 7, False, [2.625]),
    (8, 10, True, [5.25]),
    (11, 11, False, [3.28125]),
    (12, 41, True, [5.25]),
    (42, 51, False, [1.3125, 2.625, 2.625, 1.3125, 5.25, 1.3125, 2.625, 1.3125, 1.3125, 1.3125]),
    (52, 52, True, [5.25]),
    (53, 70, False, [1.3125, 1, 1, 1.3125, 1, 1, 1, 1.3125, 1.3125, 0.5, 0.5, 1, 1, 0.5, 0.5, 1, 0.5, 0.5]),
    (71, 79, True, [5.25]),
]


def super49b_pattern() -> list[tuple[bool, float]]:
    """The 80 (attention, ffn_mult) pairs of Puzzle-49B, block 0 first."""
    pattern: list[tuple[bool, float]] = []
    for first, last, attention, mults in _SUPER49B_RUNS:
        count = last - first + 1
        mults = mults * count if len(mults) == 1 else mults
        assert len(mults) == count and len(pattern) == first
        pattern.extend((attention, m) for m in mults)
    return pattern


def super49b_spec(hidden: int = 64, heads: int = 8, kv_heads: int = 1, vocab: int = 256,
                  granularity: int | None = None, **kwargs: Any) -> ModelSpec:
    """Puzzle-49B's per-block pattern (80 blocks) at a chosen size.

    FFN width = `ffn_width(ffn_mult, hidden, granularity)`. `granularity=None` picks the paper's 256 when
    hidden >= 1024 and 8 below that, so a small model keeps distinct small widths (at hidden 64:
    0.5 -> 24, 1 -> 48, 1.3125 -> 56, 2.625 -> 112, 3.28125 -> 144, 5.25 -> 224). The real shape is
    `super49b_spec(hidden=8192, heads=64, kv_heads=8, vocab=128256)`. Extra keyword arguments go to
    ModelSpec (eps, rope_theta, tie_embeddings, head_dim).
    """
    if granularity is None:
        granularity = PAPER_FFN_GRANULARITY if hidden >= SMALL_HIDDEN else SMALL_FFN_GRANULARITY
    _check_int("granularity", granularity)
    blocks = [BlockSpec(attention=a, ffn_width=ffn_width(m, hidden, granularity))
              for a, m in super49b_pattern()]
    return ModelSpec(hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, blocks=blocks, **kwargs)


def requested_spec(path: str | os.PathLike | None = None, *, hidden: int = 64, heads: int = 8,
                   kv_heads: int = 1, vocab: int = 256) -> ModelSpec:
    """The spec in the JSON file at `path`, or without one Puzzle-49B's pattern at this size (the two spec
    sources of tools/export_model.py, --spec and --super49b)."""
    if path:
        return load_spec(path)
    return super49b_spec(hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
