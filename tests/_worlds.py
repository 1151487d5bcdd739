"""Shared pieces of the CPU tests of the host backends (ReferenceEpBuffer, A2aEpBuffer).

A world of one runs in process, without a process group (``world_of_one``, ``host_config``, and the
references of its dispatch and combine: ``expected_dispatch``, ``expert_outputs``); gloo worlds of 2
and 4 ranks run a torchrun worker (tests/_torchrun_*_worker.py) that records its results, and the test
module asserts on them (``gloo_worlds_fixture``, ``assert_raised_on_every_rank``). The workers build
their cases with ``case_config`` and ``case_inputs``, and run invalid calls with ``on_host_backends``.

Not a test module (the leading underscore keeps pytest from collecting it); test files import it as
``from _worlds import ...``, like ``_launch``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from _launch import Arg, worker_results
from _rank_layout_spec import rank0_routing

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.capacity import apply_expert_capacity
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    ExpectedRecv,
    Layout,
    apply_test_expert,
    global_expert_of_rows,
    reference_dispatch_rank,
    reference_layout,
)
from cute_ep.reference_backend import ReferenceEpBuffer

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

HOST_BACKENDS = {"reference": ReferenceEpBuffer, "a2a": A2aEpBuffer}
"""The host backends by their --backend name, for tests parametrized over both."""


def world_of_one() -> SimpleNamespace:
    """What a host backend needs of a Runtime in a world of one, in process: no process group, no device."""
    return SimpleNamespace(env=DistEnv.from_environ({}), device=None, cpu_group=None)


def host_config(**kw: Any) -> EpConfig:
    """A small EpConfig, by default for a world of one: R = L = 1, E = 4, K = 2, H = 32, bf16, M = 16;
    ``kw`` overrides any field."""
    fields: dict[str, Any] = dict(world_size=1, local_world_size=1, num_experts=4, topk=2, hidden=32,
                                  dtype=torch.bfloat16, max_tokens=16)
    fields.update(kw)
    return EpConfig(**fields)


def expected_dispatch(
    cfg: EpConfig, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Layout, ExpectedRecv]:
    """The references of a dispatch in a world of one under ``cfg``'s expert capacity: (the routing
    left after the drops [T, K], rows dropped per expert [E], the layout, the expected receive
    buffers). ``x``: the rows the sender moves (for an FP8 dispatch, its packed rows)."""
    eff, dropped = apply_expert_capacity([idx], cfg.num_experts, cfg.expert_capacity)
    layout = reference_layout(eff, cfg.num_experts)
    recv = reference_dispatch_rank([x], eff, [w], layout, cfg.max_tokens, 0)
    return eff[0], dropped, layout, recv


def expert_outputs(res: Any, rows: torch.Tensor | None = None, *, rank: int = 0) -> torch.Tensor:
    """The test expert (``apply_test_expert``) on a dispatch result's received rows, or on ``rows`` in
    their place, each row's expert taken from the result's tokens_per_expert on ``rank`` (0: a world of
    one)."""
    experts = global_expert_of_rows(res.tokens_per_expert, rank)
    return apply_test_expert(res.recv_x if rows is None else rows, experts)


def gloo_worlds_fixture(worker: Arg, tag: str, *args: Arg, timeout: float,
                        scope: Literal["module", "session"] = "module") -> Callable[..., list[dict]]:
    """A fixture of ``scope``, for a test module (or, session-scoped, tests/conftest.py) to bind as
    ``ranks`` (or another name: the fixture's name): the per-rank results of ``worker``
    (``worker_results``; its arguments: a fresh folder named ``{tag}{world}``, then ``args``) in gloo
    worlds of 2 and 4 ranks (test ids ep2, ep4)."""

    @pytest.fixture(scope=scope, params=[2, 4], ids=["ep2", "ep4"])
    def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
        world = request.param
        return worker_results(worker, world, tmp_path_factory.mktemp(f"{tag}{world}"), *args, timeout=timeout)

    return ranks


RANK_LAYOUT_WORLDS = pytest.mark.xdist_group("rank_layout_worlds")
"""The mark of the tests that use tests/conftest.py's ``rank_layout_worlds`` (one launch per world for
both rank-layout test modules): under pytest-xdist with --dist loadgroup they run on one worker."""


def assert_raised_on_every_rank(ranks: list[dict], key: str, at_fault: int | None, own: str,
                                elsewhere: list[str]) -> None:
    """The invalid call ``key`` of every rank's ``res["bad"]`` (``outcome``) raised ValueError, on rank
    ``at_fault`` (on every rank if None) with ``own`` in its message, elsewhere with each of ``elsewhere``
    in theirs."""
    for r, res in enumerate(ranks):
        got = res["bad"][key]
        assert got["raised"] == "ValueError", (r, got)
        for text in [own] if at_fault is None or r == at_fault else elsewhere:
            assert text in got["message"], (r, got)


# --------------------------------------------------------------------------------------------------
# the torchrun workers' side. A case: (name, routing, dtype, topk, hidden, experts per rank, tokens per
# rank (by rank), max tokens, extras...).
# --------------------------------------------------------------------------------------------------


def world_config(env: DistEnv, **kw: Any) -> EpConfig:
    """``host_config`` in the world of ``env`` (its R and L)."""
    return host_config(world_size=env.world_size, local_world_size=env.local_world_size, **kw)


def case_config(env: DistEnv, case: tuple, **extra: Any) -> EpConfig:
    """The EpConfig of a worker's ``case`` in the world of ``env`` (E = El * R; topk 0 stands for R);
    ``extra``: more fields."""
    _, _, dtype, topk, hidden, el, _, max_tokens = case[:8]
    return world_config(env, num_experts=el * env.world_size, topk=topk or env.world_size, hidden=hidden,
                        dtype=dtype, max_tokens=max_tokens, **extra)  # fmt: skip


def case_inputs(rank: int, world: int, tokens: int, case: tuple, seed: int) -> tuple:
    """``make_inputs`` of rank ``rank`` for a worker's ``case`` (extras: "idx", the ids' dtype;
    "all_dropped", the rank whose ids are all -1), ``tokens`` tokens. Routings beyond make_inputs':
    "rank0" (every token of every rank to rank 0 only) and "everyone" (uniform; with topk 0 = R, every
    token to every rank)."""
    _, routing, dtype, topk, hidden, el, _, _, extra = case
    topk = topk or world
    num_e = el * world
    base = "uniform" if routing in ("rank0", "everyone") else routing
    x, idx, w = make_inputs(rank, tokens, hidden, num_e, topk, dtype, seed, routing=base,
                            idx_dtype=extra.get("idx", torch.int64))
    if routing == "rank0":  # skew: every token of every rank goes to rank 0 only
        idx = rank0_routing(tokens, topk, el, seed + rank).to(idx.dtype)
    if extra.get("all_dropped") == rank:
        idx.fill_(-1)
    return x, idx, w


def on_host_backends(rt: Any, cfg_a: EpConfig, cfg_b: EpConfig,
                     scenarios_of: Callable[[Any, str, Any, Any], dict]) -> dict:
    """``scenarios_of(rt, backend, buf_a, buf_b)`` on each host backend ("a2a", then "reference") with a
    buffer of ``cfg_a`` and one of ``cfg_b`` open; their results merged (a worker's invalid calls)."""
    out: dict[str, dict] = {}
    for backend, cls in (("a2a", A2aEpBuffer), ("reference", ReferenceEpBuffer)):
        with cls(rt, cfg_a) as buf_a, cls(rt, cfg_b) as buf_b:
            out.update(scenarios_of(rt, backend, buf_a, buf_b))
    return out
