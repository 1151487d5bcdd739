"""What ``EpBuffer``'s public calls hand the compiled module, on the CPU: the per-call device addresses and
launch scalars of ``dispatch`` (both receive layouts, synced or not, zero tokens) and ``combine``, with a
launcher that records instead of launching. The host path is rewritten for speed from time to time; this
pins what a launch receives, so such a rewrite is checked without a GPU.

The buffer is built with ``object.__new__`` and CPU tensors for its table (its symmetric buffers are plain
tensors here); the current stream is stood in for, as there is none on a CPU.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from _host_buffer import host_buffer
from _memory import share_no_byte

import cute_ep.buffer as buffer_module
import cute_ep.module_launch as module_launch
from cute_ep.api import DispatchHandle
from cute_ep.buffer import EpBuffer
from cute_ep.kernels.buffers import BUFFERS, CALL, HOST, STATUS, buffers_of
from cute_ep.kernels.config import DISPATCH_ALGORITHMS, MODES, OP_COMBINE, OP_DISPATCH, OP_LAYOUT, EpConfig
from cute_ep.kernels.variants import COMBINE_ALGORITHMS, LAYOUTS
from cute_ep.spare import SPARE_AHEAD

STREAM = 0x5EED


class Recorder:
    """Stands in for ``cute_ep.launcher.Launcher``: keeps each launch's stream, addresses and scalars."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, dict[str, int], dict[str, int]]] = []

    def __call__(self, stream: int, pointers: dict[str, int], **scalars: int) -> None:
        self.launches.append((stream, dict(pointers), scalars))


@pytest.fixture()
def buf(monkeypatch) -> EpBuffer:
    for module in (buffer_module, module_launch):  # the launch's stream, and the synced dispatch's wait
        monkeypatch.setattr(module, "current_stream_handle", lambda index: STREAM)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cfg = EpConfig(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=64, dtype=torch.bfloat16,
                   max_tokens=16, combine_algorithm="reduced")
    b = host_buffer(cfg)
    for t in BUFFERS:  # the rest of the table (host_buffer set the STATUS views)
        if t.place == HOST:
            setattr(b, t.name, b.status.mirror)
        elif t.place not in (CALL, STATUS):
            setattr(b, t.name, torch.zeros(t.alloc_shape(cfg), dtype=t.torch_dtype(cfg)))
    one = SimpleNamespace(num_tokens=1, capacity=1, hidden=cfg.hidden, topk=cfg.topk, experts_per_rank=1,
                          rank_capacity=1, world_size=1, fp8_scales=1)
    b._empty = {t.name: torch.empty(t.shape(one), dtype=t.torch_dtype(cfg)) for t in buffers_of(CALL)}
    b._align = {t.name: t.align(cfg) for t in buffers_of(CALL)}
    b._empty_addr = {n: t.data_ptr() for n, t in b._empty.items()}
    b._launcher, b.algorithm = Recorder(), "dedup"
    return b


def ll_stand_ins(buf) -> dict[str, int]:
    """The low-latency dispatch's tensors, the delivery's and the assembly's parts: stand-ins in every other
    call."""
    names = ("ll_x", "ll_src_info", "ll_count", "ll_range", "ll_scales", "ll_stats", "deliver0", "deliver1",
             "deliver2", "assemble0", "assemble1")
    return {n: buf._empty[n].data_ptr() for n in names}


def ll_padded() -> dict[str, torch.Tensor]:
    """The padded layout's tensors of the fixture's config (4 local experts, 2 * 16 slots each)."""
    el, slots = 4, 2 * 16
    return {"ll_x": torch.zeros(el * slots, 64, dtype=torch.bfloat16),
            "ll_src_info": torch.zeros(el * slots, dtype=torch.int32),
            "ll_count": torch.zeros(el, dtype=torch.int32), "ll_range": torch.zeros(el, 2, dtype=torch.int64),
            "ll_stats": torch.zeros(el, dtype=torch.int32),
            "y_slot": torch.zeros(el * slots, dtype=torch.int64)}


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(tokens, 8, generator=g), dim=1)[:, :2].to(torch.int32).contiguous()
    return x, idx, torch.rand(tokens, 2, generator=g)


