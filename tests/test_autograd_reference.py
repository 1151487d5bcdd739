"""Differentiable dispatch/combine (cute_ep.autograd) under a real gloo world, reference backend.

The worker (tests/_torchrun_autograd_worker.py) compares every gradient with plain torch autograd of
the same global loss and trains a two-layer MoE; the assertions live here. The GPU buffer exposes
the same calls, so the same functions run on it (tests/gpu/test_autograd.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _worlds import gloo_worlds_fixture, needs_gloo

WORKER = Path(__file__).with_name("_torchrun_autograd_worker.py")

pytestmark = needs_gloo
ranks = gloo_worlds_fixture(WORKER, "autograd", timeout=240)


def test_forward_matches_the_dense_moe(ranks):
    for r, res in enumerate(ranks):
        assert res["gradients"]["out_err"] < 1e-5, (r, res["gradients"])


@pytest.mark.parametrize("name", ["x_grad_err", "w_grad_err", "expert_grad_err"])
def test_gradients_match_plain_autograd(ranks, name):
    for r, res in enumerate(ranks):
        g = res["gradients"]
        assert g["grad_scale"] > 0.1, "the reference gradient must not be trivially zero"
        assert g[name] < 1e-4, (r, name, g)


def test_a_dropped_pair_gets_no_weight_gradient(ranks):
    for res in ranks:
        assert res["gradients"]["w_grad_dropped"] == 0.0


def test_a_two_layer_moe_trains(ranks):
    losses = ranks[0]["training"]["losses"]
    assert all(r["training"]["losses"] == losses for r in ranks), "ranks disagree on the mean loss"
    assert losses[-1] < 0.6 * losses[0], f"loss did not fall enough: {losses[0]:.4f} -> {losses[-1]:.4f}"
    assert all(b <= a * 1.05 for a, b in zip(losses, losses[1:], strict=False)), losses


def test_atomic_mode_is_refused_with_the_reason(ranks):
    for res in ranks:
        assert "need mode 'scatter'" in res["atomic_error"]
