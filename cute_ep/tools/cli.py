"""Helpers shared by the scripts in scripts/ (dispatch_and_combine.py, soak.py, benchmark.py) and the
quick start example.

Small collectives on the Runtime's CPU (gloo) group, rank-0 printing, the report of a failed check,
the expert of each received row, the arguments the launched scripts share, the buffer of a backend
and its run, the run's banner line, the exit statuses and the ``main`` every launched script shares,
the check that a backend can run on this machine, and the collective way out of a run after an error
every rank got alike. Usage errors are printed by ``cute_ep.tools.usage`` (re-exported here). Importing this
module imports torch: scripts that must answer ``--help`` without torch import it after parsing.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from cute_ep.collectives import all_gather_objects as all_gather
from cute_ep.collectives import broadcast_from_root as broadcast_from_rank0
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.tools.usage import (
    EXIT_USAGE,
    REPEAT_DELAY_S,
    UsageError,
    launch_rank,
    report_usage_error,
    write_stderr,
)

if TYPE_CHECKING:
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.kernels.config import EpConfig

__all__ = [
    "BACKENDS",
    "DTYPES",
    "EXIT_FAIL",
    "EXIT_PASS",
    "EXIT_USAGE",
    "UsageError",
    "Printer",
    "all_gather",
    "broadcast_from_rank0",
    "add_fp8_capacity_args",
    "add_launch_args",
    "add_shape_args",
    "check_backends_run_here",
    "check_fp8_capacity_args",
    "check_run_args",
    "config_from_args",
    "describe_rank",
    "exit_process",
    "expert_ids",
    "fill_expert_output",
    "in_flags",
    "launch_rank",
    "leave",
    "make_buffer",
    "print_run_error",
    "report_setup_error",
    "report_usage_error",
    "require_cuda",
    "run_buffer",
    "run_guarded",
    "runtime_backend",
    "script_main",
    "setup_errors",
    "world_banner",
]

EXIT_PASS, EXIT_FAIL = 0, 1
"""Exit statuses of the scripts: every check passed / a check failed or a run-time error (and
``EXIT_USAGE``, 2: bad usage, from ``cute_ep.tools.usage``)."""


def exit_process(code: int) -> None:
    """End a launched script with ``code`` after its run has finished (process groups destroyed, output
    written), skipping the interpreter's teardown.

    Still used only by the scripts that need GPUs (benchmark.py, kernel_times.py, decode_breakdown.py,
    status_read_ab.py): their exit on GPUs (NVSHMEM, NCCL, CUDA) has not been measured without it yet.

    Why it was added: some gloo launches aborted in the interpreter's exit after a complete, correct run
    (SIGABRT, "terminate called without an active exception", exit status -6): a gloo worker thread that
    frees a collective's tensors after the exit began takes the GIL and is ended (pytorch/pytorch PR
    #179291 describes it). ``Runtime.close`` now frees its process groups, which joins those threads
    first. Measured on a 2-core CPU machine with gloo's workers stalled 2 ms at every lock
    (tests/_exit_checks.py), which makes the abort certain while a group outlives the run: the examples
    (quickstart, moe_layer, echo_training, deep_ep_drop_in) and scripts/dispatch_and_combine.py,
    profile_backends.py, soak.py, moe_layer_bench.py and echo_bench.py, reference backend, 1 or 2 ranks,
    all exit 0 without it (deep_ep_drop_in, which owns its group: 12 of 12 runs in both modes; with its
    ``destroy_process_group`` removed, 4 of 4 abort).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

BACKENDS = ("cute", "reference", "a2a")
"""--backend choices: the CuTe kernels on GPUs, the torch reference (CPU, gloo), or the
``all_to_all_single`` fallback (NCCL on GPUs, gloo on CPUs)."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The --dtype choices of the scripts and their torch dtypes."""


# --------------------------------------------------------------------------------------------------
# small collective helpers (the cpu group is gloo in both backends)
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# printing and reporting
# --------------------------------------------------------------------------------------------------


class Printer:
    """Prints on rank 0 only, flushed (torchrun interleaves the ranks' output)."""

    def __init__(self, rank: int) -> None:
        self.on = rank == 0

    def __call__(self, *lines: str) -> None:
        if self.on:
            for line in lines:
                print(line, flush=True)

    def verdict(self, passed: bool) -> int:
        """A checking script's last line, PASS or FAIL, and its exit status (EXIT_PASS / EXIT_FAIL)."""
        self("PASS" if passed else "FAIL")
        return EXIT_PASS if passed else EXIT_FAIL


