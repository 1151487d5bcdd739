"""What one kernel launch costs the host, by how its arguments are passed: the floor under every public call.

To run (one GPU, no NVSHMEM, no CuTe DSL; the CUDA driver and torch only):

    python scripts/launch_cost.py
    python scripts/launch_cost.py --params 1,16,84,128 --struct-bytes 536 --out-json launch_cost.json

Each kernel is an empty one, written in PTX here and loaded through the driver (``cuModuleLoadData``), then
launched with ``cuLaunchKernel`` called through ctypes on an argument array packed once, so the Python
around a launch is one foreign call whatever the kernel's parameters: the time per launch is the driver's.
Kernels: one per ``--params`` count N (N separate 8-byte parameters, as the CuTe DSL passes a kernel's
flattened arguments; the cute-ep module's kernels take 84, 536 bytes), one taking a single parameter of
``--struct-bytes`` bytes (the same bytes as one block, as torch's kernels take theirs), and one taking
those bytes through ``CU_LAUNCH_PARAM_BUFFER_POINTER`` (one packed buffer). Beside them, a one-element
torch ``add_`` (torch's own launch path).

Timing: bursts of ``--burst`` launches from an idle GPU, host time per launch (``perf_counter`` around
the burst, divided), then a stream sync outside the timing, so the launch queue never fills (a full
queue makes the host wait for the GPU and times the kernels instead); median over ``--rounds`` bursts.
And each kind once as the public-calls report times a call: CUDA events around one launch started on an
idle GPU (``scripts/public_calls.py``'s ``one_launch_us``), median over ``--rounds``.

Output: a table on stdout; with --out-json PATH ``{"schema", "meta", "rows"}``, one row per kernel kind
(``kind``, ``params``, ``param_bytes``, ``host_us`` median, ``host_us_min``, ``event_us`` median).
Exit status: 0 done, 1 no GPU or a driver error, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = "cute_ep.launch_cost/1"
PTX_HEADER = ".version 7.8\n.target sm_70\n.address_size 64\n"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(not 1 <= v <= 512 for v in values):
        raise argparse.ArgumentTypeError(f"every count must be in [1, 512], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=_int_list, default=[1, 16, 84, 128],
                   help="kernels with this many 8-byte parameters each (default 1,16,84,128)")
    p.add_argument("--struct-bytes", type=int, default=536,
                   help="bytes of the one-parameter and packed-buffer kernels (multiple of 8, 8-4096; "
                        "default 536, the cute-ep module's kernels' parameter bytes)")
    p.add_argument("--burst", type=int, default=32, help="launches per timed burst (1-512, default 32)")
    p.add_argument("--rounds", type=int, default=200, help="bursts (and event-timed launches) per kind")
    p.add_argument("--out-json", default=None, help="write the rows here")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.struct_bytes % 8 or not 8 <= args.struct_bytes <= 4096:
        p.error(f"--struct-bytes must be a multiple of 8 in [8, 4096], got {args.struct_bytes}")
    if not 1 <= args.burst <= 512:
        p.error(f"--burst must be in [1, 512] (the launch queue must not fill), got {args.burst}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def kernel_ptx(kind: str, count: int) -> tuple[str, str]:
    """(entry name, PTX text) of an empty kernel: ``count`` u64 parameters ("separate"), or one parameter
    of ``count`` bytes ("struct")."""
    name = f"empty_{kind}_{count}"
    if kind == "separate":
        params = ",\n".join(f"  .param .u64 p{i}" for i in range(count))
    else:
        params = f"  .param .align 8 .b8 p0[{count}]"
    return name, f"{PTX_HEADER}.visible .entry {name}(\n{params}\n)\n{{\n  ret;\n}}\n"


class Driver:
    """The few CUDA driver calls used here, through ctypes on libcuda (torch's context made current)."""

    def __init__(self) -> None:
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("libcuda.so.1 not found: this script needs an NVIDIA driver")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def check(self, code: int, what: str) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise RuntimeError(f"{what} failed: CUDA driver error {code} ({(text.value or b'').decode()})")

    def function(self, name: str, ptx: str) -> ctypes.c_void_p:
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx.encode() + b"\0"), f"loading {name}")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"finding {name}")
        self._keep = getattr(self, "_keep", []) + [module]
        return func


