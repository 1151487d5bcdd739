"""combine() takes y with the num_recv rows of the handle's dispatch (or the whole capacity, what the views
of ``dispatch(sync=False)`` cover), on every backend. A shorter y left combine reading rows nobody passed
(NaN poison on a fresh buffer, an earlier call's rows after one) without a word.

The host backends run in a world of one here; the GPU buffer's checks run on the CPU with its launcher
replaced (no kernel runs), and tests/gpu/test_dispatch_combine.py repeats them on GPUs.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from _host_buffer import host_buffer
from _worlds import HOST_BACKENDS, expert_outputs, host_config, world_of_one

from cute_ep import autograd as ep
from cute_ep.api import DispatchHandle
from cute_ep.input_checks import InputTypeError, check_combine_input, check_combine_out, note_dispatch_rows
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig

CPU = torch.device("cpu")
CFG = EpConfig(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=128, dtype=torch.bfloat16,
               max_tokens=16)  # capacity 64, rank_capacity 32


def handle_like(t: int = 4, layout: str = "expert") -> SimpleNamespace:
    """A stand-in with a DispatchHandle's fields (what check_combine_input reads)."""
    return SimpleNamespace(topk_idx=torch.zeros(t, 2, dtype=torch.int32), topk_weights=torch.ones(t, 2),
                           scatter=torch.zeros(t, 2, dtype=torch.int32), num_tokens=t, mode="scatter",
                           layout=layout)


def real_handle(t: int = 4) -> DispatchHandle:
    h = handle_like(t)
    return DispatchHandle(h.topk_idx, h.topk_weights, h.scatter, t, "scatter")


def rows(n: int, cfg: EpConfig = CFG) -> torch.Tensor:
    return torch.zeros(n, cfg.hidden, dtype=cfg.dtype)


# --------------------------------------------------------------------------------------------------
# the shared check (the GPU buffer's path: a handle-like object, no kernel)
# --------------------------------------------------------------------------------------------------


def test_y_must_have_the_num_recv_of_the_handles_dispatch():
    h = handle_like()
    note_dispatch_rows(h, 10)  # what a synced dispatch records: its num_recv
    check_combine_input(CFG, CPU, rows(10), h, None)
    check_combine_input(CFG, CPU, rows(CFG.capacity), h, None)  # the sync-free views' rows: accepted too
    for n in (9, 0, 11, 63):
        with pytest.raises(ValueError, match=rf"y has {n} rows, but the dispatch of this handle received "
                                             r"num_recv=10: y must have one row per received row"):
            check_combine_input(CFG, CPU, rows(n), h, None)
    with pytest.raises(ValueError, match="y has 65 rows, more than the capacity 64"):
        check_combine_input(CFG, CPU, rows(65), h, None)


def test_a_sync_free_handle_takes_the_whole_capacity():
    """After dispatch(sync=False) the GPU host does not know num_recv: y must cover the capacity, the rows
    res.num_recv says (the rank layout: rank_capacity)."""
    for layout, full, name in (("expert", CFG.capacity, "capacity"),
                               ("rank", CFG.rank_capacity, "rank_capacity")):
        h = handle_like(layout=layout)
        note_dispatch_rows(h, None)
        check_combine_input(CFG, CPU, rows(full), h, 10)  # noted: the buffer's other knowledge is not used
        with pytest.raises(ValueError, match=rf"y has 10 rows, but the dispatch of this handle ran with "
                                             rf"sync=False: .* must have the {full} rows \(cfg.{name}\)"):
            check_combine_input(CFG, CPU, rows(10), h, 10)


def test_a_handle_not_noted_takes_the_callers_count_and_keeps_it():
    """A handle the backend did not note (made by hand, or by a backend that notes nothing at its dispatch)
    is taken to come from the dispatch whose count the caller passes, and keeps that count: the handle of an
    earlier dispatch still takes its own rows after a later dispatch (autograd's backward does this)."""
    h = real_handle()
    check_combine_input(CFG, CPU, rows(12), h, 12)  # first seen: the caller's count, kept for it
    check_combine_input(CFG, CPU, rows(12), dataclasses.replace(h, topk_weights=torch.zeros(4, 2)), 30)
    with pytest.raises(ValueError, match="received num_recv=12"):
        check_combine_input(CFG, CPU, rows(30), h, 30)
    unknown = handle_like()
    with pytest.raises(ValueError, match="ran with sync=False"):
        check_combine_input(CFG, CPU, rows(12), unknown, None)