def expert_ids(res: Any, rank: int) -> torch.Tensor | None:
    """Global expert of each received row, from the buffer's own tokens_per_expert (None if they disagree).

    ``res`` is a dispatch result (``tokens_per_expert`` [El] int32, ``num_recv`` int); the result is
    [num_recv] int64.
    """
    tpe = res.tokens_per_expert.to(torch.int64)
    if tpe.numel() == 0 or int(tpe.min()) < 0 or int(tpe.sum()) != res.num_recv:
        return None
    return global_expert_of_rows(tpe, rank)


def fill_expert_output(buffer: Any, res: Any, rank: int, rows: torch.Tensor) -> torch.Tensor:
    """The buffer's expert output for dispatch result ``res``, filled with the test expert
    (``cute_ep.reference.apply_test_expert``) of ``rows``, the received rows as the experts see them;
    NaN where the buffer's tokens_per_expert are unreadable (its layout check has failed already):
    combine gets defined input either way."""
    y = buffer.expert_output(res.num_recv)
    experts = expert_ids(res, rank)
    if experts is None:
        y.fill_(float("nan"))
    else:
        y.copy_(apply_test_expert(rows, experts.to(rows.device)))
    return y


# --------------------------------------------------------------------------------------------------
# the buffer of a backend, and the run's banner
# --------------------------------------------------------------------------------------------------


def runtime_backend(backend: str) -> str:
    """The Runtime backend a --backend needs: "gloo" for the reference, "nvshmem" for the kernels (its
    process group also carries NCCL), and for the all-to-all fallback whichever the machine has."""
    if backend == "a2a":
        return "nvshmem" if cuda_gpus() else "gloo"
    return "gloo" if backend == "reference" else "nvshmem"


def make_buffer(backend: str, runtime: Runtime, cfg: EpConfig) -> Any:
    """The GPU ``EpBuffer`` ("cute"), the ``A2aEpBuffer`` ("a2a") or the CPU ``ReferenceEpBuffer``
    ("reference") for ``cfg`` (collective; imported here so a reference run never imports the GPU stack)."""
    if backend == "cute":
        from cute_ep.buffer import EpBuffer

        return EpBuffer(runtime, cfg)
    if backend == "a2a":
        from cute_ep.a2a_backend import A2aEpBuffer

        return A2aEpBuffer(runtime, cfg)
    from cute_ep.reference_backend import ReferenceEpBuffer

    return ReferenceEpBuffer(runtime, cfg)


def run_buffer(backend: str, runtime: Runtime, cfg: EpConfig, body: Callable[[Any], int]) -> int:
    """Build the buffer of ``backend`` (``make_buffer``), return ``body(buffer)``'s exit status and close
    the buffer (collective). An exception from ``body`` leaves without closing it: it goes on through the
    Runtime's ``with``, so no collective teardown runs after an error that not every rank may have got."""
    buffer = make_buffer(backend, runtime, cfg)
    code = body(buffer)
    buffer.close()  # collective: every rank gets here unless an exception left the run
    return code


# --------------------------------------------------------------------------------------------------
# arguments shared by the launched scripts
# --------------------------------------------------------------------------------------------------


