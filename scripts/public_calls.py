"""What a user pays for the public dispatch() / combine() calls, against the same step captured in a CUDA
graph, the same launches made eagerly, the kernels alone and DeepEP, in one run.

To run (one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 scripts/public_calls.py          # baselines/perf/<gpu>x2_public_calls.json
    python scripts/public_calls.py --plot baselines/perf/h200x2_public_calls.json   # its .png, any machine

Per --tokens value (tokens per rank; default 1,128,4096) and receive layout (--layouts expert,rank), on
one EpBuffer of --num-sms SMs (default 24), DeepSeek-V3 shapes by default (H 7168, top-8 of 256 experts,
bf16), uniform routing from input seed 0, the same inputs for every column:
    * kernels: ``launch_dispatch`` (layout + dispatch) and ``launch_combine`` (the combine) alone;
    * captured_step: ``launch_dispatch`` -> the expert output (the received rows copied into
      ``expert_output``, no expert compute) -> ``launch_combine``, captured once in a CUDA graph, per replay;
    * eager_launches: the same step without a graph;
    * public_calls: ``dispatch()`` (synced) -> the same expert output -> ``combine()``, as a user calls
      them; and ``dispatch()``, ``dispatch(sync=False)`` and ``combine()`` each alone;
    * DeepEP, when ``import deep_ep`` works and the world can run it (else null, meta.deepep.skipped says
      why), at the same SM budget (``bench_peers.deepep_num_sms``), once per tokens value, with
      ``bench_timing.measure_deepep`` (checked first): its cached-handle dispatch, its full dispatch
      (layout + notify + host sync), its dispatch + permute and its combine.
Timing: CUDA events per iteration, each rank's median, the slowest rank's reported (every rank's under
``per_rank``). Kernels and captured_step: ``bench_timing.Timer`` (GPU time: a sleep holds the GPU while
the host enqueues); eager_launches and public calls: each started on an idle GPU (host work included).
meta.one_launch_us: a one-element torch ``add_`` timed as the calls are, the least any call with a launch
costs that way (the floor under the targets below).

Targets (meta.targets; a row's ``met``: true / false, null where one does not apply): dispatch()+combine()
within 20 us of the captured step at 1 and 128 tokens and within 3% at 4096; dispatch() within 15 us of
its kernels; dispatch(sync=False) and combine() within 8 us of theirs; the captured step (rank layout, 128
tokens) <= DeepEP's cached dispatch + combine (DeepEP copies no expert output; our step does).

Report (rank 0, rewritten after every row: a run cut short keeps what it measured): --out-json, default
``baselines/perf/<gpu>x<N>_public_calls.json`` (gpu from the device name, e.g. h100), and at the end its
``.png`` (when matplotlib imports): ``{"schema": "cute_ep.public_calls/1", "meta": {META_FIELDS, ...},
"rows": [ROW_FIELDS per (tokens, layout)]}``. Rank 0 prints a table line per row, then the table.

Constraints: GPUs with NVSHMEM, one per rank (--help, --plot and argument errors need none); ``EpConfig``'s;
--tokens in [1, 65536]; --layouts of expert, rank (rank: 2 * --num-experts + world size <= 12288); --num-sms
>= 1, at most each rank's share of its GPU; --timeout-s in [0.001, 2147483] bounds every wait for a peer
(past it the waiting rank raises ``PeerTimeout`` naming itself, the peer and the operation); --iters >= 1,
--warmup >= 0; the report writable. Exit status (every rank): 0 done, 1 run-time error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cute_ep.tools import bench_peers as bp  # pure Python + numpy: safe before parsing
from cute_ep.tools import bench_report as br
from cute_ep.tools import bench_timing as bt  # the timer and the DeepEP peer; torch-free at import
from cute_ep.tools.usage import EXIT_USAGE, UsageError, checked_args, report_usage_error, write_stderr

SCHEMA = "cute_ep.public_calls/1"
EXIT_OK, EXIT_FAIL = 0, 1
REPO = Path(__file__).resolve().parents[1]
SEED = 0  # the input set's seed: every column and every rank's run see the same inputs
# One rank's medians (us) of a (tokens, layout); the row holds ``<name>_us``, the slowest rank's.
MEASURED = ("dispatch_kernels", "combine_kernels", "captured_step", "eager_launches", "public_calls",
            "api_dispatch", "api_dispatch_nosync", "api_combine")  # fmt: skip
DERIVED = ("public_minus_captured_us", "public_over_captured", "dispatch_minus_kernels_us",
           "sync_free_dispatch_minus_kernels_us", "combine_minus_kernels_us", "captured_vs_deepep_cached")
DEEPEP_FIELDS = tuple(f"deepep_{n}_us" for n in bp.DEEPEP_TIMES)
ROW_FIELDS = ("tokens", "layout", "num_sms", "combine_algorithm", *(f"{n}_us" for n in MEASURED), *DERIVED,
              "deepep_num_sms", *DEEPEP_FIELDS, "deepep_skipped", "met", "per_rank")  # fmt: skip
META_FIELDS = ("world_size", "local_world_size", "device", "hidden", "topk", "num_experts", "dtype", "tokens",
               "num_sms", "layouts", "iters", "warmup", "deepep", "git_sha", "time", "command", "targets")
# Each target: a row field, its largest value, and where it applies (tokens / layout; absent: every row).
TARGETS: dict[str, dict[str, Any]] = {
    "public_calls_us": {"field": "public_minus_captured_us", "at_most": 20.0, "tokens": [1, 128]},
    "public_calls_pct": {"field": "public_over_captured", "at_most": 1.03, "tokens": [4096]},
    "dispatch": {"field": "dispatch_minus_kernels_us", "at_most": 15.0},
    "sync_free_dispatch": {"field": "sync_free_dispatch_minus_kernels_us", "at_most": 8.0},
    "combine": {"field": "combine_minus_kernels_us", "at_most": 8.0},
    "captured_vs_deepep": {"field": "captured_vs_deepep_cached", "at_most": 1.0, "layout": "rank",
                           "tokens": [128]},
}  # fmt: skip
CONFIG_FLAGS = {"num_experts": "--num-experts", "topk": "--topk", "hidden": "--hidden",
                "max_tokens": "--tokens", "num_sms": "--num-sms", "timeout_s": "--timeout-s"}


def build_parser() -> argparse.ArgumentParser:
    p = br.script_parser(__doc__, "See the module docstring (To run / what is timed / Constraints).")
    p.add_argument("--tokens", default="1,128,4096", help="comma list of tokens per rank")
    p.add_argument("--layouts", default="expert,rank", help="comma list of receive layouts (expert, rank)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--dtype", choices=bt.DTYPE_CHOICES, default="bfloat16")
    p.add_argument("--num-sms", type=int, default=24, help="SMs of dispatch / combine (EpConfig.num_sms)")
    p.add_argument("--combine", choices=bp.DECODE_COMBINES, default="reduced",
                   help="the buffer's combine (EpConfig.combine_algorithm) on the expert layout")
    p.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for a peer (seconds)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out-json", metavar="PATH", help="default baselines/perf/<gpu>x<N>_public_calls.json")
    p.add_argument("--plot", metavar="PATH.json", help="render this report's .png beside it, nothing else")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of an error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """Launch-independent checks (none with --plot); fills token_list, layout_list, and the peer_list and
    num_sms_list bench_timing's DeepEP functions read. Raises UsageError naming constraint, value and fix."""
    if args.plot:
        return
    try:
        args.token_list = br.parse_int_list(args.tokens, "--tokens")
        args.layout_list = br.parse_name_list(args.layouts, "--layouts", bp.LAYOUTS)
    except br.BenchReportError as exc:
        raise UsageError(f"{exc}; e.g. --tokens 1,128,4096 --layouts expert,rank") from None
    if max(args.token_list) > bt.MAX_TOKENS_PER_RANK:
        raise UsageError(f"--tokens values must be <= {bt.MAX_TOKENS_PER_RANK}, got {max(args.token_list)}; "
                         "e.g. --tokens 1,128,4096")
    got = (args.num_sms, args.timeout_s, args.iters, args.warmup)
    if args.num_sms < 1 or args.iters < 1 or args.warmup < 0 or not 0 < args.timeout_s < math.inf:
        raise UsageError(f"need --num-sms >= 1, --timeout-s > 0, --iters >= 1, --warmup >= 0, got {got}; "
                         "e.g. the defaults (24, 60.0, 50, 10)")
    args.peer_list, args.num_sms_list = ["deepep"], [args.num_sms]  # DeepEP whenever it can run here
    try:  # rank 0 writes it during the run, when a bad path could no longer stop it early
        br.check_writable("--out-json", args.out_json or str(default_report_path("gpu", 1)))
    except br.BenchReportError as exc:
        raise UsageError(f"{exc}; pass a writable --out-json PATH") from None


