"""Offset-aware SwiGLU over an expert-major receive buffer: forward and backward, live rows only.

After ``dispatch(..., sync=False)`` the receive buffer holds ``cfg.capacity`` rows (the worst case) but
only the first ``offsets[-1]`` are live: ``offsets`` [G] int32 is the inclusive prefix sum of the
per-expert row counts, the ``offs`` a grouped GEMM takes, on the device. A plain SwiGLU over the
whole buffer reads and writes every padding row; these kernels read the live row count from
``offsets`` on the device and walk only the tiles that hold live rows, so a capture in a CUDA graph
stays valid for any routing and padding rows are never read or written.

Forward (``SwiGLUForward``): gate_up [N, 2I] -> out [N, I], out = silu(g) * u with g = gate_up[:, :I],
u = gate_up[:, I:], in fp32, one rounding to the element type (silu(g) = g / (1 + exp(-g))).
Backward (``SwiGLUBackward``): gate_up [N, 2I] and grad_out [N, I] -> grad_gate_up [N, 2I]:
s = 1 / (1 + exp(-g)), d_gate = grad_out * u * s * (1 + g * (1 - s)), d_up = grad_out * silu(g)
(torch's ``silu_backward`` formula), fp32, rounded once.

Shape of the work: a persistent grid of ``ctas`` CTAs of 256 threads walks tiles of TILE_ROWS rows x
(32 lanes x vectors_per_lane x 128 bits) columns in a grid-stride loop over the live tiles only
(``ceil(live / TILE_ROWS) * ceil(I / tile columns)``; live = min(offsets[G - 1], N), so corrupt offsets
never send a CTA past the buffer). Each lane moves whole 128-bit vectors of the gate and up halves
through a tiled copy; a vector's predicate says whether its row is live and its columns inside I (I
must be a multiple of the vector, checked on the host), so the last tile of rows and of columns is
handled without reading or writing outside. The grid is a launch argument: the host picks it from the
SM count (a green context with fewer SMs is served by the same loop).

Nothing here calls NVSHMEM: the kernels are compiled apart from the EP module (kernels/module.py), one
compiled function per (direction, element type), with every size a run-time argument.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

WARP = 32
VECTOR_BITS = 128


class SwiGLUKernel:
    """What both directions share: compile-time element type and tile shape, the tiled copy, the
    gate / up / coordinate views and the live-tile loop bounds. A subclass writes ``__call__`` and its
    ``kernel``.

    dtype: the CuTe element type of the rows (BFloat16, Float16 or Float32).
    vectors_per_lane: 128-bit vectors of each half a lane moves per tile (loads in flight per lane).
    """

    threads = 256
    tile_rows = threads // WARP  # one warp per row of the tile

    def __init__(self, dtype: type[cutlass.Numeric], vectors_per_lane: int = 2) -> None:
        if vectors_per_lane < 1:
            raise ValueError(f"vectors_per_lane must be >= 1, got {vectors_per_lane}")
        self.dtype = dtype
        self.vec = VECTOR_BITS // dtype.width  # elements per 128-bit vector
        self.vectors_per_lane = vectors_per_lane
        self.tile_cols = WARP * self.vec * vectors_per_lane

    def tiled_copy(self) -> cute.TiledCopy:
        """256 threads as (8 rows, 32 lanes), each lane one 128-bit vector per copy: the tile's
        ``vectors_per_lane`` vectors of a row come out as the partition's column mode."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=VECTOR_BITS)
        thr_layout = cute.make_ordered_layout((self.tile_rows, WARP), order=(1, 0))
        val_layout = cute.make_layout((1, self.vec))
        return cute.make_tiled_copy_tv(atom, thr_layout, val_layout)

    @cute.jit
    def halves(self, gate_up: cute.Pointer, rows: Int32, inter: Int32):
        """(gate, up): the two [rows, inter] halves of the [rows, 2 * inter] row-major ``gate_up``."""
        both = cute.make_tensor(gate_up, cute.make_layout((rows, 2, inter), stride=(2 * inter, inter, 1)))
        return both[None, 0, None], both[None, 1, None]

    @cute.jit
    def matrix(self, ptr: cute.Pointer, rows: Int32, cols: Int32):
        """A [rows, cols] row-major view of ``ptr``."""
        return cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(cols, 1)))

    def thread_copy(self) -> tuple[cute.TiledCopy, Any]:
        """The tiled copy and this thread's slice of it."""
        tid, _, _ = cute.arch.thread_idx()
        copier = self.tiled_copy()
        return copier, copier.get_slice(tid)

    def tile_counts(self, live: Int32, inter: Int32) -> tuple[Int32, Int32]:
        """(column tiles, tiles that hold live rows): a CTA walks tiles bid, bid + ctas, ... below the
        second, row-major over the first."""
        col_tiles = (inter + self.tile_cols - 1) // self.tile_cols
        return col_tiles, (live + self.tile_rows - 1) // self.tile_rows * col_tiles

    @cute.jit
    def launch(self, views: tuple, offsets: cute.Pointer, rows: Int32, inter: Int32, groups: Int32,
               ctas: Int32, stream):
        """Launch ``kernel`` on a persistent grid of ``ctas`` CTAs with the [rows, inter] ``views``
        (sources, then destinations) divided into tiles, the coordinates of a tile and the offsets."""
        tiler = (self.tile_rows, self.tile_cols)
        tiled = [cute.zipped_divide(v, tiler) for v in views]
        coords = cute.zipped_divide(cute.make_identity_tensor((rows, inter)), tiler)
        self.kernel(*tiled, coords, cute.make_tensor(offsets, cute.make_layout(groups)), rows, inter,
                    groups).launch(grid=(ctas, 1, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.jit
    def live_tiles(self, offs: cute.Tensor, rows: Int32, inter: Int32, groups: Int32):
        """(live rows, column tiles, live tiles, first tile, tile stride) of this CTA's grid-stride walk."""
        bid, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        live = self.live_rows(offs, groups, rows)
        col_tiles, live_tiles = self.tile_counts(live, inter)
        return live, col_tiles, live_tiles, bid, ctas

    @cute.jit
    def load_tile(self, copier: cute.TiledCopy, thr, srcs: tuple, at, pred: cute.Tensor) -> list:
        """This thread's vectors of tile ``at`` of every source, as fp32 values: every load of the
        tile is issued before any of them is used."""
        frags = []
        for src in srcs:
            part = thr.partition_S(src[at])
            frag = cute.make_fragment_like(part)
            cute.copy(copier, part, frag, pred=pred)
            frags.append(frag)
        return [f.load().to(Float32) for f in frags]

    @cute.jit
    def store_tile(self, copier: cute.TiledCopy, thr, values: tuple, dsts: tuple, at, pred):
        """Store fp32 ``values`` rounded once to the element type into tile ``at`` of ``dsts``."""
        for value, dst in zip(values, dsts, strict=True):
            part = thr.partition_D(dst[at])
            frag = cute.make_fragment_like(part)
            frag.store(value.to(self.dtype))
            cute.copy(copier, frag, part, pred=pred)

    @cute.jit
    def live_rows(self, offsets: cute.Tensor, groups: Int32, rows: Int32) -> Int32:
        """min(offsets[groups - 1], rows): the live rows, never more than the buffer holds."""
        live = offsets[groups - 1]
        if live > rows:
            live = rows
        if live < 0:
            live = Int32(0)
        return live

    @cute.jit
    def predicate(self, coords: cute.Tensor, live: Int32, inter: Int32) -> cute.Tensor:
        """One flag per 128-bit vector of this lane's part of a tile: its row is live and its first
        column is inside ``inter`` (so is its last: inter is a multiple of the vector)."""
        shape = (cute.size(coords, mode=[0, 1]), cute.size(coords, mode=[1]), cute.size(coords, mode=[2]))
        pred = cute.make_rmem_tensor(cute.make_layout(shape), cutlass.Boolean)
        for v in cutlass.range_constexpr(cute.size(coords, mode=[0, 1])):
            for m in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                for n in cutlass.range_constexpr(cute.size(coords, mode=[2])):
                    c = coords[(0, v), m, n]
                    pred[v, m, n] = cute.elem_less(c, (live, inter))
        return pred


class SwiGLUForward(SwiGLUKernel):
    """out[r] = silu(gate[r]) * up[r] for the live rows r < offsets[G - 1] (see the module docstring).

    Arguments of a launch: gate_up [rows, 2 * inter] and out [rows, inter] (element type, 16-byte
    aligned), offsets [groups] int32, the sizes, ``ctas`` (the persistent grid) and the stream."""

    @cute.jit
    def __call__(self, gate_up: cute.Pointer, out: cute.Pointer, offsets: cute.Pointer, rows: Int32,
                 inter: Int32, groups: Int32, ctas: Int32, stream):
        inter = cute.assume(inter, divby=self.vec)  # the host checked it: lets the copies be 128-bit
        gate, up = self.halves(gate_up, rows, inter)
        self.launch((gate, up, self.matrix(out, rows, inter)), offsets, rows, inter, groups, ctas, stream)

    @cute.kernel
    def kernel(self, gate: cute.Tensor, up: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor,
               offs: cute.Tensor, rows: Int32, inter: Int32, groups: Int32):
        copier, thr = self.thread_copy()
        live, col_tiles, live_tiles, first, stride = self.live_tiles(offs, rows, inter, groups)
        for tile in range(first, live_tiles, stride):
            at = ((None, None), (tile // col_tiles, tile % col_tiles))
            pred = self.predicate(thr.partition_S(coords[at]), live, inter)
            g, u = self.load_tile(copier, thr, (gate, up), at, pred)
            silu = g / (1.0 + cute.math.exp(-g))
            self.store_tile(copier, thr, (silu * u,), (dst,), at, pred)


class SwiGLUBackward(SwiGLUKernel):
    """grad_gate_up[r] from gate_up[r] and grad_out[r] for the live rows (see the module docstring).

    Arguments of a launch: gate_up [rows, 2 * inter], grad_out [rows, inter], grad_gate_up
    [rows, 2 * inter] (element type, 16-byte aligned), offsets [groups] int32, the sizes, ``ctas`` and
    the stream."""

    @cute.jit
    def __call__(self, gate_up: cute.Pointer, grad_out: cute.Pointer, grad_gate_up: cute.Pointer,
                 offsets: cute.Pointer, rows: Int32, inter: Int32, groups: Int32, ctas: Int32, stream):
        inter = cute.assume(inter, divby=self.vec)
        gate, up = self.halves(gate_up, rows, inter)
        d_gate, d_up = self.halves(grad_gate_up, rows, inter)
        self.launch((gate, up, self.matrix(grad_out, rows, inter), d_gate, d_up), offsets, rows, inter,
                    groups, ctas, stream)

    @cute.kernel
    def kernel(self, gate: cute.Tensor, up: cute.Tensor, d_out: cute.Tensor, d_gate: cute.Tensor,
               d_up: cute.Tensor, coords: cute.Tensor, offs: cute.Tensor, rows: Int32, inter: Int32,
               groups: Int32):
        copier, thr = self.thread_copy()
        live, col_tiles, live_tiles, first, stride = self.live_tiles(offs, rows, inter, groups)
        for tile in range(first, live_tiles, stride):
            at = ((None, None), (tile // col_tiles, tile % col_tiles))
            pred = self.predicate(thr.partition_S(coords[at]), live, inter)
            g, u, dy = self.load_tile(copier, thr, (gate, up, d_out), at, pred)
            # torch's silu_backward: d silu(g) / dg = s * (1 + g * (1 - s)), s = sigmoid(g).
            e = 1.0 + cute.math.exp(-g)
            s = 1.0 / e
            self.store_tile(copier, thr, ((dy * u) * s * (1.0 + g * (1.0 - s)), dy * (g / e)), (d_gate, d_up),
                            at, pred)


# --------------------------------------------------------------------------------------------------
# host side: what a compile needs (no GPU: the pointers are stand-ins)
# --------------------------------------------------------------------------------------------------

DIRECTIONS = {"forward": SwiGLUForward, "backward": SwiGLUBackward}


def compile_key(direction: str, dtype) -> tuple:
    """The compile-cache key of one kernel: ("swiglu", direction, torch dtype name)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {sorted(DIRECTIONS)}, got {direction!r}")
    return ("swiglu", direction, str(dtype).removeprefix("torch."))


def worst_case_tiles(rows: int, inter: int, dtype) -> int:
    """Tiles of a [rows, inter] output when every row is live (the grid never needs more CTAs)."""
    from cute_ep.kernels.config import cute_dtype

    k = SwiGLUKernel(cute_dtype(dtype))
    return -(-rows // k.tile_rows) * -(-inter // k.tile_cols)


def example_args(direction: str, dtype) -> tuple:
    """Arguments for compiling ``direction`` for torch ``dtype`` without touching memory (no GPU)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    from cute_ep.kernels.config import cute_dtype

    elem = cute_dtype(dtype)
    rows_ptr = lambda: make_ptr(elem, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)  # noqa: E731
    matrices = 2 if direction == "forward" else 3
    offsets = make_ptr(Int32, 1 << 20, cute.AddressSpace.gmem, assumed_align=4)
    sizes = (Int32(64), Int32(256), Int32(4), Int32(8))  # rows, inter, groups, ctas: any values
    return (*(rows_ptr() for _ in range(matrices)), offsets, *sizes, cuda.CUstream(0))


def build(direction: str, dtype):
    """(jit function, example args) of one kernel, for ``ModuleRegistry.get`` under ``compile_key``."""
    from cute_ep.kernels.config import cute_dtype

    compile_key(direction, dtype)  # validates the direction
    return DIRECTIONS[direction](cute_dtype(dtype)), example_args(direction, dtype)
