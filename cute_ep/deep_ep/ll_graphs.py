"""Low-latency calls replayed from CUDA graphs (``LowLatencyGraphs``), on the kernels' backend.

A low-latency dispatch enqueues up to four launches (the ids' clamp and int32 copy, the module, ue8m0's
scales' copy) and a combine one launch of the module, and their host work is most of the call: on an H200 host
(2026-11-28) a low-latency pair (then with one launch more, a padded-layout kernel) took 170-180 us of host
time, of which the combine's launch took 34.5 us. A CUDA graph replays a call's launches in about 2.6 us of
host time. Calls with ``return_recv_hook`` (two launches, the second from the hook) are not replayed. A graph
reads the addresses it was captured with, so a call is replayed only where its tensors are where the graph's
were:

* **direct** (dispatch and combine): keyed by the call's argument signature (shapes, dtypes, strides,
  devices, flags), its buffer parity and the addresses of every tensor the launches read or write (the
  caller's x, ids, weights, combine output; the Buffer's per-parity tensors). A caller that passes the
  same tensors again, or new ones the allocator put at the same places (a decode loop), gets the graph
  with nothing copied. Correct by construction: the graph reads and writes exactly the addresses the
  eager call would.
* **copied** (dispatch): keyed by the signature and parity alone; x and topk_idx are first copied into
  inputs kept for the graphs (two copies), for callers whose tensors move between calls.

The outputs are the tensors an eager call of that parity returns (the Buffer keeps them per parity), so
callers see no difference. When: a key's first sighting runs eagerly (it makes every tensor the calls
keep), its second captures its graph (nothing runs while capturing) and replays it, later ones replay.
A dispatch tries its direct key first and falls back to the copied one while its direct key is new.
Not inside a caller's own capture, not on the communication stream (``async_finish`` or
``previous_event``), never where the padded layout runs in torch. The kept inputs are written on one
stream: when the caller's current stream changes, the new one first waits for the old. Captures are
budgeted (``CAPTURE_BUDGET``): a program whose keys rarely repeat stops capturing instead of paying a
capture per call. ``CUTE_EP_LOW_LATENCY_GRAPHS=0`` turns the graphs off (every call eager).
"""

from __future__ import annotations

import collections
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CAPTURE_BUDGET", "GRAPHS_ENV_VAR", "LowLatencyGraphs", "MAX_GRAPHS", "MAX_RECALLED",
           "MAX_SIGHTINGS", "combine_call_key", "combine_key", "direct_key", "dispatch_call_key"]

GRAPHS_ENV_VAR = "CUTE_EP_LOW_LATENCY_GRAPHS"
MAX_GRAPHS = 16  # graphs kept per Buffer (least recently used dropped first)
MAX_SIGHTINGS = 64  # keys seen once and remembered, waiting for a second sighting
MAX_RECALLED = 4 * MAX_GRAPHS  # call keys remembered (``remember``) before starting over
CAPTURE_BUDGET = (MAX_GRAPHS, 16)  # captures always allowed, then one more per this many replays


class _Plan:
    """One key's captured graph: ``buf`` the EpBuffer it launches on (a rebuilt buffer needs a new graph),
    ``replay`` its replay, ``result`` what the captured call returned, ``dropped`` once no longer kept."""

    __slots__ = ("buf", "replay", "result", "dropped")

    def __init__(self, buf: Any, replay: Callable[[], None], result: Any) -> None:
        self.buf, self.replay, self.result, self.dropped = buf, replay, result, False


