"""The argument checks of ``cute_ep.deep_ep.Buffer``'s calls, and the agreement that makes every rank raise.

A collective call whose arguments are wrong on one rank must not leave the other ranks waiting in it (nor
in whatever collective the failing rank runs next, ``destroy()`` included). So the calls check their
arguments on each rank first (the functions here raise ``ValueError`` naming the argument, the value and
what is accepted) and then, where the call is collective and synchronous anyway, ``agree``: every rank
sends its error (or None) and the values that must match across ranks, and every rank raises alike, as
``ReferenceEpBuffer`` does with its own inputs. Nothing has been moved or changed when they raise: the
Buffer stays usable.

``CallChecks`` holds the checks that both modes of ``Buffer`` share, and ``_agreed``: a call's checks,
agreed over the group wherever the call waits on the host anyway.

``drain_gloo`` is what ``destroy()`` runs last on a gloo group it does not own (its docstring says why).
"""

from __future__ import annotations

import hashlib
import numbers
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.collectives import all_gather_objects, collective_device, world_of
from cute_ep.deep_ep.handles import NormalHandle
from cute_ep.deep_ep.utils import plain_torch_defaults
from cute_ep.input_checks import check_tensor_args
from cute_ep.kernels.config import SUPPORTED_DTYPES

__all__ = ["CallChecks", "agree", "check_expert_ids", "check_tensors", "drain_gloo", "error_of",
           "outside_ids", "same_digest"]

_ID_DTYPES = (torch.int64, torch.int32)


def error_of(check: Callable[[], Any]) -> tuple[Any, ValueError | None]:
    """(check's result, None), or (None, the ValueError it raised)."""
    try:
        return check(), None
    except ValueError as exc:
        return None, exc


def agree(group: Any, what: str, error: ValueError | None, same: dict[str, Any]) -> None:
    """Collective over ``group``: raise on every rank if any rank's ``error`` is set (this rank's own error
    as it is; elsewhere a ``ValueError`` naming the ranks at fault and their messages), or if a value of
    ``same`` (name -> a value with a deterministic repr; ignored where errors are set) differs between
    ranks. One small collective when every rank is alike (``_all_alike``); the messages and values travel
    only when they are needed."""
    if _all_alike(group, error, same):
        return
    gathered = all_gather_objects((None if error is None else str(error), None if error else same), group)
    if error is not None:
        raise error
    bad = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e is not None]
    if bad:
        raise ValueError(f"{what}: invalid arguments on another rank, so every rank raises "
                         f"({'; '.join(bad)})")
    for name, mine in same.items():
        values = [s[name] for _, s in gathered]
        if any(v != mine for v in values):
            raise ValueError(f"{what}: {name} must be the same on every rank, got {values} (by rank)")


