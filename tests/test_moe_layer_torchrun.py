"""cute_ep.MoELayer in gloo worlds of 2 and 4 ranks (reference and all-to-all backends): forward and
every gradient against the dense single-process reference (cute_ep/validators/moe_checks.py).

The worker (tests/_torchrun_moe_layer_worker.py) runs the cases; the assertions live here. Equal values
where the arithmetic is the same (the output, the expert, router and shared-expert gradients: the CPU
grouped GEMM runs each expert's rows through the matmul the reference calls); the gradient of x within
``x_grad_rtol`` (the layer sums a token's K expert rows in fp32 and rounds once, autograd adds them one
at a time in the dtype).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _worlds import gloo_worlds_fixture, needs_gloo

from cute_ep.validators.moe_checks import EXACT

WORKER = Path(__file__).with_name("_torchrun_moe_layer_worker.py")
CASE_NAMES = ["bf16-softmax", "bf16-deepseek", "fp32-sync-shared", "bf16-softmax-a2a"]
EPS = {str(d): torch.finfo(d).eps for d in (torch.float32, torch.bfloat16)}

pytestmark = needs_gloo
ranks = gloo_worlds_fixture(WORKER, "moe", timeout=600)


def _case(res: dict, name: str) -> dict:
    found = [c for c in res["cases"] if c["case"] == name]
    assert len(found) == 1, [c["case"] for c in res["cases"]]
    return found[0]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_output_and_parameter_gradients_equal_the_dense_reference(ranks, name):
    for r, res in enumerate(ranks):
        c = _case(res, name)
        bad = {n: c["results"][n] for n in EXACT if not c["results"][n]["equal"]}
        assert bad == {}, (r, name, bad)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_input_gradient_within_the_stated_tolerance(ranks, name):
    """(K + 2) epsilons of the dtype relative to the largest value: one rounding per term autograd adds
    (the K experts, the router, the shared expert)."""
    for r, res in enumerate(ranks):
        c = _case(res, name)
        rtol = (c["config"]["topk"] + 2) * EPS[c["config"]["dtype"]]
        assert c["results"]["x"]["rel"] <= rtol, (r, name, c["results"]["x"], rtol)


def test_the_checks_see_real_traffic(ranks):
    """Gradients are not trivially zero, every rank but the empty one sends tokens, rows arrive, and
    without a sync the worst-case buffer has padding rows (which the layer must not read)."""
    for name in CASE_NAMES:
        cases = [_case(res, name) for res in ranks]
        assert max(c["grad_scale"] for c in cases) > 1e-3, name
        pairs = sum(c["tokens"] for c in cases) * cases[0]["config"]["topk"]
        assert sum(c["live_rows"] for c in cases) == pairs, name  # every pair arrives somewhere
        padded = [c["padding_rows"] for c in cases]
        if cases[0]["config"]["sync"]:
            assert padded == [0] * len(cases)
        else:
            assert all(p >= 0 for p in padded) and sum(padded) > 0, (name, padded)
    if len(ranks) > 2:  # rank 2 has no tokens (MoECase.tokens): it still receives and sends gradients
        assert all(c["tokens"] == 0 for c in ranks[2]["cases"])


def test_the_backends_agree(ranks):
    """The all-to-all backend's layer gives the reference backend's output and gradients, bit for bit."""
    for res in ranks:
        assert _case(res, "bf16-softmax")["digest"] == _case(res, "bf16-softmax-a2a")["digest"]


def test_inference_gemms_run_over_the_receive_bound_with_the_autograd_output(ranks):
    """The no_grad forward after a sync-free dispatch runs the experts over receive_bound rows (the
    ranks' tokens times K, the same on every rank and below the capacity here, where one rank has no
    tokens), and gives the autograd forward's output bit for bit."""
    found = [res["inference"] for res in ranks]
    total = sum(f["tokens"] for f in found)
    for r, f in enumerate(found):
        assert f["equal"], (r, f)
        assert f["bound"] == min(total * 2, f["capacity"]) < f["capacity"], (r, f)  # BASE: top-2
        assert f["gemm_rows"] == [f["bound"]], (r, f)
