"""Small collectives on any torch.distributed group (gloo or NCCL), that also work with no process group
at all (a world of one): what the backends, the checks and the scripts use to agree on host values."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_objects", "broadcast_from_root", "collective_device", "world_of"]




def world_of(group: Any) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group: Any) -> torch.device:
    # A pure NCCL group cannot reduce CPU tensors; mixed "cpu:gloo,cuda:nccl" and gloo can.
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of ``group`` (collective);
    ``[obj]`` without an initialised process group."""
    _, world = world_of(group)
    if world == 1 and not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_root(obj: Any, group: Any) -> Any:
    """The ``obj`` of ``group``'s rank 0 (a value or an exception) on every rank (collective);
    ``obj`` itself without an initialised process group."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


