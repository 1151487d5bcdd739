"""Where a dispatch / combine call's GPU time goes, kernel by kernel, at small (decode) batches.

To run (one process per GPU):

    torchrun --nproc-per-node 2 scripts/decode_breakdown.py --tokens 128,4096

For each tokens-per-rank value (DeepSeek-V3 shapes by default: H 7168, top-k 8, 256 experts, bf16,
uniform routing), with ``scripts/benchmark.py``'s timer (GPU held by a sleep while the host enqueues,
CUDA events per iteration, slowest rank's median), times:
    * the layout kernel alone (counts, count exchange with every peer, offsets, slots);
    * layout + dispatch + fan-out (what ``launch_dispatch`` enqueues; the dispatch time of the benchmark);
    * the pull combine and the reduced combine (``launch_combine``) on the latest dispatch's handle.
Dispatch's own share is the third minus the second. Nothing is validated here: run
``scripts/benchmark.py`` (which checks every configuration it times) for the results themselves.

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
            say(f"{t:>7} {w['layout']:>8.1f} {w['dispatch']:>14.1f} {w['dispatch'] - w['layout']:>17.1f} "
                f"{w['pull']:>13.1f} {w['reduced']:>16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
