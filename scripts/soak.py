"""Soak test of cute-ep: many back-to-back dispatch + combine rounds, each checked bit for bit.

Every iteration draws fresh inputs (a ragged token count per rank, 0 and the maximum included, and a
routing from --routings), dispatches them, applies the test expert (y = x * (expert + 1)) to the
received rows, combines them back and checks the layout, the dispatch (exactly: in order in scatter
mode) and the combine (bit-identical to the reference) with :mod:`cute_ep.validators.checks`. With
--layouts expert,rank the iterations alternate receive layouts too (see "Rank layout" below). The
receive buffers are poisoned once at the start and NEVER re-zeroed or re-poisoned in between, so
stale rows of an earlier iteration cannot hide a missing write. Before each dispatch and each combine
call a rank may straggle: with probability --straggler-prob it sleeps up to --max-straggle-us (backend
cute: a ``torch.cuda._sleep`` kernel enqueued on the stream; backend reference: ``time.sleep``).

To run:
    # 4 GPUs of one host (backend "cute": the CuTe DSL kernels on NVSHMEM), 1000 iterations
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 scripts/soak.py --max-tokens 128 --hidden 256 --num-experts 32 --topk 4

    # the same flow on the CPU (gloo, pure-torch references; no GPU needed), a short soak for CI
    torchrun --nproc-per-node 4 scripts/soak.py --backend reference --iters 50 --max-tokens 16 \\
        --hidden 64 --num-experts 16 --topk 4

    # one host split into 2 virtual nodes of 2 ranks, so that all four route classes occur
    torchrun --nproc-per-node 4 scripts/soak.py ... --local-world-size 2

    # several nodes under SLURM
    srun --ntasks-per-node 4 python scripts/soak.py ...

    # both receive layouts, alternating: every rank-layout iteration checked bit for bit as well
    torchrun --nproc-per-node 4 scripts/soak.py ... --layouts expert,rank

    # FP8 dispatch and experts capped at 0.75x their share: drops counted and checked every iteration
    torchrun --nproc-per-node 4 scripts/soak.py ... --hidden 256 --fp8 --capacity-factor 0.75

    # FP8 dispatch in both receive layouts (no capacity factor: the rank layout has none)
    torchrun --nproc-per-node 4 scripts/soak.py ... --hidden 256 --fp8 --layouts expert,rank

    # determinism: two runs with the same seed (and world size, sizes, dtype, modes, layouts, routings) print
    # the same digest, whatever the stragglers, the virtual nodes or the backend
    ... --seed 7 --out-json out/soak.json

Constraints:
    * --num-experts divisible by the world size; 1 <= --topk <= min(--num-experts, 64).
    * --hidden >= 4 and --hidden * element size a multiple of 16 bytes (8 bf16/fp16, 4 fp32).
    * 1 <= --max-tokens <= 65536 (the most tokens per rank, also the buffers' max_tokens);
      world size * max tokens * topk < 2**31. --iters >= 1; --seed >= 0.
    * 0 <= --straggler-prob <= 1; --max-straggle-us >= 0 (backend cute: cycles at ~1.5 GHz, so the
      real delay scales with the SM clock); --timeout-s in [0.001, 2147483] (the kernels' bounded
      waits, EpConfig.timeout_s): keep it well above --max-straggle-us.
    * --local-world-size (or CUTE_EP_LOCAL_WORLD_SIZE) divides the ranks per host; every host runs
      the same number of ranks, numbered host by host (torchrun, srun's block distribution).
    * --layouts with rank: --capacity-factor 0 (the rank layout has no expert capacity; --fp8 works in
      both layouts); backend cute: 2 * --num-experts + world size <= 12288 (the layout kernel's shared
      memory).
    * backend cute: one GPU per rank, NVSHMEM (keep NVLink multicast off: NCCL_NVLS_ENABLE=0
      TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1).

Iteration i uses mode --modes[i % len(modes)] (the modes alternate), layout
--layouts[(i // len(modes)) % len(layouts)] (every layout meets every mode) and, with --routing-order
cycle, routing --routings[(i // (len(modes) * len(layouts))) % len(routings)] (every routing meets
every mode and layout; with one layout, the plan of a soak before --layouts); with random, a routing
drawn from (--seed, i). Inputs are a function of (--seed, i, rank) only: make_inputs with a
seed derived from (--seed, i), token counts drawn per (--seed, i, rank) (0 with probability 5%, the
maximum with 5%, else uniform in [0, max]). The stragglers use their own generator per (--seed, rank).

A failed iteration is counted and the soak goes on (rank 0 prints the first --show-failures failures
with every failing rank's message); an exception (e.g. ``PeerTimeout``, a peer that never arrived)
stops it at once: every rank prints its error, rank 0 a partial summary, and the exit status is 1.
Wrong rows are counted only in a failed check (a passed check means every row is bit-identical):
dispatch, received slots that do not hold their expected row, weight and source tag (in atomic mode,
anywhere inside their (local expert, source) group) plus missing or extra rows; combine, output
tokens whose row differs in any bit from the reference combine of the expert outputs.

Rank layout (--layouts ... rank): the iteration dispatches with layout="rank" (in either mode: its
rows have one order), checks every received field exactly (recv_x, recv_topk_idx, recv_topk_weights,
recv_src row by row, num_recv, tokens_per_expert and the handle's rows) against
cute_ep.reference.reference_dispatch_rank_layout of every rank's inputs (each rank recomputes them from
the seeds instead of gathering them), builds the caller's per-row output (y = x * the sum over the
row's local experts e of weight * (e + 1), in fp32, rounded once to the row dtype), combines it and
checks the output bit for bit against reference_combine_rank_layout of every rank's y
(validators.checks.check_rank_dispatch / check_rank_combine). --combine reduced applies to the expert
iterations only; the rank combine has no algorithm to choose. A wrong dispatch row there is a received
row that differs from its expected row in any bit of any field, plus missing or extra rows; the
layout failures count the expert iterations' layout check (the rank layout's counts and handle are
part of its dispatch check). With --fp8 the rank-layout rows are compared as packed rows too
(check_rank_dispatch(..., fp8=True): the received e4m3 values and scales packed again, byte for byte,
against every sender's rows quantized by cute_ep.fp8), and the caller's output is computed from the
dequantized rows (cast to the row dtype), as the expert iterations' test expert is.

With --capacity-factor every check runs on the routing left after the drops, and a "capacity" check
compares the buffer's per-expert drop counts (and, in scatter mode, exactly which pairs were dropped;
in atomic mode how many per (expert, source)) with cute_ep.capacity. With --fp8 the received rows
are compared as packed rows (e4m3 values, fp32 scales, padding) with the senders' rows quantized by
cute_ep.fp8, and the test expert runs on the dequantized rows.

Digest: SHA-256 over every scatter-mode iteration, per rank, of (iteration, tokens, rows received),
recv_x[:num_recv] (the packed rows with --fp8), recv_weights, recv_src, tokens_per_expert and the
combine output (raw bytes; a rank-layout iteration: recv_x, with --fp8 recv_scales, recv_topk_idx,
recv_topk_weights, recv_src, tokens_per_expert and the combine output), then
over the ranks' digests in rank order. It depends only on the data, so equal inputs give equal digests
on any backend (the GPU kernels must match the references bit for bit) and topology.

Output on rank 0: the configuration, a progress line every --report-every iterations, the first
failures, then a summary (iterations, failed iterations, layout failures, wrong dispatch rows, wrong
combine rows, with --layouts other than expert alone the same counts per layout, straggles injected,
route-class pairs, digest, time) and PASS or FAIL; with --out-json the summary as JSON (also after an
error, with what rank 0 knew; "per_layout" holds each layout's iterations, failed iterations, wrong
dispatch and combine rows, rows received and tokens combined).

Exit status: 0 every iteration passed, 1 a failed iteration or a run-time error, 2 invalid arguments or
a launch error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from cute_ep._version import git_sha, package_versions
from cute_ep.api import LAYOUTS
from cute_ep.bootstrap.dist_env import ROUTE_CLASSES, DistEnv, possible_route_classes
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.fp8 import dequantize_fp8, fp8_check_rows
from cute_ep.inputs import ROUTINGS, make_inputs
from cute_ep.kernels.config import LAYOUT_SMEM_INTS, MODES, EpConfig
from cute_ep.reference import (
    COMBINE_REFERENCES,
    reference_dispatch_rank,
    reference_layout,
)
from cute_ep.tools import bench_report as br
from cute_ep.tools.cli import (
    EXIT_FAIL,
    Printer,
    UsageError,
    add_combine_arg,
    add_fp8_capacity_args,
    add_launch_args,
    add_shape_args,
    all_gather,
    check_fp8_capacity_args,
    check_run_args,
    config_from_args,
    fill_expert_output,
    run_buffer,
    runtime_backend,
    script_main,
    world_banner,
)
from cute_ep.validators.checks import (
    CheckResult,
    check_capacity_drops,
    check_combine,
    check_dispatch,
    check_layout,
    check_rank_combine,
    check_rank_dispatch,
    report,
)

MODE_CHOICES = tuple(MODES)
LAYOUT_CHOICES = tuple(LAYOUTS)  # ("expert", "rank")
ROUTING_ORDERS = ("cycle", "random")
CYCLES_PER_US = 1500  # torch.cuda._sleep counts SM clock cycles: ~1.5 GHz assumed
ZERO_TOKENS_P = 0.05  # share of (iteration, rank) draws with no token at all
FULL_TOKENS_P = 0.05  # ... and with exactly --max-tokens
MAX_FAILURE_RECORDS = 100  # failures kept for --out-json
# Salts keep the generators of (seed, iteration) apart.
_SALT_INPUTS, _SALT_TOKENS, _SALT_ROUTING, _SALT_STRAGGLE = 0x1A, 0x2B, 0x3C, 0x4D


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / Constraints) for examples.")
    p.add_argument("--iters", type=int, default=1000, help="dispatch + combine iterations")
    p.add_argument(
        "--max-tokens", type=int, default=128,
        help="most tokens per rank (also the buffers' max_tokens); each iteration draws [0, max] per rank",
    )  # fmt: skip
    add_shape_args(p, topk=4)
    p.add_argument("--modes", default="scatter,atomic", help="comma-separated dispatch modes, alternated")
    p.add_argument(
        "--layouts", default="expert",
        help=f"comma-separated receive layouts of {LAYOUT_CHOICES}, alternated (every layout meets every "
             "mode); rank: dispatch(layout='rank') checked field by field against "
             "reference_dispatch_rank_layout, the caller's per-row outputs combined and checked against "
             "reference_combine_rank_layout (with --fp8 too); rank needs --capacity-factor 0",
    )  # fmt: skip
    p.add_argument("--routings", default=",".join(ROUTINGS), help=f"comma-separated routings of {ROUTINGS}")
    p.add_argument(
        "--routing-order", choices=ROUTING_ORDERS, default="cycle",
        help="cycle through --routings, or draw one per iteration from the seed",
    )  # fmt: skip
    p.add_argument(
        "--straggler-prob", type=float, default=0.3, help="chance that a rank sleeps before a call"
    )
    p.add_argument("--max-straggle-us", type=float, default=2000.0, help="longest such sleep (microseconds)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs, token counts and stragglers")
    p.add_argument(
        "--timeout-s", type=float, default=None, help="longest wait for a peer, EpConfig.timeout_s (60)"
    )
    add_launch_args(p)
    p.add_argument("--num-sms", type=int, default=None, help="CTAs of dispatch/combine (EpConfig default)")
    add_fp8_capacity_args(p)
    add_combine_arg(p, note="With --layouts: expert-layout iterations only (rank-layout iterations use "
                            "the rank layout's own combine, which has no algorithm to choose)")
    p.add_argument(
        "--report-every", type=int, default=100, help="a progress line every K iterations (0: none)"
    )
    p.add_argument("--show-failures", type=int, default=5, help="failed iterations printed in full")
    p.add_argument("--out-json", metavar="PATH", help="write the summary (rank 0) to this JSON file")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Checks that do not depend on the launch; raise UsageError naming the argument."""
    try:
        args.mode_list = br.parse_name_list(args.modes, "--modes", MODE_CHOICES)
        args.routing_list = br.parse_name_list(args.routings, "--routings", ROUTINGS)
        args.layout_list = br.parse_name_list(args.layouts, "--layouts", LAYOUT_CHOICES)
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None
    check_run_args(args, "--max-tokens", args.max_tokens)
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if not 0.0 <= args.straggler_prob <= 1.0:
        raise UsageError(f"--straggler-prob must be in [0, 1], got {args.straggler_prob}")
    if not (math.isfinite(args.max_straggle_us) and args.max_straggle_us >= 0):
        raise UsageError(f"--max-straggle-us must be a finite number >= 0, got {args.max_straggle_us}")
    check_fp8_capacity_args(args)
    check_rank_layout_args(args)
    if args.report_every < 0 or args.show_failures < 0:
        raise UsageError(
            f"--report-every and --show-failures must be >= 0, got {args.report_every}, {args.show_failures}"
        )
    if args.out_json:  # rank 0 writes it after the run, when a write error could no longer stop the soak
        try:
            br.check_writable("--out-json", args.out_json)
        except br.BenchReportError as exc:
            raise UsageError(str(exc)) from None


