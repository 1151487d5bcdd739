"""A normal-mode dispatch without a cached handle (``FreshDispatch``): the count table every rank gathers,
the agreement that rides in it, the rank-layout dispatch and DeepEP's handle built around it.

The count table is one row per rank (``TABLE_COLUMNS``): an error flag and a digest of the arguments that
must be the same on every rank, the rank's token count, the smallest and largest id of its topk_idx, per
destination rank the tokens ``is_token_in_rank`` sends there and the tokens ``num_tokens_per_rank`` says it
sends, then its ``num_tokens_per_expert`` padded to ``EXPERT_COLUMNS``. Its width depends only on the
number of ranks, so a rank whose arguments are wrong still takes part with a row of its own; one gather
and one host sync tell every rank whether to go on and give it everything it needs. Why: the agreement as
a collective of its own (``checks.agree``, over gloo) cost 0.6-0.9 ms per call on a 2x H100 host
(2026-11-28), more than DeepEP's whole dispatch, and a second gather for the expert counts 0.2-0.3 ms of
host time on a 2x H200 host. Where a rank is at fault, ``checks.agree`` runs after all, to carry the
messages, and every rank raises alike. With more than ``EXPERT_COLUMNS`` experts the expert counts take a
second gather, once the table says E is the same everywhere.

Each tensor operation costs 20-40 us of host time on the 2x H200 host, so the call makes few: DeepEP's
handle matrices that cute_ep never reads are made when first read (``handles.NormalHandle``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.deep_ep import normal
from cute_ep.deep_ep.checks import agree, check_expert_ids, error_of, same_digest
from cute_ep.deep_ep.handles import NormalHandle, _NormalRoute
from cute_ep.deep_ep.lifecycle import _Scope
from cute_ep.deep_ep.pool import _CARRIER
from cute_ep.deep_ep.utils import plain_torch_defaults

__all__ = ["EXPERT_COLUMNS", "TABLE_COLUMNS", "FreshDispatch", "table_width"]

EXPERT_COLUMNS = 1024  # experts whose counts ride in the table (more: a second gather)
TABLE_COLUMNS = ("error", "digest", "tokens", "smallest id", "largest id", "destinations (R)", "given (R)",
                 f"num_tokens_per_expert ({EXPERT_COLUMNS})")
_ERROR, _DIGEST, _TOKENS, _MIN_ID, _MAX_ID, _DEST = range(6)


def table_width(world: int) -> int:
    """Columns of the count table of ``world`` ranks."""
    return _DEST + 2 * world + EXPERT_COLUMNS


class FreshDispatch:
    """``dispatch`` without a cached handle, for ``NormalMode``. Uses what ``BufferLifecycle`` sets
    (``group``, ``rank``, ``group_size``, ``device``, ``runtime``, ``_nccl``), ``BufferPool``'s buffers and
    ``CallChecks``' checks."""

    def _dispatch_fresh(self, check: Callable[[], Any], given: dict[str, Any], synced: bool,
                        previous_event: Any, async_finish: bool) -> tuple:
        """The call, from its argument check on: ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``. ``given``: the caller's num_tokens_per_rank,
        is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment and
        num_worst_tokens. ``synced``: the call reads the table on the host (no num_worst_tokens)."""
        world = self.group_size
        if synced and world > 1:  # the agreement rides in the count table
            with plain_torch_defaults():
                a, error = error_of(check)
        else:
            a, error = self._agreed("dispatch", check, lambda r: r.same(), synced=False), None
        with _Scope(self, previous_event if error is None else None, async_finish and error is None) as scope:
            row = self._count_row(a, given) if error is None else self._error_row()
            table = self._all_gather_rows(row)  # [R, table_width]
            # The call's host sync; none with num_worst_tokens on a GPU (on a CPU the table is on the host).
            host = table.tolist() if synced or table.device.type == "cpu" else None
            if synced and world > 1:
                self._agree_in_table(host, a, error)
            if host is not None:
                self._refuse_outside_ids(host, given["topk_idx"], a.num_experts)
            recv_x, recv_scales, recv_idx, recv_w, per_expert, handle = self._dispatch_counted(
                a, given, table, host, synced)
            event = scope.finish((recv_x, recv_scales, recv_idx, recv_w, *handle.made()),
                                 (a.x, a.scales, a.in_rank, given["topk_idx"], given["topk_weights"],
                                  given["per_rank"], given["per_expert"]))
        return recv_x, recv_scales, recv_idx, recv_w, per_expert(), handle, event

    def _count_row(self, a: Any, given: dict[str, Any]) -> Tensor:
        """This rank's row of the count table, in seven tensor operations and no host sync."""
        world, e = self.group_size, a.num_experts
        row = torch.empty(table_width(world), dtype=torch.int64, device=self.device)
        topk_idx = given["topk_idx"]
        row[:_DEST].copy_(self._staged([0, same_digest(a.same()), a.x.shape[0], -1, -1]), non_blocking=True)
        if topk_idx is not None and topk_idx.numel():  # ids outside [-1, E) show in the extremes
            torch.aminmax(topk_idx.reshape(-1).to(torch.int64), dim=0, out=(row[_MIN_ID], row[_MAX_ID]))
        torch.sum(a.in_rank, 0, dtype=torch.int64, out=row[_DEST : _DEST + world])
        row[_DEST + world : _DEST + 2 * world].copy_(given["per_rank"])
        if e <= EXPERT_COLUMNS:  # the columns past E are never read
            row[_DEST + 2 * world : _DEST + 2 * world + e].copy_(given["per_expert"])
        return row

    def _error_row(self) -> Tensor:
        """The row of a rank whose arguments were wrong: the error flag set, the rest 0."""
        row = [0] * table_width(self.group_size)
        row[_ERROR] = 1
        return self._on_device(row, torch.int64)

    def _staged(self, values: list, dtype: torch.dtype = torch.int64) -> Tensor:
        """``values`` in host memory the Buffer's device copies from without a host sync (pinned on a GPU:
        ``torch.tensor(..., device=cuda)`` copies from pageable memory, which waits for the stream)."""
        return torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")

    def _on_device(self, values: list, dtype: torch.dtype) -> Tensor:
        """A tensor of ``values`` on the Buffer's device without a host sync (``_staged``)."""
        staged = self._staged(values, dtype)
        return torch.empty(staged.shape, dtype=dtype, device=self.device).copy_(staged, non_blocking=True)

    def _agree_in_table(self, host: list[list[int]], a: Any, error: ValueError | None) -> None:
        """Every rank raises alike where some rank's arguments were wrong, or differ where they must be the
        same (``checks.agree`` carries the messages then); else nothing."""
        if not any(r[_ERROR] for r in host) and all(r[_DIGEST] == host[0][_DIGEST] for r in host):
            return
        agree(self.runtime.cpu_group, "dispatch", error, {} if error is not None else a.same())
        if error is not None:  # agree raises it; kept in case the gathered rows said otherwise
            raise error

    def _dispatch_counted(self, a: Any, given: dict[str, Any], table: Tensor, host: list[list[int]] | None,
                          synced: bool) -> tuple:
        """After the table: the rank-layout dispatch and DeepEP's outputs and handle. The fifth output is a
        function returning num_recv_tokens_per_expert_list (without a second gather: at once)."""
        world, rank, dev = self.group_size, self.rank, self.device
        el = a.num_experts // world
        counts_host = None
        per_expert: Callable[[], list[int]] = list
        if synced:
            given_host = [r[_DEST + world : _DEST + 2 * world] for r in host]
            bad = [r for r in range(world) if given_host[r] != host[r][_DEST : _DEST + world]]
            if bad:
                raise ValueError(
                    f"dispatch: num_tokens_per_rank disagrees with is_token_in_rank.sum(0) on rank(s) {bad}: "
                    f"{given_host[bad[0]]} vs {host[bad[0]][_DEST : _DEST + world]}"
                )
            max_tokens = self._bucketed(a.fmt.elems, _CARRIER, world, world, max(r[_TOKENS] for r in host))
            counts_host = [r[_DEST : _DEST + world] for r in host]
            num_out = sum(row[rank] for row in counts_host)
            per_expert = self._experts_received(host, given["per_expert"], el, given["alignment"])
        else:
            num_worst = given["num_worst"]
            max_tokens = self._bucketed(a.fmt.elems, _CARRIER, world, world, -(-num_worst // world))
            # Every rank knows every rank's count on a CPU (all raise alike); on a GPU only its own.
            most = max(r[_TOKENS] for r in host) if host is not None else a.x.shape[0]
            if most > max_tokens:
                raise ValueError(
                    f"dispatch: num_worst_tokens={num_worst} sizes the buffers for {max_tokens} tokens per "
                    f"rank (ceil(num_worst_tokens / {world} ranks), rounded up), but a rank has {most}; pass "
                    f"num_worst_tokens >= num_tokens x num_ranks on every rank"
                )
            num_out = num_worst
        payload = a.fmt.pack(a.x, a.scales, given["topk_idx"], given["topk_weights"])
        ids, zero_w = self._rank_routing(a.in_rank)
        _, buf = self._buffer(a.fmt.elems, _CARRIER, world, world, max_tokens, num_sms=2 * a.channels)
        rows = min(num_out, world * max_tokens)
        outputs = a.fmt.outputs(num_out, dev)
        delivered = hasattr(buf, "launch_dispatch")  # the kernels copy the rows into outputs, in the launch
        into = a.fmt.delivery(rows, outputs) if delivered else None
        res = self._dispatch_on(buf, payload, ids, zero_w, "rank", into)
        if delivered:
            recv_x, recv_scales, gidx, gw = outputs[0], outputs[1], *a.fmt.ids_and_weights(outputs[2])
        else:
            recv_x, recv_scales, gidx, gw = a.fmt.unpack(res.recv_x[:rows], num_out, outputs)
        # A synced call knows the count (every row is real); with num_worst_tokens rows past it are -1.
        recv_src_idx = torch.remainder(res.recv_src[:rows], max_tokens)
        if not synced:
            valid = torch.arange(rows, device=dev) < res.recv_count.to(dev, torch.int64)
            recv_src_idx = torch.where(valid, recv_src_idx, -1)
            if rows < num_out:  # num_worst_tokens beyond the buffers' rows: the rest count nowhere
                recv_src_idx = torch.cat([recv_src_idx, recv_src_idx.new_full((num_out - rows,), -1)])
        recv_idx = recv_w = None
        if gidx is not None:  # this rank's experts' ids, local; -1 (weight 0) elsewhere and past the count
            here = torch.div(gidx, el, rounding_mode="floor") == rank
            here = here if synced else here & (recv_src_idx >= 0)[:, None]
            recv_idx = torch.where(here, gidx - rank * el, -1).to(given["topk_idx"].dtype)
            recv_w = torch.where(here, gw, 0.0)
        counts = table[:, _DEST : _DEST + world]  # [source, destination], from is_token_in_rank
        route = _NormalRoute(res.handle, max_tokens, num_out, counts, counts_host)
        handle = NormalHandle((None, None, None, recv_src_idx, a.in_rank, None), route,
                              self._lazy_entries(a, table, counts_host, recv_src_idx, synced))
        return recv_x, recv_scales, recv_idx, recv_w, per_expert, handle

    def _lazy_entries(self, a: Any, table: Tensor, counts_host: list[list[int]] | None, recv_src_idx: Tensor,
                      synced: bool) -> dict[int, Callable[[], Tensor]]:
        """The functions that make DeepEP's handle matrices cute_ep never reads, on first read (indices 0,
        1, 2 and 5 of the handle). They read what the dispatch left: the table, recv_src_idx (the received
        rows are source-major: a row's source rank follows from the counts) and is_token_in_rank (checked
        unchanged since)."""
        world, rank, channels, in_rank = self.group_size, self.rank, a.channels, a.in_rank
        version = in_rank._version

        def from_in_rank(make: Callable[[Tensor, int], Tensor], name: str) -> Callable[[], Tensor]:
            def made() -> Tensor:
                if in_rank._version != version:
                    raise RuntimeError(f"the handle's {name} is made from is_token_in_rank when first read, "
                                       f"and that tensor was changed in place since the dispatch: read it "
                                       f"before changing is_token_in_rank, or pass the dispatch a copy")
                return make(in_rank, channels)
            return made

        def recv_channel_prefix() -> Tensor:
            ends = table[:, _DEST + rank].cumsum(0)  # received rows from sources 0..s
            n = recv_src_idx.shape[0]
            src_rank = torch.searchsorted(ends, torch.arange(n, device=ends.device), right=True)
            valid = None if synced else recv_src_idx >= 0
            return normal.recv_channel_prefix_matrix(src_rank.clamp_(max=world - 1), recv_src_idx, valid,
                                                     table[:, _TOKENS], channels)

        return {0: lambda: self._rank_prefix(table, counts_host),
                1: from_in_rank(normal.channel_prefix_matrix, "channel_prefix_matrix"),
                2: recv_channel_prefix, 5: from_in_rank(normal.send_head, "send_head")}

    def _rank_prefix(self, table: Tensor, counts_host: list[list[int]] | None) -> Tensor:
        """DeepEP's rank_prefix_matrix [R, R] int32: this rank's column only (the rest 0; DeepEP leaves them
        uninitialised); made on the host when the counts are there (one copy instead of four operations)."""
        world, rank = self.group_size, self.rank
        if counts_host is not None:
            prefix = [[0] * world for _ in range(world)]
            total = 0
            for source in range(world):
                total += counts_host[source][rank]
                prefix[source][rank] = total
            return self._on_device(prefix, torch.int32)
        prefix = torch.zeros((world, world), dtype=torch.int32, device=self.device)
        prefix[:, rank] = table[:, _DEST + rank].cumsum(dim=0).to(torch.int32)
        return prefix

    def _rank_routing(self, in_rank: Tensor) -> tuple[Tensor, Tensor]:
        """``normal.rank_routing`` in one tensor operation: the constants of the latest [T, R] shape are
        kept (one shape only: T changes from call to call in a server)."""
        key = (tuple(in_rank.shape), in_rank.device)
        if self._routing_kept[0] != key:
            self._routing_kept = (key, normal.rank_constants(*in_rank.shape, in_rank.device))
        return normal.rank_routing(in_rank, self._routing_kept[1])

    def _experts_received(self, host: list[list[int]], per_expert_given: Tensor, el: int,
                          alignment: int) -> Callable[[], list[int]]:
        """The function returning, per local expert, the sum over ranks of num_tokens_per_expert rounded up
        to ``alignment``: from the table's columns, or (more than ``EXPERT_COLUMNS`` experts) from a second
        gather (collective, enqueued now; on a GPU the sums come through pinned memory behind an event, so
        reading them waits for the gather, not for the dispatch enqueued after it)."""
        first = _DEST + 2 * self.group_size + self.rank * el

        def rounded(sums: list[int]) -> list[int]:
            return [(n + alignment - 1) // alignment * alignment for n in sums]

        if per_expert_given.shape[0] <= EXPERT_COLUMNS:
            sums = [sum(r[first + j] for r in host) for j in range(el)]
            return lambda: rounded(sums)
        table = self._all_gather_rows(per_expert_given.to(torch.int64))  # [R, E]
        local = table[:, self.rank * el : (self.rank + 1) * el].sum(dim=0)
        if not local.is_cuda:
            values = local.tolist()
            return lambda: rounded(values)
        staged = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
        staged.copy_(local, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def read() -> list[int]:
            ready.synchronize()
            return rounded(staged.tolist())

        return read

    def _refuse_outside_ids(self, host: list[list[int]], topk_idx: Tensor | None, num_experts: int) -> None:
        """ValueError on every rank when some rank's topk_idx holds ids outside [-1, E) (the table's
        extremes): that rank names its first such id, the others name that rank and its message
        (``checks.agree``, a collective only on this error's path)."""
        bad = [r for r, row in enumerate(host) if row[_MIN_ID] < -1 or row[_MAX_ID] >= num_experts]
        if not bad:
            return
        error = None
        if self.rank in bad:
            try:
                check_expert_ids(topk_idx, num_experts)
            except ValueError as exc:
                error = exc
        if self.group_size == 1:
            if error is not None:
                raise error
            return
        agree(self.runtime.cpu_group, "dispatch", error, {})

    def _all_gather_rows(self, row: Tensor) -> Tensor:
        """[R, n]: every rank's 1-D ``row`` (same length), in rank order (collective, no host sync)."""
        if self.group_size == 1:
            return row[None]
        if self._nccl and row.is_cuda:  # one collective into one tensor (no list of R, no stack)
            out = torch.empty((self.group_size, row.shape[0]), dtype=row.dtype, device=row.device)
            dist.all_gather_into_tensor(out, row, group=self.group)
            return out
        part = row.cpu() if row.is_cuda else row  # gloo moves host tensors
        out = [torch.empty_like(part) for _ in range(self.group_size)]
        dist.all_gather(out, part, group=self.group)
        return torch.stack(out).to(row.device)
