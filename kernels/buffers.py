"""The one table of buffers: every tensor the kernels read or write, declared once.

Each ``Buffer`` names a tensor, its shape as a function of the sizes, its element type, where it lives
and which operations use it. Everything else is derived from ``BUFFERS``:

- the host allocations (``cute_ep.buffer.EpBuffer``) and ``EpConfig.symmetric_bytes``;
- the status block the host reads after a call in one copy (``STATUS`` buffers, ``status_layout``);
- the compiled module's arguments: one ``Pointers`` named tuple in table order (``kernels/module.py``)
  and their CuTe element types and alignments (``kernels/host.py``);
- the device-side tensors: every kernel receives one ``EpParams`` bundle (run-time sizes + one pointer
  per buffer) instead of a list of arguments, and ``p.<name>`` is that buffer as a CuTe tensor with
  the row-major layout of its shape.

A shape function receives an object with the size attributes below: an ``EpConfig`` on the host (sizes
are ints) or ``EpParams`` on the device (sizes are run-time Int32 values), so one formula serves both.
Per-call tensors (``CALL``) are the caller's and their shapes use ``num_tokens`` (device only).

Protocol slots have names: rows of ``signals``, words of ``fault``, counters of ``done``; ``epochs``
is indexed by the operation (``OP_LAYOUT`` / ``OP_DISPATCH`` / ``OP_COMBINE``, kernels/config.py).

Importing this module imports neither CuTe DSL nor NVSHMEM (the CPU backends size things with it), nor
kernels/config.py: ``EpConfig`` takes its symmetric bytes and status words from this table.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cute_ep.kernels.variants import runs

# Where a buffer lives.
CALL = "call"  # the caller's tensor, passed per call
SYMMETRIC = "symmetric"  # NVSHMEM symmetric heap: same shape on every rank, peers read / write it
LOCAL = "local"  # this rank's device memory
STATUS = "status"  # local, inside the status block the host reads in one copy after a call
HOST = "host"  # pinned host memory the kernels write through its unified address (the host polls it)

# Rows of ``signals`` [SIGNAL_ROWS, R] uint64: row[p] is raised by peer p (epochs only grow: no resets).
SIGNAL_COUNT = 0  # the layout's count row from p has arrived (value: layout epoch)
SIGNAL_DISPATCH = 1  # every row p dispatched to this rank has arrived (value: dispatch epoch)
# combine call e: 2e - 1 when p's expert outputs are in place, 2e when p's partial rows are out
SIGNAL_COMBINE = 2
SIGNAL_ROWS = 3

# Words of ``fault`` [FAULT_WORDS] int32 on each rank: the first timed-out wait
# (kernels.signals.record_fault).
FAULT_COUNT = 0  # waits that timed out (0: none; every kernel moves no data once it is set)
FAULT_OP = 1  # operation of the first one (OP_LAYOUT / OP_DISPATCH / OP_COMBINE)
FAULT_PEER = 2  # the peer that never signalled
FAULT_EPOCH = 3  # the call (epoch, low 32 bits)
FAULT_WORDS = 4

# Words of ``input_fault`` [INPUT_FAULT_WORDS] int32, rewritten by every layout: a dispatch whose inputs are
# invalid on any rank moves no data on every rank (its epochs still advance), and the host raises.
INPUT_FAULT_RANKS = 0  # ranks whose topk_idx was invalid (0: the call is valid)
INPUT_FAULT_FIRST = 1  # the lowest of them (-1: none)
INPUT_FAULT_WORDS = 2

# Self-resetting arrival counters of ``done`` [DONE_SLOTS] int32: the last CTA to arrive finishes the op.
DONE_DISPATCH = 0
DONE_COMBINE = 1  # the pull combine, and phase 2 of the reduced combine
DONE_PUSH = 2  # phase 1 of the reduced combine
DONE_LAYOUT = 3  # the layout's CTAs (the last one to arrive exchanges the counts)
DONE_SLOTS = 4

# Element types: torch dtype name, CuTe type name, bytes per element. "row" is the buffer's dtype.
ROW = "row"
ELEMENT_TYPES = {
    "int32": ("int32", "Int32", 4),
    "int64": ("int64", "Int64", 8),
    "uint64": ("int64", "Uint64", 8),  # torch has no uint64 arithmetic: allocated as int64
    "float32": ("float32", "Float32", 4),
    "uint8": ("uint8", "Uint8", 1),
}
VECTOR_ALIGN = 16  # rows and packed FP8 rows are moved with 128-bit accesses

# The packed FP8 row (an FP8 dispatch's rows, per-call option): e4m3 values with one fp32 scale per
# FP8_BLOCK columns, [H bytes of e4m3 | H / FP8_BLOCK fp32 scales | zero padding to a multiple of 16 bytes].
FP8_BLOCK = 128


def packed_fp8_row_bytes(hidden):
    """Bytes of one packed FP8 row of ``hidden`` columns: e4m3 values, fp32 scales, zeros to 16 bytes.

    Plain integer arithmetic, so the kernels evaluate the same formula on a run-time Int32."""
    raw = hidden + 4 * (hidden // FP8_BLOCK)
    return (raw + VECTOR_ALIGN - 1) // VECTOR_ALIGN * VECTOR_ALIGN


def _fp8_capable(c: Any) -> bool:
    return c.hidden % FP8_BLOCK == 0


def _not_low_latency(c: Any) -> bool:
    return not c.low_latency


def _partial_rows(c: Any) -> bool:
    """Where a reduced combine runs: the expert layout's partial sums, or the rank layout's pushed rows."""
    return runs("expert+reduced")(c) or runs("rank+reduced")(c)


@dataclass(frozen=True)
class Buffer:
    """One tensor of the protocol (see the module docstring).

    name:   attribute name on ``EpBuffer`` and field of ``Pointers`` / ``EpParams``.
    shape:  sizes -> shape (row-major); the device view, and the allocation when ``needed``.
    dtype:  ``ROW`` or a key of ``ELEMENT_TYPES``.
    place:  CALL, SYMMETRIC, LOCAL or STATUS.
    ops:    the operations that read or write it ("layout", "dispatch", "combine").
    doc:    what it holds.
    needed: config -> whether it is allocated at full shape; otherwise a placeholder of one 16-byte
            piece is (the kernels read it only on paths that configuration never takes).
    fill:   initial value of a LOCAL buffer.
    """

    name: str
    shape: Callable[[Any], tuple]
    dtype: str
    place: str
    ops: tuple[str, ...]
    doc: str
    needed: Callable[[Any], bool] | None = None
    fill: int = 0

    def is_needed(self, cfg: Any) -> bool:
        return self.needed is None or bool(self.needed(cfg))

    def item_bytes(self, cfg: Any) -> int:
        return cfg.element_size if self.dtype == ROW else ELEMENT_TYPES[self.dtype][2]

    def align(self, cfg: Any) -> int:
        """Assumed alignment of the device pointer (bytes)."""
        return VECTOR_ALIGN if self.dtype in (ROW, "uint8") else self.item_bytes(cfg)

    def torch_dtype(self, cfg: Any):
        import torch

        return cfg.dtype if self.dtype == ROW else getattr(torch, ELEMENT_TYPES[self.dtype][0])

    def alloc_shape(self, cfg: Any) -> tuple[int, ...]:
        """Shape allocated for ``cfg``: the full shape, or one 16-byte placeholder when not needed."""
        if self.is_needed(cfg):
            return tuple(int(n) for n in self.shape(cfg))
        return (max(1, VECTOR_ALIGN // self.item_bytes(cfg)),)

    def nbytes(self, cfg: Any) -> int:
        return math.prod(self.alloc_shape(cfg)) * self.item_bytes(cfg)


BUFFERS: tuple[Buffer, ...] = (
    # -- the caller's tensors, per call -----------------------------------------------------------
    Buffer("x", lambda s: (s.num_tokens, s.hidden), ROW, CALL, ("dispatch",), "tokens to dispatch"),
    Buffer("topk_idx", lambda s: (s.num_tokens, s.topk), "int32", CALL, ("layout", "dispatch", "combine"),
           "expert of each (token, k); -1: none"),
    Buffer("topk_w", lambda s: (s.num_tokens, s.topk), "float32", CALL, ("dispatch", "combine"),
           "weight of each (token, k)"),
    Buffer("out", lambda s: (s.num_tokens, s.hidden), ROW, CALL, ("combine",), "combine output"),
    Buffer("own_idx", lambda s: (s.num_tokens, s.topk), "int32", CALL, ("layout",),
           "the dispatch handle's copy of topk_idx (written when own_routing is 1)"),
    Buffer("own_w", lambda s: (s.num_tokens, s.topk), "float32", CALL, ("layout",),
           "the dispatch handle's copy of topk_w (written when own_routing is 1)"),
    Buffer("y", lambda s: (s.capacity, s.hidden), ROW, CALL, ("combine",),
           "the caller's expert outputs, in recv_x's row order: combine's staging kernel copies their "
           "first rows into recv_y (y_rows says how many; the rank layout's push reads them here); with "
           "y_gather, any rows y_slot names"),
    Buffer("y_slot", lambda s: (s.capacity,), "int64", CALL, ("dispatch", "combine"),
           "with y_gather: the row of y that row r of recv_y is staged from (a gather); low-latency layout: "
           "at each filled padded slot the pair it holds, (source rank * M + token) * K + k"),
    Buffer("ll_x", lambda s: (s.experts_per_rank * s.rank_capacity, s.hidden), ROW, CALL, ("dispatch",),
           "low-latency dispatch: the padded layout's rows, expert l's from row l * R * M (after an FP8 "
           "dispatch: packed FP8 rows, fp8_row_bytes apart)"),
    Buffer("ll_src_info", lambda s: (s.experts_per_rank * s.rank_capacity,), "int32", CALL, ("dispatch",),
           "low-latency dispatch: each filled padded slot's token index on its source rank"),
    Buffer("ll_count", lambda s: (s.experts_per_rank,), "int32", CALL, ("dispatch", "combine"),
           "low-latency dispatch: rows each local expert received (its combine: the rows it pushes back)"),
    Buffer("ll_range", lambda s: (s.experts_per_rank, s.world_size), "int64", CALL, ("dispatch",),
           "low-latency dispatch: (begin << 32) | rows of each source rank's block of each local expert"),
    Buffer("ll_scales", lambda s: (s.experts_per_rank, s.fp8_scales, s.rank_capacity), "float32", CALL,
           ("dispatch",), "low-latency FP8 dispatch: each filled padded slot's scales, DeepEP's column-major "
           "layout (ll_count itself: none)"),
    Buffer("ll_stats", lambda s: (s.experts_per_rank,), "int32", CALL, ("dispatch",),
           "low-latency dispatch: statistics the counts are added to (ll_count itself: none)"),
    Buffer("assemble0", lambda s: (s.num_tokens,), "int32", CALL, ("dispatch",),
           "with assemble_rows: the caller's values, bytes [0, assemble_end0) of each row of x, put together "
           "there before the dispatch reads x (rows assemble_end0 bytes apart)"),
    Buffer("assemble1", lambda s: (s.num_tokens,), "int32", CALL, ("dispatch",),
           "with assemble_rows: the words after them, (assemble_end1 - assemble_end0) / 4 a row, token t's "
           "word j at t * assemble_stride_t + j * assemble_stride_j; zeros to the row's end"),
    Buffer("deliver0", lambda s: (s.capacity,), "int32", CALL, ("dispatch",),
           "with deliver_rows: the caller's tensor that bytes [0, deliver_end0) of each received row are "
           "copied into (its rows deliver_end0 bytes apart)"),
    Buffer("deliver1", lambda s: (s.capacity,), "int32", CALL, ("dispatch",),
           "with deliver_rows: the caller's tensor for bytes [deliver_end0, deliver_end1) of each row"),
    Buffer("deliver2", lambda s: (s.capacity,), "int32", CALL, ("dispatch",),
           "with deliver_rows: the caller's tensor for bytes [deliver_end1, deliver_end2) of each row"),
    # -- symmetric: peers read or write them ------------------------------------------------------
    Buffer("recv_x", lambda s: (s.capacity, s.hidden), ROW, SYMMETRIC, ("dispatch",),
           "received rows, expert-major (after an FP8 dispatch: packed FP8 rows, fp8_row_bytes apart)",
           needed=_not_low_latency),
    Buffer("recv_y", lambda s: (s.capacity, s.hidden), ROW, SYMMETRIC, ("combine",),
           "the experts' outputs, in recv_x's row order; combine reads them", needed=_not_low_latency),
    Buffer("recv_w", lambda s: (s.capacity,), "float32", SYMMETRIC, ("dispatch", "combine"),
           "weight of each received row"),
    Buffer("recv_src", lambda s: (s.capacity,), "int32", SYMMETRIC, ("dispatch", "combine"),
           "source tag of each received row: (source rank * max_tokens + token) * topk + k"),
    Buffer("recv_from", lambda s: (s.capacity,), "int32", SYMMETRIC, ("dispatch", "combine"),
           "slot whose row this slot copies (fan-out), -1: the row itself arrived, <= -2: a group primary"),
    Buffer("recv_topk_idx", lambda s: (s.rank_capacity, s.topk), "int32", SYMMETRIC, ("dispatch",),
           "rank layout: each received token's local expert ids (-1: an expert on another rank)",
           needed=runs("rank")),
    Buffer("recv_topk_w", lambda s: (s.rank_capacity, s.topk), "float32", SYMMETRIC, ("dispatch",),
           "rank layout: each received token's weights (0 where recv_topk_idx is -1)",
           needed=runs("rank")),
    Buffer("recv_group", lambda s: (s.capacity, s.topk), "int32", SYMMETRIC, ("dispatch", "combine"),
           "each primary slot's later group members (the fan-out under dedup, the reduced combine; -1: "
           "dropped)", needed=_not_low_latency),
    Buffer("counts", lambda s: (s.world_size, s.num_experts + 1 + s.world_size), "int32", SYMMETRIC,
           ("layout", "combine"), "counts[s, e]: pairs source rank s routes to expert e; counts[s, E]: its "
           "pairs with invalid ids (out of [-1, E), or an expert named twice); counts[s, E + 1 + d]: its "
           "tokens bound for rank d (rank layout; its push combine finds a rank's own rows by them)"),
    Buffer("layout_words", lambda s: (2, s.world_size, s.layout_ctas, s.world_size + 1), "uint64",
           SYMMETRIC, ("layout", "dispatch"), "rank layout: [epoch % 2, s, c, d] = (epoch << 32) | the "
           "tokens CTA c of source rank s sends to rank d (d = R: its invalid pairs), written by that CTA on "
           "every rank",
           needed=runs("rank")),
    Buffer("signals", lambda s: (SIGNAL_ROWS, s.world_size), "uint64", SYMMETRIC,
           ("layout", "dispatch", "combine"), "signals[row, p]: what peer p announced (SIGNAL_* rows)"),
    Buffer("stage", lambda s: (s.stage_rows, s.hidden), ROW, SYMMETRIC, ("combine",),
           "staging rows for rows that cross nodes in combine (get_warp / put_warp)"),
    Buffer("partials", lambda s: (s.max_tokens * s.world_size, s.hidden), ROW, SYMMETRIC, ("combine",),
           "reduced combine: row t * R + r is rank r's partial sum of token t (rank layout: rank r's row of "
           "token t, pushed as it is)", needed=_partial_rows),
    Buffer("packed", lambda s: (s.max_tokens, s.fp8_row_bytes), "uint8", SYMMETRIC, ("dispatch",),
           "this rank's tokens as packed FP8 rows (the source of an FP8 dispatch's puts)",
           needed=_fp8_capable),
    Buffer("ll_rows", lambda s: (2 * s.rank_capacity, s.hidden), ROW, SYMMETRIC, ("dispatch",),
           "low-latency dispatch, two sets (call parity): row q * R * M + s * M + t is source s's token t "
           "(FP8: packed rows, fp8_row_bytes apart)", needed=runs("low-latency")),
    Buffer("ll_index", lambda s: (2, s.experts_per_rank, s.world_size, s.max_tokens), "int32", SYMMETRIC,
           ("dispatch",), "low-latency dispatch: [q, l, s, j] = t * K + k of source s's j-th pair (t, k) for "
           "local expert l", needed=runs("low-latency")),
    Buffer("ll_signals", lambda s: (2, s.experts_per_rank, s.world_size), "uint64", SYMMETRIC, ("dispatch",),
           "low-latency dispatch: [q, l, s] = (epoch << 32) | pairs source s sent to local expert l",
           needed=runs("low-latency")),
    Buffer("ll_comb", lambda s: (s.max_tokens * s.topk, s.hidden), ROW, SYMMETRIC, ("combine",),
           "low-latency combine: row t * K + k is the expert output of this rank's pair (t, k), pushed by "
           "the expert's rank", needed=runs("low-latency")),
    # -- this rank's own --------------------------------------------------------------------------
    Buffer("scatter", lambda s: (s.max_tokens, s.topk), "int32", LOCAL, ("layout", "dispatch", "combine"),
           "slot of each (token, k) in its expert's rank's receive buffer; -1: none or dropped", fill=-1),
    Buffer("send_offsets", lambda s: (s.num_experts,), "int32", LOCAL, ("layout",),
           "first slot of this rank's rows for each expert"),
    Buffer("cursor", lambda s: (s.num_experts,), "int32", LOCAL, ("layout", "dispatch"),
           "atomic-mode slot allocator per expert"),
    Buffer("send_limit", lambda s: (s.num_experts,), "int32", LOCAL, ("layout", "dispatch"),
           "end of each expert's kept slots (capacity)"),
    Buffer("tokens_per_expert", lambda s: (s.experts_per_rank,), "int32", LOCAL, ("layout",),
           "rows each local expert receives"),
    Buffer("done", lambda s: (DONE_SLOTS,), "int32", LOCAL, ("dispatch", "combine"),
           "arrival counters (DONE_* slots)"),
    Buffer("layout_parts", lambda s: (s.num_sms + 2, s.num_experts + 1 + s.world_size), "int32", LOCAL,
           ("layout", "dispatch"), "the layout's count row of each CTA (rows 0 .. num_sms - 1, columns as in "
           "counts; the expert layout only), their sum (row num_sms, zero between calls) and this "
           "rank's first slot / row per column (row num_sms + 1)"),
    Buffer("layout_done", lambda s: (1,), "int64", LOCAL, ("layout", "dispatch"),
           "the expert layout's leader: 2 * epoch - 1 once every CTA's counts are in, 2 * epoch once the "
           "offsets are published (layout epoch; the rank layout does not use it)"),
    # -- the status block: read by the host in one copy after a call ------------------------------
    Buffer("epochs", lambda s: (3,), "int64", STATUS, ("layout", "dispatch", "combine"),
           "completed calls per operation (indexed by OP_*)"),
    Buffer("fault", lambda s: (FAULT_WORDS,), "int32", STATUS, ("layout", "dispatch", "combine"),
           "first timed-out wait (FAULT_* words)"),
    Buffer("num_recv", lambda s: (1,), "int32", STATUS, ("layout", "dispatch", "combine"),
           "rows this rank receives"),
    Buffer("dropped", lambda s: (s.num_experts,), "int32", STATUS, ("layout",),
           "rows each expert dropped beyond its capacity, accumulated until the host resets it"),
    Buffer("input_fault", lambda s: (INPUT_FAULT_WORDS,), "int32", STATUS, ("layout", "dispatch"),
           "the latest layout's refusal: ranks whose topk_idx was invalid, the lowest of them (-1: none)"),
    # -- pinned host memory -----------------------------------------------------------------------
    Buffer("status_mirror", lambda s: (s.status_words + 1,), "int32", HOST, ("layout",),
           "the status block as the layout's leader (rank layout: CTA 0) saw it once the count was known "
           "(written when mirror_seq is not 0), then mirror_seq: the host polls that word instead of copying "
           "the block and syncing"),
)

BUFFER_NAMES = tuple(b.name for b in BUFFERS)
BY_NAME = {b.name: b for b in BUFFERS}

# Run-time scalars every launch passes: the call's own, then sizes named as EpConfig's attributes.
CALL_SCALARS = ("op", "mode", "fp8", "algo", "combine_algo", "layout", "rank", "num_tokens", "own_routing",
                "routed", "mirror_seq", "y_rows", "y_gather", "phase", "deliver_rows", "deliver_end0",
                "deliver_end1", "deliver_end2", "assemble_rows", "assemble_end0", "assemble_end1",
                "assemble_stride_t", "assemble_stride_j")
SIZE_SCALARS = ("world_size", "local_world_size", "num_experts", "topk", "hidden", "max_tokens", "capacity",
                "expert_capacity", "stage_rows", "num_sms", "timeout_ms", "layout_in_dispatch")
SCALARS = CALL_SCALARS + SIZE_SCALARS


class _Sizes:
    """Sizes derived from the scalars, named as EpConfig's properties (so shape functions serve both)."""

    __slots__ = ()

    @property
    def experts_per_rank(self):
        return self.num_experts // self.world_size

    @property
    def fp8_row_bytes(self):
        return packed_fp8_row_bytes(self.hidden)

    @property
    def fp8_scales(self):
        return self.hidden // FP8_BLOCK

    @property
    def rank_capacity(self):
        return self.world_size * self.max_tokens

    @property
    def status_words(self):
        return status_words(self)

    @property
    def layout_ctas(self):
        """CTAs of a layout launch (on the device num_sms is always this buffer's own)."""
        return self.num_sms