def test_the_handle_itself_is_checked():
    with pytest.raises(InputTypeError, match="got its DispatchResult: pass res.handle"):
        from cute_ep.api import DispatchResult

        h = handle_like()
        res = DispatchResult(rows(4), None, torch.zeros(4, dtype=torch.int32), torch.zeros(4), 4, h)
        check_combine_input(CFG, CPU, rows(4), res, 4)
    with pytest.raises(TypeError, match=r"handle must be a DispatchHandle \(DispatchResult.handle of a "
                                        r"dispatch\), got dict"):
        check_combine_input(CFG, CPU, rows(4), {"scatter": None}, 4)
    h = dataclasses.replace(real_handle(), topk_weights=torch.ones(3, 2))
    message = (r"handle.topk_weights must be \[4, 2\] float32 on cpu \(num_tokens=4\), got \[3, 2\] "
               r"torch.float32")
    with pytest.raises(ValueError, match=message):
        check_combine_input(CFG, CPU, rows(4), h, 4)


def test_a_y_that_is_not_a_tensor_is_a_type_error():
    message = (r"y must be a torch.Tensor \[num_recv, 128\] torch.bfloat16 on cpu, got list; convert it with "
               r"torch.as_tensor\(y, dtype=torch.bfloat16, device='cpu'\)")
    with pytest.raises(TypeError, match=message):
        check_combine_input(CFG, CPU, [[0.0] * 128], handle_like(), 1)


# --------------------------------------------------------------------------------------------------
# the host backends
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_host_backends_refuse_a_y_of_the_wrong_row_count(backend):
    cfg = host_config()
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 6, 32, 4, 2, torch.bfloat16, 1)
        res = buf.dispatch(x, idx, w)
        n = res.num_recv
        assert 1 < n < cfg.capacity - 1
        # a fresh buffer: the rows past a short y are poison
        with pytest.raises(ValueError, match=rf"y has {n - 1} rows, but the dispatch of this handle received "
                                             rf"num_recv={n}"):
            buf.combine(expert_outputs(res)[: n - 1].clone(), res.handle)
        y = buf.expert_output(n)
        y.copy_(expert_outputs(res))
        want = buf.combine(y, res.handle)
        # after a call: the rows past a short y would be that call's
        for bad in (n - 1, n + 1):
            with pytest.raises(ValueError, match=rf"y has {bad} rows, .* num_recv={n}"):
                buf.combine(buf.expert_output(bad), res.handle)
        # the whole capacity is accepted (rows past num_recv are never read)
        full = buf.expert_output(cfg.capacity)
        assert torch.equal(buf.combine(full, res.handle), want)
        # the reduced combine checks the same
        with pytest.raises(ValueError, match=rf"y has {n - 1} rows"):
            buf.combine(y[: n - 1].clone(), res.handle, algorithm="pull")
        # sync=False: the views (and y) cover the capacity
        res2 = buf.dispatch(x, idx, w, sync=False)
        assert res2.num_recv == cfg.capacity
        assert torch.equal(buf.combine(buf.expert_output(res2.num_recv), res2.handle), want)
        # the earlier handle still takes its own rows after a later dispatch of another count
        x3, idx3, w3 = make_inputs(0, 2, 32, 4, 2, torch.bfloat16, 3)
        res3 = buf.dispatch(x3, idx3, w3)
        assert res3.num_recv != n
        buf.expert_output(n).copy_(expert_outputs(res))
        assert torch.equal(buf.combine(buf.expert_output(n), res.handle), want)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_host_backends_rank_layout_rows(backend):
    cfg = host_config()
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 6, 32, 4, 2, torch.bfloat16, 1)
        res = buf.dispatch(x, idx, w, layout="rank")
        n = res.num_recv
        message = rf"y has {n - 1} rows, .* num_recv={n}.* {cfg.rank_capacity} rows, cfg.rank_capacity"
        with pytest.raises(ValueError, match=message):
            buf.combine(buf.expert_output(n - 1), res.handle)
        buf.combine(buf.expert_output(n), res.handle)
        buf.combine(buf.expert_output(cfg.rank_capacity), res.handle)


