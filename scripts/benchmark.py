"""Bandwidth sweep of cute-ep's dispatch and combine against NCCL all_to_all, on one or more GPUs.

To run (one process per GPU; keep NVLink multicast off, as on the lent hosts):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 scripts/benchmark.py \\
        --out-json baselines/perf/h200x4.json --out-png baselines/perf/h200x4.png

    # a quick look: fewer sizes, one routing
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 512,4096 --routing uniform --iters 20

    # FP8 dispatch as well (rows "scatter+fp8": packed e4m3 rows, NCCL moving the same packed rows)
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 128,4096 --routing uniform --fp8

    # the reduced combine as well (rows "scatter+reduced")
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 128,4096 --routing uniform \\
        --combine pull,reduced

    # plot again from a saved report (CPU, no launch)
    python -c "from cute_ep import bench_report as b; b.plot(b.load_json('r.json'), 'r.png')"

What is measured, for every routing (--routing), tokens per rank T (--tokens) and dispatch mode
(--modes), with hidden H, top-k K, E experts (defaults: DeepSeek-V3's 7168, 8, 256) in --dtype:
    * One Runtime and ONE EpBuffer sized for the largest T serve the whole sweep (one compiled module).
    * --input-sets deterministic input sets (cute_ep.inputs.make_inputs, seeds --seed + j) live on
      the GPU and are rotated across iterations, so that the caches do not flatter repeated inputs.
    * T <= --validate-max-tokens: first one bit-exact round on input set 0 (dispatch layout, rows,
      weights, tags; a non-identity test expert; combine), checked on every rank; a mismatch aborts.
    * dispatch: CUDA events around ``EpBuffer.launch_dispatch`` (the layout kernel, with its count
      exchange, AND the dispatch kernel: both are in the dispatch time).
    * combine: after one real dispatch per input set (for its handle), CUDA events around
      ``EpBuffer.launch_combine`` (which includes copying the handle's [T, K] int32 slots into the
      buffer, T*K*4 bytes on the device, before the kernel). One more real combine checks afterwards
      that every timed launch ran.
    * NCCL: ``torch.distributed.all_to_all_single`` on the default (NCCL) group moving exactly the
      same rows (this rank's rows grouped by destination rank, self included, built once outside the
      timed region; split sizes exchanged first); for combine the reverse direction.
    * Timing, the same for all four: --warmup untimed iterations, then the GPU is held by a short
      sleep kernel while the host enqueues --iters iterations (so the host's launch cost is not
      timed), each between two CUDA events on the current stream. No host barrier inside the loop:
      the kernels (and NCCL) synchronise the ranks, so an iteration's time is the op's steady-state
      time including waiting for the slowest peer. Per rank: the median; the report gives the
      slowest rank's median (min / max / every rank in the JSON).
    * Bandwidth (design.md, "Measuring"): pairs_off = this rank's non-dropped (t, k) pairs whose expert
      lives on another rank, rows_off = its distinct (t, destination rank) pairs among those (both
      means over the input sets). Algorithmic = pairs_off * H * b / time (GB/s = 1e9 B/s), from the
      mean pairs_off over ranks and the slowest rank's median; moved = bytes our kernels move
      (dispatch rows_off * H*b + 12 * pairs_off: each row once per destination rank, and per pair
      its weight, source tag and from-slot; combine pairs_off * H*b), means over ranks, and their
      percentage of the 450 GB/s NVLink4 line rate; NCCL GB/s with the algorithmic formula; ratio =
      NCCL time / our time (> 1: faster than NCCL).
    * --fp8: per mode, one more row "<mode>+fp8": dispatch with ``fp8=True`` (quantized in the kernel)
      against NCCL moving the same rows packed the same way (cfg.fp8_row_bytes each: e4m3 values plus
      fp32 scales, quantized outside the timed region); moved bytes and NCCL's rate use the packed
      size, the algorithmic bandwidth the input dtype's rows; combine is the mode's own (unchanged).
    * --combine pull,reduced: the buffer is built for the reduced combine (so every dispatch also records
      its group lists, and the dispatch times include that), and per mode one more row "<mode>+reduced"
      times ``launch_combine(..., "reduced")`` on the latest dispatch's handle (the expert ranks' group
      lists belong to it); its moved bytes are rows_off partial rows (one per off-rank (token, rank)
      group), its algorithmic bandwidth the pull formula's (pairs_off rows), as for NCCL.

Output on rank 0: a table, one line per (routing, T, mode) as it completes; with --out-json the report
(device, world and local world size, config, symmetric bytes per rank, package versions, git sha,
time, command line, rows; rewritten after every row, see cute_ep.bench_report for the schema); with
--out-png bandwidth vs tokens per rank, ours vs NCCL, dispatch and combine.

Constraints:
    * GPU only: one GPU per rank, CUDA, NVSHMEM and NCCL (--help alone runs anywhere).
    * --num-experts divisible by the world size; 1 <= --topk <= min(--num-experts, 64);
      --hidden >= 4 with --hidden * element size a multiple of 16 bytes.
    * every --tokens value in [1, 65536]; world size * max(--tokens) * topk < 2**31. Symmetric memory
      per rank ~ 2 * world * max(--tokens) * min(topk, experts per rank) * H * b (7.5 GB for the
      defaults on 4 GPUs); the NCCL buffers take about as much again on a hot rank under skew.
    * --local-world-size (or CUTE_EP_LOCAL_WORLD_SIZE) divides the ranks per host (virtual nodes).
    * This script never sets NCCL / NVSHMEM / PyTorch multicast variables; it records them.

Exit status (the same on every rank): 0 done, 1 a check failed or a run-time error, 2 bad arguments
or settings (an --out-json / --out-png that cannot be written, a malformed or too small
NVSHMEM_SYMMETRIC_SIZE).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cute_ep import bench_report as br  # pure Python + numpy: safe before parsing

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
ROUTING_CHOICES = ("uniform", "skewed", "dropped")  # cute_ep.inputs.ROUTINGS (checked at run time)
MODE_CHOICES = ("scatter", "atomic")  # kernels.config.MODES (checked at run time)
DTYPE_CHOICES = ("bfloat16", "float16", "float32")
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
MIN_HOST_US_PER_ITER = 20.0  # floor of the host enqueue estimate that sizes the sleep
MAX_HOLD_MS = 5000.0


class UsageError(ValueError):
    """Arguments the script cannot run with; exit status 2."""


class CheckFailed(RuntimeError):
    """The checked round before timing found a mismatch (the same verdict on every rank)."""


# --------------------------------------------------------------------------------------------------
# arguments (no torch / GPU import before parsing: --help works anywhere)
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / what is measured / Constraints).")
    p.add_argument("--hidden", type=int, default=7168, help="elements per row (H)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (K)")
    p.add_argument("--num-experts", type=int, default=256, help="experts in total (E)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="bfloat16", help="row element type")
    p.add_argument(
        "--tokens",
        default="128,256,512,1024,2048,4096,8192",
        help="comma-separated tokens per rank; the buffer is sized for the largest",
    )
    p.add_argument(
        "--routing",
        default="uniform,skewed",
        help=f"comma-separated routings of cute_ep.inputs: {', '.join(ROUTING_CHOICES)}",
    )
    p.add_argument(
        "--modes", default="scatter", help=f"comma-separated dispatch modes: {', '.join(MODE_CHOICES)}"
    )
    p.add_argument("--iters", type=int, default=50, help="timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before them")
    p.add_argument("--input-sets", type=int, default=3, help="input sets rotated across iterations")
    p.add_argument("--num-sms", type=int, default=132, help="CTAs of dispatch / combine")
    p.add_argument(
        "--validate-max-tokens",
        type=int,
        default=1024,
        help="check a bit-exact round first for every T up to this (0: never)",
    )
    p.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="ranks per (virtual) node; default $CUTE_EP_LOCAL_WORLD_SIZE, else ranks per host",
    )
    p.add_argument("--out-json", metavar="PATH", help="write the report here (rank 0; after every row)")
    p.add_argument("--out-png", metavar="PATH", help="plot bandwidth vs tokens here at the end (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="input set j uses seed + j")
    p.add_argument("--fp8", action="store_true", help="also time FP8 dispatch (--hidden a multiple of 128)")
    p.add_argument("--combine", default="pull",
                   help="comma-separated combine algorithms: pull, reduced (rows '<mode>+reduced')")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Launch-independent checks; fills args.token_list, routing_list, mode_list. Raises UsageError."""
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.routing_list = br.parse_name_list(args.routing, "--routing", ROUTING_CHOICES)
        args.mode_list = br.parse_name_list(args.modes, "--modes", MODE_CHOICES)
        args.combine_list = br.parse_name_list(args.combine, "--combine", ("pull", "reduced"))
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None
    if max(args.token_list) > MAX_TOKENS_PER_RANK:
        raise UsageError(f"--tokens values must be <= {MAX_TOKENS_PER_RANK}, got {max(args.token_list)}")
    if args.iters < 1 or args.warmup < 0 or args.input_sets < 1:
        raise UsageError(
            f"need --iters >= 1, --warmup >= 0, --input-sets >= 1; got {args.iters}, {args.warmup}, "
            f"{args.input_sets}"
        )
    if args.hidden < 4:
        raise UsageError(f"--hidden must be >= 4 (the first columns name the sender), got {args.hidden}")
    if args.num_sms < 1:
        raise UsageError(f"--num-sms must be >= 1, got {args.num_sms}")
    if args.fp8 and args.hidden % 128:
        raise UsageError(f"--fp8 needs --hidden to be a multiple of 128, got {args.hidden}")
    if args.validate_max_tokens < 0:
        raise UsageError(f"--validate-max-tokens must be >= 0, got {args.validate_max_tokens}")
    if args.out_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--out-png needs matplotlib (pip install matplotlib)") from None
    # Rank 0 alone writes them: a write error there would leave the other ranks in a collective.
    for flag, value in (("--out-json", args.out_json), ("--out-png", args.out_png)):
        if value:
            check_writable(flag, value)


