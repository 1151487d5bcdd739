"""Expert-parallel dispatch and combine of cute-ep, checked bit for bit against the torch references.

Every rank makes deterministic inputs (a function of the seed and its rank), dispatches its tokens to
the ranks owning their top-k experts, applies a test expert (y = x * (expert + 1)) to the received
rows, combines them back and checks every step against :mod:`cute_ep.reference`.

To run:
    # 4 GPUs of one host (backend "cute": the CuTe DSL kernels on NVSHMEM)
    torchrun --nproc-per-node 4 scripts/dispatch_and_combine.py --num-tokens 64 --hidden 256 \\
        --num-experts 32 --topk 2

    # the same flow on the CPU (gloo, pure-torch references; no GPU needed)
    torchrun --nproc-per-node 4 scripts/dispatch_and_combine.py --backend reference --num-tokens 64 \\
        --hidden 256 --num-experts 32 --topk 2

    # one host split into 2 virtual nodes of 2 ranks, so that all four route classes occur
    torchrun --nproc-per-node 4 scripts/dispatch_and_combine.py ... --local-world-size 2

    # several nodes under SLURM (see scripts/slurm/dispatch_and_combine.sbatch)
    srun --ntasks-per-node 4 python scripts/dispatch_and_combine.py --num-tokens 64 ...

    # bit-exact baselines (a CPU-made baseline can check a GPU run of the same configuration)
    ... --save-baseline-to out/base.npz
    ... --compare-baseline out/base.npz

    # timing (backend cute): CUDA events, median of --bench-iters after --bench-warmup
    ... --benchmark

    # FP8 dispatch (e4m3 rows, one fp32 scale per 128 columns) and experts capped at 1.25x their share
    ... --fp8 --capacity-factor 1.25 --routing skewed

Constraints:
    * --num-experts divisible by the world size; 1 <= --topk <= --num-experts.
    * --hidden >= 4 and --hidden * element size a multiple of 16 bytes (8 bf16/fp16, 4 fp32).
    * 1 <= --num-tokens <= 65536 (tokens per rank, also the buffers' max_tokens);
      world size * num tokens * topk < 2**31.
    * --local-world-size (or CUTE_EP_LOCAL_WORLD_SIZE) divides the ranks per host; every host runs
      the same number of ranks, numbered host by host (torchrun, srun's block distribution).
    * backend cute: one GPU per rank, NVSHMEM (keep NVLink multicast off: NCCL_NVLS_ENABLE=0
      TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1). --benchmark needs backend cute.
    * baselines hold the scatter mode's first iteration: --modes must include scatter to save or
      compare one.
    * --fp8: --hidden a multiple of 128. --capacity-factor >= 0 (0: no expert drops rows).

PASS means, for every mode and iteration and on every rank: the layout (tokens per expert, rows
received, the handle's slots) matches the reference; the received rows, weights and source tags are
bit-identical to the reference (in atomic mode, after sorting each (local expert, source) group;
with --fp8 the packed e4m3 rows and scales, against the senders' rows quantized by the reference);
with --capacity-factor the references run on the routing left after the drops, every rank's drop
counts per expert match them, and atomic mode keeps as many rows per (expert, source) as scatter mode;
the combine output is bit-identical to the reference sum of the expert outputs (with --combine
reduced: to ``reference_combine_reduced``, and the pull combine of the same handle is checked as
well); every route class possible in the topology carried at least one pair (unless --no-coverage);
and, with
--compare-baseline, every array is bit-identical to the baseline's. Rank 0 prints one line per check
and a final PASS or FAIL line.

Exit status (the same on every rank): 0 PASS, 1 FAIL or a run-time error, 2 invalid arguments, a
launch error, or a baseline of another configuration (or an unreadable one). A FAILed run saves no
baseline (--save-baseline-to): it exits 1.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.fp8 import fp8_check_rows
from cute_ep.inputs import ROUTINGS, make_inputs
from cute_ep.kernels.config import MODES, EpConfig
from cute_ep.tools.bench_report import pairs_off as count_pairs_off
from cute_ep.tools.bench_report import script_parser
from cute_ep.tools.cli import (
    EXIT_FAIL,
    EXIT_USAGE,
    Printer,
    UsageError,
    add_combine_arg,
    add_fp8_capacity_args,
    add_launch_args,
    add_shape_args,
    all_gather,
    broadcast_from_rank0,
    check_fp8_capacity_args,
    check_run_args,
    config_from_args,
    describe_rank,
    fill_expert_output,
    leave,
    run_buffer,
    runtime_backend,
    script_main,
    world_banner,
)
from cute_ep.validators.baseline import (
    BaselineConfigError,
    BaselineFormatError,
    check_baseline_config,
    compare_to_baseline,
    save_baseline,
)
from cute_ep.validators.checks import (
    check_capacity_drops,
    check_combine,
    check_dispatch,
    check_layout,
    report,
)

BASELINE_MODE = "scatter"  # the only mode with a deterministic receive order


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__, "See the module docstring (To run / Constraints) for examples.")
    p.add_argument("--num-tokens", type=int, default=64, help="tokens per rank (also max_tokens)")
    add_shape_args(p, topk=2)
    p.add_argument(
        "--modes", default="scatter,atomic", help="comma-separated dispatch modes: scatter, atomic"
    )
    p.add_argument("--routing", choices=ROUTINGS, default="uniform", help="how inputs pick their experts")
    p.add_argument("--seed", type=int, default=0, help="input seed (iteration i uses seed + i)")
    add_launch_args(p)
    p.add_argument("--iters", type=int, default=1, help="validation iterations per mode")
    p.add_argument("--save-baseline-to", metavar="PATH", help="write every rank's arrays to this .npz")
    p.add_argument("--compare-baseline", metavar="PATH", help="compare every rank's arrays with this .npz")
    p.add_argument("--benchmark", action="store_true", help="time dispatch and combine (backend cute)")
    p.add_argument("--bench-iters", type=int, default=50, help="timed iterations of --benchmark")
    p.add_argument("--bench-warmup", type=int, default=10, help="untimed iterations before them")
    p.add_argument("--no-coverage", action="store_true", help="do not fail when a route class gets no pair")
    add_fp8_capacity_args(p)
    add_combine_arg(p)
    p.add_argument("--num-sms", type=int, default=None, help="CTAs of dispatch/combine (EpConfig default)")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Checks that do not depend on the launch; raise UsageError naming the argument."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise UsageError(f"--modes must be a comma-separated list of {sorted(MODES)}, got {args.modes!r}")
    args.mode_list = list(dict.fromkeys(modes))
    check_run_args(args, "--num-tokens", args.num_tokens)
    if args.benchmark and args.backend != "cute":
        raise UsageError("--benchmark needs --backend cute (it times the GPU kernels with CUDA events)")
    if args.bench_iters < 1 or args.bench_warmup < 0:
        raise UsageError(
            f"--bench-iters must be >= 1 and --bench-warmup >= 0, got {args.bench_iters}, {args.bench_warmup}"
        )
    check_fp8_capacity_args(args)
    if (args.save_baseline_to or args.compare_baseline) and BASELINE_MODE not in args.mode_list:
        raise UsageError(
            f"baselines hold the {BASELINE_MODE!r} mode (its order is deterministic): add it to --modes "
            f"(got {args.modes!r})"
        )


def make_config(args: argparse.Namespace, env: DistEnv) -> EpConfig:
    return config_from_args(args, env, max_tokens=args.num_tokens)


def baseline_meta(args: argparse.Namespace) -> dict[str, Any]:
    """What identifies the data: the backend is recorded but deliberately not part of ``config``."""
    return {
        "config": {
            "num_tokens": args.num_tokens,
            "max_tokens": args.num_tokens,
            "hidden": args.hidden,
            "num_experts": args.num_experts,
            "topk": args.topk,
            "routing": args.routing,
            "mode": BASELINE_MODE,
            "iteration": 0,
            # Only when used, so that baselines made before these options existed still match.
            **({"fp8": True} if args.fp8 else {}),
            **({"capacity_factor": args.capacity_factor} if args.capacity_factor else {}),
            **({"combine": args.combine} if args.combine != "pull" else {}),
        },
        "seed": args.seed,
        "dtype": args.dtype,
        "backend": args.backend,
        "script": "scripts/dispatch_and_combine.py",
    }


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def run_once(
    buffer: Any, args: argparse.Namespace, cfg: EpConfig, runtime: Runtime, mode: str, it: int, say: Printer
) -> tuple[bool, dict[str, torch.Tensor] | None]:
    """One dispatch + expert + combine with every check. Returns (passed, baseline arrays or None)."""
    env, group, device = runtime.env, runtime.cpu_group, runtime.device
    rank = env.rank
    x, idx, w = make_inputs(
        rank, args.num_tokens, args.hidden, args.num_experts, args.topk, cfg.dtype, args.seed + it,
        routing=args.routing, device=device,
    )  # fmt: skip
    coverage = not args.no_coverage
    tag = f"[{mode} #{it}]"
    ok = True

    buffer.poison()
    res = buffer.dispatch(x, idx, w, mode=mode, fp8=args.fp8)
    # The routing the references see: with a capacity factor, dropped pairs become -1.
    eff = idx
    if cfg.capacity_factor:
        dropped = buffer.dropped_rows()
        cap, eff = check_capacity_drops(
            idx, res.handle.scatter, dropped, num_experts=cfg.num_experts,
            expert_capacity=cfg.expert_capacity, ordered=(mode == "scatter"), group=group,
        )  # fmt: skip
        ok &= report(cap, f"{tag} capacity", group, say)
        say(f"{tag} {int(dropped.sum())} rows dropped beyond expert_capacity={cfg.expert_capacity} "
            f"({int((dropped > 0).sum())} of {cfg.num_experts} experts)")
    lay = check_layout(
        res, eff, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts,
        local_world_size=cfg.local_world_size, group=group,
    )  # fmt: skip
    ok &= report(lay, f"{tag} layout", group, say)
    rows, recv_rows, expert_in = x, res.recv_x, res.recv_x
    if args.fp8:  # what travels: the packed rows (e4m3 values, fp32 scales, padding)
        rows, recv_rows, expert_in = fp8_check_rows(x, res.recv_x, res.recv_scales, cfg.fp8_row_bytes)
        expert_in = expert_in.to(cfg.dtype).to(device)
    disp = check_dispatch(
        rows, eff, w, recv_rows, res.recv_weights, res.recv_src,
        max_tokens=cfg.max_tokens, num_experts=cfg.num_experts, local_world_size=cfg.local_world_size,
        ordered=(mode == "scatter"), require_coverage=coverage, group=group,
    )  # fmt: skip
    ok &= report(disp, f"{tag} dispatch" + (" (fp8)" if args.fp8 else ""), group, say)

    y = fill_expert_output(buffer, res, rank, expert_in)
    # The buffer's combine (its output goes into the baseline); on a buffer built for the reduced
    # combine, the pull combine of the same handle too (it stays available there).
    algorithms = ["reduced", "pull"] if cfg.combine_algorithm == "reduced" else ["pull"]
    outs = {}
    for algorithm in algorithms:
        outs[algorithm] = buffer.combine(y, res.handle, algorithm=algorithm)
        comb = check_combine(
            outs[algorithm], eff, w, y, local_world_size=cfg.local_world_size, num_experts=cfg.num_experts,
            scatter=res.handle.scatter, require_coverage=coverage, group=group, algorithm=algorithm,
        )  # fmt: skip
        label = f" ({algorithm})" if len(algorithms) > 1 else ""
        ok &= report(comb, f"{tag} combine{label}", group, say)
    out = outs[cfg.combine_algorithm]

    arrays = None
    if mode == BASELINE_MODE and it == 0:
        named = {
            "x": x,
            "topk_idx": idx,
            "topk_weights": w,
            "recv_x": recv_rows if args.fp8 else res.recv_x,  # numpy has no float8: the packed bytes
            "recv_w": res.recv_weights,
            "recv_src": res.recv_src,
            "tokens_per_expert": res.tokens_per_expert,
            "combine_out": out,
        }
        # Copies: recv_* are views of buffers the next dispatch overwrites.
        arrays = {k: v.detach().to("cpu", copy=True) for k, v in named.items()}
    return ok, arrays


def unreadable_baseline(path: str, exc: OSError) -> UsageError:
    """The error (exit status 2) of a baseline file that cannot be read."""
    return UsageError(f"cannot read baseline {path}: {exc.strerror or exc}")


def precheck_baseline(path: str, meta: dict[str, Any], env: DistEnv, group: Any) -> BaseException | None:
    """The reason the baseline cannot be compared (unreadable, another configuration), or None.

    Decided on rank 0 before any kernel runs and returned on every rank.
    """
    outcome: Any = None
    if env.rank == 0:
        try:
            lws = env.local_world_size
            check_baseline_config(path, meta, world_size=env.world_size, local_world_size=lws)
        except OSError as exc:
            outcome = unreadable_baseline(path, exc)
        except Exception as exc:
            outcome = exc
    return broadcast_from_rank0(outcome, group)


def benchmark(buffer: Any, args: argparse.Namespace, cfg: EpConfig, runtime: Runtime, say: Printer) -> None:
    """Median CUDA-event time of dispatch and of combine, and algorithmic bandwidth, per rank.

    Algorithmic bandwidth = pairs_off * H * bytes per element / time, pairs_off = this rank's
    (token, k) pairs whose expert lives on another rank (docs: design.md, "Measuring"). The events
    bracket the whole ``dispatch`` / ``combine`` call, so the times include the buffer's host-side
    work (input checks, reading num_recv back); ranks start each op together (host barrier).
    """
    env, group, device = runtime.env, runtime.cpu_group, runtime.device
    rank = env.rank
    x, idx, w = make_inputs(
        rank, args.num_tokens, args.hidden, args.num_experts, args.topk, cfg.dtype, args.seed,
        routing=args.routing, device=device, idx_dtype=torch.int32,  # the kernels' dtype: no conversion
    )  # fmt: skip
    pairs_off = count_pairs_off(idx.cpu(), rank, cfg.experts_per_rank)
    say(f"benchmark: {args.bench_warmup} warm-up + {args.bench_iters} timed iterations per mode")
    for mode in args.mode_list:
        times: dict[str, list[float]] = {"dispatch": [], "combine": []}
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        for i in range(args.bench_warmup + args.bench_iters):
            runtime.barrier()
            events[0].record()
            res = buffer.dispatch(x, idx, w, mode=mode, fp8=args.fp8)
            events[1].record()
            y = buffer.expert_output(res.num_recv)
            runtime.barrier()
            events[2].record()
            buffer.combine(y, res.handle)
            events[3].record()
            torch.cuda.synchronize(device)
            if i >= args.bench_warmup:
                times["dispatch"].append(events[0].elapsed_time(events[1]) * 1e3)  # ms -> us
                times["combine"].append(events[2].elapsed_time(events[3]) * 1e3)
        med = {op: statistics.median(v) for op, v in times.items()}
        rows = all_gather((pairs_off, med["dispatch"], med["combine"]), group)
        for r, (p_off, t_d, t_c) in enumerate(rows):
            b = p_off * cfg.row_bytes
            bd = p_off * cfg.fp8_row_bytes if args.fp8 else b  # FP8 dispatch moves packed rows
            say(
                f"[{mode}] rank {r}: dispatch {t_d:9.1f} us {bd / (t_d * 1e3):8.2f} GB/s | "
                f"combine {t_c:9.1f} us {b / (t_c * 1e3):8.2f} GB/s (pairs_off {p_off}, {b} B"
                + (f", {bd} B in fp8)" if args.fp8 else ")")
            )


def validate(buffer: Any, args: argparse.Namespace, cfg: EpConfig, runtime: Runtime, say: Printer) -> int:
    """Every mode and iteration, then the baseline and the benchmark; returns the exit status."""
    env, group = runtime.env, runtime.cpu_group
    passed = True
    arrays = None
    for mode in args.mode_list:
        for it in range(args.iters):
            ok, got = run_once(buffer, args, cfg, runtime, mode, it, say)
            passed &= ok
            arrays = got if got is not None else arrays

    # save_baseline / compare_to_baseline raise the same exception on every rank (rank 0 decides).
    meta = baseline_meta(args)
    lws = env.local_world_size
    if args.save_baseline_to and not passed:  # `passed` is the same on every rank: no file, exit 1
        problem = RuntimeError(
            f"not saving the baseline to {args.save_baseline_to}: the checks failed (see above), and a "
            "baseline must hold correct results"
        )
        leave(runtime, problem, EXIT_FAIL, meet=False)
        say("FAIL")
        return EXIT_FAIL
    if args.save_baseline_to:
        try:
            save_baseline(args.save_baseline_to, arrays, meta, group, local_world_size=lws)
        except Exception as exc:
            problem = RuntimeError(f"cannot save the baseline to {args.save_baseline_to}: {exc}")
            return leave(runtime, problem, EXIT_FAIL, meet=False)
        say(f"baseline saved to {args.save_baseline_to}")
    if args.compare_baseline:
        try:
            cmp = compare_to_baseline(args.compare_baseline, arrays, meta, group, local_world_size=lws)
        except OSError as exc:  # unreadable: exit 2, as in precheck_baseline
            return leave(runtime, unreadable_baseline(args.compare_baseline, exc), EXIT_USAGE, meet=False)
        except Exception as exc:
            usage = isinstance(exc, (BaselineConfigError, BaselineFormatError))
            return leave(runtime, exc, EXIT_USAGE if usage else EXIT_FAIL, meet=False)
        say(f"{cmp.summary} (vs {args.compare_baseline})", *cmp.lines[1:])
        passed &= cmp.passed
    if args.benchmark:
        benchmark(buffer, args, cfg, runtime, say)
    return say.verdict(passed)


def sms_share_text(runtime: Runtime) -> str:
    """What num_sms 0 becomes on this rank: its share of its GPU."""
    return f"{runtime.sm_share} (this rank's share of its GPU)"


def run(args: argparse.Namespace, env: DistEnv, cfg: EpConfig) -> int:
    say = Printer(env.rank)
    backend = runtime_backend(args.backend)
    sym = cfg.symmetric_bytes()
    with Runtime(env, symmetric_bytes=sym, backend=backend) as runtime:
        # Only what applies to the backend: SMs are the kernels', symmetric memory NVSHMEM's, and a
        # CPU runtime uses no GPU.
        nvshmem = backend == "nvshmem"
        topology = all_gather(describe_rank(env, runtime), runtime.cpu_group)
        say(
            world_banner("dispatch_and_combine", args.backend, env, cfg),
            f"config: tokens/rank {cfg.max_tokens}, hidden {cfg.hidden}, experts {cfg.num_experts} "
            f"({cfg.experts_per_rank}/rank), topk {cfg.topk}, {args.dtype}, routing {args.routing}, "
            f"seed {args.seed}, modes {','.join(args.mode_list)}, iters {args.iters}, "
            f"capacity {cfg.capacity} rows"
            + (f", num_sms {cfg.num_sms or sms_share_text(runtime)}" if args.backend == "cute" else "")
            + (f", fp8 ({cfg.fp8_row_bytes} B per row)" if args.fp8 else "")
            + (f", capacity_factor {cfg.capacity_factor:g} (expert_capacity {cfg.expert_capacity})"
               if cfg.capacity_factor else ""),
            *([f"symmetric memory per rank: {sym} bytes ({sym / 2**20:.2f} MiB)"
               + (f", NVSHMEM_SYMMETRIC_SIZE={runtime.symmetric_size}" if runtime.symmetric_size else "")]
              if nvshmem else []),
            "topology:",
            *(f"  {line}" for line in topology),
        )
        if args.compare_baseline:  # fail before building anything
            problem = precheck_baseline(args.compare_baseline, baseline_meta(args), env, runtime.cpu_group)
            if problem is not None:
                return leave(runtime, problem, EXIT_USAGE)

        return run_buffer(args.backend, runtime, cfg, lambda buf: validate(buf, args, cfg, runtime, say))


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, build_parser, validate_args, make_config, run)


if __name__ == "__main__":
    raise SystemExit(main())