def test_calls_across_a_batch_made_ahead_each_launch_into_their_own_storage(buf) -> None:
    """SPARE_AHEAD + 3 sync-free dispatches and combines of one size: each dispatch's launch names its own
    handle's storage, each combine writes a new output, and no two of those share a byte."""
    x, idx, w = inputs(5)
    kept = []
    for _ in range(SPARE_AHEAD + 3):
        res = buf.dispatch(x, idx, w, sync=False)
        h = res.handle
        ptrs = buf._launcher.launches[-1][1]
        assert (ptrs["scatter"], ptrs["own_idx"], ptrs["own_w"]) == (
            h.scatter.data_ptr(), h.topk_idx.data_ptr(), h.topk_weights.data_ptr())
        out = buf.combine(buf.recv_y[: buf.cfg.capacity], h)
        assert buf._launcher.launches[-1][1]["out"] == out.data_ptr() and out.shape == (5, 64)
        kept += [h.scatter, h.topk_idx, h.topk_weights, out]
    assert share_no_byte(kept)


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_a_sync_free_dispatch_hands_over_its_tensors_and_the_handles_storage(buf, layout) -> None:
    x, idx, w = inputs(5)
    res = buf.dispatch(x, idx, w, sync=False, layout=layout)
    ((stream, ptrs, scalars),) = buf._launcher.launches
    h = res.handle
    assert stream == STREAM
    assert ptrs == {"x": x.data_ptr(), "topk_idx": idx.data_ptr(), "topk_w": w.data_ptr(),
                    "out": buf._empty["out"].data_ptr(), "scatter": h.scatter.data_ptr(),
                    "own_idx": h.topk_idx.data_ptr(), "own_w": h.topk_weights.data_ptr(),
                    "y": buf._empty["y"].data_ptr(), "y_slot": buf._empty["y_slot"].data_ptr(),
                    **ll_stand_ins(buf)}
    combine_algo = COMBINE_ALGORITHMS["reduced" if layout == "expert" else "pull"]
    assert scalars == {"op": OP_DISPATCH, "mode": MODES["scatter"], "fp8": 0,
                       "algo": DISPATCH_ALGORITHMS["dedup"], "combine_algo": combine_algo,
                       "layout": LAYOUTS[layout], "num_tokens": 5, "own_routing": 1, "routed": 0,
                       "mirror_seq": 0, "y_rows": 0, "y_gather": 0, "phase": 0, "deliver_rows": 0,
                       "assemble_rows": 0}
    # the handle owns its routing: the layout copies the ids and weights into storage of its own
    assert {h.scatter.data_ptr(), h.topk_idx.data_ptr(), h.topk_weights.data_ptr()}.isdisjoint(
        {idx.data_ptr(), w.data_ptr()})
    assert h.num_tokens == 5 and h.layout == layout and buf._calls == [1, 1, 0]
    rows = buf.cfg.rank_capacity if layout == "rank" else buf.cfg.capacity
    assert res.recv_x.shape == (rows, 64) and res.recv_x.data_ptr() == buf.recv_x.data_ptr()
    assert res.recv_src.data_ptr() == buf.recv_src.data_ptr() and res.recv_count is buf.num_recv
    # the next sync-free call of the layout hands over the same views (made once), the other layout its own
    again = buf.dispatch(x, idx, w, sync=False, layout=layout)
    assert again.recv_x is res.recv_x and again.recv_src is res.recv_src and again.handle is not h
    assert again.recv_weights is res.recv_weights and again.recv_topk_idx is res.recv_topk_idx
    other = buf.dispatch(x, idx, w, sync=False, layout="expert" if layout == "rank" else "rank")
    assert other.recv_x is not res.recv_x and (other.recv_weights is None) == (layout == "expert")


