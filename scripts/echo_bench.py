"""ECHO under Zipf skew: rows per rank without cloning, with a static ReplicaMap and with ElasticExperts,
and what ECHO costs (planner, weight copy) and saves (dispatch + expert + combine per step).

To run (GPUs, one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 scripts/echo_bench.py --out-json echo.json --out-png echo.png

    # CPU, reference backend over gloo: the balance numbers are exact; the times only indicative
    torchrun --nproc-per-node 4 scripts/echo_bench.py --backend reference --out-json echo_cpu.json

What is measured, for every Zipf exponent (--skews) over --num-experts experts, top --topk, --tokens
tokens per rank, --spare-slots spare slots per rank (cute_ep.skew draws the routing; every rank agrees
on the hot experts):
    * balance: max / mean rows received per rank (every (token, k) pair is a row) over --steps steps,
      in two scenarios: "fixed" (the same hot experts every step, new tokens) and "drift" (the hot
      experts change every step). "none": the plain layout; "static": ``ReplicaMap.from_load`` with
      the same spare slots, built from a calibration step drawn before the measured ones (in "drift"
      the hot set has moved since); "echo": ``ElasticExperts``' plan of each step (the rows
      ``route`` delivers, checked against the plan's prediction on every step). Exact, on any backend:
      counts only, no rows move.
    * planner: ``ElasticExperts.plan`` (all-gather of the counts + ``plan_clones``) and
      ``plan_clones`` alone, median ms (CUDA events on GPUs, wall clock on the CPU).
    * weight copy: ``clone_weights`` of home experts shaped --expert-shape (default: a DeepSeek-V3
      expert, 3 x 7168 x 2048 bf16) into every spare slot of a plan that fills them all; median ms.
    * step: dispatch + a stand-in expert (two GEMMs [H, F] and [F, H], F = prod(--expert-shape) / (2 H):
      the FLOPs per row of one expert of that shape) + combine, with --step-tokens tokens per rank and
      --step-hidden columns, per step without and with ECHO (plan + route + weight copy included), over
      routings that change every step ("drift"); the slowest rank's median ms.
Balance is computed at the full shape on any backend. On the reference backend the step and copy use
the smaller --step-tokens / --step-hidden / --expert-shape defaults below, and every time is a CPU
time over gloo: indicative only (the JSON says so in "timing").

Output on rank 0: one line per (scenario, skew) and the times; with --out-json the report
(``{"schema": "cute-ep-echo/1", "meta": {...}, "balance": [...], "plan_ms": ..., "plan_clones_ms": ...,
"copy_ms": ..., "clones_in_copy": ..., "expert_bytes": ..., "step_ms": [...]}``; meta records the shapes
used, the step's --step-tokens / --step-hidden among them, and the torchrun line in "launch"), with
--out-png a plot of max / mean rows per rank.

Constraints: --num-experts divisible by the world size; 1 <= --topk <= --num-experts; --tokens,
--steps, --iters >= 1; --spare-slots >= 0; --skews numbers >= 0. Exit status: 0 done, 1 a check failed
(echo's routed rows differ from its plan, or its peak exceeds no cloning) or a run-time error, 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from cute_ep.tools.usage import report_usage_error, script_parser

SCHEMA = "cute-ep-echo/1"
DEEPSEEK_EXPERT = "3,7168,2048"


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--backend", choices=("cute", "reference"), default="cute",
                   help="cute: EpBuffer on GPUs (NCCL for ECHO's collectives); reference: CPU over gloo")
    p.add_argument("--skews", default="0.8,1.0,1.2", help="comma list of Zipf exponents")
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168, help="H of the step on GPUs")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per rank for the balance (and the GPU step)")
    p.add_argument("--spare-slots", type=int, default=2, help="S, spare expert slots per rank")
    p.add_argument("--max-clones", type=int, default=None,
                   help="ECHO's cap on clones per step (default R * S)")
    p.add_argument("--steps", type=int, default=8, help="routing steps measured per skew and scenario")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions of the planner, copy and step")
    p.add_argument("--expert-shape", default=None,
                   help=f"weights of one expert for the copy, comma list (default: {DEEPSEEK_EXPERT} on "
                        "GPUs, 3,256,128 on the reference backend)")
    p.add_argument("--step-tokens", type=int, default=None, help="tokens per rank of the timed step "
                   "(default: --tokens on GPUs, 256 on the reference backend)")
    p.add_argument("--step-hidden", type=int, default=None,
                   help="H of the timed step (default: --hidden on GPUs, 256 on the reference backend)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", metavar="PATH")
    p.add_argument("--out-png", metavar="PATH")
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """Fills the parsed lists and defaults; returns an error message or None."""
    try:
        args.skew_list = [float(v) for v in args.skews.split(",") if v.strip()]
        shape = args.expert_shape or (DEEPSEEK_EXPERT if args.backend == "cute" else "3,256,128")
        args.shape = [int(v) for v in shape.split(",") if v.strip()]
    except ValueError:
        return (f"--skews and --expert-shape take comma lists of numbers, got {args.skews!r}, "
                f"{args.expert_shape!r}")
    cpu = args.backend == "reference"
    args.step_tokens = args.step_tokens or (256 if cpu else args.tokens)
    args.step_hidden = args.step_hidden or (256 if cpu else args.hidden)
    problems = [
        (not args.skew_list or any(not s >= 0 for s in args.skew_list),
         f"--skews must be >= 0, got {args.skews}"),
        (not 1 <= args.topk <= args.num_experts, f"--topk must be in [1, --num-experts], got {args.topk}"),
        (min(args.tokens, args.steps, args.iters, args.step_tokens) < 1,
         "--tokens, --steps, --iters and --step-tokens must be >= 1"),
        (args.spare_slots < 0, f"--spare-slots must be >= 0, got {args.spare_slots}"),
        (not args.shape or min(args.shape) < 1, f"--expert-shape must list sizes >= 1, got {args.shape}"),
        (args.step_hidden < 8 or args.step_hidden % 8,
         f"--step-hidden must be a positive multiple of 8, got {args.step_hidden}"),
    ]
    for failed, message in problems:
        if failed:
            return message
    return None


class Clock:
    """Median milliseconds of a collective callable over iterations, the slowest rank's (CUDA events on
    a GPU, wall clock on the CPU; a barrier before each iteration so ranks start together)."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.cuda = runtime.device.type == "cuda"

    def median_ms(self, fn: Any, iters: int, warmup: int = 1) -> float:
        import torch

        from cute_ep.collectives import all_gather_objects

        for i in range(warmup):
            fn(-1 - i)
        times = []
        for i in range(iters):
            self.rt.barrier()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(i)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(i)
                times.append((time.perf_counter() - t0) * 1e3)
        return max(all_gather_objects(statistics.median(times), self.rt.cpu_group))


