"""Each kernel of a dispatch / combine alone, for both receive layouts: where the GPU time goes.

To run (one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):

    torchrun --nproc-per-node 2 scripts/kernel_times.py --tokens 128,4096 --num-sms 24,132
    torchrun --nproc-per-node 1 scripts/kernel_times.py --layouts rank --tokens 4096 --out-json k.json

For each receive layout, SM budget and tokens-per-rank value (DeepSeek-V3 shapes by default: H 7168,
top-k 8, 256 experts, bf16, uniform routing, input seed 0), with ``scripts/benchmark.py``'s timer (GPU
held by a sleep while the host enqueues, CUDA events per iteration, slowest rank's median), times:
    * ``layout``: the layout op alone (counts, count exchange with every peer, offsets, slots);
    * ``dispatch``: what ``launch_dispatch`` enqueues (layout + dispatch, + fan-out in the expert layout;
      up to ``--layout-in-dispatch`` tokens the layout runs inside the dispatch kernel); ``dispatch -
      layout`` is the row movement's share when the layout runs as a kernel of its own;
    * ``combine``: ``launch_combine`` on the latest handle (the pull combine; in the expert layout also
      the reduced one, on a buffer built for it).
Nothing is validated here (``scripts/benchmark.py`` checks every configuration it times); the expert
outputs are whatever ``recv_y`` holds.

Output on rank 0: one line per (layout, num_sms, tokens); with ``--out-json PATH`` the rows as
``{"meta": {...}, "rows": [...]}`` (every value the slowest rank's median in us).

Constraints: GPUs with NVSHMEM, one per rank; the constraints of ``EpConfig``; --tokens in [1, 65536];
--num-sms integers >= 1; --layouts from expert, rank; --iters >= 1, --warmup >= 0. Exit status (the same
on every rank): 0 done, 1 a run-time error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from cute_ep.tools import bench_peers as bp
from cute_ep.tools import bench_report as br
from cute_ep.tools import bench_timing as bt  # the timer and input sets of the benchmark; torch-free
from cute_ep.tools.usage import EXIT_USAGE, UsageError, checked_args, script_parser  # torch-free

LAYOUT_CHOICES = ("expert", "rank")


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--tokens", default="128,4096", help="comma list of tokens per rank")
    p.add_argument("--num-sms", default="24,max",
                   help="comma list of SM budgets (EpConfig.num_sms); max: each rank's share of its GPU")
    p.add_argument("--layouts", default="expert,rank", help="comma list of receive layouts")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(bt.DTYPE_CHOICES), default="bfloat16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--combine", choices=("pull", "reduced"), default="reduced",
                   help="the buffer's combine_algorithm (reduced also times the pull combine)")
    p.add_argument("--layout-in-dispatch", type=int, metavar="TOKENS",
                   help="EpConfig.layout_in_dispatch (default: the config's): dispatches up to this many "
                        "tokens run the layout inside the dispatch launch; 0: always a kernel of its own")
    p.add_argument("--side-sleep-us", type=float, default=0.0,
                   help="with every timed step, a one-thread sleep kernel of this many us on a side stream, "
                        "started with the step (another stream's kernel on one SM): shows whether the "
                        "kernels' CTAs, which wait for each other, stall behind it (0: none)")
    p.add_argument("--out-json", metavar="PATH", help="write the rows here (rank 0)")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Parses the comma lists into ``token_list`` / ``num_sms_list`` / ``layout_list``; raises
    UsageError naming the bad value."""
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.num_sms_list = bp.parse_num_sms(args.num_sms)
        args.layout_list = br.parse_name_list(args.layouts, "--layouts", LAYOUT_CHOICES)
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None
    if max(args.token_list) > bt.MAX_TOKENS_PER_RANK:
        most = max(args.token_list)
        raise UsageError(f"--tokens values must be <= {bt.MAX_TOKENS_PER_RANK}, got {most}")
    if args.layout_in_dispatch is not None and args.layout_in_dispatch < 0:
        raise UsageError(f"--layout-in-dispatch must be >= 0 tokens, got {args.layout_in_dispatch}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"need --iters >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")


def time_kernels(buf: Any, s: Any, layout: str, timer: Any, args: argparse.Namespace) -> dict[str, float]:
    """This rank's medians (us) of the layout op, the dispatch op and the combine(s) on input set ``s``."""
    from cute_ep.kernels.config import OP_LAYOUT
    from cute_ep.kernels.variants import LAYOUTS

    t = s.x.shape[0]
    side = with_side_sleep(timer, args.side_sleep_us)
    times: dict[str, list[float]] = {}

    def run(step: Any, name: str = "") -> float:
        got = timer.run(side(step), args.warmup, args.iters)
        times[name] = got
        return br.median(got)

    med = {
        "layout_us": run(lambda i: buf._launch(OP_LAYOUT, t, idx=s.idx, layout=LAYOUTS[layout]), "layout"),
        "dispatch_us": run(lambda i: buf.launch_dispatch(s.x, s.idx, s.w, layout=layout)),
    }
    res = buf.dispatch(s.x, s.idx, s.w, layout=layout)  # a checked call: raises if a launch did not run
    algorithms = ["pull"]
    if layout == "expert" and buf.cfg.combine_algorithm == "reduced":
        algorithms.append("reduced")
    for a in algorithms:
        med[f"{a}_combine_us"] = run(lambda i, a=a: buf.launch_combine(res.handle, s.out, a))
    med["layout_max_us"] = max(times["layout"])  # a stall shows in the slowest iteration first
    buf.check_ran()
    return med


def with_side_sleep(timer: Any, sleep_us: float) -> Any:
    """wrap(step): ``step`` as is (``sleep_us`` 0), or ``step`` with a one-thread sleep kernel of
    ``sleep_us`` on a side stream that waits for the same point of the timed stream, so both become ready
    together: a grid whose CTAs wait for each other and need every SM stalls until the sleep ends."""
    import torch

    if sleep_us <= 0:
        return lambda step: step
    side = torch.cuda.Stream(device=timer.device)
    cycles = int(sleep_us * timer.cycles_per_us)

    def wrap(step: Any) -> Any:
        def step_beside_sleep(i: int) -> None:
            ready = torch.cuda.Event()
            ready.record()
            side.wait_event(ready)
            with torch.cuda.stream(side):
                torch.cuda._sleep(cycles)
            step(i)

        return step_beside_sleep

    return wrap


def report(args: argparse.Namespace, cfg: Any, runtime: Any, say: Any) -> int:
    import dataclasses

    import torch

    from cute_ep.tools.cli import all_gather

    make_buffer = bt.shared_module_buffers(runtime)
    timer = bt.Timer(runtime)
    env = runtime.env
    args.num_sms_list = bp.resolve_num_sms(args.num_sms_list, bp.least_sm_share(runtime))
    device = torch.cuda.get_device_name(runtime.device)
    meta = {"device": device, "world_size": env.world_size, "local_world_size": env.local_world_size,
            **br.gpu_share_meta(runtime),
            "hidden": cfg.hidden, "topk": cfg.topk, "num_experts": cfg.num_experts, "dtype": args.dtype,
            "iters": args.iters, "warmup": args.warmup, "routing": "uniform", "seed": 0,
            "layout_in_dispatch": cfg.layout_in_dispatch, "side_sleep_us": args.side_sleep_us,
            "git_sha": br.git_sha(), "timestamp": br.utc_timestamp(),
            "command": shlex.join([Path(sys.executable).name, *sys.argv])}
    say(f"kernel times: {device} x {env.world_size}, H {cfg.hidden}, K {cfg.topk}, E {cfg.num_experts}, "
        f"{args.dtype}; slowest rank's median of {args.iters} (us); git {meta['git_sha']}")
    rows = []
    for budget in args.num_sms_list:
        with make_buffer(runtime, dataclasses.replace(cfg, num_sms=budget)) as buf:
            for tokens in args.token_list:
                s = bt.InputSet(cfg, env.rank, runtime.device, tokens, "uniform", 0)
                for layout in args.layout_list:
                    mine = time_kernels(buf, s, layout, timer, args)
                    every = all_gather(mine, runtime.cpu_group)
                    row = {"layout": layout, "num_sms": budget, "tokens": tokens}
                    row.update({k: round(max(r[k] for r in every), 1) for k in mine})
                    rows.append(row)
                    say("  " + "  ".join(f"{k} {v}" for k, v in row.items()))
                    if args.out_json and env.rank == 0:
                        Path(args.out_json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = checked_args(build_parser(), validate_args, argv)
    if args is None:
        return EXIT_USAGE
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.kernels.config import EpConfig
    from cute_ep.tools.cli import DTYPES, Printer, report_setup_error, require_cuda, run_guarded, setup_errors

    fold = {} if args.layout_in_dispatch is None else {"layout_in_dispatch": args.layout_in_dispatch}
    try:
        env = DistEnv.from_environ()
        cfg = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                       num_experts=args.num_experts, topk=args.topk, hidden=args.hidden,
                       dtype=DTYPES[args.dtype], max_tokens=max(args.token_list),
                       num_sms=args.num_sms_list[0], combine_algorithm=args.combine, **fold)
        require_cuda("scripts/kernel_times.py (it times the GPU kernels)", bt.CPU_WAY_OUT)
    except setup_errors() as exc:
        return report_setup_error(exc)

    def body(args: argparse.Namespace, env: Any, cfg: Any) -> int:
        import dataclasses

        heap = max(dataclasses.replace(cfg, num_sms=b).symmetric_bytes() for b in args.num_sms_list)
        with Runtime(env, symmetric_bytes=heap) as rt:
            return report(args, cfg, rt, Printer(env.rank))

    return run_guarded(body, args, env, cfg)


if __name__ == "__main__":
    code = main()
    from cute_ep.tools.cli import (
        exit_process,  # after main: --help and bad arguments exit before torch is imported
    )

    exit_process(code)
