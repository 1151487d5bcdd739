"""Checks of cute_ep.elastic (ECHO) shared by the CPU tests (reference backend, gloo) and the GPU tests.

Each runs on any buffer with the EpBuffer API (``make_buffer(cfg)`` returns one, usable as a context
manager), with tensors on ``device`` and ``ElasticExperts`` moving them over ``group`` (gloo for CPU
tensors, NCCL for GPU ones). Every function is collective and returns this rank's findings as plain
values (the tests assert on them):

* ``routing_check``: several steps of Zipf routing (ragged token counts, a rank with none, dropped
  pairs): the plan is the same on every rank, respects the spare slots and the cap, is never worse than
  no cloning; every routed pair lands on a replica of its expert; the buffer delivers exactly the rows
  the plan predicts; combine of the test expert (applied to each row's logical expert) is bit for bit
  the one without cloning.
* ``coherence_check``: clones hold their expert's weights bit for bit (bf16), and ``reduce_grads``
  equals the fixed-order fp32 sum of the home gradient and every clone's, computed here from every
  rank's gradients.
* ``exact_gradient_check``: one training step with integer-valued data, where every sum is exact: the
  expert gradients with cloning equal those without bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from cute_ep import autograd as ep
from cute_ep.collectives import all_gather_objects
from cute_ep.elastic import ClonePlan, ElasticExperts
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert
from cute_ep.skew import zipf_topk

__all__ = ["coherence_check", "exact_gradient_check", "routing_check", "row_slots", "skewed_idx"]

TOKENS = (48, 33, 0, 40, 17, 48, 29, 8)  # per rank (ragged; rank 2 has none)
EL, K, H, SPARE = 8, 4, 64, 2  # experts per rank, top-k, hidden, spare slots per rank


def row_slots(tokens_per_expert: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] int64: the local slot of each received row (slot-major), without a host sync."""
    ends = torch.cumsum(tokens_per_expert.to(torch.int64), 0)
    rows = torch.arange(num_rows, device=ends.device)
    return torch.searchsorted(ends, rows, right=True).clamp_(max=tokens_per_expert.numel() - 1)


def skewed_idx(rank: int, tokens: int, num_experts: int, topk: int, seed: int, step: int,
               skew: float = 1.2) -> torch.Tensor:
    """[T, K] int64 Zipf routing with about one pair in eight dropped (-1)."""
    idx = zipf_topk(rank, tokens, num_experts, topk, skew, seed, step)
    g = torch.Generator().manual_seed(7919 * seed + 31 * step + rank)
    return torch.where(torch.rand(idx.shape, generator=g) < 0.125, torch.full_like(idx, -1), idx)


def _plan_host(plan: ClonePlan) -> dict:
    return {f.name: getattr(plan, f.name).cpu() if isinstance(getattr(plan, f.name), torch.Tensor)
            else getattr(plan, f.name) for f in dataclasses.fields(plan)}


