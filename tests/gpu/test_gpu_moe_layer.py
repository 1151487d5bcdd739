"""cute_ep.MoELayer on the GPU buffer (EpBuffer): the CPU checks again, plus what only a GPU shows.

* The layer against the dense reference (cute_ep/validators/moe_checks.py), forward and every gradient,
  bf16, without and with the communication stream (overlap): within ``gpu_rtol`` (the grouped GEMM and
  the reference's matmuls are different kernels on a GPU, so nothing is expected bit for bit there).
* Bit for bit where the arithmetic is the same: the layer on ``EpBuffer`` and on ``A2aEpBuffer`` (NCCL)
  with the same weights and inputs give equal outputs and gradients (same rows, same GEMMs, same
  SwiGLU kernel, bit-identical combines).
* The offset-aware SwiGLU kernel against the torch version on live rows, in both directions, with the
  padding rows NaN on input and a sentinel on output that must survive.
* No host sync: after one eager step, a forward and backward under ``torch.cuda.set_sync_debug_mode
  ("error")``; the same for the inference forward (``no_grad``), whose output equals the autograd
  forward's bit for bit.
* CUDA graph: forward + backward captured once and replayed with new inputs; every replay equals an
  eager step on the same inputs bit for bit (output, input and parameter gradients).
* The green context (when torch has one): the same reference check with the GEMMs confined to the SMs
  the communication does not use.

Launch as the other GPU tests (tests/gpu/conftest.py): ``torchrun --nproc-per-node N -m pytest tests/gpu
-m gpu -k moe_layer``.
"""

from __future__ import annotations

import pytest
import torch

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.buffer import EpBuffer
from cute_ep.validators.moe_checks import (
    MoECase,
    case_inputs,
    digest,
    global_weights,
    gpu_rtol,
    layer_check,
    layer_results,
    make_layer,
    record_expert_rows,
    with_case,
)

pytestmark = pytest.mark.gpu

BASE = MoECase("bf16-softmax", dtype=torch.bfloat16, hidden=128, intermediate=64, experts_per_rank=4,
               topk=2, tokens=(48, 31, 0, 40, 17, 44, 9, 36), num_sms=16)
DEEPSEEK = with_case(BASE, name="bf16-deepseek", experts_per_rank=8, topk=4, score="sigmoid", num_groups=4,
                     topk_groups=2, normalize=True, route_scale=2.5, expert_bias=True, shared_intermediate=64)
SENTINEL = 3.0


def _fresh(runtime, case: MoECase) -> MoECase:
    """``case`` with the launch's seed (fresh inputs and weights on every launch), within the rank's SM
    share (8 ranks on one GPU get 8 SMs each)."""
    return with_case(case, seed=case.seed + runtime.seed, num_sms=min(case.num_sms, runtime.sm_share))


def _ep(runtime):
    return lambda cfg: EpBuffer(runtime, cfg, registry=runtime.registry)


