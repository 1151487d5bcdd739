"""The normal mode's torch parts: DeepEP's dispatch layout, the row format a token travels in, and the
handle's matrices, all as device-side torch ops (no host sync).

How ``cute_ep.deep_ep`` maps DeepEP's normal dispatch onto the rank layout of ``cute_ep``: every rank in a
token's ``is_token_in_rank`` row gets one row (DeepEP's rule: routing by ``is_token_in_rank``, not by the
ids). So the kernels are given per-rank ids (``rank_routing``): one expert per rank, column r naming
expert r where ``is_token_in_rank[t, r]``; the rank layout then lands the rows source rank first, token
ascending, which is DeepEP's receive order. Whatever else travels with a token (FP8 scales, top-k ids
and weights) rides in the same row (``RowFormat``), moved as raw bytes and split again on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cute_ep.kernels.config import VECTOR_BYTES

__all__ = [
    "RowFormat",
    "copy_bytes",
    "channel_prefix_matrix",
    "dispatch_layout",
    "rank_constants",
    "rank_routing",
    "recv_channel_prefix_matrix",
    "send_head",
    "token_channels",
]

_CARRIER = torch.bfloat16  # the element type the kernels move the bytes of a row as


def dispatch_layout(topk_idx: Tensor, num_experts: int, num_ranks: int) -> tuple[Tensor, Tensor, Tensor]:
    """DeepEP's ``get_dispatch_layout`` in torch: (num_tokens_per_rank [R] int32, num_tokens_per_expert
    [E] int32, is_token_in_rank [T, R] bool) of topk_idx [T, K] (ids in [-1, E); -1: no expert).

    A token counts once for each rank owning one of its experts; every (t, k) pair counts for its expert.
    ``Buffer.get_dispatch_layout`` refuses ids outside [-1, E) where it can without a host sync (CPU
    tensors); any such id that reaches this function is counted nowhere. No host sync.
    """
    t = topk_idx.shape[0]
    dev = topk_idx.device
    el = num_experts // num_ranks
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < num_experts)
    expert_bin = torch.where(valid, ids, num_experts).reshape(-1)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    per_expert.scatter_add_(0, expert_bin, torch.ones_like(expert_bin))
    rank_bin = torch.where(valid, torch.div(ids, el, rounding_mode="floor"), num_ranks)
    in_rank = torch.zeros((t, num_ranks + 1), dtype=torch.bool, device=dev)
    in_rank.scatter_(1, rank_bin, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    per_rank = in_rank.sum(dim=0, dtype=torch.int32)
    return per_rank, per_expert[:num_experts].to(torch.int32), in_rank


def rank_routing(is_token_in_rank: Tensor, constants: tuple[Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor]:
    """The ids and weights the rank layout dispatches with, one expert per rank: ids [T, R] int32 with
    ``ids[t, r] = r`` where ``is_token_in_rank[t, r]``, else -1; weights [T, R] fp32 zeros (unused, never
    written). ``constants``: ``rank_constants`` of this shape, kept by the caller (one tensor operation
    then)."""
    t, world = is_token_in_rank.shape
    ranks, zero_w = constants if constants is not None else rank_constants(t, world, is_token_in_rank.device)
    return torch.where(is_token_in_rank, ranks, -1), zero_w


def rank_constants(tokens: int, world: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """What ``rank_routing`` reads for a [T, R] shape: each column's rank [T, R] int32, zero weights [T, R]
    fp32."""
    ranks = torch.arange(world, dtype=torch.int32, device=device).expand(tokens, world).contiguous()
    return ranks, torch.zeros((tokens, world), dtype=torch.float32, device=device)


def token_channels(num_tokens: Tensor | int, num_channels: int) -> Tensor | int:
    """Tokens per channel in DeepEP's split of a rank's T tokens into ``num_channels`` contiguous ranges:
    ceil(T / channels), at least 1 (token t is in channel t // that)."""
    if isinstance(num_tokens, Tensor):
        per = torch.div(num_tokens + num_channels - 1, num_channels, rounding_mode="floor")
        return torch.clamp(per, min=1)
    return max(1, -(-num_tokens // num_channels))


def channel_prefix_matrix(is_token_in_rank: Tensor, num_channels: int) -> Tensor:
    """[R, channels] int32: for each destination rank, the tokens of channels 0..c bound for it
    (DeepEP's sender-side ``channel_prefix_matrix``, an inclusive prefix over channels)."""
    t, world = is_token_in_rank.shape
    dev = is_token_in_rank.device
    per = token_channels(t, num_channels)
    channel = torch.div(torch.arange(t, device=dev), per, rounding_mode="floor")
    counts = torch.zeros((world, num_channels), dtype=torch.int64, device=dev)
    counts.index_add_(1, channel, is_token_in_rank.t().to(torch.int64))
    return counts.cumsum(dim=1).to(torch.int32)  # a scan along the last dimension (see send_head)


def send_head(is_token_in_rank: Tensor, num_channels: int) -> Tensor:
    """[T, R] int32: DeepEP's ``send_head`` as its dispatch writes it: for a token bound for rank r, the
    number of earlier tokens of its channel bound for r; -1 where it is not bound for r.

    The scans run over [R, T] along the last dimension: torch's scan along the first dimension of a
    [T, R] tensor runs one thread per column, and took ~200 us for T = 4096, R = 4 on an H200 (2026-11-28)."""
    t, world = is_token_in_rank.shape
    dev = is_token_in_rank.device
    bound = is_token_in_rank.t()  # [R, T]
    hits = bound.to(torch.int64)
    before = hits.cumsum(dim=1) - hits  # tokens before t bound for r
    per = token_channels(t, num_channels)
    start = torch.div(torch.arange(t, device=dev), per, rounding_mode="floor") * per
    head = before - before[:, start] if t else before
    return torch.where(bound, head, -1).to(torch.int32).t().contiguous()


def recv_channel_prefix_matrix(src_rank: Tensor, src_token: Tensor, valid: Tensor | None,
                               tokens_per_rank: Tensor, num_channels: int) -> Tensor:
    """[R, channels] int32: DeepEP's receiver-side ``recv_channel_prefix_matrix``: for source rank s and
    channel c, the rows received from s whose token lies in s's channels before c.

    src_rank, src_token [N]: the source of each received row; valid [N] bool: the rows that count (None:
    all of them); tokens_per_rank [R]: every rank's token count (sizes its channels)."""
    world = tokens_per_rank.shape[0]
    dev = src_rank.device
    per = token_channels(tokens_per_rank.to(device=dev, dtype=torch.int64), num_channels)
    src = src_rank.long()
    channel = torch.div(src_token.long(), per[src.clamp(0, world - 1)], rounding_mode="floor")
    bins = src * num_channels + channel.clamp(max=num_channels - 1)
    if valid is not None:
        bins = torch.where(valid, bins, world * num_channels)
    counts = torch.zeros(world * num_channels + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    counts = counts[:-1].view(world, num_channels)
    return (counts.cumsum(dim=1) - counts).to(torch.int32)


def copy_bytes(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` for byte tensors [N, W] (last dimension contiguous, rows any stride apart), moved
    as the widest integers (8, 4 or 2 bytes) that both tensors' widths, row strides and offsets allow. Why:
    a strided copy moves one element per thread step, and as single bytes an FP8 dispatch's three row
    copies took 293 us per call at 4096 tokens on a 4x H200 host (torch.profiler, 2026-11-28)."""
    for wide in (torch.int64, torch.int32, torch.int16):
        n = wide.itemsize
        if all(t.shape[-1] % n == 0 and t.storage_offset() % n == 0 and t.data_ptr() % n == 0
               and all(st % n == 0 for st in t.stride()[:-1]) for t in (dst, src)):
            dst.view(wide).copy_(src.view(wide))
            return
    dst.copy_(src)


@dataclass(frozen=True)
class RowFormat:
    """The bytes one token carries in a normal-mode dispatch, moved as ``elems`` bf16 elements.

    Bytes [0, X) the row of x (any dtype, X = hidden * element size, a multiple of 16), then (FP8 input)
    ``num_scales`` 4-byte scales (fp32 or int32, DeepEP's ``x_scales``), then (with top-k) ``topk`` int32
    global expert ids and ``topk`` fp32 weights, zero bytes up to a multiple of 16. A row of x alone
    travels as it is, viewed as bf16 (``passthrough``: no copy).
    """

    x_dtype: torch.dtype
    hidden: int
    scale_dtype: torch.dtype | None = None
    num_scales: int = 0
    topk: int = 0

    @property
    def x_bytes(self) -> int:
        return self.hidden * self.x_dtype.itemsize

    @property
    def scale_end(self) -> int:
        return self.x_bytes + 4 * self.num_scales

    @property
    def idx_end(self) -> int:
        return self.scale_end + 4 * self.topk

    @property
    def row_bytes(self) -> int:
        raw = self.idx_end + 4 * self.topk
        return -(-raw // VECTOR_BYTES) * VECTOR_BYTES

    @property
    def elems(self) -> int:
        """Elements of the bf16 row that carries the bytes (the kernels' ``hidden``)."""
        return self.row_bytes // 2

    @property
    def passthrough(self) -> bool:
        return self.scale_dtype is None and self.topk == 0 and self.row_bytes == self.x_bytes

    def pack(self, x: Tensor, scales: Tensor | None, topk_idx: Tensor | None,
             topk_weights: Tensor | None) -> Tensor:
        """[T, elems] bf16 rows: x (and the extras this format holds) as raw bytes. x itself (viewed) when
        ``passthrough`` and contiguous."""
        t = x.shape[0]
        if self.passthrough:
            return x.contiguous().view(_CARRIER) if t else x.new_empty((0, self.elems), dtype=_CARRIER)
        if (t and self.row_bytes == self.scale_end and not self.topk and scales.dtype == self.scale_dtype
                and x.is_contiguous() and x.storage_offset() % 4 == 0):
            # FP8 rows and their scales side by side, nothing to zero: one tensor operation instead of three
            # (each costs host time per call), the scales any strides (DeepEP's test passes them
            # column-major)
            return torch.cat((x.view(torch.int32), scales.view(torch.int32)), dim=1).view(_CARRIER)
        rows = torch.empty((t, self.row_bytes), dtype=torch.uint8, device=x.device)
        if t == 0:
            return rows.view(_CARRIER)
        if self.row_bytes > self.idx_end + 4 * self.topk:  # the padding travels too: zero, not stale
            rows[:, self.idx_end + 4 * self.topk :] = 0
        copy_bytes(rows[:, : self.x_bytes], x.contiguous().view(torch.uint8))
        if self.scale_dtype is not None:
            if scales.dtype == self.scale_dtype and scales.is_contiguous():
                copy_bytes(rows[:, self.x_bytes : self.scale_end], scales.view(torch.uint8))
            else:
                rows[:, self.x_bytes : self.scale_end].view(self.scale_dtype).copy_(scales)
        if self.topk:
            rows[:, self.scale_end : self.idx_end].view(torch.int32).copy_(topk_idx)
            rows[:, self.idx_end : self.idx_end + 4 * self.topk].view(torch.float32).copy_(topk_weights)
        return rows.view(_CARRIER)

    def assembly(self, x: Tensor, scales: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """(values, words) the kernels' dispatch puts its rows of this format together from in its launch
        (``EpBuffer.launch_dispatch``'s ``assemble``): FP8 values and their scales, as given (the scales any
        strides); None where ``pack`` makes the rows (no scales, top-k ids, scales of another dtype, x not
        contiguous or not 4-byte aligned, no rows)."""
        if (self.scale_dtype is None or self.topk or scales.dtype != self.scale_dtype or not x.shape[0]
                or not x.is_contiguous() or x.data_ptr() % 4):
            return None
        return x, scales

    def outputs(self, out_rows: int, device: torch.device) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """New tensors for ``out_rows`` received rows, one per part of the row: (x [out_rows, H] x_dtype,
        scales [out_rows, num_scales] or None, ids and weights [out_rows, 8K] uint8 or None)."""
        x = torch.empty((out_rows, self.hidden), dtype=self.x_dtype, device=device)
        scales = both = None
        if self.scale_dtype is not None:
            scales = torch.empty((out_rows, self.num_scales), dtype=self.scale_dtype, device=device)
        if self.topk:
            both = torch.empty((out_rows, 8 * self.topk), dtype=torch.uint8, device=device)
        return x, scales, both

    @staticmethod
    def delivery(rows: int, outputs: tuple[Tensor, Tensor | None, Tensor | None]
                 ) -> tuple[int, tuple[Tensor, ...]]:
        """``EpBuffer.launch_dispatch``'s ``deliver`` for ``outputs``: the first ``rows`` received rows into
        the tensors there are, in row order."""
        return rows, tuple(t for t in outputs if t is not None)

    def ids_and_weights(self, both: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The global ids [N, K] int32 and weights [N, K] fp32 in ``outputs``' third tensor (views)."""
        if both is None:
            return None, None
        k = self.topk
        return both[:, : 4 * k].view(torch.int32), both[:, 4 * k :].view(torch.float32)

    def unpack(self, rows: Tensor, out_rows: int, outputs: tuple | None = None
               ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """From received rows [n, elems] bf16 (n <= out_rows; rows past n are left uninitialised, as DeepEP
        leaves its padding), copied by torch (the kernels' buffers copy them in the dispatch's launch:
        ``EpBuffer.launch_dispatch``'s ``deliver`` into ``outputs``): (x [out_rows, H] x_dtype, scales
        [out_rows, num_scales] or None, global ids [out_rows, K] int32 or None, weights [out_rows, K] fp32
        or None). x and scales are new tensors (``outputs``' when given); the ids and weights are views of one
        new tensor holding both (rows 8K bytes apart: two tensor operations instead of four)."""
        n = rows.shape[0]
        raw = rows.view(torch.uint8)
        x, scales, both = outputs if outputs is not None else self.outputs(out_rows, rows.device)
        copy_bytes(x.view(torch.uint8)[:n], raw[:, : self.x_bytes])
        if scales is not None:
            copy_bytes(scales[:n].view(torch.uint8), raw[:, self.x_bytes : self.scale_end])
        if both is not None:
            copy_bytes(both[:n], raw[:, self.scale_end : self.idx_end + 4 * self.topk])
        return x, scales, *self.ids_and_weights(both)
