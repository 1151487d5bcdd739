"""The interface every backend implements: ``EpBackend``, and the types it returns.

Three backends implement it: ``cute_ep.buffer.EpBuffer`` (the CuTe kernels on NVSHMEM, GPU),
``cute_ep.reference_backend.ReferenceEpBuffer`` (the torch references over gloo, CPU) and
``cute_ep.a2a_backend.A2aEpBuffer`` (``all_to_all_single``: NCCL on GPUs, gloo on CPUs). Their results
are bit-identical for the same inputs (scatter mode); ``tests/test_backend_protocol.py`` checks that
their public signatures match this protocol. Importing this module imports no GPU library.

Shapes: T tokens on this rank (T <= cfg.max_tokens, may be 0), H = cfg.hidden, K = cfg.topk,
E = cfg.num_experts, El = E / R experts per rank, N = num_recv rows received by this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from cute_ep.kernels.config import EpConfig

__all__ = ["BackendBase", "DispatchHandle", "DispatchResult", "EpBackend"]


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs from a dispatch: the routing and the slot of every (token, k).

    topk_idx [T, K] int32: expert of each pair (-1: none); topk_weights [T, K] fp32; scatter [T, K]
    int32: slot of each pair in its expert's rank's receive buffer (-1: none, or dropped beyond expert
    capacity); num_tokens T; mode "scatter" | "atomic".
    """

    topk_idx: Tensor
    topk_weights: Tensor
    scatter: Tensor
    num_tokens: int
    mode: str


@dataclass(frozen=True)
class DispatchResult:
    """What a dispatch delivered to this rank (views valid until the next dispatch).

    recv_x [N, H] cfg.dtype: the received rows, expert-major (local expert 0's rows first; inside an
        expert, source rank 0's rows first, each source's in (t, k) order in scatter mode). After an FP8
        dispatch: torch.float8_e4m3fn (a strided view: rows are ``cfg.fp8_row_bytes`` apart).
    recv_weights [N] fp32: the weight of each row's (token, k).
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
    """

    recv_x: Tensor
    recv_weights: Tensor
    recv_src: Tensor
    tokens_per_expert: Tensor
    num_recv: int
    handle: DispatchHandle
    recv_scales: Tensor | None = None
    recv_count: Tensor | None = None
    event: Any = None


@runtime_checkable
class EpBackend(Protocol):
    """Expert-parallel dispatch and combine over one group of ranks (see the module docstring).

    Every call is collective: every rank makes the same sequence of calls with the same options.
    """

    cfg: EpConfig
    rank: int

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, mode: str = "scatter",
                 fp8: bool = False, algorithm: str | None = None, sync: bool = True) -> DispatchResult:
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
                capacity drops raise here). False: no host sync at all (usable in CUDA graphs):
                the views cover ``cfg.capacity`` rows, ``recv_count`` holds the count on the device,
                and errors or drops raise at the next host-visible check (``check_capacity``, or the
                GPU buffer's ``check_ran``).

        Returns:
            ``DispatchResult``.

        Raises:
            ValueError: an input violates a constraint (the message names it and the value), on every
                rank (a peer's invalid inputs too).
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
            y: [N, H] cfg.dtype, this rank's expert outputs in ``recv_x``'s row order.
            handle: ``DispatchResult.handle`` of the dispatch whose rows y holds.
            algorithm: "pull" (out[t] = sum over k ascending of w[t, k] * y_owner[slot(t, k)], fp32,
                bit-identical to ``cute_ep.reference.reference_combine``) or "reduced" (per expert
                rank partial sums rounded to cfg.dtype, then summed: ``reference_combine_reduced``;
                needs ``EpConfig(combine_algorithm="reduced")``); None: ``cfg.combine_algorithm``.
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
    ``recv_src`` and ``cfg``."""

    cfg: EpConfig
    recv_x: Tensor
    recv_y: Tensor
    recv_w: Tensor
    recv_src: Tensor

    def poison(self) -> None:
        """Fill the receive buffers with NaN / -1 so that a row nobody wrote cannot pass a check."""
        self.recv_x.fill_(float("nan"))
        self.recv_y.fill_(float("nan"))
        self.recv_w.fill_(float("nan"))
        self.recv_src.fill_(-1)

    def _check_num_recv(self, num_recv: int) -> None:
        if not 0 <= num_recv <= self.cfg.capacity:
            raise ValueError(f"num_recv must be in [0, capacity={self.cfg.capacity}], got {num_recv}")

    def __enter__(self) -> Any:
        return self

