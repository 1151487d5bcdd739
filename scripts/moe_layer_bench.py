"""Step time of cute_ep.MoELayer: forward and forward+backward, ours against the same layer on NCCL's
all-to-all and against DeepEP's dispatch/combine with a torch permute; the SwiGLU with and without the
padding rows skipped; the communication overlap on and off.

To run (one process per GPU; keep NVLink multicast off, as on the H100 / H200 test hosts):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 scripts/moe_layer_bench.py \\
        --out-json baselines/perf/moe_layer_h200x2.json --out-png baselines/perf/moe_layer_h200x2.png

    # green contexts as well (torch with torch.cuda.green_contexts): the GEMMs on SMs - num_sms
    torchrun --nproc-per-node 2 scripts/moe_layer_bench.py --green-context

    # CPU smoke run: the reference backend (and the all-to-all one over gloo) at small sizes
    python scripts/moe_layer_bench.py --backend reference --tokens 8,32 --hidden 64 --intermediate 32 \\
        --num-experts 8 --topk 2 --groups 1 --shared 32 --iters 2 --warmup 1 --out-json /tmp/moe.json

The layer (defaults: DeepSeek-V3's MoE layer): H 7168, I 2048, 256 routed experts (E / world size per
rank), top-8 by sigmoid score, group-limited routing (8 groups, 4 of them per token), normalized weights
times 2.5, one shared expert of width 2048, bf16; --tokens per rank (default 128 and 4096). Random weights
(std 0.02) and tokens, the same on every backend.

What is timed, per tokens T and variant (one row each):
    * ``cute``: the layer on ``EpBuffer`` (``dispatch(sync=False)``: no host sync), with the CuTe DSL
      offset-aware SwiGLU ("kernel") and with the plain SwiGLU over the whole worst-case buffer
      ("plain"), overlap off (everything on the current stream) and on (dispatch and combine on a
      high-priority communication stream within ``--num-sms`` SMs, the shared expert meanwhile); with
      --green-context also overlap + the compute confined to a green context of SMs - num_sms; with
      --sync also the kernel SwiGLU rows with ``MoELayer(sync=True)`` (one host sync per dispatch, the
      GEMMs over the rows received instead of the worst-case buffer; rows marked ``sync``).
    * ``a2a``: the same layer on ``A2aEpBuffer`` (NCCL all_to_all_single; one host sync per dispatch).
    * ``deepep`` (forward only; when ``import deep_ep`` works and the world suits its intranode kernels:
      cute_ep/tools/bench_peers.py): the layer's router, DeepEP's layout + dispatch (host sync included),
      a torch permute into the expert-major layout, the same grouped GEMMs and SwiGLU, the weighted
      sum back to one row per (token, rank) in torch, DeepEP's combine, the shared expert. DeepEP ships
      no backward here, so its forward+backward is null with the reason.
    * ``reference`` (CPU): the layer on ``ReferenceEpBuffer``, torch SwiGLU and plain.
    * forward = ``layer(x)`` under ``torch.no_grad()`` (inference, as DeepEP's rows); forward+backward =
      ``layer(x).backward(g)`` after ``zero_grad``. CUDA events
      around every step after --warmup untimed steps (a step includes its host work and launch gaps: it
      is what a training loop pays); per rank the median, the row reports the slowest rank's median.
    * SwiGLU alone (``swiglu`` rows): on the worst-case buffer of T (``cfg.capacity`` rows, live rows
      from a real dispatch of the same routing), forward and backward of the kernel ("kernel", live
      rows only), of the torch version ("torch") and of the plain one over every row ("plain").

Meta records the device, the world, the ranks sharing each GPU (``ranks_per_gpu``, ``gpu_shared``),
versions, the git commit and the command. The JSON is ``{"schema", "meta", "rows", "swiglu"}``
(``check_report``); the PNG shows both step times per variant and the SwiGLU times.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cute_ep.tools.usage import UsageError, report_usage_error, script_parser

SCHEMA = "cute-ep/moe-layer-bench/1"
BACKEND_CHOICES = ("cute", "reference")
PEER_CHOICES = ("a2a", "deepep")
ROW_FIELDS = ("tokens", "backend", "swiglu", "overlap", "green_context", "forward_us", "fwd_bwd_us",
              "forward_us_ranks", "fwd_bwd_us_ranks", "live_rows", "buffer_rows", "skipped")
SWIGLU_FIELDS = ("tokens", "impl", "forward_us", "backward_us", "live_rows", "buffer_rows")
META_FIELDS = ("device", "world_size", "ranks_per_gpu", "gpu_shared", "hidden", "intermediate",
               "num_experts", "topk", "dtype", "num_sms")
EXIT_OK, EXIT_FAIL = 0, 1


# --------------------------------------------------------------------------------------------------
# arguments (no torch here: --help and bad arguments answer fast)
# --------------------------------------------------------------------------------------------------


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} must list integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="cute",
                   help="cute: EpBuffer on GPUs; reference: ReferenceEpBuffer on the CPU")
    p.add_argument("--peers", default="a2a,deepep", help="comma-separated peers (a2a, deepep) or 'none'")
    p.add_argument("--tokens", default="128,4096", help="tokens per rank, comma-separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--score", choices=("softmax", "sigmoid"), default="sigmoid")
    p.add_argument("--groups", type=int, default=8, help="router expert groups (1: no group limit)")
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--shared", type=int, default=2048, help="shared expert width (0: none)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--num-sms", type=int, default=24, help="SMs of the communication kernels (EpConfig)")
    p.add_argument("--green-context", action="store_true", help="also time the compute in a green context")
    p.add_argument("--sync", action="store_true",
                   help="also time the layer with sync=True (one host sync per dispatch; the experts' GEMMs "
                        "then run over the rows received instead of the worst-case buffer)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default="", help="write the report here (rank 0)")
    p.add_argument("--out-png", default="", help="write the plot here (rank 0; needs matplotlib)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments; UsageError names the bad one."""
    args = build_parser().parse_args(argv)
    args.token_list = _int_list(args.tokens, "--tokens")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    args.peer_list = [] if peers == ["none"] else list(dict.fromkeys(peers))
    bad = [p for p in args.peer_list if p not in PEER_CHOICES]
    if bad or not peers:
        raise UsageError(f"--peers must list {list(PEER_CHOICES)} or be 'none', got {args.peers!r}")
    positive = ("iters", "hidden", "intermediate", "num_experts", "topk", "num_sms", "groups", "topk_groups")
    for flag in positive:
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0 or args.shared < 0:
        raise UsageError(f"--warmup and --shared must be >= 0, got {args.warmup} and {args.shared}")
    for path, flag in ((args.out_json, "--out-json"), (args.out_png, "--out-png")):
        if path and Path(path).is_dir():
            raise UsageError(f"{flag} {path} is a directory")
    return args


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