class Mirroring(Recorder):
    """A ``Recorder`` that, for a launch with ``mirror_seq``, writes the status mirror as the layout's
    leader would: the layout's epoch at its launches (the host counts this launch after it returns), the
    dispatch's one behind (this launch's still runs; ``dispatch_behind`` more: dispatches that did not
    run), the count, whatever ``extra`` says (word index -> value), then the sequence number last."""

    def __init__(self, buf, num_recv: int, extra: dict[int, int] | None = None, dispatch_behind: int = 0
                 ) -> None:  # fmt: skip
        super().__init__()
        self.buf, self.num_recv, self.extra, self.behind = buf, num_recv, extra or {}, dispatch_behind

    def __call__(self, stream: int, pointers: dict[str, int], **scalars: int) -> None:
        super().__call__(stream, pointers, **scalars)
        st, calls = self.buf.status, self.buf._calls
        m, at = st._mirror_words, st._slices
        m[:] = 0
        m[at["epochs"]].view("int64")[:] = [calls[0] + 1, calls[1] - self.behind, calls[2]]
        m[at["num_recv"].start] = self.num_recv
        for word, value in self.extra.items():
            m[word] = value
        m[-1] = scalars["mirror_seq"]


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_a_synced_dispatch_reads_its_count_from_the_mirror_and_reports_what_it_holds(buf, layout) -> None:
    """With nothing to report, the count is read from the mirror's words in place (``quiet_count``); a
    fault or a refusal in the mirror goes through the whole block's checks and raises as before."""
    from cute_ep.kernels.buffers import FAULT_COUNT, INPUT_FAULT_FIRST, INPUT_FAULT_RANKS
    from cute_ep.status import PeerTimeout

    buf.status.use_mirror = lambda: True  # as on a GPU whose driver mapped the mirror
    buf.status.mirrored = _counted(buf.status.mirrored)
    at = buf.status._slices
    buf._launcher = Mirroring(buf, num_recv=3)
    x, idx, w = inputs(5)
    res = buf.dispatch(x, idx, w, layout=layout)
    (_, _, scalars), = buf._launcher.launches
    assert scalars["mirror_seq"] == buf.status._seq != 0
    assert res.num_recv == 3 and res.recv_x.shape == (3, 64) and buf._latest_recv == 3
    assert buf.status.mirrored.calls == 0  # the quiet path: no decode of the block
    buf._launcher = Mirroring(buf, num_recv=3, extra={at["fault"].start + FAULT_COUNT: 1})
    with pytest.raises(PeerTimeout):
        buf.dispatch(x, idx, w, layout=layout)
    assert buf.status.mirrored.calls == 1
    buf._launcher = Mirroring(buf, num_recv=3, extra={at["input_fault"].start + INPUT_FAULT_RANKS: 1,
                                                      at["input_fault"].start + INPUT_FAULT_FIRST: 1})
    with pytest.raises(ValueError, match="rank 1 passed invalid topk_idx"):
        buf.dispatch(x, idx, w, layout=layout)


def test_a_synced_dispatch_returns_while_its_rows_move_and_still_finds_a_dispatch_that_did_not_run(buf):
    """The mirror is the layout leader's: the call's own dispatch epoch is one behind and that is quiet;
    an earlier dispatch that never ran (two behind) raises ``KernelDidNotRun``."""
    from cute_ep.status import KernelDidNotRun

    buf.status.use_mirror = lambda: True
    buf.status.mirrored = _counted(buf.status.mirrored)
    x, idx, w = inputs(5)
    for _ in range(3):  # each launch's mirror holds its dispatch one behind: every call quiet
        buf._launcher = Mirroring(buf, num_recv=4)
        assert buf.dispatch(x, idx, w, layout="rank").num_recv == 4
    assert buf.status.mirrored.calls == 0 and buf._calls[OP_DISPATCH] == 3
    buf._launcher = Mirroring(buf, num_recv=4, dispatch_behind=1)
    with pytest.raises(KernelDidNotRun, match="dispatch kernel did not complete"):
        buf.dispatch(x, idx, w, layout="rank")
    assert buf.status.mirrored.calls == 1


def test_a_synced_dispatch_hands_over_the_views_of_its_count_made_once(buf, monkeypatch) -> None:
    """Views are made once per row count (and layout, format, inference mode), for the latest KEPT_VIEWS
    counts: a decode step's repeated counts skip the slicing."""
    import cute_ep.received_views as received_views

    monkeypatch.setattr(received_views, "KEPT_VIEWS", 4)
    buf.status.use_mirror = lambda: True
    x, idx, w = inputs(5)

    def synced(count: int):
        buf._launcher = Mirroring(buf, num_recv=count)
        return buf.dispatch(x, idx, w, layout="rank")

    first, other, again = synced(3), synced(4), synced(3)
    assert again.recv_x is first.recv_x and again.recv_topk_weights is first.recv_topk_weights
    assert other.recv_x is not first.recv_x and other.recv_x.shape == (4, 64)
    with torch.inference_mode():
        inferred = synced(3)
    assert inferred.recv_x is not first.recv_x and not torch.is_inference(first.recv_x)
    for count in (5, 6, 7):  # 3 was the oldest: it goes
        assert synced(count).recv_src.shape == (count,)
    assert len(buf._views) == 4 and synced(3).recv_x is not first.recv_x


