"""cute_ep.MoELayer and its parts in a world of one, in process (no launch): the router, the offset-aware
SwiGLU's torch implementation against the plain one (live rows equal, padding untouched), the layer
against the dense reference on both host backends (with padding rows in the receive buffer), a
deliberately wrong layer caught by the same comparison, and the argument checks.

The multi-rank checks are in tests/test_moe_layer_torchrun.py, the kernel's CPU compile in
tests/test_swiglu_kernel_compile.py.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from _launch import assert_imports_none
from _worlds import world_of_one

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.moe_layer import MoELayer, RouterConfig, grouped_mm, route_tokens
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.swiglu import (
    offset_swiglu,
    swiglu_backward_plain,
    swiglu_backward_torch,
    swiglu_plain,
    swiglu_torch,
)
from cute_ep.validators.moe_checks import (
    EXACT,
    MoECase,
    case_inputs,
    compare_results,
    dense_results,
    global_weights,
    layer_check,
    layer_results,
    make_layer,
    with_case,
)

CPU = torch.device("cpu")
SENTINEL = 3.0  # padding rows of the outputs are filled with it and must keep it

# --------------------------------------------------------------------------------------------------
# router
# --------------------------------------------------------------------------------------------------


def _router_inputs(t: int = 40, h: int = 16, e: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(torch.bfloat16), torch.randn(e, h, generator=g)


def test_softmax_routing_takes_the_k_best_scores():
    x, w = _router_inputs()
    cfg = RouterConfig(16, 3, "softmax", normalize=True, scale=2.0)
    weights, idx = route_tokens(x, w, cfg)
    probs = torch.softmax(x.float() @ w.t(), dim=-1)
    best = probs.sort(dim=-1, descending=True)
    assert torch.equal(idx, best.indices[:, :3])
    top = best.values[:, :3]
    torch.testing.assert_close(weights, 2.0 * top / top.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    assert weights.dtype == torch.float32 and idx.dtype == torch.int64


def test_a_selection_bias_changes_the_picks_not_the_weights():
    x, w = _router_inputs()
    cfg = RouterConfig(16, 2, "sigmoid")
    bias = torch.zeros(16)
    bias[7] = 10.0  # expert 7 wins everywhere
    weights, idx = route_tokens(x, w, cfg, bias)
    assert (idx == 7).any(dim=1).all()
    scores = torch.sigmoid(x.float() @ w.t())
    assert torch.equal(weights, scores.gather(1, idx))  # the unbiased scores of the picked experts


def test_group_limited_routing_keeps_to_the_best_groups():
    x, w = _router_inputs(t=60)
    cfg = RouterConfig(16, 3, "sigmoid", num_groups=4, topk_groups=2)
    _, idx = route_tokens(x, w, cfg)
    scores = torch.sigmoid(x.float() @ w.t())
    for t in range(x.shape[0]):
        group_score = scores[t].view(4, 4).topk(2, dim=-1).values.sum(-1)
        allowed = set(group_score.topk(2).indices.tolist())
        picked = idx[t].tolist()
        assert {e // 4 for e in picked} <= allowed, (t, picked, allowed)
        # ... and they are the best experts inside those groups.
        eligible = sorted((e for e in range(16) if e // 4 in allowed), key=lambda e: -float(scores[t, e]))
        assert sorted(picked) == sorted(eligible[:3])


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_experts=8, topk=9), "1 <= topk <= num_experts"),
        (dict(num_experts=8, topk=2, score="relu"), "score must be one of"),
        (dict(num_experts=8, topk=2, num_groups=3), "divide num_experts=8"),
        (dict(num_experts=8, topk=2, num_groups=4, topk_groups=5), "topk_groups must be in [1, num_groups=4"),
        (dict(num_experts=8, topk=5, num_groups=4, topk_groups=2), "cannot come from topk_groups=2"),
        (dict(num_experts=8, topk=2, scale=0.0), "scale must be finite and > 0"),
    ],
)
def test_router_config_errors_name_the_constraint(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RouterConfig(**kw)


# --------------------------------------------------------------------------------------------------
# offset-aware SwiGLU (torch implementation) against the plain one
# --------------------------------------------------------------------------------------------------


def _gate_up(n: int, inter: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2 * inter, generator=g) * 3).to(dtype)


LIVE = [0, 1, 13, 40]  # none, one, a partial last group, every row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("live", LIVE)
def test_forward_equals_plain_on_live_rows_and_leaves_padding(dtype, live):
    n, inter = 40, 48
    gate_up = _gate_up(n, inter, dtype)
    gate_up[live:] = float("nan")  # padding may hold anything: it must not be read
    offsets = torch.tensor([live // 3, live // 2, live], dtype=torch.int32)
    out = torch.full((n, inter), SENTINEL, dtype=dtype)
    swiglu_torch(gate_up, offsets, out)
    assert torch.equal(out[:live], swiglu_plain(gate_up)[:live])
    assert (out[live:] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("live", LIVE)
def test_backward_equals_plain_on_live_rows_and_leaves_padding(dtype, live):
    n, inter = 40, 48
    gate_up = _gate_up(n, inter, dtype, seed=1)
    grad_out = _gate_up(n, inter // 2, dtype, seed=2)
    gate_up[live:], grad_out[live:] = float("nan"), float("nan")
    offsets = torch.tensor([live], dtype=torch.int32)
    grad = torch.full((n, 2 * inter), SENTINEL, dtype=dtype)
    swiglu_backward_torch(gate_up, grad_out, offsets, grad)
    assert torch.equal(grad[:live], swiglu_backward_plain(gate_up, grad_out)[:live])
    assert (grad[live:] == SENTINEL).all()


def test_plain_backward_is_autograd_of_the_plain_forward():
    gate_up = _gate_up(24, 32, torch.bfloat16).requires_grad_()
    grad_out = _gate_up(24, 16, torch.bfloat16, seed=3)
    swiglu_plain(gate_up).backward(grad_out)
    assert torch.equal(swiglu_backward_plain(gate_up.detach(), grad_out), gate_up.grad)


def test_offset_swiglu_is_differentiable_on_the_live_rows():
    live, n = 17, 32
    gate_up = _gate_up(n, 32, torch.bfloat16, seed=4)
    gate_up[live:] = float("nan")
    offsets = torch.tensor([5, live], dtype=torch.int32)
    grad_out = _gate_up(n, 16, torch.bfloat16, seed=5)
    a = gate_up.clone().requires_grad_()
    offset_swiglu(a, offsets, impl="torch").backward(grad_out)
    b = gate_up[:live].clone().requires_grad_()
    swiglu_plain(b).backward(grad_out[:live])
    assert torch.equal(a.grad[:live], b.grad)


def test_offset_swiglu_rejects_bad_arguments():
    gate_up = _gate_up(8, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="offsets must be a non-empty 1-D int32"):
        offset_swiglu(gate_up, torch.tensor([8]))
    with pytest.raises(ValueError, match="even width"):
        offset_swiglu(gate_up[:, :7], torch.tensor([8], dtype=torch.int32))
    with pytest.raises(ValueError, match="impl must be one of"):
        offset_swiglu(gate_up, torch.tensor([8], dtype=torch.int32), impl="fast")
    with pytest.raises(ValueError, match="impl='kernel' runs on a CUDA device"):
        offset_swiglu(gate_up, torch.tensor([8], dtype=torch.int32), impl="kernel")
    with pytest.raises(ValueError, match=r"out must be \[8, 8\]"):
        swiglu_torch(gate_up, torch.tensor([8], dtype=torch.int32), torch.empty(8, 7, dtype=torch.bfloat16))


def test_grouped_mm_ignores_rows_past_the_last_offset():
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(12, 16, generator=g).to(torch.bfloat16)
    rows[7:] = float("nan")
    weight = torch.randn(3, 24, 16, generator=g).to(torch.bfloat16)
    out = grouped_mm(rows, weight, torch.tensor([2, 2, 7], dtype=torch.int32))  # an empty group too
    want = torch.cat([rows[:2] @ weight[0].t(), rows[2:7] @ weight[2].t()])
    assert torch.equal(out[:7], want)


# --------------------------------------------------------------------------------------------------
# the layer against the dense reference (a world of one)
# --------------------------------------------------------------------------------------------------

# max_tokens above the 12 tokens: the worst-case receive buffer has padding rows (poisoned with NaN).
BASE = MoECase("bf16-softmax", experts_per_rank=4, tokens=(12,), max_tokens=20)
CASES = [
    BASE,
    with_case(BASE, name="bf16-deepseek", experts_per_rank=8, topk=3, score="sigmoid", num_groups=4,
              topk_groups=2, normalize=True, route_scale=2.5, expert_bias=True, shared_intermediate=16),
    with_case(BASE, name="fp32-sync-shared", dtype=torch.float32, sync=True, shared_intermediate=16),
    with_case(BASE, name="bf16-plain-swiglu", swiglu="plain", shared_intermediate=16),
]
BACKENDS = {"reference": ReferenceEpBuffer, "a2a": A2aEpBuffer}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layer_matches_the_dense_reference(backend, case):
    rt = world_of_one()
    r = layer_check(rt, lambda cfg: BACKENDS[backend](rt, cfg), CPU, case)
    bad = {n: r["results"][n] for n in EXACT if not r["results"][n]["equal"]}
    assert bad == {}, bad
    assert r["results"]["x"]["rel"] <= (case.topk + 2) * torch.finfo(case.dtype).eps, r["results"]["x"]
    assert r["grad_scale"] > 1e-3
    assert r["live_rows"] == 12 * case.topk
    assert r["padding_rows"] == (0 if case.sync else 20 * case.topk - 12 * case.topk)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", CASES[:3], ids=[c.name for c in CASES[:3]])
def test_inference_runs_the_buffers_own_calls_with_the_same_output(backend, case, monkeypatch):
    """Under no_grad / inference_mode the layer calls the buffer's dispatch and combine itself (no
    autograd copy of the received rows): the output equals the autograd forward's bit for bit."""
    import cute_ep.moe_layer as moe

    rt = world_of_one()
    x, _ = case_inputs(case, 0)
    with BACKENDS[backend](rt, case.config(1, 1)) as buf:
        layer = make_layer(buf, case, global_weights(case, 1), CPU)
        trained = layer(x)
        assert trained.requires_grad

        def refuse(*args, **kwargs):
            raise AssertionError("the autograd dispatch ran under no_grad")

        monkeypatch.setattr(moe.ep, "dispatch", refuse)
        with torch.no_grad():
            plain = layer(x)
        with torch.inference_mode():
            inferred = layer(x)
    assert not plain.requires_grad
    assert torch.equal(plain, trained.detach()) and torch.equal(inferred, plain)


