"""EpBuffer's host-side bookkeeping on the CPU (no NVSHMEM): the status block it reads in one copy,
capacity drop accounting under both overflow policies, and the per-call pointer cache.

The buffer is built without ``__init__`` (``_host_buffer.host_buffer``: no runtime, no compiled module), so
the logic that decides what a user sees (errors, counts) is tested without a GPU.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from _host_buffer import host_buffer

from cute_ep.api import DispatchHandle
from cute_ep.buffer import EpBuffer
from cute_ep.kernels.buffers import BUFFERS, FAULT_WORDS, STATUS, status_layout
from cute_ep.kernels.config import EpConfig
from cute_ep.profiler import pick_fastest_algorithm
from cute_ep.status import CapacityExceeded, KernelDidNotRun, PeerTimeout


def _buffer(on_overflow: str = "raise") -> EpBuffer:
    cfg = EpConfig(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=128, dtype=torch.bfloat16,
                   max_tokens=16, capacity_factor=0.5, on_overflow=on_overflow)
    return host_buffer(cfg)


def test_status_block_reads_every_field_in_one_copy():
    buf = _buffer()
    buf.epochs.copy_(torch.tensor([3, 2, 1]))
    buf.num_recv.fill_(41)
    buf.dropped[5] = 7
    st = buf.status.read()
    assert st["epochs"] == [3, 2, 1] and st["num_recv"] == 41 and st["fault"] == [0] * FAULT_WORDS
    assert st["dropped"].tolist() == [0, 0, 0, 0, 0, 7, 0, 0]
    buf._calls = [3, 2, 1]
    buf._check_ran(st, 0, 1, 2)  # epochs match the launches: no error
    buf._calls = [1, 1, 1]  # epochs ahead: graph replays ran kernels the host never counted
    buf._check_ran(st, 0, 1, 2)
    assert buf._calls == [3, 2, 1]  # the host's count catches up
    buf._calls = [3, 3, 1]  # an epoch behind: a dispatch kernel did not run
    with pytest.raises(KernelDidNotRun, match="dispatch kernel did not complete: epoch 2, expected 3"):
        buf._check_ran(st, 0, 1, 2)


def test_fault_record_raises_peer_timeout_naming_op_and_peer():
    buf = _buffer()
    buf.fault.copy_(torch.tensor([1, 1, 1, 4], dtype=torch.int32))  # 1 wait timed out in dispatch, peer 1
    with pytest.raises(PeerTimeout, match=r"dispatch on rank 0: rank 1 did not signal .* \(dispatch call 4"):
        buf.check_faults()


def test_raise_policy_reports_drops_once_with_experts_and_ranks():
    buf = _buffer("raise")
    buf.dropped[1] = 3
    buf.dropped[6] = 2
    with pytest.raises(CapacityExceeded) as info:
        buf.check_capacity(result="the result")
    exc = info.value
    assert exc.dropped == {1: 3, 6: 2} and exc.total == 5 and exc.result == "the result"
    assert "dispatch dropped 5 rows beyond expert_capacity=4" in str(exc)
    assert "expert 1 (rank 0): 3, expert 6 (rank 1): 2" in str(exc)
    assert int(buf.dropped.sum()) == 0  # reset on the device: the next check counts afresh
    buf.check_capacity()  # nothing pending: no error


def test_drop_policy_counts_until_read():
    buf = _buffer("drop")
    buf.dropped[2] = 4
    buf.check_capacity()  # "drop" never raises
    buf.dropped[2] += 1  # a later dispatch drops more
    buf.dropped[7] = 2
    assert buf.dropped_rows().tolist() == [0, 0, 5, 0, 0, 0, 0, 2]
    assert buf.dropped_rows().tolist() == [0] * 8  # read resets


def test_status_block_members_do_not_overlap_and_cover_the_status_buffers():
    cfg = _buffer().cfg
    where, words = status_layout(cfg)
    assert set(where) == {b.name for b in BUFFERS if b.place == STATUS}
    spans = sorted(where.values())
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))  # disjoint
    assert spans[-1][0] + spans[-1][1] <= words
    assert where["epochs"][0] % 2 == 0  # int64 words start on an 8-byte boundary
    assert where["fault"][1] == FAULT_WORDS and where["dropped"][1] == cfg.num_experts


class _FakeModule:
    """Stands in for a compiled module: argument storage laid out like the DSL's (a c_int32 behind a
    c_void_p per scalar, 8 bytes per pointer and for the stream), and a record of each run."""

    def __init__(self) -> None:
        self.runs: list[tuple[list[int], list[int], int]] = []

    def generate_execution_args(self, scalars, pointers, stream):
        self.ints = [ctypes.c_int32(int(v)) for v in scalars]
        self.words = [ctypes.c_uint64(int(p)) for p in pointers] + [ctypes.c_uint64(int(stream))]
        exe = [ctypes.c_void_p(ctypes.addressof(v)) for v in self.ints]
        return exe + [ctypes.addressof(v) for v in self.words], []

    def run_compiled_program(self, exe) -> None:
        n = len(self.ints)
        ints = [ctypes.c_int32.from_address(a.value).value for a in exe[:n]]
        words = [ctypes.c_uint64.from_address(a).value for a in exe[n:]]
        self.runs.append((ints, words[:-1], words[-1]))


def test_launcher_writes_only_what_a_call_changes_into_the_storage():
    from cute_ep.kernels.buffers import CALL_SCALARS, SIZE_SCALARS, Pointers
    from cute_ep.kernels.host import size_scalars
    from cute_ep.launcher import Launcher

    cfg = _buffer().cfg
    module = _FakeModule()
    names = [b.name for b in BUFFERS]
    own = Pointers(*(4096 * (i + 1) for i in range(len(names))))
    launch = Launcher(module, size_scalars(cfg), own, rank=1)
    launch(77, {"x": 0x10000, "out": 0x20000}, op=2, num_tokens=9, combine_algo=1)
    launch(78, {"topk_idx": 0x30000}, op=1, mode=1, num_tokens=5)
    (ints1, ptrs1, stream1), (ints2, ptrs2, stream2) = module.runs
    call1, call2 = dict(zip(CALL_SCALARS, ints1, strict=False)), dict(zip(CALL_SCALARS, ints2, strict=False))
    assert call1 == {"op": 2, "mode": 0, "fp8": 0, "algo": 0, "combine_algo": 1, "layout": 0, "rank": 1,
                     "num_tokens": 9, "own_routing": 0, "routed": 0, "mirror_seq": 0, "y_rows": 0,
                     "y_gather": 0, "phase": 0, "deliver_rows": 0, "deliver_end0": 0, "deliver_end1": 0,
                     "deliver_end2": 0, "assemble_rows": 0, "assemble_end0": 0, "assemble_end1": 0,
                     "assemble_stride_t": 0, "assemble_stride_j": 0}
    assert call2 == {**call1, "op": 1, "mode": 1, "num_tokens": 5}  # what a call does not name stays
    sizes = ints2[len(CALL_SCALARS):]
    assert sizes == [getattr(cfg, n) for n in SIZE_SCALARS]  # the sizes were written once, at build
    by1, by2 = dict(zip(names, ptrs1, strict=True)), dict(zip(names, ptrs2, strict=True))
    assert by1["x"] == 0x10000 and by1["out"] == 0x20000 and by2["topk_idx"] == 0x30000
    assert by2["recv_x"] == 4096 * (names.index("recv_x") + 1)  # the buffer's own pointers never change
    assert (stream1, stream2) == (77, 78)


class _FakePackedModule(_FakeModule):
    """A stand-in with the DSL's packed-call members: the address list it is called with must be the one
    packed at build (with its trailing extras), reading the storage as a launch left it."""

    def __init__(self, result: int = 0) -> None:
        super().__init__()
        self.cuda_result = ctypes.c_int32(result)
        self.extras = [ctypes.c_uint64(0xAB), ctypes.c_uint64(0xCD)]  # the result word, a kernel handle
        self._num_extra_args = len(self.extras)
        self.packs = 0

    def _get_invoke_packed_args(self, exe):
        self.packs += 1
        addrs = [a if isinstance(a, int) else a.value for a in exe]
        packed = (ctypes.c_void_p * (len(addrs) + 5))()  # larger than needed, as the DSL's reused array
        for i, a in enumerate(addrs + [ctypes.addressof(v) for v in self.extras]):
            packed[i] = a
        return packed

    def capi_func(self, packed) -> None:
        n, total = len(self.ints), len(self.ints) + len(self.words)
        assert len(packed) == total + len(self.extras)
        assert [ctypes.c_uint64.from_address(packed[total + i]).value for i in range(2)] == [0xAB, 0xCD]
        ints = [ctypes.c_int32.from_address(packed[i]).value for i in range(n)]
        words = [ctypes.c_uint64.from_address(packed[i]).value for i in range(n, total)]
        self.runs.append((ints, words[:-1], words[-1]))

    def run_compiled_program(self, exe) -> None:
        raise AssertionError("the packed path must not repack the arguments")


def test_launcher_packs_the_address_list_once_and_checks_the_result():
    from cute_ep.kernels.buffers import CALL_SCALARS, Pointers
    from cute_ep.kernels.host import size_scalars
    from cute_ep.launcher import Launcher

    cfg = _buffer().cfg
    names = [b.name for b in BUFFERS]
    own = Pointers(*(4096 * (i + 1) for i in range(len(names))))
    module = _FakePackedModule()
    launch = Launcher(module, size_scalars(cfg), own, rank=0)
    launch(5, {"scatter": 0x40000}, op=3, num_tokens=7)
    launch(6, {}, op=1, num_tokens=2)
    assert module.packs == 1  # packed at build, never again
    (ints1, ptrs1, s1), (ints2, ptrs2, s2) = module.runs
    assert dict(zip(CALL_SCALARS, ints2, strict=False))["num_tokens"] == 2 and (s1, s2) == (5, 6)
    assert dict(zip(names, ptrs2, strict=True))["scatter"] == 0x40000  # a pointer keeps its last value
    failing = _FakePackedModule(result=700)  # cudaErrorIllegalAddress
    launch = Launcher(failing, size_scalars(cfg), own, rank=0)
    with pytest.raises(RuntimeError, match=r"launching the cute-ep module failed: .*700"):
        launch(5, {}, op=1, num_tokens=1)


class _BoundFunction:
    """The DSL's executor of a function bound to a device: packed-call members, a record of each run."""

    def __init__(self, store: list) -> None:
        self.store, self.cuda_result, self._num_extra_args = store, ctypes.c_int32(0), 0
        self.packs, self.runs = 0, []

    def _get_invoke_packed_args(self, exe):
        self.packs += 1
        return (ctypes.c_void_p * len(exe))(*exe)

    def capi_func(self, packed) -> None:
        self.runs.append([ctypes.c_uint64.from_address(a).value for a in packed])


