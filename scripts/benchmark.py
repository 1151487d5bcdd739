"""Bandwidth sweep of cute-ep's dispatch and combine against NCCL all_to_all and DeepEP, on one or more GPUs.

To run (one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 4 scripts/benchmark.py \\
        --out-json baselines/perf/h200x4.json --out-png baselines/perf/h200x4.png

    # a quick look: fewer sizes, one routing
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 512,4096 --routing uniform --iters 20

    # FP8 dispatch as well (rows "scatter+fp8", "rank+fp8": packed e4m3 rows, NCCL moving the same packed
    # rows, DeepEP's FP8 dispatch with --peers deepep)
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 128,4096 --routing uniform --fp8

    # the reduced combine as well (rows "scatter+reduced")
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 128,4096 --routing uniform \\
        --combine pull,reduced

    # SM budgets side by side with DeepEP (when deep_ep imports; else its columns say why not)
    torchrun --nproc-per-node 2 scripts/benchmark.py --tokens 4096,8192 --routing uniform \
        --num-sms 24,48,132 --peers nccl,deepep --out-json r.json --out-png r.png

    # plot again from a saved report (CPU, no launch)
    python -c "from cute_ep.tools import bench_peers as p; p.plot_peers(p.load_results('r.json'), 'r.png')"

What is measured, for every SM budget (--num-sms), routing (--routing), tokens per rank T (--tokens)
and dispatch mode (--modes), with hidden H, top-k K, E experts (defaults: DeepSeek-V3's 7168, 8, 256) in
--dtype:
    * One Runtime, and per SM budget ONE EpBuffer sized for the largest T (``EpConfig.num_sms`` = the
      budget; every budget's buffer shares one compiled module), serve the sweep.
    * --input-sets deterministic input sets (cute_ep.inputs.make_inputs, seeds --seed + j) live on
      the GPU and are rotated across iterations, so that the caches do not flatter repeated inputs.
    * T <= --validate-max-tokens: first one bit-exact round on input set 0 (dispatch layout, rows,
      weights, tags; a non-identity test expert; combine), checked on every rank; a mismatch aborts.
    * dispatch: CUDA events around ``EpBuffer.launch_dispatch`` (the layout kernel, with its count
      exchange, AND the dispatch kernel: both are in the dispatch time). In the rank layout also the
      cached dispatch (row ``rank+cached``: ``EpBuffer.launch_cached_dispatch`` along the latest dispatch's
      routing, no layout; DeepEP's cached dispatch is its counterpart), checked first against a full
      dispatch of the same rows; its combine column repeats the rank row's.
    * combine: after one real dispatch per input set (for its handle), CUDA events around
      ``EpBuffer.launch_combine`` (the kernels read the handle's own [T, K] int32 slots in place). One
      more real combine checks afterwards that every timed launch ran.
    * NCCL (--peers nccl): ``torch.distributed.all_to_all_single`` on the default (NCCL) group moving
      exactly the same rows (this rank's rows grouped by destination rank, self included, built once
      outside the timed region; split sizes exchanged first); for combine the reverse direction. It
      takes no SM budget (measured again at each budget, in the same run).
    * DeepEP (--peers deepep; cute_ep.tools.bench_peers has the details): when ``import deep_ep`` works and
      the world suits its intranode kernels (2, 4 or 8 ranks on one host, bf16 rows), on the same input
      sets (topk_idx as int64), at DeepEP's SM budget for the row's (even, 128 for our 132; one Buffer
      per budget sized by its Config hints): its dispatch with a cached handle, its full call (layout +
      dispatch, host sync included), that dispatch followed by a torch expert-major permute (our receive
      layout), and its combine. Before timing, per input set: received rows = the routing's (token,
      rank) pairs, rows per local expert = the routing's, the cached dispatch repeats the full one bit
      for bit, and combine(dispatch(x)) = x times the token's destination ranks; a failed check or
      call leaves DeepEP out of that (routing, T) with the reason (the run goes on). Otherwise every
      row says why DeepEP was skipped (``deepep_skipped``).
    * Timing, the same for ours and every peer: --warmup untimed iterations, then the GPU is held by a short
      sleep kernel while the host enqueues --iters iterations (so the host's launch cost is not
      timed), each between two CUDA events on the current stream. No host barrier inside the loop:
      the kernels (and NCCL) synchronise the ranks, so an iteration's time is the op's steady-state
      time including waiting for the slowest peer. Per rank: the median; the report gives the
      slowest rank's median (min / max / every rank in the JSON).
    * Bandwidth (design.md, "Measuring"): pairs_off = this rank's non-dropped (t, k) pairs whose expert
      lives on another rank, rows_off = its distinct (t, destination rank) pairs among those (both
      means over the input sets). Algorithmic = pairs_off * H * b / time (GB/s = 1e9 B/s), from the
      mean pairs_off over ranks and the slowest rank's median; moved = bytes our kernels move
      (dispatch rows_off * H*b + 12 * pairs_off: each row once per destination rank, and per pair
      its weight, source tag and from-slot; combine pairs_off * H*b), means over ranks, and their
      percentage of the 450 GB/s NVLink4 line rate; NCCL GB/s with the algorithmic formula; ratio =
      NCCL time / our time (> 1: faster than NCCL).
    * --fp8: per mode, one more row "<mode>+fp8" (and "rank+fp8" with the rank layout): dispatch with
      ``fp8=True`` (quantized in the kernel, checked byte for byte) against NCCL moving the same rows
      packed the same way (cfg.fp8_row_bytes each: e4m3 values plus fp32 scales, quantized outside the
      timed region) and DeepEP's dispatches of FP8 input (its e4m3 values and per-128-column scales,
      quantized outside the timed region as cute_ep.fp8 quantizes: cached, full, with the permute;
      checked to receive those bytes); moved bytes and NCCL's rate use the packed size, the algorithmic
      bandwidth the input dtype's rows; combine is the mode's own (unchanged).
    * --combine pull,reduced: the buffer is built for the reduced combine (so every dispatch also records
      its group lists, and the dispatch times include that), and per mode one more row "<mode>+reduced"
      times ``launch_combine(..., "reduced")`` on the latest dispatch's handle (the expert ranks' group
      lists belong to it); its moved bytes are rows_off partial rows (one per off-rank (token, rank)
      group), its algorithmic bandwidth the pull formula's (pairs_off rows), as for NCCL. With the rank
      layout a row "rank+reduced" times its combine pushed (``EpBuffer.pushes``: the latest dispatch's
      handle) beside the row "rank", pulled (``launch_combine(..., "pull")``), both reading ``recv_y``.
      The row "rank+cached" (every run with the rank layout) is the cached dispatch described above;
      with --fp8 the row "rank+fp8+cached" is its FP8 form (``fp8=True`` along the latest FP8 dispatch's
      routing, checked first against a full FP8 dispatch of the same rows, packed rows byte for byte),
      beside DeepEP's cached FP8 dispatch.

    * Link rate (``dispatch_link_gbps``): the mean over ranks of rows_off x the row's bytes, over the
      slowest rank's median dispatch time (bytes that cross the link once per destination rank; no
      metadata); ``deepep_dispatch_link_gbps`` the same bytes over DeepEP's cached dispatch.

Output on rank 0: a table, one line per (num_sms, routing, T, mode) as it completes, and at the end the
peers table (ours, DeepEP, NCCL side by side; DeepEP's skip reasons under it); with --out-json the report
(device, world and local world size, config, symmetric bytes per rank, package versions, git sha,
time, command line, rows; rewritten after every row; cute_ep.tools.bench_report has the schema, and every row
also holds the results fields of cute_ep.tools.bench_peers.PERF_ROW_FIELDS: num_sms, layout, deepep_*,
nccl_us, dispatch_link_gbps); with --out-png time vs tokens per rank for each SM budget, ours, DeepEP
and NCCL, dispatch and combine.

Constraints:
    * GPU only: one GPU per rank, CUDA, NVSHMEM and NCCL (--help alone runs anywhere).
    * --num-experts divisible by the world size; 1 <= --topk <= min(--num-experts, 64);
      --hidden >= 4 with --hidden * element size a multiple of 16 bytes.
    * every --tokens value in [1, 65536]; world size * max(--tokens) * topk < 2**31. Symmetric memory
      per rank ~ 2 * world * max(--tokens) * min(topk, experts per rank) * H * b (7.5 GB for the
      defaults on 4 GPUs); the NCCL buffers take about as much again on a hot rank under skew.
    * --local-world-size (or CUTE_EP_LOCAL_WORLD_SIZE) divides the ranks per host (virtual nodes).
    * --num-sms: integers >= 1 (DeepEP gets the largest even count <= min(budget, 128); a budget of 1
      leaves it none). --peers: names from nccl, deepep, or "none". DeepEP is never required.
    * This script never sets NCCL / NVSHMEM / PyTorch multicast variables; it records them.

Exit status (the same on every rank): 0 done, 1 a check failed or a run-time error, 2 bad arguments
or settings (an --out-json / --out-png that cannot be written, a malformed or too small
NVSHMEM_SYMMETRIC_SIZE).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cute_ep.tools import bench_peers as bp  # pure Python + numpy (deep_ep only when a peer is opened)
from cute_ep.tools import bench_report as br  # pure Python + numpy: safe before parsing
from cute_ep.tools import bench_timing as bt  # the timer, input sets and DeepEP peer; torch-free
from cute_ep.tools.usage import EXIT_USAGE, UsageError, checked_args  # torch-free: safe before parsing

EXIT_OK, EXIT_FAIL = 0, 1
ROUTING_CHOICES = ("uniform", "skewed", "dropped")  # cute_ep.inputs.ROUTINGS (checked at run time)
MODE_CHOICES = ("scatter", "atomic")  # kernels.config.MODES (checked at run time)


class CheckFailed(RuntimeError):
    """The checked round before timing found a mismatch (the same verdict on every rank)."""


# --------------------------------------------------------------------------------------------------
# arguments (no torch / GPU import before parsing: --help works anywhere)
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / what is measured / Constraints).")
    p.add_argument("--hidden", type=int, default=7168, help="elements per row (H)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (K)")
    p.add_argument("--num-experts", type=int, default=256, help="experts in total (E)")
    p.add_argument("--dtype", choices=bt.DTYPE_CHOICES, default="bfloat16", help="row element type")
    p.add_argument(
        "--tokens",
        default="128,256,512,1024,2048,4096,8192",
        help="comma-separated tokens per rank; the buffer is sized for the largest",
    )
    p.add_argument(
        "--routing",
        default="uniform,skewed",
        help=f"comma-separated routings of cute_ep.inputs: {', '.join(ROUTING_CHOICES)}",
    )
    p.add_argument(
        "--modes", default="scatter", help=f"comma-separated dispatch modes: {', '.join(MODE_CHOICES)}"
    )
    p.add_argument("--iters", type=int, default=50, help="timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before them")
    p.add_argument("--input-sets", type=int, default=3, help="input sets rotated across iterations")
    p.add_argument(
        "--num-sms",
        default="max",
        help="comma-separated SM budgets: our EpConfig.num_sms (CTAs of dispatch / combine) and DeepEP's "
        "set_num_sms (even, 128 for 132), one sweep per budget; max: each rank's share of its GPU (the "
        "whole GPU when it has one to itself)",
    )
    p.add_argument(
        "--peers",
        default="nccl,deepep",
        help=f"comma-separated peers timed beside ours: {', '.join(bp.PEER_CHOICES)} (or none); DeepEP is "
        "skipped, with the reason, when deep_ep does not import or the world cannot run it",
    )
    p.add_argument(
        "--validate-max-tokens",
        type=int,
        default=1024,
        help="check a bit-exact round first for every T up to this (0: never)",
    )
    p.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="ranks per (virtual) node; default $CUTE_EP_LOCAL_WORLD_SIZE, else ranks per host",
    )
    p.add_argument("--out-json", metavar="PATH", help="write the report here (rank 0; after every row)")
    p.add_argument("--out-png", metavar="PATH", help="plot bandwidth vs tokens here at the end (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="input set j uses seed + j")
    p.add_argument("--fp8", action="store_true", help="also time FP8 dispatch (--hidden a multiple of 128)")
    p.add_argument("--combine", default="pull",
                   help="comma-separated combine algorithms: pull, reduced (rows '<mode>+reduced')")
    p.add_argument("--layouts", default="expert",
                   help="comma-separated receive layouts: expert, rank (rows 'rank': one row per (token, "
                        "destination rank), DeepEP's layout, and its combine)")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Launch-independent checks; fills args.token_list, routing_list, mode_list. Raises UsageError."""
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.routing_list = br.parse_name_list(args.routing, "--routing", ROUTING_CHOICES)
        args.mode_list = br.parse_name_list(args.modes, "--modes", MODE_CHOICES)
        args.combine_list = br.parse_name_list(args.combine, "--combine", ("pull", "reduced"))
        args.layout_list = br.parse_name_list(args.layouts, "--layouts", ("expert", "rank"))
        # The text is kept: args.num_sms becomes the first budget (config_from_args reads an int there).
        args.num_sms_text = getattr(args, "num_sms_text", None) or str(args.num_sms)
        args.num_sms_list = bp.parse_num_sms(args.num_sms_text)
        args.peer_list = bp.parse_peers(args.peers)
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None
    if max(args.token_list) > bt.MAX_TOKENS_PER_RANK:
        raise UsageError(f"--tokens values must be <= {bt.MAX_TOKENS_PER_RANK}, got {max(args.token_list)}")
    if args.iters < 1 or args.warmup < 0 or args.input_sets < 1:
        raise UsageError(
            f"need --iters >= 1, --warmup >= 0, --input-sets >= 1; got {args.iters}, {args.warmup}, "
            f"{args.input_sets}"
        )
    if args.hidden < 4:
        raise UsageError(f"--hidden must be >= 4 (the first columns name the sender), got {args.hidden}")
    args.num_sms = args.num_sms_list[0]  # the EpConfig that sizes the Runtime (num_sms does not change it)
    if args.fp8 and args.hidden % 128:
        raise UsageError(f"--fp8 needs --hidden to be a multiple of 128, got {args.hidden}")
    if "rank" in args.layout_list and getattr(args, "capacity_factor", None):
        raise UsageError(
            f"--layouts rank needs no expert capacity (0), got --capacity-factor {args.capacity_factor}"
        )
    if args.validate_max_tokens < 0:
        raise UsageError(f"--validate-max-tokens must be >= 0, got {args.validate_max_tokens}")
    if args.out_png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--out-png needs matplotlib (pip install matplotlib)") from None
    # Rank 0 alone writes them: a write error there would leave the other ranks in a collective.
    for flag, value in (("--out-json", args.out_json), ("--out-png", args.out_png)):
        if value:
            check_writable(flag, value)


