"""A fused group's wide FFN as a torch module (FusedFFN), started from the fused block's weights
(GroupWeights) or from the original blocks concatenated (concatenated)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from passes.blocks import Block
from passes.matching import strip_cast
from passes.reference import norm_weight


class FusedFFN(torch.nn.Module):
    """x + down(silu(z gate) * (z up)), z = x / rms(x) * norm_weight: the fused block's FFN sub-block."""

    def __init__(self, gate: np.ndarray, up: np.ndarray, down: np.ndarray, norm: np.ndarray, eps: float):
        super().__init__()

        def param(a: np.ndarray) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.tensor(np.asarray(a, dtype=np.float32)))

        self.gate, self.up, self.down, self.norm = param(gate), param(up), param(down), param(norm)
        self.eps = eps

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return torch.nn.functional.silu(z @ self.gate) * (z @ self.up)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """What the output holds besides hidden @ down (fit.py refits down against target - base)."""
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.hidden(x) @ self.down

    @torch.no_grad()
    def apply(self, x: np.ndarray, batch: int = 4096) -> np.ndarray:
        flat = x.reshape(-1, x.shape[-1])
        out = [
            self(torch.from_numpy(np.ascontiguousarray(flat[s : s + batch], np.float32))).numpy()
            for s in range(0, len(flat), batch)
        ]
        return np.concatenate(out).reshape(x.shape)


@dataclass
class GroupWeights:
    """The fused block's FFN weights as [in, out] float32 arrays and where they live in the graph."""

    block: Block
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    norm: np.ndarray
    own_norm: bool  # the norm weight is an initializer only this norm reads (else it stays fixed)

    @classmethod
    def read(cls, block: Block) -> GroupWeights:
        ffn = block.ffn
        gate, up, down = (w.matrix().astype(np.float32) for w in (ffn.gate, ffn.up, ffn.down))
        for w in (ffn.gate, ffn.up, ffn.down):
            w.release()
        weight = block.norm.weight
        if weight is None:
            return cls(block, gate, up, down, np.ones(gate.shape[0], np.float32), False)
        source = strip_cast(weight)
        norm = source.const_value.numpy().astype(np.float32)
        return cls(block, gate, up, down, norm, len(source.uses()) == 1 and weight is source)

    def fingerprint(self) -> str:
        """sha256 of gate, up, down and norm as float32 [in, out]: the same for every graph of one model
        fused with one plan (prefill or decode, whatever the layout its exporter stored)."""
        digest = hashlib.sha256()
        for array in (self.gate, self.up, self.down, self.norm):
            digest.update(np.ascontiguousarray(array, np.float32).tobytes())
        return digest.hexdigest()

    def module(self) -> FusedFFN:
        module = FusedFFN(self.gate, self.up, self.down, self.norm, self.block.norm.eps)
        # Without a norm weight of its own (fold: unit norm), the scale is left to the rows of gate and up,
        # which express it exactly: z diag(w) W_gate = z (diag(w) W_gate).
        module.norm.requires_grad_(self.own_norm)
        return module

    def update(self, module: FusedFFN) -> None:
        params = (module.gate, module.up, module.down, module.norm)
        self.gate, self.up, self.down, self.norm = (p.detach().numpy().copy() for p in params)


def fingerprint(members: list[GroupWeights]) -> str:
    """The starting weights of a group: its fused FFN's fingerprint, or for a parallel group (one FFN per
    member) the sha256 of its members' fingerprints in block order."""
    if len(members) == 1:
        return members[0].fingerprint()
    return hashlib.sha256("".join(m.fingerprint() for m in members).encode()).hexdigest()


def concatenated(group: list[Block], mode: str) -> FusedFFN:
    """The exact wide FFN that fusing `group` with norm `mode` gives (as passes/fuse.py builds it), read
    from the original blocks: gate/up concatenated along the width (rows scaled by each block's own norm
    weight for "fold", unit norm), down along its input dimension. Blocks without a SwiGLU FFN
    (attention-only or no-node layers inside a group) add nothing, as in passes.fuse.ffn_members."""
    group = [b for b in group if b.ffn is not None]
    parts = {"gate": [], "up": [], "down": []}
    for block in group:
        scale = norm_weight(block) if mode == "fold" else None
        for key, part in parts.items():
            weight = getattr(block.ffn, key)
            matrix = weight.matrix().astype(np.float32)
            weight.release()
            part.append(
                matrix * scale[:, None].astype(np.float32) if scale is not None and key != "down" else matrix
            )
    hidden = parts["gate"][0].shape[0]
    last = norm_weight(group[-1]) if mode == "last" else None
    norm = np.ones(hidden, np.float32) if last is None else last.astype(np.float32)
    gate, up = (np.concatenate(parts[k], axis=1) for k in ("gate", "up"))
    return FusedFFN(gate, up, np.concatenate(parts["down"]), norm, group[-1].norm.eps)