class _UnboundFunction:
    """A function compiled apart and never registered with NVSHMEM: no packed-call members until ``to``
    binds it to a device; its own call would pack the arguments anew."""

    def __init__(self) -> None:
        self.binds: list = []

    def generate_execution_args(self, *args):
        self.store = [ctypes.c_uint64(int(a)) for a in args]
        return [ctypes.addressof(v) for v in self.store], []

    def to(self, device) -> _BoundFunction:
        self.binds.append(device)
        self.bound = _BoundFunction(self.store)
        return self.bound

    def run_compiled_program(self, exe) -> None:
        raise AssertionError("a prepared call must run through the bound executor's packed list")


def test_prepared_call_binds_a_function_compiled_apart_once_and_runs_it_packed():
    from cute_ep.launcher import PreparedCall, bound_to_device

    fn = _UnboundFunction()
    call = PreparedCall(fn, (1, 2, 3), ("ptr", "i32", "stream"))
    assert fn.binds == []  # bound at the first call, on the device current then (no GPU needed here)
    call(0x7000, 9, 0x1234)
    call(0x8000, 10, 0x1235)
    assert fn.binds == [None] and fn.bound.packs == 1  # bound once, the address list packed once
    assert [(r[0], ctypes.c_int32(r[1]).value, r[2]) for r in fn.bound.runs] == [(0x7000, 9, 0x1234),
                                                                                  (0x8000, 10, 0x1235)]
    assert bound_to_device(fn.bound) is fn.bound  # already bound: unchanged


