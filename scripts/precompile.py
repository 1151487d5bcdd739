"""Compile the EP kernels ahead of time into the disk cache, on a machine with or without a GPU.

To run (one process; no torchrun, no NVSHMEM initialization):

    python scripts/precompile.py --cache /shared/cute_ep_objects                 # bf16, fp16, fp32
    python scripts/precompile.py --cache /shared/cute_ep_objects --dtype bfloat16
    # later, on the GPU nodes: the first launch loads instead of compiling (~70 s per dtype saved)
    CUTE_EP_COMPILE_CACHE=/shared/cute_ep_objects torchrun --nproc-per-node 4 scripts/dispatch_and_combine.py

Why: one module per element type holds every kernel, and compiling it (NVSHMEM's device library is
linked in) takes tens of seconds per dtype, on every fresh node. A build host without a GPU can do it
once: with no GPU visible the kernels are compiled for sm_90 (H100/H200), the architecture a GPU
host of that kind looks the file up under. Files are named by the key and a fingerprint of the
kernel sources, the DSL and nvshmem4py versions and the architecture, so a file made from other
sources is never loaded.

Constraints: the same nvidia-cutlass-dsl and nvshmem4py versions as the GPU nodes; ``--arch`` only
where no GPU is visible. Exit 0 when every module is in the cache, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time

from cute_ep.cli import DTYPES

DEFAULT_DTYPES = ("bfloat16", "float16", "float32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cache", required=True, help="folder of the object files (CUTE_EP_COMPILE_CACHE)")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                   help="element type to compile (repeatable); default: bfloat16, float16, float32")
    p.add_argument("--arch", default=None,
                   help="target when no GPU is visible (default sm_90); a visible GPU is always the target")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from cute_ep.bootstrap.compile import CPU_TARGET_ARCH, ModuleRegistry, ObjectCache, use_cpu_target
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
    for name in args.dtype or DEFAULT_DTYPES:
        # The module is specialized on the element type alone (EpConfig.compile_key); sizes are run time.
        cfg = EpConfig(world_size=1, local_world_size=1, num_experts=8, topk=2, hidden=128,
                       dtype=DTYPES[name], max_tokens=16, num_sms=4)
        key = cfg.compile_key()
        t0, loads = time.perf_counter(), registry.loads
        registry.get(key, lambda cfg=cfg: build(cfg))
        how = "loaded (already there)" if registry.loads > loads else "compiled"
        print(f"{name}: {how} in {time.perf_counter() - t0:.1f} s -> {cache.path(key)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
