"""The host path of the GPU buffer: inputs checked on the device, calls without host syncs, and dispatch
and combine on a communication stream beside a GEMM.

- Invalid topk_idx on one rank (an id past E, below -1, an int64 id no int32 holds, an expert twice) is
  refused by the layout kernel on every rank: the rank at fault raises the host check's message, the
  others name it; nothing is received, and the buffer keeps working (a valid call right after passes).
- ``combine`` and ``dispatch(sync=False)`` make no host sync (torch's sync debug mode raises on one), a
  synced ``dispatch`` makes one; the sync-free dispatch returns worst-case views with the count on the
  device, eagerly and replayed in a CUDA graph, with the synced call's results.
- calls of one size each keep their own results, across the end of a batch of them made ahead (no later
  call writes into a handle's routing or a combine's output);
- a cached dispatch (``launch_cached_dispatch``, no layout) receives what a full dispatch of the same rows
  along the same routing receives, bit for bit, and leaves its counts;
- a dispatch copies its received rows into the caller's tensors in its own launch when asked
  (``deliver``), byte for byte, split into parts; and puts the rows it sends together from values and
  strided words first (``assemble``).
- dispatch + combine on their own stream (``stream=``), with ``num_sms`` bounding their SMs, beside
  matrix products on the compute stream: results bit-identical to running alone, and the two together
  take less time than one after the other.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time

import pytest
import torch
from _memory import share_no_byte

from cute_ep.buffer import EpBuffer
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert
from cute_ep.spare import SPARE_AHEAD
from cute_ep.validators.checks import check_combine, check_dispatch, check_rank_combine

pytestmark = pytest.mark.gpu

BAD_RANK = 0


def _setup(runtime, T=32, H=256, K=4, num_sms=16, seed=7):
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = 8 * R
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=K, hidden=H,
                   dtype=torch.bfloat16, max_tokens=T, num_sms=min(num_sms, runtime.sm_share))
    x, idx, w = make_inputs(rank, T, H, E, K, torch.bfloat16, runtime.seed + seed, routing="uniform")
    dev = runtime.device
    return cfg, rank, (x.to(dev), idx.to(dev), w.to(dev))  # idx int64, as a router returns it


def _spoil(idx: torch.Tensor, case: str, num_experts: int) -> tuple[torch.Tensor, str]:
    """A copy of idx with one invalid entry, and the message this rank's own check gives for it."""
    bad = idx.clone()
    if case == "past E":
        bad[3, 1] = num_experts + 2
    elif case == "below -1":
        bad[5, 0] = -7
    elif case == "int64 past int32":
        bad[0, 2] = 2**32 + int(idx[0, 2])  # as int32 this would be a valid id
    else:  # an expert twice in a token
        bad[4, 1] = bad[4, 0]
    want = r"distinct experts per token" if case == "repeated" else r"topk_idx values must be in \[-1, "
    return bad, want


def _check_round(runtime, buf, cfg, x, idx, w) -> None:
    res = buf.dispatch(x, idx, w)
    g = runtime.cpu_group
    r = check_dispatch(x, idx, w, res.recv_x, res.recv_weights, res.recv_src, max_tokens=cfg.max_tokens,
                       num_experts=cfg.num_experts, local_world_size=cfg.local_world_size,
                       require_coverage=False, group=g)
    assert r.passed, r.message
    y = buf.expert_output(res.num_recv)
    y.copy_(res.recv_x)
    out = buf.combine(y, res.handle)
    rc = check_combine(out, idx, w, y, local_world_size=cfg.local_world_size, num_experts=cfg.num_experts,
                       scatter=res.handle.scatter, require_coverage=False, group=g)
    assert rc.passed, rc.message


