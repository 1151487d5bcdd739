"""Where a dispatch / combine call's GPU time goes, kernel by kernel, at small (decode) batches.

To run (one process per GPU):

    torchrun --nproc-per-node 2 scripts/decode_breakdown.py --tokens 128,4096

For each tokens-per-rank value (DeepSeek-V3 shapes by default: H 7168, top-k 8, 256 experts, bf16,
uniform routing), with ``scripts/benchmark.py``'s timer (GPU held by a sleep while the host enqueues,
CUDA events per iteration, slowest rank's median), times:
    * the layout kernel alone (counts, count exchange with every peer, offsets, slots);
    * layout + dispatch + fan-out (what ``launch_dispatch`` enqueues; the dispatch time of the benchmark);
    * the pull combine and the reduced combine (``launch_combine``) on the latest dispatch's handle.
Dispatch's own share is the third minus the second. Then, for the public calls as a user who captures no
CUDA graph sees them (wall time from an idle GPU to the results, median of ``--iters``):
    * ``dispatch()`` (one host sync), ``dispatch(sync=False)`` and ``combine()`` (no host sync), each against
      its kernels' time from the first table, the difference being the host's share;
    * that share's parts, each timed alone: the argument checks, enqueueing the kernels (pointers,
      scalars, launches) and, for ``dispatch()``, the status read after the kernels (copy + sync).
Nothing is validated here: run ``scripts/benchmark.py`` (which checks every configuration it times) for
the results themselves.

Constraints: GPUs with NVSHMEM, one per rank; the constraints of ``EpConfig``. Exit 0, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark as bm  # noqa: E402  (the timer and input sets of the benchmark)

from cute_ep import bench_report as br  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default="128,4096", help="comma list of tokens per rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--num-sms", type=int, default=132)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.buffer import EpBuffer
    from cute_ep.cli import DTYPES, Printer, all_gather
    from cute_ep.kernels.config import OP_LAYOUT, EpConfig

    try:
        tokens = br.parse_int_list(args.tokens, "--tokens")
    except br.BenchReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = DistEnv.from_environ()
    cfg = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                   num_experts=args.num_experts, topk=args.topk, hidden=args.hidden, dtype=DTYPES[args.dtype],
                   max_tokens=max(tokens), num_sms=args.num_sms, combine_algorithm="reduced")
    say = Printer(env.rank)
    with Runtime(env, symmetric_bytes=cfg.symmetric_bytes()) as rt, EpBuffer(rt, cfg) as buf:
        timer = bm.Timer(rt)
        say(f"decode breakdown: {env.world_size} ranks ({cfg.nnodes} node(s)), H {cfg.hidden}, K {cfg.topk}, "
            f"E {cfg.num_experts}, {args.dtype}; slowest rank's median of {args.iters} (us)",
            f"{'tokens':>7} {'layout':>8} {'dispatch call':>14} {'dispatch kernels':>17} "
            f"{'pull combine':>13} {'reduced combine':>16}")
        ns = argparse.Namespace(hidden=cfg.hidden)
        kernels: dict[int, dict[str, float]] = {}
        for t in tokens:
            s = bm.InputSet(ns, cfg, env.rank, rt.device, t, "uniform", 0)
            res = buf.dispatch(s.x, s.idx, s.w)
            buf.expert_output(res.num_recv).copy_(res.recv_x)
            steps: dict[str, Any] = {
                "layout": lambda i, s=s, t=t: buf._launch(OP_LAYOUT, t, idx=s.idx),
                "dispatch": lambda i, s=s: buf.launch_dispatch(s.x, s.idx, s.w),
            }
            med = {name: br.median(timer.run(step, args.warmup, args.iters)) for name, step in steps.items()}
            res = buf.dispatch(s.x, s.idx, s.w)  # a checked call: raises if a launch did not run
            for algorithm in ("pull", "reduced"):
                med[algorithm] = br.median(timer.run(
                    lambda i, a=algorithm, s=s, h=res.handle: buf.launch_combine(h, s.out, a), args.warmup,
                    args.iters))
                buf.combine(buf.expert_output(res.num_recv), res.handle, algorithm=algorithm)
            per_rank = all_gather(list(med.values()), rt.cpu_group)  # [rank][step]
            w = {k: max(r[j] for r in per_rank) for j, k in enumerate(med)}
            kernels[t] = w
            say(f"{t:>7} {w['layout']:>8.1f} {w['dispatch']:>14.1f} {w['dispatch'] - w['layout']:>17.1f} "
                f"{w['pull']:>13.1f} {w['reduced']:>16.1f}")
        say("", "public calls: wall time from an idle GPU to the results vs their kernels (us; slowest rank)",
            f"{'tokens':>7} {'call':>20} {'wall':>8} {'kernels':>8} {'host':>8} {'checks':>8} {'enqueue':>8} "
            f"{'status read':>12}")
        for t in tokens:
            s = bm.InputSet(argparse.Namespace(hidden=cfg.hidden), cfg, env.rank, rt.device, t, "uniform", 0)
            rows = api_breakdown(buf, s, args.iters)
            per_rank = all_gather(rows, rt.cpu_group)
            for name, kernel in (("dispatch()", "dispatch"), ("dispatch(sync=False)", "dispatch"),
                                 ("combine()", "pull")):
                part = {k: max(r[name][k] for r in per_rank) for k in rows[name]}
                kern = kernels[t][kernel]
                say(f"{t:>7} {name:>20} {part['wall']:>8.1f} {kern:>8.1f} {part['wall'] - kern:>8.1f} "
                    f"{part['checks']:>8.1f} {part['enqueue']:>8.1f} {part.get('status', 0.0):>12.1f}")
    return 0


def _wall_us(fn, iters: int, *, host_only: bool = False) -> float:
    """Median time (us) of ``fn()`` started on an idle GPU: until its GPU work is done, or with
    ``host_only`` until it returns (the host's own time; its GPU work is waited for outside the timing)."""
    import time

    import torch

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if not host_only:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return br.median(times)


def api_breakdown(buf: Any, s: Any, iters: int) -> dict[str, dict[str, float]]:
    """{call: {wall, checks, enqueue[, status]}} in us for this rank (see the module docstring)."""
    from cute_ep.input_checks import (
        check_combine_input,
        check_dispatch_algorithm,
        check_dispatch_inputs,
        check_dispatch_options,
    )

    c = buf.cfg
    res = buf.dispatch(s.x, s.idx, s.w)
    y = buf.expert_output(res.num_recv)

    def dispatch_checks() -> None:
        check_dispatch_options(c, "scatter", False)
        check_dispatch_algorithm(None)
        check_dispatch_inputs(c, buf.device, s.x, s.idx, s.w, values=False)

    def combine_checks() -> None:
        check_combine_input(c, buf.device, y)
        buf._check_combine_algorithm(res.handle, None)

    dispatch_parts = {
        "checks": _wall_us(dispatch_checks, iters, host_only=True),
        "enqueue": _wall_us(lambda: buf.launch_dispatch(s.x, s.idx, s.w), iters, host_only=True),
        "status": _wall_us(buf.status.read, iters),  # GPU idle: the copy and the sync alone
    }
    out = {
        "dispatch()": {"wall": _wall_us(lambda: buf.dispatch(s.x, s.idx, s.w), iters), **dispatch_parts},
        "dispatch(sync=False)": {"wall": _wall_us(lambda: buf.dispatch(s.x, s.idx, s.w, sync=False), iters),
                                 "checks": dispatch_parts["checks"], "enqueue": dispatch_parts["enqueue"]},
    }
    res = buf.dispatch(s.x, s.idx, s.w)
    y = buf.expert_output(res.num_recv)
    out["combine()"] = {
        "wall": _wall_us(lambda: buf.combine(y, res.handle), iters),
        "checks": _wall_us(combine_checks, iters, host_only=True),
        "enqueue": _wall_us(lambda: buf.launch_combine(res.handle, s.out), iters, host_only=True),
    }
    buf.check_ran()
    return out


if __name__ == "__main__":
    sys.exit(main())
