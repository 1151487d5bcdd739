"""Metrics, JSON report, table and plot of ``scripts/benchmark.py`` (pure Python + numpy; CPU-testable).

The one bandwidth formula (``docs/design.md``, "Measuring"):

* ``pairs_off`` = this rank's non-dropped (token, k) pairs whose expert lives on another rank.
* ``rows_off`` = this rank's distinct (token, destination rank) pairs over those: the rows dispatch
  sends (a token's row crosses the link once per distinct destination rank; the receiver copies it
  to that rank's other slots).
* algorithmic bandwidth = pairs_off * H * element bytes / time, for dispatch and for combine
  (GB/s = 1e9 bytes per second). Dispatch sends a token once per destination rank, so it moves
  fewer bytes than this and its algorithmic rate may exceed the link rate.
* bytes our kernels actually move per rank: dispatch = rows_off * H * b + 12 * pairs_off (each
  distinct row once, and per off-rank pair its fp32 weight, int32 source tag and int32 from-slot),
  combine = pairs_off * H * b; their rate is also reported as a percentage of the NVLink4 line rate
  (450 GB/s per direction per GPU).
* NCCL baseline: ``all_to_all_single`` moving exactly those rows; ratio = NCCL time / our time. A run
  without the NCCL peer (``scripts/benchmark.py --peers deepep``) writes None in every ``nccl_*`` and
  ``*_ratio`` field (the keys stay, so the schema is unchanged).

A report is ``{"schema": SCHEMA, "meta": {...}, "rows": [{...}, ...]}``; ``META_KEYS`` and
``ROW_KEYS`` (the fields of :class:`BenchRow`) are required, extra keys are kept. No GPU import here:
matplotlib is imported inside :func:`plot` only.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cute_ep._version import git_sha, package_versions
from cute_ep.tools.usage import script_parser  # re-exported: the scripts take it from here too

__all__ = [
    "META_KEYS",
    "NVLINK4_LINE_RATE_GBPS",
    "OPTIONAL_ROW_KEYS",
    "ROW_KEYS",
    "SCHEMA",
    "TAG_BYTES",
    "BenchReportError",
    "BenchRow",
    "bandwidth_gbps",
    "check_writable",
    "combine_moved_bytes",
    "dispatch_moved_bytes",
    "format_row",
    "format_table",
    "git_sha",
    "load_json",
    "median",
    "package_versions",
    "pairs_off",
    "parse_int_list",
    "parse_name_list",
    "plot",
    "rows_off",
    "script_parser",
    "split_sizes",
    "table_header",
    "utc_timestamp",
    "write_json",
    "write_json_file",
]


SCHEMA = "cute-ep-bench/1"
NVLINK4_LINE_RATE_GBPS = 450.0  # H100/H200 NVLink4: 18 links x 25 GB/s, per direction
# Dispatch metadata per off-rank (token, k) pair, besides the (de-duplicated) row: fp32 weight,
# int32 source tag and int32 from-slot (where the receiver finds the row if another k sent it).
TAG_BYTES = 12
META_KEYS = (
    "device",
    "world_size",
    "local_world_size",
    "config",
    "symmetric_bytes",
    "line_rate_gbps",
    "versions",
    "git_sha",
    "timestamp",
    "command",
)


class BenchReportError(ValueError):
    """A benchmark report (or an argument of these helpers) that does not have the expected form."""


# --------------------------------------------------------------------------------------------------
# routing metrics
# --------------------------------------------------------------------------------------------------


def _expert_ids(topk_idx: Any, experts_per_rank: int) -> np.ndarray:
    """A [T, K] array of expert ids (-1 dropped), checked, as int64 (same shape)."""
    if experts_per_rank < 1:
        raise BenchReportError(f"experts_per_rank must be >= 1, got {experts_per_rank}")
    ids = np.asarray(topk_idx)
    if ids.ndim != 2:
        raise BenchReportError(f"topk_idx must be 2-D [T, K], got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise BenchReportError(f"topk_idx must hold integers, got {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and int(ids.min()) < -1:
        raise BenchReportError(f"topk_idx values must be >= -1 (-1: dropped), got {int(ids.min())}")
    return ids


def _routing(topk_idx: Any, experts_per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(owner rank of every non-dropped pair, expert id of it), flat, from a [T, K] array of expert ids
    (-1 dropped)."""
    ids = _expert_ids(topk_idx, experts_per_rank).reshape(-1)
    kept = ids[ids >= 0]
    return kept // experts_per_rank, kept