# --------------------------------------------------------------------------------------------------
# the GPU buffer's checks, on the CPU (its launcher replaced: no kernel runs)
# --------------------------------------------------------------------------------------------------


@pytest.fixture()
def gpu_buffer(monkeypatch):
    """An EpBuffer whose device is the CPU and whose launches are recorded instead of run."""
    from cute_ep.kernels.buffers import CALL, buffers_of

    buf = host_buffer(CFG, algorithm="dedup", _dispatches=0)
    buf.num_recv = torch.zeros(1, dtype=torch.int32)
    buf.scatter = torch.full((CFG.max_tokens, CFG.topk), -1, dtype=torch.int32)
    buf.recv_y = torch.full((CFG.capacity, CFG.hidden), float("nan"), dtype=CFG.dtype)
    buf._empty = {b.name: torch.empty(16, dtype=b.torch_dtype(CFG)) for b in buffers_of(CALL)}
    buf._align = {b.name: 1 for b in buffers_of(CALL)}
    buf._empty_addr = {n: t.data_ptr() for n, t in buf._empty.items()}
    buf.launches = []
    buf._launcher = lambda stream, addrs, **scalars: buf.launches.append(scalars)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return buf


def test_gpu_buffer_combine_refuses_before_any_launch(gpu_buffer):
    buf = gpu_buffer
    t = 4
    handle = DispatchHandle(torch.zeros(t, 2, dtype=torch.int32), torch.ones(t, 2),
                            torch.zeros(t, 2, dtype=torch.int32), t, "scatter")
    note_dispatch_rows(handle, 10)  # what dispatch() records after reading the count
    with pytest.raises(ValueError, match="y has 9 rows, but the dispatch of this handle received "
                                         "num_recv=10"):
        buf.combine(rows(9), handle)
    assert buf.launches == []
    buf.combine(rows(10), handle)
    buf.combine(rows(CFG.capacity), handle)
    assert len(buf.launches) == 2
    # launch_dispatch: the count stays on the device, so combine takes the whole capacity
    sync_free = buf.launch_dispatch(rows(t), handle.topk_idx, handle.topk_weights)
    with pytest.raises(ValueError, match="ran with sync=False"):
        buf.combine(rows(10), sync_free)
    buf.combine(rows(CFG.capacity), sync_free)
    # the kernels read the ids as contiguous int32
    with pytest.raises(ValueError, match="handle.topk_idx must be contiguous int32 for the kernels, got "
                                         "torch.int64"):
        buf.combine(rows(10), dataclasses.replace(handle, topk_idx=handle.topk_idx.long()))


def test_launch_combine_checks_out(gpu_buffer):
    """The kernels write handle.num_tokens rows into out without bounds: a smaller (or strided, or
    mistyped) out is refused on the host, before the launch."""
    buf = gpu_buffer
    t = 4
    handle = DispatchHandle(torch.zeros(t, 2, dtype=torch.int32), torch.ones(t, 2),
                            torch.zeros(t, 2, dtype=torch.int32), t, "scatter")
    bad = (torch.empty(3, 128, dtype=torch.bfloat16), torch.empty(4, 128, dtype=torch.float32),
           torch.empty(128, 4, dtype=torch.bfloat16).t())
    for out in bad:
        with pytest.raises(ValueError, match=r"out must be \[4, 128\] torch.bfloat16, contiguous, on cpu "
                                             r"\(num_tokens=4 of the handle\), got"):
            buf.launch_combine(handle, out)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        check_combine_out(CFG, CPU, None, 4)
    assert buf.launches == []
    buf.launch_combine(handle, torch.empty(4, 128, dtype=torch.bfloat16))
    assert len(buf.launches) == 1