def check_writable(flag: str, value: str) -> None:
    """Raise UsageError unless ``value`` can be written (``bench_report.check_writable``; write_json and
    plot create missing parents)."""
    try:
        br.check_writable(flag, value)
    except br.BenchReportError as exc:
        raise UsageError(str(exc)) from None


# --------------------------------------------------------------------------------------------------
# one (routing, T): the checked round (the timer and input sets: cute_ep.tools.bench_timing)
# --------------------------------------------------------------------------------------------------


def raise_if_failed(results: list, tag: str, group: Any, say: Any) -> None:
    """Report every failed (name, CheckResult) of ``results`` and raise CheckFailed naming them; the
    verdicts are the same on every rank, so every rank reports (collective) and raises alike."""
    from cute_ep.validators.checks import report

    failed = [name for name, r in results if not r.passed]
    for name, r in results:
        if not r.passed:
            report(r, f"{tag} {name}", group, say)  # collective: every rank takes this branch
    if failed:
        raise CheckFailed(f"{tag}: the {', '.join(failed)} check(s) failed (details above); not timing it")


def checked_round(buf: Any, cfg: Any, runtime: Any, s: bt.InputSet, mode: str, tag: str, say: Any,
                  fp8: bool = False, combines: tuple[str, ...] = ("pull",)) -> None:
    """Dispatch + test expert + combine on ``s``, checked bit for bit; raise CheckFailed on every rank.
    fp8: the received packed rows against the senders' rows quantized by cute_ep.fp8. combines: the
    combine algorithms to run and check on the dispatch's handle."""
    from cute_ep.fp8 import fp8_check_rows
    from cute_ep.tools.cli import fill_expert_output
    from cute_ep.validators.checks import check_combine, check_dispatch, check_layout

    group, rank = runtime.cpu_group, runtime.env.rank
    lws = cfg.local_world_size
    buf.poison()
    res = buf.dispatch(s.x, s.idx, s.w, mode=mode, fp8=fp8)
    results = [("layout", check_layout(
        res, s.idx, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts, local_world_size=lws,
        group=group,
    ))]  # fmt: skip
    rows, recv_rows, expert_in = s.x, res.recv_x, res.recv_x
    if fp8:
        rows, recv_rows, expert_in = fp8_check_rows(s.x, res.recv_x, res.recv_scales, cfg.fp8_row_bytes)
        expert_in = expert_in.to(cfg.dtype).to(runtime.device)
    results.append(("dispatch", check_dispatch(
        rows, s.idx, s.w, recv_rows, res.recv_weights, res.recv_src, max_tokens=cfg.max_tokens,
        num_experts=cfg.num_experts, local_world_size=lws, ordered=(mode == "scatter"),
        require_coverage=False, group=group,
    )))  # fmt: skip
    y = fill_expert_output(buf, res, rank, expert_in)
    for algorithm in combines:
        out = buf.combine(y, res.handle, algorithm=algorithm)
        results.append((f"{algorithm} combine", check_combine(
            out, s.idx, s.w, y, local_world_size=lws, num_experts=cfg.num_experts,
            scatter=res.handle.scatter, require_coverage=False, group=group, algorithm=algorithm,
        )))  # fmt: skip
    raise_if_failed(results, tag, group, say)


