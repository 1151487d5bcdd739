"""The interface every backend implements: ``EpBackend``, and the types it returns.

Three backends implement it: ``cute_ep.buffer.EpBuffer`` (the CuTe kernels on NVSHMEM, GPU),
``cute_ep.reference_backend.ReferenceEpBuffer`` (the torch references over gloo, CPU) and
``cute_ep.a2a_backend.A2aEpBuffer`` (``all_to_all_single``: NCCL on GPUs, gloo on CPUs). Their results
are bit-identical for the same inputs (scatter mode); ``tests/test_backend_protocol.py`` checks that
their public signatures match this protocol. Importing this module imports no GPU library.

Shapes: T tokens on this rank (T <= cfg.max_tokens, may be 0), H = cfg.hidden, K = cfg.topk,
E = cfg.num_experts, El = E / R experts per rank, N = num_recv rows received by this rank.

Two receive layouts (``dispatch(..., layout=...)``, ``LAYOUTS``):

* ``"expert"`` (default): one row per kept (token, k), expert-major (each local expert's rows back to
  back, ready for a grouped GEMM); combine takes one expert output per row and applies the weights.
* ``"rank"`` (DeepEP's): one row per (source rank s, token t of s) that names at least one expert of
  this rank, ordered by s, then t; ``recv_topk_idx`` / ``recv_topk_weights`` say which local experts
  the row is for. Combine takes one row per received row, already reduced over this rank's experts
  and weighted by the caller, and sums a token's rows over its destination ranks in ascending rank
  order (fp32 from 0.0, one rounding to cfg.dtype; no weights applied). Needs
  ``cfg.capacity_factor == 0``; FP8 works as in the expert layout. Torch references:
  ``cute_ep.reference.reference_dispatch_rank_layout`` / ``reference_combine_rank_layout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from cute_ep.kernels.config import EpConfig
from cute_ep.kernels.variants import LAYOUTS as KERNEL_LAYOUTS

__all__ = ["LAYOUTS", "BackendBase", "DispatchHandle", "DispatchResult", "EpBackend"]

LAYOUTS = tuple(KERNEL_LAYOUTS)  # ("expert", "rank"), in the kernels' code order
"""The receive layouts ``dispatch(..., layout=...)`` accepts (module docstring)."""


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs from a dispatch: the routing and the slot of every (token, k).

    topk_idx [T, K] int32: expert of each pair (-1: none); topk_weights [T, K] fp32; scatter [T, K]
    int32: slot of each pair in its expert's rank's receive buffer (-1: none, or dropped beyond expert
    capacity); num_tokens T; mode "scatter" | "atomic"; layout "expert" | "rank", the dispatch's
    receive layout. In the rank layout ``scatter[t, k]`` is the row of token t on the rank owning
    expert ``topk_idx[t, k]`` (every k of one token bound for one rank holds the same row), -1 where
    the id is -1.
    """

    topk_idx: Tensor
    topk_weights: Tensor
    scatter: Tensor
    num_tokens: int
    mode: str
    layout: str = "expert"  # appended: positional constructions of the five fields above still work


