"""MoE layer: cute_ep.MoELayer forward and backward, checked against a dense single-process torch reference.

Every rank builds the same layer (a DeepSeek-style router: sigmoid scores, group-limited top-k with a
selection bias, normalized and scaled weights; E / world_size experts with SwiGLU MLPs per rank; a shared
expert) with the same weights, runs its own tokens forward and a random output gradient backward, and
compares the output and every gradient with a plain torch evaluation of the same layer over every
rank's tokens (cute_ep/validators/moe_checks.py). Dispatch runs without a host sync: the experts see the
worst-case receive buffer, whose padding rows the grouped GEMMs and the offset-aware SwiGLU skip.

To run:
    # CPU only: the pure-torch reference backend over gloo (also a world of one, without torchrun)
    python examples/moe_layer.py --backend reference
    torchrun --nproc-per-node 4 examples/moe_layer.py --backend reference

    # GPUs: the CuTe DSL kernels on NVSHMEM (EpBuffer), one rank per GPU; --overlap puts dispatch and
    # combine on their own stream with the shared expert running meanwhile
    torchrun --nproc-per-node 2 examples/moe_layer.py
    torchrun --nproc-per-node 2 examples/moe_layer.py --overlap

    # the all_to_all_single fallback (NCCL on GPUs, gloo on CPUs)
    torchrun --nproc-per-node 2 examples/moe_layer.py --backend a2a

What must hold: on the CPU the output and the expert, router and shared-expert gradients equal the
reference's and the input gradient is within a few roundings of the dtype (validators/moe_checks.py says
why); on a GPU, where the grouped GEMM and the reference's matmuls are different kernels, every quantity
within gpu_rtol of the reference. Rank 0 prints what is compared and what the padding rows are, one line
per rank, then PASS (exit status 0) or FAIL (1).
"""

from __future__ import annotations

import argparse
from typing import Any

from cute_ep import EpConfig, MoELayer, RouterConfig
from cute_ep.bootstrap import DistEnv, Runtime
from cute_ep.collectives import all_gather_objects
from cute_ep.swiglu import resolve_impl
from cute_ep.tools.cli import (
    BACKENDS,
    DTYPES,
    Printer,
    UsageError,
    in_flags,
    make_buffer,
    runtime_backend,
    script_main,
)
from cute_ep.tools.usage import script_parser
from cute_ep.validators.moe_checks import (
    EXACT,
    MoECase,
    case_inputs,
    compare_results,
    dense_results,
    global_weights,
    gpu_rtol,
    layer_results,
)


