"""Rows in global memory as CuTe tensors, and the warp's row copy.

Why these exist:
- ``elem_view`` / ``row_view``: NVSHMEM's CuTe FFIs accept a pointer whose alignment is exactly the
  element size, while 128-bit vector copies want a 16-byte aligned view of the same bytes.
- ``gmem_tensor``: a peer's row is reached through an address (its NVSHMEM peer pointer), so a view over a
  raw address is the one place an address becomes a tensor again.
- ``RowSpace``: one buffer holds rows of the element type or packed FP8 rows (another row size, decided
  per call), and the row sum and the lanes' copy take tables of row addresses: rows are addressed here, by
  index, on this rank or on a peer, and nowhere else.
- ``copy_row_to_lanes``: a token's row bound for several destinations is loaded once and stored to all.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from nvshmem.core.device.cute.mem import nvshmem_ptr


class RowSpace(NamedTuple):
    """Rows of ``row_bytes`` bytes laid end to end from ``base``: a buffer of this rank, or a peer's
    through its NVSHMEM peer pointer (``on_peer``)."""

    base: Int64
    row_bytes: Int64

    def row(self, i) -> Int64:
        """The address of row ``i``."""
        return self.base + Int64(i) * self.row_bytes

    def from_byte(self, offset) -> RowSpace:
        """The same rows from byte ``offset`` of each on (a part of every row)."""
        return RowSpace(self.base + Int64(offset), self.row_bytes)

    def on_peer(self, peer) -> RowSpace:
        """The same rows in ``peer``'s copy of this symmetric buffer (a peer on this node)."""
        return RowSpace(nvshmem_ptr(self.base, peer), self.row_bytes)


def row_space(t: cute.Tensor, row_bytes) -> RowSpace:
    """``t``'s memory as rows of ``row_bytes`` bytes."""
    return RowSpace(t.iterator.toint(), Int64(row_bytes))


@cute.jit
def elem_view(t: cute.Tensor) -> cute.Tensor:
    """The same tensor with the pointer alignment set to exactly one element (NVSHMEM FFIs)."""
    width = t.element_type.width // 8
    p = cute.make_ptr(t.element_type, t.iterator.toint(), cute.AddressSpace.gmem, assumed_align=width)
    return cute.make_tensor(p, t.layout)


@cute.jit
def row_view(dtype: cutlass.Constexpr, addr: Int64, num_elems: Int32) -> cute.Tensor:
    """A 1-D global tensor of ``num_elems`` over a raw address, aligned to one element (NVSHMEM FFIs)."""
    p = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=dtype.width // 8)
    return cute.make_tensor(p, cute.make_layout(num_elems))


@cute.jit
def gmem_tensor(dtype: cutlass.Constexpr, addr: Int64, layout: cute.Layout, align: cutlass.Constexpr):
    """A global-memory tensor over a raw address (peer pointers, staging rows)."""
    return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align), layout)


ROW_COPY_UNROLL = 8  # 128-bit pieces per lane in flight while a warp copies a row


@cute.jit
def copy_row_to_lanes(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, dests: Int32,
                      num_pieces: Int32, lane: Int32, unroll: cutlass.Constexpr = ROW_COPY_UNROLL,
                      store_no_l1: cutlass.Constexpr = False):
    """A warp copies ``num_pieces`` 128-bit pieces from ``src_addr`` to the address ``dst_addr`` held by
    each lane whose bit is set in ``dests`` (all 16-byte aligned; a destination may be a peer's memory
    through its NVSHMEM peer pointer). Every lane calls it with the same ``dests``.

    Why one call for every destination: each piece is loaded once and stored to all of them (a token's
    row bound for several slots or ranks is read from memory once, not once per copy).
    Why unrolled: a warp that loads one piece, stores it and moves on has one load in flight and waits
    a full memory latency per 512 bytes; ``unroll`` independent loads per lane before the stores hide it
    (ROW_COPY_UNROLL, or fewer where registers are short: kernels/dispatch_senders.py).
    ``store_no_l1``: the stores do not allocate in L1 (``st.global.L1::no_allocate``), for rows nothing in
    the launch reads again (the low-latency receive into the padded layout). Why: at a world of one on an
    H200 the combine kernel that follows such a dispatch took 19.4 us instead of 20.2 (docs/results.md,
    2026-12-02); loading the rows through the read-only path (``ld.global.nc``) changed nothing.
    Why the last step is predicated rather than a loop of single pieces: a row of 7168 bf16 (896 pieces)
    is 3 full steps and 128 pieces, and that tail piece by piece was 4 more latencies per row.
    """
    V = 16 // (dtype.width // 8)
    U = unroll
    step = U * 32
    layout = cute.make_layout(V)
    piece = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    store = piece
    if cutlass.const_expr(store_no_l1):
        store = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), dtype, num_bits_per_copy=128,
                                    l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE)
    pieces = cute.make_layout((V, num_pieces))  # the row as 128-bit pieces: row[None, v] is piece v
    src = gmem_tensor(dtype, src_addr, pieces, 16)
    for base in range(0, num_pieces, step):
        frags = [cute.make_rmem_tensor(layout, dtype) for _ in range(U)]
        for j in cutlass.range_constexpr(U):
            v = base + j * 32 + lane
            if v < num_pieces:
                cute.copy(piece, src[None, v], frags[j])
        left = dests
        for _ in range(cute.arch.popc(dests)):
            holder = Int32(cute.arch.clz(cute.arch.brev(left)))  # the lowest destination left
            left = left & (left - 1)
            dst = gmem_tensor(dtype, cute.arch.shuffle_sync(dst_addr, holder), pieces, 16)
            for j in cutlass.range_constexpr(U):
                v = base + j * 32 + lane
                if v < num_pieces:
                    cute.copy(store, frags[j], dst[None, v])


