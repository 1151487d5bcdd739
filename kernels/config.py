"""Configuration of the layout, dispatch and combine kernels.

Only the element type is fixed when the kernels are compiled (one module per dtype: compiling one
costs tens of seconds, and NVSHMEM tolerates few registered modules per process). Every size here is
passed to the kernels at run time, so one compiled module serves any ``EpConfig`` of its dtype.

These three modules import one way: config.py imports buffers.py (the one table of buffers, the packed
FP8 row: ``EpConfig``'s symmetric bytes, status words and key come from it) and variants.py (receive
layouts, combine algorithms); buffers.py imports variants.py; neither imports config.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cute_ep.kernels import buffers
from cute_ep.kernels.buffers import FP8_BLOCK, packed_fp8_row_bytes
from cute_ep.kernels.variants import COMBINE_ALGORITHMS

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Dispatch modes (run-time argument of the dispatch kernel).
MODE_SCATTER = 0  # slots precomputed by the layout kernel: deterministic order
MODE_ATOMIC = 1  # slots taken by an atomic add on the sender: order inside a (expert, source) group varies
MODES = {"scatter": MODE_SCATTER, "atomic": MODE_ATOMIC}

# Dispatch primitives (run-time argument of the dispatch kernel; a sender-side choice, so ranks may
# differ): "dedup" sends a row once per destination rank and the receiver fans it out; "per_pair" sends
# every (token, k) row (peer-pointer stores on the node, put_warp beyond); "put_warp" sends every
# (token, k) row with put_warp, also on the node (self-rank rows are always local copies).
ALGO_DEDUP = 0
ALGO_PER_PAIR = 1
ALGO_PUT_WARP = 2
DISPATCH_ALGORITHMS = {"dedup": ALGO_DEDUP, "per_pair": ALGO_PER_PAIR, "put_warp": ALGO_PUT_WARP}

# Operations of the one compiled module (NVSHMEM tolerates few registered modules per process).
OP_LAYOUT = 0
OP_DISPATCH = 1
OP_COMBINE = 2
OPS = {OP_LAYOUT: "layout", OP_DISPATCH: "dispatch", OP_COMBINE: "combine"}
# The launch scalar ``phase`` of the low-latency layout's ops (DeepEP's return_recv_hook): the whole op, its
# sending half (rows out, counts announced) or its receiving half (waits, rows placed or summed).
PHASE_ALL = 0
PHASE_SEND = 1
PHASE_RECEIVE = 2

WARP = 32
VECTOR_BYTES = 16  # one 128-bit access per lane
MAX_TOPK = 64  # per-warp routing of a token is staged in shared memory: [warps, MAX_TOPK]
LAYOUT_SMEM_INTS = 12288  # 48 KB of per-warp expert histograms in the layout kernel
# Threads per CTA of the layout and dispatch kernels (the dispatch runs the layout's steps when folded in).
LAYOUT_THREADS = 16 * 32
MAX_EXPERTS = LAYOUT_SMEM_INTS // 2  # the layout kernel needs one warp's histogram plus the column sums
COMBINE_WARPS_PER_CTA = 8
# The pull combines (both layouts, and phase 2 of the rank layout's push) run twice the warps on an SM:
# they take 128 registers a thread either way, so 16 warps fill the register file, and a sum waits on
# memory latency with a fixed number of loads in flight per warp (kernels/rowsum.py): twice the warps,
# twice the bytes in flight (rank combine at 4096 tokens, 24 SMs, 2x H200: 365.8 -> 227.6 us).
PULL_COMBINE_WARPS_PER_CTA = 16
# The reduced combine's kernels read local memory only and launch this many CTAs per num_sms: more warps
# in flight hide more memory latency (they need no per-(warp, k) staging rows, only one per warp).
REDUCED_GRID_FACTOR = 2
MAX_WORLD_SIZE = COMBINE_WARPS_PER_CTA * WARP  # combine signals and waits with one thread per peer
# num_sms 0 means "this rank's share of its GPU", known once the buffer is built; until then the buffers
# that scale with num_sms (the combine's staging rows) are sized for this many SMs.
MAX_SMS_PER_GPU = 160


OVERFLOW_POLICIES = ("raise", "drop")  # what the host does after rows were dropped beyond expert capacity

# FP8 dispatch (per-call option): e4m3 rows with one fp32 scale per FP8_BLOCK columns (the packed row's
# format, FP8_BLOCK and packed_fp8_row_bytes, is declared with the buffers that hold it: kernels/buffers.py).
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 2.0**-14  # a block's amax is at least this (an all-zero block gets a finite scale)
# The scale rule of an FP8 dispatch (the launch scalar ``fp8``; 0: no FP8). Each stores a block's scale s
# (x ~ q * s) and multiplies by m before the e4m3 rounding:
FP8_SCALE_DIVIDE = 1  # amax >= FP8_AMAX_FLOOR, s = amax / 448, m = 448 / amax (cute_ep.fp8.quantize_fp8)
FP8_SCALE_LOW_LATENCY = 2  # DeepEP's low-latency cast: amax >= 1e-4, s = amax * fp32(1 / 448), m = 448 / amax
FP8_SCALE_POWER_OF_TWO = 3  # ... with round_scale: s = 2^ceil(log2(amax * fp32(1 / 448))), m = 1 / s
FP8_LOW_LATENCY_AMAX_FLOOR = 1e-4  # DeepEP's low-latency cast's least amax (rounded to fp32)


# What EpConfig.capacity must hold, by EpConfig.low_latency.
_CAPACITY_RULE = {
    False: "min(world_size * max_tokens * min(topk, experts per rank), experts per rank * expert_capacity)",
    True: "num_experts * max_tokens (low_latency)",
}

# Default EpConfig.layout_in_dispatch: every batch folds the layout into the dispatch launch (measured on one
# H200 at 4096 tokens: dispatch 644.2 / 135.0 us folded against 650.6 / 143.0 us apart in the expert / rank
# layout at 24 SMs, 277.5 / 68.3 against 285.7 / 78.5 at 132; at 128 tokens 39.7 against 43.2 us).
LAYOUT_IN_DISPATCH_TOKENS = 2**31 - 1
MAX_TIMEOUT_S = 2**31 // 1000  # the timeout travels as int32 milliseconds


def cute_dtype(dtype: torch.dtype):
    """The CuTe DSL element type of a supported torch dtype."""
    import cutlass

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
    if dtype not in table:
        raise ConfigError(f"dtype must be one of {[str(d) for d in table]}, got {dtype}")
    return table[dtype]


def nearest_valid_hidden(hidden: int, dtype: torch.dtype) -> str:
    """The hidden sizes nearest ``hidden`` whose rows of ``dtype`` are a multiple of VECTOR_BYTES, as the
    end of the message that refuses ``hidden``: "the nearest valid sizes are 96 and 104 (multiples of 8
    for torch.bfloat16)"."""
    step = VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()
    below = hidden // step * step
    sizes = [n for n in (below, below + step) if n >= 1]
    listed = " and ".join(map(str, sizes))
    verb = "sizes are" if len(sizes) > 1 else "size is"
    return f"the nearest valid {verb} {listed} (multiples of {step} for {dtype})"