def test_a_launch_compiled_apart_makes_its_prepared_call_once():
    """CompiledApart._prepared builds the argument stand-ins (the DSL's pointer objects: host time) only
    to make a variant's PreparedCall; later calls get the same call without asking for them again."""
    from cute_ep.launcher import CompiledApart

    class _Registry:
        def __init__(self) -> None:
            self.gets = []

        def get(self, key, build):
            self.gets.append(key)
            return _UnboundFunction()

    specs = []

    def spec(name):
        specs.append(name)
        return ("key", name), None, (1, 2), ("ptr", "stream")

    launch = CompiledApart(_Registry())
    first = launch._prepared("a", lambda: spec("a"))
    assert launch._prepared("a", lambda: spec("a")) is first
    other = launch._prepared("b", lambda: spec("b"))
    assert other is not first and specs == ["a", "b"] and launch.registry.gets == [("key", "a"), ("key", "b")]
    first(0x10, 0x20)
    assert first._compiled.bound.runs == [[0x10, 0x20]]


def test_auto_algorithm_takes_the_least_slowest_rank_median():
    medians = [  # rank 0 finds per_pair fastest, but rank 1's per_pair is the slowest of all
        {"dedup": 50.0, "per_pair": 40.0, "put_warp": 70.0},
        {"dedup": 55.0, "per_pair": 90.0, "put_warp": 60.0},
    ]
    name, table = pick_fastest_algorithm(medians, "H200|R2")
    assert name == "dedup"  # slowest ranks: dedup 55, per_pair 90, put_warp 70
    assert "dedup" in table and "55.0 us  <- chosen" in table and "90.0 us" in table