def add_shape_args(p: argparse.ArgumentParser, *, topk: int) -> None:
    """--hidden, --num-experts, --topk (default ``topk``) and --dtype, in this order: the shape of the
    buffers (``config_from_args``)."""
    p.add_argument("--hidden", type=int, default=256, help="elements per row (H)")
    p.add_argument(
        "--num-experts", type=int, default=32, help="experts in total (E), divisible by the world size"
    )
    p.add_argument("--topk", type=int, default=topk, help="experts per token (K)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="rows and combine output")


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """--local-world-size (virtual nodes; ``script_main`` reads it) and --backend (``BACKENDS``)."""
    from cute_ep.bootstrap.dist_env import LOCAL_WORLD_SIZE_OVERRIDE_VAR

    p.add_argument(
        "--local-world-size", type=int, default=None,
        help=f"ranks per (virtual) node; default ${LOCAL_WORLD_SIZE_OVERRIDE_VAR}, else the ranks per host",
    )  # fmt: skip
    p.add_argument("--backend", choices=BACKENDS, default="cute",
                   help="cute: GPU kernels; reference: torch on CPU; a2a: all_to_all_single fallback")


def check_run_args(args: argparse.Namespace, tokens_flag: str, tokens: int) -> None:
    """UsageError for --iters < 1, tokens per rank (``tokens``, given as ``tokens_flag``) outside [1,
    ``cute_ep.inputs.MAX_TOKENS``], or a --hidden too narrow for the columns that name the sender."""
    from cute_ep.inputs import MAX_TOKENS, SENDER_COLUMNS

    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise UsageError(f"{tokens_flag} must be in [1, {MAX_TOKENS}], got {tokens}")
    if args.hidden < SENDER_COLUMNS:
        raise UsageError(
            f"--hidden must be >= {SENDER_COLUMNS} (the first columns name the sender), got {args.hidden}"
        )


def add_fp8_capacity_args(p: argparse.ArgumentParser) -> None:
    """--fp8 and --capacity-factor, for the scripts that run checked dispatches (see
    ``check_fp8_capacity_args`` and ``config_from_args``)."""
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch: e4m3 rows, a scale per 128 columns")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="experts keep at most ceil(f * R * M * K / E) rows (M: max tokens per rank), "
                        "the rest are dropped (0: none)")


def add_combine_arg(p: argparse.ArgumentParser, note: str = "") -> None:
    """--combine: the combine algorithm the script's buffer uses (``EpConfig.combine_algorithm``);
    ``note``: a sentence the script appends to the help (e.g. where the option does not apply)."""
    p.add_argument("--combine", choices=("pull", "reduced"), default="pull",
                   help="pull: every (token, k) row to the token's rank, summed there (bit-identical to the "
                        "fixed-order reference); reduced: rows summed per rank first, one partial row per "
                        "(token, rank) moves (reference_combine_reduced)" + (f". {note}" if note else ""))


def check_fp8_capacity_args(args: argparse.Namespace) -> None:
    """UsageError for a --fp8 whose --hidden is not a multiple of 128, or a bad --capacity-factor (for the
    scripts that have those arguments)."""
    from cute_ep.kernels.buffers import FP8_BLOCK

    if getattr(args, "fp8", False) and args.hidden % FP8_BLOCK:
        raise UsageError(f"--fp8 needs --hidden to be a multiple of {FP8_BLOCK}, got {args.hidden}")
    cf = getattr(args, "capacity_factor", None)
    if cf is not None and not (math.isfinite(cf) and cf >= 0):
        raise UsageError(f"--capacity-factor must be a finite number >= 0, got {cf}")


def config_from_args(args: argparse.Namespace, env: DistEnv, max_tokens: int) -> EpConfig:
    """The ``EpConfig`` of a script's common arguments (--num-experts, --topk, --hidden, --dtype, and
    --num-sms / --timeout-s / --capacity-factor / --combine where the script has them and they are
    given) for the launch ``env``. A script with --capacity-factor reports drops itself: its buffers
    count them (on_overflow="drop") instead of raising."""
    from cute_ep.kernels.config import EpConfig

    extra: dict[str, Any] = {}
    for name in ("num_sms", "timeout_s", "capacity_factor"):
        if getattr(args, name, None) is not None:
            extra[name] = getattr(args, name)
    if extra.get("capacity_factor"):
        extra["on_overflow"] = "drop"
    combine = getattr(args, "combine_list", None) or getattr(args, "combine", None)
    if combine is not None:  # a script's --combine: one name, or a list whose members include "reduced"
        names = combine if isinstance(combine, (list, tuple)) else [combine]
        extra["combine_algorithm"] = "reduced" if "reduced" in names else "pull"
    return EpConfig(
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        num_experts=args.num_experts,
        topk=args.topk,
        hidden=args.hidden,
        dtype=DTYPES[args.dtype],
        max_tokens=max_tokens,
        **extra,
    )


