"""What the GPU timing scripts share (``scripts/benchmark.py``, ``scripts/decode_breakdown.py``,
``scripts/kernel_times.py``; ``scripts/layout_bench.py`` and ``scripts/deep_ep_call_costs.py`` time calls
with :func:`deepep_bench`): their argument limits, the CUDA-event :class:`Timer`, the deterministic
:class:`InputSet` of one (routing, T), the EpBuffers of an SM-budget sweep, DeepEP opened and timed beside
ours (:func:`open_peer`, :func:`open_budget`, :func:`measure_deepep`; the peer itself is
:mod:`cute_ep.tools.bench_peers`), and the environment a report records.

Timing, the same for ours and every peer (:meth:`Timer.run`): the warm-up iterations untimed, then the GPU
is held by a short sleep kernel while the host enqueues the timed iterations (so the host's launch cost is
not timed), each between two CUDA events on the current stream. No host barrier inside the loop: the
kernels (and NCCL) synchronise the ranks, so an iteration's time is the op's steady-state time including
waiting for the slowest peer.

Pure Python at import time: torch, the GPU stack and ``deep_ep`` are imported inside the functions that
need them, so the scripts import this module before parsing their arguments (``--help`` runs anywhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from cute_ep.tools import bench_peers as bp  # pure Python + numpy (deep_ep only when a peer is opened)
from cute_ep.tools import bench_report as br  # pure Python + numpy

__all__ = [
    "CPU_WAY_OUT",
    "DTYPE_CHOICES",
    "MAX_HOLD_MS",
    "MAX_TOKENS_PER_RANK",
    "MIN_HOST_US_PER_ITER",
    "MULTICAST_VARS",
    "RECORDED_VARS",
    "InputSet",
    "Timer",
    "agree",
    "deepep_bench",
    "deepep_meta",
    "exchange_splits",
    "measure_deepep",
    "multicast_warnings",
    "open_budget",
    "open_deepep",
    "open_deepep_budget",
    "open_peer",
    "shared_module_buffers",
]

DTYPE_CHOICES = ("bfloat16", "float16", "float32")
"""The --dtype values (row element types) of the timing scripts."""
MAX_TOKENS_PER_RANK = 256 * 256  # make_inputs' limit
MULTICAST_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
RECORDED_VARS = (
    *MULTICAST_VARS,
    "NVSHMEM_SYMMETRIC_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "CUTE_EP_LOCAL_WORLD_SIZE",
    "NCCL_ALGO",
    "NCCL_PROTO",
)
"""The environment variables a report records (``meta["environment"]``): they change what is timed."""
CPU_WAY_OUT = "on a CPU, scripts/profile_backends.py --backends reference,a2a times the CPU backends"
"""What the GPU-only timing scripts suggest on a machine without CUDA."""
MIN_HOST_US_PER_ITER = 20.0  # floor of the host enqueue estimate that sizes the sleep
MAX_HOLD_MS = 5000.0  # longest sleep that holds the GPU while the host enqueues


def deepep_bench(fn: Callable[[], Any], warmup: int, iters: int) -> tuple[float, float]:
    """DeepEP's own ``bench`` (its tests/utils.py), for timing a public call as DeepEP's tests do: ``warmup``
    calls, the L2 flushed, ``iters`` calls each between two CUDA events on the current stream (the host
    launching as it goes), the first dropped. Returns (average, minimum) microseconds. Unlike
    :class:`Timer`, the host's own cost is inside each timing: it times calls, not kernels."""
    import torch

    torch.cuda.synchronize()
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    for _ in range(warmup):
        fn()
    cache.zero_()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True)][1:]
    return sum(times) / len(times), min(times)


def multicast_warnings() -> list[str]:
    """Lines about multicast variables that are not set to 'off' (the scripts never change them)."""
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    return [
        f"{k}={os.environ.get(k)!r} (NVLink multicast is expected off: {k}={v})"
        for k, v in off.items()
        if os.environ.get(k) != v
    ]


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


