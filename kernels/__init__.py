"""The CuTe DSL kernels and what describes them.

Importing this package imports no GPU library: ``EpConfig`` (sizes and constraints, kernels/config.py)
and ``BUFFERS`` (the one table of buffers, kernels/buffers.py) are plain Python. The kernels themselves
(one file each: layout, dispatch, fanout, combine, reduce_push, partial_sum and the rank layout's
rank_layout, rank_dispatch, rank_combine) are imported by
``kernels/module.py`` when a buffer compiles them.
"""

from cute_ep.kernels.buffers import BUFFERS, Buffer, packed_fp8_row_bytes
from cute_ep.kernels.config import DISPATCH_ALGORITHMS, MODES, ConfigError, EpConfig
from cute_ep.kernels.variants import COMBINE_ALGORITHMS

__all__ = [
    "BUFFERS",
    "COMBINE_ALGORITHMS",
    "DISPATCH_ALGORITHMS",
    "MODES",
    "Buffer",
    "ConfigError",
    "EpConfig",
    "packed_fp8_row_bytes",
]