def world_banner(script: str, backend: str, env: DistEnv, cfg: EpConfig, runtime: str | None = None) -> str:
    """First line a script prints: script, backend (and the Runtime's backend: ``runtime``, or the one
    ``backend`` needs), world = nodes x ranks per node, and the combine if it is not the default."""
    virtual = " (virtual nodes)" if env.is_virtual else ""
    via = runtime or runtime_backend(backend)
    return (
        f"cute-ep {script}: backend {backend} ({via}), world {env.world_size} = "
        f"{cfg.nnodes} node(s) x {cfg.local_world_size}{virtual}"
        + (", reduced combine" if cfg.combine_algorithm == "reduced" else "")
    )


def describe_rank(env: DistEnv, runtime: Any = None) -> str:
    """One line about this rank for a script's topology listing: rank, node, local index, and on a GPU
    runtime its GPU and the ranks that share it (``Runtime.placement``, e.g. "gpu 0 of 1, shared by 4
    ranks"); on a CPU one the processes per host (the local rank picks no device there)."""
    virtual = f" virtual nodes of {env.local_world_size}" if env.is_virtual else ""
    placement = getattr(runtime, "placement", None)
    where = (placement.describe() if placement is not None
             else f"({env.physical_local_world_size} processes/host)")
    return (
        f"rank {env.rank}/{env.world_size} node {env.node_id}/{env.nnodes} "
        f"local {env.local_index}/{env.local_world_size} {where}{virtual} {env.launcher} {env.init_method}"
    )


# --------------------------------------------------------------------------------------------------
# errors and the way out
# --------------------------------------------------------------------------------------------------


FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def in_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` (an ``EpConfig`` or ``RouterConfig`` error) in the words of a script's command line.

    ``flags`` maps a field to what sets it there: a flag ("max_tokens" -> "--tokens") or words
    ("world_size" -> "the world size"). Each field named in the message becomes its flag or words, and
    "field=value" becomes "--flag=value" or "words (value)": "num_experts must be divisible by
    world_size=3, got 16" -> "--experts must be divisible by the world size (3), got 16".
    """
    if not flags:
        return message
    names = "|".join(re.escape(name) for name in sorted(flags, key=len, reverse=True))

    def say(m: re.Match[str]) -> str:
        words, value = flags[m.group(1)], m.group(2)
        if value is None:
            return words
        return f"{words}={value}" if FLAG.fullmatch(words) else f"{words} ({value})"

    return re.sub(rf"\b({names})\b(?:=([^\s,;)\]]+))?", say, message)


def setup_errors() -> tuple[type[BaseException], ...]:
    """The errors of a script's setup (its arguments, its ``EpConfig``, the launch environment, a backend
    this machine cannot run) that end the run with ``report_setup_error`` before any collective."""
    from cute_ep.bootstrap.dist_env import DistEnvError
    from cute_ep.kernels.config import ConfigError

    return (UsageError, ConfigError, DistEnvError)


def report_setup_error(exc: BaseException) -> int:
    """Print one of ``setup_errors()`` as one line ``error: ...`` and return EXIT_USAGE.

    Arguments and configuration are checked alike on every rank (``report_usage_error``: rank 0 first);
    a launch environment error may differ per rank, so every rank prints its own at once, unless it is
    one every rank gets alike (``DistEnvError.alike``, e.g. a --local-world-size that does not divide
    the ranks per host): then rank 0's line is normally the only one.
    """
    from cute_ep.bootstrap.dist_env import DistEnvError

    alike = not isinstance(exc, DistEnvError) or getattr(exc, "alike", False)
    return report_usage_error(exc, alike=alike)


def require_cuda(what: str, instead: str = "") -> None:
    """UsageError unless torch sees a CUDA GPU: ``what`` needs one, ``instead`` (if any) is the way out on a
    CPU.

    Checked before a Runtime starts, so that a CPU machine gets one line instead of a traceback.
    """
    if not cuda_gpus():
        way_out = f"; {instead}" if instead else ""
        raise UsageError(f"{what} needs a CUDA GPU (torch sees none){way_out}")


def cuda_gpus() -> int:
    """The CUDA GPUs torch sees, counted without starting CUDA (NVML): a Runtime started later can then
    still give ranks that share a GPU their MPS thread percentage, which counts only when set before CUDA
    starts in the process."""
    return torch.cuda.device_count()


def check_backends_run_here(args: argparse.Namespace) -> None:
    """UsageError when a script's ``--backend`` (or ``--backends``, parsed into ``args.backend_list``)
    names the GPU kernels ("cute") and this machine has no CUDA GPU (the other backends run on CPUs)."""
    names = getattr(args, "backend_list", None)
    if names is not None:
        gpu = [n for n in names if runtime_backend(n) == "nvshmem"]
        if gpu:
            require_cuda(f"--backends {','.join(names)}: {gpu[0]}", "on a CPU use --backends reference,a2a")
        return
    backend = getattr(args, "backend", None)
    if backend is not None and runtime_backend(backend) == "nvshmem":
        require_cuda(f"--backend {backend}", "on a CPU use --backend reference")


def script_main(
    argv: list[str] | None,
    build_parser: Callable[[], argparse.ArgumentParser],
    validate_args: Callable[[argparse.Namespace], None],
    make_config: Callable[[argparse.Namespace, DistEnv], EpConfig],
    run: Callable[[argparse.Namespace, DistEnv, EpConfig], int],
    flags: Mapping[str, str] | None = None,
) -> int:
    """The ``main`` of a launched script: parse (bad syntax exits 2; with ``ScriptArgumentParser`` in one
    line), ``validate_args``, read the launch environment (``--local-world-size``, where the script has
    it, as the virtual-node override), ``make_config`` and check that the backend can run here
    (``check_backends_run_here``); any of ``setup_errors()`` exits 2 with one line (``report_setup_error``:
    printed by every rank, before any rank can exit silently). Then ``run`` and return its status. A bad
    heap size (checked when the Runtime starts, on every rank alike) exits 2 with one message; any other
    exception is printed by the rank that got it and exits 1 (``run_guarded``).

    ``flags``: the script's flags of the ``EpConfig`` fields, for ``in_flags``: a configuration error then
    names the flag the user gave ("--tokens must be >= 1, got 0") instead of the field."""
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.kernels.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        validate_args(args)
        env = DistEnv.from_environ(local_world_size=getattr(args, "local_world_size", None),
                                   local_world_size_name="--local-world-size")
        cfg = make_config(args, env)
        check_backends_run_here(args)
    except setup_errors() as exc:
        if flags and isinstance(exc, ConfigError):
            exc = UsageError(in_flags(str(exc), flags))
        return report_setup_error(exc)
    return run_guarded(run, args, env, cfg)


def run_guarded(
    run: Callable[[argparse.Namespace, DistEnv, EpConfig], int],
    args: argparse.Namespace,
    env: DistEnv,
    cfg: EpConfig,
) -> int:
    """``run(args, env, cfg)``'s status, with the scripts' handling of what escapes it: a bad heap size
    (the same on every rank) exits 2 with one line (``report_usage_error``); any other exception is
    printed by the rank that got it (``--traceback`` for the traceback) and exits 1."""
    from cute_ep.bootstrap.runtime import HeapConfigError

    try:
        return run(args, env, cfg)
    except HeapConfigError as exc:
        return report_usage_error(exc)
    except Exception as exc:
        print_run_error(env.rank, exc, getattr(args, "traceback", False))
        return EXIT_FAIL


def print_run_error(rank: int, exc: BaseException, show_traceback: bool) -> None:
    """Print a run-time error of this rank to stderr, with the traceback or a hint at --traceback.

    Call it from the ``except`` block that caught ``exc`` (the traceback is the one being handled).
    """
    if show_traceback:
        write_stderr(f"rank {rank}: error: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    else:  # both lines in one write: ranks failing together do not interleave them
        write_stderr(f"rank {rank}: error: {type(exc).__name__}: {exc}\n"
                     f"rank {rank}: (run with --traceback for the traceback)")


def leave(runtime: Runtime, exc: BaseException, code: int, *, meet: bool = True) -> int:
    """An error every rank got alike: print it once, meet the others, return ``code``.

    Returning (instead of raising through the Runtime's ``with``) keeps the teardown collective, so
    no rank tears its connections down under another that is still talking. Rank 0 prints before the
    meeting, so no rank exits before the line is out. Without the meeting (``meet=False``) the other
    ranks pause ``REPEAT_DELAY_S`` instead: a launcher stops every rank once one exits with an error
    status, and rank 0 must not be stopped before it has printed.
    """
    if runtime.env.rank == 0:
        write_stderr(f"error: {exc}")
    if meet:
        runtime.barrier()
    elif runtime.env.rank != 0:
        time.sleep(REPEAT_DELAY_S)
    return code