@pytest.mark.parametrize("case", ["past E", "below -1", "int64 past int32", "repeated"])
def test_invalid_ids_are_refused_on_the_device_on_every_rank(runtime, case):
    cfg, rank, (x, idx, w) = _setup(runtime)
    bad, own_message = _spoil(idx, case, cfg.num_experts)
    mine = bad if rank == BAD_RANK else idx
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        buf.poison()
        with pytest.raises(ValueError) as info:
            buf.dispatch(x, mine, w)
        if rank == BAD_RANK:
            assert re.search(own_message, str(info.value)), str(info.value)
        else:
            assert f"rank {BAD_RANK} passed invalid topk_idx" in str(info.value), str(info.value)
        assert torch.isnan(buf.recv_x.float()).all(), "a refused call must move no data"
        # The sync-free call is refused the same way and says so at the next check.
        buf.dispatch(x, mine, w, sync=False)
        with pytest.raises(ValueError):
            buf.check_ran()
        assert torch.isnan(buf.recv_x.float()).all()
        _check_round(runtime, buf, cfg, x, idx, w)  # the buffer is still usable


def test_combine_and_sync_free_dispatch_make_no_host_sync(runtime):
    cfg, rank, (x, idx, w) = _setup(runtime)
    idx = idx.to(torch.int32)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        buf.dispatch(x, idx, w)  # first call: pointers made, everything loaded
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            res = buf.dispatch(x, idx, w, sync=False)
            y = buf.expert_output(cfg.capacity)
            y.copy_(buf.recv_x)
            out = buf.combine(y, res.handle)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):  # the detector sees a synced dispatch
                buf.dispatch(x, idx, w)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        buf.check_ran()
        n = int(res.recv_count)
        assert n == int(buf.num_recv[0]) and res.num_recv == cfg.capacity
        rc = check_combine(out, idx, w, y[:n], local_world_size=cfg.local_world_size,
                           num_experts=cfg.num_experts, scatter=res.handle.scatter, require_coverage=False,
                           group=runtime.cpu_group)
        assert rc.passed, rc.message


@pytest.mark.parametrize("sync", [True, False])
def test_results_of_calls_of_one_size_stay_the_callers(runtime, sync):
    """dispatch() + combine() on fresh inputs of one size, SPARE_AHEAD + 6 times (handles and outputs are made
    ahead in batches: across a batch's end), every result kept: some rounds are checked when they return;
    after all, every round's combine output and its handle's ids, weights and slots are as they were (no
    later call wrote into them) and no two of them share a byte."""
    cfg, rank, _ = _setup(runtime, seed=11)
    dev, g = runtime.device, runtime.cpu_group
    rounds = SPARE_AHEAD + 6
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        kept = []
        for i in range(rounds):
            x, idx, w = (t.to(dev) for t in make_inputs(rank, cfg.max_tokens, cfg.hidden, cfg.num_experts,
                                                         cfg.topk, cfg.dtype, runtime.seed + 300 + i,
                                                         routing="uniform"))
            res = buf.dispatch(x, idx, w, sync=sync)
            n = res.num_recv if sync else int(res.recv_count)
            y = buf.expert_output(res.num_recv)
            y.copy_(res.recv_x)
            out = buf.combine(y, res.handle)
            if i in (0, 1, SPARE_AHEAD, rounds - 1):
                rc = check_combine(out, idx, w, y[:n], local_world_size=cfg.local_world_size,
                                   num_experts=cfg.num_experts, scatter=res.handle.scatter,
                                   require_coverage=False, group=g)
                assert rc.passed, f"round {i}: {rc.message}"
            h = res.handle
            kept.append((out, out.clone(), h, h.scatter.clone(), idx.to(torch.int32), w))
        results = []
        for i, (out, out_then, h, slots_then, idx, w) in enumerate(kept):
            assert torch.equal(out, out_then), f"round {i}: combine output written by a later call"
            assert torch.equal(h.topk_idx, idx) and torch.equal(h.topk_weights, w), f"round {i}: routing"
            assert torch.equal(h.scatter, slots_then), f"round {i}: slots written by a later call"
            results += (out, h.scatter, h.topk_idx, h.topk_weights)
        assert all(t.is_contiguous() for t in results)
        assert share_no_byte(results), "two results share bytes"
        buf.check_ran()


