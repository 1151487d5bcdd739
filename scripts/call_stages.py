"""Where the host time of EpBuffer's public calls goes: dispatch(), dispatch(sync=False) and combine(), each
started on an idle GPU, with host timestamps inside the call.

To run (one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):

    torchrun --nproc-per-node 1 scripts/call_stages.py                  # a world of one, 128 tokens
    torchrun --nproc-per-node 2 scripts/call_stages.py --tokens 1,128

What is timed: for each tokens value and layout (DeepSeek-V3 shapes by default, uniform routing, input seed
0, one EpBuffer) and each call, ``--iters`` calls after ``--warmup``, the device synchronized before each.
``time.perf_counter`` stamps the call's start and end and three of its steps: the launch of the compiled
module (``EpBuffer._launcher``), a synced dispatch's wait for the status its layout's leader mirrors into
host memory (``StatusBlock.wait_mirror``) and the making of the result's views (``EpBuffer._received``). The
stages are the gaps between the stamps:
    * before the launch: the argument checks, the handle's storage, what the launch is given;
    * the launch: the module's host function and the driver's launch;
    * launch to wait / the wait: the host's work while the kernels run, then the rest of their time;
    * to the views, the views, after them: the count read, the views, the result.
A sync-free dispatch has no wait ("launch to views"), combine() no views ("after the launch"). Rank 0 prints
every rank's median of each stage, us. A stamped step costs about 0.2 us more (its two stamps and the
wrapper's call, on a 2-core CPU machine).

Constraints: GPUs with NVSHMEM, one per rank (--help and argument errors need none); the constraints of
``EpConfig``; --tokens values in [1, 65536]; --iters >= 1, --warmup >= 0. Exit status (the same on every
rank): 0 done, 1 a run-time error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from cute_ep.tools import bench_peers as bp
from cute_ep.tools import bench_report as br
from cute_ep.tools import bench_timing as bt
from cute_ep.tools.usage import UsageError

EXIT_OK = 0
CALLS = ("dispatch()", "dispatch(sync=False)", "combine()")
# The stages between a call's stamps (``stage_times``), in the order a call passes them.
STAGES = ("before the launch", "the launch", "launch to wait", "the wait", "to the views", "launch to views",
          "the views", "after them", "after the launch")


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / what is timed / Constraints).")
    p.add_argument("--tokens", default="128", help="comma list of tokens per rank")
    p.add_argument("--layouts", default="rank,expert", help="comma list of receive layouts (expert, rank)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--num-sms", type=int, default=24, help="SMs of dispatch / combine (EpConfig.num_sms)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for a peer (seconds)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Launch-independent checks; fills token_list and layout_list. Raises UsageError naming the
    constraint, the value and the fix."""
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.layout_list = br.parse_name_list(args.layouts, "--layouts", bp.LAYOUTS)
    except br.BenchReportError as exc:
        raise UsageError(f"{exc}; e.g. --tokens 1,128 --layouts rank,expert") from None
    if max(args.token_list) > bt.MAX_TOKENS_PER_RANK:
        raise UsageError(f"--tokens values must be <= {bt.MAX_TOKENS_PER_RANK}, got {max(args.token_list)}")
    got = (args.num_sms, args.timeout_s, args.iters, args.warmup)
    if args.num_sms < 1 or args.iters < 1 or args.warmup < 0 or not 0 < args.timeout_s < math.inf:
        raise UsageError(f"need --num-sms >= 1, --timeout-s > 0, --iters >= 1, --warmup >= 0, got {got}; "
                         "e.g. the defaults (24, 60.0, 300, 20)")


def stage_times(stamps: Mapping[str, float]) -> dict[str, float]:
    """One call's stages (us) from its stamps (seconds: "start", "launch", "launched" and "end" always,
    "wait" / "waited" for a synced dispatch, "views" / "viewed" for a dispatch)."""
    s = stamps
    out = {"before the launch": s["launch"] - s["start"], "the launch": s["launched"] - s["launch"]}
    if "wait" in s:
        out |= {"launch to wait": s["wait"] - s["launched"], "the wait": s["waited"] - s["wait"],
                "to the views": s["views"] - s["waited"]}
    elif "views" in s:
        out["launch to views"] = s["views"] - s["launched"]
    if "views" in s:
        out |= {"the views": s["viewed"] - s["views"], "after them": s["end"] - s["viewed"]}
    else:
        out["after the launch"] = s["end"] - s["launched"]
    out["host total"] = s["end"] - s["start"]
    return {k: v * 1e6 for k, v in out.items()}