def test_unknown_algorithm_is_refused_before_anything_is_built():
    cfg = EpConfig(world_size=1, local_world_size=1, num_experts=8, topk=2, hidden=128, dtype=torch.bfloat16,
                   max_tokens=16)
    with pytest.raises(ValueError, match=r"algorithm must be 'auto' or one of \['dedup', 'per_pair', "
                                         r"'put_warp'\], got 'fastest'"):
        EpBuffer(object(), cfg, algorithm="fastest")


@pytest.mark.parametrize("configured", ["pull", "reduced"])
def test_combine_algorithm_checks_of_the_gpu_buffer(configured):
    """EpBuffer.combine's algorithm check (resolve_combine_algorithm, shared with the host backends):
    pull always; reduced only on a reduced buffer and with the latest dispatch's handle, unchanged."""
    from dataclasses import replace

    cfg = EpConfig(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=128, dtype=torch.bfloat16,
                   max_tokens=16, combine_algorithm=configured)
    buf = host_buffer(cfg)
    idx, w = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    handle = DispatchHandle(idx, w, torch.zeros(4, 2, dtype=torch.int32), 4, "scatter")
    buf._sent = (idx, w)
    buf._check_combine_algorithm(handle, "pull")
    unknown = r"combine algorithm must be one of \['pull', 'reduced'\], got 'push'"
    with pytest.raises(ValueError, match=unknown):
        buf._check_combine_algorithm(handle, "push")
    if configured == "pull":
        buf._check_combine_algorithm(handle, None)
        with pytest.raises(ValueError, match=r"needs EpConfig\(combine_algorithm='reduced'\) \(got 'pull'\)"):
            buf._check_combine_algorithm(handle, "reduced")
        return
    buf._check_combine_algorithm(handle, None)
    buf._check_combine_algorithm(handle, "reduced")
    for other in (replace(handle, topk_weights=w.clone()), replace(handle, topk_idx=idx.clone())):
        with pytest.raises(ValueError, match="weights the latest dispatch sent"):
            buf._check_combine_algorithm(other, None)
        buf._check_combine_algorithm(other, "pull")  # the pull combine takes any ids and weights
    buf._sent = None  # no dispatch yet
    with pytest.raises(ValueError, match="weights the latest dispatch sent"):
        buf._check_combine_algorithm(handle, "reduced")


