"""``cute_ep.bootstrap.nvshmem_start``: the NVSHMEM start that ``Runtime`` and ``cute_ep.deep_ep`` share, on
the CPU with NVSHMEM and cuda.core replaced by stand-ins (tests/_torchrun_nvshmem_start_worker.py).

In process: the heap's sizing and checks, with their messages, and what a start in a world of one calls
(and leaves behind when it fails). In gloo worlds of 1 and 2 ranks (the worker): the unique id that rank 0
made reaches every rank's init, over a gloo group and over one that reports itself as pure NCCL, and
``cute_ep.deep_ep``'s session starts, shares and finalizes NVSHMEM through it, with the heap check for
ranks that share a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
from _launch import REPO, worker_results
from _torchrun_nvshmem_start_worker import FakeNvshmem, FakeProps

from cute_ep.bootstrap import nvshmem_start
from cute_ep.bootstrap.nvshmem_start import SymmetricHeap, size_symmetric_heap, start_nvshmem
from cute_ep.bootstrap.runtime import HEAP_ENV_VAR, HeapConfigError

WORKER = REPO / "tests" / "_torchrun_nvshmem_start_worker.py"
MIB = 1 << 20
GIB = 1 << 30

# The start of the refusal of a user's 1G for 2 GiB of buffers (a pattern).
TOO_SMALL = r"^NVSHMEM_SYMMETRIC_SIZE='1G' \(1073741824 bytes\) is smaller than the 2147483648 bytes"
# The fit check's refusal of 8 ranks with 8 GiB of buffers each on an 80 GB GPU (hint: the room in bytes).
EIGHT_RANKS_REFUSED = (
    "8 ranks share a GPU of 74.51 GiB, and each needs a symmetric heap of 8.75 GiB "
    "(NVSHMEM_SYMMETRIC_SIZE=8960M) plus about 1.00 GiB beside it: 78.00 GiB in all. What fits: at most "
    "7.53 GiB of symmetric buffers per rank (EpConfig.symmetric_bytes(); it grows with world_size x "
    "max_tokens x topk); hint 8084644320; or fewer ranks per GPU"
)
# cute_ep.deep_ep's refusal of 2 ranks with 6 GiB of buffers each on one GPU of 8 GiB.
TWO_BUFFERS_REFUSED = (
    "2 ranks share a GPU of 8.00 GiB, and each needs a symmetric heap of 6.75 GiB "
    "(NVSHMEM_SYMMETRIC_SIZE=6912M) plus about 1.00 GiB beside it: 15.50 GiB in all. What fits: at most "
    "2.59 GiB of symmetric buffers per rank (EpConfig.symmetric_bytes(); it grows with world_size x "
    "max_tokens x topk); for a Buffer, num_nvl_bytes + num_rdma_bytes (or symmetric_bytes=, or "
    "CUTE_EP_DEEP_EP_SYMMETRIC_BYTES) of at most 2779096484 bytes; or fewer ranks per GPU"
)


@pytest.fixture
def heap_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """NVSHMEM_SYMMETRIC_SIZE unset for the test, and as before it afterwards (whatever the test set)."""
    monkeypatch.setenv(HEAP_ENV_VAR, "1G")
    monkeypatch.delenv(HEAP_ENV_VAR)
    return monkeypatch


@pytest.fixture
def fake(heap_env: pytest.MonkeyPatch) -> FakeNvshmem:
    """NVSHMEM and cuda.core replaced by a recording stand-in for the test."""
    stand_in = FakeNvshmem()
    heap_env.setattr(nvshmem_start, "nvshmem_core", lambda: stand_in)
    heap_env.setattr(nvshmem_start, "cuda_core_device", stand_in.device)
    return stand_in


# --------------------------------------------------------------------------------------------------
# sizing and checking the heap
# --------------------------------------------------------------------------------------------------


def test_unset_size_gets_the_padded_heap():
    environ: dict[str, str] = {}
    heap = size_symmetric_heap(6 * GIB, 0, environ=environ)
    # ceil_GiB(6 GiB * 1.25 + 256 MiB) = 8 GiB
    assert heap == SymmetricHeap(size="8G", nbytes=8 * GIB, budget=6 * GIB, set_here=True)
    assert environ == {HEAP_ENV_VAR: "8G"}


def test_shared_gpu_gets_the_smaller_heap():
    environ: dict[str, str] = {}
    heap = size_symmetric_heap(3 * GIB, 0, shared_gpu=True, environ=environ)
    # 3 GiB + 3 GiB / 16 + 256 MiB = 3520 MiB, rounded up to 256 MiB
    assert (heap.size, heap.nbytes, heap.set_here) == ("3584M", 3584 * MIB, True)
    assert environ == {HEAP_ENV_VAR: "3584M"}


def test_user_size_that_holds_the_budget_is_kept(caplog: pytest.LogCaptureFixture):
    environ = {HEAP_ENV_VAR: "5G"}
    with caplog.at_level(logging.WARNING, logger="cute_ep.bootstrap.runtime"):
        heap = size_symmetric_heap(4 * GIB, 0, environ=environ)
    assert heap == SymmetricHeap(size="5G", nbytes=5 * GIB, budget=4 * GIB, set_here=False)
    assert environ == {HEAP_ENV_VAR: "5G"}
    assert "NVSHMEM_SYMMETRIC_SIZE=5G is below the recommended 6G" in caplog.text


def test_user_size_below_the_budget_is_refused():
    environ = {HEAP_ENV_VAR: "1G"}
    with pytest.raises(HeapConfigError) as err:
        size_symmetric_heap(2 * GIB, 0, environ=environ)
    assert str(err.value) == (
        "NVSHMEM_SYMMETRIC_SIZE='1G' (1073741824 bytes) is smaller than the 2147483648 bytes (2G) this run "
        "needs; unset it to get 3G automatically, or raise it"
    )
    assert environ == {HEAP_ENV_VAR: "1G"}


def test_malformed_user_size_is_refused():
    with pytest.raises(HeapConfigError) as err:
        size_symmetric_heap(GIB, 0, environ={HEAP_ENV_VAR: "lots"})
    assert str(err.value) == "NVSHMEM_SYMMETRIC_SIZE='lots' is not a size (e.g. '8G', '512M', '1073741824')"


def test_heaps_that_fit_a_shared_gpu_pass():
    environ: dict[str, str] = {}
    heap = size_symmetric_heap(7 * GIB, 0, ranks_per_gpu=8, shared_gpu=True, gpu_bytes=80 * 10**9,
                               environ=environ)
    # 7 GiB + 448 MiB + 256 MiB -> 7936 MiB; 8 x (7.75 + 1) GiB = 70 GiB fits 80 GB
    assert (heap.size, environ) == ("7936M", {HEAP_ENV_VAR: "7936M"})


def test_heaps_too_large_for_a_shared_gpu_are_refused_and_the_size_unset_again():
    environ: dict[str, str] = {}
    hints: list[int] = []
    with pytest.raises(HeapConfigError) as err:
        size_symmetric_heap(8 * GIB, 0, ranks_per_gpu=8, shared_gpu=True, gpu_bytes=80 * 10**9,
                            fit_hint=lambda room: hints.append(room) or f"hint {room}", environ=environ)
    assert str(err.value) == EIGHT_RANKS_REFUSED
    assert hints == [8084644320]
    assert environ == {}  # set for the check, removed with the refusal


def test_a_refused_user_size_stays_set():
    environ = {HEAP_ENV_VAR: "8960M"}
    with pytest.raises(HeapConfigError) as err:
        size_symmetric_heap(8 * GIB, 0, ranks_per_gpu=8, shared_gpu=True, gpu_bytes=80 * 10**9,
                            fit_hint=lambda room: f"hint {room}", environ=environ)
    assert str(err.value) == EIGHT_RANKS_REFUSED
    assert environ == {HEAP_ENV_VAR: "8960M"}


def test_gpu_memory_is_asked_of_torch_only_for_a_shared_gpu(monkeypatch: pytest.MonkeyPatch):
    import torch

    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: asked.append(index) or FakeProps("GPU-x", 4 * GIB))
    heap = size_symmetric_heap(100 * GIB, 3, environ={})  # a rank alone on its GPU: no fit check
    assert (heap.size, asked) == ("126G", [])
    with pytest.raises(HeapConfigError, match=r"^2 ranks share a GPU of 4\.00 GiB, .* heap of 2\.50 GiB "):
        size_symmetric_heap(2 * GIB, 3, ranks_per_gpu=2, shared_gpu=True, environ={})
    assert asked == [3]


def test_bad_arguments():
    with pytest.raises(ValueError, match="ranks_per_gpu=0 must be >= 1"):
        size_symmetric_heap(GIB, 0, ranks_per_gpu=0, environ={})
    with pytest.raises(ValueError, match="buffers_bytes=-1 is negative"):
        size_symmetric_heap(-1, 0, environ={})


# --------------------------------------------------------------------------------------------------
# starting NVSHMEM in a world of one (no process group)
# --------------------------------------------------------------------------------------------------


def test_world_of_one_starts_on_its_device(fake: FakeNvshmem):
    import os

    heap = start_nvshmem(None, 0, 1, 2, GIB)
    assert (heap.size, heap.set_here, os.environ[HEAP_ENV_VAR]) == ("2G", True, "2G")
    assert fake.log == ["set_current 2", "get_unique_id(empty=False)", "init"]
    assert fake.made is not None
    assert fake.inits == [{"device": 2, "uid": fake.made, "rank": 0, "nranks": 1,
                           "initializer_method": "uid"}]


def test_refused_heap_touches_no_nvshmem(fake: FakeNvshmem, heap_env: pytest.MonkeyPatch):
    heap_env.setenv(HEAP_ENV_VAR, "1G")
    with pytest.raises(HeapConfigError, match=TOO_SMALL):
        start_nvshmem(None, 0, 1, 0, 2 * GIB)
    assert fake.log == []


@pytest.mark.parametrize("user", [None, "4G"])
def test_failed_init_leaves_the_size_as_it_found_it(fake: FakeNvshmem, heap_env: pytest.MonkeyPatch, user):
    import os

    if user is not None:
        heap_env.setenv(HEAP_ENV_VAR, user)

    def init(**kwargs):
        raise RuntimeError("init failed")

    heap_env.setattr(fake, "init", init)
    with pytest.raises(RuntimeError, match="init failed"):
        start_nvshmem(None, 0, 1, 0, GIB)
    assert os.environ.get(HEAP_ENV_VAR) == user


def test_pe_other_than_the_rank_is_refused(fake: FakeNvshmem):
    fake.pe_offset = 1
    with pytest.raises(RuntimeError) as err:
        start_nvshmem(None, 0, 1, 0, GIB)
    assert str(err.value) == "NVSHMEM reports PE 1 of 1, expected rank 0 of 1"


def test_a_sized_heap_is_used_as_it_is(fake: FakeNvshmem):
    import os

    heap = size_symmetric_heap(GIB, 0)
    assert os.environ[HEAP_ENV_VAR] == "2G"
    os.environ[HEAP_ENV_VAR] = "3G"  # not sized again: the value stays as the caller left it
    assert start_nvshmem(None, 0, 1, 0, heap) is heap
    assert os.environ[HEAP_ENV_VAR] == "3G" and len(fake.inits) == 1


def test_deep_ep_session_keeps_a_user_size_that_holds_the_budget(fake: FakeNvshmem,
                                                                 heap_env: pytest.MonkeyPatch):
    import os

    import torch

    from cute_ep.deep_ep.runtime import GroupRuntime, NvshmemSession

    if dist.is_available() and dist.is_initialized():
        pytest.skip("needs a process without a process group (a world of one)")
    heap_env.setenv(HEAP_ENV_VAR, "2560M")
    runtime = GroupRuntime(None, torch.device("cuda", 0))
    session = NvshmemSession.attach(runtime, 2 * GIB)
    try:
        assert (session.heap_bytes, session.users, runtime.backend) == (2560 * MIB, 1, "nvshmem")
        assert fake.inits == [{"device": 0, "uid": fake.made, "rank": 0, "nranks": 1,
                               "initializer_method": "uid"}]
    finally:
        session.release()
    assert fake.finalized == 1 and NvshmemSession.current is None
    assert os.environ[HEAP_ENV_VAR] == "2560M"  # the user's: kept after the last release

    heap_env.setenv(HEAP_ENV_VAR, "1G")
    with pytest.raises(HeapConfigError, match=TOO_SMALL):
        NvshmemSession.attach(GroupRuntime(None, torch.device("cuda", 0)), 2 * GIB)
    assert NvshmemSession.current is None and fake.inits[1:] == []


# --------------------------------------------------------------------------------------------------
# gloo worlds of 1 and 2 ranks
# --------------------------------------------------------------------------------------------------


needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world = request.param
    return worker_results(WORKER, world, tmp_path_factory.mktemp(f"nvshmem_start{world}"), timeout=150)


@needs_gloo
def test_rank_zeros_unique_id_reaches_every_init(ranks: list[dict]):
    world = len(ranks)
    made = ranks[0]["start"]["made"]
    assert made is not None and len(made) == 2 * 128
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"], res["env_before"]) == (r, world, None)
        start = res["start"]
        assert start["heap"] == ["4G", 4 * GIB, 3 * GIB, True] and start["env"] == "4G", (r, start)
        assert start["made"] == (made if r == 0 else None), r
        assert start["log"] == [f"set_current {r}", f"get_unique_id(empty={r != 0})", "init"], r
        assert start["inits"] == [{"device": r, "uid": made, "rank": r, "nranks": world,
                                   "initializer_method": "uid"}], r


@needs_gloo
def test_a_pure_nccl_group_sends_the_id_as_an_object(ranks: list[dict]):
    world = len(ranks)
    made = ranks[0]["nccl"]["made"]
    assert made is not None and made != ranks[0]["start"]["made"]
    for r, res in enumerate(ranks):
        nccl = res["nccl"]
        assert [(i["uid"], i["rank"], i["nranks"]) for i in nccl["inits"]] == [(made, r, world)], r
        assert nccl["object_broadcasts"] == (1 if world > 1 else 0), r


@needs_gloo
def test_deep_ep_session_starts_shares_and_finalizes_nvshmem(ranks: list[dict]):
    world = len(ranks)
    made = ranks[0]["session"]["made"]
    for r, res in enumerate(ranks):
        session = res["session"]
        assert session["same"] and session["users"] == 2, (r, session)
        assert (session["heap_bytes"], session["env"], session["backend"]) == (3 * GIB, "3G", "nvshmem"), r
        assert session["inits"] == [{"device": r, "uid": made, "rank": r, "nranks": world,
                                     "initializer_method": "uid"}], r
        assert session["too_big"]["raised"] == "ValueError", r
        assert "asks for 3221225472 bytes" in session["too_big"]["message"], r
        assert session["after_one_release"] == [0, "3G", True], r
        assert session["after_last_release"] == [1, None, True], r


@needs_gloo
def test_deep_ep_refuses_heaps_too_large_for_a_shared_gpu_on_every_rank(ranks: list[dict]):
    for r, res in enumerate(ranks):
        shared = res["shared"]
        if len(ranks) == 1:  # one rank alone on the GPU: no fit check, the session started
            assert (shared["raised"], shared["current"]) == (None, True), shared
            continue
        assert (shared["raised"], shared["message"]) == ("HeapConfigError", TWO_BUFFERS_REFUSED), (r, shared)
        assert (shared["env"], shared["log"], shared["current"]) == (None, [], False), r
