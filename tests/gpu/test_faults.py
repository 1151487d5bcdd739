"""Bounded waits: a rank that skips a call is named in an error on the others, never a hang.

Each case builds a buffer with a 2 s timeout; the last rank (the "skipper") leaves out one step of the
sequence, and every other rank must raise ``PeerTimeout`` naming the skipper and the operation within
a few seconds, keep raising on later calls (the buffer moves no more data), and still close cleanly.
"""

from __future__ import annotations

import time

import pytest
import torch

from cute_ep.buffer import EpBuffer
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import OP_LAYOUT, EpConfig
from cute_ep.status import PeerTimeout

pytestmark = pytest.mark.gpu

TIMEOUT_S = 2.0


def _setup(runtime, combine: str = "pull"):
    env = runtime.env
    if env.world_size < 2:
        pytest.skip("needs at least 2 ranks")
    R, rank = env.world_size, env.rank
    T, H, K, E = 32, 256, 4, 8 * R
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=K, hidden=H,
                   dtype=torch.bfloat16, max_tokens=T, num_sms=min(8, runtime.sm_share), timeout_s=TIMEOUT_S,
                   combine_algorithm=combine)
    x, idx, w = make_inputs(rank, T, H, E, K, torch.bfloat16, runtime.seed + 99, routing="uniform")
    dev = runtime.device
    return cfg, rank, R - 1, (x.to(dev), idx.to(dev).to(torch.int32), w.to(dev))


def _expect_timeout(call, op: str, skipper: int) -> None:
    start = time.monotonic()
    with pytest.raises(PeerTimeout) as info:
        call()
    elapsed = time.monotonic() - start
    assert (info.value.op, info.value.peer) == (op, skipper), str(info.value)
    assert f"rank {skipper} did not signal" in str(info.value)
    assert elapsed < TIMEOUT_S + 15, f"took {elapsed:.1f} s to report"


@pytest.mark.parametrize("skipped", ["dispatch", "layout-only", "combine", "reduced-combine"])
def test_a_rank_that_skips_a_step_is_named(runtime, skipped):
    cfg, rank, skipper, (x, idx, w) = _setup(runtime, "reduced" if skipped == "reduced-combine" else "pull")
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        if skipped == "dispatch":  # the skipper never calls: the others' layout waits for its counts
            if rank != skipper:
                _expect_timeout(lambda: buf.dispatch(x, idx, w), "layout", skipper)
        elif skipped == "layout-only":  # the skipper runs the layout but not the dispatch kernel
            if rank == skipper:
                buf._launch(OP_LAYOUT, x.shape[0], idx=idx)
                torch.cuda.synchronize()
            else:  # a synced dispatch returns once the count is known (the layout ran on every rank): the
                # dispatch's own wait times out on the device and the next host-visible check raises
                _expect_timeout(lambda: (buf.dispatch(x, idx, w), buf.check_faults()), "dispatch", skipper)
        else:  # everyone dispatches; the skipper never combines (either combine algorithm)
            res = buf.dispatch(x, idx, w)
            if rank != skipper:
                y = buf.expert_output(res.num_recv)
                y.copy_(res.recv_x)
                # combine makes no host sync: the timeout is recorded on the device and raised by the
                # next host-visible check
                _expect_timeout(lambda: (buf.combine(y, res.handle), buf.check_faults()), "combine", skipper)
        runtime.barrier()  # every rank's kernels of the failed call have ended
        if rank != skipper:
            # Sticky: later calls raise at once and move nothing.
            buf.poison()
            start = time.monotonic()
            with pytest.raises(PeerTimeout):
                buf.dispatch(x, idx, w)
            assert time.monotonic() - start < TIMEOUT_S, "a faulted buffer must not wait again"
            assert torch.isnan(buf.recv_x.float()).all(), "a faulted buffer must not receive rows"
        runtime.barrier()
