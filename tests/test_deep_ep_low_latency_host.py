"""Host side of the low-latency calls on the kernels' backend, without a GPU: the argument checks run once
per signature, and the dispatch's routing tensors are kept per parity (no tensor made per call)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cute_ep.deep_ep.ll_checks import _signature
from cute_ep.deep_ep.ll_graphs import combine_key
from cute_ep.deep_ep.low_latency import PaddedOut
from cute_ep.deep_ep.low_latency_mode import LowLatencyMode, _LowLatencyRouting
from cute_ep.kernels.config import FP8_SCALE_POWER_OF_TWO, PHASE_ALL, PHASE_RECEIVE


def _mode(backend: str = "cute") -> LowLatencyMode:
    mode = object.__new__(LowLatencyMode)
    mode.backend, mode._ll_kept, mode._combined, mode.device = backend, {}, {("old",)}, torch.device("cpu")
    mode.checked = []

    def agreed(what, check, same, *, synced):
        assert synced is False
        mode.checked.append(what)
        return check()

    mode._agreed = agreed
    return mode


def test_a_signature_holds_what_the_checks_read_of_each_tensor():
    x = torch.zeros(4, 8)
    assert _signature((x, 3, True)) == _signature((torch.ones(4, 8), 3, True))  # values are not read
    assert _signature((x, 3, True)) != _signature((x.t().contiguous().t(), 3, True))  # strides are
    assert _signature((x, 3, True)) != _signature((x.to(torch.bfloat16), 3, True))
    assert _signature((x, 3, True)) != _signature((x[:3], 3, True))
    assert _signature((x, [3], True)) is None  # a list: no signature, the checks run every time


def test_checks_run_once_per_signature_on_the_kernels_and_every_time_elsewhere():
    mode = _mode()
    x = torch.zeros(4, 8)
    for _ in range(3):
        got = mode._ll_agreed("low_latency_dispatch", mode._ll_signature((x, 5)), lambda: "checked", dict)
        assert got in ("checked", None)
    mode._ll_agreed("low_latency_dispatch", mode._ll_signature((torch.zeros(2, 8), 5)), lambda: None, dict)
    # another call: its own checks
    mode._ll_agreed("low_latency_combine", mode._ll_signature((x, 5)), lambda: None, dict)
    assert mode.checked == ["low_latency_dispatch", "low_latency_dispatch", "low_latency_combine"]

    def refuse():
        raise ValueError("x must be [T, H]")

    for _ in range(2):  # a refused signature is not remembered
        with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
            mode._ll_agreed("low_latency_dispatch", mode._ll_signature((torch.zeros(3), 5)), refuse, dict)
    reference = _mode("reference")  # the host backends agree over the group on every call
    for _ in range(2):
        reference._ll_agreed("low_latency_dispatch", reference._ll_signature((x, 5)), lambda: None, dict)
    mode._ll_agreed("low_latency_combine", None, lambda: None, dict)  # no signature (a foreign handle)
    assert reference.checked == ["low_latency_dispatch"] * 2 and mode.checked[-1] == "low_latency_combine"


class _Buffer:
    cfg = SimpleNamespace(max_tokens=16)  # the routing tensors' rows

    def __init__(self) -> None:
        self.launches = []

    def launch_low_latency_dispatch(self, x, topk_idx, topk_weights, own, padded, fp8=0, phase=0):
        self.launches.append((x, topk_idx.clone(), topk_weights, phase, own, fp8, padded))
        return "handle"


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_the_dispatch_launches_on_routing_kept_per_parity_with_ids_clamped_to_int32(id_dtype):
    mode, buf = _mode(), _Buffer()
    key = (7168, torch.bfloat16, 288, 4, 16)  # (hidden, dtype, experts, top-k, max tokens)
    x = torch.zeros(3, 8)
    ids = torch.tensor([[5, -1, 287, 0], [2**31 - 1, -7, 1, 2], [3, 4, 288, -2]], dtype=id_dtype)
    if id_dtype == torch.int64:
        ids[1, 0] = 2**33 + 5  # would wrap to 5 as int32: clamped to E (refused by the kernels) instead
    into = PaddedOut.make_exact(4, 2, 16, 8, torch.bfloat16, torch.device("cpu"))
    assert mode._ll_launch_dispatch(buf, key, 0, x, ids, 288, 0, into, None) == "handle"
    assert mode._combined == set()  # a dispatch orders the earlier combines
    _, sent, weights, phase, own, fp8, padded = buf.launches[0]
    assert sent.dtype == torch.int32 and phase == PHASE_ALL and fp8 == 0
    # the kernel writes the padded layout into the parity's tensors; without statistics into the count only
    assert padded == {"ll_x": into.rows, "ll_src_info": into.src_info, "ll_count": into.count,
                      "ll_range": into.layout_range, "ll_stats": into.count, "y_slot": into.slot,
                      "ll_scales": into.count}
    assert into.rows.shape == (4 * 2 * 16, 8) and into.slot.shape == (4 * 2 * 16,)
    stats = torch.zeros(4, dtype=torch.int32)
    mode._ll_launch_dispatch(buf, key, 0, x, ids, 288, 0, into, stats)
    assert buf.launches[-1][6]["ll_stats"] is stats
    assert sent.tolist() == [[5, -1, 287, 0], [288, -2, 1, 2], [3, 4, 288, -2]]
    assert weights.shape == (3, 4) and not weights.any()
    assert [o.shape for o in own] == [(3, 4)] * 3 and [o.dtype for o in own] == [torch.int32] * 2 + [
        torch.float32]
    mode._ll_launch_dispatch(buf, key, 0, x[:2], ids[:2], 288, 0, into, None)
    mode._ll_launch_dispatch(buf, key, 1, x, ids, 288, FP8_SCALE_POWER_OF_TWO, into, None)
    assert buf.launches[-1][5] == FP8_SCALE_POWER_OF_TWO  # the kernels quantize by DeepEP's rule
    ptr = [[t.data_ptr() for t in (launch[2], *launch[4])] for launch in buf.launches]
    assert ptr[1] == ptr[0] and ptr[2] == ptr[0]  # the same tensors: nothing made per call
    assert not set(ptr[3]) & set(ptr[0])  # the other parity: its own, as DeepEP's two buffers
    assert len(mode._ll_kept[("routing views", key, 0, id_dtype)]) == 2  # views for T = 3 and T = 2
    # return_recv_hook's receiving half: the ids the sending half kept, not clamped and copied again
    routing = mode._ll_kept[("routing views", key, 0, id_dtype)][3]
    routing.ids.fill_(7)
    mode._combined.add("a combine")
    mode._ll_launch_dispatch(buf, key, 0, x, ids, 288, 0, into, None, PHASE_RECEIVE)
    assert buf.launches[-1][3] == PHASE_RECEIVE and bool((buf.launches[-1][1] == 7).all())
    assert mode._combined == {"a combine"}  # the sending half ordered the combines already


def test_routing_views_share_the_kept_rows():
    kept = _LowLatencyRouting.make(16, 4, torch.int32, torch.device("cpu"))
    assert kept.ids is kept.clamped  # int32 ids need no second tensor
    first = kept.first(3)
    assert first.ids is first.clamped and first.clamped.data_ptr() == kept.clamped.data_ptr()
    assert first.own[2].dtype == torch.float32 and first.own[2].shape == (3, 4)
    wide = _LowLatencyRouting.make(16, 4, torch.int64, torch.device("cpu")).first(5)
    assert wide.clamped.dtype == torch.int64 and wide.ids.dtype == torch.int32


class _Graphs:
    """LowLatencyGraphs with stand-ins for CUDA: a capture records what it enqueued, a replay counts."""

    def __init__(self, monkeypatch, enabled: str = "1") -> None:
        from cute_ep.deep_ep import ll_graphs

        monkeypatch.setenv(ll_graphs.GRAPHS_ENV_VAR, enabled)
        self.stream, self.waits, self.replayed, self.capturing = 1, [], [], False

        def capture(enqueue):
            got = enqueue()
            return (lambda: self.replayed.append(got)), got

        self.graphs = ll_graphs.LowLatencyGraphs(capture, lambda: self.stream, self.waits.append,
                                                 lambda: self.capturing)

    def call(self, key, buf, x, ids, stats=None):  # key: (signature, parity)
        enqueued = []

        def enqueue(xs, kept_ids, add_to):
            enqueued.append((xs.clone(), kept_ids.clone(), add_to))
            return ("result", xs.data_ptr(), kept_ids.data_ptr())

        self.how, result = self.graphs.dispatch(*key, buf, x, ids, stats, enqueue)
        return self.how is not None, result, enqueued


def test_a_low_latency_dispatch_at_the_same_addresses_is_captured_once_then_replayed_on_them(monkeypatch):
    g, buf = _Graphs(monkeypatch), object()
    x, ids = torch.arange(6.0).view(3, 2), torch.tensor([[1, 2], [3, -1], [0, 5]])
    assert g.call(("sig", 0), buf, x, ids) == (False, None, [])  # the first call of a key: eager
    ran, result, enqueued = g.call(("sig", 0), buf, x, ids)  # the second: captured, then replayed
    assert ran and g.how == "direct" and len(enqueued) == 1 and len(g.replayed) == 1
    assert result[1:] == (x.data_ptr(), ids.data_ptr())  # on the caller's tensors: nothing copied
    stats = torch.zeros(4, dtype=torch.int32)  # statistics: their address is part of the key
    assert g.call(("sig+stats", 0), buf, x, ids, stats)[0] is False  # (a signature holds the stats too)
    assert g.call(("sig+stats", 0), buf, x, ids, stats)[2][0][2] is stats  # the direct graph adds them
    x.add_(1)  # new values, same places
    ran, again, enqueued = g.call(("sig", 0), buf, x, ids)  # later calls: replayed, nothing enqueued
    assert ran and again == result and enqueued == [] and len(g.replayed) == 3
    assert dict(g.graphs.captures) == {"direct": 2} and g.graphs._inputs == {}  # no copies made
    assert g.call(("sig", 1), buf, x, ids)[0] is False  # the other parity: its own graph, eager first
    assert g.call(("sig", 0), object(), x, ids)[0] is False  # a rebuilt buffer: a new graph
    assert g.waits == []
    g.capturing = True  # inside the caller's own capture: eager
    assert g.call(("sig", 0), buf, x, ids)[0] is False


def test_a_low_latency_dispatch_whose_tensors_move_is_replayed_on_kept_copies(monkeypatch):
    g, buf = _Graphs(monkeypatch), object()
    made = [(torch.rand(3, 2), torch.randint(0, 6, (3, 2))) for _ in range(5)]  # kept: distinct addresses
    assert g.call(("sig", 0), buf, *made[0])[0] is False
    ran, result, enqueued = g.call(("sig", 0), buf, *made[1])  # a new direct key, the signature's second
    assert ran and g.how == "copied" and len(enqueued) == 1 and dict(g.graphs.captures) == {"copied": 1}
    assert enqueued[0][2] is None  # the caller adds the statistics
    assert torch.equal(enqueued[0][0], made[1][0]) and torch.equal(enqueued[0][1], made[1][1])
    assert result[1] != made[1][0].data_ptr() and result[2] != made[1][1].data_ptr()
    ran, again, enqueued = g.call(("sig", 0), buf, *made[2])
    assert ran and again == result and enqueued == []
    kept = g.graphs._inputs["sig"]
    assert torch.equal(kept[0], made[2][0]) and torch.equal(kept[1], made[2][1])  # the replay reads them
    assert (kept[0].data_ptr(), kept[1].data_ptr()) == result[1:]
    assert g.waits == []
    g.stream = 2  # another current stream: it waits for the one the kept inputs were written on
    assert g.call(("sig", 0), buf, *made[3])[0] and g.waits == [1]
    strided = (torch.rand(2, 3).t(), made[4][1])  # not contiguous: never a direct key
    assert g.call(("sig2", 0), buf, *strided)[0] is False and g.call(("sig2", 0), buf, *strided)[0]
    assert g.graphs.captures["direct"] == 0 and g.graphs.captures["copied"] == 2


def test_a_low_latency_combine_is_replayed_only_at_the_addresses_it_was_captured_with(monkeypatch):
    g, buf = _Graphs(monkeypatch), object()
    launched = []

    def enqueue(tag):
        return lambda: launched.append(tag) or tag

    at = [torch.zeros(2), torch.zeros(3)]  # (rows, output)
    key = combine_key("sig", *at)
    assert key == ("combine", "sig", at[0].data_ptr(), at[1].data_ptr())
    assert g.graphs.replay(key, buf) == (False, None)  # nothing captured: the full path runs
    assert g.graphs.combine(key, buf, enqueue("a")) == (False, None)
    assert g.graphs.combine(key, buf, enqueue("b")) == (True, "b")  # captured, replayed
    assert g.graphs.combine(key, buf, enqueue("c")) == (True, "b") and launched == ["b"]
    assert g.graphs.replay(key, buf) == (True, "b") and g.graphs.replay(key, object()) == (False, None)
    elsewhere = combine_key("sig", at[0], torch.zeros(3))  # an output elsewhere
    assert g.graphs.combine(elsewhere, buf, enqueue("d")) == (False, None)
    assert g.replayed == ["b", "b", "b"] and dict(g.graphs.replays) == {"combine": 3}


def test_low_latency_graphs_stop_capturing_when_signatures_rarely_repeat(monkeypatch):
    from cute_ep.deep_ep.ll_graphs import CAPTURE_BUDGET, MAX_GRAPHS, MAX_SIGHTINGS

    g, buf = _Graphs(monkeypatch), object()
    x, ids = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.int64)
    always, per = CAPTURE_BUDGET
    for i in range(always + 3):  # each signature twice: every second call would capture
        g.call((f"sig{i}", 0), buf, x, ids)
        g.call((f"sig{i}", 0), buf, x, ids)
    assert sum(g.graphs.captures.values()) == always  # then no replays earned another capture
    assert len(g.graphs._plans) <= MAX_GRAPHS and len(g.graphs._seen) <= MAX_SIGHTINGS
    for i in range(MAX_GRAPHS + 4):
        g.graphs.combine(("combine", i), buf, lambda: None)
    assert len(g.graphs._seen) <= MAX_SIGHTINGS
    off = _Graphs(monkeypatch, enabled="0")
    for _ in range(3):
        assert off.call(("sig", 0), buf, x, ids)[0] is False


def test_buffers_take_their_sms_from_the_building_call_or_the_modes_default_and_stay_apart(monkeypatch):
    from collections import OrderedDict

    from cute_ep.deep_ep.pool import LOW_LATENCY_SMS_ENV_VAR, MIN_BUCKET, BufferPool

    class Pool(BufferPool):
        def _buffer_sms(self) -> int:
            return 20

    pool = Pool.__new__(Pool)
    pool._sm_cap = 132  # each rank's share: a whole H200
    monkeypatch.delenv(LOW_LATENCY_SMS_ENV_VAR, raising=False)
    assert pool._low_latency_sms(288) == 96  # DeepEP's low-latency grid: 3 experts a CTA
    assert pool._low_latency_sms(256) == 128 and pool._low_latency_sms(8) == 8
    monkeypatch.setenv(LOW_LATENCY_SMS_ENV_VAR, "96")
    assert pool._low_latency_sms(8) == 96
    for bad in ("0", "-4", "many"):
        monkeypatch.setenv(LOW_LATENCY_SMS_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{LOW_LATENCY_SMS_ENV_VAR} must be an integer >= 1.*{bad}"):
            pool._low_latency_sms(288)
        assert pool._new_buffer_sms(True, 24, 288) == 24  # the call's own SMs: the variable is not read
    pool._sm_cap = 66  # each rank's share: two ranks on an H200
    monkeypatch.delenv(LOW_LATENCY_SMS_ENV_VAR)
    assert pool._new_buffer_sms(False, 0, 256) == 20  # Buffer.num_sms
    assert pool._new_buffer_sms(True, 0, 288) == 58  # 5 experts a CTA on 66 SMs
    # the call's own SMs, in either mode
    assert pool._new_buffer_sms(False, 24, 256) == 24 and pool._new_buffer_sms(True, 24, 288) == 24
    assert pool._new_buffer_sms(False, 132, 256) == 66  # at most the share
    monkeypatch.setenv(LOW_LATENCY_SMS_ENV_VAR, "80")
    assert pool._new_buffer_sms(True, 0, 288) == 66 and pool._new_buffer_sms(False, 0, 256) == 20
    # a low-latency buffer of the same shape is never the normal mode's
    pool._buffers = OrderedDict({(256, torch.bfloat16, 4, 4, 128, "low-latency"): object()})
    assert pool._bucketed(256, torch.bfloat16, 4, 4, 10) == MIN_BUCKET
    pool._buffers[(256, torch.bfloat16, 4, 4, 128)] = object()
    assert pool._bucketed(256, torch.bfloat16, 4, 4, 10) == 128


class _KernelsBuffer:
    """An EpBuffer's low-latency launches and notes, recorded (no kernels run)."""

    def __init__(self, max_tokens: int) -> None:
        self.cfg = SimpleNamespace(max_tokens=max_tokens)
        self.launched, self.notes = [], []

    def launch_low_latency_dispatch(self, x, topk_idx, topk_weights, own, padded, fp8=0, phase=0):
        from cute_ep.api import DispatchHandle

        self.launched.append(("dispatch", x.data_ptr(), topk_idx.data_ptr(), fp8))
        own[1].copy_(topk_idx)  # as the kernel: the routing copied into the handle's tensors
        return DispatchHandle(own[1], own[2], own[0], x.shape[0], "scatter", "low-latency")

    def launch_low_latency_combine(self, handle, out, y, pairs, count, phase=0):
        self.launched.append(("combine", out.data_ptr(), y.data_ptr()))

    def replayed_dispatch(self, handle):
        self.notes.append(("dispatch", handle))

    def replayed_combine(self):
        self.notes.append(("combine",))


