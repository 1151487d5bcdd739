"""ECHO: a toy MoE trained under Zipf-skewed routing, with and without elastic cloning of hot experts.

Every step each rank routes its tokens to K of E experts drawn from a Zipf distribution whose hot
experts change from step to step (cute_ep.skew), with the gates taken from a learned router's softmax.
The same training runs twice from the same start: once on the plain experts, once with
``cute_ep.ElasticExperts`` cloning the hot experts onto S spare slots per rank every step (plan, route,
weight copy before the experts, gradients back to their home expert after backward). Rank 0 prints the
max / mean rows received per rank of both runs, and PASS when both runs end with the same weights
within the stated fp32 tolerance (cloning splits an expert's weight-gradient sum into per-replica partial
sums: the same numbers added in another order).

To run:
    # CPU only: the pure-torch reference backend over gloo (also a world of one, without torchrun)
    python examples/echo_training.py --backend reference
    torchrun --nproc-per-node 4 examples/echo_training.py --backend reference

    # GPUs: the CuTe DSL kernels on NVSHMEM (EpBuffer), one rank per GPU
    torchrun --nproc-per-node 4 examples/echo_training.py

Rank 0 prints one line per run, then PASS (exit status 0) or FAIL (exit status 1).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep import ElasticExperts, EpConfig
from cute_ep import autograd as ep
from cute_ep.bootstrap import DistEnv, Runtime
from cute_ep.kernels.config import MAX_TOPK, nearest_valid_experts
from cute_ep.skew import zipf_topk
from cute_ep.tools.cli import BACKENDS, Printer, UsageError, make_buffer, runtime_backend, script_main
from cute_ep.tools.usage import script_parser

TOLERANCE = 1e-5
"""Largest |difference| allowed between the two runs' weights, relative to the largest |weight|: a few
hundred fp32 additions re-associated per gradient (eps 6e-8 each) over a few steps stay far below it."""


def row_slots(tokens_per_expert: Tensor, num_rows: int) -> Tensor:
    """[num_rows] int64: the local slot of each received row (rows are slot-major). A binary search over
    the slots' ends: no host sync, unlike repeat_interleave."""
    ends = torch.cumsum(tokens_per_expert.to(torch.int64), 0)
    rows = torch.arange(num_rows, device=ends.device)
    return torch.searchsorted(ends, rows, right=True).clamp_(max=tokens_per_expert.numel() - 1)


def experts_forward(recv_x: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """y[i] = tanh(recv_x[i] @ weights[slot of row i]): one [H, H] matrix per expert slot."""
    return torch.tanh(torch.einsum("nh,nhg->ng", recv_x, weights[slots]))


def train(args: argparse.Namespace, runtime: Any, group: Any, cloning: bool,
          make: Callable[[EpConfig], Any] | None = None) -> dict:
    """``args.steps`` SGD steps of the toy MoE on this rank's data; collective. ``make(cfg)`` builds the
    buffer (default: the ``--backend``'s). Returns the final expert weights of this rank's home experts
    and the router, the mean loss per step, and the rows each rank received per step."""
    env, dev = runtime.env, runtime.device
    R, rank = env.world_size, env.rank
    E, K, H, T = args.experts, args.topk, args.hidden, args.tokens
    el = E // R
    torch.manual_seed(args.seed)  # the router and the teacher are the same on every rank
    router = torch.nn.Linear(H, E).to(dev)
    teacher = (torch.randn(H, H) / H**0.5).to(dev)
    all_experts = torch.randn(E, H, H, generator=torch.Generator().manual_seed(args.seed + 1)) / H**0.5
    home = all_experts[rank * el:(rank + 1) * el].clone().to(dev).requires_grad_()

    ee = ElasticExperts(E, args.spare_slots, group=group) if cloning else None
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=K, hidden=H,
                   dtype=torch.float32, max_tokens=T)
    if ee is not None:
        cfg = dataclasses.replace(cfg, num_experts=ee.num_physical)  # home slots + spare slots per rank
    losses, rows = [], []
    with (make or (lambda c: make_buffer(args.backend, runtime, c)))(cfg) as buf:
        for step in range(args.steps):
            gen = torch.Generator().manual_seed(1000 * (args.seed * 1000 + step) + rank)  # a fresh batch
            data = torch.randn(T, H, generator=gen).to(dev)
            target = torch.tanh(data @ teacher)
            idx = zipf_topk(rank, T, E, K, args.skew, args.seed, step, device=dev)
            gates = torch.softmax(router(data), dim=-1).gather(1, idx)
            gates = gates / gates.sum(1, keepdim=True)  # differentiable top-k weights, summing to 1
            if ee is None:
                routed, weights = idx, home
            else:
                plan = ee.plan(idx)  # this step's clones, from every rank's counts (on the device)
                routed = ee.route(idx, plan)  # physical ids: a hot expert's rows split over its replicas
                clones = ee.clone_weights(home, plan).requires_grad_()  # current weights, bit for bit
                weights = ee.slot_weights(home, clones)  # [E / R + S, H, H]
            res = ep.dispatch(buf, data, routed, gates.detach())
            y = experts_forward(res.recv_x, row_slots(res.tokens_per_expert, res.num_recv), weights)
            out = ep.combine(buf, y, gates, res.handle)
            loss = (out - target).pow(2).sum(1).mean()  # squared error per token
            router.zero_grad()
            home.grad = None
            loss.backward()  # collective: the backward passes dispatch and combine too
            if ee is not None:  # each clone's gradient into its home expert, fp32, fixed order
                home.grad = ee.reduce_grads(home.grad, clones.grad, plan, like=home).to(home.dtype)
            with torch.no_grad():
                for p in router.parameters():  # replicated: average the gradient over the ranks
                    dist.all_reduce(p.grad, group=group)
                    p -= args.lr * p.grad / R
                if home.grad is not None:
                    home -= args.lr * home.grad
            mean = loss.detach().reshape(1).clone()
            received = torch.tensor([res.num_recv], device=dev)
            dist.all_reduce(mean, group=group)
            gathered = [torch.zeros_like(received) for _ in range(R)]
            dist.all_gather(gathered, received, group=group)
            losses.append(float(mean) / R)
            rows.append([int(g) for g in gathered])
    return {"experts": home.detach().cpu(), "router": [p.detach().cpu() for p in router.parameters()],
            "losses": losses, "rows": rows}


