"""A2aEpBuffer (cute_ep.a2a_backend): all_to_all_single dispatch/combine, bit-identical to the references.

Under torchrun (gloo, 2 and 4 ranks) the worker (tests/_torchrun_a2a_worker.py) compares every field
with ReferenceEpBuffer on the same inputs, runs the project's distributed checks and the autograd
gradient check on the A2A results, and makes one rank's input invalid in several ways (every rank
must raise, and the buffer must stay usable); the assertions live here. A world of one runs in
process, without a process group.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _launch import assert_cases_match
from _worlds import gloo_worlds_fixture, needs_gloo, world_of_one

from cute_ep.a2a_backend import A2aDispatchHandle, A2aEpBuffer
from cute_ep.api import DispatchHandle
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.checks import check_combine, check_dispatch, check_layout

WORKER = Path(__file__).with_name("_torchrun_a2a_worker.py")


# --------------------------------------------------------------------------------------------------
# gloo worlds of 2 and 4 ranks
# --------------------------------------------------------------------------------------------------


ranks = gloo_worlds_fixture(WORKER, "a2a", timeout=120)


@needs_gloo
def test_every_field_matches_the_reference_backend_bit_for_bit(ranks):
    assert_cases_match(ranks, 10)


@needs_gloo
def test_the_cases_move_rows_including_ranks_that_receive_nothing(ranks):
    received = [n for res in ranks for case in res["cases"] for n in case["num_recv"]]
    assert sum(received) > 500 and 0 in received


@needs_gloo
def test_the_project_checks_pass_on_the_a2a_results(ranks):
    for r, res in enumerate(ranks):
        for case in res["cases"]:
            assert sorted(case["checks"]) == sorted(f"{k}{i}" for k in ("dispatch", "layout", "combine")
                                                    for i in range(2))
            assert all(case["checks"].values()), (r, case["name"], case["messages"])


@needs_gloo
def test_autograd_gradients_match_plain_torch(ranks):
    for r, res in enumerate(ranks):
        g = res["gradients"]
        assert g["out_err"] < 1e-5 and g["grad_scale"] > 0.1, (r, g)
        for name in ("x_grad_err", "w_grad_err", "expert_grad_err"):
            assert g[name] < 1e-4, (r, name, g)
        assert g["w_grad_dropped"] == 0.0


# scenario -> (rank at fault, or None when every rank is; what the rank at fault reads; what the others read)
BAD = {
    "dispatch_wrong_hidden_on_rank1": (1, "x must be [T, 32]", "invalid inputs on another rank: rank 1:"),
    "dispatch_repeated_expert_on_rank0": (0, "distinct experts per token", "on another rank: rank 0:"),
    "dispatch_too_many_tokens_on_last": ("last", "more than max_tokens=8", "on another rank: rank {last}:"),
    "dispatch_none_on_last": ("last", "x must be a torch.Tensor", "rank {last}: InputTypeError"),
    "dispatch_mode_mismatch": (None, "every rank must use the same mode", ""),
    "dispatch_unknown_mode_on_last": ("last", "mode must be one of", "on another rank: rank {last}:"),
    "combine_bad_y_on_rank0": (0, "y must be [num_recv, 32] torch.bfloat16", "on another rank: rank 0:"),
    "combine_handles_of_different_calls": (None, "handle of the same dispatch", ""),
    "combine_foreign_handle_on_rank1": (1, "must come from this A2aEpBuffer", "on another rank: rank 1:"),
    "combine_moved_pair_on_rank0": (0, "may only set pairs to -1", "on another rank: rank 0:"),
    "capacity": (None, "rank(s) [0] would receive", ""),
}


@needs_gloo
@pytest.mark.parametrize("scenario", sorted(BAD))
def test_an_invalid_input_on_one_rank_raises_on_every_rank(ranks, scenario):
    last = len(ranks) - 1
    at_fault, own, others = BAD[scenario]
    at_fault = last if at_fault == "last" else at_fault
    for r, res in enumerate(ranks):
        got = res["bad"][scenario]
        assert got["raised"] is not None, (r, scenario)
        if at_fault is None or r == at_fault:
            assert own in got["message"], (r, got)
        else:
            assert got["raised"] == "ValueError" and others.format(last=last) in got["message"], (r, got)
    if scenario == "dispatch_none_on_last":  # the rank at fault gets its own exception back
        assert ranks[last]["bad"][scenario]["raised"] == "InputTypeError"


@needs_gloo
@pytest.mark.parametrize("after", ["usable_after_errors", "replaced_handle", "usable_after_combine_errors"])
def test_the_buffer_stays_usable_and_honours_replaced_handles(ranks, after):
    for res in ranks:
        got = res["bad"][after]
        assert got["ok"] and got.get("type_kept", True), got


# --------------------------------------------------------------------------------------------------
# a world of one, in process
# --------------------------------------------------------------------------------------------------


def _cfg(dtype=torch.bfloat16, topk=2, hidden=32, experts=8, max_tokens=16) -> EpConfig:
    return EpConfig(world_size=1, local_world_size=1, num_experts=experts, topk=topk, hidden=hidden,
                    dtype=dtype, max_tokens=max_tokens)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("topk", [1, 3])
def test_world_of_one_matches_the_reference(dtype, routing, topk):
    cfg = _cfg(dtype, topk, hidden=48)
    rt = world_of_one()
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        for seed, tokens in ((1, 13), (2, 0), (3, 16)):
            x, idx, w = make_inputs(0, tokens, 48, 8, topk, dtype, seed, routing=routing)
            ra, rr = a2a.dispatch(x, idx, w), ref.dispatch(x, idx, w)
            for f in ("recv_x", "recv_weights", "recv_src", "tokens_per_expert"):
                assert _same(getattr(ra, f), getattr(rr, f)), f
            assert ra.num_recv == rr.num_recv
            assert _same(ra.handle.scatter, rr.handle.scatter)
            y = apply_test_expert(ra.recv_x, global_expert_of_rows(ra.tokens_per_expert, 0))
            out = a2a.combine(y, ra.handle)
            assert _same(out, ref.combine(y, rr.handle))
            for res in (
                check_dispatch(x, idx, w, ra.recv_x, ra.recv_weights, ra.recv_src, max_tokens=16,
                               num_experts=8, local_world_size=1, require_coverage=tokens > 0),
                check_layout(ra, idx, max_tokens=16, num_experts=8, local_world_size=1),
                check_combine(out, idx, w, y, local_world_size=1, num_experts=8,
                              require_coverage=tokens > 0),
            ):
                assert res.passed, res.message


def test_world_of_one_atomic_mode_is_the_deterministic_layout():
    cfg = _cfg()
    with A2aEpBuffer(world_of_one(), cfg, preallocate=True) as a2a:
        assert a2a.recv_x.shape[0] == cfg.capacity
        x, idx, w = make_inputs(0, 11, 32, 8, 2, torch.bfloat16, 9, routing="dropped")
        at = a2a.dispatch(x, idx, w, mode="atomic")
        at_x, at_scatter = at.recv_x.clone(), at.handle.scatter
        sc = a2a.dispatch(x, idx, w)
        assert at.handle.mode == "atomic" and sc.handle.mode == "scatter"
        assert _same(at_x, sc.recv_x) and _same(at_scatter, sc.handle.scatter)


def test_world_of_one_handle_expert_output_and_poison():
    cfg = _cfg()
    with A2aEpBuffer(world_of_one(), cfg) as a2a, ReferenceEpBuffer(world_of_one(), cfg) as ref:
        x, idx, w = make_inputs(0, 10, 32, 8, 2, torch.bfloat16, 4)
        ra, rr = a2a.dispatch(x, idx, w), ref.dispatch(x, idx, w)
        h = ra.handle
        assert isinstance(h, DispatchHandle) and isinstance(h, A2aDispatchHandle)
        assert h.num_tokens == 10 and h.topk_idx.dtype == torch.int32 and "_route" not in repr(h)
        assert isinstance(dataclasses.replace(h, topk_weights=torch.ones(10, 2)), A2aDispatchHandle)
        y = apply_test_expert(ra.recv_x, global_expert_of_rows(ra.tokens_per_expert, 0))
        full = a2a.combine(y, h)
        # Experts writing into expert_output; a y of fewer rows than num_recv is refused.
        for buf in (a2a, ref):
            buf.expert_output(ra.num_recv).copy_(y)
        assert _same(a2a.combine(a2a.expert_output(ra.num_recv), h), full)
        for buf, handle in ((a2a, h), (ref, rr.handle)):
            with pytest.raises(ValueError, match=f"y has 3 rows, but the dispatch of this handle received "
                                                 f"num_recv={ra.num_recv}"):
                buf.combine(y[:3].clone(), handle)
        # The handle owns its routing: editing the caller's tensors changes nothing.
        idx.fill_(-1)
        w.zero_()
        assert _same(a2a.combine(y, h), full)
        a2a.poison()
        assert torch.isnan(ra.recv_x).all() and (ra.recv_src == -1).all()


def test_world_of_one_bad_inputs_raise_and_leave_the_buffer_usable():
    cfg = _cfg()
    with A2aEpBuffer(world_of_one(), cfg) as a2a:
        x, idx, w = make_inputs(0, 6, 32, 8, 2, torch.bfloat16, 2)
        with pytest.raises(ValueError, match=r"x must be \[T, 32\]"):
            a2a.dispatch(x.float(), idx, w)
        with pytest.raises(ValueError, match="topk_idx values must be in"):
            a2a.dispatch(x, idx + 8, w)
        with pytest.raises(ValueError, match="mode must be one of"):
            a2a.dispatch(x, idx, w, mode="fancy")
        res = a2a.dispatch(x, idx, w)
        with pytest.raises(ValueError, match="y must be"):
            a2a.combine(res.recv_x.float(), res.handle)
        with pytest.raises(ValueError, match="must come from this A2aEpBuffer"):
            a2a.combine(res.recv_x, DispatchHandle(res.handle.topk_idx, res.handle.topk_weights,
                                                   res.handle.scatter, 6, "scatter"))
        with A2aEpBuffer(world_of_one(), cfg) as other:
            with pytest.raises(ValueError, match="must come from this A2aEpBuffer"):
                other.combine(res.recv_x, res.handle)
        with pytest.raises(ValueError, match="topk_weights must be"):
            a2a.combine(res.recv_x, dataclasses.replace(res.handle, topk_weights=res.handle.topk_weights[:2]))
        minus5 = res.handle.topk_idx.clone()
        minus5[0, 0] = -5
        with pytest.raises(ValueError, match="may only set pairs to -1"):
            a2a.combine(res.recv_x, dataclasses.replace(res.handle, topk_idx=minus5))
        with pytest.raises(ValueError, match="num_recv must be in"):
            a2a.expert_output(cfg.capacity + 1)
        out = a2a.combine(res.recv_x, res.handle)
        assert out.shape == (6, 32) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="closed"):
        a2a.dispatch(x, idx, w)
    a2a.close()  # twice is fine


def test_a_larger_world_needs_a_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    cfg = EpConfig(world_size=2, local_world_size=2, num_experts=4, topk=2, hidden=64, dtype=torch.bfloat16,
                   max_tokens=8)
    runtime = SimpleNamespace(env=SimpleNamespace(world_size=2, rank=0), device=None, cpu_group=None)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        A2aEpBuffer(runtime, cfg)