def _counted(fn):
    def counted(*args):
        counted.calls += 1
        return fn(*args)

    counted.calls = 0
    return counted


def test_int64_ids_reach_the_kernels_as_clamped_int32(buf) -> None:
    x, idx, w = inputs(3)
    wide = idx.long()
    wide[0, 0] = 2**40  # no int32 holds it: clamped to E, which the layout kernel refuses
    res = buf.dispatch(x, wide, w, sync=False)
    ((_, ptrs, _),) = buf._launcher.launches
    assert ptrs["topk_idx"] != wide.data_ptr()  # a converted copy
    assert res.handle.topk_idx.dtype == torch.int32


def test_a_callers_own_routing_storage_must_be_4_byte_aligned(buf) -> None:
    """launch_dispatch(own=...): the ids' and weights' storage is read as 4-byte words; a misaligned one is
    refused before anything launches."""
    x, idx, w = inputs(3)
    slots = torch.zeros(3, 2, dtype=torch.int32)
    for at in (1, 2):
        own = [slots, torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2)]
        own[at] = SimpleNamespace(data_ptr=lambda: 0x1002)  # no torch tensor of these dtypes sits there
        name = ("own_idx", "own_w")[at - 1]
        with pytest.raises(ValueError, match=f"{name} must be 4-byte aligned, got address 0x1002"):
            buf.launch_dispatch(x, idx, w, own=tuple(own))
    assert buf._launcher.launches == []


def test_zero_tokens_launch_with_the_stand_ins(buf) -> None:
    x, idx, w = inputs(0)
    buf.dispatch(x, idx, w, sync=False, layout="rank")
    ((_, ptrs, scalars),) = buf._launcher.launches
    for name in ("x", "topk_idx", "topk_w", "out", "own_idx", "own_w", "y"):
        assert ptrs[name] == buf._empty[name].data_ptr(), name
    assert ptrs["scatter"] == buf.scatter.data_ptr()
    assert scalars["num_tokens"] == 0 and scalars["own_routing"] == 0


@pytest.mark.parametrize("layout", ["expert", "rank"])
@pytest.mark.parametrize("synced_first", [False, True])
def test_a_cached_dispatch_sends_along_the_latest_dispatchs_slots_with_no_layout(buf, layout,
                                                                                 synced_first) -> None:
    """launch_cached_dispatch: one launch with ``routed`` 1 (the module runs no layout), the new x, the
    handle's own slots, ids and weights (nothing copied, MODE_SCATTER), no own routing, the same variant
    scalars as the handle's dispatch; the handle stays the latest dispatch's (a second cached call works,
    combines still push), and a count the host read at that dispatch is still known."""
    x, idx, w = inputs(5)
    if synced_first:  # a status as the device would give it, read by the host
        buf.status.read = lambda: {"num_recv": 3, "dropped": torch.zeros(8, dtype=torch.int64), "fault": None}
        buf._check_ran = lambda *ops, running=None: None
        buf.status.refused_inputs = lambda status: None
        buf._take_drops = lambda dropped, result: None
        buf.status.use_mirror = lambda: False
        res = buf.dispatch(x, idx, w, layout=layout)
        assert res.num_recv == 3
    else:
        res = buf.dispatch(x, idx, w, sync=False, layout=layout)
    full = buf._launcher.launches[-1]
    h, known = res.handle, buf._latest_recv
    x2 = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for _ in range(2):
        assert buf.launch_cached_dispatch(x2, h) is h and buf.is_latest(h) and buf._latest_recv == known
        stream, ptrs, scalars = buf._launcher.launches[-1]
        assert stream == STREAM and ptrs["x"] == x2.data_ptr() and ptrs["scatter"] == h.scatter.data_ptr()
        assert ptrs["topk_idx"] == h.topk_idx.data_ptr() and ptrs["topk_w"] == h.topk_weights.data_ptr()
        assert ptrs["own_idx"] == buf._empty["own_idx"].data_ptr()
        assert scalars == {**full[2], "routed": 1, "own_routing": 0, "mirror_seq": 0}
    assert buf._calls[:2] == [3, 3]  # each counts a layout too: the kernel advances the layout's epoch
    if layout == "rank":
        assert buf.pushes(h)


