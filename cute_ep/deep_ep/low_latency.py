"""The low-latency mode's torch parts: DeepEP's per-token FP8 cast, the per-expert padded receive layout
built from the expert-major dispatch of ``cute_ep``, and its inverse for combine.

``padded_layout`` is the one place the padded layout is made (a kernel variant writing it directly can
replace it); ``expert_major_rows`` is the one place combine reads it back. Both are sync-free torch ops
whose work is proportional to the receive capacity (every row a rank could receive), not to the rows
received: the host does not know that count without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cute_ep.fp8 import pack_fp8_rows
from cute_ep.kernels.buffers import FP8_BLOCK, packed_fp8_row_bytes

__all__ = [
    "FP8_MARGIN",
    "PaddedRecv",
    "cast_fp8_blocks",
    "expert_major_rows",
    "fp8_payload",
    "padded_layout",
    "split_fp8_payload",
    "ue8m0_pack",
]

FP8_MAX = 448.0
FP8_MARGIN = 1e-4
"""The smallest amax of a block in DeepEP's cast (an all-zero block gets this amax, and finite scales)."""


def cast_fp8_blocks(x: Tensor, round_scale: bool = False) -> tuple[Tensor, Tensor]:
    """DeepEP's low-latency FP8 cast of rows x [T, H] (H a multiple of 128), block by block of 128 columns,
    in fp32: amax = max(1e-4, max |x|); without ``round_scale`` scale = 448 / amax (an IEEE division) and
    scale_inv = amax * fp32(1 / 448); with it scale_inv = 2^ceil(log2(amax * fp32(1 / 448))) (from the
    product's bits) and scale = 1 / scale_inv; q = e4m3(x * scale), saturated at +-448.

    Returns (q [T, H] float8_e4m3fn, scale_inv [T, H / 128] fp32): x ~ q * scale_inv."""
    t, hidden = x.shape
    xf = x.float().reshape(t, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = xf.abs().amax(dim=-1).clamp_min(FP8_MARGIN)
    inv_max = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=x.device)
    if round_scale:
        bits = (amax * inv_max).view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        scale_inv = ((exp + 127) << 23).view(torch.float32)
        scale = ((127 - exp) << 23).view(torch.float32)
    else:
        scale = torch.full_like(amax, FP8_MAX).div(amax)
        scale_inv = amax * inv_max
    q = (xf * scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, hidden), scale_inv


def ue8m0_pack(scale_inv: Tensor) -> Tensor:
    """Power-of-two scales [N, S] fp32 as DeepEP's UE8M0 scales: the exponent byte of each, four to an
    int32 (byte j of int p is scale 4p + j; zero bytes pad S to a multiple of 4): [N, ceil(S / 4)] int32."""
    n, s = scale_inv.shape
    exps = ((scale_inv.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    padded = torch.zeros((n, -(-s // 4) * 4), dtype=torch.uint8, device=scale_inv.device)
    padded[:, :s] = exps
    return padded.view(torch.int32)


def fp8_payload(q: Tensor, scale_inv: Tensor) -> Tensor:
    """Rows that carry e4m3 values and fp32 scales as raw bytes ([H bytes | 4 H / 128 bytes | zeros to 16]),
    as a bf16 tensor [T, P / 2] the kernels move like any row."""
    return pack_fp8_rows(q, scale_inv, packed_fp8_row_bytes(q.shape[1])).view(torch.bfloat16)


def split_fp8_payload(rows: Tensor, hidden: int) -> tuple[Tensor, Tensor]:
    """``fp8_payload``'s inverse on [..., P / 2] bf16 rows: views (q [..., H] float8_e4m3fn, scale_inv
    [..., H / 128] fp32)."""
    raw = rows.view(torch.uint8)
    scale_end = hidden + 4 * (hidden // FP8_BLOCK)
    return raw[..., :hidden].view(torch.float8_e4m3fn), raw[..., hidden:scale_end].view(torch.float32)


@dataclass(frozen=True)
class PaddedRecv:
    """A low-latency dispatch's receive side in DeepEP's per-expert padded layout (El local experts,
    R * M slots each).

    rows [El, R * M, W]: expert l's received rows in slots [0, count[l]) (the rest uninitialised);
    count [El] int32; src_info [El, R * M] int32: the source token index of each slot; layout_range
    [El, R] int64: ``(begin << 32) | rows`` of each source rank's block of slots; slot [C] int64: the
    padded slot (l * R * M + position) of each of the C expert-major rows, -1 past the rows received."""

    rows: Tensor
    count: Tensor
    src_info: Tensor
    layout_range: Tensor
    slot: Tensor


def padded_layout(recv_rows: Tensor, recv_src: Tensor, tokens_per_expert: Tensor, num_ranks: int,
                  max_tokens: int, topk: int) -> PaddedRecv:
    """Build the padded layout from an expert-major dispatch (``layout="expert"``), without a host sync.

    recv_rows [C, W]: the receive buffer's rows (expert l's rows back to back, source rank ascending, each
    source's in token order; rows past the received count are stale); recv_src [C] int32 source tags
    ``(s * M + t) * K + k``; tokens_per_expert [El]. Source s's rows of expert l form one block, so its
    ``layout_range`` entry is that block's place in the expert's slots (DeepEP fills the blocks in the
    order they arrive; here always in rank order, one of the orders DeepEP can produce).
    """
    cap, width = recv_rows.shape
    el = tokens_per_expert.shape[0]
    dev = recv_rows.device
    slots = num_ranks * max_tokens
    count = tokens_per_expert.to(torch.int64)
    ends = count.cumsum(dim=0)
    rows_idx = torch.arange(cap, device=dev)
    expert = torch.searchsorted(ends, rows_idx, right=True)  # El past the received rows
    valid = expert < el
    expert = expert.clamp(max=el - 1)
    position = rows_idx - (ends - count)[expert]
    slot = torch.where(valid, expert * slots + position, -1)
    target = torch.where(valid, slot, el * slots)  # one spare slot takes the stale rows
    padded = torch.empty((el * slots + 1, width), dtype=recv_rows.dtype, device=dev)
    padded.index_copy_(0, target, recv_rows)
    tags = recv_src.to(torch.int64)
    token = torch.div(tags, topk, rounding_mode="floor") % max_tokens
    source = torch.div(tags, topk * max_tokens, rounding_mode="floor")
    src_info = torch.empty(el * slots + 1, dtype=torch.int32, device=dev)
    src_info.index_copy_(0, target, token.to(torch.int32))
    blocks = torch.zeros(el * num_ranks + 1, dtype=torch.int64, device=dev)
    block = torch.where(valid, expert * num_ranks + source.clamp(0, num_ranks - 1), el * num_ranks)
    blocks.scatter_add_(0, block, torch.ones_like(block))
    blocks = blocks[:-1].view(el, num_ranks)
    begin = blocks.cumsum(dim=1) - blocks
    return PaddedRecv(
        rows=padded[:-1].view(el, slots, width),
        count=tokens_per_expert.to(torch.int32).clone(),
        src_info=src_info[:-1].view(el, slots),
        layout_range=(begin << 32) | blocks,
        slot=slot,
    )


def expert_major_rows(padded: Tensor, slot: Tensor, out: Tensor) -> Tensor:
    """``padded_layout``'s inverse for combine: out[j] = padded[slot[j]] (padded [El, R * M, H] viewed as
    rows), into ``out`` [C, H] (rows with slot -1 get an arbitrary row: combine never reads them)."""
    flat = padded.reshape(-1, padded.shape[-1])
    return torch.index_select(flat, 0, slot.clamp(min=0), out=out)
