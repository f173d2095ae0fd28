"""Blockwise local distillation of pruned layers (docs/pruning.md, design §12), with heal's closed-form fit.

In layer order over the PRUNED model's own stream x (what the layer will see once deployed), each pruned
layer is fitted to the ORIGINAL layer's output on that same x, y = layer_orig(x):

- attention `no_op`: the layer computes x + FFN(x); its down projection is refitted by ridge least squares
  (runtime.heal.fit.refit_down: minimize ||h D - (y - x)||^2 + lam ||D - D_0||^2);
- `--linear` (Puzzle's replace_with_linear): first one hidden x hidden Linear W after the layer's input
  norm is fitted the same way to the original attention's output, a = Attn(norm(x)) (from W_0 = 0), then
  the FFN's down projection to y on the stream x + norm(x) W.

Measured on SmolLM2 (design §12): targets from the original model's own stream were worse in 8 of 8 cases,
and Adam on gate/up/down added little to the refit. `end_to_end` optionally runs Adam steps on the changed
layers' weights against the original logits (KL), on calibration windows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from runtime.heal.ffn import FusedFFN
from runtime.heal.fit import refit_down, relative_squared_error
from runtime.prune.importance import kl_per_position
from runtime.prune.model import PruneModel


@dataclass(frozen=True)
class LayerFit:
    layer: int
    kind: str  # "no_op" or "linear"
    before: float  # relative squared error of the surgery alone (||pred - y||^2 / ||y - x||^2)
    after: float
    seconds: float

    def line(self) -> str:
        return (f"layer {self.layer} ({self.kind}): relative squared error {self.before:.4f} -> "
                f"{self.after:.4f} ({self.seconds:.1f} s)")


class _LinearBranch(torch.nn.Module):
    """x + norm(x) @ down: what refit_down solves for when the attention becomes one Linear (down: W^T)."""

    def __init__(self, norm: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.norm = norm
        self.down = torch.nn.Parameter(torch.zeros(hidden, hidden))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.hidden(x) @ self.down


def _chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """fn over windows [n, seq, hidden], `chunk` windows at a time (bounds the attention's memory)."""
    return torch.cat([fn(x[s : s + chunk]) for s in range(0, len(x), chunk)])


def _ffn_module(model: PruneModel, index: int) -> FusedFFN:
    """Layer `index`'s SwiGLU as heal's FusedFFN ([in, out] weights)."""
    layer = model.layers[index]
    mlp = layer.mlp
    return FusedFFN(
        mlp.gate_proj.weight.T.numpy(),
        mlp.up_proj.weight.T.numpy(),
        mlp.down_proj.weight.T.numpy(),
        layer.post_attention_layernorm.weight.numpy(),
        layer.post_attention_layernorm.variance_epsilon,
    )


@torch.no_grad()
def distill_local(
    original: PruneModel,
    pruned: PruneModel,
    layers: list[int],
    calib: np.ndarray,
    ridge: float,
    linear: bool = False,
    log: Callable[[str], None] = lambda m: None,
) -> list[LayerFit]:
    """Remove (or linearize) attention in `layers` of `pruned` and refit each such layer in place, in layer
    order (module docstring). `pruned` starts as a copy of `original`; `calib` is token windows [n, seq]."""
    chosen = set(layers)
    x = original.embed(torch.from_numpy(np.ascontiguousarray(calib)))
    fits = []
    for i in range(pruned.n_layers):
        if i not in chosen:
            x = _chunked(lambda s, i=i: pruned.run_layer(i, s), x)
            continue
        start = time.perf_counter()
        y = _chunked(lambda s, i=i: original.run_layer(i, s), x)
        rows = x.reshape(-1, x.shape[-1]).numpy()
        if linear:
            attention = _chunked(lambda s, i=i: original.attention(i, s), x)
            branch = _LinearBranch(original.layers[i].input_layernorm, x.shape[-1])
            refit_down(branch, rows, (x + attention).reshape(rows.shape).numpy(), ridge)
            pruned.set_linear(i, branch.down.T.contiguous())
            h = x + _chunked(lambda s, i=i: pruned.attention(i, s), x)
        else:
            pruned.remove_attention(i)
            h = x
        kind = "linear" if linear else "no_op"
        if pruned.kinds[i].ffn != "swiglu":  # a Linear or absent FFN: nothing of heal's form to refit
            x = h + _chunked(lambda s, i=i: pruned.ffn(i, s), h)
            continue
        module = _ffn_module(pruned, i)
        h_rows, y_rows = h.reshape(rows.shape).numpy(), y.reshape(rows.shape).numpy()
        before = relative_squared_error(module.apply(h_rows), h_rows, y_rows)
        refit_down(module, h_rows, y_rows, ridge)
        after = relative_squared_error(module.apply(h_rows), h_rows, y_rows)
        pruned.layers[i].mlp.down_proj.weight.copy_(module.down.T)
        x = h + _chunked(lambda s, i=i: pruned.ffn(i, s), h)
        fits.append(LayerFit(i, kind, before, after, time.perf_counter() - start))
        log(fits[-1].line())
    return fits


def end_to_end(
    original: PruneModel,
    pruned: PruneModel,
    layers: list[int],
    calib: np.ndarray,
    steps: int,
    lr: float = 5e-5,
    batch: int = 4,
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
) -> list[float]:
    """Adam steps on the changed layers' FFN (and Linear attention) weights, minimizing the mean
    KL(original || pruned) per position over random batches of calibration windows; returns the losses."""
    if steps <= 0:
        return []
    params = []
    for i in layers:
        layer = pruned.layers[i]
        params += list(layer.mlp.parameters()) + list(layer.post_attention_layernorm.parameters())
        if pruned.kinds[i].attention == "linear":
            params += list(layer.self_attn.parameters())
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=lr)
    decay = lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    generator = np.random.default_rng(seed)
    losses = []
    try:
        for step in range(steps):
            ids = torch.from_numpy(calib[generator.choice(len(calib), min(batch, len(calib)), replace=False)])
            with torch.no_grad():
                reference = original.forward(ids)
            loss = kl_per_position(reference, pruned.forward(ids)) / ids.numel()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if step % 10 == 0 or step == steps - 1:
                log(f"end-to-end step {step + 1}/{steps}: KL {losses[-1]:.4f}")
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return losses