@dataclass(frozen=True)
class DispatchResult:
    """What a dispatch delivered to this rank (views valid until the next dispatch).

    Expert layout (``layout="expert"``, the default):

    recv_x [N, H] cfg.dtype: the received rows, expert-major (local expert 0's rows first; inside an
        expert, source rank 0's rows first, each source's in (t, k) order in scatter mode). After an FP8
        dispatch: torch.float8_e4m3fn (a strided view: rows are ``cfg.fp8_row_bytes`` apart).
    recv_weights [N] fp32: the weight of each row's (token, k). None in the rank layout.
    recv_src [N] int32: the source tag of each row, (source rank * cfg.max_tokens + t) * K + k.
    tokens_per_expert [El] int32: rows of each local expert, back to back in recv_x.
    num_recv: N. After ``dispatch(..., sync=False)`` N is ``cfg.capacity`` (the worst case: the views
        cover every row a rank can receive, and the rows past the real count hold stale data).
    handle: the ``DispatchHandle`` combine takes.
    recv_scales [N, H / 128] fp32 after an FP8 dispatch (row i, block b of 128 columns is
        ``recv_x[i, 128 b : 128 (b + 1)].float() * recv_scales[i, b]``), else None.
    recv_count [1] int32 on the device: the rows really received (without ``sync`` the only place the
        count is; ``tokens_per_expert`` is exact either way).
    event: with ``EpBuffer.dispatch(..., stream=s)``, an event recorded on ``s`` after the dispatch
        (wait on it before using the results on another stream); else None.
    recv_topk_idx, recv_topk_weights: None.

    Rank layout (``layout="rank"``): one row per (source rank s, token t of s) naming at least one
    expert of this rank, source rank ascending, then t ascending (in either mode).

    recv_x [N, H] cfg.dtype: x_s[t]. After an FP8 dispatch: torch.float8_e4m3fn, x_s[t] quantized once
        by its sender (rows ``cfg.fp8_row_bytes`` apart, as in the expert layout), with ``recv_scales``.
    recv_weights: None (the weights are per (row, k): ``recv_topk_weights``).
    recv_src [N] int32: s * cfg.max_tokens + t (no k: one row serves every k of the token).
    tokens_per_expert [El] int32: rows naming each local expert (they are not contiguous).
    num_recv: N <= ``cfg.rank_capacity`` (= R * M); after ``sync=False``, ``cfg.rank_capacity``, with
        ``recv_count`` holding N as in the expert layout.
    recv_topk_idx [N, K] int32: local expert id ``e - rank * El`` where ``topk_idx_s[t, k] = e`` is an
        expert of this rank, else -1 (position k kept).
    recv_topk_weights [N, K] fp32: ``topk_weights_s[t, k]`` where recv_topk_idx >= 0, else 0.0.
    recv_scales [N, H / 128] fp32 after an FP8 dispatch (as above), else None.
    handle, recv_count, event: as above.
    """

    recv_x: Tensor
    recv_weights: Tensor | None
    recv_src: Tensor
    tokens_per_expert: Tensor
    num_recv: int
    handle: DispatchHandle
    recv_scales: Tensor | None = None
    recv_count: Tensor | None = None
    event: Any = None
    # Appended (rank layout only), so positional constructions of the fields above still work.
    recv_topk_idx: Tensor | None = None
    recv_topk_weights: Tensor | None = None


