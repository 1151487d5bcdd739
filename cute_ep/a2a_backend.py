"""``A2aEpBuffer``: the public API of ``cute_ep.buffer.EpBuffer`` on ``torch.distributed.all_to_all_single``.

    buf = A2aEpBuffer(runtime, cfg)                 # collective: every rank, same cfg
    res = buf.dispatch(x, topk_idx, topk_weights)   # same DispatchResult as the other backends
    y = buf.expert_output(res.num_recv)             # write the experts' outputs here (or pass any y)
    out = buf.combine(y, res.handle)                # [T, H]
    buf.close()

The fallback / baseline primitive: plain collectives on the runtime's process group (NCCL for CUDA
tensors under the "nvshmem" runtime, gloo on the CPU), no symmetric memory, no custom kernels. Its
results are bit-identical to :mod:`cute_ep.reference` (and so to ``ReferenceEpBuffer`` and
a correct ``EpBuffer``): the same expert-major receive layout, weights, source tags, counts and slots,
and the same fp32 combine order.

Dispatch (one rank's view; every step is collective):

1. count this rank's (t, k) pairs per expert and all-gather the [E] count rows (plus an error flag,
   the mode and the fp8 flag) as one small int64 tensor: every rank then knows ``counts[src][e]``
   and so the whole layout (offsets, split sizes, the slot of every pair, the pairs kept under
   expert capacity). One host sync reads them.
2. sort the valid pairs by expert (stable, so (t, k) row-major inside an expert): since the experts
   of a rank are contiguous, this groups them by destination rank too;
3. ``all_to_all_single`` the token rows, then an int32 [P, 2] metadata tensor (the weight's fp32
   bits and the source tag), with split sizes from the counts;
4. the receiver holds source-major blocks (source s: its rows for local expert 0, 1, ...) and puts
   each row at its expert-major slot (local expert l: source 0's rows, then source 1's ...). With one
   expert per rank, or one rank, the two orders coincide and the rows are received in place.

Combine sends every y row back to its source (the inverse permutation, then ``all_to_all_single``
with the split sizes swapped), and the source reduces in k order exactly as
``reference_combine``: ``acc = acc + (w * y.float())`` with the product its own fp32 op (no FMA),
dropped pairs skipped, the cast to ``cfg.dtype`` at the end. That is the "pull" combine algorithm;
with "reduced" (``cfg.combine_algorithm``, or ``combine(..., algorithm="reduced")`` on such a config)
the same rows come back and the source applies ``cute_ep.reference.combine_reduced_rows``: per
(token, expert rank) sums rounded to ``cfg.dtype``, summed in the order of each rank's first k,
bit-identical to ``reference_combine_reduced`` (what the GPU kernels compute with partial rows).

The handle (``A2aDispatchHandle``, a ``DispatchHandle`` with the same public fields) carries the
routing of the dispatch that made it: split sizes, the receive permutation and where each (t, k)'s
row comes back. ``handle.scatter`` holds the real slots, comparable to the other backends' handles.
Combine honours the handle's ``topk_idx`` / ``topk_weights`` (``dataclasses.replace`` may drop pairs,
set -1, or change weights, as ``cute_ep.autograd`` does), but the pairs it keeps must be routed as in
the dispatch; it does not read ``handle.scatter``.

Mode "atomic" is accepted and behaves like "scatter": slots are assigned deterministically here (the
layout is computed from the gathered counts), so both modes give the reference layout; the handle
keeps the mode it was given.

Expert capacity (``cfg.capacity_factor`` > 0): the gathered count rows say how many pairs every source
keeps per expert (:func:`cute_ep.capacity.kept_counts`: rank order, then (t, k) order), and
a source's kept pairs of an expert are its first ones in (t, k) order, so each rank drops its own
pairs without seeing the others' routing. Dropped pairs get slot -1 and are skipped by combine; the
drops are counted (``dropped_rows``) and, with ``cfg.on_overflow == "raise"``, raised after the
result is complete (every rank computes the same counts, so every rank raises).

Rank layout (``dispatch(..., layout="rank")``, DeepEP's): the gathered row also carries, per
destination rank, how many of this rank's tokens name one of its experts, which fixes every row: a
source sends its tokens bound for d in t order (destinations in rank order), and since
``all_to_all_single`` lands source s's block after those of sources < s, the receiver holds them in
(s, t) order with no permutation. With each row travel its per-k local ids (-1 where the pair is for
another rank), weights (0.0 there) and tag s * M + t, as an int32 [N, 2K + 1] metadata tensor. Combine
sends each received row back and the token's rank adds its rows in ascending destination rank (fp32
from 0.0, one cast), bit-identical to ``cute_ep.reference.reference_combine_rank_layout``.

FP8 (``dispatch(..., fp8=True)``, either layout): the sender quantizes its rows and packs them
(:mod:`cute_ep.fp8`; each token once), the all-to-all moves the packed uint8 rows where the rows of
``cfg.dtype`` would go, and the receiver's ``recv_x`` (float8_e4m3fn) and ``recv_scales`` (fp32) are
views of its packed receive rows.

Errors: an invalid input on any rank raises on every rank (the rank at fault gets the shared
checks' message, the others a message naming it) before any rows move, and the buffer stays usable.
Every rank must make the same sequence of calls; combine refuses handles of different dispatch calls
on different ranks. Host syncs, besides those of the shared input checks: one per dispatch (the
counts), one per combine (the error flags). A failure after the counts exchange (e.g. out of memory
on one rank) is not caught: the peers then wait in the all-to-all until the process group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.api import LAYOUTS, DispatchHandle, DispatchResult
from cute_ep.capacity import kept_counts
from cute_ep.collectives import all_gather_objects
from cute_ep.host_buffer import HostEpBuffer
from cute_ep.input_checks import (
    check_combine_input,
    check_combine_layout,
    check_dispatch_call,
    resolve_combine_algorithm,
)
from cute_ep.kernels.config import MODES, EpConfig
from cute_ep.kernels.variants import COMBINE_ALGORITHMS
from cute_ep.reference import combine_reduced_rows

__all__ = ["A2aDispatchHandle", "A2aEpBuffer"]

_MODE_NAMES = {code: name for name, code in MODES.items()}
_COMBINE_NAMES = {code: name for name, code in COMBINE_ALGORITHMS.items()}
_LAYOUT_CODES = {name: code for code, name in enumerate(LAYOUTS)}
_LAYOUT_NAMES = dict(enumerate(LAYOUTS))
_NO_MODE = -1


@dataclass(frozen=True)
class _Route:
    """What combine needs besides the public handle fields (one rank's view of one dispatch)."""

    owner: object  # the buffer's token: a handle works only with the buffer that made it
    call: int  # dispatch calls before this one on the buffer (the same on every rank)
    topk_idx: Tensor  # [T, K] int32, the dispatch's own routing (the handle's may be replaced)
    send_splits: list[int]  # rows sent to each destination rank
    recv_splits: list[int]  # rows received from each source rank
    slot_of: Tensor | None  # [num_recv] int64: slot of the i-th received row; None: identity
    # Row in what combine receives back, num_send if not sent: of (t, k) [T, K] in the expert layout,
    # of (t, destination rank) [T, R] in the rank layout.
    back_pos: Tensor
    layout: str = "expert"

    @property
    def num_send(self) -> int:
        return sum(self.send_splits)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)


