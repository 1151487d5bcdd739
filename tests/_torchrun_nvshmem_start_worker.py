"""One rank of tests/test_nvshmem_start.py's gloo worlds, and the stand-ins for NVSHMEM and cuda.core that
the test module uses in process too.

Usage (``_launch.worker_results``): python _torchrun_nvshmem_start_worker.py OUT_DIR

In a gloo Runtime of the launch, with NVSHMEM and cuda.core replaced by ``FakeNvshmem`` and ``FakeDevice``
(no GPU here), every rank runs ``start_nvshmem`` over the group, once as it is and once with the group
reported as pure NCCL (the unique id then goes as a pickled object), then ``cute_ep.deep_ep``'s
``NvshmemSession`` on the group, with a GPU of its own per rank and with one GPU for all ranks; it writes
what each call did to OUT_DIR/rank{r}.json for the test module to check.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

UID_DTYPE = np.dtype({"names": ["version", "internal"], "formats": ["<i4", ("i1", (124,))],
                      "offsets": [0, 4], "itemsize": 128, "aligned": True})
"""nvshmem4py's unique id layout (``nvshmem.bindings.uniqueid()._data``): one 128-byte record."""
GIB = 1 << 30


class FakeUid:
    """A unique id: ``_data`` is a one-element record array, as nvshmem4py's."""

    def __init__(self) -> None:
        self._data = np.zeros(1, dtype=UID_DTYPE)

    def hex(self) -> str:
        return self._data.view(np.uint8).tobytes().hex()


class FakeDevice:
    """cuda.core's Device: records ``set_current`` in ``log``."""

    def __init__(self, index: int, log: list[str]) -> None:
        self.index = index
        self.log = log

    def set_current(self) -> None:
        self.log.append(f"set_current {self.index}")


class FakeNvshmem:
    """``nvshmem.core``'s calls that starting and finalising NVSHMEM makes, recorded in ``log``; a made
    unique id holds random bytes (``made``: its hex), which only rank 0's call can produce. ``pe_offset``:
    added to the PE that ``my_pe`` reports (a PE that does not match the rank)."""

    def __init__(self, pe_offset: int = 0) -> None:
        self.log: list[str] = []
        self.made: str | None = None
        self.inits: list[dict[str, Any]] = []
        self.finalized = 0
        self.pe_offset = pe_offset

    def device(self, index: int) -> FakeDevice:
        return FakeDevice(index, self.log)

    def get_unique_id(self, empty: bool = False) -> FakeUid:
        self.log.append(f"get_unique_id(empty={empty})")
        uid = FakeUid()
        if not empty:
            uid._data.view(np.uint8)[:] = np.frombuffer(os.urandom(128), dtype=np.uint8)
            self.made = uid.hex()
        return uid

    def init(self, *, device: FakeDevice, uid: FakeUid, rank: int, nranks: int,
             initializer_method: str) -> None:
        self.log.append("init")
        self.inits.append({"device": device.index, "uid": uid.hex(), "rank": rank, "nranks": nranks,
                           "initializer_method": initializer_method})

    def my_pe(self) -> int:
        return self.inits[-1]["rank"] + self.pe_offset

    def n_pes(self) -> int:
        return self.inits[-1]["nranks"]

    def finalize(self) -> None:
        self.log.append("finalize")
        self.finalized += 1


def install(fake: FakeNvshmem) -> None:
    """Make ``cute_ep.bootstrap.nvshmem_start`` use ``fake`` for NVSHMEM and cuda.core (for the rest of the
    process: a worker's own fakes)."""
    from cute_ep.bootstrap import nvshmem_start

    nvshmem_start.nvshmem_core = lambda: fake
    nvshmem_start.cuda_core_device = fake.device


class FakeProps:
    """What ``torch.cuda.get_device_properties`` reports of a GPU: its UUID and memory."""

    def __init__(self, uuid: str, total_memory: int) -> None:
        self.uuid = uuid
        self.total_memory = total_memory


