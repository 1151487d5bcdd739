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


def _run_case(runtime, dtype, hidden, topk, el, tokens, routing, coverage, seed, algorithm="dedup",
              num_sms=16):
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
        num_sms=min(num_sms, runtime.sm_share),
    )
    dev = runtime.device
    with EpBuffer(runtime, cfg, registry=runtime.registry, algorithm=algorithm) as buf:
        if algorithm == "auto":
            assert buf.algorithm in ("dedup", "per_pair", "put_warp") and buf.algorithm_table, buf.algorithm
            if runtime.env.rank == 0:
                print("\n" + buf.algorithm_table)
        for it, mode in enumerate(("scatter", "atomic", "scatter")):
            x, idx, w = make_inputs(rank, T, hidden, E, topk, dtype, runtime.seed + seed + it,
                                    routing=routing)
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


@pytest.mark.parametrize("topk, el, tokens, routing, seed", [
    (8, 8, (96, 80, 64, 112), "uniform", 901),  # 300-900 received slots: by primaries
    (8, 8, (96, 72, 88, 64), "dropped", 902),
    (40, 24, (24, 16, 32, 8), "uniform", 903),  # the per-pair senders (top-k > 32): by primaries
    (8, 8, (4, 2, 6, 3), "uniform", 904),  # a few dozen slots (at most 120 below): a warp per member slot
    (40, 24, (2, 3, 1, 2), "dropped", 905),
])
def test_fanout_forms(runtime, topk, el, tokens, routing, seed):
    """On one SM (16 warps: the fan-out goes a warp per member slot up to 16 * FEW_SLOTS_PER_WARP received
    slots, 128, by group primaries beyond), both forms of the fan-out give the exact rows, in both dispatch
    modes."""
    _run_case(runtime, torch.bfloat16, 256, topk, el, tokens, routing, False, seed=seed, num_sms=1)


def _roomy(runtime) -> tuple[EpConfig, int, torch.device]:
    """(config, rank, device) of the combine-row tests: 4 experts per rank, top-2, 32 tokens of 256 bf16,
    and twice the rows that always suffice (num_recv stays below the capacity even on one rank)."""
    env = runtime.env
    R, T = env.world_size, 32
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=4 * R, topk=2, hidden=256,
                   dtype=torch.bfloat16, max_tokens=T, num_sms=min(16, runtime.sm_share), capacity=4 * R * T)
    return cfg, env.rank, runtime.device


