"""Low-latency dispatches replayed from CUDA graphs (``DispatchGraphs``), on the kernels' backend.

A low-latency dispatch enqueues five launches (the ids' clamp and int32 copy, the module, the padded
layout, the FP8 scales' copy), and their host work is most of the call: on an H200 host (2026-11-28) a
low-latency pair took 170-180 us of host time, 25 us of it in the launches' own C calls. A CUDA graph
replays all five in about 2.6 us of host time. So a dispatch whose argument signature (shapes, dtypes,
strides, devices, flags) and buffer parity repeat runs as: x and topk_idx copied into inputs kept for the
graphs (two copies: the graph reads fixed addresses), the graph replayed, the statistics added. Its outputs
are the same tensors an eager call of that parity returns (the Buffer keeps them per parity), so callers
see no difference.

When: the first call of a (signature, parity) runs eagerly (it makes every tensor the calls keep), the
second captures its graph (nothing runs while capturing) and replays it, later ones replay. Not inside a
caller's own capture, not on the communication stream (``async_finish`` or ``previous_event``), never where
the padded layout runs in torch. The kept inputs are written on one stream: when the caller's current
stream changes, the new one first waits for the old. Captures are budgeted (``CAPTURE_BUDGET``): a program
whose signatures rarely repeat stops capturing instead of paying a capture per call.
``CUTE_EP_LOW_LATENCY_GRAPHS=0`` turns the graphs off (every call eager).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CAPTURE_BUDGET", "DispatchGraphs", "GRAPHS_ENV_VAR", "MAX_GRAPHS"]

GRAPHS_ENV_VAR = "CUTE_EP_LOW_LATENCY_GRAPHS"
MAX_GRAPHS = 16  # graphs kept per Buffer (least recently used dropped first)
CAPTURE_BUDGET = (8, 16)  # captures always allowed, then one more per this many replays


class _Plan:
    """One (signature, parity)'s graph: ``buf`` the EpBuffer it launches on (a rebuilt buffer needs a new
    graph), ``replay`` (None until captured), ``result`` what the captured call returned."""

    __slots__ = ("buf", "replay", "result")

    def __init__(self, buf: Any) -> None:
        self.buf, self.replay, self.result = buf, None, None


class DispatchGraphs:
    """The CUDA graphs of one Buffer's low-latency dispatches (module docstring).

    capture: ``capture(enqueue) -> (replay, result)`` records ``enqueue()``'s launches and returns a
    function replaying them and what ``enqueue`` returned (default ``capture_on_side_stream``; tests pass
    their own). stream_handle / wait_for / capturing: the current stream's raw handle, a function making
    the current stream wait for the stream of a given handle, whether the current stream is capturing
    (defaults: torch's)."""

    def __init__(self, capture: Callable | None = None, stream_handle: Callable[[], int] | None = None,
                 wait_for: Callable[[int], None] | None = None,
                 capturing: Callable[[], bool] | None = None) -> None:
        self.enabled = os.environ.get(GRAPHS_ENV_VAR, "1") != "0"
        self._capture = capture or capture_on_side_stream
        self._capturing = capturing or torch.cuda.is_current_stream_capturing
        self._stream_handle = stream_handle or _current_stream_handle
        self._wait_for = wait_for or _wait_for_stream
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stream: int | None = None  # the stream the kept inputs were last written on
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        """Drop every graph and kept input (the buffers they launch on are being freed)."""
        self._plans.clear()
        self._inputs.clear()
        self._stream = None

    def dispatch(self, sig: tuple, parity: int, buf: Any, x: torch.Tensor, topk_idx: torch.Tensor,
                 enqueue: Callable[[torch.Tensor, torch.Tensor], Any]) -> tuple[bool, Any]:
        """``(True, result)`` where the graph of the call's signature ``sig`` at buffer ``parity`` ran the
        call on copies of x and topk_idx (``enqueue(x, topk_idx)``'s result at the capture: the same
        tensors every time), else ``(False, None)``: the caller runs the call eagerly. ``buf``: the
        EpBuffer the call launches on."""
        if not self.enabled or self._capturing():
            return False, None
        key = (sig, parity)
        plan = self._plans.get(key)
        if plan is None or plan.buf is not buf:  # first sighting (or a rebuilt buffer): eager, noted
            self._remember(key, _Plan(buf))
            return False, None
        self._plans.move_to_end(key)
        if plan.replay is None and not self._may_capture():
            return False, None
        xs, ids = self._kept_inputs(sig, x, topk_idx)
        self._order_after_last_stream()
        xs.copy_(x)
        ids.copy_(topk_idx)
        if plan.replay is None:
            plan.replay, plan.result = self._capture(lambda: enqueue(xs, ids))
            self.captures += 1
        plan.replay()
        self.replays += 1
        return True, plan.result

    def _may_capture(self) -> bool:
        always, per = CAPTURE_BUDGET
        return self.captures < always or self.replays >= per * self.captures

    def _remember(self, key: tuple, plan: _Plan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > MAX_GRAPHS:
            self._plans.popitem(last=False)

    def _kept_inputs(self, sig: tuple, x: torch.Tensor, topk_idx: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies' storage for x and topk_idx, one pair per signature: both parities' graphs
        read them, in stream order."""
        kept = self._inputs.get(sig)
        if kept is None:
            kept = self._inputs[sig] = (torch.empty(x.shape, dtype=x.dtype, device=x.device),
                                              torch.empty(topk_idx.shape, dtype=topk_idx.dtype,
                                                          device=topk_idx.device))
        return kept

    def _order_after_last_stream(self) -> None:
        """The kept inputs are rewritten in stream order: a different current stream first waits for the
        one that wrote (and whose graphs read) them last."""
        now = self._stream_handle()
        if self._stream is not None and now != self._stream:
            self._wait_for(self._stream)
        self._stream = now


def capture_on_side_stream(enqueue: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """``enqueue()``'s launches captured into a CUDA graph on a side stream that first waits for the current
    one (nothing runs while capturing; no host sync): (its replay, enqueue's result). ``thread_local``:
    other threads' CUDA calls meanwhile neither fail the capture nor are captured."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            result = enqueue()
        finally:
            graph.capture_end()
    return graph.replay, result


def _current_stream_handle() -> int:
    from cute_ep.launcher import current_stream_handle

    return current_stream_handle(torch.cuda.current_device())


def _wait_for_stream(handle: int) -> None:
    torch.cuda.current_stream().wait_stream(torch.cuda.ExternalStream(handle))