# --------------------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------------------


def checked_rank_round(buf: Any, cfg: Any, runtime: Any, s: bt.InputSet, tag: str, say: Any) -> None:
    """One rank-layout dispatch and combine on ``s``, checked bit for bit against the torch references
    (``validators.checks.check_rank_dispatch`` / ``check_rank_combine``); raise CheckFailed on every rank."""
    from cute_ep.validators.checks import check_rank_combine, check_rank_dispatch

    group, lws = runtime.cpu_group, cfg.local_world_size
    buf.poison()
    res = buf.dispatch(s.x, s.idx, s.w, layout="rank")
    results = [("rank dispatch", check_rank_dispatch(
        res, s.x, s.idx, s.w, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts, local_world_size=lws,
        require_coverage=False, group=group,
    ))]  # fmt: skip
    # What an expert rank hands back: each row scaled by its local weights' sum (any function would do).
    y = buf.expert_output(res.num_recv)
    y.copy_((res.recv_x.float() * res.recv_topk_weights.sum(dim=1, keepdim=True)).to(cfg.dtype))
    out = buf.combine(y, res.handle)
    results.append(("rank combine", check_rank_combine(
        out, s.idx, res.handle.scatter, y, num_experts=cfg.num_experts, local_world_size=lws,
        require_coverage=False, group=group,
    )))  # fmt: skip
    raise_if_failed(results, tag, group, say)
    say(f"{tag} checked: dispatch and combine bit-identical to the reference")


