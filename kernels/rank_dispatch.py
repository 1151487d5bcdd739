"""Rank-layout dispatch kernel: one row per (token, destination rank), at the row the layout kernel gave.

The dispatch kernel (kernels/dispatch.py) compiled with ``by_rank``: only a token's first pair bound
for a rank sends the row (also to this rank itself), with the token's local expert ids and weights
(``recv_topk_idx`` / ``recv_topk_w``) and ``recv_src`` = rank * max_tokens + t; no fan-out follows.
Compiled apart rather than as a run-time branch so that the expert layout's kernel carries none of it.
"""

from __future__ import annotations

import cutlass.cute as cute

from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.dispatch import DispatchKernel
from cute_ep.kernels.naming import profiler_name


class RankDispatchKernel(DispatchKernel):
    """The rank layout's dispatch (see the module docstring)."""

    by_rank = True

    @cute.kernel
    def kernel(self, p: EpParams):
        self.send(p)


profiler_name(RankDispatchKernel.kernel, "rank_dispatch")