@cute.jit
def copy_row_warp(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, num_pieces: Int32, lane: Int32):
    """A warp copies ``num_pieces`` 128-bit pieces from ``src_addr`` to ``dst_addr`` (the same values in
    every lane): ``copy_row_to_lanes`` with one destination."""
    copy_row_to_lanes(dtype, src_addr, dst_addr, Int32(1), num_pieces, lane)


@cute.jit
def copy_bytes_warp(dtype: cutlass.Constexpr, src_addr: Int64, dst_addr: Int64, num_bytes: Int32,
                    lane: Int32):
    """A warp copies ``num_bytes`` (a multiple of 4) from ``src_addr`` to ``dst_addr`` (4-byte aligned; the
    same values in every lane): as 128-bit pieces of ``dtype`` when both addresses and the length are
    multiples of 16, else as 4-byte words (a part of a row whose columns are 4 bytes wide)."""
    wide = Int32(0)
    if num_bytes % 16 == 0:
        if src_addr % 16 == 0:
            if dst_addr % 16 == 0:
                wide = Int32(1)
    if wide != 0:
        copy_row_warp(dtype, src_addr, dst_addr, num_bytes // 16, lane)
    else:
        words = cute.make_layout(num_bytes // 4)
        src = gmem_tensor(Int32, src_addr, words, 4)
        dst = gmem_tensor(Int32, dst_addr, words, 4)
        for i in range(lane, num_bytes // 4, 32):
            dst[i] = src[i]


# Bytes a warp copies per unit of ``copy_rows_warps``: one unrolled round of the row copy (ROW_COPY_UNROLL
# 128-bit pieces a lane), so that the rows' last round does not leave most warps idle (4096 rows are 2.7 a
# warp of 1536).
CHUNK_BYTES = ROW_COPY_UNROLL * 32 * 16


@cute.jit
def copy_rows_warps(dtype: cutlass.Constexpr, src: RowSpace, dst: RowSpace, num_rows: Int32, num_bytes: Int32,
                    warp: Int32, num_warps: Int32, lane: Int32):
    """Warp ``warp`` of ``num_warps`` (grid-stride) copies its share of bytes [0, ``num_bytes``) (a
    multiple of 4) of rows [0, ``num_rows``) from ``src`` to ``dst`` (each with its own row stride), a warp
    per ``CHUNK_BYTES`` of a row (``copy_bytes_warp``)."""
    chunks = (num_bytes + CHUNK_BYTES - 1) // CHUNK_BYTES
    for u in range(warp, num_rows * chunks, num_warps):
        r = u // chunks
        at = (u - r * chunks) * CHUNK_BYTES
        size = num_bytes - at
        if size > CHUNK_BYTES:
            size = CHUNK_BYTES
        copy_bytes_warp(dtype, src.row(r) + at, dst.row(r) + at, size, lane)


@cute.jit
def gather_words_warp(src: cute.Tensor, dst_addr: Int64, num_words: Int32, pad_words: Int32, lane: Int32):
    """A warp copies the ``num_words`` 4-byte elements of ``src`` (one row of a tensor, any stride) to
    consecutive words from ``dst_addr``, then zeroes ``pad_words`` words after them."""
    dst = gmem_tensor(Int32, dst_addr, cute.make_layout(num_words + pad_words), 4)
    for j in range(lane, num_words + pad_words, 32):
        word = Int32(0)
        if j < num_words:
            word = src[j]
        dst[j] = word


@cute.jit
def element(t: cute.Tensor, coord) -> cute.Tensor:
    """A one-element view of ``t`` at ``coord`` (NVSHMEM's single-value FFIs take a tensor)."""
    return cute.make_tensor(t.iterator + cute.crd2idx(coord, t.layout), cute.make_layout(1))


@cute.jit
def element_addr(t: cute.Tensor, coord) -> Int64:
    """The address of ``t``'s element at ``coord`` (for the raw loads of kernels.ptx)."""
    return (t.iterator + cute.crd2idx(coord, t.layout)).toint()