class Timer:
    """Per-iteration CUDA-event timing of ``step(i)`` on the current stream (see the module docstring).

    The host first runs the warm-up (untimed) and measures how long it takes to enqueue one
    iteration; then, after a host barrier, a sleep kernel holds the GPU for about 1.5x the time the
    host needs to enqueue one settling iteration plus every timed one, so the events see GPU time only.

    runtime: the cute_ep Runtime of this rank (its ``device`` and ``barrier()``, a host barrier of every
    rank). ``cycles_per_us`` is the sleep kernel's rate on this GPU, measured once here.
    """

    def __init__(self, runtime: Any) -> None:
        import torch

        self.runtime = runtime
        self.device = runtime.device
        torch.cuda._sleep(1000)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize(self.device)
        self.cycles_per_us = cycles / (start.elapsed_time(end) * 1e3)

    def run(self, step: Callable[[int], None], warmup: int, iters: int) -> list[float]:
        """Microseconds of each timed iteration ([iters] floats); iteration i of the loop calls ``step(i)``:
        ``warmup`` untimed ones (i < warmup), one settling one (i = warmup), then ``iters`` timed ones.
        Every rank calls it alike (host barriers)."""
        import torch

        self.runtime.barrier()
        host = []
        for i in range(warmup):
            t0 = time.perf_counter()
            step(i)
            host.append((time.perf_counter() - t0) * 1e6)
        # The median: a first call may set things up (NCCL's communicator, caches) and take long.
        host_us = max(br.median(host) if host else 100.0, MIN_HOST_US_PER_ITER)
        torch.cuda.synchronize(self.device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        hold_us = min(1.5 * host_us * (iters + 1) + 200.0, MAX_HOLD_MS * 1e3)
        self.runtime.barrier()
        torch.cuda._sleep(int(hold_us * self.cycles_per_us))
        step(warmup)  # settles the ranks' skew after the sleep (untimed)
        for i in range(iters):
            events[i][0].record()
            step(warmup + 1 + i)
            events[i][1].record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e3 for s, e in events]


# --------------------------------------------------------------------------------------------------
# one (routing, T): the inputs and what the peers need of them
# --------------------------------------------------------------------------------------------------


class InputSet:
    """One rank's inputs (on the GPU) and what the NCCL and DeepEP peers need of them.

    cfg: the run's EpConfig (hidden H, num_experts E, topk K, dtype, world_size R, experts_per_rank El);
    rank: this rank; device: where the tensors live; tokens: T; routing: a routing of cute_ep.inputs;
    seed: the set's seed (``cute_ep.inputs.make_inputs``).

    Tensors: x [T, H] cfg.dtype, idx [T, K] int32 expert ids or -1 (dropped), w [T, K] float32; send
    [P, H] cfg.dtype: this rank's rows grouped by destination rank for NCCL (P = kept (t, k) pairs, (t, k)
    row-major inside a destination); out [T, H] cfg.dtype: our combine's output; idx64 [T, K] int64 (made
    by :func:`measure_deepep`, DeepEP's topk_idx dtype). Counts: pairs_off / rows_off (bench_report's),
    send_splits [R] rows to each rank, recv_splits [R] rows from each rank (:func:`exchange_splits`).
    """

    def __init__(self, cfg: Any, rank: int, device: Any, tokens: int, routing: str, seed: int) -> None:
        import torch

        from cute_ep.inputs import make_inputs

        self.x, self.idx, self.w = make_inputs(
            rank, tokens, cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype, seed, routing=routing,
            device=device, idx_dtype=torch.int32,
        )  # fmt: skip
        idx_cpu = self.idx.cpu().numpy()
        el = cfg.experts_per_rank
        self.pairs_off = br.pairs_off(idx_cpu, rank, el)
        self.rows_off = br.rows_off(idx_cpu, rank, el)  # rows dispatch sends: once per (t, dest rank)
        self.send_splits = br.split_sizes(idx_cpu, cfg.world_size, el)
        self.recv_splits: list[int] = []
        # What DeepEP's rank-major dispatch sends and must deliver (checked before it is timed).
        self.dest_rows = bp.rows_per_rank(idx_cpu, cfg.world_size, el)  # [R] (token, rank) pairs per rank
        self.expert_pairs = bp.pairs_per_expert(idx_cpu, cfg.num_experts)  # [E]
        self.dest_count = bp.dest_ranks_per_token(idx_cpu, cfg.world_size, el)  # [T] ranks per token
        self.deepep_rows = 0  # rows this rank receives from DeepEP (exchange_splits)
        self.deepep_per_expert: list[int] = []  # [El] of them per local expert
        self.idx64: Any = None  # topk_idx as int64, DeepEP's dtype (made when DeepEP runs)
        self.deepep: Any = None  # bench_peers.DeepEpDispatch of this set at the current budget
        self.deepep_fp8: Any = None  # (e4m3 values, fp32 scales): DeepEP's FP8 input (with --fp8)
        # This rank's rows grouped by destination rank, (t, k) row-major inside a destination.
        flat = self.idx.to(torch.int64).view(-1)
        pair = torch.nonzero(flat >= 0).view(-1)
        dest = torch.div(flat[pair], el, rounding_mode="floor")
        order = torch.sort(dest, stable=True).indices
        self.send = self.x[torch.div(pair[order], cfg.topk, rounding_mode="floor")].contiguous()
        self.out = torch.empty_like(self.x)  # our combine's output
        self.handle: Any = None
        self.num_recv = 0