def check_rank_layout_args(args: argparse.Namespace) -> None:
    """UsageError for --layouts with rank and an option the rank layout does not have (a capacity
    factor): refused before the launch rather than by the first rank-layout dispatch. (--fp8 works in
    both layouts.)"""
    if "rank" in args.layout_list and args.capacity_factor:
        raise UsageError(
            f"--layouts {args.layouts!r} includes rank, which needs --capacity-factor 0 (the rank layout "
            f"has no expert capacity), got --capacity-factor {args.capacity_factor:g}"
        )


def make_config(args: argparse.Namespace, env: DistEnv) -> EpConfig:
    cfg = config_from_args(args, env, max_tokens=args.max_tokens)
    # The GPU layout kernel keeps per-warp expert and rank counts in shared memory for the rank layout.
    rank_ints = 2 * cfg.num_experts + cfg.world_size
    if args.backend == "cute" and "rank" in args.layout_list and rank_ints > LAYOUT_SMEM_INTS:
        raise UsageError(
            f"--layouts rank needs 2 * --num-experts + world size <= {LAYOUT_SMEM_INTS} on backend cute, "
            f"got {rank_ints}"
        )
    return cfg


# --------------------------------------------------------------------------------------------------
# the plan: a function of (seed, iteration, rank) only, so two runs with one seed see the same inputs
# --------------------------------------------------------------------------------------------------