def make_config(args: argparse.Namespace, env: Any) -> Any:
    """The run's EpConfig; a configuration error becomes a UsageError in the words of the command line."""
    from cute_ep.kernels.config import LAYOUT_SMEM_INTS, ConfigError, EpConfig
    from cute_ep.tools.cli import DTYPES, in_flags

    if "rank" in args.layout_list and 2 * args.num_experts + env.world_size > LAYOUT_SMEM_INTS:
        raise UsageError(f"--layouts rank needs 2 * --num-experts + world size <= {LAYOUT_SMEM_INTS}, got "
                         f"{2 * args.num_experts + env.world_size}; use --layouts expert or fewer experts")
    try:
        return EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                        num_experts=args.num_experts, topk=args.topk, hidden=args.hidden,
                        dtype=DTYPES[args.dtype], max_tokens=max(args.token_list), num_sms=args.num_sms,
                        timeout_s=args.timeout_s, combine_algorithm=args.combine)  # fmt: skip
    except ConfigError as exc:
        raise UsageError(in_flags(str(exc), CONFIG_FLAGS)) from None


def main(argv: list[str] | None = None) -> int:
    args = checked_args(build_parser(), validate_args, argv)
    if args is None:
        return EXIT_USAGE
    if args.plot:
        return plot_only(args.plot)
    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.tools.cli import Printer, report_setup_error, require_cuda, run_guarded, setup_errors

    try:
        env = DistEnv.from_environ()
        cfg = make_config(args, env)
        require_cuda("scripts/public_calls.py (it times the GPU kernels and calls)", bt.CPU_WAY_OUT)
    except setup_errors() as exc:
        return report_setup_error(exc)

    def body(args: argparse.Namespace, env: Any, cfg: Any) -> int:
        with Runtime(env, symmetric_bytes=cfg.symmetric_bytes()) as rt:
            return public_calls_report(args, cfg, rt, Printer(env.rank))

    return run_guarded(body, args, env, cfg)