def test_a_dispatch_is_one_launch_of_the_module_counting_layout_and_dispatch(monkeypatch):
    """launch_dispatch enqueues the layout, dispatch and fan-out in one launch (OP_DISPATCH; the module
    decides whether the layout runs as its own kernel or inside the dispatch's), and the host then expects
    both epochs to advance; a layout launched alone advances only its own."""
    from types import SimpleNamespace

    from cute_ep.kernels.buffers import CALL, buffers_of
    from cute_ep.kernels.config import OP_COMBINE, OP_DISPATCH, OP_LAYOUT

    buf = _buffer()
    cfg = buf.cfg
    buf.device = torch.device("cpu")
    buf._device_index = 0
    buf.algorithm = "dedup"
    buf.scatter = torch.full((cfg.max_tokens, cfg.topk), -1, dtype=torch.int32)
    buf._empty = {b.name: torch.empty(16, dtype=b.torch_dtype(cfg)) for b in buffers_of(CALL)}
    buf._align = {b.name: 1 for b in buffers_of(CALL)}
    buf._empty_addr = {n: t.data_ptr() for n, t in buf._empty.items()}
    launches = []
    buf._launcher = lambda stream, addrs, **scalars: launches.append(scalars)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = torch.zeros(4, cfg.hidden, dtype=cfg.dtype)
    idx = torch.zeros(4, cfg.topk, dtype=torch.int32)
    w = torch.ones(4, cfg.topk)
    buf.launch_dispatch(x, idx, w, layout="rank")
    assert [(s["op"], s["num_tokens"], s["layout"]) for s in launches] == [(OP_DISPATCH, 4, 1)]
    assert buf._calls == [1, 1, 0]
    buf._launch(OP_LAYOUT, 4, idx=idx)  # the layout alone (tests of a rank that stops after it)
    buf._launch(OP_COMBINE, 4, idx=idx, w=w)
    assert buf._calls == [2, 1, 1]


def test_combine_reads_the_handles_slots_in_place(monkeypatch):
    """launch_combine points the kernels at the handle's own slots (a handle from dispatch() owns a copy):
    no copy into the buffer's ``scatter``; slots laid out otherwise are copied there first. Every launch
    names its slots, so a dispatch after a combine writes the buffer's own again."""
    from types import SimpleNamespace

    from cute_ep.kernels.buffers import CALL, buffers_of

    buf = _buffer()
    cfg = buf.cfg
    buf.device, buf._device_index, buf.algorithm = torch.device("cpu"), 0, "dedup"
    buf.scatter = torch.full((cfg.max_tokens, cfg.topk), -1, dtype=torch.int32)
    buf._empty = {b.name: torch.empty(16, dtype=b.torch_dtype(cfg)) for b in buffers_of(CALL)}
    buf._align = {b.name: 1 for b in buffers_of(CALL)}
    buf._empty_addr = {n: t.data_ptr() for n, t in buf._empty.items()}
    seen = []
    buf._launcher = lambda stream, addrs, **scalars: seen.append(addrs["scatter"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    t = 3
    idx = torch.zeros(t, cfg.topk, dtype=torch.int32)
    w = torch.ones(t, cfg.topk)
    out = torch.empty(t, cfg.hidden, dtype=cfg.dtype)
    owned = torch.arange(t * cfg.topk, dtype=torch.int32).view(t, cfg.topk)
    buf.launch_combine(DispatchHandle(idx, w, owned, t, "scatter"), out, "pull")
    assert seen[-1] == owned.data_ptr() and int(buf.scatter.max()) == -1  # read in place, nothing copied
    strided = torch.arange(2 * t * cfg.topk, dtype=torch.int32).view(t, 2 * cfg.topk)[:, ::2]
    buf.launch_combine(DispatchHandle(idx, w, strided, t, "scatter"), out, "pull")
    assert seen[-1] == buf.scatter.data_ptr() and torch.equal(buf.scatter[:t], strided)
    x = torch.zeros(t, cfg.hidden, dtype=cfg.dtype)
    buf.launch_combine(DispatchHandle(idx, w, owned, t, "scatter"), out, "pull")
    buf.launch_dispatch(x, idx, w)
    assert seen[-1] == buf.scatter.data_ptr()


def test_one_per_process_makes_one_instance_for_every_caller_and_thread():
    import threading

    from cute_ep.launcher import one_per_process

    made = []
    shared = one_per_process(lambda: made.append(object()) or made[-1])
    got = []
    threads = [threading.Thread(target=lambda: got.append(shared())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and all(g is made[0] for g in got) and shared() is made[0]
