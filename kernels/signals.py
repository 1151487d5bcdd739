"""Signals between ranks, bounded waits, the fault record and the grid's arrival counter.

Why these exist:
- ``wait_signal_ge``: NVSHMEM's ``signal_wait`` waits forever, so one rank that skips a call would hang
  every other rank with no error; this wait gives up after the buffer's timeout and the fault is recorded.
- ``record_fault`` / ``fault_free``: the first timeout wins and every kernel of the buffer stops moving
  data until the host has read the record and raised.
- ``last_cta_arrives``: the last CTA of a grid announces the whole grid's work (one arrival counter per slot);
  ``cta_arrives_last``: the whole CTA's side of it (its puts completed and fenced, the answer shared).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import nvshmem.core as _nvshmem_core
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.buffers import FAULT_COUNT, FAULT_EPOCH, FAULT_OP, FAULT_PEER
from cute_ep.kernels.ptx import fence_sys, global_timer_ns, ld_acquire_u64, ld_volatile_i32
from cute_ep.kernels.rows import element, element_addr

# NVSHMEM enum values used on the device (taken from nvshmem4py so they can never drift).
SIGNAL_SET = int(_nvshmem_core.SignalOp.SIGNAL_SET)


@cute.jit
def wait_signal_ge(addr: Int64, target: Int64, timeout_ns: Int64) -> Int32:
    """Spin until the 64-bit signal at ``addr`` (this rank's symmetric memory) is >= ``target``.

    Returns 1 when it arrived, 0 when ``timeout_ns`` passed first. Why not ``nvshmem signal_wait``:
    that waits forever, so one rank that skips a call hangs every other rank with no error.
    """
    state = Int32(0)  # 0: waiting, 1: arrived, 2: timed out
    start = global_timer_ns()
    while state == Int32(0):
        if ld_acquire_u64(addr) >= target:
            state = Int32(1)
        else:
            if global_timer_ns() - start > timeout_ns:
                state = Int32(2)
    result = Int32(0)
    if state == Int32(1):
        result = Int32(1)
    return result


@cute.jit
def fault_free(fault: cute.Tensor) -> cutlass.Boolean:
    """No wait of this buffer has timed out yet (a volatile read: other CTAs and kernels record faults)."""
    return ld_volatile_i32(element_addr(fault, FAULT_COUNT)) == Int32(0)


@cute.jit
def record_fault(fault: cute.Tensor, op: Int32, peer: Int32, epoch: Int64):
    """Record (op, peer, epoch) in ``fault`` (the FAULT_* words) unless an earlier fault is recorded
    (the first one wins).

    Every kernel checks ``fault_free`` when it starts and moves no data once a fault is recorded, so
    after a timeout no kernel of this buffer moves data until the host has read the record and raised."""
    old = cute.arch.atomic_add(fault.iterator + FAULT_COUNT, Int32(1))
    if old == Int32(0):
        fault[FAULT_OP] = op
        fault[FAULT_PEER] = peer
        fault[FAULT_EPOCH] = Int32(epoch)


@cute.jit
def signal_and_wait_peers(p, row: Int32, value: Int64, op: Int32, epoch: Int64, signal: Int32):
    """A barrier across ranks on ``p.signals[row, :]`` (one SIGNAL_* row; symmetric, [rows, R] uint64).

    If ``signal`` != 0, this CTA's first R threads first SET ``signals[row, rank]`` on every peer to
    ``value`` (after a system fence: this rank's earlier writes are visible first). Then this CTA's first
    R threads wait until ``signals[row, q] >= value`` for every peer q, each at most ``p.timeout_ms``; a
    peer that never arrives is recorded in ``p.fault`` as (op, q, epoch). Nothing happens once a fault is
    recorded. Ends with a CTA barrier. Every thread of the CTA must call it.
    """
    tid, _, _ = cute.arch.thread_idx()
    R = p.world_size
    if signal != 0:
        signal_peers(p, row, value)
    if fault_free(p.fault):
        if tid < R:
            if wait_signal_ge(element_addr(p.signals, (row, tid)), value, Int64(p.timeout_ms) * 1000000) == 0:
                record_fault(p.fault, op, tid, epoch)
    cute.arch.sync_threads()


@cute.jit
def signal_peers(p, row: Int32, value: Int64):
    """This CTA's first R threads SET ``signals[row, rank]`` on every peer to ``value``, each after a system
    fence (this rank's earlier writes are visible first); nothing once a fault is recorded."""
    tid, _, _ = cute.arch.thread_idx()
    if fault_free(p.fault):
        if tid < p.world_size:
            fence_sys()
            nvshmem_cute.signal_op(element(p.signals, (row, p.rank)), value, SIGNAL_SET, tid)


@cute.jit
def last_cta_arrives(done: cute.Tensor, slot: Int32) -> Int32:
    """Called by one thread per CTA after the CTA's work: 1 in the last CTA of the grid to arrive (the
    counter ``done[slot]`` is then reset for the next launch), else 0.

    The fence first makes this CTA's writes visible before its arrival is counted, so the last CTA may
    announce everyone's work."""
    NCTA, _, _ = cute.arch.grid_dim()
    fence_sys()
    last = Int32(0)
    if cute.arch.atomic_add(done.iterator + slot, Int32(1)) == NCTA - 1:
        done[slot] = Int32(0)
        last = Int32(1)
    return last


@cute.jit
def cta_arrives_last(done: cute.Tensor, slot: Int32, flag: cute.Tensor, tid: Int32) -> Int32:
    """Called by every thread of a CTA once its part of the CTA's sends is issued: completes this thread's
    puts and fences its stores, then counts the CTA's arrival (``last_cta_arrives``). Returns in every
    thread 1 in the last CTA of the grid to arrive, else 0; ``flag`` is one shared-memory Int32 that carries
    the answer to the CTA's threads."""
    nvshmem_cute.quiet()
    fence_sys()  # this thread's rows, before the CTA's arrival
    cute.arch.sync_threads()
    if tid == 0:
        flag[0] = last_cta_arrives(done, slot)
    cute.arch.sync_threads()
    return flag[0]
