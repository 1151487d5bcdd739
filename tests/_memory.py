"""Test helper, imported as ``from _memory import share_no_byte`` (tests/ is on the path, as for ``_worlds``):
whether tensors share memory."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def share_no_byte(tensors: Iterable[torch.Tensor]) -> bool:
    """No two of ``tensors`` share a byte of memory (their [data_ptr, data_ptr + nbytes) spans)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