def sample(rank: int, tokens: int, num_experts: int, topk: int, skew: float, seed: int, hot_step: int,
           draw: int) -> Any:
    """[T, K] int64: Zipf routing whose hot experts are those of ``hot_step``, tokens of draw ``draw``."""
    import torch

    from cute_ep.skew import zipf_probs

    probs = zipf_probs(num_experts, skew, seed, hot_step)
    g = torch.Generator().manual_seed(((seed * 1009 + draw) * 4099 + rank) & 0x7FFFFFFF)
    return torch.multinomial(probs.expand(tokens, num_experts), topk, replacement=False, generator=g)


def balance(args: argparse.Namespace, rt: Any, group: Any, skew: float, scenario: str) -> dict:
    """Max / mean rows per rank (means over the steps) for none / static / echo; collective."""
    import torch
    import torch.distributed as dist

    from cute_ep import ElasticExperts, ReplicaMap
    from cute_ep.elastic import count_tokens

    R, rank, dev = rt.env.world_size, rt.env.rank, rt.device
    E, K, T, S = args.num_experts, args.topk, args.tokens, args.spare_slots
    ee = ElasticExperts(E, S, group=group, max_clones=args.max_clones)
    calib = sample(rank, T, E, K, skew, args.seed, 0, 0).to(dev)
    load = ee.transport.all_gather(count_tokens(calib, E)).sum(0).cpu()
    static = ReplicaMap.from_load(load, R, extra_slots_per_rank=S) if S else ReplicaMap.identity(E, R)
    table = static.device_table(dev)
    peaks: dict[str, list[float]] = {"none": [], "static": [], "echo": []}
    means, clones, mismatches = [], [], 0
    for step in range(1, args.steps + 1):
        idx = sample(rank, T, E, K, skew, args.seed, 0 if scenario == "fixed" else step, step).to(dev)
        plan = ee.plan(idx)
        routed = ee.route(idx, plan).long()
        per_rank = torch.zeros(R, dtype=torch.int64, device=dev)
        per_rank.index_add_(0, routed[routed >= 0] // ee.slots_per_rank,
                            torch.ones_like(routed[routed >= 0]))
        rows_static = torch.zeros(R, dtype=torch.int64, device=dev)
        phys = static.route(idx, table).long()
        rows_static.index_add_(0, phys[phys >= 0] // static.slots_per_rank, torch.ones_like(phys[phys >= 0]))
        dist.all_reduce(per_rank, group=group)
        dist.all_reduce(rows_static, group=group)
        mismatches += int(not torch.equal(per_rank, plan.rows_per_rank))
        mean = float(plan.rows_without.sum()) / R
        means.append(mean)
        peaks["none"].append(float(plan.rows_without.max()))
        peaks["static"].append(float(rows_static.max()))
        peaks["echo"].append(float(plan.rows_per_rank.max()))
        clones.append(int(plan.num_clones))
    mean = statistics.mean(means)
    row = {"scenario": scenario, "skew": skew, "mean_rows": mean, "clones_per_step": statistics.mean(clones),
           "echo_matches_plan": mismatches == 0}
    for name, values in peaks.items():
        row[f"max_rows_{name}"] = statistics.mean(values)
        row[f"max_over_mean_{name}"] = statistics.mean(values) / mean
    row["echo_never_worse"] = all(a <= b for a, b in zip(peaks["echo"], peaks["none"], strict=True))
    return row


def costs(args: argparse.Namespace, rt: Any, group: Any, clock: Clock) -> dict:
    """The planner's time, and the weight copy of a plan whose spare slots are all filled."""
    import torch

    from cute_ep import ElasticExperts
    from cute_ep.elastic import count_tokens, plan_clones

    R, rank, dev = rt.env.world_size, rt.env.rank, rt.device
    E, K, T, S = args.num_experts, args.topk, args.tokens, args.spare_slots
    ee = ElasticExperts(E, S, group=group)
    idx = sample(rank, T, E, K, max(args.skew_list), args.seed, 0, 0).to(dev)
    counts = ee.transport.all_gather(count_tokens(idx, E))
    out = {"plan_ms": clock.median_ms(lambda i: ee.plan(idx), args.iters),
           "plan_clones_ms": clock.median_ms(lambda i: plan_clones(counts, S), args.iters)}
    # Every rank's tokens to experts 0..K-1 (rank 0's when E / R >= K): the planner fills the spare slots
    # of the other ranks with their clones (the copy a rank waits for is that of its S slots).
    el = E // R
    full = ee.plan(torch.arange(K, device=dev)[None].expand(T, K).contiguous())
    dtype = torch.bfloat16
    home = torch.randn(el, *args.shape, device=dev).to(dtype)
    out["copy_ms"] = clock.median_ms(lambda i: ee.clone_weights(home, full), args.iters)
    out["clones_in_copy"] = int(full.num_clones)
    out["expert_bytes"] = math.prod(args.shape) * home.element_size()
    return out


def steps(args: argparse.Namespace, rt: Any, group: Any, clock: Clock) -> list[dict]:
    """dispatch + stand-in expert + combine per step, without and with ECHO, per skew; collective."""
    import dataclasses

    import torch

    from cute_ep import ElasticExperts
    from cute_ep.kernels.config import EpConfig
    from cute_ep.tools.cli import make_buffer

    env, dev = rt.env, rt.device
    R, rank = env.world_size, env.rank
    E, K, S, T, H = args.num_experts, args.topk, args.spare_slots, args.step_tokens, args.step_hidden
    dtype = torch.bfloat16
    F = max(8, math.prod(args.shape) // (2 * H) // 8 * 8)
    g = torch.Generator().manual_seed(17 + rank)
    A = (torch.randn(H, F, generator=g) / H**0.5).to(dtype).to(dev)
    B = (torch.randn(F, H, generator=g) / F**0.5).to(dtype).to(dev)
    el = E // R
    home = torch.randn(el, *args.shape, generator=g).to(dtype).to(dev)
    x = torch.randn(T, H, generator=g).to(dtype).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    ee = ElasticExperts(E, S, group=group, max_clones=args.max_clones)
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=K, hidden=H,
                   dtype=dtype, max_tokens=T)
    backend = "reference" if args.backend == "reference" else "cute"
    rows = []
    with make_buffer(backend, rt, cfg) as plain, \
            make_buffer(backend, rt, dataclasses.replace(cfg, num_experts=ee.num_physical)) as echo:
        for skew in args.skew_list:
            routes = [sample(rank, T, E, K, skew, args.seed, i, i).to(dev) for i in range(args.iters + 1)]

            def expert(buf: Any, res: Any) -> Any:
                y = buf.expert_output(res.num_recv)
                y.copy_((res.recv_x @ A) @ B)
                return buf.combine(y, res.handle)

            def plain_step(i: int, routes: list = routes) -> None:
                expert(plain, plain.dispatch(x, routes[i % len(routes)], w))

            def echo_step(i: int, routes: list = routes) -> None:
                idx = routes[i % len(routes)]
                plan = ee.plan(idx)
                ee.clone_weights(home, plan)  # the copy the experts would wait for
                expert(echo, echo.dispatch(x, ee.route(idx, plan), w))

            rows.append({"skew": skew, "tokens": T, "hidden": H, "ffn": F,
                         "plain_ms": clock.median_ms(plain_step, args.iters),
                         "echo_ms": clock.median_ms(echo_step, args.iters)})
    return rows


def plot(report: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8))
    scenarios = list(dict.fromkeys(r["scenario"] for r in report["balance"]))  # as measured: fixed, drift
    top = max(r[f"max_over_mean_{n}"] for r in report["balance"] for n in ("none", "static", "echo"))
    for i, scenario in enumerate(scenarios):
        ax = fig.add_subplot(1, len(scenarios), i + 1)
        rows = [r for r in report["balance"] if r["scenario"] == scenario]
        skews = [r["skew"] for r in rows]
        for j, name in enumerate(("none", "static", "echo")):
            ax.bar([k + 0.27 * (j - 1) for k in range(len(skews))],
                   [r[f"max_over_mean_{name}"] for r in rows], width=0.27, label=name)
        ax.set_xticks(range(len(skews)), [f"zipf {s:g}" for s in skews])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"hot experts {scenario}")
        ax.set_ylabel("max / mean rows per rank")
        ax.set_ylim(0, top * 1.25)  # room for the legend above the bars
        ax.legend(loc="upper left", ncols=3, fontsize="small")
    m = report["meta"]
    fig.suptitle(f"ECHO: {m['world_size']} ranks, E {m['num_experts']}, top-{m['topk']}, "
                 f"{m['tokens']} tokens/rank, {m['spare_slots']} spare slots/rank ({m['backend']})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(path)


def launch_line() -> str | None:
    """The torchrun line that started this rank (one host), or None when torchrun did not."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    where = f" --nnodes {nodes}" if nodes > 1 else ""
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "?")
    return f"torchrun{where} --nproc-per-node {per_node} {shlex.join(sys.argv)}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    error = check_args(args)
    if error:
        return report_usage_error(error)
    import torch

    from cute_ep.bootstrap import DistEnv, Runtime
    from cute_ep.kernels.config import EpConfig
    from cute_ep.tools import bench_report as br
    from cute_ep.tools.cli import Printer

    env = DistEnv.from_environ()
    if args.num_experts % env.world_size:
        return report_usage_error(f"--num-experts {args.num_experts} must be divisible by the world size "
                                  f"{env.world_size}")
    say = Printer(env.rank)
    E_phys = (args.num_experts // env.world_size + args.spare_slots) * env.world_size
    heap = 2 * EpConfig(world_size=env.world_size, local_world_size=env.local_world_size, num_experts=E_phys,
                        topk=args.topk, hidden=args.step_hidden, dtype=torch.bfloat16,
                        max_tokens=args.step_tokens).symmetric_bytes()
    code = 0
    backend = "gloo" if args.backend == "reference" else "nvshmem"
    with Runtime(env, backend=backend, symmetric_bytes=heap) as rt:
        group = rt.cpu_group if rt.device.type == "cpu" else rt.group
        clock = Clock(rt)
        device = "cpu (gloo)" if rt.device.type == "cpu" else torch.cuda.get_device_name(rt.device)
        meta = {"backend": args.backend, "device": device, "world_size": env.world_size,
                "num_experts": args.num_experts, "topk": args.topk, "tokens": args.tokens,
                "spare_slots": args.spare_slots, "max_clones": args.max_clones, "steps": args.steps,
                "iters": args.iters, "expert_shape": args.shape, "seed": args.seed,
                "balance_shape": "rows are (token, k) pairs counted per rank: independent of H",
                "step_tokens": args.step_tokens, "step_hidden": args.step_hidden,
                "cost_skew": max(args.skew_list),
                "timing": "indicative: CPU wall clock over gloo" if args.backend == "reference"
                else "CUDA events, slowest rank's median",
                "git_sha": br.git_sha(), "timestamp": br.utc_timestamp(),
                "command": shlex.join([Path(sys.executable).name, *sys.argv]), "launch": launch_line()}
        say(f"ECHO bench: {device} x {env.world_size}, E {args.num_experts}, top-{args.topk}, {args.tokens} "
            f"tokens/rank, {args.spare_slots} spare slots/rank")
        rows = []
        for scenario in ("fixed", "drift"):
            for skew in args.skew_list:
                row = balance(args, rt, group, skew, scenario)
                rows.append(row)
                say(f"  {scenario:5s} zipf {skew:3.1f}: max/mean rows per rank  "
                    f"none {row['max_over_mean_none']:.3f}  static {row['max_over_mean_static']:.3f}  "
                    f"echo {row['max_over_mean_echo']:.3f}"
                    f"  (mean {row['mean_rows']:.0f} rows, {row['clones_per_step']:.1f} clones/step)")
                if not (row["echo_matches_plan"] and row["echo_never_worse"]):
                    say("  FAIL: echo's routed rows differ from its plan, or its peak exceeds no cloning")
                    code = 1
        cost = costs(args, rt, group, clock)
        say(f"  planner {cost['plan_ms']:.3f} ms (plan_clones alone {cost['plan_clones_ms']:.3f} ms); "
            f"weight copy of {cost['clones_in_copy']} clones of {cost['expert_bytes'] / 1e6:.1f} MB: "
            f"{cost['copy_ms']:.3f} ms")
        step_rows = steps(args, rt, group, clock)
        for r in step_rows:
            say(f"  step zipf {r['skew']:3.1f} (T {r['tokens']}, H {r['hidden']}, F {r['ffn']}): "
                f"plain {r['plain_ms']:.2f} ms, echo {r['echo_ms']:.2f} ms")
        report = {"schema": SCHEMA, "meta": meta, "balance": rows, **cost, "step_ms": step_rows}
        if env.rank == 0 and args.out_json:
            br.write_json_file(args.out_json, report)
        if env.rank == 0 and args.out_png:
            plot(report, args.out_png)
        rt.barrier()
    return code


if __name__ == "__main__":
    sys.exit(main())
