"""The host path of a call, on the CPU: which checks stay on the host (shape, dtype: no sync) and which
move to the device for the GPU buffer (the ids' values), how a refused call is reported, and the
sync-free dispatch (worst-case views, the count on the device) on the host backends."""

from __future__ import annotations

import re

import pytest
import torch
from _worlds import HOST_BACKENDS, host_config, needs_gloo, world_of_one

from cute_ep.input_checks import check_dispatch_inputs, check_topk_values
from cute_ep.inputs import make_inputs
from cute_ep.kernels.buffers import INPUT_FAULT_FIRST, INPUT_FAULT_RANKS, INPUT_FAULT_WORDS
from cute_ep.status import CapacityExceeded, StatusBlock

CPU = torch.device("cpu")


def _inputs(cfg, t=8, seed=3):
    return make_inputs(0, t, cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype, seed, idx_dtype=torch.int64)


def test_values_are_left_to_the_device_but_int64_ids_cannot_wrap():
    cfg = host_config(num_experts=8)
    x, idx, w = _inputs(cfg)
    idx[0, 0] = 2**32 + 3  # as int32 this would read 3: a valid id
    idx[1, 1] = -(2**33)
    with pytest.raises(ValueError, match=r"topk_idx values must be in \[-1, 8\)"):
        check_dispatch_inputs(cfg, CPU, x, idx, w)  # the host backends check values on the host
    _, idx32, _ = check_dispatch_inputs(cfg, CPU, x, idx, w, values=False)  # the GPU buffer's call
    assert idx32.dtype == torch.int32
    assert int(idx32[0, 0]) == 8 and int(idx32[1, 1]) == -2  # still invalid: the layout kernel refuses
    assert torch.equal(idx32[2:], idx[2:].to(torch.int32))
    with pytest.raises(ValueError, match="topk_idx must be"):  # shapes are still checked on the host
        check_dispatch_inputs(cfg, CPU, x, idx[:, :1], w, values=False)


def test_refusal_messages():
    cfg = host_config()
    block = StatusBlock(cfg, CPU)
    status = block.read()
    assert status["input_fault"] == [0, 0] and block.refused_inputs(status) is None
    for ranks, first, want in [(1, 3, r"rank 3 passed invalid topk_idx"),
                               (3, 0, r"rank 0 and 2 more rank\(s\) passed invalid topk_idx")]:
        words = [0] * INPUT_FAULT_WORDS
        words[INPUT_FAULT_RANKS], words[INPUT_FAULT_FIRST] = ranks, first
        block.views["input_fault"].copy_(torch.tensor(words, dtype=torch.int32))
        message = block.refused_inputs(block.read())
        assert message is not None
        assert re.search(want, message) and "moved no data" in message


def test_own_invalid_inputs_are_named_with_the_values():
    cfg = host_config(num_experts=8, topk=3)
    idx = torch.tensor([[0, 1, 2], [4, 4, -1]])
    with pytest.raises(ValueError, match=r"distinct experts per token .* token 1 has \[4, 4, -1\]"):
        check_topk_values(cfg, idx)
    check_topk_values(cfg, torch.tensor([[0, -1, -1]]))  # -1 may repeat


