"""Signals between ranks, bounded waits, the fault record and the grid's arrival counter.

Why these exist:
- ``wait_signal_ge``: NVSHMEM's ``signal_wait`` waits forever, so one rank that skips a call would hang
  every other rank with no error; this wait gives up after the buffer's timeout and the fault is recorded.
- ``record_fault`` / ``fault_free``: the first timeout wins and every kernel of the buffer stops moving
  data until the host has read the record and raised.
- ``last_cta_arrives``: the last CTA of a grid announces the whole grid's work (one arrival counter per slot);
  ``cta_arrives_last``: the whole CTA's side of it (its sends completed and fenced, the answer shared).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import nvshmem.core as _nvshmem_core
import nvshmem.core.device.cute as nvshmem_cute
from cutlass import Int32, Int64

from cute_ep.kernels.buffers import FAULT_COUNT, FAULT_EPOCH, FAULT_OP, FAULT_PEER
from cute_ep.kernels.config import ALGO_PUT_WARP
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
    arrived, _ = wait_signal_value(addr, target, timeout_ns)
    return arrived


@cute.jit
def wait_signal_value(addr: Int64, target: Int64, timeout_ns: Int64):
    """``wait_signal_ge`` that also returns the value it saw: (1, value) when the signal arrived, (0, the
    last value read) when ``timeout_ns`` passed first. Why: a caller that needs the value (a count sent
    with its signal) would otherwise wait one more load latency to read it again."""
    state = Int32(0)  # 0: waiting, 1: arrived, 2: timed out
    seen = Int64(0)
    start = global_timer_ns()
    while state == Int32(0):
        seen = ld_acquire_u64(addr)
        if seen >= target:
            state = Int32(1)
        else:
            if global_timer_ns() - start > timeout_ns:
                state = Int32(2)
    arrived = Int32(0)
    if state == Int32(1):
        arrived = Int32(1)
    return arrived, seen


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
    if signal != 0:
        signal_peers(p, row, value)
    wait_peers(p, row, value, op, epoch)


@cute.jit
def wait_peers(p, row: Int32, value: Int64, op: Int32, epoch: Int64):
    """The wait of ``signal_and_wait_peers`` alone (a CTA that raises nothing): this CTA's first R threads
    wait until ``signals[row, q] >= value`` for every peer q (bounded; a peer that never arrives recorded
    as (op, q, epoch)), then a CTA barrier. Every thread of the CTA must call it."""
    tid, _, _ = cute.arch.thread_idx()
    if fault_free(p.fault):
        if tid < p.world_size:
            if wait_signal_ge(element_addr(p.signals, (row, tid)), value, Int64(p.timeout_ms) * 1000000) == 0:
                record_fault(p.fault, op, tid, epoch)
    cute.arch.sync_threads()


@cute.jit
def every_rank_at(p, row: Int32, value: Int64) -> Int32:
    """One thread, one look (no wait): 1 if ``signals[row, q] >= value`` for every rank q, else 0."""
    at = Int32(1)
    for q in range(p.world_size):
        if ld_acquire_u64(element_addr(p.signals, (row, q))) < value:
            at = Int32(0)
    return at


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
def last_cta_arrives(done: cute.Tensor, slot: Int32, system: cutlass.Constexpr = True) -> Int32:
    """Called by one thread per CTA after the CTA's work: 1 in the last CTA of the grid to arrive (the
    counter ``done[slot]`` is then reset for the next launch), else 0.

    The fence first makes this CTA's writes visible before its arrival is counted, so the last CTA may
    announce everyone's work: to the whole system (peers, the host), or with ``system`` False to this
    GPU only, where the last CTA only records what this GPU's CTAs saw (an epoch read after the launch
    ends, faults recorded here): a system fence in every CTA's thread 0 at the end of a kernel held 4-9%
    of the low-latency kernels' warp samples (Nsight Compute, 128 tokens, one H200)."""
    NCTA, _, _ = cute.arch.grid_dim()
    if cutlass.const_expr(system):
        fence_sys()
    else:
        cute.arch.fence_acq_rel_gpu()
    last = Int32(0)
    if cute.arch.atomic_add(done.iterator + slot, Int32(1)) == NCTA - 1:
        done[slot] = Int32(0)
        last = Int32(1)
    return last


@cute.jit
def stored_to(p, d: Int32) -> Int32:
    """1 where this rank's sends reach rank ``d`` as stores through its peer pointer (ranks of this node;
    with ALGO_PUT_WARP only this rank itself), 0 where NVSHMEM puts carry them."""
    store = Int32(0)
    if d // p.local_world_size == p.rank // p.local_world_size:
        store = Int32(1)
        if p.algo == ALGO_PUT_WARP:
            if d != p.rank:
                store = Int32(0)
    return store


@cute.jit
def sends_may_put(p) -> Int32:
    """1 where some rank's sends go by NVSHMEM puts (``stored_to`` 0 for it): peers on other nodes, or
    ALGO_PUT_WARP."""
    may = Int32(0)
    if p.local_world_size < p.world_size:
        may = Int32(1)
    if p.algo == ALGO_PUT_WARP:
        may = Int32(1)
    return may


@cute.jit
def cta_arrives_last(p, slot: Int32, flag: cute.Tensor, tid: Int32) -> Int32:
    """Called by every thread of a CTA once its part of the CTA's sends is issued: counts the CTA's
    arrival in ``p.done[slot]`` (``last_cta_arrives``) after the CTA's sends are complete and fenced.
    Returns in every thread 1 in the last CTA of the grid to arrive, else 0; ``flag`` is one shared-memory
    Int32 that carries the answer to the CTA's threads.

    Why one fence for the CTA: a store through a peer pointer is ordered before thread 0's fence by the CTA
    barrier (a fence is cumulative), so only sends through NVSHMEM puts (``sends_may_put``) need each
    thread's own ``quiet``. A quiet and a fence in every thread held about a tenth of the low-latency
    kernels' warp samples (Nsight Compute, 128 tokens, one H200)."""
    if sends_may_put(p) != 0:
        nvshmem_cute.quiet()  # this thread's puts complete
    cute.arch.sync_threads()
    if tid == 0:
        flag[0] = last_cta_arrives(p.done, slot)
    cute.arch.sync_threads()
    return flag[0]
