"""Rank-layout layout kernel: the layout kernel (kernels/layout.py) compiled with ``by_rank``.

It also counts each warp's tokens per destination rank, exchanges them with the count row, and gives
each (token, destination rank) one row; with K <= 32 a token's pairs find each other by shuffles
(``token_lanes``). Compiled apart rather than as a run-time branch so that the expert layout's kernel
carries none of it: as one kernel with a run-time branch, the expert layout's kernel went from 79.1 to
137.6 us at 4096 tokens (2x H200) when the shuffles were added for the rank layout.
"""

from __future__ import annotations

from cute_ep.kernels.layout import LayoutKernel


class RankLayoutKernel(LayoutKernel):
    """The rank layout's layout kernel (see the module docstring)."""

    by_rank = True
