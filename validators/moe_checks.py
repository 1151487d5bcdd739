"""Checks of ``cute_ep.MoELayer`` against a dense single-process torch reference of the same layer.

Shared by the CPU tests (reference and all-to-all backends over gloo), the GPU tests and
``examples/moe_layer.py``. ``layer_check(runtime, make_buffer, device, case)`` builds the layer on every
rank with weights drawn from one seed (``global_weights``: the same tensors on every rank, each rank
keeping its experts), runs forward and backward with a random output gradient, gathers every rank's
inputs and evaluates ``dense_moe``, the plain torch version of the same layer on every rank's tokens:

* the router on each rank's tokens with that rank's replica of the router (and of the shared expert), so
  the reference has a gradient per replica to compare with each rank's own;
* for every expert e, one matrix of the tokens that picked it, all ranks' tokens in rank then token
  order (the order of the receive buffer), through x @ W_gate_up[e]^T, ``swiglu_plain`` and
  @ W_down[e]^T with plain matmuls;
* out[t] = sum over k ascending of w[t, k] * y_k[t] in fp32 from 0.0, rounded once (+ shared expert);
* autograd of sum_r <out_r, G_r> for every gradient.

What is compared, and how (``EXACT`` / ``TOLERANT``): where both sides run the same arithmetic in the
same order the values must be equal (``torch.equal``): the output, the expert weights' gradients, each
rank's router and shared-expert gradients. The gradient of x is not: x feeds K experts, the router and
the shared expert, and the layer sums its K expert rows in fp32 with one rounding (the dispatch's
backward is a combine with unit weights) where autograd adds the contributions one at a time in the
input dtype, so it is compared with a tolerance relative to its largest value (``x_grad_rtol``: one
rounding of the dtype per term of the sum, K experts + router + shared expert).

That split holds on the CPU, where ``grouped_mm`` runs each expert's rows through the same matmul the
reference calls. On a GPU the grouped GEMM (CUTLASS) and the reference's matmuls (cuBLAS) accumulate
in different orders, so the GPU checks compare everything with ``GPU_RTOL`` (``exact=()``) and get their
bit-exact checks elsewhere: the layer on ``EpBuffer`` against the same layer on ``A2aEpBuffer`` (the same
GEMMs on the same rows: equal), and a CUDA-graph replay against the eager step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from cute_ep.collectives import all_gather_objects
from cute_ep.kernels.config import EpConfig
from cute_ep.moe_layer import MoELayer, RouterConfig, route_tokens
from cute_ep.swiglu import swiglu_plain

__all__ = [
    "EXACT",
    "GPU_RTOL",
    "TOLERANT",
    "gpu_rtol",
    "x_grad_rtol",
    "MoECase",
    "dense_moe",
    "global_weights",
    "case_inputs",
    "compare_results",
    "dense_results",
    "digest",
    "layer_check",
    "layer_results",
    "make_layer",
    "received_rows",
    "record_expert_rows",
    "with_case",
]

EXACT = ("out", "w_gate_up", "w_down", "router_weight", "shared_gate_up", "shared_down")
"""Quantities the layer must reproduce with equal values."""
TOLERANT = ("x",)
"""Quantities compared with a tolerance (module docstring)."""


def x_grad_rtol(dtype: torch.dtype, topk: int) -> float:
    """max |grad_x - reference| / max |reference| allowed: (K + 2) x the dtype's epsilon. Autograd adds
    the K expert terms, the router's and the shared expert's one at a time, each addition rounding in
    the dtype (half an epsilon relative to the partial sum, which may exceed the final value when terms
    cancel: hence a whole epsilon per term)."""
    return (topk + 2) * torch.finfo(dtype).eps
GPU_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}
"""The same ratio for every quantity on a GPU (``gpu_rtol``): GEMMs of different kernels round each bf16
output once (2^-8 relative) and the differences travel through SwiGLU and the second GEMM; fp32 GEMMs
may use other accumulation orders (and TF32 if the caller enabled it: then pass a looser rtol)."""


def gpu_rtol(dtype: torch.dtype, topk: int) -> float:
    """The tolerance of every quantity on a GPU: ``GPU_RTOL`` or, if larger, ``x_grad_rtol``."""
    return max(GPU_RTOL[dtype], x_grad_rtol(dtype, topk))


@dataclass(frozen=True)
class MoECase:
    """One configuration of the layer check (E = experts_per_rank * world size)."""

    name: str
    dtype: torch.dtype = torch.bfloat16
    hidden: int = 32
    intermediate: int = 32
    experts_per_rank: int = 2
    topk: int = 2
    score: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = False
    route_scale: float = 1.0
    expert_bias: bool = False
    shared_intermediate: int = 0
    sync: bool = False
    swiglu: str = "auto"
    tokens: tuple[int, ...] = (12, 7, 0, 9, 5, 11, 3, 8)  # by rank (cyclic): ragged, rank 2 has none
    max_tokens: int = 0  # the buffer's; 0: the largest T of any rank
    num_sms: int = 0  # the buffer's SM budget; 0: EpConfig's default
    seed: int = 0

    def tokens_of(self, rank: int) -> int:
        return self.tokens[rank % len(self.tokens)]

    def router(self, world: int) -> RouterConfig:
        return RouterConfig(self.experts_per_rank * world, self.topk, self.score, self.num_groups,
                            self.topk_groups, self.normalize, self.route_scale)

    def config(self, world: int, local_world: int, **kw: Any) -> EpConfig:
        """The buffer's EpConfig in a world of ``world`` ranks (max_tokens: ``self.max_tokens``, or the
        largest T of any rank)."""
        return EpConfig(world_size=world, local_world_size=local_world,
                        num_experts=self.experts_per_rank * world, topk=self.topk, hidden=self.hidden,
                        dtype=self.dtype, max_tokens=self.max_tokens or self.largest_t(world),
                        **({"num_sms": self.num_sms} if self.num_sms else {}), **kw)

    def largest_t(self, world: int) -> int:
        return max(1, *(self.tokens_of(r) for r in range(world)))


def global_weights(case: MoECase, world: int) -> dict[str, torch.Tensor | None]:
    """The whole layer's weights for ``case`` in a world of ``world`` ranks, from ``case.seed`` on the CPU
    (the same tensors on every rank): router_weight [E, H] fp32, w_gate_up [E, 2I, H], w_down [E, H, I],
    shared_gate_up [2Is, H] / shared_down [H, Is] (or None), expert_bias [E] fp32 (or None); experts in
    ``case.dtype``. Scaled so that activations stay O(1)."""
    g = torch.Generator().manual_seed(10_000 + case.seed)
    e, h, i, s = case.experts_per_rank * world, case.hidden, case.intermediate, case.shared_intermediate
    dt = case.dtype

    def draw(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / fan_in**0.5).to(dt)

    return {
        "router_weight": torch.randn(e, h, generator=g) / h**0.5,
        "w_gate_up": draw(e, 2 * i, h, fan_in=h),
        "w_down": draw(e, h, i, fan_in=i),
        "shared_gate_up": draw(2 * s, h, fan_in=h) if s else None,
        "shared_down": draw(h, s, fan_in=s) if s else None,
        # A bias that changes some picks: half the experts favoured by a fraction of a score's spread.
        "expert_bias": torch.rand(e, generator=g) * 0.2 if case.expert_bias else None,
    }


def make_layer(buf: Any, case: MoECase, weights: dict[str, torch.Tensor | None], device: torch.device,
               **layer_kw: Any) -> MoELayer:
    """A ``MoELayer`` of ``case`` on ``buf`` with ``weights`` (``global_weights``) loaded."""
    layer = MoELayer(buf, case.intermediate, score=case.score, num_groups=case.num_groups,
                     topk_groups=case.topk_groups, normalize=case.normalize, route_scale=case.route_scale,
                     expert_bias=case.expert_bias, shared_intermediate=case.shared_intermediate,
                     swiglu=case.swiglu, sync=case.sync, device=device, **layer_kw)  # fmt: skip
    layer.load_global_weights(**{k: (None if v is None else v.to(device)) for k, v in weights.items()})
    return layer


def record_expert_rows(layer: MoELayer) -> list[int]:
    """From now on ``layer`` notes how many rows each call of its experts' GEMMs runs over (its own
    ``experts`` still does the work); returns the list the counts are appended to."""
    seen: list[int] = []
    experts = layer.experts

    def noted(rows: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return experts(rows, offs)

    layer.experts = noted
    return seen


def dense_moe(xs: Sequence[torch.Tensor], routers: Sequence[torch.Tensor], w_gate_up: torch.Tensor,
              w_down: torch.Tensor, router: RouterConfig, *, expert_bias: torch.Tensor | None = None,
              shared: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[torch.Tensor]:
    """The layer's output for every rank's tokens xs[r] [T_r, H], computed densely in one process.

    routers[r] [E, H]: rank r's router replica; w_gate_up [E, 2I, H], w_down [E, H, I]: every expert;
    shared[r]: rank r's shared expert (gate_up [2Is, H], down [H, Is]) or None. Differentiable in all
    of them (module docstring)."""
    num_e = w_gate_up.shape[0]
    routes = [route_tokens(x, r, router, expert_bias) for x, r in zip(xs, routers, strict=True)]
    # Every (rank, token, k) pair of expert e, ranks then tokens ascending (a token names e at most once).
    rows_of: list[list[tuple[int, int, int]]] = [[] for _ in range(num_e)]
    for r, (_, idx) in enumerate(routes):
        for t, ks in enumerate(idx.tolist()):
            for k, e in enumerate(ks):
                rows_of[e].append((r, t, k))
    # y[(r, t, k)]: the expert output of that pair.
    pieces: dict[tuple[int, int, int], torch.Tensor] = {}
    for e, pairs in enumerate(rows_of):
        if not pairs:
            continue
        x_e = torch.stack([xs[r][t] for r, t, _ in pairs])
        y_e = swiglu_plain(x_e @ w_gate_up[e].t()) @ w_down[e].t()
        for j, pair in enumerate(pairs):
            pieces[pair] = y_e[j]
    outs = []
    for r, (x, (w, idx)) in enumerate(zip(xs, routes, strict=True)):
        acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for k in range(idx.shape[1]):
            if x.shape[0] == 0:
                continue
            y_k = torch.stack([pieces[(r, t, k)] for t in range(x.shape[0])])
            acc = acc + w[:, k, None] * y_k.float()
        out = acc.to(x.dtype)
        if shared is not None:
            gate_up, down = shared[r]
            out = out + torch.nn.functional.linear(swiglu_plain(torch.nn.functional.linear(x, gate_up)), down)
        outs.append(out)
    return outs


def _grad_of(leaf: torch.Tensor) -> torch.Tensor:
    """The gradient of ``leaf`` on the CPU; zeros where nothing reached it (a rank without tokens)."""
    return torch.zeros(leaf.shape, dtype=leaf.dtype) if leaf.grad is None else leaf.grad.detach().cpu()


def received_rows(xs: Sequence[torch.Tensor], router_weight: torch.Tensor, router: RouterConfig,
                  expert_bias: torch.Tensor | None, rank: int, experts_per_rank: int) -> int:
    """Rows rank ``rank`` receives: the (token, k) pairs of every rank's tokens xs that pick one of its
    experts."""
    lo, hi = rank * experts_per_rank, (rank + 1) * experts_per_rank
    with torch.no_grad():
        picks = [route_tokens(x, router_weight, router, expert_bias)[1] for x in xs]
    return sum(int(((p >= lo) & (p < hi)).sum()) for p in picks)


def _compare(got: torch.Tensor | None, want: torch.Tensor | None) -> dict[str, Any]:
    """{"equal", "max_abs", "scale"}: equal values (torch.equal), the largest difference, the largest
    reference value."""
    if got is None or want is None:
        return {"equal": got is None and want is None, "max_abs": 0.0, "scale": 0.0}
    got, want = got.detach().cpu().float(), want.detach().cpu().float()
    if got.shape != want.shape:
        return {"equal": False, "max_abs": float("inf"), "scale": 0.0}
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    return {"equal": bool(torch.equal(got, want)), "max_abs": diff, "scale": scale}


def case_inputs(case: MoECase, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, H], grad_out [T, H]) of ``rank`` in ``case.dtype`` on the CPU (T = ``case.tokens_of(rank)``)."""
    g = torch.Generator().manual_seed(100 * case.seed + rank)
    t = case.tokens_of(rank)
    x = torch.randn(t, case.hidden, generator=g).to(case.dtype)
    return x, torch.randn(t, case.hidden, generator=g).to(case.dtype)


