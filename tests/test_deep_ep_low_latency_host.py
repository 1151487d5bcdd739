"""Host side of the low-latency calls on the kernels' backend, without a GPU: the argument checks run once
per signature, and the dispatch's routing tensors are kept per parity (no tensor made per call)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cute_ep.deep_ep.low_latency_mode import LowLatencyMode, _LowLatencyRouting, _signature
from cute_ep.kernels.config import FP8_SCALE_POWER_OF_TWO


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

    def launch_dispatch(self, x, topk_idx, topk_weights, fp8=False, layout="expert", *, own=None):
        self.launches.append((x, topk_idx.clone(), topk_weights, layout, own, fp8))
        return "handle"


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_the_dispatch_launches_on_routing_kept_per_parity_with_ids_clamped_to_int32(id_dtype):
    mode, buf = _mode(), _Buffer()
    key = (7168, torch.bfloat16, 288, 4, 16)  # (hidden, dtype, experts, top-k, max tokens)
    x = torch.zeros(3, 8)
    ids = torch.tensor([[5, -1, 287, 0], [2**31 - 1, -7, 1, 2], [3, 4, 288, -2]], dtype=id_dtype)
    if id_dtype == torch.int64:
        ids[1, 0] = 2**33 + 5  # would wrap to 5 as int32: clamped to E (refused by the kernels) instead
    assert mode._ll_launch_dispatch(buf, key, 0, x, ids, 288) == "handle"
    assert mode._combined == set()  # a dispatch orders the earlier combines
    _, sent, weights, layout, own, fp8 = buf.launches[0]
    assert sent.dtype == torch.int32 and layout == "expert" and fp8 == 0
    assert sent.tolist() == [[5, -1, 287, 0], [288, -2, 1, 2], [3, 4, 288, -2]]
    assert weights.shape == (3, 4) and not weights.any()
    assert [o.shape for o in own] == [(3, 4)] * 3 and [o.dtype for o in own] == [torch.int32] * 2 + [
        torch.float32]
    mode._ll_launch_dispatch(buf, key, 0, x, ids, 288)
    mode._ll_launch_dispatch(buf, key, 0, x[:2], ids[:2], 288)
    mode._ll_launch_dispatch(buf, key, 1, x, ids, 288, FP8_SCALE_POWER_OF_TWO)
    assert buf.launches[-1][5] == FP8_SCALE_POWER_OF_TWO  # the kernels quantize by DeepEP's rule
    ptr = [[t.data_ptr() for t in (launch[2], *launch[4])] for launch in buf.launches]
    assert ptr[1] == ptr[0] and ptr[2] == ptr[0]  # the same tensors: nothing made per call
    assert not set(ptr[3]) & set(ptr[0])  # the other parity: its own, as DeepEP's two buffers
    assert len(mode._ll_kept[("routing views", key, 0, id_dtype)]) == 2  # views for T = 3 and T = 2


def test_routing_views_share_the_kept_rows():
    kept = _LowLatencyRouting.make(16, 4, torch.int32, torch.device("cpu"))
    assert kept.ids is kept.clamped  # int32 ids need no second tensor
    first = kept.first(3)
    assert first.ids is first.clamped and first.clamped.data_ptr() == kept.clamped.data_ptr()
    assert first.own[2].dtype == torch.float32 and first.own[2].shape == (3, 4)
    wide = _LowLatencyRouting.make(16, 4, torch.int64, torch.device("cpu")).first(5)
    assert wide.clamped.dtype == torch.int64 and wide.ids.dtype == torch.int32


class _Graphs:
    """DispatchGraphs with stand-ins for CUDA: a capture records what it enqueued, a replay counts."""

    def __init__(self, monkeypatch, enabled: str = "1") -> None:
        from cute_ep.deep_ep import ll_graphs

        monkeypatch.setenv(ll_graphs.GRAPHS_ENV_VAR, enabled)
        self.stream, self.waits, self.replayed, self.capturing = 1, [], [], False

        def capture(enqueue):
            got = enqueue()
            return (lambda: self.replayed.append(got)), got

        self.graphs = ll_graphs.DispatchGraphs(capture, lambda: self.stream, self.waits.append,
                                               lambda: self.capturing)

    def call(self, key, buf, x, ids):  # key: (signature, parity)
        enqueued = []

        def enqueue(xs, kept_ids):
            enqueued.append((xs.clone(), kept_ids.clone()))
            return ("result", xs.data_ptr(), kept_ids.data_ptr())

        ran, result = self.graphs.dispatch(*key, buf, x, ids, enqueue)
        return ran, result, enqueued


def test_a_repeated_low_latency_dispatch_is_captured_once_then_replayed_on_kept_inputs(monkeypatch):
    g, buf = _Graphs(monkeypatch), object()
    x, ids = torch.arange(6.0).view(3, 2), torch.tensor([[1, 2], [3, -1], [0, 5]])
    assert g.call(("sig", 0), buf, x, ids) == (False, None, [])  # the first call of a signature: eager
    ran, result, enqueued = g.call(("sig", 0), buf, x, ids)  # the second: captured, then replayed
    assert ran and len(enqueued) == 1 and len(g.replayed) == 1
    assert torch.equal(enqueued[0][0], x) and torch.equal(enqueued[0][1], ids)  # captured on copies
    assert result[1] != x.data_ptr() and result[2] != ids.data_ptr()
    x2, ids2 = x + 1, ids.flip(0)
    ran, again, enqueued = g.call(("sig", 0), buf, x2, ids2)  # later calls: replayed, nothing enqueued
    assert ran and again == result and enqueued == [] and len(g.replayed) == 2
    kept = g.graphs._inputs["sig"]
    assert torch.equal(kept[0], x2) and torch.equal(kept[1], ids2)  # the replay reads the new inputs
    assert (kept[0].data_ptr(), kept[1].data_ptr()) == result[1:]
    assert g.call(("sig", 1), buf, x, ids)[0] is False  # the other parity: its own graph, eager first
    assert g.call(("sig", 0), object(), x, ids)[0] is False  # a rebuilt buffer: a new graph
    assert g.waits == []
    g.call(("sig", 0), g.graphs._plans[("sig", 0)].buf, x, ids)
    g.stream = 2  # another current stream: it waits for the one the kept inputs were written on
    assert g.call(("sig", 0), g.graphs._plans[("sig", 0)].buf, x, ids)[0] and g.waits == [1]
    g.capturing = True  # inside the caller's own capture: eager
    assert g.call(("sig", 0), g.graphs._plans[("sig", 0)].buf, x, ids)[0] is False


def test_low_latency_graphs_stop_capturing_when_signatures_rarely_repeat(monkeypatch):
    from cute_ep.deep_ep.ll_graphs import CAPTURE_BUDGET, MAX_GRAPHS

    g, buf = _Graphs(monkeypatch), object()
    x, ids = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.int64)
    always, per = CAPTURE_BUDGET
    for i in range(always + 3):  # each signature twice: every second call would capture
        g.call((f"sig{i}", 0), buf, x, ids)
        g.call((f"sig{i}", 0), buf, x, ids)
    assert g.graphs.captures == always  # then no replays earned another capture
    assert len(g.graphs._plans) <= MAX_GRAPHS
    off = _Graphs(monkeypatch, enabled="0")
    for _ in range(3):
        assert off.call(("sig", 0), buf, x, ids)[0] is False