def _all_alike(group: Any, error: ValueError | None, same: dict[str, Any]) -> bool:
    """True when no rank of ``group`` has an error and every rank's ``same`` has the same 64-bit digest of
    its repr: one gather of 8 bytes per rank (collective). Why: gathering pickled objects (two collectives
    and the pickling) took 1.07 ms per call on a 2x H100 host (2026-11-28), the largest part of the host
    time of a synchronizing dispatch."""
    _, world = world_of(group)
    if world == 1 and not dist.is_initialized():
        return error is None
    digest = -1 if error is not None else same_digest(same)  # -1: a rank at fault, never alike
    device = collective_device(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return error is None and all(int(d) == digest for d in torch.cat(every).tolist())


def same_digest(same: dict[str, Any]) -> int:
    """A signed 64-bit digest of ``same`` (name -> a value with a deterministic repr): equal on two ranks
    exactly when their values print alike."""
    return int.from_bytes(hashlib.blake2b(repr(sorted(same.items())).encode(), digest_size=8).digest(),
                          "little", signed=True)


def check_tensors(device: torch.device, **args: tuple[Any, str, torch.dtype]) -> None:
    """``InputTypeError`` (a ValueError) for the first argument that is not a tensor: name=(value, what is
    expected, the dtype to convert to); None values are skipped (optional arguments)."""
    given = [(n, v, want, dt) for n, (v, want, dt) in args.items() if v is not None]
    check_tensor_args(device, *given)


def outside_ids(ids: Tensor, num_experts: int) -> Tensor:
    """Where ``ids`` holds values outside [-1, num_experts) (bool, ids' shape; no host sync)."""
    return (ids < -1) | (ids >= num_experts)


def check_expert_ids(ids: Tensor, num_experts: int, name: str = "topk_idx") -> None:
    """Every id in [-1, num_experts): DeepEP defines -1 (no expert) and the experts, nothing else. The
    message names the first id outside, where it is, and the range found (one host sync on a GPU)."""
    if not ids.numel():
        return
    outside = outside_ids(ids, num_experts)
    if not bool(outside.any()):
        return
    t, k = (int(i) for i in outside.nonzero()[0])
    raise ValueError(
        f"{name} values must be expert ids in [0, {num_experts}) or -1 (no expert), got {int(ids[t, k])} at "
        f"[{t}, {k}] (min {int(ids.min())}, max {int(ids.max())}); num_experts={num_experts}"
    )


def _check_row_dtype(name: str, rows: Tensor, why: str = "") -> None:
    """ValueError unless ``rows`` (the argument ``name``) is bfloat16, float16 or float32, saying how to
    convert it."""
    if rows.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be bfloat16, float16 or float32{why}, got {rows.dtype}; convert it "
                         f"with {name}.to(torch.bfloat16)")


class CallChecks:
    """The argument checks both modes of ``Buffer`` share. They use what ``BufferLifecycle`` sets
    (``group_size``, ``backend``, ``runtime``, ``device``)."""

    def _agreed(self, what: str, check: Callable[[], Any], same: Callable[[Any], dict[str, Any]], *,
                synced: bool) -> Any:
        """``check()`` (a call's argument checks on this rank; returns what the call needs), agreed over the
        group before anything moves (``checks.agree``: if any rank's arguments are wrong, or ``same(result)``
        differs between ranks, every rank raises ValueError) wherever the call waits on the host anyway: on
        the reference backend, and on the kernels' only with ``synced``. A sync-free call on the kernels
        raises on the rank at fault alone (an agreement would be a collective and a host sync; its peers'
        kernels end with PeerTimeout)."""
        with plain_torch_defaults():  # the caller's default device would route every torch call here
            result, error = error_of(check)
            if self.group_size > 1 and (self.backend == "reference" or synced):
                agree(self.runtime.cpu_group, what, error, {} if error is not None else same(result))
            elif error is not None:
                raise error
        return result

    @staticmethod
    def _route(handle: Any, kind: type) -> Any:
        if not isinstance(handle, kind):
            raise ValueError(
                f"handle must be the {kind.__name__} this Buffer's "
                f"{'dispatch' if kind is NormalHandle else 'low_latency_dispatch'} returned (it carries the "
                f"routing of cute_ep's kernels), got {type(handle).__name__}"
            )
        return handle

    def _check_device(self, **tensors: Any) -> None:
        for name, t in tensors.items():
            if t is not None and t.device != self.device:
                raise ValueError(f"{name} must be on {self.device} (this Buffer's backend: {self.backend}), "
                                 f"got {t.device}")

    def _check_num_experts(self, num_experts: Any) -> None:
        if not isinstance(num_experts, numbers.Integral) or num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(
                f"num_experts must be a positive multiple of {self.group_size} ranks, got {num_experts}"
            )


