"""One compiled module holding the layout, dispatch (+ fan-out) and combine kernels (pull, or the
reduced combine's two phases) of one element type.

Why one module: each module that calls NVSHMEM must be registered with ``nvshmem.core.library_init``,
and on the lent 4x H200 a process faulted ("illegal memory access") once a 4th registered module was
alive; compiling one also takes tens of seconds (NVSHMEM's device library is linked in). With all
three kernels behind one host entry point (``op`` picks the launch) and every size a run-time
argument, one registration per dtype serves every configuration.

All arguments are raw device pointers plus sizes, so a call builds no DLPack views: tensors and their
layouts are made inside the jitted function.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_ep.kernels.combine import CombineKernel
from cute_ep.kernels.config import (
    COMBINE_REDUCED,
    FAULT_WORDS,
    FP8_BLOCK,
    OP_COMBINE,
    OP_DISPATCH,
    OP_LAYOUT,
    REDUCED_GRID_FACTOR,
    VECTOR_BYTES,
    EpConfig,
    cute_dtype,
)
from cute_ep.kernels.dispatch import DispatchKernel
from cute_ep.kernels.fanout import FanoutKernel
from cute_ep.kernels.layout import LayoutKernel
from cute_ep.kernels.partial_sum import PartialSumKernel
from cute_ep.kernels.reduce_push import ReducePushKernel

# Order of the pointer arguments of ``EpModule.__call__`` (the host side passes them in this order).
POINTER_ARGS = (
    "x",  # [T, H] dtype: tokens to dispatch (layout/dispatch)
    "topk_idx",  # [T, K] int32
    "topk_w",  # [T, K] fp32
    "scatter",  # [T, K] int32: slot of each pair in its owner's receive buffer
    "out",  # [T, H] dtype: combine output
    "recv_x",  # symmetric [C, H] dtype
    "recv_y",  # symmetric [C, H] dtype: expert outputs read by combine
    "recv_w",  # symmetric [C] fp32
    "recv_src",  # symmetric [C] int32
    "recv_from",  # symmetric [C] int32: slot a de-duplicated row arrived in (-1: none; <= -2: group primary)
    "recv_group",  # symmetric [C * K] int32: each primary slot's later group members (reduced combine)
    "counts",  # symmetric [R, E] int32
    "signals",  # symmetric [3, R] uint64: count, dispatch, combine
    "stage",  # symmetric [stage_rows, H] dtype
    "partials",  # symmetric [M * R, H] dtype: reduced combine's partial rows (row t * R + source rank)
    "send_offsets",  # [E] int32
    "cursor",  # [E] int32
    "send_limit",  # [E] int32: end of each expert's kept slots (capacity)
    "dropped",  # [E] int32: rows dropped beyond expert capacity, accumulated until the host resets it
    "packed",  # [M, P] bytes: this rank's packed FP8 rows (P = cfg.fp8_row_bytes)
    "tokens_per_expert",  # [E/R] int32
    "num_recv",  # [1] int32
    "epochs",  # [3] int64
    "done",  # [3] int32: arrival counters (dispatch, combine, reduced combine's phase 1)
    "fault",  # [4] int32: first timed-out wait (kernels.ptx.record_fault)
)


class EpModule:
    """Host entry point: ``op`` (OP_LAYOUT / OP_DISPATCH / OP_COMBINE) selects the kernel launched."""

    def __init__(self, dtype) -> None:
        self.dtype = dtype
        self.layout = LayoutKernel(dtype)
        self.dispatch = DispatchKernel(dtype)
        self.fanout = FanoutKernel(dtype)
        self.combine = CombineKernel(dtype)
        self.reduce_push = ReducePushKernel(dtype)
        self.partial_sum = PartialSumKernel(dtype)

    @cute.jit
    def __call__(
        self,
        op: Int32,
        mode: Int32,
        fp8: Int32,
        algo: Int32,
        calgo: Int32,
        rank: Int32,
        num_tokens: Int32,
        world_size: Int32,
        local_world_size: Int32,
        num_experts: Int32,
        topk: Int32,
        hidden: Int32,
        max_tokens: Int32,
        capacity: Int32,
        expert_capacity: Int32,
        stage_rows: Int32,
        num_ctas: Int32,
        timeout_ms: Int32,
        x: cute.Pointer,
        topk_idx: cute.Pointer,
        topk_w: cute.Pointer,
        scatter: cute.Pointer,
        out: cute.Pointer,
        recv_x: cute.Pointer,
        recv_y: cute.Pointer,
        recv_w: cute.Pointer,
        recv_src: cute.Pointer,
        recv_from: cute.Pointer,
        recv_group: cute.Pointer,
        counts: cute.Pointer,
        signals: cute.Pointer,
        stage: cute.Pointer,
        partials: cute.Pointer,
        send_offsets: cute.Pointer,
        cursor: cute.Pointer,
        send_limit: cute.Pointer,
        dropped: cute.Pointer,
        packed: cute.Pointer,
        tokens_per_expert: cute.Pointer,
        num_recv: cute.Pointer,
        epochs: cute.Pointer,
        done: cute.Pointer,
        fault: cute.Pointer,
        stream,
    ):
        H, K, E, R, C = hidden, topk, num_experts, world_size, capacity
        rows = lambda p, n: cute.make_tensor(p, cute.make_layout((n, H), stride=(H, 1)))  # noqa: E731
        flat = lambda p, n: cute.make_tensor(p, cute.make_layout(n))  # noqa: E731
        pairs = num_tokens * K

        t_x = rows(x, num_tokens)
        t_out = rows(out, num_tokens)
        t_idx = flat(topk_idx, pairs)
        t_w = flat(topk_w, pairs)
        t_scatter = flat(scatter, pairs)
        t_recv_x = rows(recv_x, C)
        t_recv_y = rows(recv_y, C)
        t_recv_w = flat(recv_w, C)
        t_recv_src = flat(recv_src, C)
        t_recv_from = flat(recv_from, C)
        t_recv_group = flat(recv_group, C * K)
        t_counts = flat(counts, R * E)
        t_signals = flat(signals, 3 * R)
        t_stage = rows(stage, stage_rows)
        t_partials = rows(partials, max_tokens * R)
        t_send_offsets = flat(send_offsets, E)
        t_cursor = flat(cursor, E)
        t_send_limit = flat(send_limit, E)
        t_dropped = flat(dropped, E)
        P = (H + 4 * (H // FP8_BLOCK) + VECTOR_BYTES - 1) // VECTOR_BYTES * VECTOR_BYTES  # cfg.fp8_row_bytes
        t_packed = cute.make_tensor(packed, cute.make_layout((max_tokens, P), stride=(P, 1)))
        row_bytes = H * (self.dtype.width // 8)
        if fp8 != 0:
            row_bytes = P
        t_tpe = flat(tokens_per_expert, E // R)
        t_num_recv = flat(num_recv, 1)
        t_epochs = flat(epochs, 3)
        t_done = flat(done, 3)
        t_fault = flat(fault, FAULT_WORDS)

        if op == OP_LAYOUT:
            self.layout(
                t_idx, t_scatter, t_counts, t_signals, t_send_offsets, t_cursor, t_send_limit, t_dropped,
                t_tpe, t_num_recv, t_epochs, t_fault, rank, num_tokens, world_size, num_experts, topk,
                expert_capacity, timeout_ms, stream,
            )
        if op == OP_DISPATCH:
            self.dispatch(
                t_x, t_idx, t_w, t_scatter, t_cursor, t_send_limit, t_packed, t_recv_x, t_recv_w, t_recv_src,
                t_recv_from, t_recv_group, t_signals, t_epochs, t_done, t_fault, rank, num_tokens, mode, fp8,
                algo, calgo, world_size, local_world_size, num_experts, topk, max_tokens, num_ctas,
                timeout_ms, stream,
            )
            # Same stream, right after: copy the de-duplicated rows to their other slots.
            self.fanout(t_recv_x, t_recv_from, t_num_recv, t_fault, row_bytes, num_ctas, stream)
        if op == OP_COMBINE:
            if calgo == COMBINE_REDUCED:
                # Two launches on one stream: every rank's partial rows are out before any is summed.
                self.reduce_push(
                    t_recv_y, t_recv_w, t_recv_src, t_recv_from, t_recv_group, t_partials, t_stage,
                    t_signals, t_epochs, t_done, t_fault, t_num_recv, rank, world_size, local_world_size,
                    topk, max_tokens, num_ctas * REDUCED_GRID_FACTOR, timeout_ms, stream,
                )
                self.partial_sum(
                    t_out, t_idx, t_scatter, t_partials, t_signals, t_epochs, t_done, t_fault, rank,
                    num_tokens, world_size, num_experts, topk, num_ctas * REDUCED_GRID_FACTOR, timeout_ms,
                    stream,
                )
            else:
                self.combine(
                    t_out, t_idx, t_w, t_scatter, t_recv_y, t_stage, t_signals, t_epochs, t_done, t_fault,
                    rank, num_tokens, world_size, local_world_size, num_experts, topk, hidden, num_ctas,
                    timeout_ms, stream,
                )


def pointer_dtypes(cfg: EpConfig) -> dict:
    """CuTe element type and assumed alignment (bytes) of each pointer argument."""
    row = cute_dtype(cfg.dtype)
    return {
        "x": (row, 16),
        "topk_idx": (cutlass.Int32, 4),
        "topk_w": (cutlass.Float32, 4),
        "scatter": (cutlass.Int32, 4),
        "out": (row, 16),
        "recv_x": (row, 16),
        "recv_y": (row, 16),
        "recv_w": (cutlass.Float32, 4),
        "recv_src": (cutlass.Int32, 4),
        "recv_from": (cutlass.Int32, 4),
        "recv_group": (cutlass.Int32, 4),
        "counts": (cutlass.Int32, 4),
        "signals": (cutlass.Uint64, 8),
        "stage": (row, 16),
        "partials": (row, 16),
        "send_offsets": (cutlass.Int32, 4),
        "cursor": (cutlass.Int32, 4),
        "send_limit": (cutlass.Int32, 4),
        "dropped": (cutlass.Int32, 4),
        "packed": (cutlass.Uint8, 16),
        "tokens_per_expert": (cutlass.Int32, 4),
        "num_recv": (cutlass.Int32, 4),
        "epochs": (cutlass.Int64, 8),
        "done": (cutlass.Int32, 4),
        "fault": (cutlass.Int32, 4),
    }
