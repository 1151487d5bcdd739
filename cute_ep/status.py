"""What a call reports: the exceptions every backend raises, and the GPU buffer's status block.

The status block is every value the host reads after a kernel call (the ``STATUS`` buffers of
``kernels.buffers.BUFFERS``: epochs, fault record, num_recv, drop counts) in one int32 tensor, so that one
device-to-host copy (one sync) reads them all; a synced dispatch reads the copy its layout kernel writes
into pinned host memory instead, once the count is known (the status mirror: no copy, no sync). Importing this
module imports no GPU library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cute_ep.kernels.buffers import (
    FAULT_COUNT,
    FAULT_EPOCH,
    FAULT_OP,
    FAULT_PEER,
    INPUT_FAULT_FIRST,
    INPUT_FAULT_RANKS,
    status_layout,
)
from cute_ep.kernels.config import OPS, EpConfig

__all__ = ["CapacityExceeded", "KernelDidNotRun", "PeerTimeout", "StatusBlock", "capacity_error"]


class KernelDidNotRun(RuntimeError):
    """A launch returned without its kernel running (its epoch did not advance)."""


class PeerTimeout(RuntimeError):
    """A kernel waited longer than ``cfg.timeout_s`` for a peer's signal.

    op: "layout" | "dispatch" | "combine"; peer: the rank that never signalled; call: the call's number
    (epoch) of that operation. The buffer moves no more data afterwards: close it and build a new one.
    """

    def __init__(self, message: str, *, op: str, peer: int, call: int) -> None:
        super().__init__(message)
        self.op = op
        self.peer = peer
        self.call = call


class CapacityExceeded(RuntimeError):
    """Rows were dropped because experts received more than ``cfg.expert_capacity`` (capacity_factor).

    dropped: {global expert: rows dropped} since the last check; total: their sum; result: the
    ``DispatchResult`` of the call that raised (complete and consistent: combine skips the dropped
    pairs), or None when raised by ``check_capacity`` after ``launch_dispatch``. Every rank raises alike.
    """

    def __init__(self, message: str, *, dropped: dict[int, int], result: Any = None) -> None:
        super().__init__(message)
        self.dropped = dropped
        self.total = sum(dropped.values())
        self.result = result


def capacity_error(cfg: EpConfig, dropped: torch.Tensor, result: Any = None) -> CapacityExceeded | None:
    """The ``CapacityExceeded`` to raise for per-expert drop counts ``dropped`` [E] (None: none dropped).
    One message for every backend."""
    counts = {int(e): int(n) for e, n in enumerate(dropped.tolist()) if n}
    if not counts:
        return None
    el = cfg.experts_per_rank
    shown = ", ".join(f"expert {e} (rank {e // el}): {n}" for e, n in list(counts.items())[:8])
    more = f", and {len(counts) - 8} more experts" if len(counts) > 8 else ""
    return CapacityExceeded(
        f"dispatch dropped {sum(counts.values())} rows beyond expert_capacity={cfg.expert_capacity} "
        f"(capacity_factor={cfg.capacity_factor:g}): {shown}{more}. The dropped (token, k) pairs are left "
        f"out of combine; raise capacity_factor, or build the buffer with on_overflow='drop' to drop rows "
        f"silently (counted by dropped_rows()).",
        dropped=counts, result=result,
    )


class StatusBlock:
    """The STATUS buffers of one GPU buffer in one int32 tensor (see the module docstring).

    ``views[name]`` is the device tensor of each member (epochs [3] int64, fault [FAULT_WORDS] int32,
    num_recv [1] int32, dropped [E] int32); ``read()`` copies the whole block to the host at once.
    """

    def __init__(self, cfg: EpConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        self.where, words = status_layout(cfg)
        self.words = torch.zeros(words, dtype=torch.int32, device=device)
        # The host's copy: pinned, so a read is one asynchronous copy and one stream sync (a fresh
        # pageable tensor per read cost ~30 us on an idle H200).
        self._host = torch.empty(words, dtype=torch.int32, pin_memory=self.words.is_cuda)
        self._host_words = self._host.numpy()
        self.views = {name: self._member(self.words, name) for name in self.where}
        # Decoding goes through numpy: five torch slices and tolist() calls cost ~25 us of host time per
        # read on a 2-core CPU machine, the numpy equivalent ~3 us.
        self._slices = {name: slice(first, first + count) for name, (first, count) in self.where.items()}
        self._copy = _raw_copy(self.words, self._host) if self.words.is_cuda else None
        # The mirror a synced dispatch's layout kernel writes (kernels/layout.py, mirror_status): the block,
        # then the call's sequence number in the last word. Pinned memory is the device's at the same address
        # (unified addressing); ``mirror_ok`` says the driver confirmed that.
        self.mirror = torch.zeros(words + 1, dtype=torch.int32, pin_memory=self.words.is_cuda)
        self._mirror_words = self.mirror.numpy()
        self.mirror_ok = False
        self._seq = 0
        # Live numpy views of the mirror's members, made once: a synced dispatch with nothing to report
        # reads its count through them (``quiet_count``) without decoding the whole block.
        m, at = self._mirror_words, self._slices
        self._at_fault = at["fault"].start + FAULT_COUNT
        self._at_refused = at["input_fault"].start + INPUT_FAULT_RANKS
        self._at_num_recv = at["num_recv"].start
        self._mirror_epochs = m[at["epochs"]].view(np.int64)
        # Only an expert capacity below the worst case drops rows (capacity_factor > 0).
        self._mirror_dropped = m[at["dropped"]] if cfg.capacity_factor > 0 else None
        if self.words.is_cuda:
            from cute_ep.bootstrap.cuda_driver import driver

            lib = driver()
            self._driver = lib
            host = self.mirror.data_ptr()
            self.mirror_ok = lib is not None and lib.device_pointer(host) == host

    def _member(self, words: torch.Tensor, name: str) -> torch.Tensor:
        first, count = self.where[name]
        view = words[first:first + count]
        return view.view(torch.int64) if name == "epochs" else view

    def read(self) -> dict[str, Any]:
        """Epochs, fault record, num_recv and drop counts in one device-to-host copy (one sync): a dict of
        lists and ints, "dropped" a numpy int32 array [E] of its own."""
        if self._copy is not None and not torch.cuda.get_sync_debug_mode():  # torch's detector sees its own
            self._copy()
        elif self.words.is_cuda:
            self._host.copy_(self.words, non_blocking=True)
            torch.cuda.current_stream(self.words.device).synchronize()
        else:
            self._host_words[:] = self.words.numpy()
        return self._decode(self._host_words)

    def next_seq(self) -> int:
        """A sequence number for the next mirrored dispatch (``mirror_seq``: 1 .. 2**31 - 1, never 0)."""
        self._seq = self._seq % (2**31 - 1) + 1
        return self._seq

    def use_mirror(self) -> bool:
        """Whether a synced dispatch reads its status from the mirror: the driver mapped it, torch's sync
        detector is off (with it on, the read goes through torch so that the detector sees it), and the
        stream is not being captured (a captured kernel writes nothing until replayed: the plain read
        then raises torch's capture error, as before)."""
        return (self.mirror_ok and not torch.cuda.get_sync_debug_mode()
                and not torch.cuda.is_current_stream_capturing())

    def mirrored(self) -> dict[str, Any]:
        """``read()``'s dict from the mirror as it is (after ``wait_mirror``)."""
        return self._decode(self._mirror_words[:len(self._host_words)])

    def wait_mirror(self, seq: int, stream: int) -> bool:
        """Wait until the dispatch launched with ``mirror_seq = seq`` on ``stream`` has written the mirror
        (its layout kernel does, once the count is known; its rows may still be moving): the host polls
        the mirror's last word (no copy, no stream sync), and every 256 polls asks the driver whether the
        stream is done. False when it finished without that write (the layout did not run to its end):
        the caller then reads the block itself, which names what happened. A failed launch raises
        ``CudaDriverError``."""
        m, w = self._mirror_words, len(self._host_words)
        polls = 0
        while m[w] != seq:
            polls += 1
            if polls % 256 == 0 and self._driver.finished(stream) and m[w] != seq:
                return False
        return True

    def quiet_count(self, launches: list[int], *ops: int, running: int | None = None) -> int | None:
        """After ``wait_mirror``: the mirrored num_recv when the block has nothing to report (no wait timed
        out, every rank's ids accepted, no row dropped, each operation of ``ops`` at or past its launches
        ``launches[op]``, which are raised to the epochs as ``check_ran`` raises them; ``running``: the
        operation still running when the block was mirrored, one launch behind); else None, and the
        caller decodes the block (``mirrored``) to raise what it says. A handful of word reads where the
        decode and its checks ran after every synced dispatch's kernels (with them, and the handle's views
        made before the launch, 15-19 us more host time per call on an H200 host, 2026-11-30)."""
        m, epochs = self._mirror_words, self._mirror_epochs
        if m[self._at_fault] or m[self._at_refused]:
            return None
        if self._mirror_dropped is not None and self._mirror_dropped.any():
            return None
        for op in ops:
            if epochs[op] + (op == running) < launches[op]:
                return None
        for op in ops:
            launches[op] = int(epochs[op]) + (op == running)
        return int(m[self._at_num_recv])

    def _decode(self, host: np.ndarray) -> dict[str, Any]:
        at = self._slices  # decoded now: the next read overwrites the copy
        return {
            "epochs": host[at["epochs"]].view(np.int64).tolist(),
            "fault": host[at["fault"]].tolist(),
            "num_recv": int(host[at["num_recv"]][0]),
            "dropped": host[at["dropped"]].copy(),
            "input_fault": host[at["input_fault"]].tolist(),
        }

    def check_faults(self, rank: int, status: dict[str, Any] | None = None) -> None:
        """Raise ``PeerTimeout`` if a kernel timed out waiting for a peer (reads the block unless given)."""
        f = (status or self.read())["fault"]
        if f[FAULT_COUNT]:
            op, peer, call = OPS.get(f[FAULT_OP], f"op {f[FAULT_OP]}"), f[FAULT_PEER], f[FAULT_EPOCH]
            raise PeerTimeout(
                f"{op} on rank {rank}: rank {peer} did not signal within {self.cfg.timeout_s:g} s "
                f"({op} call {call}; {f[FAULT_COUNT]} wait(s) timed out). Every rank must make the same "
                f"sequence of dispatch and combine calls. This buffer moves no more data: close it and "
                f"build a new one.",
                op=op, peer=peer, call=call,
            )

    @staticmethod
    def refused_inputs(status: dict[str, Any]) -> str | None:
        """None if the latest layout accepted every rank's topk_idx, else which ranks' it refused."""
        ranks, first = status["input_fault"][INPUT_FAULT_RANKS], status["input_fault"][INPUT_FAULT_FIRST]
        if not ranks:
            return None
        more = f" and {ranks - 1} more rank(s)" if ranks > 1 else ""
        return (f"rank {first}{more} passed invalid topk_idx (ids must be in [-1, num_experts), no expert "
                f"twice in a token); the call moved no data")

    def check_ran(self, rank: int, status: dict[str, Any], launches: list[int], *ops: int,
                  running: int | None = None) -> None:
        """Raise ``PeerTimeout`` for a recorded fault, or ``KernelDidNotRun`` when an operation's epoch lags
        behind its launches counted by the host (``launches[op]``; ``running``: an operation whose latest
        launch was still running when ``status`` was taken, its epoch one behind). An epoch may be ahead:
        replays of a CUDA graph run kernels the host never counts; ``launches`` is then raised to match."""
        self.check_faults(rank, status)
        got = [epoch + (op == running) for op, epoch in enumerate(status["epochs"])]
        for op in ops:
            launches[op] = max(launches[op], got[op])
        for op in ops:
            if got[op] < launches[op]:
                if self.words.is_cuda:
                    torch.cuda.synchronize(self.words.device)  # a sticky CUDA error, if any, raises first
                raise KernelDidNotRun(
                    f"{OPS[op]} kernel did not complete: epoch {got[op]}, expected {launches[op]} launches"
                )


def _raw_copy(words: torch.Tensor, host: torch.Tensor) -> Callable[[], None] | None:
    """A function copying ``words`` (device) into the pinned ``host`` on the current stream and waiting for
    it, through two driver calls (``cute_ep.bootstrap.cuda_driver``): torch's ``copy_`` + ``synchronize``
    cost ~15 us more host time per read on the H200 test host (its dispatch, an event for the pinned block,
    a Stream object). None without the driver library (the torch path then)."""
    from cute_ep.bootstrap.cuda_driver import driver
    from cute_ep.launcher import current_stream_handle

    lib = driver()
    if lib is None:
        return None
    dst, src, nbytes = host.data_ptr(), words.data_ptr(), words.numel() * words.element_size()
    index = words.device.index

    def copy() -> None:
        stream = current_stream_handle(index)
        lib.copy_to_host(dst, src, nbytes, stream)
        lib.synchronize(stream)

    return copy
