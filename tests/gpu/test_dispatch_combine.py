"""Dispatch and combine on real GPUs, checked exactly against the torch reference.

Every case: fresh random inputs whose first columns name their sender, receive buffers poisoned
(NaN / -1) before each run, dispatch in both modes checked bit for bit (atomic mode after ordering
rows inside each (expert, source) group), tokens_per_expert against the reference layout, a
non-identity expert (y = x * (global expert + 1)), and combine bit-identical to the fixed-order fp32
reference. Route classes (self / same node / other node x local rank) are counted over all ranks and
must all be hit in the coverage cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cute_ep.buffer import EpBuffer
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows, reference_layout
from cute_ep.validators.checks import check_combine, check_dispatch

pytestmark = pytest.mark.gpu

# (name, dtype, hidden, topk, experts per rank, tokens per rank (by rank % 4), routing, coverage)
CASES = [
    ("bf16-h256-k2", torch.bfloat16, 256, 2, 8, (64, 64, 64, 64), "uniform", True),
    ("fp32-h128-k1", torch.float32, 128, 1, 2, (48, 40, 32, 56), "uniform", True),
    ("fp16-h512-k8-dropped", torch.float16, 512, 8, 16, (40, 24, 8, 16), "dropped", True),
    ("bf16-h7168-k8-e64", torch.bfloat16, 7168, 8, 16, (128, 96, 64, 32), "uniform", True),
    ("bf16-h1024-k4-skewed", torch.bfloat16, 1024, 4, 4, (32, 32, 32, 32), "skewed", False),
    ("fp32-h132-k3-ragged-zero", torch.float32, 132, 3, 3, (33, 0, 17, 5), "uniform", False),
    ("bf16-h128-k6", torch.bfloat16, 128, 6, 2, (16, 16, 16, 16), "uniform", True),
]


def _run_case(runtime, dtype, hidden, topk, el, tokens, routing, coverage, seed, algorithm="dedup"):
    env = runtime.env
    R, rank, L = env.world_size, env.rank, env.local_world_size
    E = el * R
    topk = min(topk, E)
    max_tokens = max(tokens)
    T = tokens[rank % 4]
    cfg = EpConfig(
        world_size=R,
        local_world_size=L,
        num_experts=E,
        topk=topk,
        hidden=hidden,
        dtype=dtype,
        max_tokens=max_tokens,
        num_sms=min(16, runtime.sm_share),
    )
    dev = runtime.device
    with EpBuffer(runtime, cfg, registry=runtime.registry, algorithm=algorithm) as buf:
        if algorithm == "auto":
            assert buf.algorithm in ("dedup", "per_pair", "put_warp") and buf.algorithm_table, buf.algorithm
            if runtime.env.rank == 0:
                print("\n" + buf.algorithm_table)
        for it, mode in enumerate(("scatter", "atomic", "scatter")):
            x, idx, w = make_inputs(rank, T, hidden, E, topk, dtype, seed + it, routing=routing)
            x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
            buf.poison()
            res = buf.dispatch(x, idx, w, mode=mode)
            torch.cuda.synchronize()
            r = check_dispatch(
                x,
                idx,
                w,
                res.recv_x,
                res.recv_weights,
                res.recv_src,
                max_tokens=max_tokens,
                num_experts=E,
                local_world_size=L,
                ordered=(mode == "scatter"),
                require_coverage=coverage,
                group=runtime.cpu_group,
            )
            assert r.passed, f"dispatch {mode}: {r.message}"

            all_idx = [None] * R
            dist.all_gather_object(all_idx, idx.cpu(), group=runtime.cpu_group)
            ref = reference_layout(all_idx, E)
            assert res.num_recv == int(ref.num_recv[rank])
            assert torch.equal(res.tokens_per_expert.cpu().long(), ref.tokens_per_expert[rank].long())
            if mode == "scatter":
                assert torch.equal(res.handle.scatter.cpu().long(), ref.scatter[rank].long())

            experts = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(dev)
            y = buf.expert_output(res.num_recv)
            y.copy_(apply_test_expert(res.recv_x, experts))
            out = buf.combine(y, res.handle)
            rc = check_combine(
                out,
                idx,
                w,
                y,
                local_world_size=L,
                num_experts=E,
                scatter=res.handle.scatter,
                require_coverage=coverage,
                group=runtime.cpu_group,
            )
            assert rc.passed, f"combine after {mode}: {rc.message}"
            if rank == 0 and it == 0:
                print(f"\n  routes: {r.route_counts}")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dispatch_combine(runtime, case):
    _, dtype, hidden, topk, el, tokens, routing, coverage = case
    _run_case(runtime, dtype, hidden, topk, el, tokens, routing, coverage, seed=1234)


@pytest.mark.parametrize("topk", range(1, 9))
def test_topk_sweep(runtime, topk):
    _run_case(runtime, torch.bfloat16, 256, topk, 8, (24, 16, 8, 32), "uniform", False, seed=77 + topk)


@pytest.mark.parametrize("algorithm", ["per_pair", "put_warp", "auto"])
def test_dispatch_primitives(runtime, algorithm):
    """The per-pair primitives (every (token, k) row sent, no fan-out) and the auto choice give the
    same exact results as the default rank de-duplicated dispatch."""
    _run_case(runtime, torch.bfloat16, 256, 4, 8, (64, 48, 32, 16), "uniform", True, seed=555,
              algorithm=algorithm)
    _run_case(runtime, torch.float32, 128, 6, 3, (16, 0, 24, 8), "dropped", False, seed=556,
              algorithm=algorithm)