def _assert_close_to_reference(r: dict) -> None:
    assert r["passed"], {n: v for n, v in r["results"].items() if v["rel"] > r["rtol"]}
    assert r["grad_scale"] > 1e-3 or r["live_rows"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
@pytest.mark.parametrize("case", [BASE, DEEPSEEK], ids=["softmax", "deepseek"])
def test_layer_matches_the_dense_reference(runtime, case, overlap):
    case = _fresh(runtime, case)
    r = layer_check(runtime, _ep(runtime), runtime.device, case, exact=(),
                    rtol=gpu_rtol(case.dtype, case.topk), overlap=overlap)
    _assert_close_to_reference(r)


def test_layer_on_the_kernels_equals_the_layer_on_nccl_all_to_all(runtime):
    env, dev = runtime.env, runtime.device
    case = _fresh(runtime, DEEPSEEK)
    cfg = case.config(env.world_size, env.local_world_size)
    x, grad_out = case_inputs(case, env.rank)
    weights = global_weights(case, env.world_size)
    digests = {}
    for name, make in (("kernels", _ep(runtime)), ("a2a", lambda c: A2aEpBuffer(runtime, c))):
        with make(cfg) as buf:
            digests[name] = digest(layer_results(make_layer(buf, case, weights, dev), x, grad_out))
    assert digests["kernels"] == digests["a2a"]


# --------------------------------------------------------------------------------------------------
# the SwiGLU kernel
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", [64, 200, 2048])  # one partial column tile, several full ones
@pytest.mark.parametrize("live", [0, 1, 77, 300])
def test_swiglu_kernel_matches_torch_on_live_rows_and_skips_padding(runtime, inter, live):
    from cute_ep.swiglu import kernels, swiglu_backward_torch, swiglu_torch

    dev, n, dt = runtime.device, 300, torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(inter + live)
    gate_up = (torch.randn(n, 2 * inter, generator=g) * 3).to(dt).to(dev)
    grad_out = torch.randn(n, inter, generator=g).to(dt).to(dev)
    gate_up[live:] = float("nan")
    grad_out[live:] = float("nan")
    offsets = torch.tensor([live // 2, live // 2, live], dtype=torch.int32, device=dev)

    out = torch.full((n, inter), SENTINEL, dtype=dt, device=dev)
    kernels().forward(gate_up, offsets, out)
    want = swiglu_torch(gate_up, offsets, torch.full_like(out, SENTINEL))
    grad = torch.full((n, 2 * inter), SENTINEL, dtype=dt, device=dev)
    kernels().backward(gate_up, grad_out, offsets, grad)
    want_grad = swiglu_backward_torch(gate_up, grad_out, offsets, torch.full_like(grad, SENTINEL))
    torch.cuda.synchronize()
    assert (out[live:] == SENTINEL).all() and (grad[live:] == SENTINEL).all()  # padding untouched
    # Both compute exp and the division in fp32 and round once; allow one bf16 rounding apart.
    for got, ref in ((out[:live], want[:live]), (grad[:live], want_grad[:live])):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), ref.float(), rtol=2.0**-7, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# no host sync, CUDA graph
# --------------------------------------------------------------------------------------------------


def _layer(runtime, buf, case, **kw):
    return make_layer(buf, case, global_weights(case, runtime.env.world_size), runtime.device, **kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
def test_forward_and_backward_make_no_host_sync(runtime, overlap):
    env, dev = runtime.env, runtime.device
    case = _fresh(runtime, DEEPSEEK)
    x, grad_out = (t.to(dev) for t in case_inputs(case, env.rank))
    with _ep(runtime)(case.config(env.world_size, env.local_world_size)) as buf:
        layer = _layer(runtime, buf, case, overlap=overlap)
        layer(x.clone().requires_grad_()).backward(grad_out)  # first step: kernels compiled and loaded
        torch.cuda.synchronize()
        xg = x.clone().requires_grad_()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = layer(xg)
            out.backward(grad_out)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        buf.check_ran()  # host sync, outside: every kernel of both steps ran
        assert torch.isfinite(out).all() and torch.isfinite(xg.grad).all()


# A worst-case buffer of 2048 rows per expert at 2 ranks: torch's grouped GEMM takes its 128x256 tiles
# over it (the autograd forward) and its 64x128 tiles over the rows the ranks' tokens can fill (the
# inference forward's receive bound).
BIG_BUFFER = with_case(DEEPSEEK, name="bf16-deepseek-big-buffer", max_tokens=2048)


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
@pytest.mark.parametrize("case", [DEEPSEEK, BIG_BUFFER], ids=["deepseek", "big-buffer"])
def test_inference_equals_the_autograd_forward_without_a_host_sync(runtime, case, overlap):
    """Under no_grad the layer runs the buffer's own calls (no copy of the worst-case receive buffer) and
    its GEMMs over the receive bound: the output equals the autograd forward's (GEMMs over the whole
    buffer) bit for bit, and no call syncs the host."""
    env, dev = runtime.env, runtime.device
    case = _fresh(runtime, case)
    x, _ = (t.to(dev) for t in case_inputs(case, env.rank))
    cfg = case.config(env.world_size, env.local_world_size)
    with _ep(runtime)(cfg) as buf:
        layer = _layer(runtime, buf, case, overlap=overlap)
        trained = layer(x).detach()
        gemm_rows = record_expert_rows(layer)
        with torch.no_grad():
            layer(x)  # the inference path's first step
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                inferred = layer(x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        buf.check_ran()
        assert torch.equal(inferred, trained)
        tokens = sum(case.tokens_of(r) for r in range(env.world_size))
        assert gemm_rows == [min(tokens * case.topk, cfg.capacity)] * 2, (gemm_rows, cfg.capacity)


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
def test_graph_replay_equals_the_eager_step(runtime, overlap):
    env, dev = runtime.env, runtime.device
    case = _fresh(runtime, DEEPSEEK)
    params = ("router_weight", "w_gate_up", "w_down", "shared_gate_up", "shared_down")
    with _ep(runtime)(case.config(env.world_size, env.local_world_size)) as buf:
        layer = _layer(runtime, buf, case, overlap=overlap)
        x0, g0 = (t.to(dev) for t in case_inputs(case, env.rank))
        x_static = x0.clone().requires_grad_()
        g_static = g0.clone()

        def step() -> torch.Tensor:
            out = layer(x_static)
            out.backward(g_static)
            return out

        def eager(x: torch.Tensor, g: torch.Tensor) -> dict:
            layer.zero_grad(set_to_none=True)
            xe = x.clone().requires_grad_()
            out = layer(xe)
            out.backward(g)
            res = {"out": out.detach().clone(), "x": xe.grad.clone()}
            res.update({p: getattr(layer, p).grad.clone() for p in params})
            return res

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up away from the capture stream, as torch's docs advise
            for _ in range(2):
                layer.zero_grad(set_to_none=True)
                x_static.grad = None
                step()
        torch.cuda.current_stream().wait_stream(side)
        layer.zero_grad(set_to_none=True)
        x_static.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_static = step()
        grads = {p: getattr(layer, p).grad for p in params}  # the graph's own tensors
        x_grad = x_static.grad

        for i in range(1, 6):
            g = torch.Generator().manual_seed(runtime.seed + 500 + 10 * i + env.rank)
            xi = torch.randn(x0.shape, generator=g).to(case.dtype).to(dev)
            gi = torch.randn(g0.shape, generator=g).to(case.dtype).to(dev)
            with torch.no_grad():
                x_static.copy_(xi)
                g_static.copy_(gi)
            graph.replay()
            replay = {"out": out_static.detach().clone(), "x": x_grad.clone()}
            replay.update({p: grads[p].clone() for p in params})
            want = eager(xi, gi)
            for name, t in want.items():
                assert torch.equal(replay[name], t), f"replay {i}: {name} differs from the eager step"
        # Replays run kernels the host did not launch, so check_ran's launch count does not apply here.
        buf.check_faults()
        del graph


def test_green_context_confines_the_gemms(runtime):
    module = getattr(torch.cuda, "green_contexts", None)
    if module is None or not getattr(module, "SUPPORTED", False):
        pytest.skip(f"torch {torch.__version__} has no green contexts")
    # The communication keeps BASE's 16 SMs (or the rank's share); the layer's compute gets the rest (in
    # groups of 8).
    case = with_case(_fresh(runtime, BASE), name="green", shared_intermediate=64)
    r = layer_check(runtime, _ep(runtime), runtime.device, case, exact=(),
                    rtol=gpu_rtol(case.dtype, case.topk), green_context=True, overlap=True)
    _assert_close_to_reference(r)