@dataclass(frozen=True)
class A2aDispatchHandle(DispatchHandle):
    """A ``DispatchHandle`` (topk_idx, topk_weights, scatter, num_tokens, mode) plus the routing of the
    all-to-all dispatch that made it (private: only ``A2aEpBuffer.combine`` reads it)."""

    _route: _Route | None = field(default=None, repr=False, compare=False)


class A2aEpBuffer(HostEpBuffer):
    """Same public API as ``cute_ep.buffer.EpBuffer``, built on ``all_to_all_single`` (module docstring).

    runtime:     a started ``cute_ep.bootstrap.runtime.Runtime`` ("nvshmem": rows move over the NCCL
                 part of its process group, or through host memory over gloo when ranks share a GPU;
                 "gloo": over gloo on the CPU). Anything with ``env``,
                 ``device`` and ``group`` / ``cpu_group`` attributes works, e.g. in a world of one.
    cfg:         the ``EpConfig``; world_size must match the runtime's.
    preallocate: allocate the receive buffers at ``cfg.capacity`` rows now (as EpBuffer does), instead
                 of growing them on demand (a timing loop then never reallocates).
    """

    def __init__(self, runtime: Any, cfg: EpConfig, *, preallocate: bool = False) -> None:
        super().__init__(runtime, cfg, rows=cfg.capacity if preallocate else 0)
        initialised = dist.is_available() and dist.is_initialized()
        if cfg.world_size > 1:
            if not initialised:
                raise RuntimeError(
                    f"world_size={cfg.world_size} needs an initialised torch.distributed process group"
                )
            if dist.get_world_size(self.group) != cfg.world_size:
                raise RuntimeError(
                    f"the process group has {dist.get_world_size(self.group)} ranks, "
                    f"cfg.world_size is {cfg.world_size}"
                )
        self._distributed = initialised and cfg.world_size > 1
        # Ranks that share a GPU have a gloo-only group (NCCL refuses them): their CUDA rows then travel
        # through host memory, the same bytes in the same order.
        self._via_host = (self._distributed and self.device.type == "cuda"
                          and dist.get_backend(self.group) == "gloo")
        self._calls = 0
        self._token = object()

    @property
    def group(self) -> Any:
        """The group the rows travel over: the runtime's ``group``, else ``cpu_group``; read from the runtime
        at every use (None once closed), so that a buffer outliving its runtime does not keep the process
        group alive (``HostEpBuffer.cpu_group``)."""
        group = None if self._closed else getattr(self.runtime, "group", None)
        return group if group is not None else self.cpu_group

    # -- public API ------------------------------------------------------------------------------

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, mode: str = "scatter",
                 fp8: bool = False, algorithm: str | None = None, sync: bool = True,
                 layout: str = "expert") -> DispatchResult:
        """Send every (token, k) row to the rank owning expert ``topk_idx[t, k]`` (arguments:
        ``cute_ep.api.EpBackend.dispatch``).

        x [T, H] cfg.dtype, topk_idx [T, K] int32/int64 in [-1, E), topk_weights [T, K] fp32, on this rank's
        device. mode "scatter" | "atomic"; fp8: send block-scaled e4m3 rows (H % 128 == 0, the same flag on
        every rank); algorithm: a GPU dispatch primitive's name, checked and otherwise ignored (primitives
        differ only in how rows travel). Returns a ``cute_ep.api.DispatchResult`` whose handle is an
        ``A2aDispatchHandle``; recv_x / recv_weights / recv_src (and recv_scales with fp8) are views valid
        until the next dispatch. Collective: every rank calls it; invalid inputs on any rank raise on every
        rank. Rows dropped beyond ``cfg.expert_capacity`` raise ``CapacityExceeded`` (carrying the result) if
        ``cfg.on_overflow == "raise"``. layout: "expert" or "rank" (module docstring; no capacity factor),
        the same on every rank.
        """
        self._check_open()
        c = self.cfg
        world, rank, num_e, el, k_top = c.world_size, self.rank, c.num_experts, c.experts_per_rank, c.topk
        dev = self.device
        error: BaseException | None = None
        dest: Tensor | None = None
        # Gathered row: [pairs per expert (E) | rank layout: tokens per destination rank (R) | error
        # flag, mode, fp8, layout].
        tail_at = num_e + world
        try:
            x, idx, w = check_dispatch_call(c, dev, x, topk_idx, topk_weights, mode=mode, fp8=fp8,
                                            algorithm=algorithm, layout=layout)  # fmt: skip
            idx = idx.clone()  # the handle owns its routing: later edits by the caller change nothing
            w = w.clone()
            # Dropped pairs go to a virtual expert E: they sort last and are not counted.
            flat = idx.reshape(-1).to(torch.int64)
            key = torch.where(flat < 0, torch.full_like(flat, num_e), flat)
            hist = torch.zeros(num_e + 1, dtype=torch.int64, device=dev)
            hist.scatter_add_(0, key, torch.ones_like(key))  # exact and sync-free (bincount may sync)
            per_rank = torch.zeros(world, dtype=torch.int64, device=dev)
            if layout == "rank":
                # dest[t, r]: token t names an expert of rank r (a -1 id marks a virtual rank R).
                owner = torch.where(key < num_e, torch.div(key, el, rounding_mode="floor"), world)
                dest = torch.zeros(x.shape[0], world + 1, dtype=torch.bool, device=dev)
                dest.scatter_(1, owner.view(x.shape[0], k_top), True)
                dest = dest[:, :world]
                per_rank = dest.sum(dim=0)
            tail = torch.tensor([0, MODES[mode], int(fp8), _LAYOUT_CODES[layout]], dtype=torch.int64,
                                device=dev)
            row = torch.cat([hist[:num_e], per_rank, tail])
        except Exception as exc:  # the peers must still learn of it in the same collective
            error = exc
            row = torch.zeros(tail_at + 4, dtype=torch.int64, device=dev)
            row[tail_at] = 1
            row[tail_at + 1] = _NO_MODE
            row[tail_at + 2] = -1
            row[tail_at + 3] = -1
        table = self._gather_rows(row)  # [R, E + R + 4] int64 on the CPU
        self._raise_gathered(table[:, tail_at].tolist(), error, "dispatch: invalid inputs on another rank")
        modes = table[:, tail_at + 1].tolist()
        if any(m != modes[0] for m in modes):
            names = [_MODE_NAMES.get(m, m) for m in modes]
            raise ValueError(f"dispatch: every rank must use the same mode, got {names}")
        flags = [bool(f) for f in table[:, tail_at + 2].tolist()]
        if any(f != flags[0] for f in flags):
            raise ValueError(f"dispatch: every rank must pass the same fp8 flag, got {flags} (by rank)")
        layouts = [_LAYOUT_NAMES.get(v, v) for v in table[:, tail_at + 3].tolist()]
        if any(v != layouts[0] for v in layouts):
            raise ValueError(f"dispatch: every rank must use the same layout, got {layouts} (by rank)")
        if layout == "rank":
            assert dest is not None
            return self._dispatch_rank_layout(x, idx, w, dest, table, mode, fp8, sync)

        routed = table[:, :num_e]  # [R_src, E]: pairs routed, before capacity
        limited = c.capacity_factor > 0
        # What every source keeps of every expert: sources in rank order, each its first pairs.
        counts = kept_counts(routed, c.expert_capacity) if limited else routed
        c3 = counts.view(world, world, el)  # [src, dst, local expert]
        per_dst = c3.sum(dim=(0, 2))
        # Cannot happen with cfg.capacity >= cfg.required_capacity (EpConfig enforces it); kept for a
        # configuration whose capacity was forced lower.
        over = [(d, int(n)) for d, n in enumerate(per_dst.tolist()) if n > c.capacity]
        if over:
            raise ValueError(
                f"dispatch: rank(s) {[d for d, _ in over]} would receive {[n for _, n in over]} rows, "
                f"more than the capacity {c.capacity}"
            )
        send_splits = c3[rank].sum(dim=1).tolist()
        recv_splits = c3[:, rank, :].sum(dim=1).tolist()
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        # Slot order on destination d: local expert major, source minor (reference_layout's offsets).
        groups = c3.permute(1, 2, 0).reshape(world, el * world)
        offsets = (torch.cumsum(groups, dim=1) - groups).view(world, el, world)  # [dst, l, src]

        # -- send side: kept pairs sorted by expert, (t, k) row-major inside an expert ---------------
        t = x.shape[0]
        order = torch.sort(key, stable=True).indices
        mine = counts[rank]
        first_of_e = (torch.cumsum(mine, 0) - mine).to(dev)  # first send position of expert e
        arange = torch.arange(n_send, device=dev)
        if limited:
            # Expert e's kept pairs are the first mine[e] of its sorted run: skip the dropped tails.
            routed_mine = routed[rank]
            first_routed = (torch.cumsum(routed_mine, 0) - routed_mine).to(dev)
            skip = torch.repeat_interleave(first_routed - first_of_e, mine.to(dev), output_size=n_send)
            send_order = order[arange + skip]
        else:
            send_order = order[:n_send]  # flat t * K + k of every pair sent, in send order
        e_sorted = key[send_order]
        first_slot_e = offsets[:, :, rank].reshape(num_e).to(dev)  # slot of expert e's first row from me
        slot_sorted = first_slot_e[e_sorted] + arange - first_of_e[e_sorted]
        scatter = torch.full((t * k_top,), -1, dtype=torch.int64, device=dev)
        scatter[send_order] = slot_sorted
        back_pos = torch.full((t * k_top,), n_send, dtype=torch.int64, device=dev)
        back_pos[send_order] = arange

        # With fp8 the packed rows travel: each token quantized once, before the per-k copies.
        rows = self._sent_rows(x, fp8)
        x_send = rows.index_select(0, torch.div(send_order, k_top, rounding_mode="floor"))
        tags = send_order + rank * c.max_tokens * k_top  # (rank * M + t) * K + k, < 2**31 (EpConfig)
        meta_send = torch.stack([w.reshape(-1)[send_order].view(torch.int32), tags.to(torch.int32)], dim=1)

        # -- receive side --------------------------------------------------------------------------
        self._ensure_rows(n_recv)
        dest = self._recv_rows(n_recv, fp8)
        identity = el == 1 or world == 1  # source-major order is already expert-major
        if identity:
            slot_of = None
            x_recv = dest
        else:
            sizes = c3[:, rank, :].reshape(-1)  # blocks in receive order: (source, local expert)
            slot_start = offsets[rank].t().reshape(-1)  # [src, l]: first slot of each block
            pos_start = torch.cumsum(sizes, 0) - sizes
            shift = torch.repeat_interleave((slot_start - pos_start).to(dev), sizes.to(dev),
                                            output_size=n_recv)
            slot_of = shift + torch.arange(n_recv, device=dev)
            x_recv = torch.empty_like(dest)
        meta_recv = torch.empty((n_recv, 2), dtype=torch.int32, device=dev)
        self._all_to_all(x_recv, x_send, recv_splits, send_splits)
        self._all_to_all(meta_recv, meta_send, recv_splits, send_splits)
        w_bits, src_tags = self.recv_w[:n_recv].view(torch.int32), self.recv_src[:n_recv]
        if identity:
            w_bits.copy_(meta_recv[:, 0])
            src_tags.copy_(meta_recv[:, 1])
        else:
            dest.index_copy_(0, slot_of, x_recv)
            w_bits.index_copy_(0, slot_of, meta_recv[:, 0])
            src_tags.index_copy_(0, slot_of, meta_recv[:, 1])

        tpe = c3[:, rank, :].sum(dim=0).to(device=dev, dtype=torch.int32)
        route = _Route(self._token, self._calls, idx, send_splits, recv_splits, slot_of,
                       back_pos.view(t, k_top))
        self._calls += 1
        handle = A2aDispatchHandle(idx, w, scatter.view(t, k_top).to(torch.int32), t, mode, _route=route)
        dropped = routed.sum(dim=0) - counts.sum(dim=0) if limited else None
        return self._dispatch_result(n_recv, tpe, handle, fp8, sync, dropped)

    def combine(self, y: Tensor, handle: DispatchHandle, algorithm: str | None = None) -> Tensor:
        """out[t] = sum over k ascending of topk_weights[t, k] * y_owner[slot(t, k)] (fp32, then
        cfg.dtype), as EpBuffer.combine. y [num_recv, H] cfg.dtype in recv_x's row order (rows past y's
        end, if y is shorter, are read from ``expert_output``'s buffer, as the other backends do).
        ``handle`` comes from this buffer's dispatch. algorithm: "pull" (that sum) or "reduced" (needs
        ``cfg.combine_algorithm == "reduced"``; bit-identical to ``reference_combine_reduced``); None:
        ``cfg.combine_algorithm``; the same on every rank. Collective. Returns a new [T, H] tensor."""
        self._check_open()
        c = self.cfg
        dev = self.device
        error: BaseException | None = None
        route: _Route | None = None
        algo: str | None = None
        layout = "expert"
        try:
            layout = check_combine_layout(handle, algorithm)
            # The rank layout has one combine: the expert layout's algorithms do not apply to it.
            algo = None if layout == "rank" else resolve_combine_algorithm(c, algorithm)
            check_combine_input(c, dev, y, handle, self._route_of(handle).num_recv)
            route = self._route_of(handle)
        except Exception as exc:  # the peers must still learn of it in the same collective
            error = exc
        head = torch.tensor([int(error is not None), route.call if route is not None else -1,
                             COMBINE_ALGORITHMS[algo] if algo is not None else -1],
                            dtype=torch.int64, device=dev)  # the rank layout's "algorithm" is -1
        table = self._gather_rows(head)
        self._raise_gathered(table[:, 0].tolist(), error, "combine: invalid input on another rank")
        calls = table[:, 1].tolist()
        if any(v != calls[0] for v in calls):
            raise ValueError(
                f"combine: every rank must pass the handle of the same dispatch; the handles come from "
                f"dispatch calls {calls} (by rank)"
            )
        algos = [_COMBINE_NAMES.get(v) for v in table[:, 2].tolist()]  # -1 (rank layout): None
        if any(a != algo for a in algos):
            raise ValueError(
                f"combine: every rank must use the same combine algorithm, got {algos} (by rank)"
            )
        assert route is not None

        n_recv, n_send = route.num_recv, route.num_send
        if y.shape[0] >= n_recv:
            rows = y[:n_recv]
        else:  # the tail comes from the expert-output buffer (EpBuffer's recv_y semantics)
            self._ensure_rows(n_recv)
            if y.numel() and y.data_ptr() != self.recv_y.data_ptr():
                self.recv_y[: y.shape[0]].copy_(y)
            rows = self.recv_y[:n_recv]
        back = rows if route.slot_of is None else rows.index_select(0, route.slot_of)
        got = torch.empty((n_send + 1, c.hidden), dtype=c.dtype, device=dev)
        got[n_send].zero_()  # the row every dropped pair reads (discarded below, like the reference)
        self._all_to_all(got[:n_send], back.contiguous(), route.send_splits, route.recv_splits)

        idx = handle.topk_idx
        w = handle.topk_weights
        t = handle.num_tokens
        if route.layout == "rank":
            return self._combine_rank_layout(got, idx, route)
        if algo == "reduced":
            # A pair dropped by capacity was never sent (back_pos == n_send): skipped like a -1 id.
            eff = torch.where(route.back_pos < n_send, idx.to(torch.int64), -1)
            rows3 = got.index_select(0, route.back_pos.reshape(-1)).view(t, c.topk, c.hidden)
            return combine_reduced_rows(rows3, eff, w, experts_per_rank=c.experts_per_rank)
        acc = torch.zeros((t, c.hidden), dtype=torch.float32, device=dev)
        for k in range(c.topk):
            # A pair dropped by capacity was never sent (back_pos == n_send): skipped like a -1 id.
            valid = (idx[:, k] >= 0) & (route.back_pos[:, k] < n_send)
            yk = got.index_select(0, route.back_pos[:, k])
            # Two separate fp32 ops: the product is rounded before the add (reference_combine).
            prod = w[:, k][:, None] * yk.float()
            summed = acc + prod
            acc = torch.where(valid[:, None], summed, acc)
        return acc.to(c.dtype)

    # -- internals -------------------------------------------------------------------------------

    def _dispatch_rank_layout(self, x: Tensor, idx: Tensor, w: Tensor, dest: Tensor, table: Tensor,
                              mode: str, fp8: bool, sync: bool) -> DispatchResult:
        """The rank layout (module docstring), after the exchange of the count rows.

        x [T, H], idx [T, K] int32 (this rank's own copy), w [T, K] fp32; dest [T, R] bool: token t names
        an expert of rank r; table [R, E + R + 4]: every rank's gathered row (pairs per expert, then
        tokens per destination rank); fp8: the packed FP8 rows travel instead of x's."""
        c = self.cfg
        world, rank, num_e, el, k_top = c.world_size, self.rank, c.num_experts, c.experts_per_rank, c.topk
        dev = self.device
        t = x.shape[0]
        tokens = table[:, num_e:num_e + world]  # [src, dst]: rows s sends d
        send_splits = tokens[rank].tolist()
        recv_splits = tokens[:, rank].tolist()
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        # Sources land in rank order on d, so this rank's first row there follows those of ranks < rank.
        first_row = (torch.cumsum(tokens, dim=0) - tokens)[rank].to(dev)  # [dst]
        first_sent = (torch.cumsum(tokens[rank], dim=0) - tokens[rank]).to(dev)  # [dst]: in send order

        # -- send side: (d, t) pairs with dest[t, d], d-major and t ascending (a stable sort, no sync) --
        flat = dest.t().reshape(-1)  # index d * T + t
        order = torch.sort((~flat).to(torch.int8), stable=True).indices[:n_send]
        send_d = torch.div(order, max(t, 1), rounding_mode="floor")
        send_t = order - send_d * t
        pos = torch.full((world * t,), n_send, dtype=torch.int64, device=dev)
        pos[order] = torch.arange(n_send, device=dev)
        back_pos = pos.view(world, t).t().contiguous()  # [T, R]: where (t, d)'s row comes back
        # The handle: row of t on owner(idx[t, k]) = first_row[d] + t's place among the tokens sent to d.
        row_on = back_pos - first_sent[None, :] + first_row[None, :]
        row_on = torch.cat([row_on, row_on.new_full((t, 1), -1)], dim=1)  # virtual rank R for -1 ids
        ids = idx.to(torch.int64)
        owner = torch.where(ids >= 0, torch.div(ids, el, rounding_mode="floor"), world)
        scatter = row_on.gather(1, owner).to(torch.int32)

        x_send = self._sent_rows(x, fp8).index_select(0, send_t)
        ids_sent, w_sent = ids.index_select(0, send_t), w.index_select(0, send_t)
        here = owner.index_select(0, send_t) == send_d[:, None]  # the pair is for the row's destination
        local = torch.where(here, ids_sent - send_d[:, None] * el, -1).to(torch.int32)
        w_local = torch.where(here, w_sent, torch.zeros_like(w_sent))  # +0.0 where the pair is elsewhere
        tags = (send_t + rank * c.max_tokens).to(torch.int32)  # s * M + t < R * M (EpConfig bounds it)
        meta_send = torch.cat([local, w_local.view(torch.int32), tags[:, None]], dim=1)

        # -- receive side: source-major blocks, t ascending inside each: already the layout's order ---
        self._ensure_rows(n_recv)
        self._rank_rows(n_recv)
        meta_recv = torch.empty((n_recv, 2 * k_top + 1), dtype=torch.int32, device=dev)
        self._all_to_all(self._recv_rows(n_recv, fp8), x_send, recv_splits, send_splits)
        self._all_to_all(meta_recv, meta_send, recv_splits, send_splits)
        self.recv_topk_idx[:n_recv].copy_(meta_recv[:, :k_top])
        self.recv_topk_w[:n_recv].view(torch.int32).copy_(meta_recv[:, k_top:2 * k_top])
        self.recv_src[:n_recv].copy_(meta_recv[:, 2 * k_top])

        # Rows naming local expert l = pairs routed to it (a token names an expert at most once).
        tpe = table[:, rank * el:(rank + 1) * el].sum(dim=0).to(device=dev, dtype=torch.int32)
        route = _Route(self._token, self._calls, idx, send_splits, recv_splits, None, back_pos, "rank")
        self._calls += 1
        handle = A2aDispatchHandle(idx, w, scatter, t, mode, "rank", _route=route)
        return self._dispatch_result(n_recv, tpe, handle, fp8, sync, layout="rank")

    def _combine_rank_layout(self, got: Tensor, idx: Tensor, route: _Route) -> Tensor:
        """out[t] = sum over t's destination ranks r ascending of its row back from r, fp32 from 0.0, one
        cast (``reference_combine_rank_layout``). got [num_send + 1, H]: the rows back in send order, a
        zero row last; idx: the handle's ids (a replaced routing may have dropped destinations)."""
        c = self.cfg
        ids = idx.to(torch.int64)
        owner = torch.where(ids >= 0, torch.div(ids, c.experts_per_rank, rounding_mode="floor"), -1)
        acc = torch.zeros((idx.shape[0], c.hidden), dtype=torch.float32, device=self.device)
        for r in range(c.world_size):
            has = (owner == r).any(dim=1)
            yr = got.index_select(0, route.back_pos[:, r])
            acc = torch.where(has[:, None], acc + yr.float(), acc)
        return acc.to(c.dtype)

    def _gather_rows(self, row: Tensor) -> Tensor:
        """Every rank's 1-D int64 ``row`` (same length everywhere), stacked [R, len] on the CPU."""
        if not self._distributed:
            return row[None].cpu()
        row = row.cpu() if self._via_host else row
        parts = [torch.empty_like(row) for _ in range(self.cfg.world_size)]
        dist.all_gather(parts, row, group=self.group)
        return torch.stack(parts).cpu()

    def _raise_gathered(self, flags: list[int], error: BaseException | None, what: str) -> None:
        """After a gathered error flag: every rank raises (the messages travel only when one is set)."""
        if not any(flags):
            return
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages = all_gather_objects(mine, self.cpu_group) if self._distributed else [mine]
        if error is not None:
            raise error
        bad = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
        raise ValueError(f"{what}: " + "; ".join(bad))

    def _all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        if not self._distributed:
            out.copy_(inp)
            return
        if self._via_host:
            staged = torch.empty(out.shape, dtype=out.dtype)
            dist.all_to_all_single(staged, inp.cpu(), out_splits, in_splits, group=self.group)
            out.copy_(staged)
            return
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _route_of(self, handle: Any) -> _Route:
        """The routing of ``handle`` if this buffer made it and its public fields still fit it."""
        route = getattr(handle, "_route", None)
        if not isinstance(route, _Route) or route.owner is not self._token:
            raise ValueError(
                f"combine: the handle must come from this A2aEpBuffer's dispatch, got {type(handle).__name__}"
            )
        if handle.layout != route.layout:
            raise ValueError(
                f"combine: handle.layout is {handle.layout!r}, its dispatch used layout={route.layout!r}"
            )
        t, k_top = route.topk_idx.shape
        idx, w = handle.topk_idx, handle.topk_weights
        if handle.num_tokens != t:
            raise ValueError(
                f"combine: handle.num_tokens is {handle.num_tokens}, its dispatch had {t} tokens"
            )
        int_idx = idx.dtype in (torch.int32, torch.int64)
        if tuple(idx.shape) != (t, k_top) or not int_idx or idx.device != self.device:
            raise ValueError(
                f"combine: handle.topk_idx must be [{t}, {k_top}] int32/int64 on {self.device}, got "
                f"{list(idx.shape)} {idx.dtype} on {idx.device}"
            )
        if tuple(w.shape) != (t, k_top) or w.dtype != torch.float32 or w.device != self.device:
            raise ValueError(
                f"combine: handle.topk_weights must be [{t}, {k_top}] float32 on {self.device}, got "
                f"{list(w.shape)} {w.dtype} on {w.device}"
            )
        if idx is not route.topk_idx:  # a replaced routing may only drop pairs of the dispatch
            ids = idx.to(torch.int64)
            moved = (ids < -1) | ((ids >= 0) & (ids != route.topk_idx.to(torch.int64)))
            if bool(moved.any()):
                tt, kk = (int(v) for v in torch.nonzero(moved)[0])
                raise ValueError(
                    f"combine: handle.topk_idx[{tt}, {kk}] is {int(idx[tt, kk])} but the dispatch routed "
                    f"that pair to {int(route.topk_idx[tt, kk])} (a replaced topk_idx may only set pairs "
                    f"to -1)"
                )
        return route