def max_over_mean(rows: list[list[int]]) -> tuple[float, float]:
    """(mean over steps of the max rows per rank, mean over steps of the mean rows per rank)."""
    peaks = [max(r) for r in rows]
    means = [sum(r) / len(r) for r in rows]
    return sum(peaks) / len(peaks), sum(means) / len(means)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--backend", choices=BACKENDS, default="cute", help="cute (GPUs), reference (CPU), a2a")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (T)")
    p.add_argument("--hidden", type=int, default=32, help="H")
    p.add_argument("--experts", type=int, default=16, help="logical experts (E), divisible by the ranks")
    p.add_argument("--topk", type=int, default=2, help="experts per token (K)")
    p.add_argument("--spare-slots", type=int, default=2, help="spare expert slots per rank (S)")
    p.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the routing")
    p.add_argument("--steps", type=int, default=12, help="training steps of each run")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, data and routing")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of a run-time error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """UsageError naming the first bad value (before any rank starts)."""
    for flag, value, least in (("--spare-slots", args.spare_slots, 0), ("--steps", args.steps, 1),
                               ("--tokens", args.tokens, 1), ("--skew", args.skew, 0)):
        if not value >= least:  # a NaN --skew too
            raise UsageError(f"{flag} must be >= {least}, got {value}")


FLAGS = {"max_tokens": "--tokens", "hidden": "--hidden", "topk": "--topk", "world_size": "the world size",
         "num_experts": "the expert slots (--experts + the world size x --spare-slots)"}
"""What sets each EpConfig field here: a configuration error names it."""


def make_config(args: argparse.Namespace, env: DistEnv) -> EpConfig:
    """The physical slots' buffer's configuration, which sizes the heap (ConfigError names a bad value,
    under the flags that set it: ``FLAGS``)."""
    if args.experts < 1 or args.experts % env.world_size:
        raise UsageError(f"--experts must be positive and divisible by the world size ({env.world_size}), "
                         f"got {args.experts}; {nearest_valid_experts(args.experts, env.world_size)}")
    if not 1 <= args.topk <= min(args.experts, MAX_TOPK):
        raise UsageError(f"--topk must be in [1, min(--experts={args.experts}, {MAX_TOPK})], got {args.topk}")
    return EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                    num_experts=args.experts + env.world_size * args.spare_slots, topk=args.topk,
                    hidden=args.hidden, dtype=torch.float32, max_tokens=args.tokens)


def run(args: argparse.Namespace, env: DistEnv, cfg: EpConfig) -> int:
    """Both trainings on every rank, the weights compared; rank 0 reports."""
    say = Printer(env.rank)
    heap = 4 * cfg.symmetric_bytes()
    with Runtime(env, backend=runtime_backend(args.backend), symmetric_bytes=heap) as rt:
        group = rt.cpu_group if rt.device.type == "cpu" else rt.group  # the device's collectives
        runs = {name: train(args, rt, group, cloning) for name, cloning in (("plain", False), ("echo", True))}
        # Both runs' weights on every rank: the largest difference, relative to the largest weight.
        diff = max(float((a - b).abs().max()) for a, b in zip(
            [runs["plain"]["experts"], *runs["plain"]["router"]],
            [runs["echo"]["experts"], *runs["echo"]["router"]], strict=True))
        scale = max(float(runs["plain"]["experts"].abs().max()), 1.0)
        worst = torch.tensor([diff / scale])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=rt.cpu_group)
    for name, run in runs.items():
        peak, mean = max_over_mean(run["rows"])
        say(f"[{args.backend}] {name:5s}: rows per rank max {peak:.1f} / mean {mean:.1f} = "
            f"{peak / mean:.2f}; loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}")
    passed = float(worst) <= TOLERANCE
    say(f"max |w_echo - w_plain| / max |w| = {float(worst):.3g} (tolerance {TOLERANCE:g})")
    return say.verdict(passed)


def main(argv: list[str] | None = None) -> int:
    # A bad argument or configuration is one line `error: ...` and exit 2 before any rank starts.
    return script_main(argv, build_parser, validate_args, make_config, run, flags=FLAGS)


if __name__ == "__main__":
    raise SystemExit(main())