def check_writable(flag: str, value: str) -> None:
    """Raise UsageError unless ``value`` can be written (``bench_report.check_writable``; write_json and
    plot create missing parents)."""
    try:
        br.check_writable(flag, value)
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


class Timer:
    """Per-iteration CUDA-event timing of ``step(i)`` on the current stream (see the docstring).

    The host first runs the warm-up (untimed) and measures how long it takes to enqueue one
    iteration; then, after a host barrier, a sleep kernel holds the GPU for about 1.5x the time the
    host needs to enqueue one settling iteration plus every timed one, so the events see GPU time only.
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
        """Microseconds of each timed iteration (iteration i of the loop calls ``step(i)``)."""
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
# one (routing, T): inputs, NCCL buffers, the checked round
# --------------------------------------------------------------------------------------------------


class InputSet:
    """One rank's inputs (on the GPU, topk_idx int32) and what the NCCL baseline needs of them."""

    def __init__(
        self, args: argparse.Namespace, cfg: Any, rank: int, device: Any, tokens: int, routing: str, seed: int
    ) -> None:
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
    """recv_splits[s] = rows source s sends this rank, for every set (one host all-gather)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [s.send_splits for s in sets], group=group)
    for j, s in enumerate(sets):
        s.recv_splits = [gathered[src][j][rank] for src in range(world)]


def checked_round(buf: Any, cfg: Any, runtime: Any, s: InputSet, mode: str, tag: str, say: Any,
                  fp8: bool = False, combines: tuple[str, ...] = ("pull",)) -> None:
    """Dispatch + test expert + combine on ``s``, checked bit for bit; raise CheckFailed on every rank.
    fp8: the received packed rows against the senders' rows quantized by cute_ep.fp8. combines: the
    combine algorithms to run and check on the dispatch's handle."""
    from cute_ep.cli import expert_ids
    from cute_ep.fp8 import fp8_check_rows
    from cute_ep.reference import apply_test_expert
    from cute_ep.validators.checks import check_combine, check_dispatch, check_layout, report

    group, rank = runtime.cpu_group, runtime.env.rank
    lws = cfg.local_world_size
    buf.poison()
    res = buf.dispatch(s.x, s.idx, s.w, mode=mode, fp8=fp8)
    results = [("layout", check_layout(
        res, s.idx, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts, local_world_size=lws,
        group=group,
    ))]  # fmt: skip
    rows, recv_rows, expert_in = s.x, res.recv_x, res.recv_x
    if fp8:
        rows, recv_rows, expert_in = fp8_check_rows(s.x, res.recv_x, res.recv_scales, cfg.fp8_row_bytes)
        expert_in = expert_in.to(cfg.dtype).to(runtime.device)
    results.append(("dispatch", check_dispatch(
        rows, s.idx, s.w, recv_rows, res.recv_weights, res.recv_src, max_tokens=cfg.max_tokens,
        num_experts=cfg.num_experts, local_world_size=lws, ordered=(mode == "scatter"),
        require_coverage=False, group=group,
    )))  # fmt: skip
    y = buf.expert_output(res.num_recv)
    experts = expert_ids(res, rank)
    if experts is None:  # the layout check failed already; give combine defined input
        y.fill_(float("nan"))
    else:
        y.copy_(apply_test_expert(expert_in, experts.to(runtime.device)))
    for algorithm in combines:
        out = buf.combine(y, res.handle, algorithm=algorithm)
        results.append((f"{algorithm} combine", check_combine(
            out, s.idx, s.w, y, local_world_size=lws, num_experts=cfg.num_experts,
            scatter=res.handle.scatter, require_coverage=False, group=group, algorithm=algorithm,
        )))  # fmt: skip
    failed = [name for name, r in results if not r.passed]  # verdicts are the same on every rank
    for name, r in results:
        if not r.passed:
            report(r, f"{tag} {name}", group, say)  # collective: every rank takes this branch
    if failed:
        raise CheckFailed(f"{tag}: the {', '.join(failed)} check(s) failed (details above); not timing it")


