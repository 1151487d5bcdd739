"""ElasticExperts (ECHO) on the GPU buffer, at the launch's world size: the checks of the CPU tests
(cute_ep/validators/elastic_checks.py, with ECHO's collectives on NCCL), training with and without
cloning (examples/echo_training.py), and the whole step captured in a CUDA graph and replayed over
routings that change every step, equal to eager.

    torchrun --nproc-per-node 2 -m pytest tests/gpu/test_elastic.py -m gpu -q
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from cute_ep import ElasticExperts
from cute_ep.buffer import EpBuffer
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert
from cute_ep.validators.elastic_checks import (
    coherence_check,
    exact_gradient_check,
    routing_check,
    row_slots,
    skewed_idx,
)

pytestmark = pytest.mark.gpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "echo_training.py"


def _make(runtime):
    return lambda cfg: EpBuffer(runtime, cfg, registry=runtime.registry)


def _multi_rank(runtime) -> bool:
    return runtime.env.world_size >= 2


def test_plan_routing_and_combine_match_the_plain_buffer(runtime):
    got = routing_check(runtime, _make(runtime), runtime.device, runtime.group, steps=3)
    assert all(got["same_plan"]) and got["problems"] == [[]] * 3, got
    assert all(got["routed_to_replica"]) and all(got["same_output"]), got
    assert got["rows"] == got["predicted"], got  # the kernels deliver exactly the planned rows
    if _multi_rank(runtime):
        assert max(got["clones"]) >= 1, got
    capped = routing_check(runtime, _make(runtime), runtime.device, runtime.group, steps=1, max_clones=1)
    assert capped["problems"] == [[]] and all(capped["same_output"]) and max(capped["clones"]) <= 1, capped


def test_weights_and_gradients_stay_coherent(runtime):
    got = coherence_check(runtime, runtime.device, runtime.group)
    assert got["bad_slots"] == [] and got["grads_exact"] and got["dtype"] == "torch.float32", got
    if _multi_rank(runtime):
        assert got["clones"] >= 1 and got["homes_cloned"] == [0], got
        if runtime.env.rank == 0:
            assert got["home_changed"], got


def test_exact_arithmetic_gives_bit_identical_gradients(runtime):
    got = exact_gradient_check(runtime, _make(runtime), runtime.device, runtime.group)
    assert got["expert_grads_equal"] and got["input_grads_equal"], got
    if _multi_rank(runtime):
        assert got["clones"] >= 1, got


def test_training_with_cloning_matches_training_without(runtime):
    spec = importlib.util.spec_from_file_location("echo_training_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    R = runtime.env.world_size
    args = argparse.Namespace(backend="cute", tokens=64, hidden=32, experts=4 * R, topk=2, spare_slots=2,
                              skew=1.2, steps=6, lr=0.2, seed=3)
    runs = {c: example.train(args, runtime, runtime.group, c, make=_make(runtime)) for c in (False, True)}
    scale = max(float(runs[False]["experts"].abs().max()), 1.0)
    diff = max(float((a - b).abs().max()) for a, b in zip([runs[False]["experts"], *runs[False]["router"]],
                                                           [runs[True]["experts"], *runs[True]["router"]],
                                                           strict=True))
    assert diff / scale <= example.TOLERANCE, diff / scale
    if _multi_rank(runtime):
        peak = lambda rows: max(max(step) for step in rows)  # noqa: E731
        assert peak(runs[True]["rows"]) < peak(runs[False]["rows"]), runs


def test_graph_replay_over_changing_routings_equals_eager(runtime):
    if runtime.env.world_size > 1 and "nccl" not in str(torch.distributed.get_backend(runtime.group)):
        pytest.skip("ECHO's collectives run on a gloo group here (ranks share a GPU, and NCCL refuses that): "
                    "gloo moves GPU tensors through the host, which a CUDA graph cannot capture")
    env, dev = runtime.env, runtime.device
    R, rank = env.world_size, env.rank
    T, H, K, el, S = 64, 256, 4, 8, 2
    E = el * R
    ee = ElasticExperts(E, S, group=runtime.group)
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=ee.num_physical, topk=K,
                   hidden=H, dtype=torch.bfloat16, max_tokens=T, num_sms=min(16, runtime.sm_share))
    x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    idx = torch.empty(T, K, dtype=torch.int64, device=dev)
    w = torch.empty(T, K, dtype=torch.float32, device=dev)
    home = torch.randn(el, 4, 16, generator=torch.Generator().manual_seed(rank)).to(dev)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

    def load(i: int) -> None:
        g = torch.Generator().manual_seed(runtime.seed + 3000 + 10 * i + rank)
        x.copy_(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx.copy_(skewed_idx(rank, T, E, K, 41, i, skew=1.3))
        w.copy_(torch.rand(T, K, generator=g))

    def expert_into(buf: EpBuffer, plan) -> None:
        # Every receive slot, no host sync: rows past the real count hold stale data and are never read.
        slot = row_slots(buf.tokens_per_expert, cfg.capacity)
        buf.recv_y.copy_(apply_test_expert(buf.recv_x, plan.local_experts(rank)[slot]))

    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf, \
            EpBuffer(runtime, cfg, registry=runtime.registry) as eager_buf:
        captured: dict = {}

        def step() -> None:
            plan = ee.plan(idx)
            phys = ee.route(idx, plan)
            captured["plan"], captured["clones"] = plan, ee.clone_weights(home, plan)
            handle = buf.launch_dispatch(x, phys, w, "scatter")
            expert_into(buf, plan)
            buf.launch_combine(handle, out)

        load(0)
        step()  # eager first: NCCL's communicator and the kernels are set up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        clones_seen = 0
        for i in range(1, 9):  # a new routing (and hot set) every replay
            load(i)
            graph.replay()
            torch.cuda.synchronize()
            got_out, got_plan, got_clones = out.clone(), captured["plan"], captured["clones"].clone()
            plan = ee.plan(idx)
            assert torch.equal(got_plan.slot_expert, plan.slot_expert), f"replay {i}: plan"
            assert torch.equal(got_plan.rows_per_rank, plan.rows_per_rank), f"replay {i}: rows"
            assert torch.equal(got_clones, ee.clone_weights(home, plan)), f"replay {i}: clones"
            res = eager_buf.dispatch(x, ee.route(idx, plan), w)
            y = eager_buf.expert_output(res.num_recv)
            y.copy_(apply_test_expert(res.recv_x, plan.local_experts(rank)[row_slots(res.tokens_per_expert,
                                                                                     res.num_recv)]))
            want = eager_buf.combine(y, res.handle)
            assert torch.equal(got_out.view(torch.int16), want.view(torch.int16)), f"replay {i}: combine"
            assert int(buf.num_recv[0]) == res.num_recv == int(plan.rows_per_rank[rank]), f"replay {i}"
            clones_seen += int(plan.num_clones)
        buf.check_ran()
        if R >= 2:
            assert clones_seen >= 1, "no replay placed a clone: the test would not exercise ECHO"
