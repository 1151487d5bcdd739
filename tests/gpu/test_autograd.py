"""cute_ep.autograd on the GPU buffer: the same checks as the CPU test (reference backend).

Gradients of dispatch -> per-expert linear -> combine against dense torch autograd (fp32), and a
two-layer MoE whose loss falls. See cute_ep/validators/autograd_checks.py.
"""

from __future__ import annotations

import pytest

from cute_ep.buffer import EpBuffer
from cute_ep.validators.autograd_checks import gradient_check, train

pytestmark = pytest.mark.gpu


def _make(runtime):
    return lambda cfg: EpBuffer(runtime, cfg, registry=runtime.registry)


def test_gradients_match_plain_autograd(runtime):
    g = gradient_check(runtime, _make(runtime), runtime.device)
    assert g["grad_scale"] > 0.1
    assert g["out_err"] < 1e-5, g
    for name in ("x_grad_err", "w_grad_err", "expert_grad_err"):
        assert g[name] < 1e-4, (name, g)
    assert g["w_grad_dropped"] == 0.0


def test_a_two_layer_moe_trains(runtime):
    losses = train(runtime, _make(runtime), runtime.device)["losses"]
    assert losses[-1] < 0.6 * losses[0], f"{losses[0]:.4f} -> {losses[-1]:.4f}"