def _kernels_mode(monkeypatch, replays: bool):
    """A LowLatencyMode on the kernels' backend over stand-ins (the Buffer's pool, fence, graphs with a
    recording capture); ``replays`` False: the replay path always declines (the full path runs)."""
    from collections import OrderedDict

    from cute_ep.deep_ep.checks import CallChecks
    from cute_ep.deep_ep.pool import BufferPool

    class Mode(BufferPool, CallChecks, LowLatencyMode):
        pass

    mode = object.__new__(Mode)
    base = _mode()
    mode.__dict__.update(base.__dict__)
    mode._agreed = base._agreed
    g = _Graphs(monkeypatch)
    t, h, e, k, world = 4, 256, 8, 2, 2
    buf = _KernelsBuffer(max_tokens=t)
    mode._buffers = OrderedDict({(h, torch.float32, e, k, t, "low-latency"): buf})
    mode._ll_graphs, mode._ll_index, mode.group_size, mode._ll_staging = g.graphs, 0, world, {}
    mode._ll_replay_handles = [None, None]
    mode._check_alive = lambda: None
    mode.fences = []
    mode._fence = lambda key: mode.fences.append(key) if key in mode._combined else None
    if not replays:
        mode._ll_dispatch_replayed = lambda *a: None
        mode._ll_combine_replayed = lambda *a: None
    out_rows, real_empty = torch.zeros(t, h), torch.empty

    def empty(*shape, **kw):  # the combine's output where the CUDA allocator would put it again (a CPU
        # allocator may not), so that its graph's key repeats
        size = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return out_rows if tuple(size) == (t, h) else real_empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    x = torch.rand(t, h)
    ids = torch.tensor([[0, 5], [3, -1], [7, 2], [1, 4]])
    w = torch.rand(t, k)
    y = torch.rand(e // world, world * t, h)
    stats = torch.zeros(e // world, dtype=torch.int32)
    return mode, buf, g, (x, ids, w, y, stats, t, e)


def _pairs(mode, args, n: int, use_fp8: bool = False):
    x, ids, w, y, stats, t, e = args
    got = []
    for _ in range(n):
        recv, count, handle, event, hook = mode.low_latency_dispatch(
            x, ids, t, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8)
        combined, cevent, chook = mode.low_latency_combine(y, ids, w, handle)
        got.append((recv, count, tuple(handle), handle.cute_ep.dispatch_handle, event.event, hook,
                    combined.shape, cevent.event, chook, mode._ll_index))
    return got


@pytest.mark.parametrize("use_fp8", [False, True])
def test_repeated_low_latency_calls_replay_their_graphs_with_the_full_paths_results(monkeypatch, use_fp8):
    full, full_buf, full_g, full_args = _kernels_mode(monkeypatch, replays=False)
    fast, fast_buf, fast_g, fast_args = _kernels_mode(monkeypatch, replays=True)
    import collections

    calls = {id(full): collections.Counter(), id(fast): collections.Counter()}
    for mode in (full, fast):
        counter = calls[id(mode)]
        for name in ("_ll_kernels_dispatch", "_ll_launch_combine"):  # the full path's launch steps
            real = getattr(mode, name)
            setattr(mode, name, lambda *a, _r=real, _c=counter, _n=name: (_c.update([_n]), _r(*a))[1])
    a = _pairs(full, full_args, 8, use_fp8)
    b = _pairs(fast, fast_args, 8, use_fp8)
    assert calls[id(full)] == {"_ll_kernels_dispatch": 8, "_ll_launch_combine": 8}
    assert calls[id(fast)] == {"_ll_kernels_dispatch": 2, "_ll_launch_combine": 2}  # sighting, capture
    assert len(full_buf.launched) == len(fast_buf.launched)  # eager first sightings, then the captures
    # a dispatch + combine loop keeps each call at one parity: one graph each
    assert dict(full_g.graphs.captures) == dict(fast_g.graphs.captures) == {"direct": 1, "combine": 1}
    assert dict(full_g.graphs.replays) == dict(fast_g.graphs.replays)  # every later call a replay
    assert [n[0] for n in full_buf.notes] == [n[0] for n in fast_buf.notes]
    for one, other in zip(a, b, strict=True):
        recv_a, recv_b = (one[0], other[0]) if not use_fp8 else (one[0][0], other[0][0])
        assert recv_a.shape == recv_b.shape and recv_a.dtype == recv_b.dtype
        assert one[4:] == other[4:] and one[1].shape == other[1].shape  # events, hooks, parity
        assert [type(v) for v in one[2]] == [type(v) for v in other[2]] and one[2][2:] == other[2][2:]
    # on the replay path the later calls return the very tensors the captured calls returned
    for i in range(4, 8):
        assert b[i][0] is b[i - 2][0] and b[i][3] is b[i - 2][3]
        assert b[i][2][0] is b[i - 2][2][0]  # src_info of this parity
    assert fast.fences == [] and full.fences == []  # a dispatch between: no fence due
    # the combine's replay takes the handle's ids as they are; ids the caller changed take the full path
    x, ids, w, y, stats, t, e = fast_args
    handle = fast.low_latency_dispatch(x, ids, t, e, cumulative_local_expert_recv_stats=stats,
                                       use_fp8=use_fp8)[2]
    before = dict(fast_g.graphs.replays)
    ids.masked_fill_(ids == 3, -1)  # a new version of the same tensor
    fast.low_latency_combine(y, ids, w, handle)
    assert fast_g.graphs.replays["combine"] == before["combine"]  # not this graph: new ids, new addresses
    # a call with async_finish takes the full path (its event), as does one while a capture is under way
    fast_g.capturing = True
    n = len(fast_buf.launched)
    fast.low_latency_dispatch(x, ids, t, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8)
    assert len(fast_buf.launched) == n + 1