def pairs_off(topk_idx: Any, rank: int, experts_per_rank: int) -> int:
    """Non-dropped (t, k) pairs of ``topk_idx`` ([T, K], any integer array) whose expert's owner
    (expert // experts_per_rank) is not ``rank``."""
    owners, _ = _routing(topk_idx, experts_per_rank)
    return int(np.count_nonzero(owners != rank))


def rows_off(topk_idx: Any, rank: int, experts_per_rank: int) -> int:
    """Distinct (t, owner) pairs of ``topk_idx`` ([T, K], any integer array) over its non-dropped
    entries with owner (expert // experts_per_rank) not ``rank``: the rows dispatch sends off-rank."""
    ids = _expert_ids(topk_idx, experts_per_rank)
    owners = np.where(ids >= 0, ids // experts_per_rank, -1)
    owners[owners == rank] = -1  # to self (or dropped): no row crosses a link
    if owners.size == 0:
        return 0
    owners.sort(axis=1)
    first = np.ones(owners.shape, dtype=bool)
    first[:, 1:] = owners[:, 1:] != owners[:, :-1]
    return int(np.count_nonzero(first & (owners >= 0)))


def split_sizes(topk_idx: Any, world_size: int, experts_per_rank: int) -> list[int]:
    """Pairs per destination rank (dropped excluded, self included): the all_to_all split sizes."""
    if world_size < 1:
        raise BenchReportError(f"world_size must be >= 1, got {world_size}")
    owners, kept = _routing(topk_idx, experts_per_rank)
    if owners.size and int(owners.max()) >= world_size:
        raise BenchReportError(
            f"expert {int(kept.max())} is owned by rank {int(owners.max())}, outside world_size={world_size} "
            f"({experts_per_rank} experts per rank)"
        )
    return [int(c) for c in np.bincount(owners, minlength=world_size)]


def bandwidth_gbps(nbytes: float, seconds: float) -> float:
    """nbytes / seconds in GB/s (1 GB = 1e9 bytes)."""
    if nbytes < 0:
        raise BenchReportError(f"nbytes must be >= 0, got {nbytes}")
    if not seconds > 0:
        raise BenchReportError(f"seconds must be > 0, got {seconds}")
    return nbytes / seconds / 1e9


def dispatch_moved_bytes(rows: float, pairs: float, row_bytes: int) -> float:
    """Bytes our dispatch moves off-rank: each distinct (token, destination rank) row once
    (``rows``, see :func:`rows_off`), plus TAG_BYTES of metadata per off-rank pair (``pairs``)."""
    return rows * row_bytes + pairs * TAG_BYTES


def combine_moved_bytes(pairs: float, row_bytes: int) -> float:
    """Bytes our combine moves off-rank: each off-rank pair's expert-output row (the pull combine); for
    the reduced combine pass the distinct (token, rank) groups off-rank (rows_off): one partial row each."""
    return pairs * row_bytes


def gpu_share_meta(runtime: Any) -> dict[str, Any]:
    """A report's record of how the ranks use their GPUs: ``ranks_per_gpu`` (ranks on this rank's GPU;
    None without a GPU) and ``shared_gpu`` (None when every rank has a GPU to itself, else the sentence
    that says how to read the report: the "link" is the GPU's own memory, not NVLink)."""
    placement = getattr(runtime, "placement", None)  # a started nvshmem Runtime's (bootstrap/gpu_share.py)
    if placement is None:
        return {"ranks_per_gpu": None, "shared_gpu": None}
    note = None
    if placement.shared:
        note = (f"shared GPU: {placement.ranks_per_gpu} ranks per GPU under CUDA MPS, each at its share of "
                f"the SMs; peers exchange rows through the GPU's own memory, not NVLink")
    return {"ranks_per_gpu": placement.ranks_per_gpu, "shared_gpu": note}


def median(values: Iterable[float]) -> float:
    """Median of a non-empty sequence of numbers (mean of the middle two for an even count)."""
    vals = sorted(float(v) for v in values)
    if not vals:
        raise BenchReportError("median of an empty sequence")
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


# --------------------------------------------------------------------------------------------------
# rows
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One (routing, tokens per rank, mode) measurement: what was measured and what follows from it.

    Times are microseconds. ``*_per_rank`` lists are indexed by rank: each rank's median over the
    timed iterations. ``dispatch_us`` etc. are the slowest rank's median (the collective is done
    when its slowest rank is), ``*_min`` / ``*_max`` the fastest and slowest ranks' medians.
    ``pairs_off`` and ``rows_off`` per rank are means over the input sets. Bandwidths (GB/s) divide
    the mean over ranks of the bytes (algorithmic: ``pairs_off`` rows; dispatch moved: ``rows_off``
    rows and ``pairs_off`` metadata) by the slowest rank's median; ``*_line_pct`` is the moved rate as a
    percentage of ``line_rate_gbps``; ``*_ratio`` = NCCL time / our time (> 1: we are faster).
    ``checked``: a bit-exact dispatch + combine round passed before timing (False: not checked).
    """

    routing: str
    tokens: int
    mode: str
    checked: bool
    row_bytes: int
    line_rate_gbps: float
    pairs_off: list[float]
    pairs_off_mean: float
    rows_off: list[float]
    rows_off_mean: float
    dispatch_us: float
    dispatch_us_min: float
    dispatch_us_max: float
    dispatch_us_per_rank: list[float]
    combine_us: float
    combine_us_min: float
    combine_us_max: float
    combine_us_per_rank: list[float]
    # None (all eight, and the NCCL rates and ratios below) when NCCL was not measured
    nccl_dispatch_us: float | None
    nccl_dispatch_us_min: float | None
    nccl_dispatch_us_max: float | None
    nccl_dispatch_us_per_rank: list[float] | None
    nccl_combine_us: float | None
    nccl_combine_us_min: float | None
    nccl_combine_us_max: float | None
    nccl_combine_us_per_rank: list[float] | None
    dispatch_alg_gbps: float
    combine_alg_gbps: float
    dispatch_moved_gbps: float
    combine_moved_gbps: float
    dispatch_line_pct: float
    combine_line_pct: float
    nccl_dispatch_gbps: float | None
    nccl_combine_gbps: float | None
    dispatch_ratio: float | None
    combine_ratio: float | None
    # FP8 dispatch rows (mode "<mode>+fp8"): bytes of one packed row, which dispatch and the NCCL
    # baseline move (0: a row of the input dtype, ``row_bytes``). Optional in reports.
    dispatch_row_bytes: int = 0

    @classmethod
    def from_measurements(
        cls,
        *,
        routing: str,
        tokens: int,
        mode: str,
        checked: bool,
        row_bytes: int,
        pairs_off: Sequence[float],
        rows_off: Sequence[float],
        dispatch_us: Sequence[float],
        combine_us: Sequence[float],
        nccl_dispatch_us: Sequence[float] | None,
        nccl_combine_us: Sequence[float] | None,
        line_rate_gbps: float = NVLINK4_LINE_RATE_GBPS,
        dispatch_row_bytes: int = 0,
        reduced_combine: bool = False,
    ) -> BenchRow:
        """Build a row from per-rank values (each sequence indexed by rank, all the same length).

        dispatch_row_bytes: bytes per row that dispatch and NCCL's dispatch baseline really move when
        they differ from ``row_bytes`` (FP8 packed rows); the algorithmic bandwidth keeps ``row_bytes``
        (the rows the application hands over), the moved bytes and NCCL's rate use the packed size.
        reduced_combine: the combine moved one partial row per off-rank (token, rank) group (rows_off),
        not one row per off-rank pair.
        nccl_dispatch_us / nccl_combine_us: None (both) when NCCL was not measured: its times, rates and
        the ratios are then None."""
        if (nccl_dispatch_us is None) != (nccl_combine_us is None):
            raise BenchReportError("nccl_dispatch_us and nccl_combine_us must both be given or both be None")
        with_nccl = nccl_dispatch_us is not None
        per_rank = {
            "pairs_off": [float(v) for v in pairs_off],
            "rows_off": [float(v) for v in rows_off],
            "dispatch_us": [float(v) for v in dispatch_us],
            "combine_us": [float(v) for v in combine_us],
        }
        if with_nccl:
            per_rank["nccl_dispatch_us"] = [float(v) for v in nccl_dispatch_us]
            per_rank["nccl_combine_us"] = [float(v) for v in nccl_combine_us]
        world = len(per_rank["pairs_off"])
        if world == 0 or any(len(v) != world for v in per_rank.values()):
            raise BenchReportError(
                "per-rank sequences must be non-empty and of one length, got lengths "
                + ", ".join(f"{k}={len(v)}" for k, v in per_rank.items())
            )
        counts = ("pairs_off", "rows_off")
        for name, vals in per_rank.items():
            if name not in counts and any(not (v > 0 and math.isfinite(v)) for v in vals):
                raise BenchReportError(f"{name} must be positive finite times, got {vals}")
        for name in counts:
            if any(not (v >= 0 and math.isfinite(v)) for v in per_rank[name]):
                raise BenchReportError(f"{name} must be >= 0, got {per_rank[name]}")

        mean_pairs = sum(per_rank["pairs_off"]) / world
        mean_rows = sum(per_rank["rows_off"]) / world
        alg_bytes = mean_pairs * row_bytes
        times = {k: v for k, v in per_rank.items() if k not in counts}
        slowest = {k: max(v) for k, v in times.items()}

        def gbps(nbytes: float, key: str) -> float | None:
            return bandwidth_gbps(nbytes, slowest[key] * 1e-6) if key in slowest else None

        def ratio(op: str) -> float | None:
            return slowest[f"nccl_{op}_us"] / slowest[f"{op}_us"] if with_nccl else None

        d_row = dispatch_row_bytes or row_bytes
        d_moved = gbps(dispatch_moved_bytes(mean_rows, mean_pairs, d_row), "dispatch_us")
        c_rows = mean_rows if reduced_combine else mean_pairs
        c_moved = gbps(combine_moved_bytes(c_rows, row_bytes), "combine_us")
        fields: dict[str, Any] = {
            "routing": routing,
            "tokens": int(tokens),
            "mode": mode,
            "checked": bool(checked),
            "row_bytes": int(row_bytes),
            "line_rate_gbps": float(line_rate_gbps),
            "pairs_off": per_rank["pairs_off"],
            "pairs_off_mean": mean_pairs,
            "rows_off": per_rank["rows_off"],
            "rows_off_mean": mean_rows,
            "dispatch_alg_gbps": gbps(alg_bytes, "dispatch_us"),
            "combine_alg_gbps": gbps(alg_bytes, "combine_us"),
            "dispatch_moved_gbps": d_moved,
            "combine_moved_gbps": c_moved,
            "dispatch_line_pct": 100.0 * d_moved / line_rate_gbps,
            "combine_line_pct": 100.0 * c_moved / line_rate_gbps,
            "nccl_dispatch_gbps": gbps(mean_pairs * d_row, "nccl_dispatch_us"),
            "nccl_combine_gbps": gbps(alg_bytes, "nccl_combine_us"),
            "dispatch_ratio": ratio("dispatch"),
            "combine_ratio": ratio("combine"),
            "dispatch_row_bytes": int(dispatch_row_bytes),
        }
        for key, vals in times.items():
            fields[key] = max(vals)
            fields[f"{key}_min"] = min(vals)
            fields[f"{key}_max"] = max(vals)
            fields[f"{key}_per_rank"] = vals
        if not with_nccl:
            for op in ("dispatch", "combine"):
                for suffix in ("", "_min", "_max", "_per_rank"):
                    fields[f"nccl_{op}_us{suffix}"] = None
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ROW_KEYS = tuple(f.name for f in dataclasses.fields(BenchRow) if f.default is dataclasses.MISSING)
"""Keys every row of a report must hold (rows written before optional keys existed stay readable)."""
OPTIONAL_ROW_KEYS = tuple(f.name for f in dataclasses.fields(BenchRow) if f.name not in ROW_KEYS)


def _row_dict(row: BenchRow | Mapping[str, Any]) -> dict[str, Any]:
    return row.to_dict() if isinstance(row, BenchRow) else dict(row)


# --------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------


def _describe_row(row: Mapping[str, Any]) -> str:
    return f"({row.get('routing', '?')}, tokens={row.get('tokens', '?')}, mode={row.get('mode', '?')})"


def _check_report(report: Any, where: str) -> None:
    if not isinstance(report, Mapping):
        raise BenchReportError(f"{where}: a report must be a JSON object, got {type(report).__name__}")
    missing_top = [k for k in ("schema", "meta", "rows") if k not in report]
    if missing_top:
        raise BenchReportError(f"{where}: missing top-level key(s) {missing_top}")
    if report["schema"] != SCHEMA:
        raise BenchReportError(f"{where}: schema is {report['schema']!r}, expected {SCHEMA!r}")
    meta, rows = report["meta"], report["rows"]
    if not isinstance(meta, Mapping):
        raise BenchReportError(f"{where}: 'meta' must be an object, got {type(meta).__name__}")
    missing_meta = [k for k in META_KEYS if k not in meta]
    if missing_meta:
        raise BenchReportError(f"{where}: meta is missing key(s) {missing_meta}")
    if not isinstance(rows, list):
        raise BenchReportError(f"{where}: 'rows' must be a list, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise BenchReportError(f"{where}: row {i} must be an object, got {type(row).__name__}")
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise BenchReportError(f"{where}: row {i} {_describe_row(row)} is missing key(s) {missing}")


def write_json(
    path: str | os.PathLike, meta: Mapping[str, Any], rows: Sequence[BenchRow | Mapping[str, Any]]
) -> dict[str, Any]:
    """Validate and write ``{"schema", "meta", "rows"}`` to ``path`` (parents made; written to a
    temporary file first, then renamed, so a reader never sees half a report). Returns the report."""
    report = {"schema": SCHEMA, "meta": dict(meta), "rows": [_row_dict(r) for r in rows]}
    _check_report(report, str(path))
    write_json_file(path, report)
    return report


def write_json_file(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    """Write ``report`` as JSON to ``path`` (parents made; written to a temporary file first, then
    renamed, so a reader never sees half a report). NaN and infinities are refused."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def load_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a report written by :func:`write_json`; raise :class:`BenchReportError` naming what is
    missing or malformed (not JSON, another schema, a meta or row key absent)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise BenchReportError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        report = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchReportError(f"{path}: not JSON: {exc}") from exc
    _check_report(report, str(path))
    return report


