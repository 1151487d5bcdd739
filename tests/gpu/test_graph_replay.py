"""Dispatch -> expert -> combine captured once in a CUDA graph and replayed with new inputs.

Nothing in the captured region synchronizes with the host: the kernels find their epochs, receive
sizes and slots on the device, so replaying the graph is a whole new call. Every replay writes fresh
routing and rows into the captured input tensors, poisons the receive buffers and the output, may
start late on some ranks (a random ``torch.cuda._sleep`` straggler), and is validated exactly:
dispatch bit for bit in its deterministic order, the expert outputs, combine bit-identical to the
fixed-order reference (pull) or to ``reference_combine_reduced`` (the reduced combine, its partial rows
poisoned too), and each kernel's epoch advanced by exactly one.
"""

from __future__ import annotations

import random

import pytest
import torch

from cute_ep.buffer import EpBuffer
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.validators.checks import check_combine, check_dispatch

pytestmark = pytest.mark.gpu

REPLAYS = 100


def _expert_into(buf: EpBuffer, rank: int) -> None:
    """The test expert over every receive slot, without a host sync: row i's local expert is found by
    searching the device's tokens_per_expert (slots past num_recv hold poison and are never read)."""
    c = buf.cfg
    ends = torch.cumsum(buf.tokens_per_expert.to(torch.int64), 0)
    rows = torch.arange(c.capacity, device=ends.device)
    local = torch.searchsorted(ends, rows, right=True).clamp_(max=c.experts_per_rank - 1)
    buf.recv_y.copy_(apply_test_expert(buf.recv_x, rank * c.experts_per_rank + local))


@pytest.mark.parametrize("combine", ["pull", "reduced"])
def test_graph_replay_with_new_inputs_and_stragglers(runtime, combine):
    env = runtime.env
    R, rank, L = env.world_size, env.rank, env.local_world_size
    T, H, K, E, dtype = 48, 256, 4, 8 * R, torch.bfloat16
    cfg = EpConfig(world_size=R, local_world_size=L, num_experts=E, topk=K, hidden=H, dtype=dtype,
                   max_tokens=T, num_sms=min(16, runtime.sm_share), combine_algorithm=combine)
    dev = runtime.device
    rng = random.Random(1000 + rank)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        x = torch.empty(T, H, dtype=dtype, device=dev)
        idx = torch.empty(T, K, dtype=torch.int32, device=dev)
        w = torch.empty(T, K, dtype=torch.float32, device=dev)
        out = torch.empty(T, H, dtype=dtype, device=dev)

        def load(i: int) -> None:
            xi, ii, wi = make_inputs(rank, T, H, E, K, dtype, runtime.seed + 5000 + i, routing="uniform")
            x.copy_(xi)
            idx.copy_(ii.to(torch.int32))
            w.copy_(wi)

        def step() -> None:
            handle = buf.launch_dispatch(x, idx, w, "scatter")
            _expert_into(buf, rank)
            buf.launch_combine(handle, out)

        def check(i: int, epoch: int) -> None:
            torch.cuda.synchronize()
            assert buf.epochs.tolist() == [epoch] * 3, f"replay {i}: epochs {buf.epochs.tolist()}"
            n = int(buf.num_recv.item())
            r = check_dispatch(x, idx, w, buf.recv_x[:n], buf.recv_w[:n], buf.recv_src[:n], max_tokens=T,
                               num_experts=E, local_world_size=L, ordered=True, require_coverage=False,
                               group=runtime.cpu_group)
            assert r.passed, f"replay {i}: dispatch {r.message}"
            experts = global_expert_of_rows(buf.tokens_per_expert.cpu(), rank).to(dev)
            assert torch.equal(buf.recv_y[:n], apply_test_expert(buf.recv_x[:n], experts)), f"replay {i}"
            rc = check_combine(out, idx, w, buf.recv_y[:n], local_world_size=L, num_experts=E,
                               scatter=buf.scatter[:T], require_coverage=False,
                               group=runtime.cpu_group, algorithm=combine)
            assert rc.passed, f"replay {i}: combine {rc.message}"

        # One eager call first: loads everything lazily loaded, and proves the same steps work uncaptured.
        load(0)
        buf.poison()
        step()
        check(0, 1)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        assert buf.epochs.tolist() == [1] * 3, "capturing must not run the kernels"

        for i in range(1, REPLAYS + 1):
            load(i)
            buf.poison()
            out.fill_(float("nan"))
            if combine == "reduced":
                buf.partials.fill_(float("nan"))  # a partial row nobody wrote this replay fails
            if rng.random() < 0.5:
                torch.cuda._sleep(rng.randrange(1, 2_000_000))  # a straggler: up to ~1 ms late
            graph.replay()
            check(i, 1 + i)
        del graph