def checked_rank_fp8(buf: Any, cfg: Any, runtime: Any, s: bt.InputSet, tag: str, say: Any) -> None:
    """One FP8 rank-layout dispatch on ``s`` from poisoned buffers, its packed rows checked byte for byte
    against every sender's rows quantized by ``cute_ep.fp8`` (``check_rank_dispatch(fp8=True)``); raise
    CheckFailed on every rank otherwise."""
    from cute_ep.validators.checks import check_rank_dispatch

    buf.poison()
    res = buf.dispatch(s.x, s.idx, s.w, layout="rank", fp8=True)
    raise_if_failed([("rank FP8 dispatch", check_rank_dispatch(
        res, s.x, s.idx, s.w, max_tokens=cfg.max_tokens, num_experts=cfg.num_experts,
        local_world_size=cfg.local_world_size, require_coverage=False, fp8=True, group=runtime.cpu_group,
    ))], tag, runtime.cpu_group, say)  # fmt: skip
    say(f"{tag} checked: the packed FP8 rows bit-identical to the reference")


def checked_cached_round(buf: Any, runtime: Any, s: bt.InputSet, other: Any, tag: str, say: Any,
                         fp8: bool = False) -> None:
    """A cached rank-layout dispatch (``launch_cached_dispatch``) of the rows ``other`` along ``s``'s routing
    receives, byte for byte, what a full dispatch of ``other`` along it does (rows, source tags, local ids
    and weights; with ``fp8`` the packed FP8 rows), from poisoned receive buffers; raise CheckFailed on
    every rank otherwise."""
    import torch

    from cute_ep.tools.cli import all_gather

    def received(n: int) -> dict[str, Any]:
        rows = {"fp8 rows": buf.fp8_packed_rows(n)} if fp8 else {"recv_x": buf.recv_x[:n]}
        return rows | {name: getattr(buf, name)[:n] for name in ("recv_src", "recv_topk_idx", "recv_topk_w")}

    n = buf.dispatch(other, s.idx, s.w, layout="rank", fp8=fp8).num_recv
    want = {name: t.clone() for name, t in received(n).items()}
    res = buf.dispatch(s.x, s.idx, s.w, layout="rank", fp8=fp8)
    buf.poison()
    buf.launch_cached_dispatch(other, res.handle, fp8=fp8)  # on the stream the comparisons below run on
    bad = [name for name, got in received(n).items()
           if not torch.equal(got.view(torch.uint8), want[name].view(torch.uint8))]
    everyone = all_gather(bad, runtime.cpu_group)
    if any(everyone):
        raise CheckFailed(f"{tag}: the cached dispatch's {sorted({n for b in everyone for n in b})} differ "
                          f"from a full dispatch's; not timing it")
    say(f"{tag} checked: the cached dispatch receives what the full one does")