def test_a_cached_dispatch_refuses_what_the_latest_layout_does_not_hold(buf) -> None:
    """Refused with the fix named: the handle of an earlier dispatch (or after a layout alone), another
    number of rows than the handle's, a low-latency handle."""
    x, idx, w = inputs(4)
    first = buf.dispatch(x, idx, w, sync=False, layout="rank")
    with pytest.raises(ValueError, match="handle's 4 rows"):
        buf.launch_cached_dispatch(x[:3], first.handle)
    buf.dispatch(*inputs(3, seed=1), sync=False, layout="rank")
    with pytest.raises(ValueError, match="latest dispatch.*dispatch anew"):
        buf.launch_cached_dispatch(x, first.handle)
    latest = buf.dispatch(x, idx, w, sync=False).handle
    buf._launch(OP_LAYOUT, 3)
    with pytest.raises(ValueError, match="latest dispatch"):
        buf.launch_cached_dispatch(x, latest)
    ll = DispatchHandle(latest.topk_idx, latest.topk_weights, latest.scatter, 4, "scatter", "low-latency")
    with pytest.raises(ValueError, match="expert- or rank-layout handle"):
        buf.launch_cached_dispatch(x, ll)
    latest = buf.dispatch(x, idx, w, sync=False).handle
    wide = dataclasses.replace(latest, scatter=latest.scatter.long())
    with pytest.raises(ValueError, match=r"scatter must be the dispatch's \[4, 2\] int32 slots"):
        buf.launch_cached_dispatch(x, wide)
    assert len(buf._launcher.launches) == 5  # nothing launched by the refused calls


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_combine_hands_over_the_handles_slots_and_a_new_output(buf, layout) -> None:
    x, idx, w = inputs(4)
    res = buf.dispatch(x, idx, w, sync=False, layout=layout)
    y = buf.expert_output(res.recv_x.shape[0])
    out = buf.combine(y, res.handle)
    stream, ptrs, scalars = buf._launcher.launches[-1]
    h = res.handle
    assert stream == STREAM and out.shape == (4, 64) and out.dtype == torch.bfloat16
    assert ptrs == {"x": buf._empty["x"].data_ptr(), "topk_idx": h.topk_idx.data_ptr(),
                    "topk_w": h.topk_weights.data_ptr(), "out": out.data_ptr(),
                    "scatter": h.scatter.data_ptr(), "own_idx": buf._empty["own_idx"].data_ptr(),
                    "own_w": buf._empty["own_w"].data_ptr(), "y": buf._empty["y"].data_ptr(),
                    "y_slot": buf._empty["y_slot"].data_ptr(), **ll_stand_ins(buf)}
    assert scalars["y_rows"] == 0 and scalars["y_gather"] == 0  # y is recv_y itself: nothing to stage
    # the buffer's reduced combine; in the rank layout the pull (the push only where asked for by name)
    want_algo = COMBINE_ALGORITHMS["reduced" if layout == "expert" else "pull"]
    assert scalars["op"] == OP_COMBINE and scalars["num_tokens"] == 4 and scalars["combine_algo"] == want_algo
    assert scalars["layout"] == LAYOUTS[layout] and buf._calls == [1, 1, 1]