class Scalars(_Sizes, namedtuple("Scalars", SCALARS)):
    """The run-time scalars of one launch (Int32 values), in ``SCALARS`` order."""

    __slots__ = ()


Pointers = namedtuple("Pointers", BUFFER_NAMES)
Pointers.__doc__ = "One device pointer per buffer of ``BUFFERS``, in table order (the module's argument)."


def row_major(shape: tuple):
    """The compact row-major CuTe layout of ``shape`` (ints or run-time Int32 values)."""
    import cutlass.cute as cute

    if len(shape) == 1:
        return cute.make_layout(shape[0])
    strides = [1]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    return cute.make_layout(shape, stride=tuple(strides))


class EpParams(_Sizes, namedtuple("EpParams", SCALARS + tuple(f"{n}_ptr" for n in BUFFER_NAMES))):
    """What every kernel receives: the launch's scalars and one device pointer per buffer (``<name>_ptr``).

    ``p.<name>`` is the buffer as a CuTe tensor: its pointer with the row-major layout of its table shape,
    made from the scalars on access (no run-time cost). Pointers travel rather than tensors so that every
    layout is built from the same run-time sizes, and a launch passes only what the table names.
    """

    __slots__ = ()


def _tensor_property(b: Buffer) -> property:
    def tensor(self: EpParams):
        import cutlass.cute as cute

        return cute.make_tensor(getattr(self, f"{b.name}_ptr"), row_major(tuple(b.shape(self))))

    return property(tensor, doc=f"{b.name}: {b.doc}")


