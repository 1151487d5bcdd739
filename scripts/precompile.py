"""Compile the EP kernels (and the MoE layer's SwiGLU kernels) ahead of time into the disk cache, on a
machine with or without a GPU.

To run (one process; no torchrun, no NVSHMEM initialization):

    python scripts/precompile.py --cache /shared/cute_ep_objects                 # bf16, fp16, fp32
    python scripts/precompile.py --cache /shared/cute_ep_objects --dtype bfloat16
    # later, on the GPU nodes: the first launch loads instead of compiling (minutes per dtype saved)
    CUTE_EP_COMPILE_CACHE=/shared/cute_ep_objects torchrun --nproc-per-node 4 scripts/dispatch_and_combine.py

Why: one module per element type holds every kernel, and compiling it (NVSHMEM's device library is
linked in) takes minutes per dtype, on every fresh node. A build host without a GPU can do it
once: with no GPU visible the kernels are compiled for sm_90 (H100/H200), the architecture a GPU
host of that kind looks the file up under. Files are named by the key and a fingerprint of the
kernel sources, the DSL and nvshmem4py versions and the architecture, so a file made from other
sources is never loaded.

Progress: one line per dtype when it starts (loading from the cache, or compiling: measured 138-146 s
per dtype on one machine and about 7 min per dtype on a 2-core machine, 2026-11-27; longer beside other
work), a line every --progress-every seconds while it compiles, and one when it is done. LLVM's warning
"Linking two modules of different data layouts" (printed by the native compiler while NVSHMEM's device
library is linked in, harmless) is kept out of stderr; every other line there passes through.

Constraints: the same nvidia-cutlass-dsl and nvshmem4py versions as the GPU nodes; ``--arch`` only
where no GPU is visible. Exit 0 when every module is in the cache, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from cute_ep.tools.cli import DTYPES

DEFAULT_DTYPES = ("bfloat16", "float16", "float32")
MEASURED = "138-146 s per dtype on one machine, about 7 min per dtype on a 2-core machine (2026-11-27)"
"""How long this script took per dtype, with the machines: what the plan line quotes. Beside other work
it takes longer: 613, 991 and 1336 s for bf16, fp32 and fp16 on a busy 2-core machine (2026-11-26)."""
MEASURED_S = (138, 420)
"""The range of MEASURED in seconds (about 7 min = 420 s): what the totals and the progress lines quote."""
PROGRESS_EVERY_S = 30.0
LAYOUT_WARNING = "Linking two modules of different data layouts"
"""LLVM's warning when NVSHMEM's device library (built with another data layout string) is linked into
the module: harmless, and printed on every compile."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="folder of the object files (CUTE_EP_COMPILE_CACHE)")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                   help="element type to compile (repeatable); default: bfloat16, float16, float32")
    p.add_argument("--arch", default=None,
                   help="target when no GPU is visible (default sm_90); a visible GPU is always the target")
    p.add_argument("--no-swiglu", dest="swiglu", action="store_false",
                   help="compile the EP kernels only; without this flag the MoE layer's SwiGLU kernels "
                        "(forward and backward per dtype) are compiled too")
    p.add_argument("--progress-every", type=float, default=PROGRESS_EVERY_S, metavar="SECONDS",
                   help="print how long a compile has run every this many seconds (0: never; "
                        "default: %(default)s)")
    return p


_WATCHER = r"""
import os, select, sys, time
name, every, lo, hi, pattern = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
start = time.monotonic()
due = start + every if every > 0 else None
pending, after_drop = b"", False

def forward(line):
    global after_drop
    text = line.decode(errors="replace")
    if pattern in text or (after_drop and not text.strip()):
        after_drop = pattern in text
        return
    after_drop = False
    os.write(2, line)

while True:
    wait = None if due is None else max(0.0, due - time.monotonic())
    if select.select([0], [], [], wait)[0]:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            forward(line + b"\n")
    if due is not None and time.monotonic() >= due:
        os.write(1, f"  {name}: compiling, {time.monotonic() - start:.0f} s so far "
                    f"(measured {lo}-{hi} s per dtype)\n".encode())
        due += every
if pending:
    forward(pending)
"""
"""The watcher process of ``watched_compile``: it reads what the compile writes to stderr (its stdin),
passes every line on except LLVM's data layout warning (and an empty line right after one), and every
``every`` seconds prints how long the compile has run."""


