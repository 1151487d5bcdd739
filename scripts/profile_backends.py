"""Profile the dispatch/combine backends for the shapes you run, and pick the fastest correct one.

To run (one process per GPU; every rank prints nothing but rank 0's tables):

    torchrun --nproc-per-node 4 scripts/profile_backends.py --tokens 128,4096 --cache ep_choices.json
    # anywhere, on CPUs (gloo): the torch reference against the all-to-all fallback
    torchrun --nproc-per-node 2 scripts/profile_backends.py --backends reference,a2a --tokens 8,16 \
        --hidden 128 --num-experts 16 --topk 2

The cute backend is one candidate per dispatch primitive (--cute-algorithms: "cute:dedup" sends a
row once per destination rank, "cute:per_pair" every (token, k) row, "cute:put_warp" every row with
put_warp), so the table also says which primitive to build ``EpBuffer(algorithm=...)`` with.
``--combine reduced`` builds every candidate for the reduced combine (all backends implement it bit
for bit alike); the profiler never switches between pull and reduced by itself, because their
results differ in the last bits: profile each and choose.

For each tokens-per-rank value, every backend runs the same inputs once to be checked bit for bit
against the first backend listed, then ``--warmup`` + ``--iters`` timed dispatch and combine calls
(the public calls, host work and syncs included); the slowest rank's median counts. A table per shape
shows each backend's times (or why it was excluded) and the choice: the least dispatch + combine
time. ``--cache`` keeps the choices per (device, world, local world, tokens, hidden, top-k, experts,
dtype) so a later run reuses them; ``--out-json`` writes every table's numbers.

Constraints: those of ``EpConfig`` (see README); ``cute`` needs GPUs with NVSHMEM; tokens per rank
<= 65536. Exit 0 when every shape has a backend that passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.inputs import MAX_TOKENS
from cute_ep.kernels.config import DISPATCH_ALGORITHMS, EpConfig
from cute_ep.profiler import ProfileCache, choose, format_table, profile
from cute_ep.tools.bench_report import parse_int_list, parse_name_list, script_parser
from cute_ep.tools.cli import (
    BACKENDS,
    DTYPES,
    EXIT_FAIL,
    EXIT_PASS,
    Printer,
    UsageError,
    add_combine_arg,
    config_from_args,
    make_buffer,
    runtime_backend,
    script_main,
    world_banner,
)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__, "See the module docstring (To run / Constraints).")
    p.add_argument("--backends", default="cute,a2a", help=f"comma list from {list(BACKENDS)}; the first "
                   "is the correctness reference for the others")
    p.add_argument("--tokens", default="128,4096", help="comma list of tokens per rank")
    p.add_argument("--hidden", type=int, default=7168, help="elements per row (H)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (K)")
    p.add_argument("--num-experts", type=int, default=256, help="experts in total (E)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="row element type")
    p.add_argument("--iters", type=int, default=10, help="timed calls per backend and shape")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before them")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--cute-algorithms", default="dedup,per_pair,put_warp",
                   help="the cute backend's dispatch primitives to time, each a candidate 'cute:NAME' "
                        f"(from {list(DISPATCH_ALGORITHMS)})")
    p.add_argument("--cache", metavar="PATH", help="JSON file of choices per shape (read, then updated)")
    p.add_argument("--out-json", metavar="PATH", help="write every shape's table here (rank 0)")
    p.add_argument("--local-world-size", type=int, default=None, help="ranks per (virtual) node")
    p.add_argument("--num-sms", type=int, default=None, help="CTAs of the cute kernels")
    p.add_argument("--timeout-s", type=float, default=None, help="longest wait for a peer (cute)")
    add_combine_arg(p)
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    try:
        args.backend_list = parse_name_list(args.backends, "--backends", BACKENDS)
        args.algorithm_list = parse_name_list(args.cute_algorithms, "--cute-algorithms", DISPATCH_ALGORITHMS)
        args.token_list = parse_int_list(args.tokens, "--tokens")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if max(args.token_list) > MAX_TOKENS:
        raise UsageError(f"--tokens values must be <= {MAX_TOKENS}, got {max(args.token_list)}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")


def make_config(args: argparse.Namespace, env: DistEnv) -> EpConfig:
    return config_from_args(args, env, max_tokens=max(args.token_list))


def _factories(args: argparse.Namespace, runtime: Runtime) -> dict[str, Any]:
    """name -> buffer factory; the cute buffers share one compiled-module registry (one compile)."""
    registry = None
    if "cute" in args.backend_list:
        from cute_ep.bootstrap.compile import ModuleRegistry

        registry = ModuleRegistry(device_id=runtime.device.index)
        runtime.add_finalizer(registry.finalize_all)

    def cute(algorithm: str) -> Any:
        from cute_ep.buffer import EpBuffer

        return lambda cfg: EpBuffer(runtime, cfg, registry=registry, algorithm=algorithm)

    factories: dict[str, Any] = {}
    for name in args.backend_list:
        if name == "cute":  # one candidate per dispatch primitive; the same combine kernel
            factories.update({f"cute:{a}": cute(a) for a in args.algorithm_list})
        else:
            factories[name] = lambda cfg, name=name: make_buffer(name, runtime, cfg)
    return factories


def run(args: argparse.Namespace, env: DistEnv, cfg: EpConfig) -> int:
    say = Printer(env.rank)
    # One Runtime serves every candidate: NVSHMEM (with NCCL) as soon as one of them needs it.
    gpu = any(runtime_backend(name) == "nvshmem" for name in args.backend_list)
    backend = "nvshmem" if gpu else "gloo"
    with Runtime(env, symmetric_bytes=cfg.symmetric_bytes() if gpu else 0, backend=backend) as runtime:
        say(world_banner("profile_backends", ",".join(args.backend_list), env, cfg, runtime=backend),
            f"shapes: tokens/rank {args.token_list}, hidden {cfg.hidden}, top-k {cfg.topk}, experts "
            f"{cfg.num_experts}, {args.dtype}; {args.warmup} warm-up + {args.iters} timed calls")
        factories = _factories(args, runtime)
        cache = ProfileCache(args.cache) if args.cache else None
        tables, code = [], EXIT_PASS
        for tokens in args.token_list:
            common = dict(iters=args.iters, warmup=args.warmup, seed=args.seed)
            if cache is not None:
                name, buf = choose(runtime, cfg, factories, tokens=tokens, cache=cache, say=say, **common)
                buf.close()
                tables.append({"tokens": tokens, "winner": name})
                continue
            result = profile(runtime, cfg, factories, tokens=tokens, **common)
            say(format_table(result))
            tables.append({"tokens": tokens, **result.to_json()})
            if result.winner is None:
                code = EXIT_FAIL
        if args.out_json and env.rank == 0:
            Path(args.out_json).write_text(json.dumps(tables, indent=1) + "\n")
            say(f"written to {args.out_json}")
        runtime.barrier()
    return code


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, build_parser, validate_args, make_config, run)


if __name__ == "__main__":
    raise SystemExit(main())