def exchange_splits(sets: list[InputSet], group: Any) -> None:
    """recv_splits[s] = rows source s sends this rank, and what DeepEP must deliver here (deepep_rows,
    deepep_per_expert), for every set of ``sets`` (the same sets, in the same order, on every rank).
    group: a CPU (gloo) process group of every rank; one host all-gather on it."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    mine = [(s.send_splits, s.dest_rows, s.expert_pairs) for s in sets]
    dist.all_gather_object(gathered, mine, group=group)
    for j, s in enumerate(sets):
        s.recv_splits = [gathered[src][j][0][rank] for src in range(world)]
        s.deepep_rows, s.deepep_per_expert = bp.expected_receive(
            [gathered[src][j][1] for src in range(world)], [gathered[src][j][2] for src in range(world)],
            rank, len(s.expert_pairs) // world,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the buffers of an SM-budget sweep, and DeepEP beside them
# --------------------------------------------------------------------------------------------------


def shared_module_buffers(runtime: Any) -> Callable[[Any, Any], Any]:
    """make_buffer(runtime, cfg) -> EpBuffer, every buffer on one ModuleRegistry: the SM budgets of a sweep
    differ only in a run-time scalar, so they share one compiled module. runtime: the cute_ep Runtime
    (the registry is finalized with it)."""
    from cute_ep.bootstrap.compile import ModuleRegistry
    from cute_ep.buffer import EpBuffer

    registry = ModuleRegistry(device_id=runtime.device.index)
    runtime.add_finalizer(registry.finalize_all)
    return lambda rt, c: EpBuffer(rt, c, registry=registry)


def agree(runtime: Any, reason: str | None) -> str | None:
    """Every rank's reason (None: fine here) -> one verdict, the same on every rank (a host all-gather on
    ``runtime.cpu_group``): DeepEP's calls are collective, so the ranks skip it together."""
    from cute_ep.tools.cli import all_gather

    return bp.first_reason(all_gather(reason, runtime.cpu_group))