# --------------------------------------------------------------------------------------------------
# table
# --------------------------------------------------------------------------------------------------


def _num(row: Mapping[str, Any], key: str, fmt: str) -> str:
    """``row[key]`` formatted, or "-" where the row has no value (an older report, a peer not measured)."""
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


# (header, width, format of the row's values)
_COLUMNS: tuple[tuple[str, int, Any], ...] = (
    ("routing", 8, lambda r: str(r["routing"])),
    ("tokens", 6, lambda r: str(r["tokens"])),
    ("mode", 7, lambda r: str(r["mode"])),
    ("sms", 4, lambda r: _num(r, "num_sms", "d")),  # the row's SM budget (scripts/benchmark.py --num-sms)
    ("chk", 3, lambda r: "yes" if r["checked"] else "-"),
    ("disp us", 8, lambda r: f"{r['dispatch_us']:.1f}"),
    ("comb us", 8, lambda r: f"{r['combine_us']:.1f}"),
    ("disp alg", 8, lambda r: f"{r['dispatch_alg_gbps']:.1f}"),
    ("comb alg", 8, lambda r: f"{r['combine_alg_gbps']:.1f}"),
    ("disp moved", 13, lambda r: f"{r['dispatch_moved_gbps']:.1f} ({r['dispatch_line_pct']:.0f}%)"),
    ("comb moved", 13, lambda r: f"{r['combine_moved_gbps']:.1f} ({r['combine_line_pct']:.0f}%)"),
    ("nccl d us", 9, lambda r: _num(r, "nccl_dispatch_us", ".1f")),
    ("nccl c us", 9, lambda r: _num(r, "nccl_combine_us", ".1f")),
    ("ratio d", 7, lambda r: _num(r, "dispatch_ratio", ".2f")),
    ("ratio c", 7, lambda r: _num(r, "combine_ratio", ".2f")),
)
TABLE_NOTE = (
    "us: slowest rank's median; alg/moved: GB/s (1e9 B/s) from the mean over ranks of off-rank pairs "
    "(disp moved: distinct rows + 12 B per pair); %: of the line rate; ratio: NCCL time / ours "
    "(> 1: faster than NCCL); sms: the SM budget (num_sms); -: not measured"
)


