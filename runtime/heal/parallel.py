"""A full-block parallel group's FFNs as one torch module (ParallelFFNs), the thing healing fits for it.

The parallel form of blocks i..j (passes/parallel.py, design §10) computes

    y = x + sum_k a_k + sum_k FFN_k(norm2_k(h_k)),   a_k = Attn_k(norm1_k(x)),   h_k = x + a_k

Every member's attention reads x in the parallel form as in block k of the original run on x, so a_k and h_k
are the ORIGINAL block k's (BlockRunner.run_attention on x) and stay fixed; the members' FFNs (gate, up,
down, norm2 weight) are what healing fits so that y approaches the original's sequential output. The
module reads packed rows [N, 1 + n, hidden]: the stream x, then each member's h_k. Its output is linear
in the members' down projections stacked along their input (width) dimension, `down`, so fit.py's
closed-form refit solves for all of them at once, like the down projection of a fused group's wide FFN.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.heal.ffn import GroupWeights


def pack(x: np.ndarray, members: list[np.ndarray]) -> np.ndarray:
    """The module's input: the stream x [..., hidden] and each member's h_k, stacked [..., 1 + n, hidden]."""
    return np.stack([x, *members], axis=-2)


class ParallelFFNs(torch.nn.Module):
    """x + sum_k (h_k - x) + sum_k down_k(silu(z_k gate_k) * (z_k up_k)), z_k = h_k / rms(h_k) * norm_k."""

    def __init__(self, members: list[GroupWeights]):
        super().__init__()

        def param(a: np.ndarray) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.tensor(np.asarray(a, dtype=np.float32)))

        self.gates = torch.nn.ParameterList(param(m.gate) for m in members)
        self.ups = torch.nn.ParameterList(param(m.up) for m in members)
        self.norms = torch.nn.ParameterList(param(m.norm) for m in members)
        for norm, member in zip(self.norms, members, strict=True):
            norm.requires_grad_(member.own_norm)  # a shared or absent norm weight stays as it is
        self.down = param(np.concatenate([m.down for m in members]))
        self.eps = [m.block.norm.eps for m in members]
        self.widths = [m.gate.shape[1] for m in members]

    def hidden(self, packed: torch.Tensor) -> torch.Tensor:
        """Every member's SwiGLU hidden activations on its own h_k, side by side [N, sum of widths]."""
        parts = []
        members = zip(self.gates, self.ups, self.norms, self.eps, strict=True)
        for k, (gate, up, norm, eps) in enumerate(members):
            h = packed[..., k + 1, :]
            z = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm
            parts.append(torch.nn.functional.silu(z @ gate) * (z @ up))
        return torch.cat(parts, -1)

    def base(self, packed: torch.Tensor) -> torch.Tensor:
        """x + sum_k a_k (a_k = h_k - x): the group's output without its FFNs."""
        x = packed[..., 0, :]
        return x + (packed[..., 1:, :] - x.unsqueeze(-2)).sum(-2)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        return self.base(packed) + self.hidden(packed) @ self.down

    @torch.no_grad()
    def apply(self, packed: np.ndarray, batch: int = 4096) -> np.ndarray:
        """The group's output stream [..., hidden] for packed inputs [..., 1 + n, hidden]."""
        flat = packed.reshape(-1, *packed.shape[-2:])
        out = [
            self(torch.from_numpy(np.ascontiguousarray(flat[s : s + batch], np.float32))).numpy()
            for s in range(0, len(flat), batch)
        ]
        return np.concatenate(out).reshape(*packed.shape[:-2], packed.shape[-1])

    def update(self, members: list[GroupWeights]) -> None:
        """The fitted weights into each member's record (down split back along the widths)."""
        downs = torch.split(self.down.detach(), self.widths)
        for k, member in enumerate(members):
            member.gate, member.up, member.norm, member.down = (
                p.detach().numpy().copy() for p in (self.gates[k], self.ups[k], self.norms[k], downs[k])
            )