def test_sync_free_dispatch_eagerly_and_in_a_graph(runtime):
    cfg, rank, (x0, idx0, w0) = _setup(runtime, T=48)
    dev, T, K, H, E = runtime.device, cfg.max_tokens, cfg.topk, cfg.hidden, cfg.num_experts
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        x, idx = x0.clone(), idx0.to(torch.int32)
        w = w0.clone()

        def expert() -> None:  # every slot through the test expert, experts found on the device
            ends = torch.cumsum(buf.tokens_per_expert.to(torch.int64), 0)
            local = torch.searchsorted(ends, torch.arange(cfg.capacity, device=dev), right=True)
            local.clamp_(max=cfg.experts_per_rank - 1)
            buf.recv_y.copy_(apply_test_expert(buf.recv_x, rank * cfg.experts_per_rank + local))

        def step():
            res = buf.dispatch(x, idx, w, sync=False)
            expert()
            return res, buf.combine(buf.recv_y, res.handle)

        def eager_reference():
            res = buf.dispatch(x, idx, w)
            expert()
            return res.num_recv, res.recv_x.clone(), buf.combine(buf.recv_y, res.handle)

        n, rows, want = eager_reference()
        res, got = step()
        assert int(res.recv_count) == n and torch.equal(res.recv_x[:n], rows) and torch.equal(got, want)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_res, g_out = step()
        for i in range(5):
            xi, ii, wi = make_inputs(rank, T, H, E, K, cfg.dtype, runtime.seed + 900 + i, routing="uniform")
            x.copy_(xi)
            idx.copy_(ii.to(torch.int32))
            w.copy_(wi)
            n, rows, want = eager_reference()
            buf.poison()
            graph.replay()
            torch.cuda.synchronize()
            assert int(g_res.recv_count) == n, f"replay {i}"
            assert torch.equal(g_res.recv_x[:n], rows) and torch.equal(g_out, want), f"replay {i}"
        del graph
        buf.check_ran()


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_a_dispatch_delivers_its_rows_into_the_callers_tensors_in_its_launch(runtime, layout):
    """``launch_dispatch(..., deliver=(rows, parts))``: the same launch copies each received row's bytes into
    the parts in order (a 400-byte part of 128-bit pieces, then 12 and 100 bytes of 4-byte words, the last
    starting off a 16-byte boundary), exactly the buffer's rows; rows past ``rows`` and a dispatch without
    ``deliver`` leave the parts as they were."""
    cfg, rank, (x, idx, w) = _setup(runtime, seed=11)
    idx = idx.to(torch.int32)
    dev = runtime.device
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        n = buf.dispatch(x, idx, w, layout=layout).num_recv
        want = buf.recv_x[:n].clone().view(torch.int32)  # 128 words a row (256 bf16)
        parts = tuple(torch.full((n + 2, cols), -7, dtype=torch.int32, device=dev) for cols in (100, 3, 25))
        buf.poison()
        buf.launch_dispatch(x, idx, w, layout=layout, deliver=(n, parts))
        torch.cuda.synchronize()
        assert torch.equal(torch.cat([p[:n] for p in parts], dim=1), want)
        assert all(bool((p[n:] == -7).all()) for p in parts)  # nothing past the rows asked for
        kept = [p.clone() for p in parts]
        buf.launch_dispatch(x, idx, w, layout=layout)  # no delivery: the parts stay as they were
        torch.cuda.synchronize()
        assert all(torch.equal(p, k) for p, k in zip(parts, kept, strict=True))
        buf.check_ran()


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_a_dispatch_assembles_its_rows_from_values_and_strided_words_in_its_launch(runtime, layout):
    """``launch_dispatch(..., assemble=(values, words))``: the same launch writes each row of x as the row of
    values (400 bytes), its 25 words from a column-major tensor, then zeros (12 bytes), and sends those
    rows: x and every received row byte for byte as a dispatch of the rows built by torch."""
    cfg, rank, (x, idx, w) = _setup(runtime, seed=13)
    idx = idx.to(torch.int32)
    dev, t = runtime.device, x.shape[0]
    g = torch.Generator().manual_seed(runtime.seed + 31 * rank)
    values = torch.randint(-2**31, 2**31 - 1, (t, 100), generator=g, dtype=torch.int32).to(dev)
    words = torch.randn(25, t, generator=g).to(dev).T  # [t, 25], column-major (DeepEP's FP8 scales)
    want = torch.cat([values.view(torch.uint8), words.contiguous().view(torch.uint8),
                      torch.zeros(t, 12, dtype=torch.uint8, device=dev)], dim=1)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        n = buf.dispatch(want.view(cfg.dtype), idx, w, layout=layout).num_recv
        received = buf.recv_x[:n].clone()
        rows = torch.full_like(x, float("nan"))  # every byte of it is the launch's to write
        buf.poison()
        buf.launch_dispatch(rows, idx, w, layout=layout, assemble=(values, words))
        torch.cuda.synchronize()
        assert torch.equal(rows.view(torch.uint8), want)
        assert torch.equal(buf.recv_x[:n].view(torch.uint8), received.view(torch.uint8))
        buf.check_ran()


