"""``ReferenceEpBuffer``: the public API of ``cute_ep.buffer.EpBuffer``, computed on the CPU.

    with Runtime(env, backend="gloo") as runtime:
        buf = ReferenceEpBuffer(runtime, cfg)          # collective: every rank, same cfg
        res = buf.dispatch(x, topk_idx, topk_weights)  # same DispatchResult as the GPU buffer
        y = buf.expert_output(res.num_recv)            # write the experts' outputs here
        out = buf.combine(y, res.handle)               # [T, H]
        buf.close()

Every call all-gathers the inputs of all ranks (``all_gather_object`` on ``runtime.cpu_group``, or
nothing in a world of one without a process group) and evaluates the pure-torch references of
:mod:`cute_ep.reference` for this rank. The results are the references themselves, so a
run with this backend passes the checks by construction: it exists to exercise the whole flow of a
script (arguments, launch, checks, baselines) without GPUs, and to make baselines on a CPU that a
GPU run must match bit for bit.

Mode "atomic" imitates the kernels' non-deterministic slot allocation: inside every (local expert,
source) group the rows are shuffled with a generator seeded by the number of dispatch calls so far
(identical on every rank, since dispatch is collective), and the handle's ``scatter`` holds the
slots where each (token, k) really went, so combine still finds its rows.

Expert capacity (``cfg.capacity_factor`` > 0): the gathered routing is first reduced to the effective
routing of :func:`cute_ep.capacity.apply_expert_capacity` (both modes keep the same pairs);
dropped pairs get slot -1 in the handle and combine skips them. The drops are counted
(``dropped_rows``) and, with ``cfg.on_overflow == "raise"``, raised after the result is complete.

FP8 (``dispatch(..., fp8=True)``, either layout): every rank quantizes its own rows and gathers the
packed rows (:mod:`cute_ep.fp8`), which the references then place like any rows; the receiver gets e4m3
``recv_x`` and fp32 ``recv_scales``.

Combine algorithm (``cfg.combine_algorithm``, or ``combine(..., algorithm=...)``): "pull" evaluates
``reference_combine``, "reduced" ``reference_combine_reduced`` (allowed only on a "reduced" config).

Rank layout (``dispatch(..., layout="rank")``): ``reference_rank_layout`` and
``reference_dispatch_rank_layout`` give this rank's rows (one per (source rank, token) naming one of
its experts; with fp8 the packed rows), their per-k local ids and weights, and the handle's rows;
combine of such a handle evaluates ``reference_combine_rank_layout`` (no algorithm). Both modes give the
same rows there.

It imports torch and plain-Python parts of the library only (the references, ``cute_ep.api``,
``cute_ep.input_checks``, ``cute_ep.kernels.config``): no CUDA, CuTe DSL, NVSHMEM or GPU buffer
(``tests/test_backend_protocol.py`` checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.api import DispatchHandle, DispatchResult
from cute_ep.capacity import apply_expert_capacity, effective_topk_from_scatter
from cute_ep.collectives import all_gather_objects
from cute_ep.host_buffer import HostEpBuffer
from cute_ep.input_checks import (
    check_combine_input,
    check_combine_layout,
    check_dispatch_call,
    resolve_combine_algorithm,
)
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    COMBINE_REFERENCES,
    Layout,
    reference_combine_rank_layout,
    reference_dispatch_rank,
    reference_dispatch_rank_layout,
    reference_layout,
    reference_rank_layout,
)

__all__ = ["ReferenceEpBuffer"]

_ATOMIC_SEED_SALT = 0x5EED_A70



class ReferenceEpBuffer(HostEpBuffer):
    """Same public API as ``cute_ep.buffer.EpBuffer``, computed with the torch references over gloo.

    runtime: a started ``cute_ep.bootstrap.runtime.Runtime`` (backend "gloo"; anything with ``env``,
             ``device`` and ``cpu_group`` attributes works, e.g. in a world of one).
    cfg:     the ``EpConfig``; world_size must match the runtime's.

    Receive buffers are grown on demand up to ``cfg.capacity`` rows instead of being allocated at
    full capacity, so large configurations stay affordable on a CPU.
    """

    def __init__(self, runtime: Any, cfg: EpConfig) -> None:
        super().__init__(runtime, cfg)
        self._calls = 0  # dispatch calls so far: seeds the atomic-mode shuffle
        self._num_recv = 0

    @property
    def group(self) -> Any:
        """The group of the all-gathers: ``cpu_group``, read from the runtime at every use (None once closed),
        so that a buffer outliving its runtime does not keep the process group alive."""
        return self.cpu_group

    # -- public API ------------------------------------------------------------------------------

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, mode: str = "scatter",
                 fp8: bool = False, algorithm: str | None = None, sync: bool = True,
                 layout: str = "expert") -> DispatchResult:
        """Send every (token, k) row to the rank owning expert ``topk_idx[t, k]`` (arguments:
        ``cute_ep.api.EpBackend.dispatch``).

        x [T, H] cfg.dtype, topk_idx [T, K] int32/int64 in [-1, E), topk_weights [T, K] fp32. mode "scatter" |
        "atomic"; fp8: send block-scaled e4m3 rows (needs H % 128 == 0; same on every rank); algorithm: a GPU
        dispatch primitive's name, checked and otherwise ignored (primitives differ only in how rows travel).
        Returns a ``cute_ep.api.DispatchResult`` (recv_x float8_e4m3fn and recv_scales [num_recv, H / 128]
        fp32 with fp8). Collective: every rank calls it. Invalid inputs on any rank raise on every rank (the
        rank at fault gets the EpBuffer message). Rows dropped beyond ``cfg.expert_capacity`` raise
        ``CapacityExceeded`` (carrying the result) if ``cfg.on_overflow == "raise"``. layout: "expert"
        or "rank" (``reference_dispatch_rank_layout``; no capacity factor), the same on every rank.
        """
        self._check_open()
        c = self.cfg
        error = None
        try:
            x, idx, w = check_dispatch_call(c, self.device, x, topk_idx, topk_weights, mode=mode, fp8=fp8,
                                            algorithm=algorithm, layout=layout)  # fmt: skip
            # With fp8 the sender quantizes and only the packed rows travel (as on the GPU).
            rows = self._sent_rows(x.detach(), fp8)
            payload = (None, mode, fp8, layout, rows.cpu(), idx.cpu(), w.detach().cpu())
        except ValueError as exc:
            error = str(exc)
            payload = (error, mode, fp8, layout, None, None, None)
        gathered = self._all_gather(payload)
        if error is not None:
            raise ValueError(error)
        bad = [f"rank {r}: {g[0]}" for r, g in enumerate(gathered) if g[0] is not None]
        if bad:
            raise ValueError("dispatch: invalid inputs on another rank: " + "; ".join(bad))
        modes = [g[1] for g in gathered]
        if any(m != mode for m in modes):
            raise ValueError(f"dispatch: every rank must use the same mode, got {modes}")
        flags = [g[2] for g in gathered]
        if any(f != fp8 for f in flags):
            raise ValueError(f"dispatch: every rank must pass the same fp8 flag, got {flags} (by rank)")
        layouts = [g[3] for g in gathered]
        if any(v != layout for v in layouts):
            raise ValueError(f"dispatch: every rank must use the same layout, got {layouts} (by rank)")

        xs, idxs, ws = [g[4] for g in gathered], [g[5] for g in gathered], [g[6] for g in gathered]
        if layout == "rank":
            return self._dispatch_rank_layout(xs, idxs, ws, idx, w, mode, fp8, sync)
        # Capacity: the layout is that of the effective routing (dropped pairs set to -1).
        idxs, dropped = apply_expert_capacity(idxs, c.num_experts, c.expert_capacity)
        layout = reference_layout(idxs, c.num_experts)
        # Cannot happen with cfg.capacity >= cfg.required_capacity (EpConfig enforces it); kept for a
        # configuration whose capacity was forced lower.
        over = [(d, int(n)) for d, n in enumerate(layout.num_recv.tolist()) if n > c.capacity]
        if over:
            raise ValueError(
                f"dispatch: rank(s) {[d for d, _ in over]} would receive {[n for _, n in over]} rows, "
                f"more than the capacity {c.capacity}"
            )
        expected = reference_dispatch_rank(xs, idxs, ws, layout, c.max_tokens, self.rank)
        scatter = layout.scatter[self.rank].to(torch.int64)
        rx, rw, rsrc = expected.recv_x, expected.recv_w, expected.recv_src
        if mode == "atomic":
            inverse = _atomic_inverse_permutations(layout, self._calls)
            order = torch.empty_like(inverse[self.rank])
            order[inverse[self.rank]] = torch.arange(order.numel())
            rx, rw, rsrc = rx[order], rw[order], rsrc[order]
            scatter = _remap_scatter(scatter, idxs[self.rank], layout, inverse)
        self._calls += 1

        n = expected.num_recv
        self._ensure_rows(n)
        self._num_recv = n
        self._recv_rows(n, fp8).copy_(rx)
        self.recv_w[:n].copy_(rw)
        self.recv_src[:n].copy_(rsrc)
        t = x.shape[0]
        tpe = layout.tokens_per_expert[self.rank].to(device=self.device, dtype=torch.int32)
        # The handle keeps the caller's routing; dropped pairs have slot -1 (as EpBuffer's handle).
        handle = DispatchHandle(
            idx, w, scatter.view(t, c.topk).to(device=self.device, dtype=torch.int32), t, mode
        )
        return self._dispatch_result(n, tpe, handle, fp8, sync, dropped)

    def combine(self, y: Tensor, handle: Any, algorithm: str | None = None) -> Tensor:
        """out[t] = sum over k ascending of topk_weights[t, k] * y_owner[scatter[t, k]] (fp32, then
        cfg.dtype), as EpBuffer.combine. Collective. Returns a new [T, H] tensor.

        algorithm: "pull" (that sum, ``reference_combine``) or "reduced" (per expert rank sums rounded
        to cfg.dtype, then summed in the order of each rank's first k: ``reference_combine_reduced``;
        needs ``cfg.combine_algorithm == "reduced"``); None: ``cfg.combine_algorithm``. Every rank
        must use the same one. A rank-layout handle takes None only and evaluates
        ``reference_combine_rank_layout`` (y: one row per received row, no weights applied)."""
        self._check_open()
        c = self.cfg
        algo = layout = None
        try:
            layout = check_combine_layout(handle, algorithm)
            # The rank layout has one combine: the expert layout's algorithms do not apply to it.
            algo = "rank" if layout == "rank" else resolve_combine_algorithm(c, algorithm)
            check_combine_input(c, self.device, y, handle, self._num_recv)  # y: num_recv rows of its dispatch
            bad_y = None
        except ValueError as exc:
            bad_y = str(exc)
        # Every rank learns of a bad y (or algorithm) before anyone waits in the gather of the outputs.
        gathered = self._all_gather((bad_y, algo, layout))
        bad = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(gathered) if e is not None]
        if bad_y is not None:
            raise ValueError(bad_y)
        if bad:
            raise ValueError("combine: invalid expert outputs on another rank: " + "; ".join(bad))
        layouts = [v for _, _, v in gathered]
        if any(v != layout for v in layouts):
            raise ValueError(
                f"combine: every rank must pass a handle of the same layout, got {layouts} (by rank)"
            )
        algos = [a for _, a, _ in gathered]
        if any(a != algo for a in algos):
            raise ValueError(
                f"combine: every rank must use the same combine algorithm, got {algos} (by rank)"
            )
        rows = max(self._num_recv, y.shape[0])
        self._ensure_rows(rows)
        if y.numel() and y.data_ptr() != self.recv_y.data_ptr():
            self.recv_y[: y.shape[0]].copy_(y)
        ys = self._all_gather(self.recv_y[:rows].detach().cpu().clone())
        out, error = None, None
        try:
            if algo == "rank":
                out = reference_combine_rank_layout(
                    ys, [handle.topk_idx.cpu()], [handle.scatter.cpu()], num_experts=c.num_experts
                )[0]
            else:
                out = COMBINE_REFERENCES[algo](
                    ys,
                    # Pairs without a slot (dropped by capacity) are skipped like -1 ids.
                    [effective_topk_from_scatter(handle.topk_idx.cpu(), handle.scatter.cpu())],
                    [handle.topk_weights.cpu()],
                    [handle.scatter.cpu()],
                    num_experts=c.num_experts,
                )[0]
        except ValueError as exc:
            error = str(exc)
        # A bad handle on one rank must not leave the others waiting in their next collective.
        errors = self._all_gather(error)
        if error is not None:
            raise ValueError(f"combine: {error}")
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if bad:
            raise ValueError("combine failed on another rank: " + "; ".join(bad))
        return out.to(self.device)

    # -- internals -------------------------------------------------------------------------------

    def _dispatch_rank_layout(self, xs: list[Tensor], idxs: list[Tensor], ws: list[Tensor], idx: Tensor,
                              w: Tensor, mode: str, fp8: bool, sync: bool) -> DispatchResult:
        """The rank layout of every rank's gathered inputs (xs, idxs, ws; with ``fp8`` xs are the packed
        rows), this rank's rows written into the receive buffers; ``idx`` / ``w``: this rank's routing,
        for the handle."""
        c = self.cfg
        layout = reference_rank_layout(idxs, c.num_experts)
        expected = reference_dispatch_rank_layout(xs, idxs, ws, layout, c.max_tokens, self.rank)
        self._calls += 1  # the atomic-mode seed counts every dispatch, whatever its layout
        n = expected.num_recv
        self._ensure_rows(n)
        self._rank_rows(n)
        self._num_recv = n
        self._recv_rows(n, fp8).copy_(expected.recv_x)
        self.recv_src[:n].copy_(expected.recv_src)
        self.recv_topk_idx[:n].copy_(expected.recv_topk_idx)
        self.recv_topk_w[:n].copy_(expected.recv_topk_weights)
        t = idx.shape[0]
        tpe = expected.tokens_per_expert.to(self.device)
        scatter = layout.scatter[self.rank].view(t, c.topk).to(device=self.device, dtype=torch.int32)
        handle = DispatchHandle(idx, w, scatter, t, mode, "rank")
        return self._dispatch_result(n, tpe, handle, fp8, sync, layout="rank")

    def _all_gather(self, obj: Any) -> list[Any]:
        if not (dist.is_available() and dist.is_initialized()):
            if self.cfg.world_size != 1:
                raise RuntimeError(
                    f"world_size={self.cfg.world_size} needs an initialised torch.distributed process group"
                )
        return all_gather_objects(obj, self.group)


# --------------------------------------------------------------------------------------------------
# atomic-mode imitation
# --------------------------------------------------------------------------------------------------


def _atomic_inverse_permutations(layout: Layout, call: int) -> list[Tensor]:
    """Per destination d, [num_recv_d] int64: the shuffled slot of every deterministic slot.

    Rows move only inside their (local expert, source) group. Every rank computes the permutations
    of all destinations from the same generator, so the slots a source sees match what the
    destination holds.
    """
    g = torch.Generator(device="cpu")
    g.manual_seed(_ATOMIC_SEED_SALT + call)
    out = []
    for d in range(layout.world_size):
        sizes = layout.group_sizes(d).cpu()
        group = torch.repeat_interleave(torch.arange(sizes.numel(), dtype=torch.float64), sizes)
        # group + U[0, 1) sorts by group first, randomly inside a group.
        order = torch.argsort(group + torch.rand(group.numel(), generator=g, dtype=torch.float64))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        out.append(inverse)
    return out


def _remap_scatter(scatter: Tensor, topk_idx: Tensor, layout: Layout, inverse: Sequence[Tensor]) -> Tensor:
    """Move this rank's slots (deterministic layout) to where the shuffle put them on each owner."""
    flat = scatter.reshape(-1).clone()
    ids = topk_idx.reshape(-1).to(torch.int64)
    owner = torch.div(ids, layout.experts_per_rank, rounding_mode="floor")
    for d in range(layout.world_size):
        m = (ids >= 0) & (owner == d)
        if bool(m.any()):
            flat[m] = inverse[d][flat[m]]
    return flat.view(scatter.shape)
