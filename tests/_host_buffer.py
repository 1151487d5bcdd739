"""Test helper, imported as ``from _host_buffer import host_buffer`` (tests/ is on the path, as for
``_worlds``): an ``EpBuffer`` for CPU tests of its host logic, built without ``__init__`` (no runtime, no
compiled module, no GPU)."""

from __future__ import annotations

import torch

from cute_ep.buffer import EpBuffer
from cute_ep.kernels.config import EpConfig
from cute_ep.spare import SpareOutputs, handle_storage
from cute_ep.status import StatusBlock


def host_buffer(cfg: EpConfig, **attrs) -> EpBuffer:
    """An ``EpBuffer`` of ``cfg`` on the CPU (rank 0) with the state ``EpBuffer.__init__`` gives every
    buffer: the status block and its views, no launch counted, no dispatch sent, no drops, the dispatch
    handle's storage sets; then ``attrs`` set as given (a test's launch recorder, stand-ins, ...)."""
    buf = object.__new__(EpBuffer)
    buf.cfg, buf.rank, buf.device, buf._device_index, buf._closed = cfg, 0, torch.device("cpu"), 0, False
    buf.status = StatusBlock(cfg, "cpu")
    for name, view in buf.status.views.items():  # epochs, fault, num_recv, dropped: one host copy
        setattr(buf, name, view)
    buf._calls, buf._sent, buf._latest_recv = [0, 0, 0], None, None
    buf._drops = torch.zeros(cfg.num_experts, dtype=torch.int64)
    # dispatch()'s handle sets made ahead (cute_ep.spare); no CUDA graph capture on the CPU
    buf._handle_sets = SpareOutputs(handle_storage, capturing=lambda: False)
    for name, value in attrs.items():
        setattr(buf, name, value)
    return buf