def measure(
    buf: Any,
    cfg: Any,
    runtime: Any,
    timer: Any,
    args: argparse.Namespace,
    routing: str,
    tokens: int,
    say: Any,
    *,
    deepep: Any = None,
    deepep_skipped: str | None = None,
) -> list[dict[str, Any]]:
    """Rows (on rank 0; [] elsewhere) of every mode for one (routing, T) at the budget ``cfg.num_sms``.

    deepep: a bench_peers.DeepEpBudget to time beside ours, or None with ``deepep_skipped`` the reason."""
    import torch
    import torch.distributed as dist

    from cute_ep.tools.cli import all_gather

    env, device = runtime.env, runtime.device
    n = args.input_sets
    sets = [bt.InputSet(cfg, env.rank, device, tokens, routing, args.seed + j) for j in range(n)]
    bt.exchange_splits(sets, runtime.cpu_group)
    recv = torch.empty((max(sum(s.recv_splits) for s in sets), cfg.hidden), dtype=cfg.dtype, device=device)
    nccl_group = runtime.group

    def nccl_dispatch(i: int) -> None:
        s = sets[i % n]
        dist.all_to_all_single(
            recv[: sum(s.recv_splits)], s.send, s.recv_splits, s.send_splits, group=nccl_group
        )

    def nccl_combine(i: int) -> None:
        s = sets[i % n]
        dist.all_to_all_single(
            s.send, recv[: sum(s.recv_splits)], s.send_splits, s.recv_splits, group=nccl_group
        )

    with_nccl = "nccl" in args.peer_list
    nccl_d = br.median(timer.run(nccl_dispatch, args.warmup, args.iters)) if with_nccl else None
    nccl_c = br.median(timer.run(nccl_combine, args.warmup, args.iters)) if with_nccl else None
    nccl_fp8: list[float] = []

    def nccl_fp8_dispatch() -> float | None:
        """NCCL moving the same rows packed as FP8 (quantized here, outside the timed region); once."""
        if not with_nccl:
            return None
        if not nccl_fp8:
            from cute_ep.fp8 import pack_fp8_rows, quantize_fp8

            packed = [pack_fp8_rows(*quantize_fp8(s.send), cfg.fp8_row_bytes) for s in sets]
            recv8 = torch.empty((recv.shape[0], cfg.fp8_row_bytes), dtype=torch.uint8, device=device)

            def step(i: int) -> None:
                s = sets[i % n]
                dist.all_to_all_single(
                    recv8[: sum(s.recv_splits)], packed[i % n], s.recv_splits, s.send_splits, group=nccl_group
                )

            nccl_fp8.append(br.median(timer.run(step, args.warmup, args.iters)))
        return nccl_fp8[0]

    deepep_us = None
    if deepep is None and not deepep_skipped:
        deepep_skipped = "not requested"
    if deepep is not None:
        deepep_us, deepep_skipped = bt.measure_deepep(deepep, sets, runtime, timer, args)
        if deepep_skipped:
            say(f"[{routing} T={tokens} num_sms={cfg.num_sms}] DeepEP skipped: {deepep_skipped}")
    deepep_per_rank = all_gather(deepep_us, runtime.cpu_group)  # all lists or all None (agreed)
    pairs = sum(s.pairs_off for s in sets) / n
    rows_sent = sum(s.rows_off for s in sets) / n

    def add_row(label: str, layout: str, checked: bool, t_d: float, t_nccl_d: float | None, d_row: int,
                t_c: float) -> None:
        per_rank = all_gather((pairs, rows_sent, t_d, t_c, t_nccl_d, nccl_c), runtime.cpu_group)
        if env.rank != 0:
            return
        nccl = with_nccl and t_nccl_d is not None
        row = br.BenchRow.from_measurements(
            routing=routing, tokens=tokens, mode=label, checked=checked, row_bytes=cfg.row_bytes,
            pairs_off=[p[0] for p in per_rank], rows_off=[p[1] for p in per_rank],
            dispatch_us=[p[2] for p in per_rank], combine_us=[p[3] for p in per_rank],
            nccl_dispatch_us=[p[4] for p in per_rank] if nccl else None,
            nccl_combine_us=[p[5] for p in per_rank] if nccl else None,
            dispatch_row_bytes=d_row, reduced_combine=label.endswith("+reduced"),
        ).to_dict()  # fmt: skip
        # An FP8 row beside DeepEP's FP8 dispatches (and its bf16 combine); a bf16 row beside its bf16 ones.
        dep_times = dep_why = None
        if deepep_per_rank[0] is None:
            dep_why = deepep_skipped
        elif "+fp8" in label:
            dep_times = [bp.fp8_peer_times(m) for m in deepep_per_rank]
        else:
            dep_times = [m[: len(bp.DEEPEP_TIMES)] for m in deepep_per_rank]
        row.update(bp.peer_fields(
            num_sms=cfg.num_sms, layout=layout, row_bytes=d_row or cfg.row_bytes,
            rows_off=row["rows_off"], dispatch_us=row["dispatch_us_per_rank"],
            combine_us=row["combine_us_per_rank"], nccl_dispatch_us=row["nccl_dispatch_us_per_rank"],
            deepep_num_sms=bp.deepep_num_sms(cfg.num_sms) or None, deepep_us=dep_times,
            deepep_skipped=dep_why,
        ))  # fmt: skip
        rows.append(row)
        say(br.format_row(row))

    rows: list[dict[str, Any]] = []
    if "rank" in args.layout_list:
        checked = tokens <= args.validate_max_tokens
        if checked:
            checked_rank_round(buf, cfg, runtime, sets[0], f"[{routing} T={tokens} rank layout]", say)

        def rank_dispatch(i: int) -> None:
            s = sets[i % n]
            buf.launch_dispatch(s.x, s.idx, s.w, layout="rank")

        rank_d = br.median(timer.run(rank_dispatch, args.warmup, args.iters))
        handles = [buf.dispatch(s.x, s.idx, s.w, layout="rank").handle for s in sets]  # all ran?

        def rank_combine(i: int) -> None:
            s = sets[i % n]
            buf.launch_combine(handles[i % n], s.out, "pull")

        rank_c = br.median(timer.run(rank_combine, args.warmup, args.iters))
        buf.check_ran()
        add_row("rank", "rank", checked, rank_d, nccl_d, 0, rank_c)
        if "reduced" in args.combine_list:
            # Pushed (EpBuffer.pushes): the latest dispatch's handle, every row read from recv_y as the
            # pull reads it, so the two rows time the kernels alone.
            last, latest = sets[-1], handles[-1]

            def rank_push(i: int, last: bt.InputSet = last) -> None:
                buf.launch_combine(latest, last.out, "reduced")

            push_c = br.median(timer.run(rank_push, args.warmup, args.iters))
            buf.check_ran()
            add_row("rank+reduced", "rank", checked, rank_d, nccl_d, 0, push_c)

        def cached_dispatch(tag: str, fp8: bool) -> float:
            """DeepEP's cached dispatch's counterpart (with ``fp8`` its cached FP8 dispatch's): the latest
            dispatch's routing again, no layout, checked first; its median time."""
            if checked:  # other rows than set -1's own: its x with the tokens' rows rotated
                checked_cached_round(buf, runtime, sets[-1], sets[-1].x.roll(1, 0), tag, say, fp8=fp8)
            latest = buf.dispatch(sets[-1].x, sets[-1].idx, sets[-1].w, layout="rank", fp8=fp8).handle

            def rank_cached(i: int) -> None:
                buf.launch_cached_dispatch(sets[i % n].x, latest, fp8=fp8)

            cached_d = br.median(timer.run(rank_cached, args.warmup, args.iters))
            buf.check_ran()
            return cached_d

        cached_d = cached_dispatch(f"[{routing} T={tokens} rank cached]", False)
        add_row("rank+cached", "rank", checked, cached_d, nccl_d, 0, rank_c)
        if args.fp8:
            if checked:
                checked_rank_fp8(buf, cfg, runtime, sets[0], f"[{routing} T={tokens} rank+fp8]", say)

            def rank_fp8_dispatch(i: int) -> None:
                s = sets[i % n]
                buf.launch_dispatch(s.x, s.idx, s.w, layout="rank", fp8=True)

            fp8_d = br.median(timer.run(rank_fp8_dispatch, args.warmup, args.iters))
            buf.check_ran()
            add_row("rank+fp8", "rank", checked, fp8_d, nccl_fp8_dispatch(), cfg.fp8_row_bytes, rank_c)
            fp8_cached_d = cached_dispatch(f"[{routing} T={tokens} rank+fp8+cached]", True)
            add_row("rank+fp8+cached", "rank", checked, fp8_cached_d, nccl_fp8_dispatch(), cfg.fp8_row_bytes,
                    rank_c)
    for mode in args.mode_list if "expert" in args.layout_list else ():
        checked = tokens <= args.validate_max_tokens
        if checked:
            checked_round(buf, cfg, runtime, sets[0], mode, f"[{routing} T={tokens} {mode}]", say,
                          combines=tuple(args.combine_list))

        def our_dispatch(i: int, mode: str = mode) -> None:
            s = sets[i % n]
            buf.launch_dispatch(s.x, s.idx, s.w, mode)

        ours_d = br.median(timer.run(our_dispatch, args.warmup, args.iters))
        # Real dispatches (checked launches) give each set's handle; the expert outputs' values do not
        # change combine's cost, so recv_y holds the last set's received rows (zeros beyond them).
        buf.expert_output(cfg.capacity).zero_()
        for s in sets:
            res = buf.dispatch(s.x, s.idx, s.w, mode=mode)
            s.handle, s.num_recv = res.handle, res.num_recv
        buf.expert_output(res.num_recv).copy_(res.recv_x)

        def our_combine(i: int) -> None:
            s = sets[i % n]
            buf.launch_combine(s.handle, s.out, "pull")

        variants = []
        if "pull" in args.combine_list:
            ours_c = br.median(timer.run(our_combine, args.warmup, args.iters))
            buf.combine(buf.expert_output(sets[0].num_recv), sets[0].handle, algorithm="pull")  # all ran?
            variants.append((mode, ours_d, nccl_d, 0, ours_c))
        if "reduced" in args.combine_list:
            # The group lists on the expert ranks are the latest dispatch's: every iteration combines
            # that dispatch's handle (the last input set's).
            last = sets[-1]

            def our_reduced_combine(i: int, last: bt.InputSet = last) -> None:
                buf.launch_combine(last.handle, last.out, "reduced")

            reduced_c = br.median(timer.run(our_reduced_combine, args.warmup, args.iters))
            buf.combine(buf.expert_output(last.num_recv), last.handle, algorithm="reduced")  # all ran?
            variants.append((f"{mode}+reduced", ours_d, nccl_d, 0, reduced_c))
        if args.fp8:
            if checked:
                checked_round(buf, cfg, runtime, sets[0], mode, f"[{routing} T={tokens} {mode}+fp8]", say,
                              fp8=True)

            def our_fp8_dispatch(i: int, mode: str = mode) -> None:
                s = sets[i % n]
                buf.launch_dispatch(s.x, s.idx, s.w, mode, fp8=True)

            fp8_d = br.median(timer.run(our_fp8_dispatch, args.warmup, args.iters))
            buf.dispatch(sets[0].x, sets[0].idx, sets[0].w, mode=mode, fp8=True)  # raises if one did not run
            variants.append((f"{mode}+fp8", fp8_d, nccl_fp8_dispatch(), cfg.fp8_row_bytes, variants[0][4]))
        for label, t_d, t_nccl_d, d_row, t_c in variants:
            add_row(label, "expert", checked, t_d, t_nccl_d, d_row, t_c)
    return rows