def test_the_comparison_catches_a_wrong_expert():
    """One expert's weight nudged on the layer's side: the output and gradients no longer match."""
    rt = world_of_one()
    case = BASE
    x, grad_out = case_inputs(case, 0)
    weights = global_weights(case, 1)
    with ReferenceEpBuffer(rt, case.config(1, 1)) as buf:
        layer = make_layer(buf, case, weights, CPU)
        with torch.no_grad():
            layer.w_down[1, 0, 0] += 0.25
        mine = layer_results(layer, x, grad_out)
    verdict = compare_results(mine, dense_results(case, 0, [x], [grad_out]), case.dtype, case.topk)
    assert not verdict["passed"] and not verdict["results"]["out"]["equal"]


def test_replicated_gradients_are_this_ranks_part_and_experts_are_local():
    rt = world_of_one()
    case = with_case(BASE, shared_intermediate=16)
    with ReferenceEpBuffer(rt, case.config(1, 1)) as buf:
        layer = make_layer(buf, case, global_weights(case, 1), CPU)
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"router_weight", "w_gate_up", "w_down", "shared_gate_up", "shared_down"}
        assert tuple(layer.w_gate_up.shape) == (4, 2 * case.intermediate, case.hidden)
        assert list(layer.local_experts) == [0, 1, 2, 3]
        assert "intermediate=32" in repr(layer)


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------


