"""Peers of ``scripts/benchmark.py`` (NCCL, DeepEP), its SM-budget sweep, and the results form of its report.

Pure Python + numpy at import time (like :mod:`cute_ep.tools.bench_report`): torch is imported inside the few
functions that take tensors, matplotlib inside :func:`plot_peers`, and ``deep_ep`` only by
:func:`import_deep_ep` (or a :class:`DeepEpPeer` made without an injected module).

**DeepEP** (deepseek-ai/DeepEP v1.2.1, ``import deep_ep``) is a benchmark peer only: nothing in cute-ep needs
it. Its intranode "normal" kernels run when ``deep_ep`` imports and the world suits them
(:func:`deepep_skip_reason`); otherwise every row says why in ``deepep_skipped``. One set of inputs serves
ours and DeepEP's: x [T, H] bf16, topk_idx [T, K] (int64 for DeepEP: the dtype it takes), topk_weights
[T, K] fp32. What is timed for DeepEP, per SM budget (:class:`DeepEpBudget`):

* ``deepep_dispatch_us``: ``Buffer.dispatch`` with the cached handle of a full call on the same input set
  (no layout, no host sync: how DeepEP's own tests time it); it lands one row per (token, destination rank).
* ``deepep_full_dispatch_us``: ``get_dispatch_layout`` + ``dispatch`` with the routing, which waits on the
  host for the received counts (that wait is part of the call, so it is timed).
* ``deepep_dispatch_permute_us``: the cached dispatch followed by a torch permute into our receive layout
  (expert-major: one row per (token, local expert), experts in order; :func:`expert_major_permute`), the
  like-for-like comparison with our expert-major dispatch.
* ``deepep_combine_us``: ``Buffer.combine`` of the received rows (one per (token, rank), summed on the
  token's rank, no weights), with the same handle.

**SM budgets.** ``--num-sms 24,48,132`` sets our ``EpConfig.num_sms`` and DeepEP's ``Buffer.set_num_sms`` in
one run. DeepEP needs an even count (an even SM sends and the next odd one receives: one channel) and uses
128 for the full GPU (our 132): :func:`deepep_num_sms` maps one to the other and each row reports both.

**Link rate.** ``dispatch_link_gbps`` = L / t with L = the mean over ranks of this rank's link bytes, a
rank's link bytes = (distinct (token, destination rank) pairs whose destination is another rank, i.e.
``bench_report.rows_off``, mean over the input sets) x the bytes of one row as dispatch sends it (H x
element size; FP8 rows: the packed row), and t = the slowest rank's median dispatch time; GB/s = 1e9 B/s.
It counts each row once per destination rank and leaves out the 12 bytes of metadata per pair that
``dispatch_moved_gbps`` adds: the bytes any rank-deduplicating dispatch must move (DeepEP's as well, so
``deepep_dispatch_link_gbps`` divides the same bytes by DeepEP's dispatch time).

**Results form.** A report is ``{"meta": {...}, "rows": [...]}`` (the benchmark's report, which also keeps
``bench_report``'s schema); :func:`check_perf_json` checks ``PERF_META_FIELDS`` in meta and
``PERF_ROW_FIELDS`` in every row (see :func:`peer_fields` for the meaning of each).

**Decode report.** ``scripts/decode_breakdown.py`` writes ``{"schema", "meta", "rows"}`` with one row per
(tokens, num_sms): our kernel times, the public calls' wall times and their host parts, and DeepEP at the
same budget (:func:`decode_row` assembles a row from every rank's medians; :func:`check_decode_json`
checks a report: ``check_perf_json``'s rules plus ``DECODE_ROW_FIELDS``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cute_ep.tools.bench_report import BenchReportError, bandwidth_gbps, rows_off, write_json_file

__all__ = [
    "DECODE_API_TIMES",
    "DECODE_COMBINES",
    "DECODE_HOST_TIMES",
    "DECODE_KERNEL_TIMES",
    "DECODE_MEASURED",
    "DECODE_META_FIELDS",
    "DECODE_ROW_FIELDS",
    "DECODE_SCHEMA",
    "DEEPEP_FULL_GPU_SMS",
    "DEEPEP_MAX_HIDDEN_BF16",
    "DEEPEP_MAX_LOCAL_EXPERTS",
    "DEEPEP_TIMES",
    "DEEPEP_FP8_TIMES",
    "fp8_peer_times",
    "DEEPEP_WORLD_SIZES",
    "FULL_GPU_SMS",
    "LAYOUTS",
    "PEER_CHOICES",
    "PERF_META_FIELDS",
    "PERF_ROW_FIELDS",
    "DeepEpBudget",
    "DeepEpDispatch",
    "DeepEpPeer",
    "check_decode_json",
    "check_deepep_combine",
    "check_deepep_dispatch",
    "check_perf_json",
    "decode_row",
    "deepep_budget_skip_reason",
    "deepep_num_sms",
    "deepep_skip_reason",
    "deepep_version",
    "dest_ranks_per_token",
    "dispatch_link_bytes",
    "expected_receive",
    "expert_major_permute",
    "first_reason",
    "format_decode_progress",
    "format_decode_tables",
    "format_peer_table",
    "import_deep_ep",
    "link_gbps",
    "load_results",
    "pairs_per_expert",
    "parse_num_sms",
    "resolve_num_sms",
    "least_sm_share",
    "SHARE_BUDGET",
    "parse_peers",
    "peer_fields",
    "plot_peers",
    "rows_per_rank",
    "write_decode_json",
]

PEER_CHOICES = ("nccl", "deepep")
"""--peers names: NCCL ``all_to_all_single`` moving the same rows, and DeepEP's intranode kernels."""
LAYOUTS = ("expert", "rank")
"""Receive layouts a row may name: "expert" (expert-major, today's kernels) and "rank" (DeepEP's)."""
FULL_GPU_SMS = 132  # H100 / H200 SXM: our default EpConfig.num_sms ("full GPU")
DEEPEP_FULL_GPU_SMS = 128  # DeepEP's budget for the full-GPU rows; also its largest here
DEEPEP_WORLD_SIZES = (2, 4, 8)  # intranode kernels are instantiated for these rank counts (one node)
# Limits of DeepEP v1.2.1's intranode kernels that the benchmark checks up front (a device-side assert
# would end the process instead of skipping the peer):
DEEPEP_MAX_LOCAL_EXPERTS = 128  # notify_dispatch counts one local expert per thread of a 128-thread block
DEEPEP_MAX_HIDDEN_BF16 = 8176  # dispatch stages half a row + an 8-byte mbarrier in 8 KiB per warp
DEEPEP_MAX_TOPK = 128  # its buffer size hint assumes at most 128 top-k entries per token
DEEPEP_TIMES = ("dispatch", "full_dispatch", "dispatch_permute", "combine")
"""DeepEP's timed calls, in the order of a rank's medians (row fields ``deepep_<name>_us``)."""
DEEPEP_FP8_TIMES = ("fp8_dispatch", "fp8_full_dispatch", "fp8_dispatch_permute")
"""With FP8 rows as well (benchmark.py --fp8), the same three dispatches of DeepEP's FP8 input (e4m3 values
and per-128-column fp32 scales, quantized before the timed calls), after ``DEEPEP_TIMES`` in a rank's
medians; an FP8 row's ``deepep_<name>_us`` fields are these (its combine: the bf16 one)."""