def instrument(buf: Any, stamps: dict[str, float]) -> None:
    """Make ``buf``'s launch, its wait for the status mirror and its views stamp ``stamps`` before and after
    (instance attributes over the methods: this buffer only)."""
    def stamped(owner: Any, attr: str, before: str, after: str) -> None:
        fn = getattr(owner, attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            stamps[before] = time.perf_counter()
            result = fn(*args, **kwargs)
            stamps[after] = time.perf_counter()
            return result

        setattr(owner, attr, call)

    stamped(buf, "_launcher", "launch", "launched")
    stamped(buf.status, "wait_mirror", "wait", "waited")
    stamped(buf, "_received", "views", "viewed")


def call_stages(fn: Callable[[], Any], stamps: dict[str, float], sync: Callable[[], Any], iters: int,
                warmup: int) -> dict[str, float]:
    """This rank's median (us) of each stage of ``fn()`` over ``iters`` calls, each after ``sync()``."""
    for _ in range(warmup):
        fn()
    per_stage: dict[str, list[float]] = {}
    for _ in range(iters):
        sync()
        stamps.clear()
        stamps["start"] = time.perf_counter()
        fn()
        stamps["end"] = time.perf_counter()
        for name, us in stage_times(stamps).items():
            per_stage.setdefault(name, []).append(us)
    sync()
    return {name: br.median(values) for name, values in per_stage.items()}


def format_row(rank: int, tokens: int, layout: str, call: str, stages: Mapping[str, float]) -> str:
    """One line of the table: what ran, then each stage it has, in ``STAGES`` order, and its total."""
    parts = [f"{name} {stages[name]:.1f}" for name in (*STAGES, "host total") if name in stages]
    return f"rank {rank} {tokens:5d} {layout:6s} {call:21s} " + ", ".join(parts)


def the_call(buf: Any, s: Any, layout: str, name: str) -> Callable[[], Any]:
    """The call ``name`` (of ``CALLS``) on input set ``s``; combine() on a synced dispatch's handle made
    now (the latest dispatch's), its expert output the received rows where the buffer keeps them."""
    if name == "combine()":
        res = buf.dispatch(s.x, s.idx, s.w, layout=layout)
        y = buf.expert_output(res.num_recv)
        return lambda: buf.combine(y, res.handle)
    sync = name == "dispatch()"
    return lambda: buf.dispatch(s.x, s.idx, s.w, layout=layout, sync=sync)


CONFIG_FLAGS = {"num_experts": "--num-experts", "topk": "--topk", "hidden": "--hidden",
                "max_tokens": "--tokens", "num_sms": "--num-sms", "timeout_s": "--timeout-s"}


def make_config(args: argparse.Namespace, env: Any) -> Any:
    """The run's EpConfig, once this machine is known to have a CUDA GPU."""
    import torch

    from cute_ep.kernels.config import EpConfig
    from cute_ep.tools.cli import require_cuda

    require_cuda("scripts/call_stages.py (it times EpBuffer's calls on the GPU)", bt.CPU_WAY_OUT)
    return EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                    num_experts=args.num_experts, topk=args.topk, hidden=args.hidden, dtype=torch.bfloat16,
                    max_tokens=max(args.token_list), num_sms=args.num_sms, timeout_s=args.timeout_s)


def main(argv: list[str] | None = None) -> int:
    from cute_ep.tools.cli import script_main

    return script_main(argv, build_parser, validate_args, make_config, run, CONFIG_FLAGS)


def run(args: argparse.Namespace, env: Any, cfg: Any) -> int:
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.tools.cli import Printer

    with Runtime(env, symmetric_bytes=cfg.symmetric_bytes()) as rt:
        return stages_report(args, cfg, rt, Printer(env.rank))


def stages_report(args: argparse.Namespace, cfg: Any, runtime: Any, say: Callable[..., None]) -> int:
    """Every (tokens, layout, call) on one EpBuffer; rank 0 prints every rank's medians."""
    import torch

    from cute_ep.buffer import EpBuffer
    from cute_ep.tools.cli import all_gather

    env = runtime.env
    say(f"call stages: {torch.cuda.get_device_name(runtime.device)} x {env.world_size}, H {cfg.hidden}, "
        f"K {cfg.topk}, E {cfg.num_experts}, {cfg.num_sms} SMs, {args.iters} calls each (us, medians)")
    stamps: dict[str, float] = {}
    sync = lambda: torch.cuda.synchronize(runtime.device)  # noqa: E731
    with EpBuffer(runtime, cfg) as buf:
        instrument(buf, stamps)
        for t in args.token_list:
            s = bt.InputSet(cfg, env.rank, runtime.device, t, "uniform", 0)
            for layout in args.layout_list:
                for name in CALLS:
                    mine = call_stages(the_call(buf, s, layout, name), stamps, sync, args.iters, args.warmup)
                    every = all_gather(mine, runtime.cpu_group)
                    say(*(format_row(r, t, layout, name, st) for r, st in enumerate(every)))
        buf.check_ran()  # a peer that never came: PeerTimeout here, naming this rank, that peer and the op
    runtime.barrier()
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    from cute_ep.tools.cli import exit_process  # after main: --help and bad arguments exit before torch

    exit_process(code)