def time_steps(step: Callable[[], Any], warmup: int, iters: int, device: Any, barrier: Callable[[], None]
               ) -> list[float]:
    """Microseconds of each of ``iters`` calls of ``step`` after ``warmup`` untimed ones (CUDA events on
    a GPU, the host clock on the CPU). Collective when ``step`` is."""
    import torch

    for _ in range(warmup):
        step()
    barrier()
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in range(iters)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in events]


def slowest_median(per_rank: Sequence[Sequence[float]]) -> tuple[float, list[float]]:
    """(the largest of the ranks' medians, every rank's median)."""
    medians = [float(statistics.median(v)) for v in per_rank]
    return max(medians), medians


# --------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------


def _positive_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)


def _check_entry(
    name: str, entry: Any, fields: Sequence[str], times: Sequence[str] = (),
    must: str = "positive and finite or null",
) -> None:
    """Raise ValueError unless ``entry`` (``name`` in the message) has every key of ``fields`` and each
    key of ``times`` holds a positive and finite time or null (``must``: how the message says it)."""
    lacking = [k for k in fields if k not in entry]
    if lacking:
        raise ValueError(f"{name} lacks {lacking}")
    for key in times:
        if not _positive_or_none(entry[key]):
            raise ValueError(f"{name}: {key} must be {must}, got {entry[key]!r}")


def check_report(report: Any) -> None:
    """Raise ValueError naming the first problem of a report: the schema, META_FIELDS in meta,
    ROW_FIELDS in every row (times positive and finite, or null with a ``skipped`` reason),
    SWIGLU_FIELDS in every SwiGLU row."""
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"not a MoE layer report (schema {SCHEMA!r} expected)")
    _check_entry("meta", report.get("meta", {}), META_FIELDS)
    rows = report.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("the report has no rows")
    for i, row in enumerate(rows):
        _check_entry(f"row {i}", row, ROW_FIELDS, ("forward_us", "fwd_bwd_us"))
        if (row["forward_us"] is None or row["fwd_bwd_us"] is None) and not row["skipped"]:
            raise ValueError(f"row {i}: a null time needs a 'skipped' reason")
    for i, row in enumerate(report.get("swiglu", [])):
        times = ("forward_us", "backward_us")
        _check_entry(f"swiglu row {i}", row, SWIGLU_FIELDS, times, "positive and finite")