@pytest.fixture()
def buf():
    rt = world_of_one()
    with ReferenceEpBuffer(rt, BASE.config(1, 1)) as b:
        yield b


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(intermediate=12), "intermediate must be a positive multiple of 8, got 12"),
        (dict(intermediate=32, shared_intermediate=4), "shared_intermediate must be 0 or a positive"),
        (dict(intermediate=32, swiglu="fast"), "swiglu must be one of"),
        (dict(intermediate=32, num_sms=7), "num_sms must equal the buffer's cfg.num_sms=0"),
        (dict(intermediate=32, overlap=True), "need a buffer whose dispatch takes stream= .EpBuffer.; "
                                              "ReferenceEpBuffer has none"),
        (dict(intermediate=32, green_context=True), "ReferenceEpBuffer has none"),
        (dict(intermediate=32, score="tanh"), "score must be one of"),
    ],
)
def test_layer_arguments_are_checked(buf, kw, message):
    with pytest.raises(ValueError, match=message):
        MoELayer(buf, **kw)


def test_input_is_checked(buf):
    layer = MoELayer(buf, 32)
    with pytest.raises(ValueError, match=r"x must be \[T, 32\] torch.bfloat16, got \[4, 32\] torch.float32"):
        layer(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="more than the buffer's max_tokens=20"):
        layer(torch.zeros(21, 32, dtype=torch.bfloat16))