def _times(name: str, values: Sequence[Any]) -> list[float]:
    """``values`` (one median per rank) as floats, each checked to be a positive finite time."""
    for r, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise br.BenchReportError(f"{name}: rank {r}'s median must be a positive time (us), got {v!r}")
    return [float(v) for v in values]


def targets_met(row: Mapping[str, Any]) -> dict[str, bool | None]:
    """Per target of ``TARGETS``: whether ``row`` meets it; None where it does not apply (another tokens
    value or layout) or its field is null (DeepEP not measured)."""
    met: dict[str, bool | None] = {}
    for name, t in TARGETS.items():
        value = row[t["field"]]
        tokens, layout = t.get("tokens", [row["tokens"]]), t.get("layout", row["layout"])
        here = row["tokens"] in tokens and row["layout"] == layout
        met[name] = None if value is None or not here else bool(value <= t["at_most"])
    return met


def make_row(*, tokens: int, layout: str, num_sms: int, combine_algorithm: str,
             per_rank: Sequence[Mapping[str, float]], deepep_us: Sequence[Sequence[float]] | None,
             deepep_skipped: str | None) -> dict[str, Any]:  # fmt: skip
    """One row (``ROW_FIELDS``) from every rank's medians: per_rank[r] holds rank r's ``MEASURED`` ones,
    deepep_us[r] its DeepEP ones in ``bench_peers.DEEPEP_TIMES`` order (None, with ``deepep_skipped`` the
    reason, when not measured). Times: the slowest rank's; ``DERIVED`` from them (the ratios: public_calls /
    captured_step and captured_step / (DeepEP's cached dispatch + combine)); combine_algorithm: the
    buffer's on the expert layout, "rank" (its one combine) on the rank layout."""
    if not per_rank:
        raise br.BenchReportError("make_row needs the medians of at least one rank")
    if (deepep_us is None) == (deepep_skipped is None):
        raise br.BenchReportError("give DeepEP's times or the reason it was skipped, not both or neither")
    spread = {f"{n}_us": _times(f"{n}_us", [m.get(n) for m in per_rank]) for n in MEASURED}
    if deepep_us is not None:
        spread.update({f: _times(f, [d[j] for d in deepep_us]) for j, f in enumerate(DEEPEP_FIELDS)})
    r: dict[str, Any] = {"tokens": int(tokens), "layout": layout, "num_sms": int(num_sms),
                         "combine_algorithm": "rank" if layout == "rank" else combine_algorithm,
                         **dict.fromkeys(DEEPEP_FIELDS), **{k: max(v) for k, v in spread.items()}}
    cap, pub = r["captured_step_us"], r["public_calls_us"]
    dep_pair = None if deepep_us is None else r["deepep_dispatch_us"] + r["deepep_combine_us"]
    r.update({
        "public_minus_captured_us": pub - cap, "public_over_captured": pub / cap,
        "dispatch_minus_kernels_us": r["api_dispatch_us"] - r["dispatch_kernels_us"],
        "sync_free_dispatch_minus_kernels_us": r["api_dispatch_nosync_us"] - r["dispatch_kernels_us"],
        "combine_minus_kernels_us": r["api_combine_us"] - r["combine_kernels_us"],
        "captured_vs_deepep_cached": None if dep_pair is None else cap / dep_pair,
        "deepep_num_sms": bp.deepep_num_sms(num_sms) or None, "deepep_skipped": deepep_skipped,
    })  # fmt: skip
    r["met"], r["per_rank"] = targets_met(r), spread
    return {k: r[k] for k in ROW_FIELDS}


