"""``StatusChecks``: what ``EpBuffer`` tells the host from its status block (``cute_ep.status``): peers
that never arrived, kernels that did not run, refused inputs, and rows dropped beyond the expert
capacity, with their accounting under both overflow policies.
"""

from __future__ import annotations

from typing import Any

import torch

from cute_ep.kernels.config import OP_COMBINE, OP_DISPATCH, OP_LAYOUT
from cute_ep.status import capacity_error

__all__ = ["StatusChecks"]


class StatusChecks:
    """The host-visible checks of ``EpBuffer``. They use its ``cfg``, ``rank``, ``status`` (the
    ``StatusBlock``), ``dropped`` (the device's drop counts), ``_calls`` (launches per operation) and
    ``_drops`` (counts read from the device and not reported yet)."""

    def check_faults(self) -> None:
        """Raise ``PeerTimeout`` if a kernel of this buffer timed out waiting for a peer (host sync).

        ``dispatch`` and ``combine`` check; after ``launch_*`` calls (e.g. CUDA graph replays) call it
        before trusting the results."""
        self.status.check_faults(self.rank)

    def check_ran(self) -> None:
        """Raise ``PeerTimeout`` (a wait timed out), ``KernelDidNotRun`` (a kernel did not complete: every
        operation's epoch must equal its launches) or ``ValueError`` (the latest dispatch refused invalid
        topk_idx on some rank) after ``launch_*`` calls, ``dispatch(sync=False)`` or ``combine`` (host
        sync)."""
        status = self.status.read()
        self._check_ran(status, OP_LAYOUT, OP_DISPATCH, OP_COMBINE)
        refused = self.status.refused_inputs(status)
        if refused is not None:
            raise ValueError(f"dispatch: {refused}")

    def dropped_rows(self) -> torch.Tensor:
        """Rows dropped beyond ``cfg.expert_capacity`` per global expert ([E] int64 on the CPU) since the
        last ``dropped_rows``/``check_capacity``/``dispatch`` report; resets the count (host sync)."""
        counts = self.dropped.cpu().to(torch.int64)
        self.dropped.zero_()
        return counts + self._pending_drops()

    def check_capacity(self, result: Any = None) -> None:
        """With on_overflow="raise": raise ``CapacityExceeded`` (carrying ``result``, if given) if rows
        were dropped since the last report (host sync; call it after ``launch_dispatch`` / graph
        replays). Every rank raises alike. With "drop" the drops stay counted for ``dropped_rows``."""
        self._take_drops(self.dropped.cpu(), result)

    def _pending_drops(self) -> torch.Tensor:
        pending, self._drops = self._drops, torch.zeros(self.cfg.num_experts, dtype=torch.int64)
        return pending

    def _take_drops(self, dropped: Any, result: Any = None) -> None:
        """Account for drop counts just read (a tensor, or the status read's numpy array): raise (policy
        "raise") or keep them for dropped_rows."""
        if not dropped.any():  # the common case, decided before any copy
            return
        counts = torch.as_tensor(dropped).to(torch.int64)  # a copy: ``dropped`` may alias the status block
        self.dropped.zero_()  # enqueued after the kernels that counted them: the next call counts afresh
        if self.cfg.on_overflow == "raise":
            error = capacity_error(self.cfg, counts + self._pending_drops(), result)
            if error is not None:
                raise error
            return
        self._drops += counts

    def _check_ran(self, status: dict[str, Any], *ops: int, running: int | None = None) -> None:
        """Raise if a kernel timed out (``PeerTimeout``) or did not run: its epoch must equal the number
        of launches so far (``running``: see ``StatusBlock.check_ran``)."""
        self.status.check_ran(self.rank, status, self._calls, *ops, running=running)
