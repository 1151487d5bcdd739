"""Shared pieces of the CPU tests of the host backends (ReferenceEpBuffer, A2aEpBuffer).

A world of one runs in process, without a process group (``world_of_one``, ``host_config``, and the
references of its dispatch and combine: ``expected_dispatch``, ``expert_outputs``); gloo worlds of 2
and 4 ranks run a torchrun worker (tests/_torchrun_*_worker.py) that records its results, and the test
module asserts on them (``gloo_worlds_fixture``).

Not a test module (the leading underscore keeps pytest from collecting it); test files import it as
``from _worlds import ...``, like ``_launch``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _launch import Arg, worker_results

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.capacity import apply_expert_capacity
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


def expert_outputs(res: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The test expert (``apply_test_expert``) on a world-of-one dispatch result's received rows, or on
    ``rows`` in their place, each row's expert taken from the result's tokens_per_expert."""
    experts = global_expert_of_rows(res.tokens_per_expert, 0)
    return apply_test_expert(res.recv_x if rows is None else rows, experts)


def gloo_worlds_fixture(worker: Arg, tag: str, *args: Arg, timeout: float) -> Callable[..., list[dict]]:
    """A module-scoped fixture, for a test module to bind as ``ranks``: the per-rank results of
    ``worker`` (``worker_results``; its arguments: a fresh folder named ``{tag}{world}``, then ``args``)
    in gloo worlds of 2 and 4 ranks (test ids ep2, ep4)."""

    @pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
    def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
        world = request.param
        return worker_results(worker, world, tmp_path_factory.mktemp(f"{tag}{world}"), *args, timeout=timeout)

    return ranks
