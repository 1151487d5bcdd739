"""What each call of ``cute_ep.deep_ep`` costs against DeepEP's, as DeepEP's own tests call them: wall time
between CUDA events, and the host time of a call issued on an idle GPU.

    torchrun --nproc-per-node 2 scripts/deep_ep_call_costs.py                    # both modes
    torchrun --nproc-per-node 2 scripts/deep_ep_call_costs.py --mode normal --profile-dir /tmp/prof

Each rank sets torch's defaults as DeepEP's test harness does (bf16, CUDA), draws DeepEP's test inputs
(``|randn| + 1`` scores and their top-k) and builds a ``cute_ep.deep_ep.Buffer`` and, where ``import
deep_ep`` works, DeepEP's on the same group. Normal mode (4096 tokens, hidden 7168, top-8 of 256, DeepEP's
EP2 config of 24 SMs): a dispatch with the layout given (one host sync), a cached-handle dispatch of BF16
rows and of FP8 rows with per-128-column scales, and a combine of the received rows. Low-latency mode
(its own Buffer, 128 tokens, top-8 of 288): dispatch + combine of BF16 and of FP8 rows (DeepEP's own
low-latency kernels need DeepEP built with NVSHMEM; where its import lacks them the DeepEP column says
why). Wall: DeepEP's own ``bench`` (``cute_ep.tools.bench_timing.deepep_bench``: ``--warmup`` calls, the
L2 flushed, ``--iters`` calls between CUDA events, the average with the first dropped);
host: the median over ``--iters`` calls of ``time.perf_counter`` around one call after a device sync and
a barrier; back to back: the host time per call of ``--iters`` calls issued one after another (no sync
between them: what a host-bound loop of calls costs). With ``--profile-dir`` each rank writes, for ours, a
cProfile of 200 back-to-back calls of each kind (by own time and by cumulative time) and a
``torch.profiler`` table (CPU and CUDA) of ten. Rank 0 prints one line per (module, call) with every rank's
values.
Needs CUDA GPUs (one per rank) and NCCL; exit status 0, 2 for bad arguments or no GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

MODES = ("normal", "low_latency")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=30, help="timed calls per measurement, >= 2")
    p.add_argument("--profile-dir", default="", help="write each rank's profiles of our calls here")
    return p


def host_us(fn: Callable[[], object], iters: int, settle: Callable[[], object]) -> float:
    """Median microseconds of host time of one ``fn`` call, each issued after ``settle()`` (a device sync
    and a barrier)."""
    times = []
    for _ in range(iters):
        settle()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def back_to_back_us(fn: Callable[[], object], iters: int, settle: Callable[[], object]) -> float:
    """Microseconds of host time per call of ``iters`` calls of ``fn`` issued back to back, after
    ``settle()``; ``settle()`` again after them."""
    settle()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    per_call = (time.perf_counter() - t0) / iters * 1e6
    settle()
    return per_call


def normal_calls(module, group, rank: int) -> dict[str, Callable[[], object]]:
    """DeepEP's test_intranode.py inputs and the four calls its tuning and users make."""
    import torch

    t, h, k, e = 4096, 7168, 8, 256
    x = torch.ones((t, h), dtype=torch.bfloat16, device="cuda") * rank
    blocks = x.view(t, -1, 128).float()
    amax = blocks.abs().amax(dim=2).clamp(1e-4)
    q = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h)
    x_fp8 = (q, (amax / 448.0).view(t, -1).T.contiguous().T)
    scores = torch.randn((t, e), dtype=torch.float32, device="cuda").abs() + 1
    idx = torch.topk(scores, k, dim=-1, largest=True, sorted=False)[1]
    w = torch.ones((t, k), dtype=torch.float32, device="cuda") * rank
    buf = module.Buffer(group, int(1e9), 0, explicitly_destroy=True)
    cfg = module.Config(24, 20, 256)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout, topk_idx=idx, topk_weights=w, config=cfg)

    def fresh() -> object:
        return buf.dispatch(x, **layout, topk_idx=idx, topk_weights=w, config=cfg)

    return {"_buffer": buf, "dispatch, layout given": fresh,
            "cached dispatch, bf16": lambda: buf.dispatch(x=x, handle=handle, config=cfg),
            "cached dispatch, fp8": lambda: buf.dispatch(x=x_fp8, handle=handle, config=cfg),
            "combine": lambda: buf.combine(x=recv_x, handle=handle, config=cfg)}