# --------------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------------


def measure(
    buf: Any,
    cfg: Any,
    runtime: Any,
    timer: Any,
    args: argparse.Namespace,
    routing: str,
    tokens: int,
    say: Any,
) -> list[dict[str, Any]]:
    """Rows (on rank 0; [] elsewhere) of every mode for one (routing, T)."""
    import torch
    import torch.distributed as dist

    from cute_ep.cli import all_gather

    env, device = runtime.env, runtime.device
    n = args.input_sets
    sets = [InputSet(args, cfg, env.rank, device, tokens, routing, args.seed + j) for j in range(n)]
    exchange_splits(sets, runtime.cpu_group)
    recv = torch.empty((max(sum(s.recv_splits) for s in sets), cfg.hidden), dtype=cfg.dtype, device=device)
    nccl_group = runtime.group

    def nccl_dispatch(i: int) -> None:
        s = sets[i % n]
        dist.all_to_all_single(
            recv[: sum(s.recv_splits)], s.send, s.recv_splits, s.send_splits, group=nccl_group
        )

    def nccl_combine(i: int) -> None:
        s = sets[i % n]
        dist.all_to_all_single(
            s.send, recv[: sum(s.recv_splits)], s.send_splits, s.recv_splits, group=nccl_group
        )

    nccl_d = br.median(timer.run(nccl_dispatch, args.warmup, args.iters))
    nccl_c = br.median(timer.run(nccl_combine, args.warmup, args.iters))
    nccl_fp8: list[float] = []

    def nccl_fp8_dispatch() -> float:
        """NCCL moving the same rows packed as FP8 (quantized here, outside the timed region); once."""
        if not nccl_fp8:
            from cute_ep.fp8 import pack_fp8_rows, quantize_fp8

            packed = [pack_fp8_rows(*quantize_fp8(s.send), cfg.fp8_row_bytes) for s in sets]
            recv8 = torch.empty((recv.shape[0], cfg.fp8_row_bytes), dtype=torch.uint8, device=device)

            def step(i: int) -> None:
                s = sets[i % n]
                dist.all_to_all_single(
                    recv8[: sum(s.recv_splits)], packed[i % n], s.recv_splits, s.send_splits, group=nccl_group
                )

            nccl_fp8.append(br.median(timer.run(step, args.warmup, args.iters)))
        return nccl_fp8[0]
    pairs = sum(s.pairs_off for s in sets) / n
    rows_sent = sum(s.rows_off for s in sets) / n

    rows = []
    for mode in args.mode_list:
        checked = tokens <= args.validate_max_tokens
        if checked:
            checked_round(buf, cfg, runtime, sets[0], mode, f"[{routing} T={tokens} {mode}]", say,
                          combines=tuple(args.combine_list))

        def our_dispatch(i: int, mode: str = mode) -> None:
            s = sets[i % n]
            buf.launch_dispatch(s.x, s.idx, s.w, mode)

        ours_d = br.median(timer.run(our_dispatch, args.warmup, args.iters))
        # Real dispatches (checked launches) give each set's handle; the expert outputs' values do not
        # change combine's cost, so recv_y holds the last set's received rows (zeros beyond them).
        buf.expert_output(cfg.capacity).zero_()
        for s in sets:
            res = buf.dispatch(s.x, s.idx, s.w, mode=mode)
            s.handle, s.num_recv = res.handle, res.num_recv
        buf.expert_output(res.num_recv).copy_(res.recv_x)

        def our_combine(i: int) -> None:
            s = sets[i % n]
            buf.launch_combine(s.handle, s.out, "pull")

        variants = []
        if "pull" in args.combine_list:
            ours_c = br.median(timer.run(our_combine, args.warmup, args.iters))
            buf.combine(buf.expert_output(sets[0].num_recv), sets[0].handle, algorithm="pull")  # all ran?
            variants.append((mode, ours_d, nccl_d, 0, ours_c))
        if "reduced" in args.combine_list:
            # The group lists on the expert ranks are the latest dispatch's: every iteration combines
            # that dispatch's handle (the last input set's).
            last = sets[-1]

            def our_reduced_combine(i: int, last: InputSet = last) -> None:
                buf.launch_combine(last.handle, last.out, "reduced")

            reduced_c = br.median(timer.run(our_reduced_combine, args.warmup, args.iters))
            buf.combine(buf.expert_output(last.num_recv), last.handle, algorithm="reduced")  # all ran?
            variants.append((f"{mode}+reduced", ours_d, nccl_d, 0, reduced_c))
        if args.fp8:
            if checked:
                checked_round(buf, cfg, runtime, sets[0], mode, f"[{routing} T={tokens} {mode}+fp8]", say,
                              fp8=True)

            def our_fp8_dispatch(i: int, mode: str = mode) -> None:
                s = sets[i % n]
                buf.launch_dispatch(s.x, s.idx, s.w, mode, fp8=True)

            fp8_d = br.median(timer.run(our_fp8_dispatch, args.warmup, args.iters))
            buf.dispatch(sets[0].x, sets[0].idx, sets[0].w, mode=mode, fp8=True)  # raises if one did not run
            variants.append((f"{mode}+fp8", fp8_d, nccl_fp8_dispatch(), cfg.fp8_row_bytes, variants[0][4]))
        for label, t_d, t_nccl_d, d_row, t_c in variants:
            per_rank = all_gather((pairs, rows_sent, t_d, t_c, t_nccl_d, nccl_c), runtime.cpu_group)
            if env.rank == 0:
                row = br.BenchRow.from_measurements(
                    routing=routing, tokens=tokens, mode=label, checked=checked, row_bytes=cfg.row_bytes,
                    pairs_off=[p[0] for p in per_rank], rows_off=[p[1] for p in per_rank],
                    dispatch_us=[p[2] for p in per_rank], combine_us=[p[3] for p in per_rank],
                    nccl_dispatch_us=[p[4] for p in per_rank], nccl_combine_us=[p[5] for p in per_rank],
                    dispatch_row_bytes=d_row, reduced_combine=label.endswith("+reduced"),
                )  # fmt: skip
                rows.append(row.to_dict())
                say(br.format_row(row))
    return rows