class LowLatencyGraphs:
    """The CUDA graphs of one Buffer's low-latency calls (module docstring).

    capture: ``capture(enqueue) -> (replay, result)`` records ``enqueue()``'s launches and returns a
    function replaying them and what ``enqueue`` returned (default ``capture_on_side_stream``; tests pass
    their own). stream_handle / wait_for / capturing: the current stream's raw handle, a function making
    the current stream wait for the stream of a given handle, whether the current stream is capturing
    (defaults: torch's). ``captures`` / ``replays``: how many so far, per kind ("direct", "copied",
    "combine")."""

    def __init__(self, capture: Callable | None = None, stream_handle: Callable[[], int] | None = None,
                 wait_for: Callable[[int], None] | None = None,
                 capturing: Callable[[], bool] | None = None) -> None:
        self.enabled = os.environ.get(GRAPHS_ENV_VAR, "1") != "0"
        self._capture = capture or capture_on_side_stream
        self._capturing = capturing or torch.cuda.is_current_stream_capturing
        self._stream_handle = stream_handle or _current_stream_handle
        self._wait_for = wait_for or _wait_for_stream
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._recalled: dict[tuple, tuple[tuple, _Plan, Any]] = {}  # see remember()
        self._seen: OrderedDict[tuple, Any] = OrderedDict()  # key -> the buffer of its first sighting
        self._inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stream: int | None = None  # the stream the kept inputs were last written on
        self.captures: collections.Counter[str] = collections.Counter()
        self.replays: collections.Counter[str] = collections.Counter()

    def clear(self) -> None:
        """Drop every graph, sighting and kept input (the buffers they launch on are being freed)."""
        for plan in self._plans.values():
            plan.dropped = True
        self._plans.clear()
        self._recalled.clear()
        self._seen.clear()
        self._inputs.clear()
        self._stream = None

    def dispatch(self, sig: tuple, parity: int, buf: Any, x: torch.Tensor, topk_idx: torch.Tensor,
                 stats: torch.Tensor | None, enqueue: Callable[..., Any]) -> tuple[str | None, Any]:
        """``(how, result)`` where a graph ran the call of signature ``sig`` at buffer ``parity``
        (``enqueue(x, topk_idx, add_to)``'s result at the capture: the same tensors every time): how =
        "direct", its graph on x, topk_idx and the statistics ``stats`` (None: none) where they are (x
        contiguous; the graph adds the statistics), or "copied", its graph on copies of x and topk_idx
        (the caller adds the statistics); else ``(None, None)``: the caller runs the call eagerly.
        ``buf``: the EpBuffer it launches on."""
        if not self._usable():
            return None, None
        if x.is_contiguous():  # a new direct key is only noted: the copied graph may run meanwhile
            ran, result = self._run(direct_key(sig, parity, x, topk_idx, stats), buf,
                                    lambda: enqueue(x, topk_idx, stats))
            if ran:
                return "direct", result
        kept: list[torch.Tensor] = []  # made at the first capture (before() runs before enqueue())

        def copy_inputs() -> None:
            kept[:] = self._kept_inputs(sig, x, topk_idx)
            self._order_after_last_stream()
            kept[0].copy_(x)
            kept[1].copy_(topk_idx)

        ran, result = self._run(("copied", sig, parity), buf, lambda: enqueue(*kept, None), copy_inputs)
        return ("copied" if ran else None), result

    def combine(self, key: tuple, buf: Any, enqueue: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, result)`` where the graph of ``key`` (``combine_key``: the call's signature and the
        addresses of every tensor its launch reads or writes) ran ``enqueue()``'s launches, else
        ``(False, None)``."""
        if not self._usable():
            return False, None
        return self._run(key, buf, enqueue)

    def replay(self, key: tuple, buf: Any) -> tuple[bool, Any]:
        """``(True, result)`` where the graph of ``key`` (``direct_key`` or ``combine_key``) is captured on
        ``buf`` and was replayed now, else ``(False, None)`` with nothing noted (the call's full path then
        notes, captures or replays it): a repeated call's replay with none of that path's host work."""
        if not self._usable():
            return False, None
        plan = self._plans.get(key)
        if plan is None or plan.buf is not buf:
            return False, None
        return True, self._replay(key, plan)

    def remember(self, call_key: tuple, key: tuple, extra: Any) -> None:
        """Note that a call whose arguments give ``call_key`` (a cheaper key, built from the tensors'
        addresses and layouts alone: ``dispatch_call_key``, ``combine_call_key``) replayed the captured graph
        of ``key``, with what the caller needs to replay it again (``extra``): ``recall`` finds it."""
        plan = self._plans.get(key)
        if plan is None:
            return
        if len(self._recalled) >= MAX_RECALLED:  # many addresses: start over
            self._recalled.clear()
        self._recalled[call_key] = (key, plan, extra)

    def recall(self, call_key: tuple) -> tuple[tuple, _Plan, Any] | None:
        """``(key, plan, extra)`` remembered for ``call_key`` while its graph is kept and may replay now
        (not while capturing), else None: replay it with ``replay_plan``."""
        got = self._recalled.get(call_key)
        if got is None or got[1].dropped or not self._usable():
            return None
        return got

    def replay_plan(self, key: tuple, plan: _Plan) -> Any:
        """Replay a recalled plan (``recall``): what its captured call returned."""
        return self._replay(key, plan)

    def _usable(self) -> bool:
        return self.enabled and not self._capturing()

    def _replay(self, key: tuple, plan: _Plan) -> Any:
        self._plans.move_to_end(key)
        plan.replay()
        self.replays[key[0]] += 1
        return plan.result

    def _run(self, key: tuple, buf: Any, enqueue: Callable[[], Any],
             before: Callable[[], None] | None = None) -> tuple[bool, Any]:
        """Replay ``key``'s graph, or capture it at its second sighting on ``buf`` (budget allowing) and
        replay it, ``before()`` first in both cases; else note the sighting: ``(False, None)``."""
        plan = self._plans.get(key)
        captured = plan is not None and plan.buf is buf
        if not captured and not (self._seen.get(key) is buf and self._may_capture()):
            self._note(key, buf)
            return False, None
        if before is not None:
            before()
        if not captured:
            del self._seen[key]
            plan = self._plans[key] = _Plan(buf, *self._capture(enqueue))
            self.captures[key[0]] += 1
            while len(self._plans) > MAX_GRAPHS:
                self._plans.popitem(last=False)[1].dropped = True
        return True, self._replay(key, plan)

    def _note(self, key: tuple, buf: Any) -> None:
        """A first sighting (or one on a rebuilt buffer): remembered until a second comes."""
        old = self._plans.pop(key, None)
        if old is not None:
            old.dropped = True
        self._seen[key] = buf
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_SIGHTINGS:
            self._seen.popitem(last=False)

    def _may_capture(self) -> bool:
        always, per = CAPTURE_BUDGET
        done = sum(self.captures.values())
        return done < always or sum(self.replays.values()) >= per * done

    def _kept_inputs(self, sig: tuple, x: torch.Tensor, topk_idx: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies' storage for x and topk_idx, one pair per signature: both parities' copied
        graphs read them, in stream order."""
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