PERF_META_FIELDS = ("world_size", "device", "hidden", "topk", "num_experts", "dtype")
PERF_ROW_FIELDS = (
    "tokens",
    "num_sms",
    "layout",
    "dispatch_us",
    "combine_us",
    "deepep_dispatch_us",
    "deepep_combine_us",
    "deepep_num_sms",
    "deepep_full_dispatch_us",
    "deepep_dispatch_permute_us",
    "nccl_us",
    "dispatch_link_gbps",
)
# Row fields that hold a time (us): positive and finite, or None where the peer was not measured.
_TIMES = ("dispatch_us", "combine_us", "nccl_us", *(f"deepep_{n}_us" for n in DEEPEP_TIMES))
_NULLABLE = frozenset({"nccl_us", "deepep_num_sms", *(f"deepep_{n}_us" for n in DEEPEP_TIMES)})


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_peers(text: str) -> list[str]:
    """ "nccl,deepep" -> ["nccl", "deepep"] (order kept, duplicates removed); "none": no peer.

    Raises BenchReportError naming the unknown name and the allowed ones."""
    names = _split(text)
    if names == ["none"]:
        return []
    if not names:
        raise BenchReportError(
            f"--peers must name at least one of {list(PEER_CHOICES)} (or 'none'), got {text!r}"
        )
    unknown = [n for n in names if n not in PEER_CHOICES]
    if unknown:
        raise BenchReportError(
            f"--peers must be a comma-separated list of {list(PEER_CHOICES)} (or 'none'); "
            f"{unknown[0]!r} in {text!r} is not one"
        )
    return list(dict.fromkeys(names))


SHARE_BUDGET = 0  # "max" in --num-sms: each rank's share of its GPU, a number once the runtime is up


def parse_num_sms(text: str) -> list[int]:
    """ "24,48,132" -> [24, 48, 132] (order kept, duplicates removed): SM budgets, each an integer >= 1 or
    "max" (``SHARE_BUDGET``: the rank's share of its GPU, all of it when the rank has the GPU to itself;
    ``resolve_num_sms`` turns it into a number).

    Raises BenchReportError naming the offending value and the constraint."""
    parts = _split(text)
    if not parts:
        raise BenchReportError(f"--num-sms must list SM budgets (integers >= 1 or max), got {text!r}")
    values = []
    for p in parts:
        if p.lower() == "max":
            values.append(SHARE_BUDGET)
            continue
        try:
            v = int(p)
        except ValueError:
            raise BenchReportError(
                f"--num-sms must be a comma-separated list of integers >= 1 or max; {p!r} in {text!r} is "
                "not one"
            ) from None
        if v < 1:
            raise BenchReportError(f"--num-sms values must be integers >= 1 (or max); {v} in {text!r} is not")
        values.append(v)
    return list(dict.fromkeys(values))


def resolve_num_sms(budgets: Sequence[int], share: int | None) -> list[int]:
    """``budgets`` with "max" (``SHARE_BUDGET``) replaced by ``share`` (the least SM share of any rank;
    None: no GPU, then ``FULL_GPU_SMS``), duplicates removed, order kept."""
    full = FULL_GPU_SMS if share is None else int(share)
    return list(dict.fromkeys(full if b == SHARE_BUDGET else int(b) for b in budgets))


def least_sm_share(runtime: Any) -> int | None:
    """The least ``Runtime.sm_share`` over every rank (collective on ``runtime.cpu_group``), None without
    GPUs."""
    from cute_ep.collectives import all_gather_objects

    every = all_gather_objects(getattr(runtime, "sm_share", None), getattr(runtime, "cpu_group", None))
    known = [s for s in every if s is not None]
    return min(known) if known else None


# --------------------------------------------------------------------------------------------------
# SM budgets and when DeepEP cannot run
# --------------------------------------------------------------------------------------------------


def deepep_num_sms(num_sms: int) -> int:
    """DeepEP's SM budget for our budget ``num_sms``: the largest even count <= min(num_sms,
    DEEPEP_FULL_GPU_SMS) (132 -> 128, 48 -> 48, 25 -> 24); 0 when ``num_sms`` is 1 (no even count).

    Why even: one DeepEP channel is a pair of SMs (sender, receiver). Why 128 for the full GPU: the
    project compares our 132 with DeepEP at 128; budgets above 128 map there too."""
    if num_sms < 1:
        raise BenchReportError(f"num_sms must be >= 1, got {num_sms}")
    n = min(int(num_sms), DEEPEP_FULL_GPU_SMS)
    return n - n % 2


def deepep_budget_skip_reason(num_sms: int) -> str | None:
    """Why DeepEP cannot run at our SM budget ``num_sms`` (None: it can, at ``deepep_num_sms``)."""
    if deepep_num_sms(num_sms) < 2:
        return f"an SM budget of {num_sms} leaves DeepEP no even SM count >= 2"
    return None


def import_deep_ep() -> tuple[Any, str | None]:
    """(the ``deep_ep`` module, None), or (None, why it does not import). Never raises: a missing package
    and a broken build (an extension that fails to load) are both reasons to skip the peer."""
    try:
        return importlib.import_module("deep_ep"), None
    except Exception as exc:  # ImportError, or OSError / RuntimeError from a bad extension build
        return None, f"deep_ep is not importable ({type(exc).__name__}: {exc})"