def test_combine_refuses_y_of_the_wrong_row_count(runtime):
    """combine takes y with the num_recv rows of the handle's dispatch, or the whole capacity (what
    dispatch(sync=False) covers; after it another count is checked against the count on the device);
    another count is refused on every rank before any
    kernel runs, and the buffer stays usable. The handle of an earlier dispatch keeps its own count after a
    later dispatch of another count (autograd's backward combines such handles). launch_combine refuses an
    ``out`` the kernels would write past."""
    cfg, rank, dev = _roomy(runtime)
    E, T, H = cfg.num_experts, cfg.max_tokens, cfg.hidden
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        x, idx, w = (t.to(dev) for t in make_inputs(rank, T, H, E, 2, torch.bfloat16,
                                                                 runtime.seed + 4321))
        buf.poison()
        res = buf.dispatch(x, idx, w)
        n = res.num_recv
        assert 0 < n <= cfg.capacity // 2
        experts = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(dev)
        y = apply_test_expert(res.recv_x, experts)
        # A fresh buffer: the rows past a short y would be NaN poison.
        with pytest.raises(ValueError, match=rf"y has {n - 1} rows, but the dispatch of this handle received "
                                             rf"num_recv={n}"):
            buf.combine(y[: n - 1].clone(), res.handle)
        want = buf.combine(y, res.handle)
        rc = check_combine(want, idx, w, y, local_world_size=cfg.local_world_size, num_experts=E,
                           scatter=res.handle.scatter, require_coverage=False, group=runtime.cpu_group)
        assert rc.passed, rc.message
        # After a call: the rows past a short (or long) y would be that call's.
        for bad in (n - 1, n + 1):
            with pytest.raises(ValueError, match=rf"y has {bad} rows, .* num_recv={n}"):
                buf.combine(buf.expert_output(bad), res.handle)
        full = buf.expert_output(cfg.capacity)
        full[:n].copy_(y)
        assert torch.equal(buf.combine(full, res.handle), want)  # rows past num_recv are never read

        # sync=False: the host does not know num_recv. The whole capacity passes unread; another count is
        # checked against the count the kernels wrote (read back then), so n passes and n - 1 does not.
        res2 = buf.dispatch(x, idx, w, sync=False)
        assert res2.num_recv == cfg.capacity
        y2 = buf.expert_output(res2.num_recv)
        y2[:n].copy_(y)
        assert torch.equal(buf.combine(y2, res2.handle), want)
        assert torch.equal(buf.combine(y, res2.handle), want)
        with pytest.raises(ValueError, match=rf"y has {n - 1} rows, but the dispatch of this handle received "
                                             rf"num_recv={n}"):
            buf.combine(y[: n - 1].clone(), res2.handle)
        buf.check_ran()

        # An earlier handle keeps its own count after a dispatch of another count.
        x3, idx3, w3 = (t.to(dev) for t in make_inputs(rank, T // 2, H, E, 2, torch.bfloat16,
                                                                    runtime.seed + 4322))
        res3 = buf.dispatch(x3, idx3, w3)
        assert buf.combine(buf.expert_output(res3.num_recv), res3.handle).shape == (T // 2, H)
        buf.expert_output(n).copy_(y)
        assert torch.equal(buf.combine(buf.expert_output(n), res.handle), want)

        # launch_combine writes handle.num_tokens rows into out: a smaller out is refused on the host.
        with pytest.raises(ValueError, match=rf"out must be \[{T}, {H}\] torch.bfloat16, contiguous, on "):
            buf.launch_combine(res.handle, torch.empty(T - 1, H, dtype=torch.bfloat16, device=dev))
        torch.cuda.synchronize(dev)
        buf.check_ran()


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_combine_stages_a_worst_case_y_of_the_callers_row_by_row(runtime, layout):
    """A y of the caller's (not the buffer's recv_y) reaches recv_y on the device: after a sync-free
    dispatch only the rows that dispatch received (the count on the device), so a worst-case y costs the
    rows received; for an earlier dispatch's handle every row of y. Either way the result is
    bit-identical to the combine of the same rows written into recv_y directly."""
    cfg, rank, dev = _roomy(runtime)
    E, T, H = cfg.num_experts, cfg.max_tokens, cfg.hidden
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        # 3/4 of max_tokens: the rank layout's worst case (R * max_tokens rows) is then never all received
        x, idx, w = (t.to(dev) for t in make_inputs(rank, 3 * T // 4, H, E, 2, torch.bfloat16,
                                                    runtime.seed + 977))
        x2, idx2, w2 = (t.to(dev) for t in make_inputs(rank, T // 2, H, E, 2, torch.bfloat16,
                                                       runtime.seed + 978))
        rows = cfg.rank_capacity if layout == "rank" else cfg.capacity
        res = buf.dispatch(x, idx, w, sync=False, layout=layout)
        n = int(res.recv_count[0])
        assert 0 < n < rows
        g = torch.Generator(device=dev).manual_seed(runtime.seed + rank)
        y = torch.full((rows, H), 7.0, dtype=torch.bfloat16, device=dev)  # rows past n: not received
        y[:n] = torch.randn(n, H, generator=g, device=dev).to(torch.bfloat16)
        direct = buf.expert_output(rows)
        direct[:n].copy_(y[:n])
        want = buf.combine(direct, res.handle)
        runtime.barrier()  # (synchronizes first) no peer's combine still reads this rank's recv_y
        buf.recv_y.fill_(float("nan"))
        got = buf.combine(y, res.handle)
        assert torch.equal(got, want)
        staged = buf.recv_y[:rows]
        assert torch.equal(staged[:n], y[:n])
        assert bool(staged[n:].isnan().all()), "rows past the received count were staged"

        # An earlier dispatch's handle: the device's count is the later one's, so all of y is staged.
        buf.dispatch(x2, idx2, w2, sync=False, layout=layout)
        runtime.barrier()
        buf.recv_y.fill_(float("nan"))
        again = buf.combine(y, res.handle, algorithm="pull" if layout == "expert" else None)
        assert torch.equal(again, want)
        assert torch.equal(buf.recv_y[:rows], y)
        buf.check_ran()
