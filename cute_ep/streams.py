"""Where a call's kernels run: the ``stream`` / ``previous_event`` arguments of ``EpBuffer.dispatch``
and ``EpBuffer.combine`` (the caller's current stream, or a side stream ordered after it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

__all__ = ["join", "on_stream"]

_CURRENT_STREAM = nullcontext()  # the body of a call without ``stream`` runs on the current stream


def on_stream(device: torch.device, stream: torch.cuda.Stream | None, previous_event: torch.cuda.Event | None,
              *used: torch.Tensor) -> AbstractContextManager[torch.cuda.Stream | None]:
    """Enqueue the body on ``stream`` after ``previous_event`` (or after the caller's current stream);
    the caller's tensors it uses stay allocated until ``stream`` is done with them. Without a stream,
    the current one (waiting for ``previous_event`` first, if given; the context's value is then
    None)."""
    if stream is None:
        if previous_event is not None:
            torch.cuda.current_stream(device).wait_event(previous_event)
        return _CURRENT_STREAM  # no generator to run: this is every plain call's path
    return _on_side_stream(device, stream, previous_event, used)


@contextmanager
def _on_side_stream(device: torch.device, stream: torch.cuda.Stream, previous_event: torch.cuda.Event | None,
                    used: tuple[torch.Tensor, ...]) -> Iterator[torch.cuda.Stream]:
    caller = torch.cuda.current_stream(device)
    if previous_event is not None:
        stream.wait_event(previous_event)
    else:
        stream.wait_stream(caller)
    for tensor in used:
        tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        yield stream


def join(stream: torch.cuda.Stream | None = None, event: torch.cuda.Event | None = None,
         device: torch.device | None = None) -> None:
    """The caller's current stream waits for work enqueued elsewhere: for all of ``stream``'s, or for
    ``event`` (on ``device``, default ``stream``'s); nothing when neither is given (the work ran on the
    current stream)."""
    if event is not None:
        torch.cuda.current_stream(device if device is not None else stream.device).wait_event(event)
    elif stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
