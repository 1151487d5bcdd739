"""The low-latency mode's torch parts: DeepEP's per-token FP8 cast, the per-expert padded receive layout
built from the expert-major dispatch of ``cute_ep``, and its inverse for combine.

``padded_layout`` is the one place the padded layout is made in torch, for the host backends (on a GPU the
module's low-latency dispatch writes it itself: kernels/low_latency_dispatch.py); ``expert_major_rows`` is the
one place combine reads it back in torch (on a GPU the module's low-latency combine pushes the rows received
back itself: kernels/low_latency_combine.py). Both are sync-free torch ops whose work is proportional to the
receive capacity (every row a rank could receive), not to the rows received: the host does not know that count
without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from cute_ep.kernels.buffers import FP8_BLOCK, packed_fp8_row_bytes

__all__ = [
    "FP8_MARGIN",
    "PaddedOut",
    "PaddedRecv",
    "PaddedScratch",
    "cast_fp8_blocks",
    "expert_major_rows",
    "padded_layout",
    "split_fp8_payload",
    "ue8m0_pack",
]

FP8_MAX = 448.0
FP8_MARGIN = 1e-4
"""The smallest amax of a block in DeepEP's cast (an all-zero block gets this amax, and finite scales)."""


def cast_fp8_blocks(x: Tensor, round_scale: bool = False, *, out: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """DeepEP's low-latency FP8 cast of rows x [T, H] (H a multiple of 128), block by block of 128 columns,
    in fp32: amax = max(1e-4, max |x|); without ``round_scale`` scale = 448 / amax (an IEEE division) and
    scale_inv = amax * fp32(1 / 448); with it scale_inv = 2^ceil(log2(amax * fp32(1 / 448))) (from the
    product's bits) and scale = 1 / scale_inv; q = e4m3(x * scale), saturated at +-448.

    Returns (q [T, H] float8_e4m3fn, scale_inv [T, H / 128] fp32): x ~ q * scale_inv. ``out``: packed rows
    [T, P] uint8 (the layout ``split_fp8_payload`` reads, P >= H + 4 H / 128) to write q and scale_inv into
    (the bytes past them are left as they are); the returned tensors are then views of it. Seven tensor
    operations without ``round_scale`` and no host sync (the
    constants are made once per device): on the GPU each costs host time, so they are counted."""
    t, hidden = x.shape
    blocks = x.reshape(t, hidden // FP8_BLOCK, FP8_BLOCK)
    consts = _fp8_constants(x.device)
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=-1, dtype=torch.float32)  # max |x|, exact
    amax = amax.clamp_min_(FP8_MARGIN)
    if out is None:
        out = torch.zeros((t, packed_fp8_row_bytes(hidden)), dtype=torch.uint8, device=x.device)
    q, scale_inv = split_fp8_payload(out, hidden)
    if round_scale:
        bits = (amax * consts.inv_max).view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale_inv.copy_(((exp + 127) << 23).view(torch.float32))
        scale = ((127 - exp) << 23).view(torch.float32)
    else:
        scale = torch.div(consts.max, amax)
        torch.mul(amax, consts.inv_max, out=scale_inv)
    # the fp32 product, saturated, then rounded to e4m3 by the copy (the cast .to() makes)
    product = torch.mul(blocks, scale[..., None]).clamp_(-FP8_MAX, FP8_MAX)
    q.view(t, hidden // FP8_BLOCK, FP8_BLOCK).copy_(product)
    return q, scale_inv


@dataclass(frozen=True)
class _Fp8Constants:
    max: Tensor  # 448.0, fp32, 0-dim
    inv_max: Tensor  # fp32(1 / 448), 0-dim


_FP8_CONSTANTS: dict[torch.device, _Fp8Constants] = {}


def _fp8_constants(device: torch.device) -> _Fp8Constants:
    """The cast's fp32 constants on ``device``, made once (a tensor made from a Python number on a GPU is
    a host-to-device copy with a stream sync)."""
    consts = _FP8_CONSTANTS.get(device)
    if consts is None:
        consts = _Fp8Constants(torch.tensor(FP8_MAX, dtype=torch.float32, device=device),
                               torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=device))
        _FP8_CONSTANTS[device] = consts
    return consts


def ue8m0_pack(scale_inv: Tensor) -> Tensor:
    """Power-of-two scales [N, S] fp32 as DeepEP's UE8M0 scales: the exponent byte of each, four to an
    int32 (byte j of int p is scale 4p + j; zero bytes pad S to a multiple of 4): [N, ceil(S / 4)] int32."""
    n, s = scale_inv.shape
    exps = ((scale_inv.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    padded = torch.zeros((n, -(-s // 4) * 4), dtype=torch.uint8, device=scale_inv.device)
    padded[:, :s] = exps
    return padded.view(torch.int32)


def split_fp8_payload(rows: Tensor, hidden: int) -> tuple[Tensor, Tensor]:
    """Views of the packed FP8 rows the kernels move (any element type; P bytes each, P =
    ``packed_fp8_row_bytes(H)``: [H bytes of e4m3 | 4 H / 128 bytes of fp32 scales | zeros to 16]):
    (q [..., H] float8_e4m3fn, scale_inv [..., H / 128] fp32)."""
    raw = rows.view(torch.uint8)
    scale_end = hidden + 4 * (hidden // FP8_BLOCK)
    return raw[..., :hidden].view(torch.float8_e4m3fn), raw[..., hidden:scale_end].view(torch.float32)


@dataclass(frozen=True)
class PaddedRecv:
    """A low-latency dispatch's receive side in DeepEP's per-expert padded layout (El local experts,
    S = R * M slots each).

    rows [El, S, W]: expert l's received rows in slots [0, count[l]) (the rest uninitialised); count [El]
    int32; src_info [El, S] int32: the source token index of each slot; layout_range [El, R] int64:
    ``(begin << 32) | rows`` of each source rank's block of slots; slot [C] int64: the row of ``rows``
    (viewed as [El * S, W]) holding each of the C expert-major rows, and for rows past the received count
    a row in [El * S - 1, ...) that combine may read and ignore (clamped to the last slot)."""

    rows: Tensor
    count: Tensor
    src_info: Tensor
    layout_range: Tensor
    slot: Tensor


@dataclass(frozen=True)
class PaddedScratch:
    """What ``padded_layout`` needs for one shape besides its inputs, made once (``make``) and kept by the
    Buffer: sizes and small constant or work tensors, so a call makes no tensor of its own beyond its
    results."""

    capacity: int  # C: expert-major rows of the receive buffer
    experts: int  # El
    slots: int  # S = R * M
    rows: Tensor  # arange(C) int64
    bases: Tensor  # arange(El + 1) * S int64: each expert's first slot (El: the spare rows)
    starts: Tensor  # [El + 1] int64 work tensor: starts[0] = 0, then the running received counts
    blocks: Tensor  # arange(El * R + 1) int64: the (expert, source) block ids and the end

    @classmethod
    def make(cls, capacity: int, experts: int, num_ranks: int, max_tokens: int, device: torch.device
             ) -> PaddedScratch:
        slots = num_ranks * max_tokens
        return cls(capacity, experts, slots, torch.arange(capacity, device=device),
                   torch.arange(experts + 1, device=device) * slots,
                   torch.zeros(experts + 1, dtype=torch.int64, device=device),
                   torch.arange(experts * num_ranks + 1, device=device))


@dataclass(frozen=True)
class PaddedOut:
    """Kept tensors ``padded_layout`` writes into (DeepEP's low-latency receive buffers: made once per shape
    and buffer parity, rewritten by every dispatch of that parity): rows [El * S + C, W] (C spare rows past
    the El * S slots take the stale rows), src_info [El * S + C] int32, count [El] int32, layout_range
    [El, R] int64, slot [C] int64."""

    rows: Tensor
    src_info: Tensor
    count: Tensor
    layout_range: Tensor
    slot: Tensor
    _received: dict = field(default_factory=dict, compare=False, repr=False)

    def received(self, experts: int, slots: int) -> PaddedRecv:
        """These tensors as a dispatch returns them (``PaddedRecv``: the rows and sources viewed as [El,
        S, ...]), the views made once (each costs host time)."""
        got = self._received.get((experts, slots))
        if got is None:
            n = experts * slots
            got = self._received[experts, slots] = PaddedRecv(
                rows=self.rows[:n].view(experts, slots, self.rows.shape[1]), count=self.count,
                src_info=self.src_info[:n].view(experts, slots), layout_range=self.layout_range,
                slot=self.slot)
        return got

    @classmethod
    def make_exact(cls, experts: int, num_ranks: int, max_tokens: int, width: int, dtype: torch.dtype,
                   device: torch.device) -> PaddedOut:
        """The tensors the kernels' low-latency dispatch writes (kernels/low_latency_dispatch.py): no spare
        rows, and slot [El * R * M] (each filled slot's pair, which its combine pushes back by)."""
        n = experts * num_ranks * max_tokens
        return cls(torch.empty((n, width), dtype=dtype, device=device),
                   torch.empty(n, dtype=torch.int32, device=device),
                   torch.empty(experts, dtype=torch.int32, device=device),
                   torch.empty((experts, num_ranks), dtype=torch.int64, device=device),
                   torch.empty(n, dtype=torch.int64, device=device))

    @classmethod
    def make(cls, scratch: PaddedScratch, num_ranks: int, width: int, dtype: torch.dtype,
             device: torch.device) -> PaddedOut:
        n = scratch.experts * scratch.slots + scratch.capacity
        return cls(torch.empty((n, width), dtype=dtype, device=device),
                   torch.empty(n, dtype=torch.int32, device=device),
                   torch.empty(scratch.experts, dtype=torch.int32, device=device),
                   torch.empty((scratch.experts, num_ranks), dtype=torch.int64, device=device),
                   torch.empty(scratch.capacity, dtype=torch.int64, device=device))


def padded_layout(recv_rows: Tensor, recv_src: Tensor, tokens_per_expert: Tensor, num_ranks: int,
                  max_tokens: int, topk: int, scratch: PaddedScratch | None = None,
                  into: PaddedOut | None = None) -> PaddedRecv:
    """Build the padded layout from an expert-major dispatch (``layout="expert"``), without a host sync.

    recv_rows [C, W]: the receive buffer's rows (expert l's rows back to back, source rank ascending, each
    source's in token order; rows past the received count are stale); recv_src [C] int32 source tags
    ``(s * M + t) * K + k``; tokens_per_expert [El]. Source s's rows of expert l form one block, so its
    ``layout_range`` entry is that block's place in the expert's slots (DeepEP fills the blocks in the
    order they arrive; here always in rank order, one of the orders DeepEP can produce). The results are
    views of ``into`` (new tensors without it). 19 tensor operations, one copy of the C rows (each costs
    host time on a GPU, so they are counted).
    """
    cap, width = recv_rows.shape
    el = tokens_per_expert.shape[0]
    dev = recv_rows.device
    s = scratch or PaddedScratch.make(cap, el, num_ranks, max_tokens, dev)
    out = into or PaddedOut.make(s, num_ranks, width, recv_rows.dtype, dev)
    slots = s.slots
    torch.cumsum(tokens_per_expert, 0, dtype=torch.int64, out=s.starts[1:])
    expert = torch.searchsorted(s.starts[1:], s.rows, right=True)  # El for the rows past the count
    # Row j of expert l goes to slot l * S + j - starts[l]; the stale rows (expert El) to the spare rows
    # past El * S, so one index_copy_ moves every row without a mask.
    slot = (s.bases - s.starts).index_select(0, expert).add_(s.rows)
    out.rows.index_copy_(0, slot, recv_rows)
    out.src_info.index_copy_(0, slot, recv_src.div(topk, rounding_mode="floor").remainder_(max_tokens))
    # The blocks: rows are sorted by (expert, source) (stale rows last, as expert El), so each block's
    # first row is a binary search; a stale tag's source is clamped into [0, R).
    source = recv_src.div(topk * max_tokens, rounding_mode="floor").clamp_(0, num_ranks - 1)
    first = torch.searchsorted(expert.mul(num_ranks).add_(source), s.blocks)
    rows_of = (first[1:] - first[:-1]).view(el, num_ranks)
    begin = first[:-1].view(el, num_ranks) - first[: el * num_ranks : num_ranks].view(el, 1)
    torch.add(rows_of, begin, alpha=1 << 32, out=out.layout_range)
    out.count.copy_(tokens_per_expert)
    torch.clamp(slot, max=el * slots - 1, out=out.slot)
    return out.received(el, slots)


def expert_major_rows(padded: Tensor, slot: Tensor, out: Tensor) -> Tensor:
    """``padded_layout``'s inverse for combine: out[j] = padded[slot[j]] (padded [El, R * M, H] viewed as
    rows), into ``out`` [C, H] (rows past the received count get an arbitrary row: combine never reads
    them)."""
    return torch.index_select(padded.reshape(-1, padded.shape[-1]), 0, slot, out=out)