def outcome(fn) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}


def results(rt: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from cute_ep.bootstrap import nvshmem_start
    from cute_ep.bootstrap.runtime import HEAP_ENV_VAR
    from cute_ep.deep_ep.runtime import GroupRuntime, NvshmemSession

    env = rt.env
    out: dict[str, Any] = {"rank": env.rank, "world": env.world_size,
                           "env_before": os.environ.get(HEAP_ENV_VAR)}

    # start_nvshmem over the launch's gloo group.
    fake = FakeNvshmem()
    install(fake)
    heap = nvshmem_start.start_nvshmem(rt.cpu_group, env.rank, env.world_size, env.rank, 3 * GIB)
    out["start"] = {"heap": [heap.size, heap.nbytes, heap.budget, heap.set_here],
                    "env": os.environ.get(HEAP_ENV_VAR), "made": fake.made, "inits": fake.inits,
                    "log": fake.log}
    os.environ.pop(HEAP_ENV_VAR)

    # The same over a group that reports itself as pure NCCL: the id goes by broadcast_object_list.
    fake = FakeNvshmem()
    install(fake)
    objects = []
    get_backend, broadcast_object_list = dist.get_backend, dist.broadcast_object_list
    dist.get_backend = lambda group=None: "nccl"
    dist.broadcast_object_list = lambda box, *a, **k: objects.append(1) or broadcast_object_list(box, *a, **k)
    try:
        nvshmem_start.start_nvshmem(rt.cpu_group, env.rank, env.world_size, 0, GIB)
    finally:
        dist.get_backend, dist.broadcast_object_list = get_backend, broadcast_object_list
    out["nccl"] = {"made": fake.made, "inits": fake.inits, "object_broadcasts": len(objects)}
    os.environ.pop(HEAP_ENV_VAR)

    # cute_ep.deep_ep's session: every rank on a GPU of its own, two Buffers, then the last release.
    get_device_properties = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda index: FakeProps(f"GPU-{env.rank}", 80 * GIB)
    fake = FakeNvshmem()
    install(fake)
    runtime = GroupRuntime(rt.group, torch.device("cuda", env.rank))
    first = NvshmemSession.attach(runtime, 2 * GIB)
    second = NvshmemSession.attach(GroupRuntime(rt.group, torch.device("cuda", env.rank)), GIB)
    session = {"same": first is second, "users": first.users, "heap_bytes": first.heap_bytes,
               "env": os.environ.get(HEAP_ENV_VAR), "backend": runtime.backend, "inits": fake.inits,
               "made": fake.made,
               "too_big": outcome(lambda: NvshmemSession.attach(runtime, 3 * GIB))}
    first.release()
    session["after_one_release"] = [fake.finalized, os.environ.get(HEAP_ENV_VAR),
                                    NvshmemSession.current is first]
    second.release()
    session["after_last_release"] = [fake.finalized, os.environ.get(HEAP_ENV_VAR),
                                     NvshmemSession.current is None]
    out["session"] = session

    # Every rank on one GPU of 8 GiB: 6 GiB of buffers per rank cannot fit beside the others'.
    torch.cuda.get_device_properties = lambda index: FakeProps("GPU-shared", 8 * GIB)
    fake = FakeNvshmem()
    install(fake)
    try:
        shared = outcome(lambda: NvshmemSession.attach(GroupRuntime(rt.group, torch.device("cuda", 0)),
                                                        6 * GIB))
    finally:
        torch.cuda.get_device_properties = get_device_properties
    out["shared"] = {**shared, "env": os.environ.get(HEAP_ENV_VAR), "log": fake.log,
                     "current": NvshmemSession.current is not None}
    if NvshmemSession.current is not None:  # a world of one shares no GPU: its session started
        NvshmemSession.current.release()
    return out


if __name__ == "__main__":
    from _launch import gloo_worker_main

    gloo_worker_main(results)