def test_a_rank_combine_pushes_only_when_asked_and_only_the_latest_dispatchs_rows(buf) -> None:
    """The rank layout's one result, two ways (EpBuffer.pushes): asked for by name ("reduced"), the latest
    dispatch's handle pushes the caller's y where it is (combine_algo "reduced", y handed over, nothing
    staged first on the host); by default, or with "pull", it pulls; an earlier dispatch's handle, whose
    source tags the buffer no longer holds, pulls even when asked; a layout-only launch (which rewrites the
    count) leaves no handle to push; an expert-layout handle never pushes."""
    x, idx, w = inputs(4)
    first = buf.dispatch(x, idx, w, sync=False, layout="rank")
    y = torch.randn(first.recv_x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert buf.pushes(first.handle)
    out = torch.empty((4, 64), dtype=torch.bfloat16)
    buf.launch_combine(first.handle, out, "reduced", y=y)
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert scalars["combine_algo"] == COMBINE_ALGORITHMS["reduced"] and scalars["layout"] == LAYOUTS["rank"]
    assert ptrs["y"] == y.data_ptr() and scalars["y_rows"] == -y.shape[0]
    for algorithm in (None, "pull"):
        buf.launch_combine(first.handle, out, algorithm, y=y)
        assert buf._launcher.launches[-1][2]["combine_algo"] == COMBINE_ALGORITHMS["pull"]
    second = buf.dispatch(*inputs(3, seed=1), sync=False, layout="rank")
    assert not buf.pushes(first.handle) and buf.pushes(second.handle)
    buf.launch_combine(first.handle, out, "reduced", y=y)
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert scalars["combine_algo"] == COMBINE_ALGORITHMS["pull"] and scalars["y_rows"] == y.shape[0]
    buf._launch(OP_LAYOUT, 3)  # a layout alone rewrites num_recv and the routing the push would read
    assert not buf.pushes(second.handle)
    expert = buf.dispatch(x, idx, w, sync=False)
    assert not buf.pushes(expert.handle)


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_combine_stages_the_callers_y_on_the_device_as_many_rows_as_received(buf, layout) -> None:
    """A y of the caller's (not recv_y) goes to the module, which copies it into recv_y first: after a
    sync-free dispatch, as many rows as the device's count of that dispatch (y_rows = -rows, the count at
    most y's rows), so a worst-case y costs only the rows received; no host copy."""
    x, idx, w = inputs(4)
    res = buf.dispatch(x, idx, w, sync=False, layout=layout)
    y = torch.randn(res.recv_x.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    before = buf.recv_y.clone()
    buf.combine(y, res.handle)
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert ptrs["y"] == y.data_ptr() and scalars["y_rows"] == -y.shape[0]
    assert torch.equal(buf.recv_y, before)  # the kernel stages it, not the host


def test_combine_of_an_older_dispatchs_handle_stages_all_of_y(buf) -> None:
    """The device's count is the latest dispatch's: a combine for an earlier handle copies every row of
    y (y_rows = +rows)."""
    x, idx, w = inputs(4)
    first = buf.dispatch(x, idx, w, sync=False)
    buf.dispatch(*inputs(3, seed=1), sync=False)
    y = torch.zeros(first.recv_x.shape, dtype=torch.bfloat16)
    buf.combine(y, first.handle, algorithm="pull")  # the buffer's reduced combine needs the latest
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert ptrs["y"] == y.data_ptr() and scalars["y_rows"] == y.shape[0]


def test_a_strided_y_is_copied_on_the_host_and_not_staged(buf) -> None:
    x, idx, w = inputs(4)
    res = buf.dispatch(x, idx, w, sync=False)
    rows, h = res.recv_x.shape
    wide = torch.randn(rows, 2 * h, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y = wide[:, :h]  # rows 2H apart: not what the kernel's 16-byte row copies read
    buf.combine(y, res.handle)
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert scalars["y_rows"] == 0 and ptrs["y"] == buf._empty["y"].data_ptr()
    assert torch.equal(buf.recv_y[:rows], y)


def test_launch_combine_gathers_y_by_its_slots_on_the_device(buf) -> None:
    """launch_combine(y=, y_slot=) (the low-latency combine reading DeepEP's padded layout): the module gets
    y, the slots and y_gather = 1, and stages as many rows as the latest dispatch received (y_rows = minus
    the slots' count); slots it cannot read as contiguous int64 are gathered on the host instead."""
    x, idx, w = inputs(4)
    handle = buf.launch_dispatch(x, idx, w)
    padded = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    slots = torch.randperm(40, generator=torch.Generator().manual_seed(4))[:24]
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    before = buf.recv_y.clone()
    buf.launch_combine(handle, out, y=padded, y_slot=slots)
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert ptrs["y"] == padded.data_ptr() and ptrs["y_slot"] == slots.data_ptr()
    assert scalars["y_gather"] == 1 and scalars["y_rows"] == -24
    assert torch.equal(buf.recv_y, before)  # the kernel stages them, not the host
    strided = torch.stack([slots, slots], 1)[:, 0]  # not contiguous: the host gathers, nothing to stage
    assert not strided.is_contiguous()
    buf.launch_combine(handle, out, y=padded, y_slot=strided)
    _, ptrs, scalars = buf._launcher.launches[-1]
    assert scalars["y_gather"] == 0 and scalars["y_rows"] == 0
    assert ptrs["y_slot"] == buf._empty["y_slot"].data_ptr()
    assert torch.equal(buf.recv_y[:24], padded[strided])


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_launches_hand_over_the_padded_tensors_and_the_phase(buf, split) -> None:
    """The low-latency layout's launches (cute_ep/low_latency_launches.py): the dispatch gets the caller's
    routing, the handle's own tensors and every padded tensor by name, the combine the padded rows, the
    dispatch's pairs and counts; with return_recv_hook (``split``) each op is two launches, the sending
    half counted as the op's launch and the receiving half not (its epoch is the op's)."""
    from cute_ep.kernels.config import OP_LAYOUT, PHASE_ALL, PHASE_RECEIVE, PHASE_SEND
    from cute_ep.kernels.variants import LAYOUT_LOW_LATENCY

    x, idx, w = inputs(5)
    own = tuple(torch.zeros(5, 2, dtype=d) for d in (torch.int32, torch.int32, torch.float32))
    padded = ll_padded()
    phases = (PHASE_SEND, PHASE_RECEIVE) if split else (PHASE_ALL,)
    for phase in phases:
        handle = buf.launch_low_latency_dispatch(x, idx, w, own, padded, fp8=3, phase=phase)
    assert handle.layout == "low-latency" and handle.scatter is own[0] and handle.topk_idx is own[1]
    assert buf._calls[OP_LAYOUT] == buf._calls[OP_DISPATCH] == 1  # one dispatch, however many halves
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    for phase in phases:
        buf.launch_low_latency_combine(handle, out, padded["ll_x"], padded["y_slot"], padded["ll_count"],
                                       phase)
    assert buf._calls[OP_COMBINE] == 1
    launches = buf._launcher.launches
    assert len(launches) == 2 * len(phases)
    for (_, ptrs, scalars), phase in zip(launches[: len(phases)], phases, strict=True):
        assert scalars["op"] == OP_DISPATCH and scalars["phase"] == phase and scalars["fp8"] == 3
        assert scalars["layout"] == LAYOUT_LOW_LATENCY and scalars["own_routing"] == 1
        assert ptrs["x"] == x.data_ptr() and ptrs["topk_idx"] == idx.data_ptr()
        assert (ptrs["scatter"], ptrs["own_idx"], ptrs["own_w"]) == tuple(t.data_ptr() for t in own)
        assert all(ptrs[n] == t.data_ptr() for n, t in padded.items())
    for (_, ptrs, scalars), phase in zip(launches[len(phases):], phases, strict=True):
        assert scalars["op"] == OP_COMBINE and scalars["phase"] == phase and scalars["y_rows"] == 0
        assert scalars["layout"] == LAYOUT_LOW_LATENCY
        assert ptrs["y"] == padded["ll_x"].data_ptr() and ptrs["y_slot"] == padded["y_slot"].data_ptr()
        assert ptrs["ll_count"] == padded["ll_count"].data_ptr() and ptrs["out"] == out.data_ptr()
        assert ptrs["scatter"] == own[0].data_ptr() and ptrs["topk_w"] == own[2].data_ptr()


def test_a_delivering_dispatch_hands_over_its_parts_and_where_each_ends(buf) -> None:
    """``launch_dispatch(..., deliver=(rows, parts))``: each part's address and the byte where it ends in a
    row (absent parts end where the last one did), the rows at most the capacity; the next launch
    delivers nothing."""
    x, idx, w = inputs(5)
    head = torch.empty(7, 25, dtype=torch.int32)  # 100 bytes of a 128-byte row
    tail = torch.empty(7, 7, dtype=torch.float32)  # the next 28
    buf.launch_dispatch(x, idx, w, layout="rank", deliver=(7, (head, tail)))
    whole = torch.empty(10**6, 32, dtype=torch.int32)
    buf.launch_dispatch(x, idx, w, layout="rank", deliver=(10**6, (whole,)))
    buf.launch_dispatch(x, idx, w, layout="rank")
    (_, ptrs, scalars), (_, _, most), (_, plain_ptrs, plain) = buf._launcher.launches
    assert ptrs["deliver0"] == head.data_ptr() and ptrs["deliver1"] == tail.data_ptr()
    assert ptrs["deliver2"] == buf._empty["deliver2"].data_ptr()
    assert {k: v for k, v in scalars.items() if k.startswith("deliver")} == {
        "deliver_rows": 7, "deliver_end0": 100, "deliver_end1": 128, "deliver_end2": 128}
    assert most["deliver_rows"] == buf.cfg.capacity and most["deliver_end0"] == 128
    assert plain["deliver_rows"] == 0
    assert all(plain_ptrs[f"deliver{i}"] == buf._empty[f"deliver{i}"].data_ptr() for i in range(3))


@pytest.mark.parametrize("parts, message", [
    (lambda: (), "1 to 3 parts, got 0"),
    (lambda: (torch.empty(4, 4, dtype=torch.int32),) * 4, "1 to 3 parts, got 4"),
    (lambda: (torch.empty(3, 4, dtype=torch.int32),), "at least 4 rows"),
    (lambda: (torch.empty(4, 3, dtype=torch.uint8),), "a multiple of 4 bytes"),
    (lambda: (torch.empty(4, 8, dtype=torch.int32)[:, :4],), "contiguous"),
    (lambda: (torch.empty(4 * 4 + 1, dtype=torch.int32)[1:].view(4, 4),), "16-byte aligned"),
    (lambda: (torch.empty(4, 4, dtype=torch.int32, device="meta"),), "on meta"),
    (lambda: (torch.empty(4, 33, dtype=torch.int32),), "take 132 bytes of each row; a received row has 128"),
])
def test_a_delivery_the_kernel_could_not_write_is_refused(buf, parts, message) -> None:
    x, idx, w = inputs(4)
    with pytest.raises(ValueError, match=message):
        buf.launch_dispatch(x, idx, w, layout="rank", deliver=(4, parts()))
    assert not buf._launcher.launches


def test_an_assembling_dispatch_hands_over_its_values_words_and_their_strides(buf) -> None:
    """``launch_dispatch(..., assemble=(values, words))``: both addresses, where the values end in a row and
    the words end, the words' strides in words (column-major scales: 1 and the token count), the tokens;
    the next launch assembles nothing."""
    x, idx, w = inputs(5)
    values = torch.empty(5, 24, dtype=torch.int32)  # 96 bytes of a 128-byte row
    words = torch.empty(6, 5, dtype=torch.float32).T  # [5, 6], column-major: 24 bytes, 8 left to zero
    buf.launch_dispatch(x, idx, w, layout="rank", assemble=(values, words))
    buf.launch_dispatch(x, idx, w, layout="rank")
    (_, ptrs, scalars), (_, _, plain) = buf._launcher.launches
    assert ptrs["assemble0"] == values.data_ptr() and ptrs["assemble1"] == words.data_ptr()
    assert {k: v for k, v in scalars.items() if k.startswith("assemble")} == {
        "assemble_rows": 5, "assemble_end0": 96, "assemble_end1": 120, "assemble_stride_t": 1,
        "assemble_stride_j": 5}
    assert plain["assemble_rows"] == 0


@pytest.mark.parametrize("parts, message", [
    (lambda: (torch.empty(4, 4, dtype=torch.int32), torch.empty(4, 1)), "values must be .* of 5 rows"),
    (lambda: (torch.empty(5, 3, dtype=torch.uint8), torch.empty(5, 1)), "a multiple of 4 bytes"),
    (lambda: (torch.empty(5, 8, dtype=torch.int32)[:, :4], torch.empty(5, 1)),
     "values must be a contiguous"),
    (lambda: (torch.empty(5, 4, dtype=torch.int32), torch.empty(5, 1, dtype=torch.float64)),
     "4-byte elements"),
    (lambda: (torch.empty(5, 4, dtype=torch.int32), torch.empty(6, 1)), "words must be .* 5 rows"),
    (lambda: (torch.empty(5, 4, dtype=torch.int32), torch.empty(5, 1, device="meta")), "on meta"),
    (lambda: (torch.empty(5, 30, dtype=torch.int32), torch.empty(5, 3)), "take 132 bytes of each row"),
])
def test_an_assembly_the_kernel_could_not_read_is_refused(buf, parts, message) -> None:
    x, idx, w = inputs(5)
    with pytest.raises(ValueError, match=message):
        buf.launch_dispatch(x, idx, w, layout="rank", assemble=parts())
    assert not buf._launcher.launches