CACHED_CASES = [("expert", False, True), ("expert", False, False), ("rank", False, True),
                ("rank", False, False), ("rank", True, True)]  # (layout, fp8, layout folded in)


@pytest.mark.parametrize("layout,fp8,fold", CACHED_CASES)
def test_a_cached_dispatch_sends_new_rows_along_the_latest_routing(runtime, layout, fp8, fold):
    """``launch_cached_dispatch(x2, handle)`` on the latest dispatch's handle (no layout runs; the layout
    folded into the dispatch or a kernel of its own otherwise): three calls in a row, from poisoned
    receive buffers, receive byte for byte what a full dispatch of x2 along the same routing receives (rows,
    source tags, weights, the rank layout's ids and weights), and leave its counts; a combine on the handle
    after them sums right."""
    cfg, rank, (x, idx, w) = _setup(runtime, seed=17)
    if not fold:
        cfg = dataclasses.replace(cfg, layout_in_dispatch=0)
    idx = idx.to(torch.int32)
    g = torch.Generator().manual_seed(runtime.seed + 53 * rank)
    x2 = torch.randn(x.shape, generator=g).to(x.dtype).to(runtime.device)
    names = ("recv_x", "recv_src", "recv_w") + (("recv_topk_idx", "recv_topk_w") if layout == "rank" else ())
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        full = buf.dispatch(x2, idx, w, layout=layout, fp8=fp8)
        n = full.num_recv
        want = {name: getattr(buf, name)[:n].clone() for name in names}
        counts = buf.tokens_per_expert.clone()
        res = buf.dispatch(x, idx, w, layout=layout, fp8=fp8)  # the handle: the same routing, x's rows
        assert res.num_recv == n
        buf.poison()
        for _ in range(3):
            assert buf.launch_cached_dispatch(x2, res.handle, fp8=fp8) is res.handle
        torch.cuda.synchronize()
        for name in names:
            got = getattr(buf, name)[:n]
            assert torch.equal(got.view(torch.uint8), want[name].view(torch.uint8)), name
        assert torch.equal(buf.tokens_per_expert, counts) and int(buf.num_recv[0]) == n
        buf.check_ran()  # each call advanced the layout's and the dispatch's epochs
        if not fp8:
            y = buf.expert_output(n)
            y.copy_(buf.recv_x[:n])
            out = buf.combine(y, res.handle)
            common = dict(local_world_size=cfg.local_world_size, num_experts=cfg.num_experts,
                          require_coverage=False, group=runtime.cpu_group)
            if layout == "rank":  # a row per (token, rank): the sum over ranks, no weights
                rc = check_rank_combine(out, idx, res.handle.scatter, y, **common)
            else:
                rc = check_combine(out, idx, w, y, scatter=res.handle.scatter, **common)
            assert rc.passed, rc.message
        buf.check_ran()


