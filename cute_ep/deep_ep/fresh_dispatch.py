"""A normal-mode dispatch without a cached handle (``FreshDispatch``): the count table every rank gathers,
the agreement that rides in it, the rank-layout dispatch and DeepEP's handle built around it.

The count table is one row per rank (``TABLE_COLUMNS``): an error flag and a digest of the arguments that
must be the same on every rank, then the rank's token count, its ids outside [-1, E), and per destination
rank the tokens ``is_token_in_rank`` sends there and the tokens ``num_tokens_per_rank`` says it sends. Its
width depends only on the number of ranks, so a rank whose arguments are wrong still takes part with a
row of its own; one gather and one host sync then tell every rank whether to go on. Why: the agreement
as a collective of its own (``checks.agree``, over gloo) cost 0.6-0.9 ms per call on a 2x H100 host
(2026-11-28), more than DeepEP's whole dispatch. Where a rank is at fault, ``checks.agree`` runs after
all, to carry the messages, and every rank raises alike.

The number of tokens each rank sends to each of this rank's experts (DeepEP's
``num_recv_tokens_per_expert_list``) needs a second gather, of E values per rank, once the table says E
is the same everywhere; its host copy is read only when the call returns, so the dispatch is launched
before the host waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.deep_ep import normal
from cute_ep.deep_ep.checks import agree, check_expert_ids, error_of, outside_ids, same_digest
from cute_ep.deep_ep.handles import NormalHandle, _NormalRoute
from cute_ep.deep_ep.lifecycle import _Scope
from cute_ep.deep_ep.pool import _CARRIER
from cute_ep.deep_ep.utils import plain_torch_defaults

__all__ = ["TABLE_COLUMNS", "FreshDispatch", "table_width"]

TABLE_COLUMNS = ("error", "digest", "tokens", "outside ids", "destinations (R)", "given (R)")
_ERROR, _DIGEST, _TOKENS, _OUTSIDE, _DEST = 0, 1, 2, 3, 4


def table_width(world: int) -> int:
    """Columns of the count table of ``world`` ranks."""
    return _DEST + 2 * world


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
            host = table.cpu() if synced or table.device.type == "cpu" else None
            if synced and world > 1:
                self._agree_in_table(host, a, error)
            if host is not None:
                self._refuse_outside_ids(host[:, _OUTSIDE].tolist(), given["topk_idx"], a.num_experts)
            result = self._dispatch_counted(a, given, table, host, synced)
            recv_x, recv_scales, recv_idx, recv_w, per_expert, handle = result
            event = scope.finish((recv_x, recv_scales, recv_idx, recv_w, *handle),
                                 (a.x, a.scales, a.in_rank, given["topk_idx"], given["topk_weights"],
                                  given["per_rank"], given["per_expert"]))
        return recv_x, recv_scales, recv_idx, recv_w, per_expert(), handle, event

    def _count_row(self, a: Any, given: dict[str, Any]) -> Tensor:
        """This rank's row of the count table (no host sync): its ids outside [-1, E) are counted on the
        device."""
        head = self._on_device([0, same_digest(a.same()), a.x.shape[0]], torch.int64)
        topk_idx = given["topk_idx"]
        outside = (outside_ids(topk_idx, a.num_experts).sum(dtype=torch.int64).reshape(1)
                   if topk_idx is not None else head[:1])
        return torch.cat([head, outside, a.in_rank.sum(dim=0, dtype=torch.int64),
                          given["per_rank"].to(torch.int64)])

    def _error_row(self) -> Tensor:
        """The row of a rank whose arguments were wrong: the error flag set, the rest 0."""
        row = [0] * table_width(self.group_size)
        row[_ERROR] = 1
        return self._on_device(row, torch.int64)

    def _on_device(self, values: list, dtype: torch.dtype) -> Tensor:
        """A tensor of ``values`` on the Buffer's device without a host sync: on a GPU through pinned memory
        (``torch.tensor(..., device=cuda)`` copies from pageable memory, which waits for the stream)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        staged = torch.tensor(values, dtype=dtype, pin_memory=True)
        return torch.empty(staged.shape, dtype=dtype, device=self.device).copy_(staged, non_blocking=True)

    def _agree_in_table(self, host: Tensor, a: Any, error: ValueError | None) -> None:
        """Every rank raises alike where some rank's arguments were wrong, or differ where they must be the
        same (``checks.agree`` carries the messages then); else nothing."""
        if not bool(host[:, _ERROR].any()) and bool((host[:, _DIGEST] == host[0, _DIGEST]).all()):
            return
        agree(self.runtime.cpu_group, "dispatch", error, {} if error is not None else a.same())
        if error is not None:  # agree raises it; kept in case the gathered rows said otherwise
            raise error

    def _dispatch_counted(self, a: Any, given: dict[str, Any], table: Tensor, host: Tensor | None,
                          synced: bool) -> tuple:
        """After the table: the rank-layout dispatch and DeepEP's outputs and handle. The last output is a
        function returning num_recv_tokens_per_expert_list (it waits for its gather only)."""
        world, rank, dev = self.group_size, self.rank, self.device
        el = a.num_experts // world
        counts = table[:, _DEST : _DEST + world]  # [source, destination], from is_token_in_rank
        counts_host = None
        per_expert: Callable[[], list[int]] = list
        if synced:
            given_host = host[:, _DEST + world : _DEST + 2 * world]
            bad = [r for r in range(world) if not torch.equal(given_host[r], host[r, _DEST : _DEST + world])]
            if bad:
                raise ValueError(
                    f"dispatch: num_tokens_per_rank disagrees with is_token_in_rank.sum(0) on rank(s) {bad}: "
                    f"{given_host[bad[0]].tolist()} vs {host[bad[0], _DEST : _DEST + world].tolist()}"
                )
            max_tokens = self._bucketed(a.fmt.elems, _CARRIER, world, world, int(host[:, _TOKENS].max()))
            counts_host = host[:, _DEST : _DEST + world].tolist()
            num_out = sum(row[rank] for row in counts_host)
            per_expert = self._experts_received(given["per_expert"], el, given["alignment"])
        else:
            num_worst = given["num_worst"]
            max_tokens = self._bucketed(a.fmt.elems, _CARRIER, world, world, -(-num_worst // world))
            # Every rank knows every rank's count on a CPU (all raise alike); on a GPU only its own.
            most = int(host[:, _TOKENS].max()) if host is not None else a.x.shape[0]
            if most > max_tokens:
                raise ValueError(
                    f"dispatch: num_worst_tokens={num_worst} sizes the buffers for {max_tokens} tokens per "
                    f"rank (ceil(num_worst_tokens / {world} ranks), rounded up), but a rank has {most}; pass "
                    f"num_worst_tokens >= num_tokens x num_ranks on every rank"
                )
            num_out = num_worst
        payload = a.fmt.pack(a.x, a.scales, given["topk_idx"], given["topk_weights"])
        ids, zero_w = normal.rank_routing(a.in_rank)
        _, buf = self._buffer(a.fmt.elems, _CARRIER, world, world, max_tokens)
        res = self._dispatch_on(buf, payload, ids, zero_w, "rank")
        rows = min(num_out, world * max_tokens)
        recv_x, recv_scales, gidx, gw = a.fmt.unpack(res.recv_x[:rows], num_out)
        src = res.recv_src[:rows]
        # A synced call knows the count (every row is real); with num_worst_tokens rows past it are masked.
        valid = None if synced else torch.arange(num_out, device=dev) < res.recv_count.to(dev, torch.int64)
        src_rank = torch.div(src, max_tokens, rounding_mode="floor").long()
        src_token = (src % max_tokens).long()
        if rows < num_out:  # num_worst_tokens beyond the buffers' rows: the rest count nowhere
            pad = torch.zeros(num_out - rows, dtype=torch.int64, device=dev)
            src_rank, src_token = torch.cat([src_rank, pad]), torch.cat([src_token, pad])
        recv_idx = recv_w = None
        if gidx is not None:
            local = gidx - rank * el
            here = (local >= 0) & (local < el)
            here = here if valid is None else here & valid[:, None]
            recv_idx = torch.where(here, local, -1).to(given["topk_idx"].dtype)
            recv_w = torch.where(here, gw, 0.0)
        recv_src_idx = (src_token if valid is None else torch.where(valid, src_token, -1)).to(torch.int32)
        entries = (
            self._rank_prefix(counts, counts_host),
            normal.channel_prefix_matrix(a.in_rank, a.channels),
            normal.recv_channel_prefix_matrix(src_rank, src_token, valid, table[:, _TOKENS], a.channels),
            recv_src_idx,
            a.in_rank,
            normal.send_head(a.in_rank, a.channels),
        )
        route = _NormalRoute(res.handle, max_tokens, num_out, counts, counts_host)
        return recv_x, recv_scales, recv_idx, recv_w, per_expert, NormalHandle(entries, route)

    def _rank_prefix(self, counts: Tensor, counts_host: list[list[int]] | None) -> Tensor:
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
        prefix[:, rank] = counts[:, rank].cumsum(dim=0).to(torch.int32)
        return prefix

    def _experts_received(self, per_expert_given: Tensor, el: int, alignment: int) -> Callable[[], list[int]]:
        """Gathers every rank's num_tokens_per_expert (collective, no host sync) and returns the function
        that reads, per local expert, the sum over ranks rounded up to ``alignment``. On a GPU the sums are
        copied into pinned memory behind an event, so reading them waits for the gather, not for the
        dispatch enqueued after it."""
        table = self._all_gather_rows(per_expert_given.to(torch.int64))  # [R, E]
        sums = table[:, self.rank * el : (self.rank + 1) * el].sum(dim=0)
        if not sums.is_cuda:
            values = sums.tolist()
            return lambda: [(n + alignment - 1) // alignment * alignment for n in values]
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def read() -> list[int]:
            ready.synchronize()
            return [(n + alignment - 1) // alignment * alignment for n in host.tolist()]

        return read

    def _refuse_outside_ids(self, outside: list[int], topk_idx: Tensor | None, num_experts: int) -> None:
        """ValueError on every rank when some rank's topk_idx holds ids outside [-1, E) (``outside``: each
        rank's count, from the table): that rank names its first such id, the others name that rank and
        its message (``checks.agree``, a collective only on this error's path)."""
        bad = [r for r, n in enumerate(outside) if n]
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