@runtime_checkable
class EpBackend(Protocol):
    """Expert-parallel dispatch and combine over one group of ranks (see the module docstring).

    Every call is collective: every rank makes the same sequence of calls with the same options.
    """

    cfg: EpConfig
    rank: int

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, mode: str = "scatter",
                 fp8: bool = False, algorithm: str | None = None, sync: bool = True,
                 layout: str = "expert") -> DispatchResult:
        """Send every (token, k) row to the rank owning expert ``topk_idx[t, k]``.

        Args:
            x: [T, H] cfg.dtype, contiguous, on this rank's device.
            topk_idx: [T, K] int32 or int64 in [-1, E); -1 drops the pair; a token names an expert once.
            topk_weights: [T, K] float32.
            mode: "scatter" (deterministic slots) or "atomic" (slots taken with an atomic add on the
                sender: the same ranges, the order inside an (expert, source) group varies).
            fp8: send e4m3 rows with one fp32 scale per 128 columns (needs H % 128 == 0).
            algorithm: the dispatch primitive ("dedup", "per_pair", "put_warp"; None: the buffer's).
                Primitives differ only in how rows travel, never in the result.
            sync: True: read the received row count back to the host (``num_recv`` exact; errors and
                capacity drops known by then raise here; the GPU buffer returns once the count is known, its
                rows may still be moving: the stream orders their later use). False: no host sync at all
                (usable in CUDA graphs): the views cover ``cfg.capacity`` rows, ``recv_count`` holds the count
                on the device, and errors or drops raise at the next host-visible check (``check_capacity``,
                or the GPU buffer's ``check_ran``). In the rank layout the views cover ``cfg.rank_capacity``
                rows.
            layout: "expert" (expert-major rows, one per (token, k)) or "rank" (one row per (token,
                destination rank), DeepEP's; needs ``cfg.capacity_factor == 0``; with ``fp8`` its
                rows are the packed FP8 rows of the expert layout); the same on every rank. See the
                module docstring and ``DispatchResult``.

        Returns:
            ``DispatchResult``.

        Raises:
            ValueError: an input violates a constraint (the message names it and the value), on every
                rank (a peer's invalid inputs too); an unknown layout, or layout="rank" with a capacity
                factor.
            CapacityExceeded: rows were dropped beyond ``cfg.expert_capacity`` and ``cfg.on_overflow``
                is "raise" (carries the complete result), on every rank alike.
        """
        ...

    def expert_output(self, num_recv: int) -> Tensor:
        """The [num_recv, H] cfg.dtype buffer combine reads: experts writing here save a copy."""
        ...

    def combine(self, y: Tensor, handle: DispatchHandle, algorithm: str | None = None) -> Tensor:
        """The top-k weighted sum of each token's expert outputs: a new [T, H] cfg.dtype tensor.

        Args:
            y: [N, H] cfg.dtype, this rank's expert outputs in ``recv_x``'s row order. For a rank-layout
                handle: one row per received row, already reduced over this rank's experts and
                weighted by the caller. N is the ``num_recv`` of the dispatch that made ``handle``, or
                the rows the views of ``dispatch(sync=False)`` cover (``cfg.capacity``; in the rank
                layout ``cfg.rank_capacity``). After ``dispatch(sync=False)`` the count the kernels wrote is
                read (one host sync) only when y has fewer rows than the views; while a CUDA graph is
                being captured only the views' row count is accepted. Any other count raises
                ``ValueError`` naming both.
            handle: ``DispatchResult.handle`` of the dispatch whose rows y holds.
            algorithm: "pull" (out[t] = sum over k ascending of w[t, k] * y_owner[slot(t, k)], fp32,
                bit-identical to ``cute_ep.reference.reference_combine``) or "reduced" (per expert
                rank partial sums rounded to cfg.dtype, then summed: ``reference_combine_reduced``;
                needs ``EpConfig(combine_algorithm="reduced")``); None: ``cfg.combine_algorithm``.
                A rank-layout handle takes None only (``ValueError`` otherwise): out[t] = the sum
                over t's destination ranks r ascending of y_r[row of t on r], fp32 from 0.0, rounded
                to cfg.dtype once, zeros for a token without destination, no weights
                (``cute_ep.reference.reference_combine_rank_layout``).
        """
        ...

    def poison(self) -> None:
        """Fill the receive buffers with NaN / -1 so that a row nobody wrote cannot pass a check."""
        ...

    def dropped_rows(self) -> Tensor:
        """[E] int64 on the CPU: rows dropped per global expert since the last report; resets it."""
        ...

    def check_capacity(self, result: Any = None) -> None:
        """With on_overflow="raise": raise ``CapacityExceeded`` if rows were dropped since the last report."""
        ...

    def close(self) -> None:
        """Release the buffers (collective). Safe to call twice."""
        ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: object, *exc: object) -> None: ...


class BackendBase:
    """What the backends share word for word: poisoning the receive buffers, the range check of
    ``expert_output`` and the context-manager entry. Subclasses own ``recv_x``, ``recv_y``, ``recv_w``,
    ``recv_src``, ``recv_topk_idx``, ``recv_topk_w`` and ``cfg``."""

    cfg: EpConfig
    recv_x: Tensor
    recv_y: Tensor
    recv_w: Tensor
    recv_src: Tensor
    recv_topk_idx: Tensor
    recv_topk_w: Tensor

    def poison(self) -> None:
        """Fill the receive buffers with NaN / -1 so that a row nobody wrote cannot pass a check. The rank
        layout's ``recv_topk_idx`` gets -1 (a received row always names a local expert, so an all -1 row
        is never a real one) and ``recv_topk_w`` NaN."""
        self.recv_x.fill_(float("nan"))
        self.recv_y.fill_(float("nan"))
        self.recv_w.fill_(float("nan"))
        self.recv_src.fill_(-1)
        self.recv_topk_idx.fill_(-1)
        self.recv_topk_w.fill_(float("nan"))

    def _check_num_recv(self, num_recv: int) -> None:
        if not 0 <= num_recv <= self.cfg.capacity:
            raise ValueError(f"num_recv must be in [0, capacity={self.cfg.capacity}], got {num_recv}")

    def __enter__(self) -> Any:
        return self