def layer_results(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Forward of x [T, H] and backward of grad_out on ``layer`` (collective): the output and every
    gradient (``EXACT`` and ``TOLERANT`` names; None where the layer has no such parameter), on the CPU.
    The inputs go to the layer's device; x is copied (its own .grad stays untouched)."""
    device = layer.router_weight.device
    x_dev = x.to(device, copy=True).requires_grad_()
    out = layer(x_dev)
    out.backward(grad_out.to(device))

    def grad(p: torch.Tensor | None) -> torch.Tensor | None:
        return None if p is None else _grad_of(p)

    return {
        "out": out.detach().cpu(), "x": _grad_of(x_dev),
        "w_gate_up": grad(layer.w_gate_up), "w_down": grad(layer.w_down),
        "router_weight": grad(layer.router_weight), "shared_gate_up": grad(layer.shared_gate_up),
        "shared_down": grad(layer.shared_down),
    }  # fmt: skip


def dense_results(case: MoECase, rank: int, xs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  device: torch.device | str = "cpu") -> dict[str, Any]:
    """What ``layer_results`` must give on ``rank``, from ``dense_moe`` of every rank's inputs xs and
    output gradients grads (index = rank), computed on ``device`` (the layer's: the router must pick
    with the same arithmetic). Also "live_rows": the rows ``rank`` receives."""
    world = len(xs)
    weights = global_weights(case, world)
    dev = torch.device(device)
    on = {k: (None if v is None else v.to(dev)) for k, v in weights.items()}
    leaves = [x.to(dev, copy=True).requires_grad_() for x in xs]
    routers = [on["router_weight"].clone().requires_grad_() for _ in range(world)]
    w_gu = on["w_gate_up"].clone().requires_grad_()
    w_dn = on["w_down"].clone().requires_grad_()
    shared = None
    if case.shared_intermediate:
        shared = [(on["shared_gate_up"].clone().requires_grad_(), on["shared_down"].clone().requires_grad_())
                  for _ in range(world)]
    router = case.router(world)
    outs = dense_moe(leaves, routers, w_gu, w_dn, router, expert_bias=on["expert_bias"], shared=shared)
    # A rank without tokens has an output that depends on nothing (and gets no gradient).
    live = [(o, g.to(dev)) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
    torch.autograd.backward([o for o, _ in live], [g for _, g in live])
    lo, hi = rank * case.experts_per_rank, (rank + 1) * case.experts_per_rank

    return {
        "out": outs[rank].detach().cpu(), "x": _grad_of(leaves[rank]),
        "w_gate_up": _grad_of(w_gu)[lo:hi], "w_down": _grad_of(w_dn)[lo:hi],
        "router_weight": _grad_of(routers[rank]),
        "shared_gate_up": None if shared is None else _grad_of(shared[rank][0]),
        "shared_down": None if shared is None else _grad_of(shared[rank][1]),
        "live_rows": received_rows(leaves, on["router_weight"], router, on["expert_bias"], rank,
                                   case.experts_per_rank),
    }  # fmt: skip


def compare_results(mine: dict[str, Any], want: dict[str, Any], dtype: torch.dtype, topk: int, *,
                    exact: Sequence[str] = EXACT, rtol: float | None = None) -> dict[str, Any]:
    """The verdict on one rank: {"results": {name: {"equal", "max_abs", "scale", "rel"}}, "exact_ok",
    "tolerant_ok", "worst_rel", "passed"}. Names in ``exact`` must be equal; every other one (``EXACT``
    and ``TOLERANT`` names) within ``rtol`` of the reference's largest value (default:
    ``x_grad_rtol(dtype, topk)``; on a GPU, where the grouped GEMM and the dense matmuls are different
    kernels, the caller passes a looser one and no exact names)."""
    rtol = x_grad_rtol(dtype, topk) if rtol is None else rtol
    results = {}
    for name in (*EXACT, *TOLERANT):
        r = _compare(mine.get(name), want.get(name))
        r["rel"] = r["max_abs"] / r["scale"] if r["scale"] > 0 else r["max_abs"]
        results[name] = r
    exact_ok = all(results[n]["equal"] for n in exact)
    others = [n for n in results if n not in exact]
    tolerant_ok = all(results[n]["rel"] <= rtol for n in others)
    worst = max((results[n]["rel"] for n in others), default=0.0)
    return {"results": results, "exact_ok": exact_ok, "tolerant_ok": tolerant_ok, "worst_rel": worst,
            "rtol": rtol, "passed": exact_ok and tolerant_ok}


def layer_check(runtime: Any, make_buffer: Callable[[EpConfig], Any], device: torch.device, case: MoECase, *,
                exact: Sequence[str] = EXACT, rtol: float | None = None, **layer_kw: Any) -> dict[str, Any]:
    """Forward and backward of the layer of ``case`` on this rank against ``dense_moe`` (collective):
    ``compare_results`` plus "case", "config", "tokens", "live_rows", "padding_rows" (rows of the
    worst-case receive buffer past the live ones: never read) and "grad_scale" (the largest expert
    gradient: a check that the gradients are not trivially zero). ``layer_kw``: more MoELayer options."""
    env = runtime.env
    world, rank = env.world_size, env.rank
    cfg = case.config(world, env.local_world_size)
    x, grad_out = case_inputs(case, rank)
    with make_buffer(cfg) as buf:
        layer = make_layer(buf, case, global_weights(case, world), device, **layer_kw)
        mine = layer_results(layer, x, grad_out)
    everyone = all_gather_objects((x, grad_out), runtime.cpu_group)
    want = dense_results(case, rank, [e[0] for e in everyone], [e[1] for e in everyone], device)
    verdict = compare_results(mine, want, case.dtype, case.topk, exact=exact, rtol=rtol)
    return {
        "case": case.name,
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(case).items()},
        "tokens": x.shape[0],
        "live_rows": want["live_rows"],
        "padding_rows": 0 if case.sync else cfg.capacity - want["live_rows"],
        "grad_scale": verdict["results"]["w_down"]["scale"],
        "digest": digest(mine),
        **verdict,
    }


def digest(results: dict[str, Any]) -> str:
    """sha256 of the bytes of every tensor of ``layer_results`` (name order): equal digests, equal bits."""
    h = hashlib.sha256()
    for name in sorted(results):
        t = results[name]
        if isinstance(t, torch.Tensor):
            h.update(name.encode() + str(t.dtype).encode() + str(list(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def with_case(case: MoECase, **changes: Any) -> MoECase:
    """``case`` with ``changes`` (a dataclasses.replace that tests and scripts read naturally)."""
    return replace(case, **changes)