def test_gpu_buffer_fp8_views_check_the_row_count(gpu_buffer):
    buf = gpu_buffer
    buf.recv_x = torch.zeros(CFG.capacity, CFG.hidden, dtype=CFG.dtype)
    assert buf.fp8_packed_rows(5).shape == (5, CFG.fp8_row_bytes)
    for n in (-1, CFG.capacity + 1):
        with pytest.raises(ValueError, match=rf"num_recv must be in \[0, capacity=64\], got {n}"):
            buf.fp8_views(n)


# --------------------------------------------------------------------------------------------------
# autograd and the MoE layer pass the caller's tensors on: checked too
# --------------------------------------------------------------------------------------------------


def test_autograd_combine_checks_rows_weights_and_types():
    cfg = host_config(dtype=torch.float32)
    buf = HOST_BACKENDS["reference"](world_of_one(), cfg)
    x, idx, w = make_inputs(0, 6, 32, 4, 2, torch.float32, 1)
    res = ep.dispatch(buf, x, idx, w)
    y = res.recv_x * 2
    n = res.num_recv
    with pytest.raises(ValueError, match=rf"y has {n - 1} rows, but the dispatch of this handle received "
                                         rf"num_recv={n}"):
        ep.combine(buf, y[: n - 1], w, res.handle)
    with pytest.raises(ValueError, match=r"topk_weights must be \[6, 2\] \(num_tokens x topk of the handle\) "
                                         r"and floating point, got \[5, 2\] torch.float32"):
        ep.combine(buf, y, w[:5], res.handle)
    with pytest.raises(TypeError, match=r"topk_weights must be a torch.Tensor \[6, 2\] float32 on cpu, got "
                                        r"list"):
        ep.combine(buf, y, w.tolist(), res.handle)
    with pytest.raises(TypeError, match=r"y must be a torch.Tensor \[num_recv, 32\] torch.float32 on cpu, "
                                        r"got list"):
        ep.combine(buf, y.tolist(), w, res.handle)
    with pytest.raises(TypeError, match=r"handle must be the DispatchHandle of a dispatch \(res.handle\), "
                                        r"got DispatchResult"):
        ep.combine(buf, y, w, res)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor \[T, 32\] torch.float32 on cpu, got list"):
        ep.dispatch(buf, x.tolist(), idx, w)
    out = ep.combine(buf, y, w, res.handle)
    assert out.shape == (6, 32)


def test_moe_layer_checks_the_type_and_device_of_x():
    from cute_ep.moe_layer import MoELayer

    cfg = host_config(hidden=32, max_tokens=8)
    layer = MoELayer(HOST_BACKENDS["reference"](world_of_one(), cfg), 32)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor \[T, 32\] torch.bfloat16 on cpu, got "
                                        r"list"):
        layer([[0.0] * 32])
    with pytest.raises(ValueError, match=r"x must be on the layer's device cpu, got meta: pass "
                                         r"x.to\('cpu'\)"):
        layer(torch.zeros(4, 32, dtype=torch.bfloat16, device="meta"))


def test_after_a_sync_free_dispatch_y_may_hold_the_count_the_kernels_wrote(gpu_buffer, monkeypatch):
    """dispatch(sync=False) leaves the count on the device: y of the whole capacity passes without reading
    it; a y of other size passes when it holds exactly that count (read back: a host sync the caller who
    sized y by res.recv_count has already paid), and is refused while capturing a CUDA graph or once a
    later dispatch has overwritten the count."""
    buf = gpu_buffer
    t = 4
    handle = DispatchHandle(torch.zeros(t, 2, dtype=torch.int32), torch.ones(t, 2),
                            torch.zeros(t, 2, dtype=torch.int32), t, "scatter")
    buf._dispatches += 1
    note_dispatch_rows(handle, buf._count_reader())
    buf.num_recv.fill_(7)  # what the kernels wrote
    buf.combine(rows(CFG.capacity), handle)
    buf.combine(rows(7), handle)
    with pytest.raises(ValueError, match="y has 6 rows, but the dispatch of this handle received num_recv=7"):
        buf.combine(rows(6), handle)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="while a CUDA graph is being captured the count cannot be read"):
        buf.combine(rows(7), handle)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    buf._dispatches += 1  # a later dispatch
    with pytest.raises(ValueError, match="a later dispatch has overwritten its count"):
        buf.combine(rows(7), handle)
    assert len(buf.launches) == 2