def test_load_global_weights_checks_shapes(buf):
    layer = MoELayer(buf, 32)
    w = global_weights(BASE, 1)
    with pytest.raises(ValueError, match=r"w_down must be \[4, 32, 32\]"):
        layer.load_global_weights(w["router_weight"], w["w_gate_up"], w["w_down"][:, :, :16])
    with pytest.raises(ValueError, match="shared_gate_up: the layer has none"):
        layer.load_global_weights(w["router_weight"], w["w_gate_up"], w["w_down"],
                                  shared_gate_up=torch.zeros(32, 32, dtype=torch.bfloat16))


def test_importing_the_layer_imports_no_gpu_module():
    assert_imports_none("import cute_ep.moe_layer, cute_ep.swiglu; import cute_ep; cute_ep.MoELayer",
                        ["cutlass", "nvshmem", "cute_ep.buffer", "cute_ep.kernels.swiglu"])


def test_the_layer_loads_its_swiglu_kernels_before_any_step_and_then_meets_the_ranks(buf, monkeypatch):
    """Where the SwiGLU kernel serves (a GPU), building the layer compiles both directions and puts them on
    the GPU (``SwiGLUKernels.load``) and then waits for the other ranks, so no rank compiles or loads a
    kernel inside a step while the peers' kernels wait for it."""
    import cute_ep.moe_layer as ml
    import cute_ep.swiglu as sw

    events = []
    fake = SimpleNamespace(load=lambda dtype, device: events.append(("load", dtype, device.type)))
    monkeypatch.setattr(sw, "kernels", lambda: fake)
    monkeypatch.setattr(ml, "resolve_impl", lambda impl, device: "kernel")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda group: events.append(("barrier", group)))
    group = object()
    monkeypatch.setattr(buf, "runtime", SimpleNamespace(cpu_group=group), raising=False)
    MoELayer(buf, 32)
    assert events == [("load", torch.bfloat16, "cpu"), ("barrier", group)]
    events.clear()
    monkeypatch.setattr(ml, "resolve_impl", lambda impl, device: "torch")  # CPU: nothing to load
    MoELayer(buf, 32)
    assert events == []


def test_the_local_warm_up_step_runs_every_local_part_and_leaves_no_gradient(buf, monkeypatch):
    """The set-up step on a GPU (``_local_step``: router, experts, shared expert, forward and backward on
    dummy rows) asks autograd for the gradient of every parameter and of its input without accumulating
    any into ``.grad``: the caller's first step starts from untouched parameters."""
    import cute_ep.moe_layer as ml

    layer = MoELayer(buf, 32, shared_intermediate=16)
    calls = []
    real_grad = torch.autograd.grad

    def grad(outputs, inputs, **kw):
        calls.append([tuple(t.shape) for t in inputs])
        return real_grad(outputs, inputs, **kw)

    monkeypatch.setattr(ml.torch.autograd, "grad", grad)
    layer._local_step(torch.device("cpu"))
    params = [tuple(p.shape) for p in layer.parameters()]
    assert calls == [[(2, layer.cfg.hidden), *params]]
    assert len(params) == 5  # router, w_gate_up, w_down and the shared expert's two
    assert all(p.grad is None for p in layer.parameters())


def test_receive_bound_is_the_tokens_times_k_up_to_the_capacity():
    """A world of one (no group): this rank's tokens times K, never above the capacity."""
    from cute_ep.moe_layer import receive_bound

    assert receive_bound(5, 3, 100) == 15
    assert receive_bound(50, 3, 100) == 100
    assert receive_bound(0, 8, 64) == 0


def test_no_receive_bound_where_the_other_ranks_counts_cannot_be_summed():
    """A world of two without a CPU group to sum the counts on, or a synchronizing layer: no bound (the
    GEMMs then run over the dispatch's views); a world of one: this rank's tokens times K."""
    from types import SimpleNamespace

    from cute_ep.moe_layer import MoELayer

    x = torch.zeros(3, 4)
    buf = SimpleNamespace(recv_y=torch.zeros(1, 4), runtime=None)

    def layer(world: int, sync: bool = False) -> SimpleNamespace:
        cfg = SimpleNamespace(world_size=world, topk=2, capacity=10)
        return SimpleNamespace(sync=sync, buffer=buf, cfg=cfg)

    assert MoELayer._receive_bound(layer(2), x) is None
    assert MoELayer._receive_bound(layer(1, sync=True), x) is None
    assert MoELayer._receive_bound(layer(1), x) == 6