def launches(driver: Driver, func: ctypes.c_void_p, stream: int, kind: str, count: int
             ) -> Callable[[], int]:
    """A function making one launch of ``func`` (arguments packed once, kept alive by the function),
    returning the driver's code. kind: "separate" (``count`` u64 parameters), "struct" (one parameter of
    ``count`` bytes) or "buffer" (those bytes as one packed buffer, ``CU_LAUNCH_PARAM_BUFFER_POINTER``)."""
    launch = driver.lib.cuLaunchKernel
    params, extra = None, None
    if kind == "separate":
        values = (ctypes.c_uint64 * count)(*range(count))
        params = (ctypes.c_void_p * count)(*(ctypes.addressof(values) + 8 * i for i in range(count)))
        kept: tuple = (values, params)
    else:
        blob = (ctypes.c_uint8 * count)()
        if kind == "struct":
            params = (ctypes.c_void_p * 1)(ctypes.addressof(blob))
            kept = (blob, params)
        else:  # CU_LAUNCH_PARAM_BUFFER_POINTER (1), the buffer, CU_LAUNCH_PARAM_BUFFER_SIZE (2), its size
            size = ctypes.c_size_t(count)
            extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(blob), 2, ctypes.addressof(size), 0)
            kept = (blob, size, extra)

    def one_launch(kept: tuple = kept) -> int:  # kept: the arrays params / extra point into stay alive
        return launch(func, 1, 1, 1, 32, 1, 1, 0, stream, params, extra)

    return one_launch


def time_kind(call: Callable[[], object], burst: int, rounds: int, sync: Callable[[], None],
              event_time: Callable[[Callable[[], object]], float]) -> tuple[float, float, float]:
    """(median host us per launch over bursts, the fastest burst's, median event-timed us of one launch)."""
    for _ in range(3):  # warm: first launches load code
        call()
    sync()
    per_launch = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(burst):
            call()
        per_launch.append((time.perf_counter() - t0) / burst * 1e6)
        sync()
    events = [event_time(call) for _ in range(rounds)]
    return statistics.median(per_launch), min(per_launch), statistics.median(events)


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("launch_cost.py needs a GPU: torch sees none", file=sys.stderr)
        return 1
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=dev)  # torch's context, made current for the driver calls below
    driver = Driver()
    stream = torch.cuda.current_stream(dev).cuda_stream

    def sync() -> None:
        torch.cuda.synchronize(dev)

    def event_time(call: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        start.record()
        code = call()
        end.record()
        end.synchronize()
        if code:
            driver.check(code, "a launch")
        return start.elapsed_time(end) * 1e3

    kinds: list[tuple[str, int, int, Callable[[], object]]] = []
    for count in args.params:
        name, ptx = kernel_ptx("separate", count)
        kinds.append(("separate", count, 8 * count,
                      launches(driver, driver.function(name, ptx), stream, "separate", count)))
    name, ptx = kernel_ptx("struct", args.struct_bytes)
    func = driver.function(name, ptx)
    kinds.append(("struct", 1, args.struct_bytes,
                  launches(driver, func, stream, "struct", args.struct_bytes)))
    kinds.append(("packed buffer", 1, args.struct_bytes,
                  launches(driver, func, stream, "buffer", args.struct_bytes)))
    one = torch.zeros(1, device=dev)

    def torch_add() -> int:
        one.add_(1)
        return 0

    kinds.append(("torch add_", 0, 0, torch_add))

    rows = []
    print(f"{'kernel':<16} {'params':>6} {'bytes':>6} {'host us/launch':>15} {'fastest':>8} "
          f"{'events us':>10}")
    for kind, params, nbytes, call in kinds:
        code = call()
        if code:
            driver.check(code, f"launching the {kind} kernel")
        host, fastest, event = time_kind(call, args.burst, args.rounds, sync, event_time)
        rows.append({"kind": kind, "params": params, "param_bytes": nbytes, "host_us": host,
                     "host_us_min": fastest, "event_us": event})
        print(f"{kind:<16} {params:>6} {nbytes:>6} {host:>15.2f} {fastest:>8.2f} {event:>10.2f}")
    if args.out_json:
        meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                "burst": args.burst, "rounds": args.rounds,
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["python", "scripts/launch_cost.py", *sys.argv[1:]])}
        Path(args.out_json).write_text(json.dumps({"schema": SCHEMA, "meta": meta, "rows": rows}, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except RuntimeError as exc:
        print(f"launch_cost.py: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