def check_report(report: Any, where: str = "report") -> None:
    """Raise BenchReportError naming the first problem: the schema, a ``META_FIELDS`` key, a row's
    ``ROW_FIELDS`` key, a time that is not positive (DeepEP's: or null with a reason), or a ``met`` that
    is not one true / false / null per target."""
    if not isinstance(report, Mapping) or report.get("schema") != SCHEMA:
        raise br.BenchReportError(f"{where}: not a public-calls report (schema {SCHEMA!r} expected)")
    meta, rows = report.get("meta"), report.get("rows")
    if not isinstance(meta, Mapping) or not isinstance(rows, list):
        raise br.BenchReportError(f"{where}: 'meta' must be an object and 'rows' a list")
    if [k for k in META_FIELDS if k not in meta]:
        raise br.BenchReportError(f"{where}: meta lacks {[k for k in META_FIELDS if k not in meta]}")
    if meta.get("one_launch_us") is not None:  # reports made before it was measured have none
        _times(f"{where}: meta one_launch_us", [meta["one_launch_us"]])
    for i, row in enumerate(rows):
        lacking = [k for k in ROW_FIELDS if k not in row] if isinstance(row, Mapping) else list(ROW_FIELDS)
        if lacking:
            raise br.BenchReportError(f"{where}: row {i} lacks {lacking}")
        tag = f"{where}: row {i} (tokens={row['tokens']}, layout={row['layout']})"
        for k in (*(f"{n}_us" for n in MEASURED), *DEEPEP_FIELDS):
            if not (k in DEEPEP_FIELDS and row[k] is None and row["deepep_skipped"]):
                _times(f"{tag} {k}", [row[k]])
        met = row["met"]
        if not isinstance(met, Mapping) or set(met) != set(TARGETS) or {*met.values()} - {True, False, None}:
            raise br.BenchReportError(f"{tag}: 'met' must be true / false / null for each of {list(TARGETS)}")


