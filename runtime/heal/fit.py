"""Fitting a group's FFN weights to its streams: the objective (relative squared error), Adam steps on all
weights, and the closed-form (ridge least squares) refit of the down projection.

A module here computes base(x) + hidden(x) @ down: a fused group's FusedFFN (base: the stream x) or a
parallel group's ParallelFFNs (parallel.py; x packs the stream and each member's h_k, base = x + sum_k a_k).
Either way the output is linear in `down`, which the refit solves for."""

from __future__ import annotations

import math

import numpy as np
import torch

from runtime.heal.ffn import FusedFFN
from runtime.heal.metadata import HealConfig
from runtime.heal.parallel import ParallelFFNs


def relative_squared_error(pred: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """sum ||pred - y||^2 / sum ||y - x||^2, in float64."""
    p, x, y = (np.asarray(a, np.float64) for a in (pred, x, y))
    return float(((p - y) ** 2).sum() / max(((y - x) ** 2).sum(), 1e-300))


def fit(module: FusedFFN | ParallelFFNs, x: np.ndarray, y: np.ndarray, config: HealConfig) -> None:
    """Adam steps on all weights, then (ridge > 0) the down projection refitted in closed form."""
    adam(module, x, y, config)
    if config.ridge > 0:
        refit_down(module, x, y, config.ridge)


def refit_down(
    module: FusedFFN | ParallelFFNs, x: np.ndarray, y: np.ndarray, ridge: float, chunk: int = 2048
) -> None:
    """The down projection that minimizes ||h D - (y - x)||^2 + lam ||D - D_0||^2 for the current gate
    and up (h: the SwiGLU hidden activations, N tokens x width W), lam = ridge * mean_t ||h_t||^2: least
    squares, regularized towards the current D. With N >= W the W x W Gram matrix is accumulated over
    token chunks; with fewer tokens the N x N form D_0 + h^T (h h^T + lam)^-1 r is solved instead."""
    targets = y.reshape(-1, y.shape[-1])
    rows = x.reshape(len(targets), *x.shape[y.ndim - 1 :])  # [N, hidden], or packed [N, 1 + n, hidden]

    def residuals(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = torch.from_numpy(np.ascontiguousarray(rows[s : s + chunk], np.float32))
        h = module.hidden(xs)
        ys = torch.from_numpy(np.ascontiguousarray(targets[s : s + chunk], np.float32))
        return h, ys - module.base(xs) - h @ module.down

    with torch.no_grad():
        width, count = module.down.shape[0], len(rows)
        if count < width:
            h, r = (torch.cat(parts) for parts in zip(*map(residuals, range(0, count, chunk)), strict=True))
            kernel = h @ h.T
            lam = ridge * float(kernel.diagonal().sum()) / count
            kernel.diagonal().add_(lam)
            module.down.add_(h.T @ torch.cholesky_solve(r, torch.linalg.cholesky(kernel)))
            return
        gram = torch.zeros(width, width)
        rhs = torch.zeros_like(module.down)
        for s in range(0, count, chunk):
            h, r = residuals(s)
            gram.addmm_(h.T, h)
            rhs.addmm_(h.T, r)
        lam = ridge * float(gram.diagonal().sum()) / count
        gram.diagonal().add_(lam)
        module.down.add_(torch.cholesky_solve(rhs, torch.linalg.cholesky(gram)))


def adam(module: FusedFFN | ParallelFFNs, x: np.ndarray, y: np.ndarray, config: HealConfig) -> None:
    """Adam with a cosine learning-rate decay on minibatches of calibration tokens."""
    if config.steps == 0:
        return
    generator = torch.Generator().manual_seed(config.seed)
    ys = torch.from_numpy(y.reshape(-1, y.shape[-1]).astype(np.float32))
    xs = torch.from_numpy(x.reshape(len(ys), *x.shape[y.ndim - 1 :]).astype(np.float32))
    with torch.no_grad():
        scale = (ys - module.base(xs)).pow(2).sum(-1)  # each token's own target size ("token" loss)
    mean_scale = scale.mean()
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / config.steps))
    )
    count = xs.shape[0]
    for _ in range(config.steps):
        index = (
            torch.randperm(count, generator=generator)[: config.batch_tokens]
            if config.batch_tokens < count
            else slice(None)
        )
        error = (module(xs[index]) - ys[index]).pow(2).sum(-1)
        if config.loss == "token":
            loss = (error / scale[index].clamp_min(1e-12 * mean_scale)).mean()
        else:
            loss = error.mean() / mean_scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    optimizer.zero_grad(set_to_none=True)