def where(meta: dict[str, Any]) -> str:
    """ "NVIDIA H200 x 2 (1 rank per GPU)", "cpu x 2": the device, the world and how ranks share GPUs."""
    text = f"{meta['device']} x {meta['world_size']}"
    if meta["ranks_per_gpu"]:
        text += f" ({meta['ranks_per_gpu']} rank{'s' if meta['ranks_per_gpu'] > 1 else ''} per GPU)"
    return text


def row_label(row: dict[str, Any]) -> str:
    """A row's variant in words: backend, SwiGLU, overlap and green context."""
    parts = [row["backend"], row["swiglu"]]
    if row["overlap"]:
        parts.append("overlap")
    if row["green_context"]:
        parts.append("green")
    if row.get("sync") and row["backend"] == "cute":  # older reports have no such field
        parts.append("sync")
    return " ".join(parts)


def format_table(report: dict[str, Any]) -> str:
    def us(v: Any) -> str:
        return "-" if v is None else f"{v:,.0f}"

    lines = [f"{'tokens':>7} {'variant':<28} {'forward us':>12} {'fwd+bwd us':>12}  note"]
    for r in report["rows"]:
        lines.append(f"{r['tokens']:>7} {row_label(r):<28} {us(r['forward_us']):>12} "
                     f"{us(r['fwd_bwd_us']):>12}  {r['skipped'] or ''}")
    if report.get("swiglu"):
        lines += ["", f"{'tokens':>7} {'swiglu':<8} {'fwd us':>10} {'bwd us':>10} {'live/buffer rows':>18}"]
        for r in report["swiglu"]:
            lines.append(f"{r['tokens']:>7} {r['impl']:<8} {us(r['forward_us']):>10} "
                         f"{us(r['backward_us']):>10} {r['live_rows']:>9}/{r['buffer_rows']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Bars of forward and forward+backward per variant, one panel per token count, and the SwiGLU
    times; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({r["tokens"] for r in report["rows"]})
    fig, axes = plt.subplots(1, len(tokens) + 1, figsize=(6 * (len(tokens) + 1), 5), squeeze=False)
    for ax, t in zip(axes[0], tokens, strict=False):
        rows = [r for r in report["rows"] if r["tokens"] == t]
        labels = [row_label(r) for r in rows]
        xs = range(len(rows))
        fwd = [r["forward_us"] or 0 for r in rows]
        both = [r["fwd_bwd_us"] or 0 for r in rows]
        ax.bar([x - 0.2 for x in xs], fwd, 0.4, label="forward")
        ax.bar([x + 0.2 for x in xs], both, 0.4, label="forward+backward")
        ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("us per step (slowest rank's median)")
        ax.set_title(f"{t} tokens per rank")
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    sw = report.get("swiglu", [])
    labels = [f"{r['tokens']} {r['impl']}" for r in sw]
    xs = range(len(sw))
    ax.bar([x - 0.2 for x in xs], [r["forward_us"] for r in sw], 0.4, label="forward")
    ax.bar([x + 0.2 for x in xs], [r["backward_us"] for r in sw], 0.4, label="backward")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_title("SwiGLU on the worst-case buffer")
    ax.legend(fontsize=8)
    m = report["meta"]
    fig.suptitle(f"MoELayer, {where(m)}, H {m['hidden']}, I {m['intermediate']}, E {m['num_experts']}, "
                 f"top-{m['topk']}, {m['dtype']}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_report(path: str, report: dict[str, Any]) -> None:
    from cute_ep.tools.bench_report import write_json_file

    check_report(report)
    write_json_file(path, report)


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def make_meta(args: argparse.Namespace, runtime: Any, cfg: Any) -> dict[str, Any]:
    """The report's meta: device, world, ranks sharing each GPU, the layer's shape, versions, command."""
    import torch

    from cute_ep.tools import bench_report as br

    dev = runtime.device
    name = torch.cuda.get_device_properties(dev).name if dev.type == "cuda" else "cpu"
    share = br.gpu_share_meta(runtime)  # the runtime's own record of who shares this rank's GPU
    versions = br.package_versions()
    versions["torch"] = torch.__version__
    return {
        "device": name, "world_size": runtime.env.world_size,
        "local_world_size": runtime.env.local_world_size,
        "ranks_per_gpu": share["ranks_per_gpu"],
        "gpu_shared": share["shared_gpu"] is not None,
        "hidden": cfg.hidden, "intermediate": args.intermediate, "num_experts": cfg.num_experts,
        "topk": cfg.topk, "dtype": args.dtype, "num_sms": cfg.num_sms, "score": args.score,
        "groups": args.groups, "topk_groups": args.topk_groups, "shared": args.shared,
        "tokens": args.token_list, "capacity": cfg.capacity, "iters": args.iters, "warmup": args.warmup,
        "timing": "CUDA events around each step (host work and launch gaps included); per rank the median, "
                  "the slowest rank's reported",
        "versions": versions, "git_sha": br.git_sha(), "timestamp": br.utc_timestamp(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }  # fmt: skip


def inputs(args: argparse.Namespace, rank: int, tokens: int, device: Any, dtype: Any) -> tuple[Any, Any]:
    """(x [T, H], output gradient [T, H]) of this rank, drawn on the CPU from the seed."""
    import torch

    g = torch.Generator().manual_seed(args.seed * 1000 + rank * 7 + tokens)
    x = torch.randn(tokens, args.hidden, generator=g).to(dtype)
    return x.to(device), torch.randn(tokens, args.hidden, generator=g).to(dtype).to(device)


def build_layer(args: argparse.Namespace, buf: Any, device: Any) -> Any:
    """The benchmarked layer on ``buf``; its weights come from the device's generator seeded with --seed
    (the same on every backend of a run)."""
    import torch

    from cute_ep.moe_layer import MoELayer

    torch.manual_seed(args.seed)
    return MoELayer(buf, args.intermediate, score=args.score, num_groups=args.groups,
                    topk_groups=args.topk_groups, normalize=True, route_scale=2.5,
                    shared_intermediate=args.shared, device=device)  # fmt: skip


def variants(args: argparse.Namespace, backend: str, on_gpu: bool) -> list[dict[str, Any]]:
    """(swiglu, overlap, green_context, sync) of every row of ``backend``."""
    if backend == "cute":
        out = [dict(swiglu=s, overlap=o, green_context=False, sync=False)
               for s in ("kernel", "plain") for o in (False, True)]
        if args.sync:
            out += [dict(swiglu="kernel", overlap=o, green_context=False, sync=True) for o in (False, True)]
        if args.green_context:
            out.append(dict(swiglu="kernel", overlap=True, green_context=True, sync=False))
        return out
    return [dict(swiglu="kernel" if on_gpu else "torch", overlap=False, green_context=False, sync=False)] + (
        [] if on_gpu else [dict(swiglu="plain", overlap=False, green_context=False, sync=False)])


def measure_layer(args: argparse.Namespace, runtime: Any, layer: Any, backend: str, tokens: int,
                  variant: dict[str, Any], comm: Any, green: Any) -> dict[str, Any]:
    """One row: forward and forward+backward of ``layer`` as ``variant`` says (collective)."""
    import torch

    from cute_ep.collectives import all_gather_objects

    env, dev = runtime.env, runtime.device
    row = dict(tokens=tokens, backend=backend, **variant, skipped=None)
    if variant["green_context"] and green is None:
        return dict(row, forward_us=None, fwd_bwd_us=None, forward_us_ranks=None, fwd_bwd_us_ranks=None,
                    live_rows=None, buffer_rows=layer.cfg.capacity, skipped="no green context")
    layer.swiglu = variant["swiglu"]
    layer.overlap = variant["overlap"]
    layer.sync = variant["sync"]
    layer.comm_stream = comm if (variant["overlap"] or variant["green_context"]) else None
    layer.gemm_stream = green if variant["green_context"] else None
    x, g = inputs(args, env.rank, tokens, dev, layer.cfg.dtype)
    xg = x.clone().requires_grad_()

    def forward() -> None:
        with torch.no_grad():  # inference, as DeepEP's rows (which have no backward)
            layer(x)

    def both() -> None:
        layer.zero_grad(set_to_none=True)
        xg.grad = None
        layer(xg).backward(g)

    barrier = runtime.barrier
    fwd = time_steps(forward, args.warmup, args.iters, dev, barrier)
    fb = time_steps(both, args.warmup, args.iters, dev, barrier)
    f_max, f_ranks = slowest_median(all_gather_objects(fwd, runtime.cpu_group))
    b_max, b_ranks = slowest_median(all_gather_objects(fb, runtime.cpu_group))
    return dict(row, forward_us=f_max, fwd_bwd_us=b_max, forward_us_ranks=f_ranks, fwd_bwd_us_ranks=b_ranks,
                live_rows=None, buffer_rows=layer.cfg.capacity)


def measure_swiglu(args: argparse.Namespace, runtime: Any, layer: Any, tokens: int) -> list[dict[str, Any]]:
    """SwiGLU rows of T = ``tokens``: kernel (GPU) / torch (CPU) and plain on the worst-case buffer, its
    live rows from a real sync-free dispatch of the layer's routing (collective)."""
    import torch

    from cute_ep import swiglu as sw
    from cute_ep.collectives import all_gather_objects

    env, dev = runtime.env, runtime.device
    x, _ = inputs(args, env.rank, tokens, dev, layer.cfg.dtype)
    with torch.no_grad():
        w, idx = layer.route(x)
        res = layer.buffer.dispatch(x, idx.to(torch.int32), w, sync=False)
        offs = torch.cumsum(res.tokens_per_expert, 0, dtype=torch.int32)
    rows = layer.cfg.capacity
    g = torch.Generator().manual_seed(tokens)
    gate_up = torch.randn(rows, 2 * args.intermediate, generator=g).to(layer.cfg.dtype).to(dev)
    grad_out = torch.randn(rows, args.intermediate, generator=g).to(layer.cfg.dtype).to(dev)
    out = torch.empty(rows, args.intermediate, dtype=gate_up.dtype, device=dev)
    grad = torch.empty_like(gate_up)
    impls: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "plain": (lambda: sw.swiglu_plain(gate_up), lambda: sw.swiglu_backward_plain(gate_up, grad_out)),
    }
    if dev.type == "cuda":
        k = sw.kernels()
        impls["kernel"] = (lambda: k.forward(gate_up, offs, out),
                           lambda: k.backward(gate_up, grad_out, offs, grad))
    impls["torch"] = (lambda: sw.swiglu_torch(gate_up, offs, out),
                      lambda: sw.swiglu_backward_torch(gate_up, grad_out, offs, grad))
    live = int(offs[-1])  # a report, after the dispatch: the sync does not matter here
    out_rows = []
    for name, (fwd, bwd) in impls.items():
        tf = time_steps(fwd, args.warmup, args.iters, dev, lambda: None)
        tb = time_steps(bwd, args.warmup, args.iters, dev, lambda: None)
        per_rank = all_gather_objects((statistics.median(tf), statistics.median(tb), live), runtime.cpu_group)
        out_rows.append(dict(tokens=tokens, impl=name, forward_us=max(p[0] for p in per_rank),
                             backward_us=max(p[1] for p in per_rank), live_rows=max(p[2] for p in per_rank),
                             buffer_rows=rows))  # fmt: skip
    return out_rows


def deepep_rows(args: argparse.Namespace, runtime: Any, cfg: Any, layer: Any, say: Callable[..., None]
                ) -> list[dict[str, Any]]:
    """DeepEP's forward rows (module docstring), or rows saying why it was skipped (collective)."""
    import torch
    import torch.distributed as dist

    from cute_ep.collectives import all_gather_objects
    from cute_ep.tools import bench_peers as bp

    env, dev = runtime.env, runtime.device
    module, why = bp.import_deep_ep()
    why = bp.deepep_skip_reason(import_error=why, device_type=dev.type, world_size=env.world_size,
                                ranks_per_host=env.physical_local_world_size, dtype=args.dtype,
                                hidden=cfg.hidden, experts_per_rank=cfg.experts_per_rank, topk=cfg.topk)
    why = bp.first_reason(all_gather_objects(why, runtime.cpu_group))
    base = dict(backend="deepep", swiglu="kernel", overlap=False, green_context=False, sync=True,
                fwd_bwd_us=None, fwd_bwd_us_ranks=None, live_rows=None, buffer_rows=None)
    if why is not None:
        return [dict(base, tokens=t, forward_us=None, forward_us_ranks=None, skipped=why)
                for t in args.token_list]
    # The experts as in the "kernel" rows, everything on the current stream.
    layer.swiglu, layer.overlap, layer.comm_stream, layer.gemm_stream = "kernel", False, None, None
    peer = bp.DeepEpPeer(dist.group.WORLD, world_size=env.world_size, hidden=cfg.hidden,
                         num_experts=cfg.num_experts, module=module)
    rows = []
    try:
        budget = peer.budget(args.num_sms)
        el = cfg.experts_per_rank
        for t in args.token_list:
            x, _ = inputs(args, env.rank, t, dev, cfg.dtype)

            def forward(x: torch.Tensor = x) -> torch.Tensor:
                with torch.no_grad():
                    w, idx = layer.route(x)
                    made = budget.dispatch_full(x, idx, w)
                    rows_x, rows_w, src = bp.expert_major_permute(made.recv_x, made.recv_topk_idx,
                                                                  made.recv_topk_weights, made.num_pairs)
                    counts = torch.tensor(made.tokens_per_expert[:el], dtype=torch.int64, device=dev)
                    offs = torch.cumsum(counts, 0).to(torch.int32)
                    y = layer.experts(rows_x, offs)
                    back = torch.zeros(made.recv_x.shape, dtype=torch.float32, device=dev)
                    back.index_add_(0, src, y.float() * rows_w[:, None])
                    out = budget.combine(back.to(cfg.dtype), made.handle)
                    return out + layer.shared_expert(x) if layer.shared_gate_up is not None else out

            times = time_steps(forward, args.warmup, args.iters, dev, runtime.barrier)
            worst, ranks = slowest_median(all_gather_objects(times, runtime.cpu_group))
            rows.append(dict(base, tokens=t, forward_us=worst, forward_us_ranks=ranks,
                             skipped="forward only: DeepEP ships no backward here"))
            say(format_table({"rows": rows[-1:]}).splitlines()[-1])
    finally:
        peer.close()
    return rows


def make_buffer(kind: str, runtime: Any, cfg: Any) -> Any:
    if kind == "cute":
        from cute_ep.buffer import EpBuffer

        return EpBuffer(runtime, cfg)
    if kind == "a2a":
        from cute_ep.a2a_backend import A2aEpBuffer

        return A2aEpBuffer(runtime, cfg, preallocate=True)
    from cute_ep.reference_backend import ReferenceEpBuffer

    return ReferenceEpBuffer(runtime, cfg)


def run(args: argparse.Namespace) -> int:
    import torch

    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime
    from cute_ep.kernels.config import EpConfig
    from cute_ep.moe_layer import GreenContextError, make_green_context
    from cute_ep.tools.cli import Printer

    env = DistEnv.from_environ()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    cfg = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                   num_experts=args.num_experts, topk=args.topk, hidden=args.hidden, dtype=dtype,
                   max_tokens=max(args.token_list), num_sms=args.num_sms)  # fmt: skip
    say = Printer(env.rank)
    runtime_backend = "gloo" if args.backend == "reference" else "nvshmem"
    with Runtime(env, backend=runtime_backend, symmetric_bytes=cfg.symmetric_bytes()) as rt:
        dev = rt.device
        on_gpu = dev.type == "cuda"
        meta = make_meta(args, rt, cfg)
        say(f"MoE layer bench: {where(meta)}; H {cfg.hidden}, I {args.intermediate}, E {cfg.num_experts}, "
            f"top-{cfg.topk}, {args.dtype}, tokens {args.token_list}, capacity {cfg.capacity} rows")
        report: dict[str, Any] = {"schema": SCHEMA, "meta": meta, "rows": [], "swiglu": []}
        comm = torch.cuda.Stream(device=dev, priority=-1) if on_gpu else None
        green = None
        if args.green_context and on_gpu:
            try:
                _, green = make_green_context(args.num_sms, dev)
            except GreenContextError as exc:
                say(f"green context: {exc}")
        kinds = [args.backend] + [p for p in args.peer_list if p == "a2a"]
        for kind in kinds:
            with make_buffer(kind, rt, cfg) as buf:
                layer = build_layer(args, buf, dev)
                for t in args.token_list:
                    for v in variants(args, kind, on_gpu):
                        report["rows"].append(measure_layer(args, rt, layer, kind, t, v, comm, green))
                        say(format_table({"rows": report["rows"][-1:]}).splitlines()[-1])
                    if kind == args.backend:
                        report["swiglu"] += measure_swiglu(args, rt, layer, t)
                if kind == args.backend and "deepep" in args.peer_list:
                    report["rows"] += deepep_rows(args, rt, cfg, layer, say)
                del layer
            if on_gpu:
                torch.cuda.empty_cache()
        rt.barrier()
    if env.rank == 0:
        say("", format_table(report))
        if args.out_json:
            write_report(args.out_json, report)
            say(f"report: {args.out_json}")
        if args.out_png:
            say(f"plot: {plot(report, args.out_png)}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        return report_usage_error(exc)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