def deepep_meta(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """A report's meta["deepep"] before the run (:func:`open_peer` fills in version or skipped), plus
    ``extra``. args: the parsed arguments (``peer_list``, ``num_sms_list``)."""
    return {
        "requested": "deepep" in args.peer_list,
        "version": None,  # filled in when DeepEP runs
        "skipped": None,  # why it cannot run in this world (rows also say why per budget / size)
        "num_sms": {str(b): bp.deepep_num_sms(b) or None for b in args.num_sms_list},
        **extra,
    }


def open_deepep(runtime: Any, cfg: Any, args: argparse.Namespace) -> tuple[Any, str | None]:
    """(a bench_peers.DeepEpPeer, None), or (None, why DeepEP cannot run in this world): the same on
    every rank. Never raises for a missing or unusable deep_ep. runtime: the cute_ep Runtime; cfg: the
    run's EpConfig; args: the parsed arguments (``dtype``)."""
    env = runtime.env
    module, import_error = bp.import_deep_ep()
    why = bp.deepep_skip_reason(
        import_error=import_error, device_type=runtime.device.type, world_size=env.world_size,
        ranks_per_host=env.physical_local_world_size, dtype=args.dtype, hidden=cfg.hidden,
        experts_per_rank=cfg.experts_per_rank, topk=cfg.topk,
    )  # fmt: skip
    why = agree(runtime, why)
    if why:
        return None, why
    peer = bp.DeepEpPeer(runtime.group, world_size=env.world_size, hidden=cfg.hidden,
                         num_experts=cfg.num_experts, module=module)  # fmt: skip
    return peer, None


def open_deepep_budget(peer: Any, budget: int, runtime: Any) -> tuple[Any, str | None]:
    """(DeepEP at our SM budget ``budget``, None), or (None, why not), the same on every rank.
    peer: a bench_peers.DeepEpPeer (or a stand-in with its ``budget`` / ``discard``)."""
    why = bp.deepep_budget_skip_reason(budget)  # the same on every rank: no exchange
    if why:
        return None, why
    dep, err = None, None
    try:
        dep = peer.budget(budget)
    except Exception as exc:  # a Buffer that cannot be made (NVLink check, IPC, memory): skip, do not crash
        err = f"DeepEP Buffer at {bp.deepep_num_sms(budget)} SMs failed ({type(exc).__name__}: {exc})"
    why = agree(runtime, err)
    if why:
        # Not destroyed: its destroy is a device barrier that a rank without a buffer would never join.
        peer.discard(budget)
        return None, why
    return dep, None


def open_peer(
    make_deepep: Callable[[Any, Any, argparse.Namespace], tuple[Any, str | None]],
    runtime: Any,
    cfg: Any,
    args: argparse.Namespace,
    meta: dict[str, Any],
    say: Any,
    not_requested: str,
) -> tuple[Any, str | None]:
    """DeepEP for a run (``make_deepep``, e.g. :func:`open_deepep`) if --peers names it: (the peer, None)
    or (None, why not; ``not_requested`` without deepep in --peers). Records why not, or DeepEP's version,
    in meta["deepep"] (made by :func:`deepep_meta`) and says which (``say(line)``: rank 0 prints)."""
    if "deepep" not in args.peer_list:
        return None, not_requested
    peer, skipped = make_deepep(runtime, cfg, args)
    meta["deepep"]["skipped"] = skipped
    if peer is None:
        say(f"DeepEP skipped: {skipped}")
        return None, skipped
    meta["deepep"]["version"] = bp.deepep_version()
    budgets = ", ".join(f"{b}->{bp.deepep_num_sms(b) or 'none'}" for b in args.num_sms_list)
    version = meta["deepep"]["version"] or "(version unknown)"
    say(f"DeepEP {version}: SM budgets (ours->DeepEP's) {budgets}")
    return peer, skipped


def open_budget(
    make_buffer: Callable[[Any, Any], Any],
    runtime: Any,
    cfg: Any,
    budget: int,
    peer: Any,
    peer_skipped: str | None,
    say: Any,
) -> tuple[Any, Any, Any, str | None]:
    """One SM budget of a run: (``cfg`` at ``budget``, our buffer of it (``make_buffer``; said when
    ready), DeepEP at that budget or None, why not (``peer_skipped`` without a peer)). peer: what
    :func:`open_peer` returned (None when DeepEP does not run)."""
    cfg_b = dataclasses.replace(cfg, num_sms=budget)
    t0 = time.perf_counter()
    buf = make_buffer(runtime, cfg_b)  # the first compiles the module (tens of s) unless cached
    say(f"EpBuffer ({budget} SMs) ready in {time.perf_counter() - t0:.1f} s")
    dep, dep_skipped = None, peer_skipped
    if peer is not None:
        dep, dep_skipped = open_deepep_budget(peer, budget, runtime)
        if dep_skipped:
            say(f"DeepEP at {budget} SMs skipped: {dep_skipped}")
    return cfg_b, buf, dep, dep_skipped


def measure_deepep(dep: Any, sets: list[InputSet], runtime: Any, timer: Any,
                   args: argparse.Namespace) -> tuple[list[float] | None, str | None]:  # fmt: skip
    """This rank's medians (us, in bench_peers.DEEPEP_TIMES order, then DEEPEP_FP8_TIMES with
    ``args.fp8``) of DeepEP on ``sets``, or (None, why not); the verdict is the same on every rank.

    dep: a bench_peers.DeepEpBudget; sets: the input sets after :func:`exchange_splits`; timer: a
    :class:`Timer` (or a stand-in with its ``run``); args: the parsed arguments (``warmup``, ``iters``,
    ``fp8`` if present).

    First, untimed, per set: a full dispatch (its handle, rows and routing are what the timed calls
    reuse), checked (rows received, rows per local expert, the cached dispatch repeats it bit for bit,
    combine(dispatch(x)) = x times the token's destination ranks), and with ``fp8`` the FP8 input and its
    check (:func:`_deepep_fp8_inputs`). Then the four timed calls (seven with ``fp8``)."""
    import torch

    n = len(sets)
    why = None
    try:
        for s in sets:
            if s.idx64 is None:
                s.idx64 = s.idx.to(torch.int64)  # DeepEP's topk_idx dtype; converted once, untimed
            # Every rank makes the same collective calls whatever its checks say; the verdicts meet below.
            s.deepep = made = dep.dispatch_full(s.x, s.idx64, s.w)
            cached = dep.dispatch_cached(s.x, made.handle)
            combined = dep.combine(made.recv_x, made.handle)
            why = why or bp.check_deepep_dispatch(
                made.recv_x.shape[0], made.tokens_per_expert, s.deepep_rows, s.deepep_per_expert
            )
            if why is None and not torch.equal(cached, made.recv_x):
                why = "DeepEP's cached dispatch differs from its full dispatch on the same input"
            if why is None:
                why = bp.check_deepep_combine(s.x, combined, torch.from_numpy(s.dest_count).to(s.x.device))
    except Exception as exc:  # the same call on every rank: a host-side refusal is the same everywhere
        why = f"DeepEP call failed ({type(exc).__name__}: {exc})"
    why = agree(runtime, why)
    names = bp.DEEPEP_TIMES
    if getattr(args, "fp8", False) and not why:
        names += bp.DEEPEP_FP8_TIMES
        why = agree(runtime, _deepep_fp8_inputs(dep, sets))
    steps = {
        "dispatch": lambda i: dep.dispatch_cached(sets[i % n].x, sets[i % n].deepep.handle),
        "full_dispatch": lambda i: dep.dispatch_full(sets[i % n].x, sets[i % n].idx64, sets[i % n].w),
        "dispatch_permute": lambda i: dep.dispatch_permute(sets[i % n].x, sets[i % n].deepep),
        "combine": lambda i: dep.combine(sets[i % n].deepep.recv_x, sets[i % n].deepep.handle),
        "fp8_dispatch": lambda i: dep.dispatch_cached(sets[i % n].deepep_fp8, sets[i % n].deepep.handle),
        "fp8_full_dispatch": lambda i: dep.dispatch_full(sets[i % n].deepep_fp8, sets[i % n].idx64,
                                                         sets[i % n].w),
        "fp8_dispatch_permute": lambda i: dep.dispatch_permute(sets[i % n].deepep_fp8, sets[i % n].deepep),
    }
    medians: list[float] = []
    for name in names:
        if why:
            break
        err = None
        try:
            medians.append(br.median(timer.run(steps[name], args.warmup, args.iters)))
        except Exception as exc:
            err = f"DeepEP {name} failed while timed ({type(exc).__name__}: {exc})"
        why = agree(runtime, err)
    for s in sets:
        s.deepep = s.deepep_fp8 = None  # its received rows: up to R * T rows of H per set
    return (None, why) if why else (medians, None)


def _deepep_fp8_inputs(dep: Any, sets: list[InputSet]) -> str | None:
    """Each set's rows as DeepEP's FP8 input (``s.deepep_fp8``: e4m3 values [T, H] and fp32 scales
    [T, H / 128], column-major as DeepEP's test passes them), quantized by ``cute_ep.fp8`` as our kernels
    quantize, outside the timed calls; then one cached FP8 dispatch per set, checked: it must receive the
    rows its bf16 dispatch received, quantized alike, bit for bit. None, or why not (this rank's)."""
    import torch

    from cute_ep.fp8 import quantize_fp8

    for s in sets:
        q, scales = quantize_fp8(s.x)
        s.deepep_fp8 = (q, scales.T.contiguous().T)
    why = None
    try:
        for s in sets:  # every rank makes the same collective calls whatever its checks say
            got_q, got_scales = dep.dispatch_cached(s.deepep_fp8, s.deepep.handle)
            want_q, want_scales = quantize_fp8(s.deepep.recv_x)  # row-wise: the received rows' own
            if not (torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
                    and torch.equal(got_scales, want_scales)):
                why = why or "DeepEP's FP8 dispatch did not receive the sent rows' e4m3 values and scales"
    except Exception as exc:  # the same call on every rank
        why = f"DeepEP FP8 dispatch failed ({type(exc).__name__}: {exc})"
    return why