def low_latency_calls(module, group, world: int) -> dict[str, Callable[[], object]]:
    """DeepEP's test_low_latency.py shapes: dispatch + combine per call pair, BF16 and FP8 rows."""
    import torch

    t, h, e, k = 128, 7168, 288, 8
    x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    idx = torch.topk(torch.randn(t, e, device="cuda").abs() + 1, k, dim=-1).indices
    w = torch.rand(t, k, dtype=torch.float32, device="cuda")
    size = module.Buffer.get_low_latency_rdma_size_hint(t, h, world, e)
    buf = module.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=e // world,
                        explicitly_destroy=True)
    y = torch.zeros((e // world, world * t, h), dtype=torch.bfloat16, device="cuda")

    def pair(fp8: bool) -> None:
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=fp8)
        buf.low_latency_combine(y, idx, w, handle)

    return {"_buffer": buf, "low-latency dispatch + combine, bf16": lambda: pair(False),
            "low-latency dispatch + combine, fp8": lambda: pair(True)}


def profile(calls: dict[str, Callable[[], object]], folder: Path, rank: int, mode: str) -> None:
    """A cProfile of 200 back-to-back calls of each kind (by own time, then cumulative) and a
    torch.profiler table of ten."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{mode}_rank{rank}.txt", "w") as out:
        for name, fn in calls.items():
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as tp:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            table = tp.key_averages().table(sort_by="cpu_time_total", max_name_column_width=80, row_limit=40)
            out.write(f"=== {name}\n{text.getvalue()}\n{table}\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("deep_ep_call_costs.py: needs CUDA GPUs (one per rank) and NCCL; none here", file=sys.stderr)
        return 2
    if args.iters < 2 or args.warmup < 0:
        print(f"deep_ep_call_costs.py: --iters must be >= 2 and --warmup >= 0, got {args.iters}, "
              f"{args.warmup}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_default_dtype(torch.bfloat16)  # as DeepEP's test harness (tests/utils.py init_dist)
    torch.set_default_device("cuda")
    group = dist.new_group(list(range(world)))
    import cute_ep.deep_ep as ours
    from cute_ep.tools.bench_peers import import_deep_ep
    from cute_ep.tools.bench_timing import deepep_bench

    theirs, why = import_deep_ep()
    modules = [("cute_ep", ours)] + ([("deep_ep", theirs)] if theirs is not None else [])

    def settle() -> None:
        torch.cuda.synchronize()
        dist.barrier(group)

    results: dict[tuple[str, str], tuple[float, float]] = {}
    skipped: list[str] = []
    for mode in MODES if args.mode == "both" else (args.mode,):
        for name, module in modules:
            torch.manual_seed(rank)
            try:
                calls = normal_calls(module, group, rank) if mode == "normal" else low_latency_calls(
                    module, group, world)
            except Exception as exc:  # DeepEP built without its low-latency kernels: its column says why
                if name == "cute_ep":
                    raise
                skipped.append(f"{name} {mode}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            buf = calls.pop("_buffer")
            for call, fn in calls.items():
                wall = deepep_bench(fn, args.warmup, args.iters)[0]
                results[name, call] = (wall, host_us(fn, args.iters, settle),
                                       back_to_back_us(fn, args.iters, settle))
            if name == "cute_ep" and args.profile_dir:
                profile(calls, Path(args.profile_dir), rank, mode)
            settle()
            buf.destroy()
    rows: list = [None] * world
    dist.all_gather_object(rows, results)
    if rank == 0:
        print(f"{world} ranks" + ("" if theirs is not None else f"; DeepEP: {why}"))
        for line in skipped:
            print(f"skipped {line}")
        for key in results:
            walls = "  ".join(f"r{r} {rows[r][key][0]:8.1f}" for r in range(world))
            hosts = "  ".join(f"r{r} {rows[r][key][1]:8.1f}" for r in range(world))
            loops = "  ".join(f"r{r} {rows[r][key][2]:8.1f}" for r in range(world))
            print(f"{key[0]:8s} {key[1]:40s} wall {walls} us | host {hosts} us | back to back {loops} us")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