def direct_key(sig: tuple, parity: int, x: torch.Tensor, topk_idx: torch.Tensor,
               stats: torch.Tensor | None) -> tuple:
    """A dispatch's direct key: its signature, buffer parity and the addresses of x, topk_idx and the
    statistics (0: none)."""
    stats_at = 0 if stats is None else stats.data_ptr()
    return ("direct", sig, parity, x.data_ptr(), topk_idx.data_ptr(), stats_at)


def dispatch_call_key(parity: int, x: Any, topk_idx: Any, stats: Any, *values: Any) -> tuple | None:
    """A dispatch's call key (``LowLatencyGraphs.remember``): the addresses, shapes, strides and dtypes of
    x, topk_idx and the statistics (None: none), the plain ``values`` and the buffer ``parity``; None
    unless every tensor is a plain ``torch.Tensor`` (then the full path decides). It holds all that the
    call's signature and direct key hold: a device is known by its addresses (CUDA's unified addressing)."""
    if type(x) is not torch.Tensor or type(topk_idx) is not torch.Tensor:
        return None
    if stats is None:
        at = None
    elif type(stats) is torch.Tensor:
        at = (stats.data_ptr(), stats.shape, stats.stride(), stats.dtype)
    else:
        return None
    return (parity, x.data_ptr(), x.shape, x.stride(), x.dtype, topk_idx.data_ptr(), topk_idx.shape,
            topk_idx.stride(), topk_idx.dtype, at, *values)


def combine_call_key(parity: int, x: Any, topk_weights: Any, sent: Any, *values: Any) -> tuple | None:
    """A combine's call key (``LowLatencyGraphs.remember``): the buffer ``parity``, the addresses, shapes,
    strides and dtypes of x and topk_weights, the dispatch's own handle ``sent`` by identity (the remembered
    entry holds it: its id is not reused meanwhile) and the plain ``values``; None unless x and
    topk_weights are plain ``torch.Tensor``s."""
    if type(x) is not torch.Tensor or type(topk_weights) is not torch.Tensor:
        return None
    return (parity, x.data_ptr(), x.shape, x.stride(), x.dtype, topk_weights.data_ptr(), topk_weights.shape,
            topk_weights.stride(), topk_weights.dtype, id(sent), *values)


def combine_key(sig: tuple, *tensors: torch.Tensor) -> tuple:
    """A combine's key: its signature and the addresses of ``tensors``, every tensor its launch reads or
    writes."""
    return ("combine", sig, *(t.data_ptr() for t in tensors))


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