def write_report(path: str | os.PathLike, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict:
    """Check and write ``{"schema", "meta", "rows"}`` (never half of it on disk); returns it."""
    report = {"schema": SCHEMA, "meta": dict(meta), "rows": [dict(r) for r in rows]}
    check_report(report, str(path))
    br.write_json_file(path, report)
    return report


def default_report_path(device: str, world_size: int) -> Path:
    """baselines/perf/<gpu>x<N>_public_calls.json: <gpu> the model in the device name ("NVIDIA H100 80GB
    HBM3" -> h100), else the whole name made file-safe."""
    model = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", device)
    gpu = model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") or "gpu"
    return REPO / "baselines" / "perf" / f"{gpu}x{world_size}_public_calls.json"


def _us(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _met(met: Mapping[str, bool | None]) -> str:
    """'<met>/<applied>', and the names of the targets missed."""
    applied = [k for k, v in met.items() if v is not None]
    missed = [k for k in applied if not met[k]]
    return f"{len(applied) - len(missed)}/{len(applied)}" + (f" missed {','.join(missed)}" if missed else "")


TABLE = (("disp k", "dispatch_kernels_us"), ("comb k", "combine_kernels_us"), ("capt", "captured_step_us"),
         ("eager", "eager_launches_us"), ("calls", "public_calls_us"), ("-capt", "public_minus_captured_us"),
         ("disp()", "api_dispatch_us"), ("-k", "dispatch_minus_kernels_us"),
         ("nosync", "api_dispatch_nosync_us"), ("-k", "sync_free_dispatch_minus_kernels_us"),
         ("comb()", "api_combine_us"), ("-k", "combine_minus_kernels_us"), ("dep d", "deepep_dispatch_us"),
         ("dep c", "deepep_combine_us"), ("cap/dep", "captured_vs_deepep_cached"))  # fmt: skip
TABLE_NOTE = ("us, slowest rank's median. k: kernels alone, capt: dispatch -> expert output copy -> combine "
              "in a CUDA graph (GPU time); eager: those launches, calls: dispatch() + copy + combine(), and "
              "each call alone (from an idle GPU); -capt / -k: minus capt / k; dep d / c: DeepEP's d / c")
TABLE_HEADER = f"{'tokens':>6} {'layout':>6} " + " ".join(f"{h:>8}" for h, _ in TABLE) + "  targets met"


def table_line(r: Mapping[str, Any]) -> str:
    """Row ``r`` as a line of the table (rank 0 prints it when the row is measured, and in the table)."""
    cells = [_us(r[k], ".2f" if k.startswith("captured_vs") else "+.1f" if "minus" in k else ".1f")
             for _, k in TABLE]
    return f"{r['tokens']:>6} {r['layout']:>6} " + " ".join(f"{c:>8}" for c in cells) + f"  {_met(r['met'])}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The final table, its note, and each distinct reason DeepEP was skipped."""
    skips = [f"DeepEP skipped: {w}" for w in dict.fromkeys(r["deepep_skipped"] for r in rows) if w]
    return "\n".join([TABLE_HEADER, *map(table_line, rows), TABLE_NOTE, *skips])


PLOT_LINES = (  # (label, the fields summed, matplotlib format); points where a field is null are left out
    ("kernels (dispatch + combine)", ("dispatch_kernels_us", "combine_kernels_us"), "v:"),
    ("captured step (CUDA graph)", ("captured_step_us",), "o-"),
    ("eager launches", ("eager_launches_us",), "^-"),
    ("dispatch() + combine()", ("public_calls_us",), "s-"),
    ("DeepEP cached dispatch + combine", ("deepep_dispatch_us", "deepep_combine_us"), "x--"),
    ("DeepEP full dispatch + combine", ("deepep_full_dispatch_us", "deepep_combine_us"), "+-."),
)


def plot_report(report: Mapping[str, Any], png_path: str | os.PathLike) -> Path:
    """Step time vs tokens per rank (log-log), a panel per layout with ``PLOT_LINES``, drawn on the Agg
    canvas (no display). Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m, layouts = report["meta"], list(dict.fromkeys(r["layout"] for r in report["rows"])) or ["no rows"]
    fig = Figure(figsize=(6.5 * len(layouts), 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, layout in zip(fig.subplots(1, len(layouts), squeeze=False)[0], layouts, strict=True):
        rows = sorted((r for r in report["rows"] if r["layout"] == layout), key=lambda r: r["tokens"])
        for label, fields, fmt in PLOT_LINES:
            pts = [(r["tokens"], sum(r[f] for f in fields)) for r in rows if all(r[f] for f in fields)]
            if pts:
                ax.plot(*zip(*pts, strict=True), fmt, label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="us (slowest rank's median)",
               title=f"{layout} layout")
        ax.set_xticks([r["tokens"] for r in rows], [str(r["tokens"]) for r in rows])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{m['device']} x {m['world_size']}: H={m['hidden']}, top-{m['topk']} of "
                 f"{m['num_experts']}, {m['dtype']}, {m['num_sms']} SMs; git {m['git_sha']}")
    fig.savefig(png_path, dpi=110)
    return Path(png_path)


def plot_only(json_path: str) -> int:
    """--plot: the PNG of an existing report beside it (same stem). 2: no such report; 1: no matplotlib."""
    try:
        report = json.loads(Path(json_path).read_text())
        check_report(report, json_path)
    except (OSError, ValueError) as exc:  # JSONDecodeError and BenchReportError are ValueErrors
        return report_usage_error(f"--plot {json_path}: {exc}; pass a report this script wrote")
    try:
        print(f"wrote {plot_report(report, Path(json_path).with_suffix('.png'))}")
    except ImportError as exc:
        write_stderr(f"error: --plot needs matplotlib ({exc}); pip install matplotlib")
        return EXIT_FAIL
    return EXIT_OK


def call_times(runtime: Any, fn: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Microseconds of each of ``iters`` calls of ``fn()`` (after ``warmup`` untimed), each started on an
    idle GPU: CUDA events before and after the call on the current stream, the device synchronized between
    calls, so a time holds the host's work in the call and its kernels. Collective when ``fn`` is."""
    import torch

    for _ in range(warmup):
        fn()
    runtime.barrier()  # synchronizes the device first
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(runtime.device)
        times.append(start.elapsed_time(end) * 1e3)
    return times


def one_launch_median(runtime: Any, args: argparse.Namespace) -> float:
    """This rank's median (us) of the least a call with one kernel launch costs when timed as the public
    calls are (``call_times``): a torch ``add_`` on one element, whose kernel runs ~2 us; the rest is the
    host's launch and the GPU's start from idle, which every call that launches pays."""
    import torch

    one = torch.zeros(1, device=runtime.device)
    return br.median(call_times(runtime, lambda: one.add_(1), args.warmup, args.iters))


def step_medians(buf: Any, s: Any, layout: str, timer: Any, runtime: Any, args: argparse.Namespace
                 ) -> dict[str, float]:  # fmt: skip
    """This rank's medians (us) of the kernels alone, the captured step and the eager step on ``s``."""
    import torch

    w, n = args.warmup, args.iters
    res = buf.dispatch(s.x, s.idx, s.w, layout=layout)  # checked; the same inputs give the same count
    y, rows = buf.expert_output(res.num_recv), buf.recv_x[: res.num_recv]
    y.copy_(rows)
    med = {"dispatch_kernels": br.median(timer.run(
        lambda i: buf.launch_dispatch(s.x, s.idx, s.w, layout=layout), w, n))}
    res = buf.dispatch(s.x, s.idx, s.w, layout=layout)  # checked: raises if a launch above did not run
    med["combine_kernels"] = br.median(timer.run(lambda i: buf.launch_combine(res.handle, s.out), w, n))

    def step() -> None:
        handle = buf.launch_dispatch(s.x, s.idx, s.w, layout=layout)
        y.copy_(rows)  # the expert output: the received rows, no expert compute
        buf.launch_combine(handle, s.out)

    step()  # eager once before the capture: whatever loads lazily is loaded
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    med["captured_step"] = br.median(timer.run(lambda i: graph.replay(), w, n))
    med["eager_launches"] = br.median(call_times(runtime, step, w, n))
    buf.check_ran()  # a peer that never came: PeerTimeout here, naming this rank, that peer and the op
    return med


def call_medians(buf: Any, s: Any, layout: str, runtime: Any, args: argparse.Namespace) -> dict[str, float]:
    """This rank's medians (us) of dispatch() + expert output + combine(), and of each call alone."""

    def dispatch(sync: bool = True) -> Any:
        return buf.dispatch(s.x, s.idx, s.w, layout=layout, sync=sync)

    def public_pair() -> None:
        res = dispatch()
        y = buf.expert_output(res.num_recv)
        y.copy_(res.recv_x)  # the expert output, as in the captured step
        buf.combine(y, res.handle)

    calls = {"public_calls": public_pair, "api_dispatch": dispatch,
             "api_dispatch_nosync": lambda: dispatch(sync=False)}
    med = {k: br.median(call_times(runtime, fn, args.warmup, args.iters)) for k, fn in calls.items()}
    last = dispatch()  # combine() alone: on the latest dispatch's handle, its expert output in place
    y = buf.expert_output(last.num_recv)
    y.copy_(last.recv_x)
    med["api_combine"] = br.median(call_times(runtime, lambda: buf.combine(y, last.handle), args.warmup,
                                              args.iters))  # fmt: skip
    buf.check_ran()
    return med


def make_meta(args: argparse.Namespace, cfg: Any, runtime: Any, device: str) -> dict[str, Any]:
    env, deepep = runtime.env, bt.deepep_meta(args)
    deepep["num_sms"] = bp.deepep_num_sms(cfg.num_sms) or None
    return {
        "world_size": env.world_size, "local_world_size": env.local_world_size, "device": device,
        "hidden": cfg.hidden, "topk": cfg.topk, "num_experts": cfg.num_experts, "dtype": args.dtype,
        "num_sms": cfg.num_sms, "combine_algorithm": cfg.combine_algorithm, "timeout_s": cfg.timeout_s,
        "tokens": args.token_list, "layouts": args.layout_list, "iters": args.iters, "warmup": args.warmup,
        "routing": "uniform", "seed": SEED, **br.gpu_share_meta(runtime), "deepep": deepep,
        "timing": "kernels, captured_step: bench_timing.Timer; eager_launches, public calls: CUDA events "
                  "around each call, started on an idle GPU; DeepEP: bench_timing.measure_deepep; "
                  "one_launch_us: a one-element torch add_ timed as the calls are (the floor of any call)",
        "environment": {k: os.environ.get(k) for k in bt.RECORDED_VARS},
        "versions": br.package_versions(), "git_sha": br.git_sha(), "time": br.utc_timestamp(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]), "targets": TARGETS,
    }  # fmt: skip


def public_calls_report(args: argparse.Namespace, cfg: Any, runtime: Any, say: Callable[..., None]) -> int:
    """Every (tokens, layout) on one EpBuffer, DeepEP once per tokens value; rank 0 prints and writes."""
    import torch

    from cute_ep.tools.cli import all_gather

    env = runtime.env
    names = all_gather(torch.cuda.get_device_name(runtime.device), runtime.cpu_group)
    device = ", ".join(sorted(set(names)))
    out_json = args.out_json or str(default_report_path(device, env.world_size))
    meta = make_meta(args, cfg, runtime, device)
    say(f"public calls: {device} x {env.world_size}, H {cfg.hidden}, K {cfg.topk}, E {cfg.num_experts}, "
        f"{args.dtype}, {cfg.num_sms} SMs, timeout {cfg.timeout_s:g} s; git {meta['git_sha']}")
    say(*(f"warning: {line}" for line in bt.multicast_warnings()))
    peer, skipped = bt.open_peer(bt.open_deepep, runtime, cfg, args, meta, say, "not requested")
    timer = bt.Timer(runtime)
    cfg, buf, dep, dep_skipped = bt.open_budget(bt.shared_module_buffers(runtime), runtime, cfg, cfg.num_sms,
                                                peer, skipped, say)  # fmt: skip
    # The floor under the targets' "within N us of the kernels": one launch timed as a call (slowest rank)
    meta["one_launch_us"] = max(all_gather(one_launch_median(runtime, args), runtime.cpu_group))
    say(f"one launch (torch add_ of one element, from an idle GPU): {meta['one_launch_us']:.1f} us")
    rows: list[dict[str, Any]] = []
    say(TABLE_HEADER)
    for t in args.token_list:
        s = bt.InputSet(cfg, env.rank, runtime.device, t, "uniform", SEED)
        dep_us, why = None, dep_skipped
        if dep is not None:
            bt.exchange_splits([s], runtime.cpu_group)  # what DeepEP must deliver (checked first)
            dep_us, why = bt.measure_deepep(dep, [s], runtime, timer, args)
        for layout in args.layout_list:
            mine = step_medians(buf, s, layout, timer, runtime, args)
            mine.update(call_medians(buf, s, layout, runtime, args))
            every = all_gather((mine, dep_us), runtime.cpu_group)  # DeepEP: all lists or all None
            rows.append(make_row(tokens=t, layout=layout, num_sms=cfg.num_sms,
                                 combine_algorithm=cfg.combine_algorithm, per_rank=[m for m, _ in every],
                                 deepep_us=None if every[0][1] is None else [d for _, d in every],
                                 deepep_skipped=why))  # fmt: skip
            say(table_line(rows[-1]))
            if env.rank == 0:
                write_report(out_json, meta, rows)
    buf.close()
    if dep is not None:
        peer.release(cfg.num_sms)
    say("", format_table(rows), f"report: {out_json}")
    if env.rank == 0 and rows:
        png = Path(out_json).with_suffix(".png")
        try:  # the checked report, as --plot reads it back
            say(f"plot: {plot_report(write_report(out_json, meta, rows), png)}")
        except ImportError as exc:
            say(f"no plot: matplotlib does not import ({exc})")
    runtime.barrier()
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    from cute_ep.tools.cli import exit_process  # after main: --help and bad arguments exit before torch

    exit_process(code)
