"""``get_dispatch_layout``'s path straight to the layout launch, without a GPU (the launch a stand-in): a call
of a kind a checked call already took to the kernel (num_experts; the ids' dtype, device and rank) skips the
checks and the stream scope and returns the launch's tensors; a call of any other kind, with stream options,
of ids too many for the kernel's int32 indexing, or on a destroyed Buffer, takes the checked path (and its
errors)."""

from __future__ import annotations

import pytest
import torch

from cute_ep.deep_ep import Buffer, normal_mode
from cute_ep.deep_ep.token_layout import TokenLayout
from cute_ep.deep_ep.utils import EventOverlap


class _Launch:
    """The layout launch's stand-in: records its calls, returns new tensors as the kernel's call does."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, topk_idx, num_experts, num_ranks):
        self.calls.append((topk_idx, num_experts, num_ranks))
        t = topk_idx.shape[0]
        per_rank = torch.full((num_ranks,), 7, dtype=torch.int32)
        per_expert = torch.full((num_experts,), 3, dtype=torch.int32)
        return per_rank, per_expert, torch.ones((t, num_ranks), dtype=torch.bool)


@pytest.fixture
def kernel_buffer(monkeypatch):
    """A one-rank Buffer whose layout takes the kernel's path: (buffer, launch stand-in, checked calls)."""
    buf = Buffer(None, explicitly_destroy=True)
    buf.backend = "cute"
    launch = _Launch()
    monkeypatch.setattr(normal_mode, "shared_token_layout", lambda: launch)
    monkeypatch.setattr(TokenLayout, "fits", staticmethod(lambda *a, **k: True))
    checked: list = []
    real = normal_mode.check_tensors

    def counted(device, **args):
        checked.append(args)
        return real(device, **args)

    monkeypatch.setattr(normal_mode, "check_tensors", counted)
    yield buf, launch, checked
    buf.destroy()


def test_a_kind_the_kernel_took_goes_straight_to_the_launch(kernel_buffer):
    buf, launch, checked = kernel_buffer
    ids = torch.randint(-1, 64, (10, 4))
    first = buf.get_dispatch_layout(ids, 64)
    assert len(checked) == 1 and len(launch.calls) == 1
    for other in (ids, ids.clone(), torch.randint(-1, 64, (3, 4)), torch.randint(-1, 64, (5, 9))):
        per_rank, rdma, per_expert, in_rank, event = buf.get_dispatch_layout(other, 64)
        got_ids, e, r = launch.calls[-1]
        assert got_ids is other and (e, r) == (64, 1)
        assert rdma is None and isinstance(event, EventOverlap) and event.event is None
        assert per_rank.tolist() == [7] and per_expert.shape == (64,) and in_rank.shape == (other.shape[0], 1)
    assert len(checked) == 1 and len(launch.calls) == 5  # no check after the first call
    assert [type(v) for v in first] == [torch.Tensor, type(None), torch.Tensor, torch.Tensor, EventOverlap]


def test_another_kind_or_stream_options_take_the_checked_path(kernel_buffer):
    buf, launch, checked = kernel_buffer
    ids = torch.randint(-1, 64, (10, 4))
    buf.get_dispatch_layout(ids, 64)
    buf.get_dispatch_layout(ids.int(), 64)  # another dtype: checked, then known too
    buf.get_dispatch_layout(ids, 128)  # another num_experts
    assert len(checked) == 3
    buf.get_dispatch_layout(ids.int(), 64)
    buf.get_dispatch_layout(ids, 128)
    assert len(checked) == 3
    with pytest.raises(ValueError, match=r"topk_idx must be \[T, K\] int64"):
        buf.get_dispatch_layout(ids.short(), 64)  # a dtype never checked: refused as before
    with pytest.raises(ValueError, match=r"topk_idx must be \[T, K\] int64"):
        buf.get_dispatch_layout(ids[None], 64)  # three dimensions
    with pytest.raises(ValueError, match="must be on cpu"):
        buf.get_dispatch_layout(ids.to("meta"), 64)  # another device
    with pytest.raises(ValueError, match="num_experts must be a positive multiple"):
        buf.get_dispatch_layout(ids, 0)
    calls = len(launch.calls)
    # the caller's stream options: the checked path, each time (its scope runs on the communication
    # stream on a GPU; on a CPU the options are accepted and the work is done in place)
    buf.get_dispatch_layout(ids, 64, async_finish=True)
    assert len(checked) == 8 and len(launch.calls) == calls + 1
    with pytest.raises(ValueError, match="allocate_on_comm_stream=True needs previous_event"):
        buf.get_dispatch_layout(ids, 64, allocate_on_comm_stream=True)


def test_too_many_ids_or_a_subclass_or_a_destroyed_buffer_take_the_checked_path(kernel_buffer):
    buf, launch, checked = kernel_buffer
    ids = torch.randint(-1, 64, (10, 8))
    buf.get_dispatch_layout(ids, 64)
    huge = torch.zeros(1, 8, dtype=torch.int64).expand(2**28, 8)  # 2**31 ids: past the kernel's indexing
    buf.get_dispatch_layout(huge, 64)
    assert len(checked) == 2

    class Ids(torch.Tensor):
        pass

    buf.get_dispatch_layout(ids.as_subclass(Ids), 64)
    assert len(checked) == 3
    buf.destroy()
    with pytest.raises(RuntimeError, match="this Buffer was destroyed"):
        buf.get_dispatch_layout(ids, 64)