def deepep_version() -> str | None:
    """The installed deep_ep distribution's version (e.g. "1.2.1+abc1234"), or None."""
    from importlib import metadata

    for name in ("deep_ep", "deep-ep"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def deepep_skip_reason(
    *,
    import_error: str | None,
    device_type: str,
    world_size: int,
    ranks_per_host: int,
    dtype: str,
    hidden: int,
    experts_per_rank: int,
    topk: int,
) -> str | None:
    """Why DeepEP's intranode kernels cannot run in this world (None: they can), first reason first.

    import_error: :func:`import_deep_ep`'s reason (None: it imported). device_type: "cuda" or "cpu".
    ranks_per_host: processes on one host (the physical node: DeepEP intranode reaches its peers over
    NVLink, so every rank must be on one host). dtype: --dtype's name (DeepEP dispatches bf16 rows; its
    FP8 path takes e4m3 + scales, not timed here)."""
    if import_error:
        return import_error
    if device_type != "cuda":
        return f"DeepEP needs CUDA GPUs (this run's device is {device_type})"
    if world_size not in DEEPEP_WORLD_SIZES:
        return f"DeepEP intranode needs 2, 4 or 8 ranks on one node, this world has {world_size}"
    if ranks_per_host != world_size:
        return (
            f"DeepEP intranode needs every rank on one node (NVLink); {world_size} ranks run "
            f"{ranks_per_host} per host"
        )
    if dtype != "bfloat16":
        return f"DeepEP dispatches bfloat16 rows; this run's --dtype is {dtype}"
    if hidden % 16 or hidden > DEEPEP_MAX_HIDDEN_BF16:
        return (
            f"DeepEP's dispatch needs --hidden a multiple of 16 and <= {DEEPEP_MAX_HIDDEN_BF16} "
            f"(half a bf16 row in its per-warp staging buffer), got {hidden}"
        )
    if experts_per_rank > DEEPEP_MAX_LOCAL_EXPERTS:
        return (
            f"DeepEP intranode takes <= {DEEPEP_MAX_LOCAL_EXPERTS} experts per rank, got {experts_per_rank}"
        )
    if topk > DEEPEP_MAX_TOPK:
        return f"DeepEP takes top-k <= {DEEPEP_MAX_TOPK}, got {topk}"
    return None


def first_reason(reasons: Sequence[str | None]) -> str | None:
    """One verdict from every rank's reason (indexed by rank; None: fine there): None when no rank has a
    reason; the reason alone when every rank has the same one; else the lowest such rank's, prefixed
    "rank r: ". So every rank skips DeepEP together (its calls are collective)."""
    named = [(r, why) for r, why in enumerate(reasons) if why]
    if not named:
        return None
    if len(named) == len(reasons) and len({why for _, why in named}) == 1:
        return named[0][1]
    rank, why = named[0]
    return f"rank {rank}: {why}"


# --------------------------------------------------------------------------------------------------
# routing arithmetic (numpy; topk_idx [T, K] integer ids, -1 dropped)
# --------------------------------------------------------------------------------------------------


def _owners(topk_idx: Any, experts_per_rank: int) -> np.ndarray:
    """[T, K] int64: the owner rank of each pair, -1 where the id is -1."""
    ids = np.asarray(topk_idx)
    if ids.ndim != 2:
        raise BenchReportError(f"topk_idx must be 2-D [T, K], got shape {ids.shape}")
    if experts_per_rank < 1:
        raise BenchReportError(f"experts_per_rank must be >= 1, got {experts_per_rank}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and int(ids.min()) < -1:
        raise BenchReportError(f"topk_idx values must be >= -1 (-1: dropped), got {int(ids.min())}")
    return np.where(ids >= 0, ids // experts_per_rank, -1)


def _token_in_rank(topk_idx: Any, world_size: int, experts_per_rank: int) -> np.ndarray:
    """[T, world_size] bool: token t sends a row to rank r (some non-dropped k is owned by r)."""
    owners = _owners(topk_idx, experts_per_rank)
    if owners.size and int(owners.max()) >= world_size:
        raise BenchReportError(
            f"an expert is owned by rank {int(owners.max())}, outside world_size={world_size}"
        )
    hit = np.zeros((owners.shape[0], world_size + 1), dtype=bool)
    rows = np.repeat(np.arange(owners.shape[0]), owners.shape[1])
    hit[rows, owners.reshape(-1)] = True  # owner -1 lands in the last column, dropped below
    return hit[:, :world_size]


def rows_per_rank(topk_idx: Any, world_size: int, experts_per_rank: int) -> list[int]:
    """[world_size] ints: distinct (token, destination rank) pairs per destination, this rank included:
    the rows a rank-major dispatch (DeepEP's) sends each rank."""
    return [int(c) for c in _token_in_rank(topk_idx, world_size, experts_per_rank).sum(axis=0)]


def dest_ranks_per_token(topk_idx: Any, world_size: int, experts_per_rank: int) -> np.ndarray:
    """[T] int64: the distinct destination ranks of each token (0 when all its ids are -1): how many
    rows a rank-major combine sums for it."""
    return _token_in_rank(topk_idx, world_size, experts_per_rank).sum(axis=1).astype(np.int64)


def pairs_per_expert(topk_idx: Any, num_experts: int) -> list[int]:
    """[num_experts] ints: non-dropped (t, k) pairs routed to each expert."""
    ids = np.asarray(topk_idx).astype(np.int64, copy=False).reshape(-1)
    kept = ids[ids >= 0]
    if kept.size and int(kept.max()) >= num_experts:
        raise BenchReportError(f"expert id {int(kept.max())} is outside num_experts={num_experts}")
    return [int(c) for c in np.bincount(kept, minlength=num_experts)]


def expected_receive(
    rows_by_source: Sequence[Sequence[int]],
    pairs_by_source: Sequence[Sequence[int]],
    rank: int,
    experts_per_rank: int,
) -> tuple[int, list[int]]:
    """What ``rank`` must receive from a rank-major dispatch, from every source's counts.

    rows_by_source[s]: :func:`rows_per_rank` of source s ([world]); pairs_by_source[s]:
    :func:`pairs_per_expert` of source s ([E]). Returns (rows = sum over sources of rows_by_source[s][rank],
    [El] pairs per local expert = sum over sources of pairs_by_source[s][rank * El + l])."""
    rows = sum(int(r[rank]) for r in rows_by_source)
    lo = rank * experts_per_rank
    per_expert = [sum(int(p[lo + j]) for p in pairs_by_source) for j in range(experts_per_rank)]
    return rows, per_expert


def dispatch_link_bytes(topk_idx: Any, rank: int, experts_per_rank: int, row_bytes: int) -> int:
    """Bytes a rank-deduplicating dispatch sends from ``rank`` across the link for one input set: its
    distinct (token, destination rank) pairs with destination != ``rank`` (``bench_report.rows_off``)
    times ``row_bytes`` (one row as sent: H x element size, or the packed FP8 row)."""
    if row_bytes < 1:
        raise BenchReportError(f"row_bytes must be >= 1, got {row_bytes}")
    return rows_off(topk_idx, rank, experts_per_rank) * int(row_bytes)


def link_gbps(link_bytes: Sequence[float], times_us: Sequence[float]) -> float:
    """The report's link rate (GB/s): the mean over ranks of ``link_bytes`` (per rank) divided by the
    slowest rank's time ``max(times_us)`` (per rank, microseconds)."""
    if not link_bytes or not times_us:
        raise BenchReportError("link_gbps needs per-rank bytes and times")
    return bandwidth_gbps(sum(link_bytes) / len(link_bytes), max(times_us) * 1e-6)


# --------------------------------------------------------------------------------------------------
# DeepEP outputs: checks and the expert-major permute (torch, imported when called)
# --------------------------------------------------------------------------------------------------


def check_deepep_dispatch(
    num_rows: int, tokens_per_expert: Sequence[int], expected_rows: int, expected_per_expert: Sequence[int]
) -> str | None:
    """None when DeepEP's dispatch delivered what the routing implies on this rank, else what differs.

    num_rows: recv_x.shape[0]; tokens_per_expert: its per-local-expert list; the expected values come
    from :func:`expected_receive`."""
    if int(num_rows) != int(expected_rows):
        return (
            f"DeepEP dispatch received {num_rows} rows, the routing gives {expected_rows} "
            f"(token, rank) pairs"
        )
    got, want = [int(v) for v in tokens_per_expert], [int(v) for v in expected_per_expert]
    if got != want:
        return f"DeepEP dispatch counted {got} rows per local expert, the routing gives {want}"
    return None


def check_deepep_combine(x: Any, combined: Any, dest_count: Any, rtol: float = 2.0**-7) -> str | None:
    """None when DeepEP's combine of the dispatched rows (unchanged, no weights) gave each token its row
    times its number of destination ranks, else what differs.

    x, combined: [T, H] (bf16); dest_count: [T] integers (:func:`dest_ranks_per_token`). Tokens sent
    nowhere are not checked. Tolerance ``rtol`` of the expected magnitude (plus 1e-6): DeepEP sums in
    fp32 and rounds once to bf16."""
    import torch

    if tuple(combined.shape) != tuple(x.shape):
        return f"DeepEP combine returned shape {tuple(combined.shape)}, expected {tuple(x.shape)}"
    n = torch.as_tensor(dest_count, device=x.device).to(torch.float32)
    sent = n > 0
    want = x.float()[sent] * n[sent].unsqueeze(1)
    diff = (combined.float()[sent] - want).abs()
    bad = diff > rtol * want.abs() + 1e-6
    if bool(bad.any()):
        tokens = torch.nonzero(sent).view(-1)[torch.nonzero(bad.any(dim=1)).view(-1)]
        return (
            f"DeepEP combine differs from x times the destination count on {tokens.numel()} token(s), "
            f"first {int(tokens[0])} (largest difference {float(diff.max()):.3g})"
        )
    return None


def expert_major_permute(recv_x: Any, recv_topk_idx: Any, recv_topk_weights: Any, num_pairs: int) -> tuple:
    """DeepEP's rank-major receive into our expert-major layout, without a host sync.

    recv_x [N, H] (or DeepEP's FP8 pair: values [N, H] and scales [N, H / 128], each permuted alike),
    recv_topk_idx [N, K] int (local expert ids, -1 elsewhere), recv_topk_weights [N, K]
    fp32; num_pairs P = the number of ids >= 0 (host-known: the sum of DeepEP's per-expert list).
    Returns (rows [P, H], weights [P] fp32, source row [P] int64): one row per (received token, local
    expert), local experts in order, and inside one expert the received order (source rank, then token:
    the order our scatter mode uses)."""
    import torch

    k = recv_topk_idx.shape[1]
    keys = recv_topk_idx.reshape(-1)
    keys = keys.masked_fill(keys < 0, torch.iinfo(keys.dtype).max)  # dropped ids sort last, then cut
    order = torch.sort(keys, stable=True).indices[:num_pairs]
    rows = torch.div(order, k, rounding_mode="floor")
    # DeepEP's FP8 receive is (values, scales): both follow the same rows
    moved = (tuple(p.index_select(0, rows) for p in recv_x) if isinstance(recv_x, tuple)
             else recv_x.index_select(0, rows))
    return moved, recv_topk_weights.reshape(-1).index_select(0, order), rows


# --------------------------------------------------------------------------------------------------
# the DeepEP adapter (deep_ep imported lazily; a fake module can be injected)
# --------------------------------------------------------------------------------------------------


@dataclass
class DeepEpDispatch:
    """A full DeepEP dispatch on one input set: what the timed calls reuse.

    recv_x [N, H] bf16 (N = (token, rank) pairs received); recv_topk_idx [N, K] int64 local expert ids or
    -1; recv_topk_weights [N, K] fp32; tokens_per_expert [El] ints; handle: DeepEP's handle (tied to the
    SM count of the config it was made with); num_pairs = sum(tokens_per_expert)."""

    recv_x: Any
    recv_topk_idx: Any
    recv_topk_weights: Any
    tokens_per_expert: list[int]
    handle: Any
    num_pairs: int


class DeepEpBudget:
    """DeepEP at one SM budget: its Buffer and the dispatch / combine Configs made at that budget.

    Every call passes these Configs explicitly: ``Buffer.set_num_sms`` sets a class attribute that the
    config helpers read, so a later budget's ``set_num_sms`` must not reach this budget's calls (a handle
    only works with the SM count it was made with)."""

    def __init__(self, ep: Any, buffer: Any, num_sms: int, deepep_num_sms: int, dispatch_config: Any,
                 combine_config: Any, num_nvl_bytes: int, num_experts: int) -> None:  # fmt: skip
        self.ep = ep
        self.buffer = buffer
        self.num_sms = num_sms  # ours
        self.deepep_num_sms = deepep_num_sms
        self.dispatch_config = dispatch_config
        self.combine_config = combine_config
        self.num_nvl_bytes = num_nvl_bytes
        self.num_experts = num_experts
        self.closed = False

    def dispatch_full(self, x: Any, topk_idx: Any, topk_weights: Any) -> DeepEpDispatch:
        """Layout + dispatch (the host waits for the received counts). x [T, H] bf16, topk_idx [T, K]
        int64, topk_weights [T, K] fp32."""
        layout = self.buffer.get_dispatch_layout(topk_idx, self.num_experts)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = layout
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            config=self.dispatch_config,
        )  # fmt: skip
        counts = [int(c) for c in counts]
        return DeepEpDispatch(recv_x, recv_idx, recv_w, counts, handle, sum(counts))

    def dispatch_cached(self, x: Any, handle: Any) -> Any:
        """Dispatch x [T, H] with a cached handle (no layout, no host sync); returns recv_x [N, H]. x may
        be DeepEP's FP8 pair (e4m3 values [T, H], fp32 scales [T, H / 128]); recv_x is then such a pair."""
        return self.buffer.dispatch(x, handle=handle, config=self.dispatch_config)[0]

    def dispatch_permute(self, x: Any, made: DeepEpDispatch) -> tuple:
        """The cached dispatch, then :func:`expert_major_permute` (the routing of ``made``, which the handle
        repeats): ([P, H], [P], [P])."""
        recv_x = self.dispatch_cached(x, made.handle)
        return expert_major_permute(recv_x, made.recv_topk_idx, made.recv_topk_weights, made.num_pairs)

    def combine(self, y: Any, handle: Any) -> Any:
        """Sum y [N, H] bf16 (one row per received (token, rank)) back onto the tokens' ranks: [T, H]."""
        return self.buffer.combine(y, handle, config=self.combine_config)[0]

    def close(self) -> None:
        """Free DeepEP's buffer (collective: a device barrier between the ranks). Safe to call twice."""
        if not self.closed:
            self.closed = True
            self.buffer.destroy()


class DeepEpPeer:
    """DeepEP's intranode kernels for one world: a :class:`DeepEpBudget` per SM budget, made once.

    group: the torch.distributed group DeepEP exchanges its IPC handles on (every rank of the world).
    hidden: H; num_experts: E. module: ``deep_ep`` itself (imported here when None) or a stand-in."""

    def __init__(
        self, group: Any, *, world_size: int, hidden: int, num_experts: int, module: Any = None
    ) -> None:
        if module is None:
            module, why = import_deep_ep()
            if module is None:
                raise ImportError(why)
        self.ep = module
        self.group = group
        self.world_size = world_size
        self.hidden_bytes = hidden * 2  # bf16 rows (DeepEP sizes FP8 buffers by bf16 rows too)
        self.num_experts = num_experts
        self._budgets: dict[int, DeepEpBudget] = {}

    def budget(self, num_sms: int) -> DeepEpBudget:
        """DeepEP at our SM budget ``num_sms`` (``deepep_num_sms(num_sms)`` SMs), made on first use and
        reused after: ``set_num_sms``, then both Configs, then a Buffer sized by their hints (collective
        on first use: every rank must ask for the same budgets in the same order)."""
        n = deepep_num_sms(num_sms)
        if n < 2:
            raise ValueError(deepep_budget_skip_reason(num_sms))
        made = self._budgets.get(n)
        if made is not None and not made.closed:
            return made
        buf_cls = self.ep.Buffer
        buf_cls.set_num_sms(n)  # before the configs: get_*_config read the class's SM count
        dcfg = buf_cls.get_dispatch_config(self.world_size)
        ccfg = buf_cls.get_combine_config(self.world_size)
        nvl = max(c.get_nvl_buffer_size_hint(self.hidden_bytes, self.world_size) for c in (dcfg, ccfg))
        # No RDMA bytes: one node. explicitly_destroy: freed by close(), not by a destructor during an
        # exception (DeepEP's docstring warns that can hang).
        buffer = buf_cls(self.group, nvl, 0, explicitly_destroy=True)
        made = DeepEpBudget(self.ep, buffer, num_sms, n, dcfg, ccfg, nvl, self.num_experts)
        self._budgets[n] = made
        return made

    def release(self, num_sms: int) -> None:
        """Free the budget's buffer (collective), if it was made."""
        made = self._budgets.pop(deepep_num_sms(num_sms), None)
        if made is not None:
            made.close()

    def discard(self, num_sms: int) -> None:
        """Forget the budget's buffer without freeing it (local): for a budget some rank could not make,
        whose destroy (a device barrier) that rank would never join."""
        self._budgets.pop(deepep_num_sms(num_sms), None)

    def close(self) -> None:
        """Free every budget's buffer (collective)."""
        for n in sorted(self._budgets):
            self._budgets[n].close()
        self._budgets.clear()


# --------------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------------


def _times(name: str, vals: Sequence[float]) -> list[float]:
    out = [float(v) for v in vals]
    if not out or any(not (v > 0 and math.isfinite(v)) for v in out):
        raise BenchReportError(f"{name} must be non-empty positive finite times, got {out}")
    return out


def fp8_peer_times(medians: Sequence[float] | None) -> list[float] | None:
    """A rank's DeepEP medians for an FP8 row, in ``DEEPEP_TIMES`` order: its FP8 dispatches (cached,
    full, with the permute) and its combine, from ``medians`` in ``DEEPEP_TIMES + DEEPEP_FP8_TIMES``
    order. None when DeepEP was skipped or its FP8 calls were not timed (only ``DEEPEP_TIMES`` given)."""
    if medians is None or len(medians) != len(DEEPEP_TIMES) + len(DEEPEP_FP8_TIMES):
        return None
    named = dict(zip(DEEPEP_TIMES + DEEPEP_FP8_TIMES, medians, strict=True))
    return [named.get(f"fp8_{name}", named[name]) for name in DEEPEP_TIMES]  # the combine has no FP8 form


def peer_fields(
    *,
    num_sms: int,
    layout: str,
    row_bytes: int,
    rows_off: Sequence[float],
    dispatch_us: Sequence[float],
    combine_us: Sequence[float],
    nccl_dispatch_us: Sequence[float] | None,
    deepep_num_sms: int | None,
    deepep_us: Sequence[Sequence[float]] | None,
    deepep_skipped: str | None,
) -> dict[str, Any]:
    """The results-form fields of one row (added to ``bench_report.BenchRow.to_dict()``).

    Per-rank inputs (each indexed by rank): rows_off (mean over the input sets), our dispatch_us and
    combine_us medians, NCCL's dispatch medians (None: not measured), and deepep_us[r] = rank r's
    medians in ``DEEPEP_TIMES`` order (None: skipped, with ``deepep_skipped`` the reason). row_bytes:
    bytes of one row as our dispatch sends it. Returns:

    * num_sms: our SM budget; layout: our receive layout ("expert" or "rank").
    * dispatch_link_bytes: the mean over ranks of rows_off x row_bytes; dispatch_link_gbps: those bytes
      over our slowest rank's median dispatch time (module docstring, "Link rate").
    * nccl_us: NCCL all_to_all_single of the dispatch's rows, slowest rank's median (None: not measured).
    * deepep_num_sms: DeepEP's SM budget for this row (None: no even count).
    * deepep_<name>_us (slowest rank's median) and deepep_<name>_us_per_rank for each of
      ``DEEPEP_TIMES``; deepep_dispatch_link_gbps: the same link bytes over DeepEP's cached dispatch;
      dispatch_vs_deepep / combine_vs_deepep: our time / DeepEP's (< 1: we are faster); all None when
      skipped. deepep_skipped: None when measured, else why not."""
    if layout not in LAYOUTS:
        raise BenchReportError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if (deepep_us is None) == (deepep_skipped is None):
        raise BenchReportError("give either DeepEP's times or the reason it was skipped, not both or neither")
    ours_d = _times("dispatch_us", dispatch_us)
    ours_c = _times("combine_us", combine_us)
    link = [float(r) * int(row_bytes) for r in rows_off]
    if len(link) != len(ours_d) or any(not (b >= 0 and math.isfinite(b)) for b in link):
        raise BenchReportError(f"rows_off must be >= 0, one per rank, got {list(rows_off)}")
    fields: dict[str, Any] = {
        "num_sms": int(num_sms),
        "layout": layout,
        "dispatch_link_bytes": sum(link) / len(link),
        "dispatch_link_gbps": link_gbps(link, ours_d),
        "nccl_us": None if nccl_dispatch_us is None else max(_times("nccl_dispatch_us", nccl_dispatch_us)),
        "deepep_num_sms": int(deepep_num_sms) if deepep_num_sms else None,
    }
    slowest: dict[str, float | None] = dict.fromkeys(DEEPEP_TIMES)
    for j, name in enumerate(DEEPEP_TIMES):
        per_rank = None
        if deepep_us is not None:
            per_rank = _times(f"deepep_{name}_us", [r[j] for r in deepep_us])
            slowest[name] = max(per_rank)
        fields[f"deepep_{name}_us"] = slowest[name]
        fields[f"deepep_{name}_us_per_rank"] = per_rank
    measured = deepep_us is not None
    fields["deepep_dispatch_link_gbps"] = link_gbps(link, [slowest["dispatch"]]) if measured else None
    fields["dispatch_vs_deepep"] = max(ours_d) / slowest["dispatch"] if measured else None
    fields["combine_vs_deepep"] = max(ours_c) / slowest["combine"] if measured else None
    fields["deepep_skipped"] = deepep_skipped
    return fields


# --------------------------------------------------------------------------------------------------
# the results form: check, table, plot
# --------------------------------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _row_problems(row: Mapping[str, Any], required: Sequence[str]) -> list[str]:
    problems = [f"missing {k!r}" for k in required if k not in row]
    for k in required:
        if k not in row:
            continue
        v = row[k]
        if v is None:
            if k not in _NULLABLE:
                problems.append(f"{k!r} is None")
            continue
        if k in _TIMES and not (_is_number(v) and v > 0):
            problems.append(f"{k!r} must be a positive time (us), got {v!r}")
        elif k in ("tokens", "num_sms") and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            problems.append(f"{k!r} must be an integer >= 1, got {v!r}")
        elif k == "deepep_num_sms" and not (isinstance(v, int) and v >= 2 and v % 2 == 0):
            problems.append(f"'deepep_num_sms' must be an even integer >= 2 or None, got {v!r}")
        elif k == "layout" and v not in LAYOUTS:
            problems.append(f"'layout' must be one of {list(LAYOUTS)}, got {v!r}")
        elif k == "dispatch_link_gbps" and not (_is_number(v) and v >= 0):
            problems.append(f"'dispatch_link_gbps' must be a number >= 0, got {v!r}")
    # A DeepEP time left out must say why; a measured row has all of them.
    deepep = [k for k in required if k.startswith("deepep_") and k.endswith("_us") and k in row]
    missing = [k for k in deepep if row[k] is None]
    if missing:
        why = row.get("deepep_skipped")
        if not (isinstance(why, str) and why.strip()):
            problems.append(f"{missing[0]!r} is None without a 'deepep_skipped' reason")
        if len(missing) != len(deepep):
            problems.append(f"DeepEP measured in part: {missing} are None")
    return problems


def check_perf_json(
    obj: Any,
    required_fields: Sequence[str] = PERF_ROW_FIELDS,
    required_meta: Sequence[str] = PERF_META_FIELDS,
) -> None:
    """Check a results object ``{"meta": {...}, "rows": [...]}`` (as loaded from JSON); raise
    BenchReportError naming every problem of the first bad row (or of meta).

    Every key of ``required_meta`` in meta; at least one row; every key of ``required_fields`` in every
    row, with these rules where the key is required: times (``dispatch_us``, ``combine_us``, ``nccl_us``,
    ``deepep_*_us``) positive numbers, ``nccl_us`` / ``deepep_*`` None where not measured (a None DeepEP
    time needs a non-empty ``deepep_skipped``, and then every required DeepEP time is None); ``tokens`` and
    ``num_sms`` integers >= 1; ``deepep_num_sms`` even >= 2 or None; ``layout`` in LAYOUTS;
    ``dispatch_link_gbps`` >= 0."""
    if not isinstance(obj, Mapping):
        raise BenchReportError(f"a results object must be a JSON object, got {type(obj).__name__}")
    meta, rows = obj.get("meta"), obj.get("rows")
    if not isinstance(meta, Mapping):
        raise BenchReportError(f"'meta' must be an object, got {type(meta).__name__}")
    absent = [k for k in required_meta if k not in meta]
    if absent:
        raise BenchReportError(f"meta is missing key(s) {absent}")
    if not isinstance(rows, list) or not rows:
        raise BenchReportError(f"'rows' must be a non-empty list, got {rows!r:.60}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise BenchReportError(f"row {i} must be an object, got {type(row).__name__}")
        problems = _row_problems(row, required_fields)
        if problems:
            where = f"row {i} (tokens={row.get('tokens', '?')}, num_sms={row.get('num_sms', '?')})"
            raise BenchReportError(f"{where}: " + "; ".join(problems))


def load_results(path: str | Path, required_fields: Sequence[str] = PERF_ROW_FIELDS) -> dict[str, Any]:
    """Read a results JSON file and :func:`check_perf_json` it; raise BenchReportError naming the file and
    what is wrong."""
    import json

    try:
        obj = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BenchReportError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise BenchReportError(f"{path}: not JSON: {exc}") from exc
    try:
        check_perf_json(obj, required_fields)
    except BenchReportError as exc:
        raise BenchReportError(f"{path}: {exc}") from None
    return obj


# (header, width, value) of the peers table
_PEER_COLUMNS: tuple[tuple[str, int, Any], ...] = (
    ("routing", 8, lambda r: str(r.get("routing", "-"))),
    ("tokens", 6, lambda r: str(r["tokens"])),
    ("mode", 15, lambda r: str(r.get("mode", "-"))),
    ("sms", 4, lambda r: str(r["num_sms"])),
    ("ours d", 8, lambda r: f"{r['dispatch_us']:.1f}"),
    ("ours c", 8, lambda r: f"{r['combine_us']:.1f}"),
    ("link GB/s", 9, lambda r: f"{r['dispatch_link_gbps']:.1f}"),
    ("dep sms", 7, lambda r: "-" if r.get("deepep_num_sms") is None else str(r["deepep_num_sms"])),
    ("dep d", 8, lambda r: _or_skip(r, "deepep_dispatch_us", ".1f")),
    ("dep full", 8, lambda r: _or_skip(r, "deepep_full_dispatch_us", ".1f")),
    ("dep+perm", 8, lambda r: _or_skip(r, "deepep_dispatch_permute_us", ".1f")),
    ("dep c", 8, lambda r: _or_skip(r, "deepep_combine_us", ".1f")),
    ("dep link", 8, lambda r: _or_skip(r, "deepep_dispatch_link_gbps", ".1f")),
    ("nccl", 8, lambda r: "-" if r.get("nccl_us") is None else f"{r['nccl_us']:.1f}"),
)
PEER_TABLE_NOTE = (
    "us, slowest rank's median; ours d/c: our dispatch / combine at the row's SM budget (sms); link: "
    "distinct off-rank rows x row bytes / dispatch time (GB/s); dep: DeepEP at its budget (dep sms): "
    "d = cached-handle dispatch, full = layout + dispatch, +perm = dispatch + torch expert-major permute, "
    "c = combine (an FP8 row's d, full and +perm: DeepEP's with FP8 input); nccl: all_to_all_single of the "
    "dispatch rows"
)


def _or_skip(row: Mapping[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is not None:
        return format(value, fmt)
    return "skip" if row.get("deepep_skipped") else "-"


def format_peer_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Ours vs DeepEP vs NCCL, one line per row that has the results fields, then the note and each
    distinct reason DeepEP was skipped ("skip" in its columns)."""
    rows = [r for r in rows if "num_sms" in r]
    head = "  ".join(name.rjust(w) for name, w, _ in _PEER_COLUMNS)
    lines = [head, "-" * len(head)]
    lines += ["  ".join(fmt(r).rjust(w) for _, w, fmt in _PEER_COLUMNS) for r in rows]
    lines.append(PEER_TABLE_NOTE)
    for why in dict.fromkeys(r["deepep_skipped"] for r in rows if r.get("deepep_skipped")):
        lines.append(f"DeepEP skipped: {why}")
    return "\n".join(lines)


def plot_peers(report: Mapping[str, Any], png_path: str | Path) -> Path:
    """Time vs tokens per rank (log-log) for each SM budget: ours, DeepEP (at its budget) and NCCL.

    One row of panels per routing, dispatch on the left and combine on the right. Ours: solid, one
    colour per budget (one marker per mode; "+reduced" rows only on combine, "+fp8" and "+cached" only
    on dispatch); DeepEP: dashed (and, for dispatch, dotted: + the expert-major permute; stars: its FP8
    dispatch, where FP8 rows hold it); NCCL: black
    dash-dot (it takes no SM budget: the first budget's measurement). Rows without the results fields are
    ignored. Renders with the Agg canvas; returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [dict(r) for r in report["rows"] if "num_sms" in r]
    if not rows:
        raise BenchReportError(f"{png_path}: no row has the results fields (num_sms, ...)")
    meta = report.get("meta", {})
    routings = list(dict.fromkeys(r.get("routing", "-") for r in rows))
    budgets = list(dict.fromkeys(r["num_sms"] for r in rows))
    modes = list(dict.fromkeys(r.get("mode", "-") for r in rows))
    fig = Figure(figsize=(13, 4.6 * len(routings)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(routings), 2, squeeze=False)
    markers = ("o", "^", "D", "v", "P")

    def line(ax: Any, sel: list[dict], key: str, **style: Any) -> None:
        pts = sorted((r["tokens"], r[key]) for r in sel if r.get(key) is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)

    for row_axes, routing in zip(axes, routings, strict=True):
        for ax, op in zip(row_axes, ("dispatch", "combine"), strict=True):
            mine = [r for r in rows if r.get("routing", "-") == routing]
            for bi, b in enumerate(budgets):
                color = f"C{bi % 10}"
                at_b = [r for r in mine if r["num_sms"] == b]
                for mi, mode in enumerate(modes):
                    if (op == "dispatch" and "+reduced" in mode) or (
                            op == "combine" and ("+fp8" in mode or "+cached" in mode)):
                        continue
                    sel = [r for r in at_b if r.get("mode", "-") == mode]
                    label = f"cute-ep {b} SMs" + (f" ({mode})" if len(modes) > 1 else "")
                    line(ax, sel, f"{op}_us", color=color, marker=markers[mi % len(markers)], label=label)
                # DeepEP's numbers are the same on every bf16 mode row of one (routing, T, budget); an FP8
                # row holds its FP8 dispatches
                fp8_rows = [r for r in at_b if "+fp8" in r.get("mode", "-")]
                first = list({r["tokens"]: r for r in reversed(at_b) if r not in fp8_rows}.values())
                dep_sms = next((r["deepep_num_sms"] for r in first if r.get("deepep_num_sms")), "?")
                line(ax, first, f"deepep_{op}_us", color=color, linestyle="--", marker="s",
                     markerfacecolor="none", label=f"DeepEP {dep_sms} SMs")  # fmt: skip
                if op == "dispatch":
                    line(ax, first, "deepep_dispatch_permute_us", color=color, linestyle=":", marker="x",
                         label=f"DeepEP {dep_sms} SMs + permute")  # fmt: skip
                    fp8_first = list({r["tokens"]: r for r in reversed(fp8_rows)}.values())
                    line(ax, fp8_first, "deepep_dispatch_us", color=color, linestyle="--", marker="*",
                         label=f"DeepEP {dep_sms} SMs FP8")  # fmt: skip
            nccl_rows = list({r["tokens"]: r for r in reversed(mine) if r["num_sms"] == budgets[0]}.values())
            line(ax, nccl_rows, "nccl_us" if op == "dispatch" else "nccl_combine_us", color="black",
                 linestyle="-.", marker="s", markerfacecolor="none", label="NCCL all_to_all")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            toks = sorted({r["tokens"] for r in mine})
            ax.set_xticks(toks, [str(t) for t in toks])
            ax.minorticks_off()
            ax.set_xlabel("tokens per rank")
            ax.set_ylabel("us (slowest rank's median)")
            ax.set_title(f"{op} ({routing})")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
    skipped = next((r["deepep_skipped"] for r in rows if r.get("deepep_skipped")), None)
    fig.suptitle(
        f"{meta.get('device', '?')} x {meta.get('world_size', '?')}: H={meta.get('hidden', '?')}, "
        f"top-k={meta.get('topk', '?')}, E={meta.get('num_experts', '?')}, {meta.get('dtype', '?')}"
        + (f"\nDeepEP skipped: {skipped}" if skipped else "")
    )
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------------------------------
# the decode report (scripts/decode_breakdown.py): rows from per-rank medians, its check and tables
# --------------------------------------------------------------------------------------------------

DECODE_SCHEMA = "cute-ep-decode/1"
DECODE_COMBINES = ("pull", "reduced")
DECODE_KERNEL_TIMES = ("layout", "dispatch", "pull_combine", "reduced_combine")
"""Kernel times a rank measures (CUDA events): the layout kernel alone, layout + dispatch (what
``launch_dispatch`` enqueues), and each combine algorithm (``reduced_combine`` None on a "pull" buffer)."""
DECODE_API_TIMES = ("api_dispatch", "api_dispatch_nosync", "api_combine")
"""Wall times of the public calls from an idle GPU to their results: ``dispatch()``,
``dispatch(sync=False)``, ``combine()`` (the buffer's default algorithm)."""
DECODE_HOST_TIMES = (
    "dispatch_checks", "dispatch_enqueue", "dispatch_status", "combine_checks", "combine_enqueue",
)  # fmt: skip
"""The host's share of a public call, each part timed alone: argument checks, enqueueing the kernels,
and dispatch()'s status read (copy + sync on an idle GPU)."""
DECODE_MEASURED = (*DECODE_KERNEL_TIMES, *DECODE_API_TIMES, *DECODE_HOST_TIMES)
"""The keys of one rank's measurements for :func:`decode_row` (microseconds, this rank's medians)."""
DECODE_META_FIELDS = (*PERF_META_FIELDS, "iters")
DECODE_ROW_FIELDS = (
    "tokens",
    "num_sms",
    "combine_algorithm",
    "layout_us",
    "dispatch_us",
    "combine_us",
    "pull_combine_us",
    "reduced_combine_us",
    "api_dispatch_us",
    "api_dispatch_nosync_us",
    "api_combine_us",
    "api_dispatch_host_us",
    "api_combine_host_us",
    *(f"{n}_us" for n in DECODE_HOST_TIMES),
    "deepep_num_sms",
    *(f"deepep_{n}_us" for n in DEEPEP_TIMES),
    "deepep_skipped",
)
"""Every row of a decode report holds these (see :func:`decode_row` for their meaning)."""
# Row fields that check_perf_json already checks by its rules (times, nullable DeepEP times with a reason).
_DECODE_PERF_CHECKED = ("tokens", "num_sms", "dispatch_us", "combine_us", "deepep_num_sms",
                        *(f"deepep_{n}_us" for n in DEEPEP_TIMES))  # fmt: skip
_DECODE_POSITIVE = ("layout_us", "pull_combine_us", "reduced_combine_us", "api_dispatch_us",
                    "api_dispatch_nosync_us", "api_combine_us")  # fmt: skip


def _slowest(name: str, per_rank: Sequence[Any], *, positive: bool, nullable: bool) -> tuple[Any, Any]:
    """(max over ranks, the per-rank list) of one measurement; (None, None) when every rank has None.

    Every rank times the same collective steps, so a value on some ranks and None on others is a bug
    in the caller, not a skip."""
    if nullable and all(v is None for v in per_rank):
        return None, None
    vals = []
    for r, v in enumerate(per_rank):
        if not _is_number(v) or v < 0 or (positive and v == 0):
            want = "a positive time" if positive else "a time >= 0"
            raise BenchReportError(f"{name}: rank {r}'s median must be {want} (us), got {v!r}")
        vals.append(float(v))
    return max(vals), vals


def decode_row(
    *,
    tokens: int,
    num_sms: int,
    combine_algorithm: str,
    per_rank: Sequence[Mapping[str, float | None]],
    deepep_us: Sequence[Sequence[float]] | None,
    deepep_skipped: str | None,
) -> dict[str, Any]:
    """One row of the decode report from every rank's medians (each list indexed by rank).

    per_rank[r]: rank r's medians (us) for every key of ``DECODE_MEASURED`` (``reduced_combine`` None on
    every rank when ``combine_algorithm`` is "pull": that buffer cannot run it). deepep_us[r]: rank r's
    DeepEP medians in ``DEEPEP_TIMES`` order, or None with ``deepep_skipped`` the reason. Returns:

    * tokens, num_sms (our SM budget), combine_algorithm (the buffer's default combine);
    * ``<name>_us`` for every measured name: the slowest rank's median (kernels: CUDA events; public
      calls and host parts: wall time), each field's own slowest rank; ``combine_us`` = the default
      algorithm's kernel time (what ``combine()`` runs);
    * api_dispatch_host_us / api_combine_host_us: public call minus its kernels (dispatch_us /
      combine_us), the host's share (may be slightly negative: separate measurements);
    * deepep_num_sms (``deepep_num_sms(num_sms)``, None when no even count), ``deepep_<name>_us`` (slowest
      rank) for ``DEEPEP_TIMES`` and dispatch_vs_deepep / combine_vs_deepep (ours / DeepEP's cached
      dispatch and combine; < 1: ours faster), all None when skipped; deepep_skipped: None or the reason;
    * per_rank: {field: [value per rank]} for every measured field.

    Raises BenchReportError for inconsistent input (ranks missing a key, a non-positive kernel time,
    DeepEP both measured and skipped, ...)."""
    if combine_algorithm not in DECODE_COMBINES:
        raise BenchReportError(
            f"combine_algorithm must be one of {list(DECODE_COMBINES)}, got {combine_algorithm!r}"
        )
    if not per_rank:
        raise BenchReportError("decode_row needs the measurements of at least one rank")
    for r, m in enumerate(per_rank):
        missing = [k for k in DECODE_MEASURED if k not in m]
        if missing:
            raise BenchReportError(f"rank {r}'s measurements lack {missing}")
    if (deepep_us is None) == (deepep_skipped is None):
        raise BenchReportError("give either DeepEP's times or the reason it was skipped, not both or neither")
    if deepep_skipped is not None and not (isinstance(deepep_skipped, str) and deepep_skipped.strip()):
        raise BenchReportError(f"deepep_skipped must be a non-empty reason, got {deepep_skipped!r}")
    row: dict[str, Any] = {
        "tokens": int(tokens), "num_sms": int(num_sms), "combine_algorithm": combine_algorithm,
    }  # fmt: skip
    spread: dict[str, list[float]] = {}
    for name in DECODE_MEASURED:
        values = [m[name] for m in per_rank]
        host_part = name in DECODE_HOST_TIMES
        slowest, vals = _slowest(f"{name}_us", values, positive=not host_part,
                                 nullable=name == "reduced_combine")  # fmt: skip
        row[f"{name}_us"] = slowest
        if vals is not None:
            spread[f"{name}_us"] = vals
    if (row["reduced_combine_us"] is None) != (combine_algorithm == "pull"):
        raise BenchReportError(
            "reduced_combine must be measured exactly when the buffer's combine_algorithm is 'reduced' "
            f"(got {row['reduced_combine_us']!r} with {combine_algorithm!r})"
        )
    row["combine_us"] = row[f"{combine_algorithm}_combine_us"]
    row["api_dispatch_host_us"] = row["api_dispatch_us"] - row["dispatch_us"]
    row["api_combine_host_us"] = row["api_combine_us"] - row["combine_us"]
    row["deepep_num_sms"] = deepep_num_sms(num_sms) or None
    for j, name in enumerate(DEEPEP_TIMES):
        slowest = None
        if deepep_us is not None:
            if len(deepep_us) != len(per_rank):
                raise BenchReportError(f"DeepEP times for {len(deepep_us)} ranks, ours for {len(per_rank)}")
            slowest, vals = _slowest(f"deepep_{name}_us", [r[j] for r in deepep_us], positive=True,
                                     nullable=False)  # fmt: skip
            spread[f"deepep_{name}_us"] = vals
        row[f"deepep_{name}_us"] = slowest
    measured = deepep_us is not None
    row["dispatch_vs_deepep"] = row["dispatch_us"] / row["deepep_dispatch_us"] if measured else None
    row["combine_vs_deepep"] = row["combine_us"] / row["deepep_combine_us"] if measured else None
    row["deepep_skipped"] = deepep_skipped
    # DECODE_ROW_FIELDS' order first (a reader of the JSON sees combine_us beside dispatch_us), then the rest.
    out = {k: row.pop(k) for k in DECODE_ROW_FIELDS}
    out.update(row)
    out["per_rank"] = spread
    return out


def _decode_row_problems(row: Mapping[str, Any]) -> list[str]:
    """What check_perf_json's rules do not cover in a decode row."""
    problems = [f"missing {k!r}" for k in DECODE_ROW_FIELDS if k not in row]
    if problems:
        return problems
    alg = row["combine_algorithm"]
    if alg not in DECODE_COMBINES:
        problems.append(f"'combine_algorithm' must be one of {list(DECODE_COMBINES)}, got {alg!r}")
    for k in _DECODE_POSITIVE:
        v = row[k]
        if v is None and k == "reduced_combine_us" and alg == "pull":
            continue  # a "pull" buffer cannot run the reduced combine
        if not (_is_number(v) and v > 0):
            problems.append(f"{k!r} must be a positive time (us), got {v!r}")
    for n in DECODE_HOST_TIMES:
        v = row[f"{n}_us"]
        if not (_is_number(v) and v >= 0):
            problems.append(f"'{n}_us' must be a time >= 0 (us), got {v!r}")
    for k in ("api_dispatch_host_us", "api_combine_host_us"):
        if not _is_number(row[k]):
            problems.append(f"{k!r} must be a number (us), got {row[k]!r}")
    if alg in DECODE_COMBINES and row.get(f"{alg}_combine_us") != row["combine_us"]:
        problems.append(f"'combine_us' ({row['combine_us']!r}) must be the default combine's time "
                        f"'{alg}_combine_us' ({row.get(f'{alg}_combine_us')!r})")  # fmt: skip
    why = row["deepep_skipped"]
    if why is not None and not (isinstance(why, str) and why.strip()):
        problems.append(f"'deepep_skipped' must be None or a non-empty reason, got {why!r}")
    if why is not None and row["deepep_dispatch_us"] is not None:
        problems.append(f"DeepEP has times and a skip reason ({why!r})")
    return problems


def check_decode_json(obj: Any, *, tokens: Iterable[int] = (), num_sms: Iterable[int] = ()) -> None:
    """Check a decode report ``{"meta": {...}, "rows": [...]}`` (as loaded from JSON); raise
    BenchReportError naming the first problem found.

    :func:`check_perf_json`'s rules for the fields it knows (meta ``DECODE_META_FIELDS``; tokens,
    num_sms, dispatch_us, combine_us, deepep_num_sms and the DeepEP times, None only with a reason),
    then per row: every key of ``DECODE_ROW_FIELDS``; kernel and public-call times positive
    (``reduced_combine_us`` None only on a "pull" buffer); host parts >= 0; combine_us the default
    algorithm's time; DeepEP either measured or skipped with a reason. One row per (tokens, num_sms);
    with ``tokens`` / ``num_sms`` given, a row for each pair of them must be present."""
    check_perf_json(obj, _DECODE_PERF_CHECKED, DECODE_META_FIELDS)
    if "schema" in obj and obj["schema"] != DECODE_SCHEMA:
        raise BenchReportError(f"schema is {obj['schema']!r}, expected {DECODE_SCHEMA!r}")
    iters = obj["meta"]["iters"]
    if not (isinstance(iters, int) and not isinstance(iters, bool) and iters >= 1):
        raise BenchReportError(f"meta 'iters' must be an integer >= 1, got {iters!r}")
    seen: dict[tuple[int, int], int] = {}
    for i, row in enumerate(obj["rows"]):
        problems = _decode_row_problems(row)
        if problems:
            raise BenchReportError(f"row {i} (tokens={row['tokens']}, num_sms={row['num_sms']}): "
                                   + "; ".join(problems))  # fmt: skip
        key = (row["tokens"], row["num_sms"])
        if key in seen:
            raise BenchReportError(f"rows {seen[key]} and {i} are both tokens={key[0]}, num_sms={key[1]}")
        seen[key] = i
    want = [(t, n) for t in tokens for n in num_sms]
    missing = [p for p in want if p not in seen]
    if missing:
        raise BenchReportError(f"no row for (tokens, num_sms) {missing}; the report has {sorted(seen)}")


def write_decode_json(path: str | Path, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict:
    """Check (:func:`check_decode_json`) and write ``{"schema", "meta", "rows"}`` to ``path``
    (``bench_report.write_json_file``: a reader never sees half a report). Returns it."""
    report = {"schema": DECODE_SCHEMA, "meta": dict(meta), "rows": [dict(r) for r in rows]}
    check_decode_json(report)
    write_json_file(path, report)
    return report


def _us(row: Mapping[str, Any], key: str) -> str:
    v = row.get(key)
    return "-" if v is None else f"{v:.1f}"


def _dep(row: Mapping[str, Any], key: str) -> str:
    v = row.get(key)
    if v is not None:
        return f"{v:.1f}"
    return "skip" if row.get("deepep_skipped") else "-"


def format_decode_progress(row: Mapping[str, Any]) -> str:
    """One line for a decode row just measured (kernels, public calls, DeepEP)."""
    head = (
        f"[T={row['tokens']} num_sms={row['num_sms']}] kernels: dispatch {_us(row, 'dispatch_us')} "
        f"(layout {_us(row, 'layout_us')}), combine {_us(row, 'combine_us')} ({row['combine_algorithm']}); "
        f"calls: dispatch() {_us(row, 'api_dispatch_us')}, combine() {_us(row, 'api_combine_us')}; "
    )
    if row.get("deepep_skipped"):
        return head + f"DeepEP skipped: {row['deepep_skipped']}"
    return head + (
        f"DeepEP ({row['deepep_num_sms']} SMs): dispatch {_us(row, 'deepep_dispatch_us')}, full "
        f"{_us(row, 'deepep_full_dispatch_us')}, combine {_us(row, 'deepep_combine_us')}"
    )


DECODE_TABLE_NOTE = (
    "us, slowest rank's median; dispatch call = layout + dispatch kernels (launch_dispatch), dispatch "
    "kernels = that minus the layout; dep: DeepEP at its SM budget (dep sms): d = cached-handle dispatch, "
    "full = layout + dispatch (host sync included), c = combine"
)
DECODE_CALLS_NOTE = (
    "wall: from an idle GPU to the results (median); kernels: the call's kernels from the first table "
    "(combine: the buffer's default algorithm); host = wall - kernels; checks / enqueue / status read: "
    "each part timed alone; DeepEP: its full dispatch (layout + dispatch, host sync) and its combine"
)


def format_decode_tables(rows: Sequence[Mapping[str, Any]]) -> str:
    """The kernel table and the public-call table of the decode report, with DeepEP's columns, their
    notes, and each distinct reason DeepEP was skipped."""
    kern_head = (f"{'sms':>4} {'tokens':>7} {'layout':>8} {'dispatch call':>14} {'dispatch kernels':>17} "
                 f"{'pull combine':>13} {'reduced combine':>16} {'dep sms':>7} {'dep d':>8} {'dep full':>8} "
                 f"{'dep c':>8}")  # fmt: skip
    lines = [kern_head]
    for r in rows:
        d_only = "-" if r.get("dispatch_us") is None else f"{r['dispatch_us'] - r['layout_us']:.1f}"
        dep_sms = "-" if r.get("deepep_num_sms") is None else str(r["deepep_num_sms"])
        lines.append(
            f"{r['num_sms']:>4} {r['tokens']:>7} {_us(r, 'layout_us'):>8} {_us(r, 'dispatch_us'):>14} "
            f"{d_only:>17} {_us(r, 'pull_combine_us'):>13} {_us(r, 'reduced_combine_us'):>16} {dep_sms:>7} "
            f"{_dep(r, 'deepep_dispatch_us'):>8} {_dep(r, 'deepep_full_dispatch_us'):>8} "
            f"{_dep(r, 'deepep_combine_us'):>8}"
        )
    lines += [DECODE_TABLE_NOTE, ""]
    lines.append(f"{'sms':>4} {'tokens':>7} {'call':>20} {'wall':>8} {'kernels':>8} {'host':>8} "
                 f"{'checks':>8} {'enqueue':>8} {'status read':>12} {'DeepEP':>8}")  # fmt: skip
    for r in rows:
        calls = (
            ("dispatch()", "api_dispatch_us", "dispatch_us", "dispatch", "dispatch_status_us",
             "deepep_full_dispatch_us"),
            ("dispatch(sync=False)", "api_dispatch_nosync_us", "dispatch_us", "dispatch", None, None),
            ("combine()", "api_combine_us", "combine_us", "combine", None, "deepep_combine_us"),
        )  # fmt: skip
        for name, wall, kern, part, status, dep in calls:
            host = f"{r[wall] - r[kern]:.1f}"
            lines.append(
                f"{r['num_sms']:>4} {r['tokens']:>7} {name:>20} {_us(r, wall):>8} {_us(r, kern):>8} "
                f"{host:>8} {_us(r, f'{part}_checks_us'):>8} {_us(r, f'{part}_enqueue_us'):>8} "
                f"{_us(r, status) if status else '-':>12} {_dep(r, dep) if dep else '-':>8}"
            )
    lines.append(DECODE_CALLS_NOTE)
    for why in dict.fromkeys(r["deepep_skipped"] for r in rows if r.get("deepep_skipped")):
        lines.append(f"DeepEP skipped: {why}")
    return "\n".join(lines)
