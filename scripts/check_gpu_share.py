"""What each rank of a launch got: its GPU, who shares it, CUDA MPS, its SM share and heap; then one
NVSHMEM barrier and a peer store, so a launch with several ranks per GPU is known to work before a long run.

To run (one GPU shared by 4 ranks; start MPS first):

    bash scripts/mps.sh start
    torchrun --nproc-per-node 4 scripts/check_gpu_share.py
    torchrun --nproc-per-node 8 scripts/check_gpu_share.py --symmetric-gib 7   # DeepSeek-V3 size heaps

Every rank prints one line (rank, GPU, ranks on it, MPS, the MPS thread percentage in force, the GPU's SMs,
this rank's SM share, the heap); rank 0 then checks that every rank wrote its rank into its right-hand
neighbour's symmetric memory (NVSHMEM peer pointers) and prints PASS. Exit status: 0 PASS, 1 a failure
(e.g. ranks share a GPU without MPS: the Runtime's error says how to start it), 2 bad arguments.
"""

from __future__ import annotations

import os
import sys

from cute_ep.tools.usage import report_usage_error, script_parser


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--symmetric-gib", type=float, default=0.0,
                   help="symmetric buffers to size each rank's heap for, in GiB (the heap check runs on it)")
    args = p.parse_args(argv)
    if args.symmetric_gib < 0:
        return report_usage_error(f"--symmetric-gib must be >= 0, got {args.symmetric_gib}")

    import torch

    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.gpu_share import MPS_PERCENTAGE_VAR
    from cute_ep.bootstrap.runtime import GIB, Runtime
    from cute_ep.tools.cli import all_gather

    env = DistEnv.from_environ()
    try:
        rt = Runtime(env, symmetric_bytes=int(args.symmetric_gib * GIB)).start()
    except Exception as exc:  # the reason, on the rank that met it
        print(f"rank {env.rank}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    with rt:
        import nvshmem.core as nvshmem

        limit = "no limit" if rt.mps_sm_limit is None else f"{rt.mps_sm_limit} for this process"
        line = (f"rank {env.rank}: {rt.placement.describe()}, MPS {rt.mps}, "
                f"{MPS_PERCENTAGE_VAR}={os.environ.get(MPS_PERCENTAGE_VAR)}, {rt.device_sms} SMs "
                f"({limit}), share {rt.sm_share}, heap {rt.symmetric_size}, "
                f"group {torch.distributed.get_backend()}")
        print(line, flush=True)
        slot = nvshmem.tensor((1,), dtype=torch.int32)
        slot.fill_(-1)
        rt.barrier()
        right = (env.rank + 1) % env.world_size
        nvshmem.get_peer_tensor(slot, right).fill_(env.rank)
        torch.cuda.synchronize()
        rt.barrier()
        got = int(slot.item())
        seen = all_gather((got, (env.rank - 1) % env.world_size), rt.cpu_group)
        nvshmem.free_tensor(slot)
        bad = [r for r, (value, want) in enumerate(seen) if value != want]
        if env.rank == 0:
            print("PASS" if not bad else f"FAIL: ranks {bad} did not see their left neighbour's store")
        return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
