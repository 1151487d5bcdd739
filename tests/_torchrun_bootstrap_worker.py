"""One rank of the CPU bootstrap test (started by torchrun or as a fake srun task).

Usage: python _torchrun_bootstrap_worker.py OUT_DIR EXPECTED_LAUNCHER VIRTUAL_LOCAL_WORLD_SIZE

Reads DistEnv from the environment, starts a gloo Runtime, shares a fake 128-byte NVSHMEM unique
id from rank 0, checks every rank got the same bytes, and writes OUT_DIR/rank<R>.json.
VIRTUAL_LOCAL_WORLD_SIZE > 0 also builds the env with CUTE_EP_LOCAL_WORLD_SIZE set to it.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime, share_unique_id

UID_BYTES = 128  # sizeof(nvshmemx_uniqueid_t)


def topology(env: DistEnv) -> dict[str, object]:
    return {
        "local_world_size": env.local_world_size,
        "nnodes": env.nnodes,
        "node_id": env.node_id,
        "local_index": env.local_index,
        "is_virtual": env.is_virtual,
        "routes": [env.route_class_to(dst) for dst in range(env.world_size)],
    }


def main(out_dir: Path, expected_launcher: str, virtual_lws: int) -> None:
    import torch.distributed as dist

    env = DistEnv.from_environ()
    assert env.launcher == expected_launcher, (env.launcher, expected_launcher)
    virtual = None
    if virtual_lws > 0:
        virtual = DistEnv.from_environ({**os.environ, "CUTE_EP_LOCAL_WORLD_SIZE": str(virtual_lws)})

    make_uid_calls = 0

    def make_uid() -> np.ndarray:
        nonlocal make_uid_calls
        make_uid_calls += 1
        return np.frombuffer(os.urandom(UID_BYTES), dtype=np.int8).copy()

    finalized: list[str] = []
    with Runtime(env, backend="gloo", timeout=timedelta(seconds=30)) as rt:
        rt.add_finalizer(lambda: finalized.append("first"))
        rt.add_finalizer(lambda: finalized.append("second"))
        assert rt.device is not None and rt.device.type == "cpu"
        assert dist.get_rank() == env.rank and dist.get_world_size() == env.world_size

        uid = share_unique_id(rt.cpu_group, make_uid, env.rank)
        assert uid.dtype == np.uint8 and uid.shape == (UID_BYTES,), (uid.dtype, uid.shape)

        everyone: list[str | None] = [None] * env.world_size
        dist.all_gather_object(everyone, uid.tobytes().hex(), group=rt.cpu_group)
        # Where each rank thinks it is, so the test can cross-check the whole launch from one file.
        placements: list[object] = [None] * env.world_size
        dist.all_gather_object(placements, [env.node_id, env.local_index, env.local_rank], group=rt.cpu_group)
        rt.barrier()

    result = {
        "rank": env.rank,
        "world_size": env.world_size,
        "local_rank": env.local_rank,
        "physical_local_world_size": env.physical_local_world_size,
        "launcher": env.launcher,
        "describe": env.describe(),
        "topology": topology(env),
        "virtual": topology(virtual) if virtual is not None else None,
        "uid_hex": uid.tobytes().hex(),
        "all_uids_equal": len(set(everyone)) == 1,
        "uid_nonzero": bool(uid.any()),
        "make_uid_calls": make_uid_calls,
        "placements": placements,
        "finalized": finalized,
        "closed": rt.closed,
        "pg_after_close": dist.is_initialized(),
    }
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