@needs_gloo
@pytest.mark.parametrize("name", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("fp8", [False, True])
def test_sync_free_dispatch_gives_worst_case_views_and_the_count(name, fp8):
    cfg = host_config(num_experts=8, topk=2, hidden=128, max_tokens=16)
    x, idx, w = _inputs(cfg, t=16)
    idx[::2, 1] = -1  # fewer rows than the worst case arrive
    with HOST_BACKENDS[name](world_of_one(), cfg) as buf:
        exact = buf.dispatch(x, idx, w, fp8=fp8)
        n = exact.num_recv
        rows = exact.recv_x.view(torch.uint8) if fp8 else exact.recv_x
        got = [rows.clone(), exact.recv_weights.clone()]
        free = buf.dispatch(x, idx, w, fp8=fp8, sync=False)
        assert free.num_recv == cfg.capacity > n and int(free.recv_count) == n == int(exact.recv_count)
        assert free.recv_x.shape[0] == free.recv_weights.shape[0] == cfg.capacity
        head = free.recv_x[:n].view(torch.uint8) if fp8 else free.recv_x[:n]
        assert torch.equal(head, got[0]) and torch.equal(free.recv_weights[:n], got[1])
        assert torch.equal(free.tokens_per_expert, exact.tokens_per_expert)
        if fp8:
            assert free.recv_scales.shape == (cfg.capacity, cfg.hidden // 128)


@needs_gloo
@pytest.mark.parametrize("name", sorted(HOST_BACKENDS))
def test_sync_free_dispatch_reports_drops_at_the_next_check(name):
    cfg = host_config(num_experts=4, topk=2, max_tokens=16, capacity_factor=0.25)
    x, idx, w = _inputs(cfg, t=16)
    with HOST_BACKENDS[name](world_of_one(), cfg) as buf:
        res = buf.dispatch(x, idx, w, sync=False)  # drops happen, nothing raises yet
        assert int(res.recv_count) <= cfg.num_experts * cfg.expert_capacity
        with pytest.raises(CapacityExceeded):
            buf.check_capacity()
        with pytest.raises(CapacityExceeded):
            buf.dispatch(x, idx, w)  # a synced call raises at once


class _Stream:
    """Stands in for the driver's stream query: done after ``after`` queries; ``write`` runs on the
    query that finds it done (a kernel whose last write lands just then)."""

    def __init__(self, after: int, write=None) -> None:
        self.after, self.write, self.queries = after, write, 0

    def finished(self, stream: int) -> bool:
        self.queries += 1
        done = self.queries >= self.after
        if done and self.write is not None:
            self.write()
        return done


def test_status_mirror_is_read_once_its_sequence_number_lands():
    cfg = host_config()
    block = StatusBlock(cfg, CPU)
    w = block.words.numel()
    assert block.mirror.shape == (w + 1,) and not block.mirror_ok  # a CPU block: the plain read only
    seq = block.next_seq()
    assert seq == 1 and block.next_seq() == 2
    where = block.where
    mirror = block.mirror
    mirror[where["num_recv"][0]] = 37
    mirror[where["dropped"][0] + 1] = 5
    mirror[w] = 2
    block._driver = _Stream(after=10**9)
    assert block.wait_mirror(2, stream=0)
    status = block.mirrored()
    assert status["num_recv"] == 37 and status["dropped"].tolist()[:2] == [0, 5]
    assert block._driver.queries == 0  # the word was there: no stream query

    def land():
        mirror[where["num_recv"][0]] = 41
        mirror[w] = 3

    block._driver = _Stream(after=3, write=land)  # the write lands as the stream finishes: still read
    assert block.wait_mirror(3, stream=0) and block.mirrored()["num_recv"] == 41
    block._driver = _Stream(after=2)  # finished without the write: the caller reads the block itself
    assert block.wait_mirror(4, stream=0) is False and block._driver.queries == 2


def test_quiet_count_reads_the_count_only_when_the_mirror_has_nothing_to_report():
    from cute_ep.kernels.buffers import FAULT_COUNT, INPUT_FAULT_RANKS

    for factor in (0, 0.5):  # drops are looked at only where an expert capacity can drop rows
        block = StatusBlock(host_config(capacity_factor=factor), CPU)
        m, at = block._mirror_words, block._slices
        epochs = m[at["epochs"]].view("int64")
        epochs[:] = [4, 4, 2]
        m[at["num_recv"].start] = 11
        launches = [3, 3, 2]
        assert block.quiet_count(launches, 0, 1, 2) == 11
        assert launches == [4, 4, 2]  # raised to the epochs (graph replays the host did not count)
        assert block.quiet_count([5, 4, 2], 0, 1, 2) is None  # a layout that did not run
        m[at["dropped"].start + 1] = 2
        assert (block.quiet_count([4, 4, 2], 0, 1, 2) is None) == (factor > 0)
        m[at["dropped"].start + 1] = 0
        for word in (at["fault"].start + FAULT_COUNT, at["input_fault"].start + INPUT_FAULT_RANKS):
            m[word] = 1
            assert block.quiet_count([4, 4, 2], 0, 1, 2) is None
            m[word] = 0
        assert block.quiet_count([4, 4, 2], 0, 1, 2) == 11
        # mirrored while the dispatch (op 1) ran: its epoch one behind is its launches
        launches = [4, 5, 2]
        assert block.quiet_count(launches, 0, 1, 2, running=1) == 11 and launches == [4, 5, 2]
        assert block.quiet_count([4, 6, 2], 0, 1, 2, running=1) is None  # an earlier one did not run
        assert block.quiet_count([4, 5, 2], 0, 1, 2) is None  # not running: one behind is missing


def test_check_ran_takes_a_running_operation_one_launch_behind():
    from cute_ep.status import KernelDidNotRun

    block = StatusBlock(host_config(), CPU)
    status = {"epochs": [4, 4, 2], "fault": [0] * len(block.read()["fault"])}
    launches = [4, 5, 2]
    block.check_ran(0, status, launches, 0, 1, 2, running=1)
    assert launches == [4, 5, 2]
    with pytest.raises(KernelDidNotRun, match="dispatch kernel did not complete"):
        block.check_ran(0, status, [4, 5, 2], 0, 1, 2)
    with pytest.raises(KernelDidNotRun):
        block.check_ran(0, status, [4, 6, 2], 0, 1, 2, running=1)