for _b in BUFFERS:
    setattr(EpParams, _b.name, _tensor_property(_b))


def buffers_of(place: str) -> tuple[Buffer, ...]:
    return tuple(b for b in BUFFERS if b.place == place)


def symmetric_bytes(cfg: Any) -> int:
    """Bytes of NVSHMEM symmetric memory one rank allocates for ``cfg`` (the SYMMETRIC buffers)."""
    return sum(b.nbytes(cfg) for b in buffers_of(SYMMETRIC) if b.is_needed(cfg))


def status_layout(cfg: Any) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each STATUS buffer lives in the status block, an int32 tensor: {name: (first word, words)}
    and the block's length in words. Each member starts at a multiple of its element size."""
    where, word = {}, 0
    for b in buffers_of(STATUS):
        per = b.item_bytes(cfg) // 4
        word = -(-word // per) * per
        words = math.prod(b.alloc_shape(cfg)) * per
        where[b.name] = (word, words)
        word += words
    return where, word


def status_words(sizes: Any):
    """The status block's length in int32 words (``status_layout``'s), from host or device sizes."""
    word = 0
    for b in buffers_of(STATUS):
        per = ELEMENT_TYPES[b.dtype][2] // 4
        word = -(-word // per) * per
        for n in b.shape(sizes):
            per = per * n
        word = word + per
    return word
