"""Where a dispatch / combine call's GPU time goes, kernel by kernel, at small (decode) batches.

To run (one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):

    torchrun --nproc-per-node 2 scripts/decode_breakdown.py --tokens 128,4096

    # the committed decode report (baselines/perf/h200x2_decode.json), DeepEP beside ours
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 scripts/decode_breakdown.py --tokens 1,32,128,256 --num-sms 24,132 \\
        --peers deepep --out-json baselines/perf/h200x2_decode.json

For each SM budget (--num-sms: one EpBuffer per budget, all sharing one compiled module) and each
tokens-per-rank value (DeepSeek-V3 shapes by default: H 7168, top-k 8, 256 experts, bf16, uniform
routing, input seed 0), with ``scripts/benchmark.py``'s timer (GPU held by a sleep while the host
enqueues, CUDA events per iteration, slowest rank's median), times:
    * the layout kernel alone (counts, count exchange with every peer, offsets, slots);
    * layout + dispatch + fan-out (what ``launch_dispatch`` enqueues in one launch of the module; the
      dispatch time of the benchmark; up to ``--layout-in-dispatch`` tokens the layout runs inside the
      dispatch kernel, so "layout" is then a cost the dispatch no longer pays in full);
    * the pull combine and, on a buffer built for it (--combine reduced, the default), the reduced
      combine (``launch_combine``) on the latest dispatch's handle.
Dispatch's own share is the second minus the first. Then, for the public calls as a user who captures no
CUDA graph sees them (wall time from an idle GPU to the results, median of ``--iters``):
    * ``dispatch()`` (one host sync), ``dispatch(sync=False)`` and ``combine()`` (no host sync; the
      buffer's default algorithm), each against its kernels' time, the difference being the host's share;
    * that share's parts, each timed alone: the argument checks, enqueueing the kernels (pointers,
      scalars, launches) and, for ``dispatch()``, the status read after the kernels (copy + sync).
With --host-costs, the host operations those calls are made of are timed alone as well (tensor views and
copies, a launch of the module with and without a kernel, a stream sync, the status read).
And DeepEP (--peers deepep; optional: when ``import deep_ep`` fails or the world cannot run it, its
columns say why) at the same budget (``cute_ep.tools.bench_peers.deepep_num_sms``: the largest even count <=
min(budget, 128)), on the same inputs, with the same timer (``cute_ep.tools.bench_timing.measure_deepep``:
checked first; its cached-handle dispatch, its full layout + dispatch call with its host sync, and its
combine).
Nothing of ours is validated here: run ``scripts/benchmark.py`` (which checks every configuration it
times) for the results themselves.

Output on rank 0: one line per (num_sms, tokens) as it is measured; at the end the kernel table and the
public-call table (with DeepEP's columns). With --out-json PATH (rewritten after every row): ``{"schema",
"meta", "rows"}``, meta = world_size, local_world_size, device, hidden, topk, num_experts, dtype, iters,
warmup, tokens, num_sms_budgets, combine_algorithm, peers, deepep {version, skipped, num_sms}, versions,
git sha, time, command; one row per (tokens, num_sms) with ``cute_ep.tools.bench_peers.DECODE_ROW_FIELDS``
(``decode_row`` says what each means) and every rank's values under ``per_rank``.

Constraints: GPUs with NVSHMEM, one per rank (--help and argument errors need none); the constraints of
``EpConfig``; every --tokens value in [1, 65536]; --num-sms integers >= 1; --peers deepep or none
(NCCL is scripts/benchmark.py's peer); --iters >= 1, --warmup >= 0; --out-json writable. Exit status
(the same on every rank): 0 done, 1 a run-time error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cute_ep.tools import bench_peers as bp  # pure Python + numpy: safe before parsing
from cute_ep.tools import bench_report as br
from cute_ep.tools import bench_timing as bt  # the timer, input sets and DeepEP peer; torch-free
from cute_ep.tools.usage import EXIT_USAGE, UsageError, checked_args  # torch-free: safe before parsing

EXIT_OK, EXIT_FAIL = 0, 1
PEERS = ("deepep",)  # of bench_peers.PEER_CHOICES, the ones this script times


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / what is timed / Constraints).")
    p.add_argument("--tokens", default="128,4096", help="comma list of tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--dtype", choices=bt.DTYPE_CHOICES, default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--num-sms", default="max",
                   help="comma list of SM budgets (EpConfig.num_sms; DeepEP gets the largest even count <= "
                        "min(budget, 128)); one EpBuffer per budget; max: each rank's share of its GPU")
    p.add_argument("--combine", choices=bp.DECODE_COMBINES, default="reduced",
                   help="the buffer's default combine (EpConfig.combine_algorithm): what combine() and the "
                        "rows' combine_us use; 'reduced' also times the pull combine")
    p.add_argument("--peers", default="deepep",
                   help="'deepep' (timed beside ours when deep_ep imports and the world can run it; else "
                        "skipped with the reason) or 'none'")
    p.add_argument("--layout-in-dispatch", type=int, metavar="TOKENS",
                   help="EpConfig.layout_in_dispatch: batches up to this many tokens run the layout inside "
                        "the dispatch launch (0: never); default: EpConfig's")
    p.add_argument("--host-costs", action="store_true",
                   help="also time, on the first budget's buffer, the host operations a public call is made "
                        "of (tensor views, copies, a launch of the module, a stream sync, the status read; "
                        "us per call, printed and written to the report's meta as host_costs_us, rank 0's)")
    p.add_argument("--out-json", metavar="PATH",
                   help="write the decode report here (rank 0; after every row)")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Launch-independent checks; fills args.token_list, num_sms_list, peer_list. Raises UsageError naming
    the constraint and the value."""
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.num_sms_list = bp.parse_num_sms(args.num_sms)
        args.peer_list = bp.parse_peers(args.peers)
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None
    if max(args.token_list) > bt.MAX_TOKENS_PER_RANK:
        raise UsageError(f"--tokens values must be <= {bt.MAX_TOKENS_PER_RANK}, got {max(args.token_list)}")
    other = [p for p in args.peer_list if p not in PEERS]
    if other:
        raise UsageError(
            f"--peers takes 'deepep' or 'none' here (NCCL is scripts/benchmark.py's peer); {other[0]!r} in "
            f"{args.peers!r} is not one"
        )
    if args.layout_in_dispatch is not None and args.layout_in_dispatch < 0:
        raise UsageError(f"--layout-in-dispatch must be >= 0 tokens, got {args.layout_in_dispatch}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"need --iters >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.out_json:  # rank 0 writes it during the run, when a bad path could no longer stop it early
        try:
            br.check_writable("--out-json", args.out_json)
        except br.BenchReportError as exc:
            raise UsageError(str(exc)) from None


def make_config(args: argparse.Namespace, env: Any) -> Any:
    """The EpConfig of the run (the first budget's; each budget's buffer replaces num_sms)."""
    from cute_ep.kernels.config import EpConfig
    from cute_ep.tools.cli import DTYPES

    fold = {} if args.layout_in_dispatch is None else {"layout_in_dispatch": args.layout_in_dispatch}
    return EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                    num_experts=args.num_experts, topk=args.topk, hidden=args.hidden,
                    dtype=DTYPES[args.dtype], max_tokens=max(args.token_list), num_sms=args.num_sms_list[0],
                    combine_algorithm=args.combine, **fold)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = checked_args(build_parser(), validate_args, argv)
    if args is None:
        return EXIT_USAGE
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.tools.cli import Printer, report_setup_error, require_cuda, run_guarded, setup_errors

    try:
        env = DistEnv.from_environ()
        cfg = make_config(args, env)
        require_cuda("scripts/decode_breakdown.py (it times the GPU kernels)", bt.CPU_WAY_OUT)
    except setup_errors() as exc:
        return report_setup_error(exc)

    # The heap fits the largest budget's buffer (across nodes the staging rows grow with num_sms).
    heap = max(dataclasses.replace(cfg, num_sms=b).symmetric_bytes() for b in args.num_sms_list)

    def body(args: argparse.Namespace, env: Any, cfg: Any) -> int:
        with Runtime(env, symmetric_bytes=heap) as rt:
            return decode_report(args, cfg, rt, Printer(env.rank))

    return run_guarded(body, args, env, cfg)


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def make_meta(args: argparse.Namespace, cfg: Any, runtime: Any, device: str) -> dict[str, Any]:
    env = runtime.env
    return {
        "device": device,
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "hidden": cfg.hidden,
        "topk": cfg.topk,
        "num_experts": cfg.num_experts,
        "dtype": args.dtype,
        "iters": args.iters,
        "warmup": args.warmup,
        "tokens": args.token_list,
        "num_sms_budgets": args.num_sms_list,
        **br.gpu_share_meta(runtime),
        "combine_algorithm": cfg.combine_algorithm,
        "layout_in_dispatch": cfg.layout_in_dispatch,
        "routing": "uniform",
        "seed": 0,
        "peers": args.peer_list,
        "deepep": bt.deepep_meta(args),
        "timing": (
            "kernels: cute_ep.tools.bench_timing's Timer (CUDA events per iteration, GPU held by a sleep "
            "while the host enqueues), median per rank, slowest rank; dispatch = layout + dispatch kernels; "
            "combine = the buffer's default algorithm (handle slot copy included); public calls: wall time "
            "from an idle GPU to the results (torch.cuda.synchronize), median per rank, slowest rank; DeepEP:"
            " bench_timing.measure_deepep (dispatch = cached handle; full_dispatch = layout + dispatch, host "
            "sync included)"
        ),
        "environment": {k: os.environ.get(k) for k in bt.RECORDED_VARS},
        "versions": br.package_versions(),
        "git_sha": br.git_sha(),
        "timestamp": br.utc_timestamp(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def kernel_medians(buf: Any, s: Any, timer: Any, args: argparse.Namespace) -> dict[str, float | None]:
    """This rank's medians (us) of the kernels (bench_peers.DECODE_KERNEL_TIMES) on input set ``s``."""
    from cute_ep.kernels.config import OP_LAYOUT

    t = s.x.shape[0]
    res = buf.dispatch(s.x, s.idx, s.w)
    buf.expert_output(res.num_recv).copy_(res.recv_x)
    steps: dict[str, Callable[[int], Any]] = {
        "layout": lambda i: buf._launch(OP_LAYOUT, t, idx=s.idx),
        "dispatch": lambda i: buf.launch_dispatch(s.x, s.idx, s.w),
    }
    med: dict[str, float | None] = {
        name: br.median(timer.run(step, args.warmup, args.iters)) for name, step in steps.items()
    }
    res = buf.dispatch(s.x, s.idx, s.w)  # a checked call: raises if a launch did not run
    # The reduced combine needs a buffer built for it (its partial rows, the dispatch's group lists).
    algorithms = ("pull", "reduced") if buf.cfg.combine_algorithm == "reduced" else ("pull",)
    med["reduced_combine"] = None
    for algorithm in algorithms:
        med[f"{algorithm}_combine"] = br.median(timer.run(
            lambda i, a=algorithm, h=res.handle: buf.launch_combine(h, s.out, a), args.warmup, args.iters))
        buf.combine(buf.expert_output(res.num_recv), res.handle, algorithm=algorithm)  # all ran?
    return med


def _wall_us(fn: Callable[[], Any], iters: int, sync: Callable[[], Any], *, host_only: bool = False) -> float:
    """Median time (us) of ``fn()`` started on an idle GPU: until its GPU work is done, or with
    ``host_only`` until it returns (the host's own time; its GPU work is waited for outside the timing)."""
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        if not host_only:
            sync()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return br.median(times)


def api_breakdown(buf: Any, s: Any, iters: int) -> dict[str, float]:
    """This rank's medians (us) of the public calls and their host parts (bench_peers.DECODE_API_TIMES and
    DECODE_HOST_TIMES; see the module docstring)."""
    import torch

    from cute_ep.input_checks import (
        check_combine_input,
        check_dispatch_algorithm,
        check_dispatch_inputs,
        check_dispatch_options,
    )

    c = buf.cfg
    # The device's own sync (a CPU stand-in buffer has no GPU work to wait for).
    sync = (lambda: torch.cuda.synchronize(buf.device)) if buf.device.type == "cuda" else (lambda: None)
    res = buf.dispatch(s.x, s.idx, s.w)
    y = buf.expert_output(res.num_recv)

    def dispatch_checks() -> None:
        check_dispatch_options(c, "scatter", False)
        check_dispatch_algorithm(None)
        check_dispatch_inputs(c, buf.device, s.x, s.idx, s.w, values=False)

    def combine_checks() -> None:
        check_combine_input(c, buf.device, y)
        buf._check_combine_algorithm(res.handle, None)

    def dispatch_enqueue() -> None:
        buf.launch_dispatch(s.x, s.idx, s.w)

    out = {
        "dispatch_checks": _wall_us(dispatch_checks, iters, sync, host_only=True),
        "dispatch_enqueue": _wall_us(dispatch_enqueue, iters, sync, host_only=True),
        "dispatch_status": _wall_us(buf.status.read, iters, sync),  # GPU idle: the copy and the sync alone
        "api_dispatch": _wall_us(lambda: buf.dispatch(s.x, s.idx, s.w), iters, sync),
        "api_dispatch_nosync": _wall_us(lambda: buf.dispatch(s.x, s.idx, s.w, sync=False), iters, sync),
    }
    # combine() with the default algorithm: the reduced one needs the latest dispatch's handle.
    res = buf.dispatch(s.x, s.idx, s.w)
    y = buf.expert_output(res.num_recv)
    out["api_combine"] = _wall_us(lambda: buf.combine(y, res.handle), iters, sync)
    out["combine_checks"] = _wall_us(combine_checks, iters, sync, host_only=True)
    out["combine_enqueue"] = _wall_us(lambda: buf.launch_combine(res.handle, s.out), iters, sync,
                                      host_only=True)
    buf.check_ran()
    return out


HOST_COST_ITERS = 2000  # calls per operation in host_costs (each is a few us)
HOST_COST_BURST = 32  # calls timed between two syncs in host_costs


def host_costs(buf: Any, iters: int = HOST_COST_ITERS) -> dict[str, float]:
    """Host time (us per call, mean of ``iters`` calls after one untimed, in bursts from an idle GPU) of the
    operations a public call is made of, on ``buf``'s device: torch tensor operations on [T, K] int32
    routing tensors (T = 128), and on a GPU also a stream handle, a stream sync of an idle GPU, one launch
    of the module with no kernel to run and with one (the layout of 0 tokens: collective, every rank makes
    the same calls), and the status read (idle GPU). What a dispatch or combine costs the host is the sum
    of what it does of these (docs/design.md, the host path of a call)."""
    import torch

    from cute_ep.kernels.config import OP_LAYOUT
    from cute_ep.launcher import current_stream_handle

    dev, k = buf.device, buf.cfg.topk
    a = torch.zeros(256, k, dtype=torch.int32, device=dev)
    b = torch.zeros_like(a)
    ops: dict[str, Callable[[], Any]] = {
        "view": lambda: a.view(-1),
        "slice": lambda: a[:128],
        "empty [3, T, K]": lambda: torch.empty((3, 128, k), dtype=torch.int32, device=dev),
        "cat of three": lambda: torch.cat((a[:128], b[:128], a[128:])),
        "split into three": lambda: torch.split_with_sizes(a[:192], (64, 64, 64)),
        "unbind into three": lambda: a[:192].view(3, 64, k).unbind(0),
        "Tensor.copy_": lambda: b.copy_(a),
    }
    if dev.type == "cuda":
        index = buf._device_index
        ops["torch.cuda.current_stream"] = lambda: torch.cuda.current_stream(dev)
        ops["stream handle (raw)"] = lambda: current_stream_handle(index)
        ops["stream sync, idle GPU"] = lambda: torch.cuda.synchronize(dev)
        ops["launch, no kernel"] = lambda: buf._launcher(current_stream_handle(index), {}, op=-1,
                                                         num_tokens=0)
        ops["launch, one kernel"] = lambda: buf._launch(OP_LAYOUT, 0, idx=a[:0])
        ops["status read, idle GPU"] = buf.status.read
    out = {}
    for name, fn in ops.items():
        fn()
        # Bursts of HOST_COST_BURST calls, each from an idle GPU (the sync outside the timing): a launch
        # queue that fills makes the host wait for the kernels, which would time them instead of the host.
        elapsed = 0.0
        for first in range(0, iters, HOST_COST_BURST):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(min(HOST_COST_BURST, iters - first)):
                fn()
            elapsed += time.perf_counter() - t0
        out[name] = elapsed / iters * 1e6
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    if dev.type == "cuda":
        buf.check_ran()  # every layout launched above ran
    return out


def format_host_costs(costs: Mapping[str, float]) -> str:
    """The host-costs table (us per call)."""
    width = max(len(n) for n in costs)
    lines = [f"  {name:<{width}} {us:8.2f}" for name, us in costs.items()]
    return "\n".join(["host costs (us per call, rank 0):", *lines])


def decode_report(
    args: argparse.Namespace,
    cfg: Any,
    runtime: Any,
    say: Callable[..., None],
    *,
    make_buffer: Callable[[Any, Any], Any] | None = None,
    make_timer: Callable[[Any], Any] | None = None,
    make_deepep: Callable[[Any, Any, argparse.Namespace], tuple[Any, str | None]] | None = None,
    measure_api: Callable[[Any, Any, int], Mapping[str, float]] | None = None,
) -> int:
    """Every (num_sms, tokens) with one EpBuffer per SM budget; rank 0 prints and writes the report.

    ``make_buffer(runtime, cfg)`` / ``make_timer(runtime)`` / ``make_deepep(runtime, cfg, args)`` /
    ``measure_api(buf, input_set, iters)`` default to EpBuffers sharing one module / bench_timing.Timer /
    bench_timing.open_deepep / :func:`api_breakdown` (the CPU tests pass stand-ins to run this over gloo)."""
    import torch

    from cute_ep.tools.cli import all_gather

    make_buffer = bt.shared_module_buffers(runtime) if make_buffer is None else make_buffer
    make_timer = bt.Timer if make_timer is None else make_timer
    make_deepep = bt.open_deepep if make_deepep is None else make_deepep
    measure_api = api_breakdown if measure_api is None else measure_api

    env = runtime.env
    args.num_sms_list = bp.resolve_num_sms(args.num_sms_list, bp.least_sm_share(runtime))
    name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu"
    device = ", ".join(sorted(set(all_gather(name, runtime.cpu_group))))
    meta = make_meta(args, cfg, runtime, device)
    say(f"decode breakdown: {device} x {env.world_size} ({cfg.nnodes} node(s)), H {cfg.hidden}, "
        f"K {cfg.topk}, E {cfg.num_experts}, {args.dtype}, tokens/rank {args.token_list}, "
        f"num_sms {args.num_sms_list}, default combine {cfg.combine_algorithm}; slowest rank's median "
        f"of {args.iters} (us); git {meta['git_sha']}")  # fmt: skip
    for line in bt.multicast_warnings():
        say(f"warning: {line}")
    peer, peer_skipped = bt.open_peer(make_deepep, runtime, cfg, args, meta, say,
                                      "not requested (--peers none)")  # fmt: skip
    timer = make_timer(runtime)
    rows: list[dict[str, Any]] = []
    for budget in args.num_sms_list:
        cfg_b, buf, dep, dep_skipped = bt.open_budget(
            make_buffer, runtime, cfg, budget, peer, peer_skipped, say
        )
        for t in args.token_list:
            s = bt.InputSet(cfg_b, env.rank, runtime.device, t, "uniform", 0)
            med = kernel_medians(buf, s, timer, args)
            med.update(measure_api(buf, s, args.iters))
            dep_us, why = None, dep_skipped
            if dep is not None:
                bt.exchange_splits([s], runtime.cpu_group)  # what DeepEP must deliver (checked first)
                dep_us, why = bt.measure_deepep(dep, [s], runtime, timer, args)
            per_rank = all_gather((med, dep_us), runtime.cpu_group)  # DeepEP: all lists or all None
            row = bp.decode_row(
                tokens=t, num_sms=budget, combine_algorithm=cfg.combine_algorithm,
                per_rank=[m for m, _ in per_rank],
                deepep_us=None if per_rank[0][1] is None else [d for _, d in per_rank], deepep_skipped=why,
            )  # fmt: skip
            rows.append(row)
            say(bp.format_decode_progress(row))
            if env.rank == 0 and args.out_json:
                bp.write_decode_json(args.out_json, meta, rows)
        if getattr(args, "host_costs", False) and "host_costs_us" not in meta:
            meta["host_costs_us"] = costs = host_costs(buf)
            say(format_host_costs(costs))
            if env.rank == 0 and args.out_json:
                bp.write_decode_json(args.out_json, meta, rows)
        buf.close()
        if dep is not None:
            peer.release(budget)
    say("", bp.format_decode_tables(rows))
    if args.out_json:
        say(f"report: {args.out_json}")
    runtime.barrier()
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    from cute_ep.tools.cli import (
        exit_process,  # after main: --help and bad arguments exit before torch is imported
    )

    exit_process(code)
