"""Rank-layout layout kernel: the layout kernel (kernels/layout.py) compiled with ``by_rank``.

It takes a lane per token instead of per pair: counts each warp's tokens per destination rank with a
ballot per rank, exchanges them with the count row, and gives each (token, destination rank) one row.
Compiled apart rather than as a run-time branch so that the expert layout's kernel carries none of it:
as one kernel with a run-time branch, the expert layout's kernel went from 79.1 to 137.6 us at 4096
tokens (2x H200) when an earlier form of the rank steps (shuffles per pair) was added.
"""

from __future__ import annotations

import cutlass.cute as cute

from cute_ep.kernels.buffers import EpParams
from cute_ep.kernels.layout import LayoutKernel
from cute_ep.kernels.naming import profiler_name


class RankLayoutKernel(LayoutKernel):
    """The rank layout's layout kernel (see the module docstring)."""

    by_rank = True

    @cute.kernel
    def kernel(self, p: EpParams):
        self.route(p)


profiler_name(RankLayoutKernel.kernel, "rank_layout")