def nearest_valid_experts(num_experts: int, world_size: int) -> str:
    """The expert counts nearest ``num_experts`` that ``world_size`` ranks split evenly (multiples of
    ``world_size`` in [1, MAX_EXPERTS]), as the end of the message that refuses ``num_experts``: "use 15
    or 18"."""
    below = num_experts // world_size * world_size
    counts = [n for n in (below, below + world_size) if 1 <= n <= MAX_EXPERTS] or [world_size]
    return "use " + " or ".join(map(str, counts))


class ConfigError(ValueError):
    """An argument that violates a constraint of the kernels; the message names it and its value."""


@dataclass(frozen=True)
class EpConfig:
    """Shapes and placement a compiled module is specialized for.

    world_size:        R, ranks in the expert-parallel group.
    local_world_size:  L, ranks per (possibly virtual) node; peers on the same node are read through
                       their NVSHMEM peer pointer in combine, others are fetched with ``get_warp``.
    num_experts:       E, divisible by R; rank r owns experts [r*E/R, (r+1)*E/R).
    topk:              K, experts per token (1 <= K <= min(E, 64): routing is staged per warp).
    hidden:            H, elements per row; H * element size must be a multiple of 16 bytes.
    dtype:             torch.bfloat16, torch.float16 or torch.float32 (rows and combine output).
    max_tokens:        M, most tokens per rank and call; buffers and the source tag are sized by it.
    capacity_factor:   0 (default): no expert ever drops a row (buffers sized for the worst case).
                       f > 0: each expert receives at most ``expert_capacity`` = ceil(f * R * M * K / E)
                       rows per dispatch (f times its share at full batch); rows beyond it are dropped
                       in a fixed order (an expert keeps source 0's rows first, each source's in (t, k)
                       order), counted on the device, and reported (see ``on_overflow``).
    combine_algorithm: "pull" (default) or "reduced" (see COMBINE_ALGORITHMS): the buffer's default
                       combine. "reduced" also allocates ``partial_rows`` x H symmetric rows and makes
                       every dispatch record each (token, rank) group; "pull" stays available per call.
    on_overflow:       "raise" (default): the next host-visible check (``dispatch``, or
                       ``EpBuffer.check_capacity`` after ``launch_dispatch``) raises ``CapacityExceeded``
                       naming how many rows each expert dropped, on every rank alike; "drop": rows are
                       dropped silently and counted (``EpBuffer.dropped_rows``).
    capacity:          rows each rank can receive; the default (0) is the least that always fits:
                       min(R * M * min(K, E/R), E/R * expert_capacity). A smaller one is refused.
    num_sms:           CTAs launched by dispatch/combine (persistent grid-stride loops); at most this rank's
                       share of its GPU (its SM count, divided by the ranks that share it), checked when a
                       buffer is built (the layout's CTAs wait for each other). 0 (the default): that share,
                       the least of any rank's (``EpBuffer.cfg`` holds the number).
    timeout_s:         longest a kernel waits for a peer's signal; past it the kernel records which
                       peer and operation, moves no more data, and the host raises ``PeerTimeout``.
    layout_in_dispatch: dispatches (either receive layout) of at most this many tokens run the layout
                       inside the dispatch launch (every CTA for the tokens it then sends) instead of in
                       a kernel of its own: one kernel less on the critical path. Default: every batch;
                       0: always a kernel of its own. Results are identical either way.
    low_latency:       buffers for DeepEP's low-latency layout (``cute_ep.deep_ep``'s low-latency mode,
                       kernels/low_latency_dispatch.py): capacity E * M (every (expert, source, token)
                       row of the combine), two sets of per-source token rows, no ``recv_x``; needs
                       ``capacity_factor == 0`` and top-k <= 32.
    """

    world_size: int
    local_world_size: int
    num_experts: int
    topk: int
    hidden: int
    dtype: torch.dtype
    max_tokens: int
    capacity: int = 0
    num_sms: int = 0
    timeout_s: float = 60.0
    capacity_factor: float = 0.0
    on_overflow: str = "raise"
    combine_algorithm: str = "pull"
    layout_in_dispatch: int = LAYOUT_IN_DISPATCH_TOKENS
    low_latency: bool = False

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(
            1 <= self.world_size <= MAX_WORLD_SIZE,
            f"world_size must be in [1, {MAX_WORLD_SIZE}] (combine's start barrier uses one thread per "
            f"peer), got {self.world_size}",
        )
        need(
            self.local_world_size >= 1 and self.world_size % self.local_world_size == 0,
            f"local_world_size must divide world_size={self.world_size}, got {self.local_world_size}",
        )
        need(self.num_experts >= 1, f"num_experts must be >= 1, got {self.num_experts}")
        need(
            self.num_experts % self.world_size == 0,
            f"num_experts must be divisible by world_size={self.world_size}, got {self.num_experts}; "
            f"{nearest_valid_experts(self.num_experts, self.world_size)}",
        )
        need(
            self.num_experts <= MAX_EXPERTS,
            f"num_experts must be <= {MAX_EXPERTS} (layout kernel shared memory), got {self.num_experts}",
        )
        need(
            1 <= self.topk <= min(self.num_experts, MAX_TOPK),
            f"topk must be in [1, min(num_experts={self.num_experts}, {MAX_TOPK})], got {self.topk}",
        )
        need(
            self.dtype in SUPPORTED_DTYPES,
            f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {self.dtype}",
        )
        need(self.hidden >= 1, f"hidden must be >= 1, got {self.hidden}")
        if (self.hidden * self.element_size) % VECTOR_BYTES:
            raise ConfigError(
                f"hidden * element size must be a multiple of {VECTOR_BYTES} bytes: hidden={self.hidden} x "
                f"{self.element_size} B = {self.hidden * self.element_size} B; "
                f"{nearest_valid_hidden(self.hidden, self.dtype)}"
            )
        need(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        # The source tag (rank * M + token) * K + k is an int32.
        need(
            self.world_size * self.max_tokens * self.topk < 2**31,
            f"world_size * max_tokens * topk must be < 2**31 (int32 source tag), got "
            f"{self.world_size} * {self.max_tokens} * {self.topk}",
        )
        need(
            math.isfinite(self.capacity_factor) and self.capacity_factor >= 0,
            f"capacity_factor must be a finite number >= 0 (0: no limit), got {self.capacity_factor}",
        )
        need(
            self.on_overflow in OVERFLOW_POLICIES,
            f"on_overflow must be one of {OVERFLOW_POLICIES}, got {self.on_overflow!r}",
        )
        need(
            self.combine_algorithm in COMBINE_ALGORITHMS,
            f"combine_algorithm must be one of {sorted(COMBINE_ALGORITHMS)}, got {self.combine_algorithm!r}",
        )
        if self.low_latency:
            need(self.capacity_factor == 0 and self.topk <= WARP,
                 f"low_latency buffers need capacity_factor == 0 and topk <= {WARP} (a lane per pair), got "
                 f"capacity_factor={self.capacity_factor}, topk={self.topk}")
        if self.capacity == 0:
            object.__setattr__(self, "capacity", self.required_capacity)
        need(
            self.capacity >= self.required_capacity,
            f"capacity must be >= {_CAPACITY_RULE[self.low_latency]} = {self.required_capacity}, got "
            f"{self.capacity}",
        )
        need(self.capacity < 2**31, f"capacity must be < 2**31 (int32 slots), got {self.capacity}")
        need(self.num_sms >= 0,
             f"num_sms must be >= 1 (or 0: this rank's share of its GPU), got {self.num_sms}")
        need(
            type(self.layout_in_dispatch) is int and 0 <= self.layout_in_dispatch < 2**31,
            f"layout_in_dispatch must be in [0, 2**31) tokens (0: the layout is always a kernel of its own), "
            f"got {self.layout_in_dispatch}",
        )
        need(
            0.001 <= self.timeout_s <= MAX_TIMEOUT_S,
            f"timeout_s must be in [0.001, {MAX_TIMEOUT_S}] seconds, got {self.timeout_s}",
        )

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def worst_case_capacity(self) -> int:
        return self.world_size * self.max_tokens * min(self.topk, self.experts_per_rank)

    @property
    def rank_capacity(self) -> int:
        """Rows a rank can receive in the rank layout (``dispatch(..., layout="rank")``): at most one per
        (source rank, token), R * M. It never exceeds ``capacity`` when ``capacity_factor == 0``, the
        only configuration that layout accepts."""
        return self.world_size * self.max_tokens

    @property
    def status_words(self) -> int:
        """int32 words of the status block the host reads after a call (``kernels.buffers.status_layout``)."""
        return buffers.status_words(self)

    @property
    def expert_capacity(self) -> int:
        """Rows one expert may receive per dispatch: R * M (never drops) unless capacity_factor > 0."""
        most = self.world_size * self.max_tokens
        if self.capacity_factor == 0:
            return most
        share = self.world_size * self.max_tokens * self.topk / self.num_experts
        # Rounded first so that e.g. 1.1 * 10 gives 11, not ceil(11.000000000000002) = 12.
        return max(1, min(most, math.ceil(round(self.capacity_factor * share, 6))))

    @property
    def required_capacity(self) -> int:
        """Receive rows that always suffice: every routing, and at most expert_capacity per expert (the
        low-latency layout: a row for every (expert, source, token), E * M)."""
        if self.low_latency:
            return self.num_experts * self.max_tokens
        return min(self.worst_case_capacity, self.experts_per_rank * self.expert_capacity)

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout_s * 1000))

    @property
    def vec(self) -> int:
        """Elements per 128-bit access."""
        return VECTOR_BYTES // self.element_size

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_size

    @property
    def fp8_scales(self) -> int:
        """fp32 scales per row of an FP8 dispatch (one per FP8_BLOCK columns)."""
        return self.hidden // FP8_BLOCK

    @property
    def fp8_row_bytes(self) -> int:
        """Bytes of one packed FP8 row: e4m3 values, fp32 scales, zero padding to 16 bytes."""
        return packed_fp8_row_bytes(self.hidden)

    def check_fp8(self) -> None:
        """Raise ConfigError unless FP8 dispatch works for this configuration."""
        if self.hidden % FP8_BLOCK != 0:
            raise ConfigError(
                f"FP8 dispatch needs hidden to be a multiple of {FP8_BLOCK} (one scale per {FP8_BLOCK} "
                f"columns), got hidden={self.hidden}"
            )

    @property
    def combine_warps(self) -> int:
        """Warps of the widest combine grid (the pull combines')."""
        return (self.num_sms or MAX_SMS_PER_GPU) * max(COMBINE_WARPS_PER_CTA, PULL_COMBINE_WARPS_PER_CTA)

    @property
    def layout_ctas(self) -> int:
        """CTAs of a layout launch (the rank layout's ``layout_words`` has a row per CTA): num_sms, or before
        num_sms 0 becomes this rank's share of its GPU, the most any GPU has."""
        return self.num_sms or MAX_SMS_PER_GPU

    @property
    def stage_rows(self) -> int:
        """Rows of the combine staging buffer, only when other nodes exist: one per (pull-combine warp, k),
        and at least one per warp of the reduced combine's larger grid."""
        return self.combine_warps * max(self.topk, REDUCED_GRID_FACTOR) if self.nnodes > 1 else 1

    @property
    def partial_rows(self) -> int:
        """Rows of the reduced combine's partial buffer: one per (token slot, source rank), M * R."""
        return self.max_tokens * self.world_size if self.combine_algorithm == "reduced" else 0

    def key(self) -> tuple:
        """Everything that defines the configuration (compared across ranks at construction)."""
        return (str(self.dtype), *(getattr(self, n) for n in buffers.SIZE_SCALARS), self.capacity_factor,
                self.on_overflow, self.combine_algorithm, self.low_latency)

    def compile_key(self) -> tuple:
        """The explicit compile-cache key: the kernels are specialized on the element type only."""
        return ("ep_module", str(self.dtype))

    def symmetric_bytes(self) -> int:
        """Bytes of NVSHMEM symmetric memory one rank allocates for this configuration (the symmetric
        buffers of ``kernels.buffers.BUFFERS``)."""
        return buffers.symmetric_bytes(self)
