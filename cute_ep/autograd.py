"""Differentiable dispatch and combine: ``combine(expert(dispatch(x)))`` trains.

    res = cute_ep.autograd.dispatch(buf, x, topk_idx, topk_weights)   # res.recv_x carries x's graph
    y = expert(res.recv_x, res.tokens_per_expert)                     # any differentiable torch ops
    out = cute_ep.autograd.combine(buf, y, topk_weights, res.handle)  # grads flow to y and the weights
    loss(out).backward()                                              # collective: every rank

``buf`` is an ``EpBuffer`` (GPU) or a ``ReferenceEpBuffer`` (CPU); both expose the same calls, and the
backward passes are built from those calls only:

* dispatch copies x[t] to the slot of every valid (t, k), so grad_x[t] = sum over k of
  grad_recv[slot(t, k)]: a combine of the gradients with all weights 1 (exact: x * 1.0 in fp32).
* combine computes out[t] = sum_k w[t, k] * y[slot(t, k)], so
  - grad_y[slot(t, k)] = w[t, k] * grad_out[t]: a dispatch of grad_out with the same routing (slots
    are a deterministic function of the routing in "scatter" mode, so the rows land where y's rows
    were), scaled on the expert side by the weight that arrived with each row;
  - grad_w[t, k] = <grad_out[t], y[slot(t, k)]>: the K rows y[slot(t, k)] come back with K combines,
    each keeping only column k with weight 1 (exact copies), and the dot products run in fp32.

Constraints: mode "scatter" only (atomic slots differ from call to call, so a backward dispatch
would not land where the forward's rows were); every rank runs forward and backward in the same
order (every step is a collective); the handle must come from the dispatch whose rows ``y`` holds,
and that dispatch must be the buffer's most recent one when combine runs forward. Gradients are
rounded to ``cfg.dtype`` where they cross ranks (they travel as rows of that type). With a capacity
factor, combine's backward dispatch of ``grad_out`` drops exactly the pairs the forward dropped (same
routing, same rule) and counts them again: use ``on_overflow="drop"`` when training with a capacity
factor, or the backward raises ``CapacityExceeded`` whenever the forward dropped rows. FP8 dispatch is
not differentiable here (the forward rows are quantized). Every combine here is the "pull" combine,
also on a buffer built for the reduced one: its weights (and, in the backward, its ids) are not the
ones the dispatch sent.

Without a host sync (``sync=False``, e.g. inside ``cute_ep.MoELayer`` or a CUDA graph): every dispatch,
the forward's and the one in combine's backward, returns views of ``cfg.capacity`` rows (the worst
case) and exact ``tokens_per_expert``; ``y`` then has ``cfg.capacity`` rows too (rows past the count are
never read). ``stream`` (GPU buffer only): the buffer's kernels run on that stream, forward and
backward (a communication stream beside the GEMMs); the caller's current stream waits for them before
it uses their results. ``previous_event``: the forward dispatch / combine waits for it instead of the
whole current stream (work enqueued on the current stream after the event overlaps it).

Cost of a backward: combine's is one dispatch plus K combines, dispatch's one combine. A fused
backward kernel (one pass for grad_y and grad_w) is the obvious next step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from cute_ep.api import DispatchHandle, DispatchResult
from cute_ep.input_checks import InputTypeError, check_tensor_args
from cute_ep.streams import join

__all__ = ["combine", "dispatch"]


def _check_mode(mode: str) -> None:
    if mode != "scatter":
        raise ValueError(
            f"differentiable dispatch/combine need mode 'scatter' (atomic slots change between the "
            f"forward and the backward dispatch), got {mode!r}"
        )


def _check_tensors(buf: Any, *args: tuple[str, Any, str, torch.dtype | None]) -> None:
    """InputTypeError for the first (name, value, expected, dtype) whose value is not a tensor; dtype
    None: the buffer's ``cfg.dtype``, whose name ``expected`` may hold as ``{dtype}``, and its rows'
    width as ``{hidden}``."""
    cfg = getattr(buf, "cfg", None)
    rows = getattr(cfg, "dtype", torch.float32)
    hidden = getattr(cfg, "hidden", "H")
    check_tensor_args(getattr(buf, "device", "cpu"),
                      *((name, value, expected.format(dtype=rows, hidden=hidden), dtype or rows)
                        for name, value, expected, dtype in args))


def _check_weights(topk_weights: Tensor, handle: DispatchHandle) -> None:
    """combine's ``topk_weights`` replace the handle's: the same [T, K] shape, a floating dtype. (The
    GPU kernels read T * K weights from where they are: a smaller tensor would be read past its end.)"""
    want = tuple(handle.topk_idx.shape)
    if tuple(topk_weights.shape) != want or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights must be {list(want)} (num_tokens x topk of the handle) and floating point, got "
            f"{list(topk_weights.shape)} {topk_weights.dtype}: pass the [T, K] router weights of the tokens "
            f"that the dispatch of this handle sent"
        )


def _rows(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.detach().to(dtype).contiguous()


def _on(stream: Any, previous_event: Any = None) -> dict:
    """The stream arguments of a buffer call: none at all without a stream or event (the host
    backends take no ``stream=``)."""
    kw = {}
    if stream is not None:
        kw["stream"] = stream
    if previous_event is not None:
        kw["previous_event"] = previous_event
    return kw



class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, buf: Any, topk_idx: Tensor, topk_weights: Tensor, mode: str,
                box: dict, sync: bool, stream: Any, previous_event: Any) -> Tensor:
        res = buf.dispatch(x.detach(), topk_idx, topk_weights, mode=mode, sync=sync,
                           **_on(stream, previous_event))
        join(event=res.event, device=x.device)  # the rows are written on ``stream``
        box["result"] = res
        ctx.buf, ctx.handle, ctx.x_dtype, ctx.stream = buf, res.handle, x.dtype, stream
        # The buffer's rows are overwritten by the next dispatch: the graph keeps its own copy.
        return res.recv_x.clone()

    @staticmethod
    def backward(ctx: Any, grad_recv: Tensor) -> tuple:
        buf, h = ctx.buf, ctx.handle
        ones = torch.ones_like(h.topk_weights)
        grad_rows = _rows(grad_recv, buf.cfg.dtype)
        grad_x = buf.combine(grad_rows, replace(h, topk_weights=ones), algorithm="pull", **_on(ctx.stream))
        join(ctx.stream)
        return grad_x.to(ctx.x_dtype), None, None, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, topk_weights: Tensor, buf: Any, handle: DispatchHandle, sync: bool,
                stream: Any, previous_event: Any) -> Tensor:
        w = topk_weights.detach().to(torch.float32).contiguous()
        out = buf.combine(_rows(y, buf.cfg.dtype), replace(handle, topk_weights=w), algorithm="pull",
                          **_on(stream, previous_event))
        join(stream)
        ctx.save_for_backward(y.detach(), w)
        ctx.buf, ctx.handle, ctx.y_dtype, ctx.w_dtype = buf, handle, y.dtype, topk_weights.dtype
        ctx.sync, ctx.stream = sync, stream
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        y, w = ctx.saved_tensors
        buf, h = ctx.buf, ctx.handle
        dtype = buf.cfg.dtype
        grad_out = _rows(grad_out, dtype)
        # y goes into the buffer's expert-output rows once: the K combines below read it there (passing
        # y itself would copy it K times).
        y_rows = buf.expert_output(y.shape[0])
        y_rows.copy_(_rows(y, dtype))
        # grad_w[t, k] = <grad_out[t], y[slot(t, k)]>: fetch each k's row with a one-column combine.
        grad_w = torch.zeros_like(w)
        ones = torch.ones_like(w)
        on = _on(ctx.stream)
        for k in range(w.shape[1]):
            only_k = torch.full_like(h.topk_idx, -1)
            only_k[:, k] = h.topk_idx[:, k]
            y_k = buf.combine(y_rows, replace(h, topk_idx=only_k, topk_weights=ones), algorithm="pull", **on)
            join(ctx.stream)
            grad_w[:, k] = (grad_out.float() * y_k.float()).sum(dim=1)
        # grad_y[slot(t, k)] = w[t, k] * grad_out[t]: the rows land where y's rows were.
        res = buf.dispatch(grad_out, h.topk_idx, w, mode="scatter", sync=ctx.sync, **on)
        join(ctx.stream)
        # Synced, the counts must agree; without a sync the views cover the capacity and y may too.
        mismatch = res.num_recv != y.shape[0] if ctx.sync else y.shape[0] > res.num_recv
        if mismatch:
            raise RuntimeError(
                f"combine backward: the gradient dispatch received {res.num_recv} rows but y has "
                f"{y.shape[0]}: the handle does not match the routing of y"
            )
        rows = y.shape[0]
        grad_y = (res.recv_x[:rows].float() * res.recv_weights[:rows, None]).to(ctx.y_dtype)
        return grad_y, grad_w.to(ctx.w_dtype), None, None, None, None, None


def dispatch(buf: Any, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, mode: str = "scatter", *,
             sync: bool = True, stream: Any = None, previous_event: Any = None) -> DispatchResult:
    """``buf.dispatch`` whose ``recv_x`` [num_recv, H] is differentiable with respect to ``x`` [T, H].

    topk_idx [T, K] int in [-1, E), topk_weights [T, K] fp32 (not differentiated here: pass them to
    ``combine``). The other fields are those of ``buf.dispatch`` (recv_weights / recv_src copied out
    of the buffer; ``tokens_per_expert`` and ``recv_count`` are the buffer's, valid until the next
    dispatch). sync, stream, previous_event: see the module docstring (sync=False: ``cfg.capacity``
    rows, no host sync). Collective.
    """
    _check_mode(mode)
    if not isinstance(x, Tensor):
        _check_tensors(buf, ("x", x, "[T, {hidden}] {dtype}", None))
    box: dict = {}
    recv_x = _Dispatch.apply(x, buf, topk_idx, topk_weights, mode, box, sync, stream, previous_event)
    res = box["result"]
    return DispatchResult(recv_x, res.recv_weights.clone(), res.recv_src.clone(), res.tokens_per_expert,
                          res.num_recv, res.handle, recv_count=res.recv_count)


def combine(buf: Any, y: Tensor, topk_weights: Tensor, handle: DispatchHandle, *, sync: bool = True,
            stream: Any = None, previous_event: Any = None) -> Tensor:
    """out [T, H] = sum over k of topk_weights[t, k] * y[slot(t, k)] on the owner, differentiable with
    respect to ``y`` [num_recv, H] (this rank's expert outputs, rows in recv_x's order) and
    ``topk_weights`` [T, K] (e.g. a router's softmax; any floating dtype, ``ValueError`` for another
    shape). ``handle`` comes from ``dispatch``; y's rows are checked by the buffer's combine (the
    dispatch's num_recv, or ``cfg.capacity`` after ``sync=False``). sync: the
    ``sync`` of the backward's dispatch (pass the forward dispatch's); stream, previous_event: see the
    module docstring. Collective.
    """
    if not hasattr(handle, "mode") or not hasattr(handle, "topk_idx"):
        raise InputTypeError(
            f"handle must be the DispatchHandle of a dispatch (res.handle), got {type(handle).__name__}"
        )
    _check_mode(handle.mode)
    if not (isinstance(y, Tensor) and isinstance(topk_weights, Tensor)):
        weights = f"{list(handle.topk_idx.shape)} float32"
        _check_tensors(buf, ("y", y, "[num_recv, {hidden}] {dtype}", None),
                       ("topk_weights", topk_weights, weights, torch.float32))
    _check_weights(topk_weights, handle)
    return _Combine.apply(y, topk_weights, buf, handle, sync, stream, previous_event)