def _median_ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def test_dispatch_and_combine_overlap_a_gemm_on_their_own_stream(runtime):
    cfg, rank, (x, idx, w) = _setup(runtime, T=2048, H=4096, K=8, num_sms=24, seed=11)
    idx = idx.to(torch.int32)
    dev = runtime.device
    # The compute: three fp32 GEMMs without TF32 (about 8 ms on an H200). Not bf16: cuBLAS's bf16 GEMMs on
    # sm_90 are persistent kernels that hold every SM until they end, and measured beside them the
    # communication lost 0.3-0.75 ms instead of hiding (with torch's SM carve-out for cuBLASLt too);
    # expert GEMMs must leave the communication its SMs (DeepGEMM's num_sms), which torch.mm cannot.
    a = torch.randn(4096, 4096, dtype=torch.float32, device=dev)
    b = torch.randn(4096, 4096, dtype=torch.float32, device=dev)
    c = torch.empty_like(a)
    # A high-priority stream, as a serving loop would use: its kernels take SMs as the GEMM's CTAs retire.
    comm = torch.cuda.Stream(dev, priority=-1)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        outs = []

        def communicate(after: torch.cuda.Event | None = None) -> None:
            """dispatch -> identity expert -> combine, all on ``comm``, ordered after ``after`` (default:
            after the current stream)."""
            res = buf.dispatch(x, idx, w, sync=False, stream=comm, previous_event=after)
            with torch.cuda.stream(comm):
                buf.recv_y.copy_(buf.recv_x)
            outs.append(buf.combine(buf.recv_y, res.handle, stream=comm, previous_event=after))

        def compute() -> None:
            for _ in range(3):
                torch.mm(a, b, out=c)

        def both() -> None:
            # The inputs are ready now: the communication follows this event, not the GEMMs queued after
            # it on the current stream (without previous_event it would wait for them).
            ready = torch.cuda.Event()
            ready.record()
            compute()  # queued first (the host returns at once); the communication is enqueued beside it
            communicate(ready)

        communicate()
        torch.cuda.current_stream().wait_stream(comm)  # the output is ready only once ``comm`` is
        alone = outs.pop().clone()
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            comm_ms, gemm_ms = _median_ms(communicate), _median_ms(compute)
            product = c.clone()
            outs.clear()
            both_ms = _median_ms(both)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        buf.check_ran()
    # Checked after the buffer's collective close: a rank that fails here must not leave the others
    # waiting in it (they would then meet the next test's collectives out of step).
    assert torch.equal(c, product), "the GEMM's result changed when overlapped"
    assert all(torch.equal(o, alone) for o in outs), "results changed when overlapped"
    print(f"[rank {rank}] dispatch + combine {comm_ms:.3f} ms, GEMMs {gemm_ms:.3f} ms, "
          f"together {both_ms:.3f} ms (sum {comm_ms + gemm_ms:.3f} ms)")
    if runtime.placement.ranks_per_gpu == 1:
        # Ranks that share a GPU also run each other's GEMMs meanwhile: the sum is no bound there.
        # The saving is the group's: dispatch and combine wait for the peers, so a rank whose GEMMs end
        # first waits for the others' communication (2x H100, 2026-11-25: one rank saved 0.5 ms of
        # 0.76, the other lost up to 0.1). The sums over ranks are compared: the same verdict on every rank.
        times = torch.tensor([both_ms, comm_ms + gemm_ms], dtype=torch.float64)
        torch.distributed.all_reduce(times, group=runtime.cpu_group)
        overlapped, serial = times.tolist()
        assert overlapped < serial, f"over all ranks: overlapped {overlapped:.3f} ms, serial {serial:.3f} ms"