def input_seed(seed: int, it: int) -> int:
    """The make_inputs seed of iteration ``it`` (32 bits: make_inputs keeps the low 32)."""
    return int(np.random.SeedSequence([seed, it, _SALT_INPUTS]).generate_state(1, dtype=np.uint32)[0])


def tokens_of(seed: int, it: int, rank: int, max_tokens: int) -> int:
    """Tokens of ``rank`` in iteration ``it``: 0 or max_tokens 5% of the time each, else uniform."""
    rng = np.random.default_rng([seed, it, rank, _SALT_TOKENS])
    u = rng.random()
    if u < ZERO_TOKENS_P:
        return 0
    if u < ZERO_TOKENS_P + FULL_TOKENS_P:
        return max_tokens
    return int(rng.integers(0, max_tokens + 1))


def mode_of(args: argparse.Namespace, it: int) -> str:
    return args.mode_list[it % len(args.mode_list)]


def layout_of(args: argparse.Namespace, it: int) -> str:
    """The receive layout of iteration ``it``: it changes after a full round of modes, so that every
    layout meets every mode (with one layout: always it)."""
    return args.layout_list[(it // len(args.mode_list)) % len(args.layout_list)]


def routing_of(args: argparse.Namespace, it: int) -> str:
    routings = args.routing_list
    if args.routing_order == "random":
        return routings[int(np.random.default_rng([args.seed, it, _SALT_ROUTING]).integers(len(routings)))]
    # After a full round of (mode, layout): with one layout, the plan of a soak without --layouts.
    return routings[(it // (len(args.mode_list) * len(args.layout_list))) % len(routings)]


class Straggler:
    """Random delays of one rank before its calls (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, rank: int, gpu: bool) -> None:
        self.prob = args.straggler_prob
        self.max_us = args.max_straggle_us
        self.gpu = gpu
        self.rng = np.random.default_rng([args.seed, rank, _SALT_STRAGGLE])
        self.count = 0
        self.total_us = 0.0

    def maybe(self) -> None:
        """With probability ``prob``, delay this rank's next call by U(0, max_us) microseconds."""
        if self.prob <= 0 or self.rng.random() >= self.prob:
            return
        us = float(self.rng.uniform(0.0, self.max_us))
        self.count += 1
        self.total_us += us
        if self.gpu:
            torch.cuda._sleep(int(us * CYCLES_PER_US))  # on the current stream, before the call's kernels
        else:
            time.sleep(us * 1e-6)


# --------------------------------------------------------------------------------------------------
# digest and wrong-row counts
# --------------------------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes (C order), from any device and dtype (bf16 included)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def row_bits(t: torch.Tensor) -> torch.Tensor:
    """[N, bytes per row] uint8 view of a CPU tensor's rows (compares NaN and -0.0 by their bits)."""
    t = t.detach().contiguous().cpu()
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _wrong_dispatch_rows_local(
    gathered: list[tuple], res: Any, cfg: EpConfig, rank: int, ordered: bool
) -> int:
    """Rows of this rank's dispatch result that are not their expected row (see the docstring)."""
    xs, idxs, ws = ([g[i] for g in gathered] for i in range(3))
    layout = reference_layout(idxs, cfg.num_experts)
    exp = reference_dispatch_rank(xs, idxs, ws, layout, cfg.max_tokens, rank)
    n, got = exp.num_recv, int(res.num_recv)
    if n == 0:
        return got
    m = min(n, got)
    g_src = res.recv_src[:m].detach().cpu().to(torch.int64)
    e_src = exp.recv_src.to(torch.int64)
    order = torch.argsort(e_src)
    pos = torch.searchsorted(e_src[order], g_src).clamp(max=n - 1)
    j = order[pos]  # the expected slot holding the tag found in each received slot
    ok = e_src[j] == g_src
    slots = torch.arange(m)
    if ordered:
        ok &= j == slots
    else:  # atomic: anywhere inside its (local expert, source) group
        sizes = layout.group_sizes(rank)
        group = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
        ok &= group[j] == group[slots]
    ok &= (row_bits(res.recv_x[:m]) == row_bits(exp.recv_x)[j]).all(dim=1)
    ok &= (row_bits(res.recv_weights[:m].reshape(m, 1)) == row_bits(exp.recv_w.reshape(n, 1))[j]).all(dim=1)
    right = int(torch.unique(j[ok]).numel())  # a row received twice counts once
    return max(n, got) - right


def wrong_dispatch_rows(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    res: Any,
    cfg: EpConfig,
    rank: int,
    ordered: bool,
    group: Any,
) -> int:
    """Wrong received rows summed over all ranks (collective: call it on every rank)."""
    gathered = all_gather((x.detach().cpu(), idx.detach().cpu(), w.detach().cpu()), group)
    try:
        local = _wrong_dispatch_rows_local(gathered, res, cfg, rank, ordered)
    except Exception:  # unreadable results: every received row is wrong (at least one)
        local = max(int(res.num_recv), 1)
    return sum(all_gather(local, group))


def wrong_combine_rows(
    out: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    scatter: torch.Tensor,
    cfg: EpConfig,
    rank: int,
    group: Any,
) -> int:
    """Output tokens differing from the reference combine of every rank's y, summed over all ranks
    (collective). The slots are the handle's, as in check_combine."""
    ys = all_gather(y.detach().cpu(), group)
    try:
        routing = [idx.detach().cpu()], [w.detach().cpu()], [scatter.detach().cpu()]
        exp = COMBINE_REFERENCES[cfg.combine_algorithm](ys, *routing, num_experts=cfg.num_experts)[0]
        if tuple(out.shape) != tuple(exp.shape) or out.dtype != exp.dtype:
            raise ValueError("shape")
        local = int((row_bits(out) != row_bits(exp)).any(dim=1).sum()) if exp.shape[0] else 0
    except Exception:
        local = max(int(idx.shape[0]), 1)
    return sum(all_gather(local, group))


# --------------------------------------------------------------------------------------------------
# the soak
# --------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One iteration's checks and counts (the wrong-row counts summed over all ranks)."""

    checks: dict[str, CheckResult]
    wrong_dispatch_rows: int
    wrong_combine_rows: int
    num_recv: int  # this rank's

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.checks.values())


@dataclass
class LayoutTotals:
    """The counts of the iterations of one receive layout (in :class:`Totals`, of every layout)."""

    iterations: int = 0
    failed: int = 0
    wrong_dispatch_rows: int = 0
    wrong_combine_rows: int = 0
    rows_received: int = 0  # this rank's
    tokens: int = 0  # this rank's

    def count(self, o: Outcome, num_tokens: int) -> None:
        """Add one iteration of ``num_tokens`` tokens on this rank."""
        self.iterations += 1
        self.failed += not o.passed
        self.wrong_dispatch_rows += o.wrong_dispatch_rows
        self.wrong_combine_rows += o.wrong_combine_rows
        self.rows_received += o.num_recv
        self.tokens += num_tokens


@dataclass
class Totals(LayoutTotals):
    """What the soak counted so far (the counts of checks are the same on every rank): the counts of
    :class:`LayoutTotals` over every layout, and these."""

    layout_failures: int = 0
    scatter_iterations: int = 0
    call_s: float = 0.0  # this rank's host time in dispatch + combine (straggles included)
    rows_dropped: int = 0  # beyond expert capacity, all ranks (every rank counts every drop)
    route_pairs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROUTE_CLASSES, 0))
    failures: list[dict[str, Any]] = field(default_factory=list)
    by_layout: dict[str, LayoutTotals] = field(default_factory=dict)  # per --layouts entry


def rank_expert_output(res: Any, rank: int, experts_per_rank: int,
                       rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """The caller's per-row output of a rank-layout dispatch: the test expert (x * (e + 1)) of every
    local expert e a row names, weighted and summed, i.e. ``y[i] = x[i] * s[i]`` with ``s[i]`` the sum
    over k ascending of ``recv_topk_weights[i, k] * (e + 1)`` (fp32), cast to x's dtype once. x: ``rows``
    (after an FP8 dispatch, ``dequantized_rows``), else ``res.recv_x``.

    Depending on recv_topk_idx and the weights, a wrong id or weight also shows in the combine. Explicit
    elementwise fp32 ops in a fixed order, so every device computes the same bits (the digest covers
    the combine output). None if the result's fields cannot hold the rows (a failed dispatch check).
    """
    n = int(res.num_recv)
    x, ids, w = res.recv_x if rows is None else rows, res.recv_topk_idx, res.recv_topk_weights
    if ids is None or w is None or ids.dim() != 2 or w.shape != ids.shape:
        return None
    if min(x.shape[0], ids.shape[0]) < n:
        return None
    x, ids, w = x[:n], ids[:n].to(torch.int64), w[:n]
    scale = torch.zeros(n, dtype=torch.float32, device=x.device)
    for k in range(ids.shape[1]):
        term = w[:, k] * (ids[:, k] + (rank * experts_per_rank + 1)).to(torch.float32)
        scale = scale + torch.where(ids[:, k] >= 0, term, torch.zeros_like(term))
    return (x.float() * scale[:, None]).to(x.dtype)


def dequantized_rows(res: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The rows the experts read after an FP8 dispatch: recv_x * recv_scales block by block
    (``cute_ep.fp8.dequantize_fp8`` on the CPU, as ``fp8_check_rows`` gives the expert iterations), cast
    to ``dtype``, on ``device``. None if recv_x / recv_scales cannot be read so (a failed dispatch check)."""
    try:
        rows = dequantize_fp8(res.recv_x.cpu(), res.recv_scales.cpu())
    except (AttributeError, ValueError):
        return None
    return rows.to(dtype).to(device)


class Soak:
    def __init__(self, buffer: Any, args: argparse.Namespace, cfg: EpConfig, runtime: Runtime) -> None:
        self.buffer, self.args, self.cfg, self.runtime = buffer, args, cfg, runtime
        self.env, self.group, self.device = runtime.env, runtime.cpu_group, runtime.device
        self.rank = self.env.rank
        self.say = Printer(self.rank)
        self.straggler = Straggler(args, self.rank, gpu=args.backend == "cute")
        self.digest = hashlib.sha256()
        self.totals = Totals(by_layout={name: LayoutTotals() for name in args.layout_list})
        self.current: tuple[int, str, str, str] | None = None  # (iteration, mode, routing, layout)
        self.wall_s = 0.0

    # -- one iteration -----------------------------------------------------------------------------

    def iteration(self, it: int) -> None:
        args, cfg, t = self.args, self.cfg, self.totals
        mode, layout, routing = mode_of(args, it), layout_of(args, it), routing_of(args, it)
        self.current = (it, mode, routing, layout)
        num_tokens = tokens_of(args.seed, it, self.rank, cfg.max_tokens)
        if layout == "rank":
            o = self.rank_iteration(it, mode, routing, num_tokens)
        else:
            o = self.expert_iteration(it, mode, routing, num_tokens)

        t.count(o, num_tokens)
        t.by_layout[layout].count(o, num_tokens)
        for c, n in o.checks["dispatch"].route_counts.items():
            t.route_pairs[c] = t.route_pairs.get(c, 0) + n
        t.layout_failures += "layout" in o.checks and not o.checks["layout"].passed
        if not o.passed:
            self.failure(it, mode, routing, layout, o)

    def expert_iteration(self, it: int, mode: str, routing: str, num_tokens: int) -> Outcome:
        """Dispatch (expert layout), the test expert, combine; every check (see the module docstring)."""
        args, cfg, group, rank, t = self.args, self.cfg, self.group, self.rank, self.totals
        x, idx, w = make_inputs(
            rank, num_tokens, cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype, input_seed(args.seed, it),
            routing=routing, device=self.device,
        )  # fmt: skip

        t0 = time.perf_counter()
        self.straggler.maybe()
        res = self.buffer.dispatch(x, idx, w, mode=mode, fp8=args.fp8)
        t.call_s += time.perf_counter() - t0
        checks: dict[str, CheckResult] = {}
        eff = idx  # the routing after capacity drops: what every check below compares against
        if cfg.capacity_factor:
            dropped = self.buffer.dropped_rows()
            checks["capacity"], eff = check_capacity_drops(
                idx, res.handle.scatter, dropped, num_experts=cfg.num_experts,
                expert_capacity=cfg.expert_capacity, ordered=(mode == "scatter"), group=group,
            )  # fmt: skip
            t.rows_dropped += int(dropped.sum())
        rows, got, expert_in = x, res, res.recv_x
        if args.fp8:  # what travels: packed rows (e4m3 values, fp32 scales, padding)
            rows, packed, expert_in = fp8_check_rows(x, res.recv_x, res.recv_scales, cfg.fp8_row_bytes)
            got = SimpleNamespace(recv_x=packed, recv_weights=res.recv_weights, recv_src=res.recv_src,
                                  num_recv=res.num_recv)
            expert_in = expert_in.to(cfg.dtype).to(self.device)
        lay = check_layout(
            res, eff, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts,
            local_world_size=cfg.local_world_size, group=group,
        )  # fmt: skip
        disp = check_dispatch(
            rows, eff, w, got.recv_x, res.recv_weights, res.recv_src,
            max_tokens=cfg.max_tokens, num_experts=cfg.num_experts, local_world_size=cfg.local_world_size,
            ordered=(mode == "scatter"), require_coverage=False, group=group,
        )  # fmt: skip

        y = fill_expert_output(self.buffer, res, rank, expert_in)
        t0 = time.perf_counter()
        self.straggler.maybe()
        out = self.buffer.combine(y, res.handle)
        t.call_s += time.perf_counter() - t0
        comb = check_combine(
            out, eff, w, y, local_world_size=cfg.local_world_size, num_experts=cfg.num_experts,
            scatter=res.handle.scatter, require_coverage=False, group=group, algorithm=cfg.combine_algorithm,
        )  # fmt: skip

        # Every verdict is the same on every rank, so the collectives below are entered by all or none.
        ordered = mode == "scatter"
        bad_d = 0 if disp.passed else wrong_dispatch_rows(rows, eff, w, got, cfg, rank, ordered, group)
        bad_c = 0 if comb.passed else wrong_combine_rows(out, eff, w, y, res.handle.scatter, cfg, rank, group)
        if mode == "scatter":
            self.digest.update(struct.pack("<qqq", it, num_tokens, res.num_recv))
            received = got.recv_x[: res.num_recv]
            for tensor in (received, res.recv_weights, res.recv_src, res.tokens_per_expert, out):
                self.digest.update(raw_bytes(tensor))
            t.scatter_iterations += 1
        checks.update(layout=lay, dispatch=disp, combine=comb)
        return Outcome(checks, bad_d, bad_c, res.num_recv)

    def rank_iteration(self, it: int, mode: str, routing: str, num_tokens: int) -> Outcome:
        """Dispatch (rank layout), the caller's per-row outputs, the rank combine; both checked bit for
        bit against the torch references of every rank's inputs (see the module docstring)."""
        args, cfg, group, rank, t = self.args, self.cfg, self.group, self.rank, self.totals
        # Every rank's inputs, recomputed from the seeds (cheaper than gathering them; drawn on the CPU,
        # so this rank's are the same bits as make_inputs on its device).
        seed = input_seed(args.seed, it)
        inputs = [
            make_inputs(r, num_tokens if r == rank else tokens_of(args.seed, it, r, cfg.max_tokens),
                        cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype, seed, routing=routing)
            for r in range(cfg.world_size)
        ]  # fmt: skip
        xs, idxs, ws = ([v[i] for v in inputs] for i in range(3))
        x, idx, w = (v.to(self.device) for v in inputs[rank])

        t0 = time.perf_counter()
        self.straggler.maybe()
        res = self.buffer.dispatch(x, idx, w, mode=mode, fp8=args.fp8, layout="rank")
        t.call_s += time.perf_counter() - t0
        disp = check_rank_dispatch(
            res, xs, idxs, ws, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts,
            local_world_size=cfg.local_world_size, require_coverage=False, fp8=args.fp8, group=group,
        )  # fmt: skip

        y = self.buffer.expert_output(res.num_recv)
        expert_in = dequantized_rows(res, cfg.dtype, self.device) if args.fp8 else res.recv_x
        rows = None if expert_in is None else rank_expert_output(res, rank, cfg.experts_per_rank, expert_in)
        if rows is None:  # the dispatch check has failed already; give combine defined input
            y.fill_(float("nan"))
        else:
            y.copy_(rows)
        t0 = time.perf_counter()
        self.straggler.maybe()
        out = self.buffer.combine(y, res.handle)
        t.call_s += time.perf_counter() - t0
        # The caller's routing (not the handle's copy) with the handle's rows, which the dispatch
        # check compared with the reference's.
        comb = check_rank_combine(
            out, idx, res.handle.scatter, y, num_experts=cfg.num_experts,
            local_world_size=cfg.local_world_size, require_coverage=False, group=group,
        )  # fmt: skip

        # The verdicts are the same on every rank: the gathers below are entered by all or none.
        bad_d = 0 if disp.passed else sum(all_gather(disp.wrong_rows or 0, group))
        bad_c = 0 if comb.passed else sum(all_gather(comb.wrong_rows or 0, group))
        if mode == "scatter":
            n = res.num_recv
            self.digest.update(struct.pack("<qqq", it, num_tokens, n))
            fields = (res.recv_x, res.recv_scales, res.recv_topk_idx, res.recv_topk_weights, res.recv_src)
            for tensor in (*(f[:n] for f in fields if f is not None), res.tokens_per_expert, out):
                self.digest.update(raw_bytes(tensor))
            t.scatter_iterations += 1
        return Outcome({"dispatch": disp, "combine": comb}, bad_d, bad_c, res.num_recv)

    def failure(self, it: int, mode: str, routing: str, layout: str, o: Outcome) -> None:
        """Record a failed iteration; print the first --show-failures of them (collective)."""
        t, cfg, checks = self.totals, self.cfg, o.checks
        bad_d, bad_c = o.wrong_dispatch_rows, o.wrong_combine_rows
        tokens = [tokens_of(self.args.seed, it, r, cfg.max_tokens) for r in range(self.env.world_size)]
        failed = [name for name, r in checks.items() if not r.passed]
        if len(t.failures) < MAX_FAILURE_RECORDS:
            t.failures.append({
                "iteration": it, "mode": mode, "routing": routing, "tokens": tokens, "failed_checks": failed,
                "wrong_dispatch_rows": bad_d, "wrong_combine_rows": bad_c,
                "messages": {name: checks[name].message for name in failed},  # rank 0's view
                "layout": layout,
            })  # fmt: skip
        if t.failed > self.args.show_failures:
            return
        kind = mode if layout == "expert" else f"{mode}, rank layout"
        self.say(
            f"iteration {it} FAILED ({kind}, {routing}, tokens per rank {tokens}): "
            f"{bad_d} wrong dispatch rows, {bad_c} wrong combine rows"
        )
        tag = mode if layout == "expert" else f"{mode} rank-layout"
        for name in failed:  # report() gathers every failing rank's message: the same on every rank
            report(checks[name], f"  [{tag} #{it}] {name}", self.group, self.say)
        if t.failed == self.args.show_failures:
            self.say("  (later failures are counted, not printed: see --show-failures)")

    # -- the loop and the summary ------------------------------------------------------------------

    def loop(self) -> None:
        start = time.perf_counter()
        every = self.args.report_every
        for it in range(self.args.iters):
            self.iteration(it)
            self.wall_s = time.perf_counter() - start
            if every and (it + 1) % every == 0 and it + 1 < self.args.iters:
                t = self.totals
                self.say(
                    f"[{it + 1}/{self.args.iters}] failed iterations {t.failed}, wrong rows: dispatch "
                    f"{t.wrong_dispatch_rows}, combine {t.wrong_combine_rows}; "
                    f"{1e3 * self.wall_s / t.iterations:.2f} ms/iteration"
                )
        self.current = None

    def summary(self, per_rank: list[dict[str, Any]] | None, error: BaseException | None) -> dict[str, Any]:
        """The JSON summary. ``per_rank``: every rank's local counts (None after an error: rank 0's)."""
        args, cfg, t = self.args, self.cfg, self.totals
        ranks = per_rank if per_rank is not None else [self.local_counts()]
        digest = None
        if per_rank is not None and t.scatter_iterations:
            digest = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in per_rank)).hexdigest()
        n = max(t.iterations, 1)
        stopped_in = None
        if error is not None and self.current is not None:
            stopped_in = dict(zip(("iteration", "mode", "routing", "layout"), self.current, strict=True))
        return {
            "script": "scripts/soak.py",
            "passed": error is None and t.failed == 0 and t.iterations == args.iters,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "stopped_in": stopped_in,
            "backend": args.backend,
            "world_size": cfg.world_size,
            "local_world_size": cfg.local_world_size,
            "virtual_nodes": self.env.is_virtual,
            "config": {
                "iters": args.iters,
                "max_tokens": cfg.max_tokens,
                "hidden": cfg.hidden,
                "num_experts": cfg.num_experts,
                "topk": cfg.topk,
                "dtype": args.dtype,
                "modes": args.mode_list,
                "layouts": args.layout_list,
                "routings": args.routing_list,
                "routing_order": args.routing_order,
                "straggler_prob": args.straggler_prob,
                "max_straggle_us": args.max_straggle_us,
                "seed": args.seed,
                "timeout_s": cfg.timeout_s,
                "num_sms": cfg.num_sms,
                "fp8": args.fp8,
                "capacity_factor": cfg.capacity_factor,
                "expert_capacity": cfg.expert_capacity,
                "combine": cfg.combine_algorithm,
            },
            "iterations_run": t.iterations,
            "failed_iterations": t.failed,
            "layout_failures": t.layout_failures,
            "wrong_dispatch_rows": t.wrong_dispatch_rows,
            "wrong_combine_rows": t.wrong_combine_rows,
            "rows_dropped": t.rows_dropped,
            "rows_received": sum(r["rows_received"] for r in ranks),
            "tokens_combined": sum(r["tokens"] for r in ranks),
            "straggles": sum(r["straggles"] for r in ranks),
            "straggle_ms": sum(r["straggle_us"] for r in ranks) / 1e3,
            "route_pairs": dict(t.route_pairs),
            "per_layout": {
                name: {
                    "iterations": lt.iterations,
                    "failed_iterations": lt.failed,
                    "wrong_dispatch_rows": lt.wrong_dispatch_rows,
                    "wrong_combine_rows": lt.wrong_combine_rows,
                    "rows_received": sum(r["by_layout"][name]["rows_received"] for r in ranks),
                    "tokens_combined": sum(r["by_layout"][name]["tokens"] for r in ranks),
                }
                for name, lt in t.by_layout.items()
            },
            "digest": digest,
            "digest_iterations": t.scatter_iterations,
            "rank_digests": [r["digest"] for r in ranks] if per_rank is not None else None,
            "wall_s": self.wall_s,
            "mean_iteration_ms": 1e3 * self.wall_s / n,
            "mean_dispatch_combine_ms": 1e3 * t.call_s / n,
            "failures": t.failures,
            "command": sys.argv,
        }

    def local_counts(self) -> dict[str, Any]:
        t, s = self.totals, self.straggler
        by_layout = {
            name: {"rows_received": c.rows_received, "tokens": c.tokens} for name, c in t.by_layout.items()
        }
        return {
            "digest": self.digest.hexdigest(), "straggles": s.count, "straggle_us": s.total_us,
            "rows_received": t.rows_received, "tokens": t.tokens, "by_layout": by_layout,
        }  # fmt: skip

    def print_summary(self, s: dict[str, Any], partial: bool) -> None:
        cfg = self.cfg
        ranks = f"{cfg.world_size} rank{'s' if cfg.world_size > 1 else ''}"
        who = "rank 0's counts" if partial else ranks
        possible = possible_route_classes(cfg.world_size, cfg.local_world_size)
        missing = [c for c in possible if not s["route_pairs"][c]]
        digest = (
            f"{s['digest']} (sha256 over {s['digest_iterations']} scatter iterations, {ranks})"
            if s["digest"] else "none (" + ("stopped early" if partial else "no scatter iteration") + ")"
        )  # fmt: skip
        self.say(
            "soak summary" + (" (PARTIAL: stopped by an error)" if partial else ""),
            f"  iterations run: {s['iterations_run']} of {self.args.iters}",
            f"  failed iterations: {s['failed_iterations']} (layout failures: {s['layout_failures']})",
            f"  wrong dispatch rows: {s['wrong_dispatch_rows']} (of {s['rows_received']} rows received)",
            f"  wrong combine rows: {s['wrong_combine_rows']} (of {s['tokens_combined']} tokens combined)",
            *self.layout_lines(s),
            *([f"  rows dropped beyond expert capacity {cfg.expert_capacity}: {s['rows_dropped']}"]
              if cfg.capacity_factor else []),
            f"  straggles injected: {s['straggles']} ({s['straggle_ms']:.1f} ms in all, {who})",
            "  pairs: "
            + " ".join(f"{c}={s['route_pairs'][c]}" for c in ROUTE_CLASSES)
            + (f" [never exercised: {', '.join(missing)}]" if missing else ""),
            f"  digest: {digest}",
            f"  time: {s['wall_s']:.2f} s wall, {s['mean_iteration_ms']:.2f} ms/iteration "
            f"(in dispatch + combine {s['mean_dispatch_combine_ms']:.2f} ms/iteration, the rest is checking)",
        )

    def layout_lines(self, s: dict[str, Any]) -> list[str]:
        """The per-layout counts (none when only the expert layout ran: the totals above are its)."""
        if self.args.layout_list == ["expert"]:
            return []
        lines = []
        for name, c in s["per_layout"].items():
            lines.append(
                f"  {name} layout: {c['iterations']} iterations, {c['failed_iterations']} failed; "
                f"wrong rows: dispatch {c['wrong_dispatch_rows']} (of {c['rows_received']} received), "
                f"combine {c['wrong_combine_rows']} (of {c['tokens_combined']} tokens)"
            )
        return lines

    def finish(self) -> int:
        """Gather every rank's counts, print the summary, write the JSON; returns the exit status."""
        s = self.summary(all_gather(self.local_counts(), self.group), None)
        self.print_summary(s, partial=False)
        code = self.say.verdict(s["passed"])
        if self.rank == 0 and self.args.out_json and not self.write_json(s):
            code = EXIT_FAIL
        return code

    def stopped(self, exc: BaseException) -> None:
        """After an exception in the loop: no collective; rank 0 prints and writes what it knows."""
        if self.rank != 0:
            return
        where = ""
        if self.current is not None:
            it, mode, routing, layout = self.current
            where = f" in iteration {it} ({mode}, {routing}{', rank layout' if layout == 'rank' else ''})"
        self.say(f"soak stopped{where} by {type(exc).__name__} (see the error below)")
        s = self.summary(None, exc)
        self.print_summary(s, partial=True)
        self.say("FAIL")
        if self.args.out_json:
            self.write_json(s)

    def write_json(self, s: dict[str, Any]) -> bool:
        path = Path(self.args.out_json)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            provenance = {"git_sha": git_sha(), "versions": package_versions()}
            tmp.write_text(json.dumps({**s, **provenance}, indent=1, allow_nan=False) + "\n")
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            print(f"rank 0: error: cannot write {path}: {exc}", file=sys.stderr, flush=True)
            return False
        self.say(f"summary written to {path}")
        return True


def run(args: argparse.Namespace, env: DistEnv, cfg: EpConfig) -> int:
    say = Printer(env.rank)
    backend = runtime_backend(args.backend)
    with Runtime(env, symmetric_bytes=cfg.symmetric_bytes(), backend=backend) as runtime:
        gpu = args.backend == "cute"
        sleeper = f"torch.cuda._sleep at ~{CYCLES_PER_US / 1e3:g} GHz" if gpu else "time.sleep"
        # The default (expert layout only) names no layout: the banner of a soak before --layouts.
        layouts = f"layouts {','.join(args.layout_list)} (alternating), "
        layouts = "" if args.layout_list == ["expert"] else layouts
        say(
            world_banner("soak", args.backend, env, cfg),
            f"config: tokens/rank 0..{cfg.max_tokens} (ragged), hidden {cfg.hidden}, experts "
            f"{cfg.num_experts} ({cfg.experts_per_rank}/rank), topk {cfg.topk}, {args.dtype}, modes "
            f"{','.join(args.mode_list)} (alternating), {layouts}routings {','.join(args.routing_list)} "
            f"({args.routing_order}), seed {args.seed}, iters {args.iters}, timeout {cfg.timeout_s:g} s",
            f"stragglers: p={args.straggler_prob:g} per rank and call, up to {args.max_straggle_us:g} us "
            f"({sleeper})",
            "receive buffers poisoned once; never re-zeroed or re-poisoned between iterations",
        )

        def body(buffer: Any) -> int:
            buffer.poison()  # once; EpBuffer also poisons at construction
            runtime.barrier()
            soak = Soak(buffer, args, cfg, runtime)
            try:
                soak.loop()
            except Exception as exc:
                soak.stopped(exc)
                raise  # through the Runtime's `with`: no collective teardown after an error
            return soak.finish()

        return run_buffer(args.backend, runtime, cfg, body)


def main(argv: list[str] | None = None) -> int:
    return script_main(argv, build_parser, validate_args, make_config, run)


if __name__ == "__main__":
    raise SystemExit(main())
