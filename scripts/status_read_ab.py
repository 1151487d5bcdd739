"""How a synced dispatch() learns its status, compared in one process: the status mirror against the plain
read, with dispatch(sync=False) beside them.

To run (one process per GPU; a world of one is enough, every rank makes the same calls):

    torchrun --nproc-per-node 1 scripts/status_read_ab.py --tokens 1,128,4096 --num-sms 24,132

For each SM budget (one EpBuffer each, H 7168, K 8, E 256, bf16 by default), tokens-per-rank value and
receive layout, the three variants run in turn, ``--iters`` times each (interleaved, so that this host's
drift from run to run falls on all three alike), each timed from an idle GPU until
``torch.cuda.synchronize()`` returns:
    * ``mirror``: ``dispatch()`` as built: the layout's leader writes the status block into pinned
      host memory once the count is known and the host polls it (``StatusBlock.wait_mirror``);
    * ``plain read``: ``dispatch()`` with the mirror turned off for the call: a device-to-host copy of the
      block and a stream sync (``StatusBlock.read``);
    * ``sync=False``: ``dispatch(sync=False)`` (no status in the call; the outer sync waits instead).
Rank 0 prints one line per (num_sms, tokens, layout): each variant's median (us), the slowest rank's.

Constraints: GPUs with NVSHMEM, one per rank (--help and argument errors need none); the constraints of
``EpConfig``; --tokens values in [1, 65536]; --num-sms >= 1; --iters >= 1. Exit status: 0 done, 1 a
run-time error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import time

from cute_ep.tools import bench_report as br  # pure Python + numpy: safe before parsing
from cute_ep.tools.usage import EXIT_USAGE, report_usage_error  # torch-free

VARIANTS = ("mirror", "plain read", "sync=False")
MAX_TOKENS = 65536


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / what is timed / Constraints).")
    p.add_argument("--tokens", default="1,128,4096", help="comma list of tokens per rank")
    p.add_argument("--num-sms", default="24,132", help="comma list of SM budgets (EpConfig.num_sms)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=200, help="calls of each variant")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace | None:
    """The arguments, or None after printing the error (``report_usage_error``; exit status 2)."""
    args = build_parser().parse_args(argv)
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.sms_list = br.parse_int_list(args.num_sms, "--num-sms")
    except br.BenchReportError as exc:
        report_usage_error(exc)
        return None
    if max(args.token_list) > MAX_TOKENS or min(args.sms_list) < 1 or args.iters < 1:
        report_usage_error(f"need --tokens values <= {MAX_TOKENS}, --num-sms >= 1 and --iters >= 1, got "
                           f"{args.tokens!r}, {args.num_sms!r}, {args.iters}")
        return None
    return args


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args is None:
        return EXIT_USAGE
    import dataclasses

    import torch

    from cute_ep import EpConfig
    from cute_ep.bootstrap import DistEnv, Runtime
    from cute_ep.buffer import EpBuffer
    from cute_ep.tools.cli import Printer, all_gather, report_setup_error, require_cuda, setup_errors

    try:
        env = DistEnv.from_environ()
        base = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size, hidden=args.hidden,
                        topk=args.topk, num_experts=args.num_experts, dtype=torch.bfloat16,
                        max_tokens=max(args.token_list), num_sms=args.sms_list[0])
        require_cuda("scripts/status_read_ab.py (it times the GPU kernels)")
    except setup_errors() as exc:
        return report_setup_error(exc)
    say = Printer(env.rank)
    with Runtime(env, symmetric_bytes=max(dataclasses.replace(base, num_sms=n).symmetric_bytes()
                                          for n in args.sms_list)) as rt:
        say(f"status read A/B: {torch.cuda.get_device_name(rt.device)} x {env.world_size}; median of "
            f"{args.iters} calls each, interleaved (us, slowest rank)")
        for sms in args.sms_list:
            buf = EpBuffer(rt, dataclasses.replace(base, num_sms=sms))
            if not buf.status.mirror_ok:
                say("warning: the driver did not map the status mirror: both synced variants read plainly")
            for t in args.token_list:
                g = torch.Generator().manual_seed(1000 * env.rank + t)
                x = torch.randn(t, args.hidden, generator=g).to(torch.bfloat16).to(rt.device)
                idx = torch.rand(t, args.num_experts, generator=g).topk(args.topk, dim=1).indices
                idx = idx.to(torch.int32).to(rt.device)
                w = torch.rand(t, args.topk, generator=g).to(rt.device)
                for layout in ("expert", "rank"):
                    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                    mapped = buf.status.mirror_ok
                    for _ in range(args.iters):
                        for variant in VARIANTS:
                            buf.status.mirror_ok = mapped and variant == "mirror"
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            buf.dispatch(x, idx, w, layout=layout, sync=variant != "sync=False")
                            torch.cuda.synchronize()
                            times[variant].append((time.perf_counter() - t0) * 1e6)
                    buf.status.mirror_ok = mapped
                    mine = [median(times[v]) for v in VARIANTS]
                    worst = [max(r[i] for r in all_gather(mine, rt.cpu_group)) for i in range(len(VARIANTS))]
                    say(f"  num_sms {sms:4d} T {t:6d} {layout:6s}: "
                        + "  ".join(f"{v} {us:7.1f}" for v, us in zip(VARIANTS, worst, strict=True)))
            buf.check_ran()
            buf.close()
    return 0


if __name__ == "__main__":
    code = main()
    from cute_ep.tools.cli import (
        exit_process,  # after main: --help and bad arguments exit before torch is imported
    )

    exit_process(code)