@contextmanager
def watched_compile(name: str, every: float) -> Iterator[None]:
    """While the body runs, this process's file descriptor 2 (Python's stderr and native code's alike)
    goes through a watcher process (``_WATCHER``) that keeps LLVM's data layout warning out and prints
    the compile's progress every ``every`` seconds (0: never).

    Why a process and not a thread: the DSL's compile holds the GIL for its whole run (one bf16 module:
    a single stretch of 1300 s on a loaded 2-core machine), so a thread of this process neither ticks nor
    drains the pipe until it ends; a compiler writing more than a pipe's buffer would then block."""
    lo, hi = MEASURED_S
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, name, str(every), str(lo), str(hi),
                                LAYOUT_WARNING], stdin=read_fd)  # stdout, stderr: this process's own
    os.close(read_fd)
    saved = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the watcher reads to the end and stops
        os.close(saved)
        try:
            watcher.wait(timeout=10.0)
        except subprocess.TimeoutExpired:  # a child of the compile still holds the pipe
            watcher.kill()


def compile_with_progress(name: str, compile_fn: Callable[[], Any], *, cached: bool,
                          every: float) -> tuple[Any, float]:
    """``compile_fn()`` (a load when ``cached``: no progress lines) under ``watched_compile``; returns its
    result and the seconds it took."""
    t0 = time.perf_counter()
    with watched_compile(name, 0 if cached else every):
        result = compile_fn()
    return result, time.perf_counter() - t0


def plan_line(names: list[str], cached: list[str], arch: str) -> str:
    """The first line: what will be compiled, for which architecture, and about how long it takes."""
    todo = [n for n in names if n not in cached]
    lo, hi = MEASURED_S
    head = f"precompile: {len(names)} dtype(s) for {arch}"
    if not todo:
        return f"{head}, all in the cache already"
    loads = f"; {', '.join(cached)} from the cache" if cached else ""
    return (f"{head}: compiling {', '.join(todo)}{loads}; measured {MEASURED}: "
            f"{len(todo) * lo / 60:.0f}-{len(todo) * hi / 60:.0f} min in all, longer beside other work")


def say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from cute_ep.bootstrap.compile import (
        CPU_TARGET_ARCH,
        ModuleRegistry,
        ObjectCache,
        target_arch,
        use_cpu_target,
    )
    from cute_ep.kernels import swiglu, token_layout
    from cute_ep.kernels.config import EpConfig
    from cute_ep.kernels.host import build

    if torch.cuda.is_available():
        if args.arch:
            print(f"--arch {args.arch} is for hosts without a GPU; this one compiles for its GPU",
                  file=sys.stderr)
            return 2
    else:
        use_cpu_target(args.arch or CPU_TARGET_ARCH)
    cache = ObjectCache(args.cache)
    registry = ModuleRegistry(register=False, disk=cache)
    names = list(args.dtype or DEFAULT_DTYPES)
    # The module is specialized on the element type alone (EpConfig.compile_key); sizes are run time.
    configs = {name: EpConfig(world_size=1, local_world_size=1, num_experts=8, topk=2, hidden=128,
                              dtype=DTYPES[name], max_tokens=16, num_sms=4) for name in names}
    cached = [n for n in names if cache.path(configs[n].compile_key()).exists()]
    say(plan_line(names, cached, target_arch()))
    for i, name in enumerate(names, 1):
        cfg = configs[name]
        key = cfg.compile_key()
        what = "loading from the cache" if name in cached else "compiling"
        say(f"{name} ({i}/{len(names)}): {what} ...")
        loads = registry.loads
        _, took = compile_with_progress(name, lambda cfg=cfg, key=key: registry.get(key, lambda: build(cfg)),
                                        cached=name in cached, every=args.progress_every)
        how = "loaded (already there)" if registry.loads > loads else "compiled"
        say(f"{name}: {how} in {took:.1f} s -> {cache.path(key)}")
        if args.swiglu:
            # The MoE layer's SwiGLU kernels (no NVSHMEM): built on a layer's first use otherwise.
            for direction in ("forward", "backward"):
                skey = swiglu.compile_key(direction, DTYPES[name])
                compile_apart(registry, f"{name} SwiGLU {direction}", skey,
                              lambda d=direction, n=name: swiglu.build(d, DTYPES[n]), args.progress_every)
    # cute_ep.deep_ep's get_dispatch_layout kernel, per id type (no element type; seconds to build)
    for id_type in token_layout.ID_TYPES:
        compile_apart(registry, f"token layout ({id_type} ids)", token_layout.compile_key(id_type),
                      lambda i=id_type: token_layout.build(i), args.progress_every)
    return 0


def compile_apart(registry: Any, label: str, key: tuple, build: Callable[[], Any], every: float) -> None:
    """One kernel compiled apart from the EP module (no NVSHMEM; seconds to build), built or loaded into
    ``registry``'s cache under ``key``, and a line saying which and how long it took."""
    loads, t0 = registry.loads, time.perf_counter()
    with watched_compile(label, every):
        registry.get(key, build)
    how = "loaded (already there)" if registry.loads > loads else "compiled"
    say(f"{label}: {how} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