def make_meta(args: argparse.Namespace, cfg: Any, runtime: Any) -> dict[str, Any]:
    import torch

    env = runtime.env
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # not every build has it
        nccl = None
    versions = br.package_versions()
    versions["nccl"] = nccl
    versions["cuda"] = torch.version.cuda
    return {
        "device": torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu",
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "virtual_nodes": env.is_virtual,
        "config": {
            "hidden": cfg.hidden,
            "topk": cfg.topk,
            "num_experts": cfg.num_experts,
            "experts_per_rank": cfg.experts_per_rank,
            "dtype": args.dtype,
            "element_size": cfg.element_size,
            "row_bytes": cfg.row_bytes,
            "max_tokens": cfg.max_tokens,
            "capacity": cfg.capacity,
            "num_sms": cfg.num_sms,
            "tokens": args.token_list,
            "routings": args.routing_list,
            "modes": args.mode_list,
            "combines": args.combine_list,
            "iters": args.iters,
            "warmup": args.warmup,
            "input_sets": args.input_sets,
            "validate_max_tokens": args.validate_max_tokens,
            "seed": args.seed,
        },
        "symmetric_bytes": cfg.symmetric_bytes(),
        "symmetric_heap": runtime.symmetric_size,
        "line_rate_gbps": br.NVLINK4_LINE_RATE_GBPS,
        "timing": (
            "CUDA events per iteration after warm-up, GPU held by a sleep while the host enqueues; "
            "median per rank, slowest rank reported; dispatch includes the layout kernel; combine "
            "includes copying the handle's slots"
        ),
        "environment": {k: os.environ.get(k) for k in RECORDED_VARS},
        "versions": versions,
        "git_sha": br.git_sha(),
        "timestamp": br.utc_timestamp(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def run(args: argparse.Namespace) -> int:
    from cute_ep.bootstrap.dist_env import DistEnv, DistEnvError
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.cli import Printer, config_from_args, launch_rank, run_guarded
    from cute_ep.inputs import ROUTINGS
    from cute_ep.kernels.config import MODES, ConfigError

    rank_hint = launch_rank()
    try:
        if set(args.routing_list) - set(ROUTINGS) or set(args.mode_list) - set(MODES):
            raise UsageError(f"routings must be in {ROUTINGS} and modes in {sorted(MODES)}")
        env = DistEnv.from_environ(local_world_size=args.local_world_size)
        cfg = config_from_args(args, env, max_tokens=max(args.token_list))
    except (UsageError, ConfigError, DistEnvError) as exc:
        if rank_hint == "0" or isinstance(exc, DistEnvError):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE

    def timed_sweep(args: argparse.Namespace, env: Any, cfg: Any) -> int:
        with Runtime(env, symmetric_bytes=cfg.symmetric_bytes()) as runtime:
            return sweep(args, cfg, runtime, Printer(env.rank))

    return run_guarded(timed_sweep, args, env, cfg)


def sweep(
    args: argparse.Namespace,
    cfg: Any,
    runtime: Any,
    say: Any,
    *,
    make_buffer: Callable[[Any, Any], Any] | None = None,
    make_timer: Callable[[Any], Any] | None = None,
) -> int:
    """Every (routing, T, mode) with one EpBuffer; rank 0 prints, writes the report and the plot.

    ``make_buffer(runtime, cfg)`` / ``make_timer(runtime)`` default to EpBuffer / Timer (the CPU
    tests pass stand-ins to run this flow over gloo).
    """
    from cute_ep.cli import all_gather, leave

    if make_buffer is None:
        from cute_ep.buffer import EpBuffer as make_buffer
    make_timer = Timer if make_timer is None else make_timer

    env = runtime.env
    meta = make_meta(args, cfg, runtime)
    devices = sorted(set(all_gather(meta["device"], runtime.cpu_group)))
    sym = cfg.symmetric_bytes()
    say(
        f"cute-ep benchmark: {', '.join(devices)} x {env.world_size} = {cfg.nnodes} node(s) x "
        f"{cfg.local_world_size}{' (virtual nodes)' if env.is_virtual else ''}; git {meta['git_sha']}",
        f"H {cfg.hidden}, top-k {cfg.topk}, E {cfg.num_experts} ({cfg.experts_per_rank}/rank), {args.dtype}, "
        f"tokens/rank {args.token_list}, routings {args.routing_list}, modes {args.mode_list}, "
        f"num_sms {cfg.num_sms}, {args.warmup} warm-up + {args.iters} timed iterations, "
        f"{args.input_sets} input sets",
        f"symmetric memory per rank: {sym} bytes ({sym / 2**30:.2f} GiB), heap {runtime.symmetric_size}",
        "dispatch time = layout + dispatch kernels; combine time = handle slot copy + combine kernel; "
        "NCCL = all_to_all_single of the same rows",
    )
    for var in multicast_warnings():
        say(f"warning: {var}")
    t0 = time.perf_counter()
    buf = make_buffer(runtime, cfg)  # compiles the module (tens of seconds) unless cached
    say(f"EpBuffer ready in {time.perf_counter() - t0:.1f} s", "", br.table_header())
    timer = make_timer(runtime)
    rows: list[dict[str, Any]] = []
    try:
        for routing in args.routing_list:
            for tokens in args.token_list:
                rows += measure(buf, cfg, runtime, timer, args, routing, tokens, say)
                if env.rank == 0 and args.out_json:
                    br.write_json(args.out_json, meta, rows)
    except CheckFailed as exc:  # the same on every rank
        buf.close()
        return leave(runtime, exc, EXIT_FAIL)
    buf.close()
    if env.rank == 0:
        say(br.TABLE_NOTE)
        if args.out_json:
            say(f"report: {args.out_json}")
        if args.out_png:
            br.plot({"schema": br.SCHEMA, "meta": meta, "rows": rows}, args.out_png)
            say(f"plot: {args.out_png}")
    runtime.barrier()
    return EXIT_OK


def multicast_warnings() -> list[str]:
    """Lines about multicast variables that are not set to 'off' (this script never changes them)."""
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    return [
        f"{k}={os.environ.get(k)!r} (NVLink multicast is expected off: {k}={v})"
        for k, v in off.items()
        if os.environ.get(k) != v
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 with argparse's message on bad syntax
    try:
        validate_args(args)
    except UsageError as exc:
        from cute_ep.cli import launch_rank  # imports torch: only after parsing (--help stays torch-free)

        if launch_rank() == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    code = main()
    from cute_ep.cli import exit_process  # after main: --help and bad syntax exit before torch is imported

    exit_process(code)