def table_header() -> str:
    """The header line of :func:`format_table` (printed once before progressive rows)."""
    return "  ".join(name.rjust(width) for name, width, _ in _COLUMNS)


def format_row(row: BenchRow | Mapping[str, Any]) -> str:
    """One table line of a row (aligned with :func:`table_header`)."""
    r = _row_dict(row)
    return "  ".join(fmt(r).rjust(width) for _, width, fmt in _COLUMNS)


def format_table(rows: Sequence[BenchRow | Mapping[str, Any]]) -> str:
    """Header, a rule and one line per row, then a note on the units."""
    head = table_header()
    lines = [head, "-" * len(head), *(format_row(r) for r in rows), TABLE_NOTE]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------------


def plot_lines(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The lines ``plot`` draws: dicts with ``op`` (dispatch / combine), ``label``, ``tokens`` and
    ``gbps`` (algorithmic GB/s: off-rank pairs x row bytes / time) and matplotlib ``style``. Ours: one
    line per routing, mode and SM budget; NCCL: one dashed line per routing; DeepEP, where the report
    timed it: one dotted line per routing and SM budget (its cached-handle dispatch and its combine),
    over the same off-rank pairs as ours, so the lines compare times at equal work."""
    rows = [_row_dict(r) for r in report["rows"]]
    routings = list(dict.fromkeys(r["routing"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    budgets = list(dict.fromkeys(r.get("num_sms") for r in rows))
    colors = {name: f"C{i % 10}" for i, name in enumerate(routings)}
    markers = ("o", "^", "D", "v", "P")
    lines: list[dict[str, Any]] = []

    def add(op: str, label: str, points: Mapping[int, float], **style: Any) -> None:
        toks = sorted(points)
        if toks:
            lines.append({"op": op, "label": label, "tokens": toks, "gbps": [points[t] for t in toks],
                          "style": style})

    for op in ("dispatch", "combine"):
        for routing in routings:
            color = colors[routing]
            for mi, mode in enumerate(modes):
                for bi, sms in enumerate(budgets):
                    sel = [r for r in rows if r["routing"] == routing and r["mode"] == mode
                           and r.get("num_sms") == sms]
                    tags = ([mode] if len(modes) > 1 else []) + ([f"{sms} SMs"] if len(budgets) > 1 else [])
                    add(op, f"cute-ep {routing}" + (f" ({', '.join(tags)})" if tags else ""),
                        {r["tokens"]: r[f"{op}_alg_gbps"] for r in sel}, marker=markers[mi % len(markers)],
                        color=color, alpha=1.0 - 0.25 * (bi % 3))
            # NCCL moving rows of the input dtype (FP8 rows' packed baseline is in the table and JSON)
            plain = [r for r in rows if r["routing"] == routing and not r.get("dispatch_row_bytes")]
            add(op, f"NCCL all_to_all {routing}",
                {r["tokens"]: r[f"nccl_{op}_gbps"] for r in plain if r.get(f"nccl_{op}_gbps") is not None},
                linestyle="--", marker="s", markerfacecolor="none", color=color)
            timed = [r for r in plain if r.get(f"deepep_{op}_us")]
            for sms in dict.fromkeys(r.get("deepep_num_sms") for r in timed):
                add(op, f"DeepEP {routing}" + (f" ({sms} SMs)" if sms else ""),
                    {r["tokens"]: bandwidth_gbps(r["pairs_off_mean"] * r["row_bytes"],
                                                 r[f"deepep_{op}_us"] * 1e-6)
                     for r in timed if r.get("deepep_num_sms") == sms},
                    linestyle=":", marker="x", color=color)
    return lines


def plot(report: Mapping[str, Any], png_path: str | os.PathLike) -> Path:
    """Algorithmic bandwidth vs tokens per rank (log x) for dispatch and combine: the lines of
    ``plot_lines`` (ours, NCCL, DeepEP where timed). Renders with the Agg canvas (no display, no global
    pyplot state); returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    _check_report({"schema": SCHEMA, **report} if "schema" not in report else report, str(png_path))
    rows = [_row_dict(r) for r in report["rows"]]
    meta = report["meta"]
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=False)
    lines = plot_lines(report)
    for ax, op in zip(axes, ("dispatch", "combine"), strict=True):
        for line in (ln for ln in lines if ln["op"] == op):
            ax.plot(line["tokens"], line["gbps"], label=line["label"], **line["style"])
        ax.set_xscale("log", base=2)
        all_tokens = sorted({r["tokens"] for r in rows})
        if all_tokens:
            ax.set_xticks(all_tokens, [str(t) for t in all_tokens])
            ax.minorticks_off()
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("algorithmic GB/s (off-rank pairs x H x b / time)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)
        if rows:
            ax.legend(fontsize="small")
    cfg = meta.get("config", {})
    fig.suptitle(
        f"{meta.get('device', '?')} x {meta.get('world_size', '?')} "
        f"(local {meta.get('local_world_size', '?')}): H={cfg.get('hidden', '?')}, "
        f"top-k={cfg.get('topk', '?')}, E={cfg.get('num_experts', '?')}, {cfg.get('dtype', '?')}; "
        f"median of {cfg.get('iters', '?')} iters, slowest rank"
    )
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# --------------------------------------------------------------------------------------------------
# small helpers for the script's metadata and arguments (also used by the other scripts in scripts/:
# these need no torch, so a script can parse and check its arguments before importing it)
# --------------------------------------------------------------------------------------------------


def check_writable(flag: str, value: str) -> None:
    """Raise BenchReportError unless ``value`` (the argument of ``flag``) can be written as a file: not a
    directory, not a read-only file, and its nearest existing ancestor (the writers create missing
    parents) a writable directory. For outputs rank 0 writes after or during a run, when a write error
    could no longer stop the run early."""
    path = Path(value)
    try:
        if path.is_dir():
            raise BenchReportError(f"{flag} {value} is a directory")
        if path.exists() and not os.access(path, os.W_OK):
            raise BenchReportError(f"{flag} {value} is not writable")
        folder = path.absolute().parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise BenchReportError(f"{flag} {value}: {folder} is not a directory")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise BenchReportError(f"{flag} {value}: directory {folder} is not writable")
    except OSError as exc:
        raise BenchReportError(f"{flag} {value}: {exc.strerror or exc}") from None


def utc_timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def parse_int_list(text: str, name: str) -> list[int]:
    """ "128,256, 512" -> [128, 256, 512] (order kept, duplicates removed); every value >= 1."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise BenchReportError(f"{name} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise BenchReportError(f"{name} must list integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def parse_name_list(text: str, name: str, allowed: Sequence[str]) -> list[str]:
    """ "uniform,skewed" -> ["uniform", "skewed"]; every name in ``allowed``, duplicates removed."""
    values = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [v for v in values if v not in allowed]
    if not values or unknown:
        raise BenchReportError(f"{name} must be a comma-separated list of {list(allowed)}, got {text!r}")
    return list(dict.fromkeys(values))
