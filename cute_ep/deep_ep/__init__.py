"""``cute_ep.deep_ep``: DeepEP v1.2.1's Python API (``deep_ep``) on cute-ep's backends.

Switching is one line::

    import cute_ep.deep_ep as deep_ep      # instead of: import deep_ep

    buffer = deep_ep.Buffer(group, num_nvl_bytes=2 << 30)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    ...

``Buffer``, ``Config``, ``EventOverlap`` (and ``EventHandle``) have DeepEP's names, arguments, shapes and
return tuples. On an NCCL group with CUDA the calls run cute-ep's CuTe kernels on NVSHMEM (``EpBuffer``);
on a gloo group with CPU tensors the torch reference (``ReferenceEpBuffer``), with the same results.
What differs and what is refused: the docstrings of ``cute_ep.deep_ep.buffer.Buffer`` and docs/deep_ep.md.
"""

from __future__ import annotations

from cute_ep.deep_ep.buffer import Buffer, LowLatencyHandle, NormalHandle
from cute_ep.deep_ep.utils import Config, EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "LowLatencyHandle", "NormalHandle"]
