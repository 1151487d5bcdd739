"""Checks of cute_ep.autograd shared by the CPU test (reference backend, gloo) and the GPU test.

Both run the same two checks on any buffer with the EpBuffer API (``make_buffer(cfg)`` returns one,
usable as a context manager) and tensors on ``device``:

* ``gradient_check``: dispatch -> per-expert linear -> combine, every gradient (x, top-k weights,
  expert matrices) against plain torch autograd of the same global loss computed densely from every
  rank's inputs (fp32, ragged token counts including a rank with none, a dropped pair);
* ``train``: a two-layer MoE (router softmax -> top-k weights, experts owned by their ranks, the
  router replicated with its gradient averaged) trained with SGD; the loss curve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cute_ep import autograd as ep
from cute_ep.collectives import all_gather_objects
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import local_expert_of_rows

__all__ = ["gradient_check", "train"]

H, K, EL = 16, 2, 2  # hidden, top-k, experts per rank
TOKENS = (12, 7, 0, 9, 5, 11, 3, 8)  # per rank (ragged; rank 2 has none)


def expert_forward(recv_x: torch.Tensor, tpe: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Row i goes through its local expert's matrix: y[i] = recv_x[i] @ weights[local expert of i]."""
    local = local_expert_of_rows(tpe)
    return torch.einsum("nh,nhg->ng", recv_x, weights[local])


def gradient_check(runtime: Any, make_buffer: Callable[[EpConfig], Any], device: torch.device) -> dict:
    """Gradients of dispatch -> per-expert linear -> combine against dense torch autograd (fp32).

    Collective. Returns this rank's max abs errors of the output and of the gradients of x, the
    top-k weights and the rank's expert matrices, plus the scale of the reference gradient."""
    R, rank = runtime.env.world_size, runtime.env.rank
    E = EL * R
    T = TOKENS[rank % len(TOKENS)]
    cfg = EpConfig(world_size=R, local_world_size=runtime.env.local_world_size, num_experts=E, topk=K,
                   hidden=H, dtype=torch.float32, max_tokens=max(TOKENS))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    idx = idx.to(torch.int64)
    if T:
        idx[0, 1] = -1  # a dropped pair
    w = torch.rand(T, K, generator=g).requires_grad_()
    G = torch.randn(T, H, generator=g)  # d loss / d out
    W_all = torch.randn(E, H, H, generator=torch.Generator().manual_seed(7)) / H**0.5
    W_mine = W_all[rank * EL:(rank + 1) * EL].clone().requires_grad_()

    dev = dict(device=device)
    with make_buffer(cfg) as buf:
        res = ep.dispatch(buf, x.to(**dev), idx.to(**dev), w.detach().to(**dev))
        y = expert_forward(res.recv_x, res.tokens_per_expert, W_mine.to(**dev))
        out = ep.combine(buf, y, w.to(**dev), res.handle)
        (out * G.to(**dev)).sum().backward()
        out = out.detach().cpu()

    # Dense reference of the same global loss (sum over ranks), from everyone's inputs.
    everyone = all_gather_objects((x.detach(), idx, w.detach(), G), runtime.cpu_group)
    xs = [e[0].clone().requires_grad_() for e in everyone]
    ws = [e[2].clone().requires_grad_() for e in everyone]
    W = W_all.clone().requires_grad_()
    total = torch.zeros(())
    for s, (_, idx_s, _, G_s) in enumerate(everyone):
        for k in range(K):
            keep = idx_s[:, k] >= 0
            if keep.any():
                e = idx_s[keep, k]
                y_s = torch.einsum("nh,nhg->ng", xs[s][keep], W[e])
                total = total + (ws[s][keep, k, None] * y_s * G_s[keep]).sum()
    total.backward()

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max()) if a.numel() else 0.0

    ref_out = torch.zeros(T, H)
    for k in range(K):
        keep = idx[:, k] >= 0
        rows = torch.einsum("nh,nhg->ng", x.detach()[keep], W_all[idx[keep, k]])
        ref_out[keep] += w.detach()[keep, k, None] * rows
    return {
        "tokens": T,
        "out_err": err(out, ref_out),
        "x_grad_err": err(x.grad, xs[rank].grad),
        "w_grad_err": err(w.grad, ws[rank].grad),
        "expert_grad_err": err(W_mine.grad, W.grad[rank * EL:(rank + 1) * EL]),
        "w_grad_dropped": float(w.grad[0, 1]) if T else 0.0,
        "grad_scale": float(W.grad.abs().max()),
    }


def train(runtime: Any, make_buffer: Callable[[EpConfig], Any], device: torch.device,
          steps: int = 40) -> dict:
    """Two MoE layers (residual), a replicated router per layer, experts owned by their ranks; SGD on
    a teacher's outputs. Collective. Returns the mean loss over ranks after every step."""
    R, rank = runtime.env.world_size, runtime.env.rank
    E, T = EL * R, 24
    cfg = EpConfig(world_size=R, local_world_size=runtime.env.local_world_size, num_experts=E, topk=K,
                   hidden=H, dtype=torch.float32, max_tokens=T)
    torch.manual_seed(0)  # the router and the teacher are the same on every rank
    routers = [torch.nn.Linear(H, E).to(device) for _ in range(2)]
    teacher = (torch.randn(H, H) / H**0.5).to(device)
    gen = torch.Generator().manual_seed(1000 + rank)
    experts = [(torch.randn(EL, H, H, generator=gen) * 0.1).to(device).requires_grad_() for _ in range(2)]
    params = [p for r in routers for p in r.parameters()] + experts
    opt = torch.optim.SGD(params, lr=0.2)
    data = torch.randn(T, H, generator=gen).to(device)
    target = torch.tanh(data @ teacher)
    losses = []
    with make_buffer(cfg) as buf:
        for _ in range(steps):
            h = data
            for router, weights in zip(routers, experts, strict=True):
                probs = torch.softmax(router(h), dim=-1)
                top_w, top_i = probs.topk(K, dim=-1)
                res = ep.dispatch(buf, h, top_i.to(torch.int32), top_w.detach())
                y = torch.tanh(expert_forward(res.recv_x, res.tokens_per_expert, weights))
                h = h + ep.combine(buf, y, top_w, res.handle)
            loss = torch.nn.functional.mse_loss(h, target)
            opt.zero_grad()
            loss.backward()
            for r in routers:  # replicated parameters: average their gradients over the ranks
                for p in r.parameters():
                    grad = p.grad.cpu()
                    dist.all_reduce(grad, group=runtime.cpu_group)
                    p.grad.copy_(grad / R)
            opt.step()
            mean = torch.tensor([loss.item()])
            dist.all_reduce(mean, group=runtime.cpu_group)
            losses.append(float(mean) / R)
    return {"losses": losses}