def _gloo_workers(group: Any) -> int:
    """The worker threads of the group's gloo backend (torch's default: 2)."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return 2


def _is_gloo(group: Any) -> bool:
    try:
        return isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
    except (AttributeError, RuntimeError, ValueError):
        return False


class _LastStep:
    """Kept in a gloo worker's thread-local storage by ``drain_gloo``: the Python thread state that torch
    (pybind11's gil_scoped_acquire) made there to free a tensor is cleared as the last Python step of that
    (the GIL is let go of after it, not taken again), and with it this object, which then calls ``done``."""

    __slots__ = ("done",)

    def __init__(self, done: Callable[[], Any]) -> None:
        self.done = done

    def __del__(self) -> None:
        self.done()


_ROUND_WAIT_S = 60.0
"""The longest ``drain_gloo`` waits for one round's tensors (microseconds, normally)."""
_LEAVE_WAIT_S = 5.0
"""The longest it waits for a worker to leave Python after freeing the probe (a torch that kept the
worker's Python thread state would never say so)."""


def _drain_round(group: Any, world: int, flag: int, here: int,
                 local: threading.local) -> tuple[int | None, bool]:
    """All-gather ``flag`` from a tensor that only the collective holds; wait until it is freed (in a gloo
    worker: until that worker has left Python) and the collective holds none of the outputs. Returns (the
    worker thread that freed it, or None where this thread did; whether any rank's flag is set)."""
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    unheld = [sys.getrefcount(f) for f in flags]
    probe = torch.tensor([flag], dtype=torch.int32)
    freed: list[int] = []
    left = threading.Event()
    deadline = time.monotonic() + _ROUND_WAIT_S

    def on_free(_: Any) -> None:  # runs in the thread that frees the probe
        freed.append(threading.get_native_id())
        local.last_step = _LastStep(left.set)

    ref = weakref.ref(probe, on_free)
    dist.all_gather(flags, probe, group=group, async_op=True)
    del probe
    while (ref() is not None or not freed) and time.monotonic() < deadline:  # a worker takes the GIL
        time.sleep(1e-4)
    if not freed:
        raise RuntimeError(f"cute_ep.deep_ep: a gloo all_gather did not end within {_ROUND_WAIT_S:.0f} s "
                           f"(is a peer gone?)")
    worker = freed[0] if freed[0] != here else None
    if worker is not None:
        left.wait(_LEAVE_WAIT_S)
    # While the collective holds a tensor, torch holds its Python object too, and lets go of that under the
    # GIL in the worker: the flags' Python reference counts say when that is done.
    while [sys.getrefcount(f) for f in flags] != unheld and time.monotonic() < deadline:
        time.sleep(1e-4)
    return worker, any(int(f) for f in flags)


def drain_gloo(group: Any, timeout_s: float = 10.0) -> None:
    """Collective: return once each of the group's gloo worker threads is done with every collective made
    on it before this call, Python included (a no-op on other groups).

    A gloo worker lets go of a collective's tensors a moment after the caller's wait returned; for a tensor
    that Python made (``all_gather_object`` makes several), torch does that under the GIL (while C++ holds
    such a tensor it holds its Python object too), and a worker that takes the GIL after the interpreter
    began to exit is ended by CPython, which aborts the process ("terminate called without an active
    exception"). A group the program keeps lives into that exit. So each round here all-gathers a
    "not yet" flag from a tensor that only the collective holds: the worker that frees it names itself
    (a weak reference's callback) and, leaving Python, says so (``_LastStep``). A worker runs its
    collectives one at a time, so once every worker has freed one of these, none holds an earlier one.
    The ranks stop in the same round: the first in which no rank's flag is set (each rank clears its flag
    once it has seen all its workers, or after ``timeout_s``); every round waits for its own tensors.
    """
    if group is None or not dist.is_initialized() or not _is_gloo(group):
        return
    workers, world = _gloo_workers(group), dist.get_world_size(group)
    here, local, seen = threading.get_native_id(), threading.local(), set()
    deadline = time.monotonic() + timeout_s
    more = True
    while more:
        flag = int(len(seen) < workers and time.monotonic() < deadline)
        worker, more = _drain_round(group, world, flag, here, local)
        if worker is not None:
            seen.add(worker)