def make_case(args: argparse.Namespace, world: int) -> MoECase:
    """The layer and inputs of this run: rank r has T - r * T / 8 tokens (ragged), max_tokens T * 5 / 4
    (so the worst-case receive buffer has padding rows even in a world of one)."""
    t = args.tokens
    return MoECase(
        "example", dtype=DTYPES[args.dtype], hidden=args.hidden, intermediate=args.intermediate,
        experts_per_rank=args.experts_per_rank, topk=args.topk, score=args.score, num_groups=args.groups,
        topk_groups=args.topk_groups, normalize=True, route_scale=2.5, expert_bias=True,
        shared_intermediate=args.shared, sync=args.sync, swiglu=args.swiglu,
        tokens=tuple(t - r * t // 8 for r in range(world)), max_tokens=t + t // 4, seed=args.seed,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--backend", choices=BACKENDS, default="cute", help="cute (GPUs), reference (CPU), a2a")
    p.add_argument("--tokens", type=int, default=64, help="tokens of rank 0 (T); rank r has T - r*T/8")
    p.add_argument("--hidden", type=int, default=256, help="H (a multiple of 8)")
    p.add_argument("--intermediate", type=int, default=128, help="the experts' width I (a multiple of 8)")
    p.add_argument("--experts-per-rank", type=int, default=8, help="E / world size")
    p.add_argument("--topk", type=int, default=4, help="experts per token (K)")
    p.add_argument("--score", choices=["softmax", "sigmoid"], default="sigmoid")
    p.add_argument("--groups", type=int, default=4, help="expert groups of the router (1: no group limit)")
    p.add_argument("--topk-groups", type=int, default=2, help="groups a token may use")
    p.add_argument("--shared", type=int, default=128, help="the shared expert's width (0: none)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--sync", action="store_true", help="dispatch with a host sync (views of the real rows)")
    p.add_argument("--swiglu", choices=["auto", "kernel", "torch", "plain"], default="auto")
    p.add_argument("--overlap", action="store_true",
                   help="GPU: a communication stream, the shared expert beside it")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of a run-time error")
    return p


FLAGS = {
    "hidden": "--hidden", "topk": "--topk", "dtype": "--dtype", "num_groups": "--groups",
    "topk_groups": "--topk-groups", "num_experts": "--experts-per-rank x the world size",
    "max_tokens": "the buffer's tokens per rank (--tokens + --tokens / 4)", "world_size": "the world size",
}  # fmt: skip
"""What sets each EpConfig and RouterConfig field here: a configuration error names it."""


def validate_args(args: argparse.Namespace) -> None:
    """UsageError for the flags whose fields the configuration only sees derived."""
    if args.tokens < 0:
        raise UsageError(f"--tokens must be >= 0, got {args.tokens}")
    if args.experts_per_rank < 1:
        raise UsageError(f"--experts-per-rank must be >= 1, got {args.experts_per_rank}")


def make_config(args: argparse.Namespace, env: DistEnv) -> EpConfig:
    """The buffer's configuration, and the router's arguments checked (one line and exit 2 if bad; the
    message names the flags: ``FLAGS``)."""
    case = make_case(args, env.world_size)
    cfg = case.config(env.world_size, env.local_world_size)  # ConfigError names a bad value
    try:
        RouterConfig(num_experts=cfg.num_experts, topk=case.topk, score=case.score,
                     num_groups=case.num_groups, topk_groups=case.topk_groups, scale=case.route_scale)
    except ValueError as exc:
        raise UsageError(in_flags(str(exc), FLAGS)) from None
    if args.intermediate < 1 or args.intermediate % 8 or args.shared < 0 or args.shared % 8:
        raise UsageError(f"--intermediate must be a positive multiple of 8 and --shared a multiple of 8 "
                         f"(0: none), got {args.intermediate} and {args.shared}")
    return cfg


def run(args: argparse.Namespace, env: DistEnv, cfg: EpConfig) -> int:
    """The layer forward and backward on every rank against the dense reference; rank 0 reports."""
    case = make_case(args, env.world_size)
    say = Printer(env.rank)
    with Runtime(env, backend=runtime_backend(args.backend), symmetric_bytes=cfg.symmetric_bytes()) as rt:
        device = rt.device
        x, grad_out = case_inputs(case, env.rank)
        with make_buffer(args.backend, rt, cfg) as buf:
            layer = MoELayer(
                buf, case.intermediate, score=case.score, num_groups=case.num_groups,
                topk_groups=case.topk_groups, normalize=case.normalize, route_scale=case.route_scale,
                expert_bias=case.expert_bias, shared_intermediate=case.shared_intermediate,
                swiglu=case.swiglu, sync=case.sync, overlap=args.overlap, device=device,
            )  # fmt: skip
            # The same weights on every rank (each keeps its own experts), so a dense reference can
            # evaluate the whole layer in one process.
            weights = global_weights(case, env.world_size)
            layer.load_global_weights(**{k: None if v is None else v.to(device) for k, v in weights.items()})
            mine = layer_results(layer, x, grad_out)  # out = layer(x); out.backward(grad_out)
        everyone = all_gather_objects((x, grad_out), rt.cpu_group)
        want = dense_results(case, env.rank, [e[0] for e in everyone], [e[1] for e in everyone], device)
        on_gpu = device.type == "cuda"
        verdict = compare_results(mine, want, case.dtype, case.topk, exact=() if on_gpu else EXACT,
                                  rtol=gpu_rtol(case.dtype, case.topk) if on_gpu else None)  # fmt: skip
        padding = 0 if case.sync else cfg.capacity - want["live_rows"]
        line = (x.shape[0], want["live_rows"], padding, verdict["exact_ok"], verdict["worst_rel"],
                verdict["rtol"], verdict["passed"])
        ranks = all_gather_objects(line, rt.cpu_group)
    say(*legend(case, cfg, device, verdict["rtol"]))
    for r, (tokens, rows, pad, ex, worst, rtol, good) in enumerate(ranks):
        off = f"off by {worst:.3g} x its largest value (<= {rtol:.3g})"
        compared = (f"every quantity {off}" if on_gpu else
                    f"output and parameter gradients {'equal' if ex else 'DIFFER'}, input gradient {off}")
        say(f"[{args.backend}] rank {r}: {tokens} tokens, {rows} rows received + {pad} padding rows; "
            f"{compared}" + ("" if good else ", MISMATCH"))
    passed = all(r[-1] for r in ranks)
    return say.verdict(passed)


def legend(case: MoECase, cfg: EpConfig, device: Any, rtol: float) -> list[str]:
    """What each rank's line compares, with what and why within that tolerance, and what its padding rows
    are (validators/moe_checks.py has the details)."""
    dt = str(case.dtype).removeprefix("torch.")
    lines = ["Each rank's output and gradients against the same layer evaluated densely in torch, "
             "on every rank's tokens in one process:"]
    if device.type == "cuda":
        lines.append(f"  every quantity: largest difference <= {rtol:.3g} x its largest value; the grouped "
                     "GEMM and the reference's matmuls are different kernels, rounding in different orders")
    else:
        lines.append("  output and parameter gradients (experts, router, shared expert): equal, the same "
                     "arithmetic in the same order")
        lines.append(f"  input gradient: largest difference <= {rtol:.3g} x its largest value, (K + 2) x the "
                     f"epsilon of {dt} with K = --topk {case.topk}: the layer sums the K expert rows in fp32 "
                     f"and rounds once, autograd adds the K expert terms, the router's and the shared "
                     f"expert's one at a time, rounding each in {dt}")
    if not case.sync:
        impl = resolve_impl(case.swiglu, device)
        swiglu = f"--swiglu {case.swiglu}" + ("" if impl == case.swiglu else f": {impl}")
        what = "computes them too" if impl == "plain" else "skips them too"
        lines.append(f"  padding rows: rows of the worst-case receive buffer ({cfg.capacity} per rank) "
                     f"that no token filled; dispatch without a host sync (no --sync) hands the experts "
                     f"the whole buffer: the grouped GEMMs skip its padding rows, the SwiGLU ({swiglu}) "
                     f"{what}")
    return lines


def main(argv: list[str] | None = None) -> int:
    # A bad argument or configuration is one line `error: ...` and exit 2 before any rank starts.
    return script_main(argv, build_parser, validate_args, make_config, run, flags=FLAGS)


if __name__ == "__main__":
    raise SystemExit(main())