def _plan_problems(plan: ClonePlan, cap: int) -> list[str]:
    """What is wrong with a plan's structure (empty: nothing), checked on the host."""
    p = _plan_host(plan)
    R, E = p["counts"].shape
    el, S = E // R, p["spare_slots"]
    out = []
    se = p["slot_expert"]
    if se.shape != (R, S):
        out.append(f"slot_expert shape {tuple(se.shape)}")
    if int((se >= 0).sum()) > cap or int(p["num_clones"]) != int((se >= 0).sum()):
        out.append(f"{int((se >= 0).sum())} clones, cap {cap}, num_clones {int(p['num_clones'])}")
    for r in range(R):
        held = [e for e in se[r].tolist() if e >= 0]
        if len(set(held)) != len(held) or any(e // el == r for e in held):
            out.append(f"rank {r} holds {held} besides its home experts")
    for e in range(E):
        reps = [v for v in p["replicas"][e].tolist() if v >= 0]
        owners = [v // (el + S) for v in reps]
        if len(reps) != int(p["num_replicas"][e]) or reps != sorted(reps) or (e // el) not in owners:
            out.append(f"expert {e}: replicas {reps}, num_replicas {int(p['num_replicas'][e])}")
            break
    peak, peak_without = int(p["rows_per_rank"].max()), int(p["rows_without"].max())
    if peak > peak_without:
        out.append(f"max rows {peak} > without cloning {peak_without}")
    if int(p["rows_per_rank"].sum()) != int(p["counts"].sum()):
        out.append("rows_per_rank does not add up to the pairs")
    return out


def routing_check(runtime: Any, make_buffer: Callable[[EpConfig], Any], device: torch.device, group: Any,
                  steps: int = 3, max_clones: int | None = None) -> dict:
    """See the module docstring. Returns per step: problems found (lists of text), rows received with
    and without cloning, the plan's prediction, the clones placed."""
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = EL * R
    T = TOKENS[rank % len(TOKENS)]
    ee = ElasticExperts(E, SPARE, group=group, max_clones=max_clones)
    cap = R * SPARE if max_clones is None else min(R * SPARE, max_clones)
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=K, hidden=H,
                   dtype=torch.bfloat16, max_tokens=max(TOKENS))
    out: dict[str, list] = {"problems": [], "rows": [], "rows_plain": [], "predicted": [], "clones": [],
                            "same_plan": [], "same_output": [], "routed_to_replica": []}
    cfg_echo = dataclasses.replace(cfg, num_experts=ee.num_physical)
    with make_buffer(cfg) as plain, make_buffer(cfg_echo) as echo:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
            w = torch.rand(T, K, generator=g).to(device)
            idx = skewed_idx(rank, T, E, K, 11, step).to(device)
            plan = ee.plan(idx)
            phys = ee.route(idx, plan)
            host = _plan_host(plan)
            plans = all_gather_objects(host, runtime.cpu_group)
            out["same_plan"].append(all(_same(a, host) for a in plans))
            out["problems"].append(_plan_problems(plan, cap))
            p2l = plan.physical_to_logical()
            logical = torch.where(phys >= 0, p2l[phys.long().clamp(min=0)], torch.full_like(phys.long(), -1))
            out["routed_to_replica"].append(bool(torch.equal(logical.cpu(), idx.cpu())))

            res = plain.dispatch(x, idx, w)
            y = plain.expert_output(res.num_recv)
            y.copy_(apply_test_expert(res.recv_x, rank * EL + row_slots(res.tokens_per_expert, res.num_recv)))
            want = plain.combine(y, res.handle)
            res_e = echo.dispatch(x, phys, w)
            experts = plan.local_experts(rank)[row_slots(res_e.tokens_per_expert, res_e.num_recv)]
            y = echo.expert_output(res_e.num_recv)
            y.copy_(apply_test_expert(res_e.recv_x, experts))
            got = echo.combine(y, res_e.handle)
            out["same_output"].append(bool(torch.equal(got.view(torch.int16), want.view(torch.int16))))
            out["rows"].append(res_e.num_recv)
            out["rows_plain"].append(res.num_recv)
            out["predicted"].append(int(host["rows_per_rank"][rank]))
            out["clones"].append(int(host["num_clones"]))
    return out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def coherence_check(runtime: Any, device: torch.device, group: Any) -> dict:
    """See the module docstring. Returns: clones placed, the slots whose copy differs from the home
    weights (bit for bit), whether reduce_grads equals the fixed-order reference bit for bit, and whether
    a clone's gradient changed its home expert's (so the check is not vacuous)."""
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = EL * R
    ee = ElasticExperts(E, SPARE, group=group)
    # Every rank's tokens go to experts 0, 1 and 2 (homed on rank 0): clones are bound to be placed.
    T = 24
    idx = torch.tensor([[0, 1, 2]] * T, dtype=torch.int64, device=device)
    plan = ee.plan(idx)
    g = torch.Generator().manual_seed(50 + rank)
    shape = (3, 8, 5)
    home = torch.randn(EL, *shape, generator=g).to(torch.bfloat16).to(device)
    clones = ee.clone_weights(home, plan)
    home_grad = torch.randn(EL, *shape, generator=g).to(torch.bfloat16).to(device)
    clone_grad = torch.randn(SPARE, *shape, generator=g).to(device)
    reduced = ee.reduce_grads(home_grad, clone_grad, plan)

    everyone = all_gather_objects((home.cpu(), clone_grad.cpu()), runtime.cpu_group)
    se = plan.slot_expert.cpu()
    bad_slots = []
    for s, e in enumerate(se[rank].tolist()):
        want = torch.zeros(shape, dtype=torch.bfloat16) if e < 0 else everyone[e // EL][0][e % EL]
        if not torch.equal(clones[s].cpu().view(torch.int16), want.view(torch.int16)):
            bad_slots.append(s)
    want = home_grad.cpu().float()
    for r in range(R):  # the documented order: home first, then rank, then slot
        for s in range(SPARE):
            e = int(se[r, s])
            if e >= 0 and e // EL == rank:
                want[e % EL] = want[e % EL] + everyone[r][1][s]
    changed = not torch.equal(reduced.cpu(), home_grad.cpu().float())
    return {"clones": int(plan.num_clones), "bad_slots": bad_slots, "dtype": str(reduced.dtype),
            "grads_exact": bool(torch.equal(reduced.cpu(), want)), "home_changed": changed,
            "homes_cloned": sorted({int(e) // EL for e in se.reshape(-1).tolist() if e >= 0})}


def exact_gradient_check(runtime: Any, make_buffer: Callable[[EpConfig], Any], device: torch.device,
                         group: Any) -> dict:
    """See the module docstring. Integer inputs, weights and output gradient, a linear expert and gates
    of 1: every product and sum is an integer below 2**24, exact in fp32 in any order. Returns whether the
    home experts' gradients and the input gradients agree bit for bit, and the clones placed."""
    env = runtime.env
    R, rank = env.world_size, env.rank
    E, T, h = EL * R, 32, 16
    ee = ElasticExperts(E, SPARE, group=group)
    g = torch.Generator().manual_seed(900 + rank)
    x0 = torch.randint(-3, 4, (T, h), generator=g).float().to(device)
    grad_out = torch.randint(-3, 4, (T, h), generator=g).float().to(device)
    idx = skewed_idx(rank, T, E, K, 23, 0, skew=1.5).to(device)
    gates = torch.ones(T, K, device=device)
    weights0 = torch.randint(-2, 3, (EL, h, h), generator=torch.Generator().manual_seed(7 + rank)).float()
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=K, hidden=h,
                   dtype=torch.float32, max_tokens=T)
    grads = {}
    clones_placed = 0
    for name in ("plain", "echo"):
        home = weights0.clone().to(device).requires_grad_()
        x = x0.clone().requires_grad_()
        c = cfg if name == "plain" else dataclasses.replace(cfg, num_experts=ee.num_physical)
        with make_buffer(c) as buf:
            if name == "plain":
                routed, slots_w = idx, home
            else:
                plan = ee.plan(idx)
                clones_placed = int(plan.num_clones)
                routed = ee.route(idx, plan)
                clones = ee.clone_weights(home, plan).requires_grad_()
                slots_w = ee.slot_weights(home, clones)
            res = ep.dispatch(buf, x, routed, gates)
            slot = row_slots(res.tokens_per_expert, res.num_recv)
            y = torch.einsum("nh,nhg->ng", res.recv_x, slots_w[slot])
            out = ep.combine(buf, y, gates, res.handle)
            (out * grad_out).sum().backward()
            if name == "plain":
                g_home = home.grad
            else:
                g_home = ee.reduce_grads(home.grad, clones.grad, plan, like=home)
        g_home = torch.zeros_like(home) if g_home is None else g_home
        grads[name] = (g_home.detach().cpu(), x.grad.detach().cpu())
    return {"clones": clones_placed,
            "expert_grads_equal": bool(torch.equal(grads["plain"][0], grads["echo"][0])),
            "input_grads_equal": bool(torch.equal(grads["plain"][1], grads["echo"][1])),
            "grad_scale": float(grads["plain"][0].abs().max())}