def make_meta(args: argparse.Namespace, cfg: Any, runtime: Any) -> dict[str, Any]:
    import torch

    env = runtime.env
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # not every build has it
        nccl = None
    versions = br.package_versions()
    versions["nccl"] = nccl
    versions["cuda"] = torch.version.cuda
    return {
        "device": torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu",
        "world_size": env.world_size,
        "local_world_size": env.local_world_size,
        "virtual_nodes": env.is_virtual,
        # Ranks sharing one GPU (CUDA MPS): the "link" is that GPU's own memory, not NVLink; compare
        # ratios within such a report, not its times with NVLink reports.
        **br.gpu_share_meta(runtime),
        "sm_share": getattr(runtime, "sm_share", None),
        # the results form's keys (bench_peers.PERF_META_FIELDS), beside the config below
        "hidden": cfg.hidden,
        "topk": cfg.topk,
        "num_experts": cfg.num_experts,
        "dtype": args.dtype,
        "num_sms_budgets": args.num_sms_list,
        "peers": args.peer_list,
        "deepep": bt.deepep_meta(
            args,
            timing=(
                "same timer, same input sets; dispatch = cached handle; full_dispatch = layout + dispatch "
                "(host sync included); dispatch_permute = cached dispatch + torch expert-major permute; "
                "combine = sum of the received rows (no weights); a +fp8 row's dispatches take DeepEP's FP8 "
                "input (e4m3 values and column-major fp32 scales, quantized before timing)"
            ),
        ),
        "config": {
            "hidden": cfg.hidden,
            "topk": cfg.topk,
            "num_experts": cfg.num_experts,
            "experts_per_rank": cfg.experts_per_rank,
            "dtype": args.dtype,
            "element_size": cfg.element_size,
            "row_bytes": cfg.row_bytes,
            "max_tokens": cfg.max_tokens,
            "capacity": cfg.capacity,
            # one budget: an int as before; a sweep (--num-sms a,b,...): the list
            "num_sms": args.num_sms_list[0] if len(args.num_sms_list) == 1 else args.num_sms_list,
            "tokens": args.token_list,
            "routings": args.routing_list,
            "modes": args.mode_list,
            "combines": args.combine_list,
            "layouts": args.layout_list,
            "fp8": bool(args.fp8),
            "iters": args.iters,
            "warmup": args.warmup,
            "input_sets": args.input_sets,
            "validate_max_tokens": args.validate_max_tokens,
            "seed": args.seed,
        },
        "symmetric_bytes": cfg.symmetric_bytes(),
        "symmetric_heap": runtime.symmetric_size,
        "line_rate_gbps": br.NVLINK4_LINE_RATE_GBPS,
        "timing": (
            "CUDA events per iteration after warm-up, GPU held by a sleep while the host enqueues; "
            "median per rank, slowest rank reported; dispatch includes the layout kernel; combine "
            "includes copying the handle's slots"
        ),
        "environment": {k: os.environ.get(k) for k in bt.RECORDED_VARS},
        "versions": versions,
        "git_sha": br.git_sha(),
        "timestamp": br.utc_timestamp(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def run(args: argparse.Namespace) -> int:
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.inputs import ROUTINGS
    from cute_ep.kernels.config import MODES
    from cute_ep.tools.cli import (
        Printer,
        config_from_args,
        report_setup_error,
        require_cuda,
        run_guarded,
        setup_errors,
    )

    try:
        if set(args.routing_list) - set(ROUTINGS) or set(args.mode_list) - set(MODES):
            raise UsageError(f"routings must be in {ROUTINGS} and modes in {sorted(MODES)}")
        env = DistEnv.from_environ(local_world_size=args.local_world_size)
        cfg = config_from_args(args, env, max_tokens=max(args.token_list))
        require_cuda("scripts/benchmark.py (it times the GPU kernels)", bt.CPU_WAY_OUT)
    except setup_errors() as exc:
        return report_setup_error(exc)

    def timed_sweep(args: argparse.Namespace, env: Any, cfg: Any) -> int:
        with Runtime(env, symmetric_bytes=cfg.symmetric_bytes()) as runtime:
            return sweep(args, cfg, runtime, Printer(env.rank))

    return run_guarded(timed_sweep, args, env, cfg)


def sweep(
    args: argparse.Namespace,
    cfg: Any,
    runtime: Any,
    say: Any,
    *,
    make_buffer: Callable[[Any, Any], Any] | None = None,
    make_timer: Callable[[Any], Any] | None = None,
    make_deepep: Callable[[Any, Any, argparse.Namespace], tuple[Any, str | None]] | None = None,
) -> int:
    """Every (num_sms, routing, T, mode) with one EpBuffer per SM budget; rank 0 prints, writes the report
    and the plot.

    ``make_buffer(runtime, cfg)`` / ``make_timer(runtime)`` / ``make_deepep(runtime, cfg, args)`` default
    to EpBuffers sharing one module / bench_timing.Timer / bench_timing.open_deepep (the CPU tests pass
    stand-ins to run this flow over gloo). ``make_deepep`` returns (a bench_peers.DeepEpPeer, None) or
    (None, why not).
    """
    from cute_ep.tools.cli import all_gather, leave

    make_buffer = bt.shared_module_buffers(runtime) if make_buffer is None else make_buffer
    make_timer = bt.Timer if make_timer is None else make_timer
    make_deepep = bt.open_deepep if make_deepep is None else make_deepep

    env = runtime.env
    # "max" in --num-sms: the least SM share of any rank (the whole GPU where a rank has one to itself).
    args.num_sms_list = bp.resolve_num_sms(args.num_sms_list, bp.least_sm_share(runtime))
    if br.gpu_share_meta(runtime)["shared_gpu"] and "nccl" in args.peer_list:
        args.peer_list = [p for p in args.peer_list if p != "nccl"]
        say("NCCL not timed: NCCL refuses ranks that share a GPU")
    meta = make_meta(args, cfg, runtime)
    devices = sorted(set(all_gather(meta["device"], runtime.cpu_group)))
    sym = cfg.symmetric_bytes()
    say(
        f"cute-ep benchmark: {', '.join(devices)} x {env.world_size} = {cfg.nnodes} node(s) x "
        f"{cfg.local_world_size}{' (virtual nodes)' if env.is_virtual else ''}; git {meta['git_sha']}",
        f"H {cfg.hidden}, top-k {cfg.topk}, E {cfg.num_experts} ({cfg.experts_per_rank}/rank), {args.dtype}, "
        f"tokens/rank {args.token_list}, routings {args.routing_list}, modes {args.mode_list}, "
        f"num_sms {args.num_sms_list}, {args.warmup} warm-up + {args.iters} timed iterations, "
        f"{args.input_sets} input sets",
        f"symmetric memory per rank: {sym} bytes ({sym / 2**30:.2f} GiB), heap {runtime.symmetric_size}",
        "dispatch time = layout + dispatch kernels; combine time = handle slot copy + combine kernel; "
        "NCCL = all_to_all_single of the same rows",
    )
    for var in bt.multicast_warnings():
        say(f"warning: {var}")
    peer, peer_skipped = bt.open_peer(make_deepep, runtime, cfg, args, meta, say,
                                   "not requested (--peers without deepep)")  # fmt: skip
    timer = make_timer(runtime)
    rows: list[dict[str, Any]] = []
    buf = None
    try:
        for bi, budget in enumerate(args.num_sms_list):
            cfg_b, buf, dep, dep_skipped = bt.open_budget(
                make_buffer, runtime, cfg, budget, peer, peer_skipped, say
            )
            if bi == 0:
                say("", br.table_header())
            for routing in args.routing_list:
                for tokens in args.token_list:
                    rows += measure(buf, cfg_b, runtime, timer, args, routing, tokens, say,
                                    deepep=dep, deepep_skipped=dep_skipped)  # fmt: skip
                    if env.rank == 0 and args.out_json:
                        write_report(args.out_json, meta, rows)
            buf.close()
            buf = None
            if dep is not None:
                peer.release(budget)
    except CheckFailed as exc:  # the same on every rank
        if buf is not None:
            buf.close()
        if peer is not None:
            peer.close()
        return leave(runtime, exc, EXIT_FAIL)
    if env.rank == 0:
        say(br.TABLE_NOTE, "", bp.format_peer_table(rows))
        if args.out_json:
            say(f"report: {args.out_json}")
        if args.out_png:
            bp.plot_peers({"meta": meta, "rows": rows}, args.out_png)
            say(f"plot: {args.out_png}")
    runtime.barrier()
    return EXIT_OK


def write_report(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The report at ``path``: bench_report's schema, and the results form of bench_peers (checked first)."""
    bp.check_perf_json({"meta": meta, "rows": rows})
    br.write_json(path, meta, rows)


def main(argv: list[str] | None = None) -> int:
    args = checked_args(build_parser(), validate_args, argv)
    return EXIT_USAGE if args is None else run(args)


if __name__ == "__main__":
    code = main()
    from cute_ep.tools.cli import (
        exit_process,  # after main: --help and bad syntax exit before torch is imported
    )

    exit_process(code)
