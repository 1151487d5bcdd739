"""``MoELayer``: a mixture-of-experts layer on any dispatch/combine backend.

    buf = EpBuffer(runtime, cfg)                     # or ReferenceEpBuffer (CPU), A2aEpBuffer
    layer = MoELayer(buf, intermediate=2048, score="sigmoid", num_groups=8, topk_groups=4,
                     shared_intermediate=2048)
    out = layer(x)                                   # x [T, H] cfg.dtype -> [T, H]; collective
    out.sum().backward()                             # collective too

One forward, on every rank (every call is collective):

1. **Router** (replicated): logits = x @ router_weight^T in fp32, scores = softmax or sigmoid; the top-k
   experts by score (plus ``expert_bias`` if set: it changes which experts are picked, never the weights),
   optionally DeepSeek-style group-limited: the experts are split into ``num_groups`` groups, a group
   scores the sum of its best two experts, and only the ``topk_groups`` best groups are eligible. The
   weights are the picked experts' scores, optionally divided by their sum (``normalize``), times
   ``route_scale`` (``route_tokens``).
2. **Dispatch** (``cute_ep.autograd.dispatch``) into the expert-major receive buffer: this rank's local
   experts' rows back to back; ``offs`` = cumsum(tokens_per_expert) in int32 on the device.
3. **Experts** on the received rows: a grouped GEMM with [El, 2I, H] gate/up weights (``offs``
   delimiting the experts), the offset-aware SwiGLU (``cute_ep.swiglu.offset_swiglu``), a grouped GEMM
   with the [El, H, I] down weights. Rows past ``offs[-1]`` (the padding of a worst-case buffer) are
   never computed nor read.
4. **Combine** (``cute_ep.autograd.combine``) with the router weights: out[t] = sum over k of
   w[t, k] * y[slot(t, k)] in fp32, rounded once; plus the **shared expert** (a SwiGLU MLP of every
   token, replicated) when ``shared_intermediate`` > 0.

Under ``torch.no_grad()`` / ``torch.inference_mode()`` steps 2 and 4 are the buffer's own ``dispatch``
and ``combine`` (the pull combine), the experts reading the received rows in the buffer: the same
results, without the copy of the received rows autograd keeps (after a sync-free dispatch, the whole
worst-case buffer). There, after a sync-free dispatch, the grouped GEMMs run over the rows this rank can
receive this step (``receive_bound``: the ranks' token counts times K, summed on the host) instead of
the worst-case buffer, and write combine's input in place.

The backward (``loss.backward()``, collective) runs through ``cute_ep.autograd``: gradients reach x, the
router weight and the local expert weights (and the shared expert). Replicated parameters (router,
shared expert, ``expert_bias``) get this rank's part of their gradient: average or sum them over the
ranks as data parallelism does; the expert weights' gradients are complete on their owner.

**No host sync** (``sync=False``, the default): every dispatch returns the worst-case views
(``cfg.capacity`` rows) with exact per-expert counts on the device, the grouped GEMMs take ``offs`` on
the device and the SwiGLU reads it there, so on the GPU buffer (``EpBuffer``, bf16) neither the forward
nor the backward waits for the host (torch's ``set_sync_debug_mode("error")`` passes) and the whole step
captures in a CUDA graph. ``sync=True`` reads the received count instead (views of the real rows; one
host sync per dispatch). ``A2aEpBuffer`` syncs in every dispatch whatever ``sync`` says.

**Streams** (``EpBuffer`` only): ``comm_stream`` runs dispatch and combine (forward and backward) on
their own stream, within the buffer's ``cfg.num_sms`` SMs; with ``overlap=True`` the shared expert runs
on the compute stream while the dispatch moves the rows. ``green_context=True`` confines the layer's
compute (router, GEMMs, SwiGLU, shared expert) to a CUDA green context of ``SMs - num_sms`` SMs
(rounded down to the granularity of 8 SMs), so cuBLAS's GEMMs cannot take the SMs the communication
kernels need (torch's ``torch.cuda.green_contexts``; refused with the reason where torch lacks it).

Grouped GEMMs: ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``): on the CPU any float dtype;
on CUDA torch's fast path takes bf16 on sm_90+ without a host sync, other dtypes go through a fallback
that reads ``offs`` on the host.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cute_ep import autograd as ep
from cute_ep.input_checks import check_tensor_args
from cute_ep.streams import join
from cute_ep.swiglu import IMPLS, offset_swiglu, resolve_impl, swiglu_plain

__all__ = ["SCORES", "GreenContextError", "MoELayer", "RouterConfig", "grouped_mm", "receive_bound",
           "route_tokens"]

SCORES = ("softmax", "sigmoid")
"""Router score functions."""
GREEN_CONTEXT_SM_GRANULARITY = 8  # SMs of a green context come in groups of 8 on sm_90


class GreenContextError(RuntimeError):
    """A green context was asked for where torch or the device cannot make one (the message says why)."""


# --------------------------------------------------------------------------------------------------
# router
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterConfig:
    """How tokens pick experts (``route_tokens``); violations raise ``ValueError`` naming the value.

    num_experts: E. topk: K experts per token (1 <= K <= E). score: "softmax" or "sigmoid".
    num_groups: expert groups for group-limited routing (1: none; divides E). topk_groups: groups a
    token may use (1 <= topk_groups <= num_groups; K <= topk_groups * E / num_groups). normalize: divide
    the K weights by their sum. scale: multiply the weights by it (finite, > 0).
    """

    num_experts: int
    topk: int
    score: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        e, k, g = self.num_experts, self.topk, self.num_groups
        if e < 1 or not 1 <= k <= e:
            raise ValueError(f"router: need 1 <= topk <= num_experts, got topk={k}, num_experts={e}")
        if self.score not in SCORES:
            raise ValueError(f"router: score must be one of {SCORES}, got {self.score!r}")
        if g < 1 or e % g:
            raise ValueError(f"router: num_groups must be >= 1 and divide num_experts={e}, got {g}")
        if g > 1:
            if not 1 <= self.topk_groups <= g:
                raise ValueError(
                    f"router: topk_groups must be in [1, num_groups={g}], got {self.topk_groups}"
                )
            if k > self.topk_groups * (e // g):
                raise ValueError(
                    f"router: topk={k} experts cannot come from topk_groups={self.topk_groups} groups of "
                    f"{e // g} experts"
                )
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"router: scale must be finite and > 0, got {self.scale}")


def route_tokens(x: Tensor, weight: Tensor, cfg: RouterConfig,
                 bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(topk_weights [T, K] fp32, differentiable in x and weight; topk_idx [T, K] int64) for x [T, H].

    weight [E, H]: the router's matrix (used in fp32). bias [E] (optional): added to the scores only to
    pick the experts (load balancing without an auxiliary loss); the weights are the scores themselves.
    Group-limited routing (``cfg.num_groups`` > 1): a group's score is the sum of its two best (biased)
    scores (its one expert's with groups of one), the ``cfg.topk_groups`` best groups stay eligible.
    """
    c = cfg
    logits = F.linear(x.float(), weight.float())
    scores = logits.softmax(dim=-1) if c.score == "softmax" else logits.sigmoid()
    choice = scores.detach()
    if bias is not None:
        choice = choice + bias.detach().float()
    if c.num_groups > 1:
        per_group = c.num_experts // c.num_groups
        grouped = choice.view(-1, c.num_groups, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        keep = group_score.topk(c.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        # expand + reshape, not repeat_interleave: no host round trip on a GPU.
        eligible = allowed[:, :, None].expand(-1, -1, per_group).reshape(choice.shape)
        choice = choice.masked_fill(~eligible, float("-inf"))
    idx = choice.topk(c.topk, dim=-1).indices
    w = scores.gather(1, idx)
    if c.normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if c.scale != 1.0:
        w = w * c.scale
    return w, idx


# --------------------------------------------------------------------------------------------------
# grouped GEMM
# --------------------------------------------------------------------------------------------------


def _grouped_mm_fn() -> Callable[..., Tensor]:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError(
            f"MoELayer needs torch.nn.functional.grouped_mm or torch._grouped_mm (torch {torch.__version__} "
            "has neither)"
        )
    return fn


def grouped_mm(rows: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """out[r] = rows[r] @ weight[e]^T for the rows r of expert e (rows [N, in], weight [El, out, in],
    offs [El] int32 inclusive ends): [N, out], rows past offs[-1] not computed (never read them).
    Differentiable in rows and weight."""
    return _grouped_mm_fn()(rows, weight.transpose(-2, -1), offs=offs)


# --------------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------------


def receive_bound(tokens: int, topk: int, capacity: int, group: Any = None) -> int:
    """The most rows a rank can receive in the expert layout when this rank dispatches ``tokens`` tokens
    and the other ranks of ``group`` (a CPU group; None or a world of one: this rank alone) theirs: each
    token sends at most ``topk`` rows to a rank, and no rank receives more than ``capacity``. Collective
    on ``group`` (one all-reduce of the counts on the host)."""
    total = torch.tensor([tokens], dtype=torch.int64)
    dist = torch.distributed
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return min(int(total[0]) * topk, capacity)


def _takes_stream(buf: Any) -> bool:
    """Whether the buffer's dispatch takes ``stream=`` (the GPU ``EpBuffer`` does)."""
    try:
        return "stream" in inspect.signature(buf.dispatch).parameters
    except (TypeError, ValueError):
        return False


def make_green_context(num_sms: int, device: torch.device) -> tuple[Any, Any]:
    """(green context, its stream) with every SM of ``device`` but ``num_sms``, rounded down to the
    granularity (``GREEN_CONTEXT_SM_GRANULARITY``). Raises GreenContextError with the reason."""
    module = getattr(torch.cuda, "green_contexts", None)
    if module is None or not getattr(module, "SUPPORTED", False):
        raise GreenContextError(
            f"green_context=True needs torch.cuda.green_contexts with green context support; torch "
            f"{torch.__version__} has none"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    gemm_sms = (total - num_sms) // GREEN_CONTEXT_SM_GRANULARITY * GREEN_CONTEXT_SM_GRANULARITY
    if gemm_sms < GREEN_CONTEXT_SM_GRANULARITY:
        raise GreenContextError(
            f"green_context=True: {total} SMs minus num_sms={num_sms} leaves {total - num_sms} for the "
            f"GEMMs, fewer than one group of {GREEN_CONTEXT_SM_GRANULARITY}"
        )
    try:
        ctx = module.GreenContext.create(num_sms=gemm_sms, device_id=index)
        return ctx, ctx.Stream()
    except Exception as exc:  # driver or build without the feature: say so instead of a bare error
        raise GreenContextError(f"green_context=True: could not make one of {gemm_sms} SMs: {exc}") from exc


class MoELayer(nn.Module):
    """A mixture-of-experts layer over a dispatch/combine buffer (see the module docstring).

    Args:
        buffer: an ``EpBackend`` (``EpBuffer``, ``ReferenceEpBuffer``, ``A2aEpBuffer``): its ``cfg`` gives
            H (hidden), E (num_experts), K (topk), the dtype and the world; this rank owns the experts
            [rank * E/R, (rank + 1) * E/R).
        intermediate: I, the experts' hidden width (a multiple of 8; the SwiGLU kernel wants I * element
            size % 16 == 0).
        score, num_groups, topk_groups, normalize, route_scale: the router (``RouterConfig``).
        expert_bias: keep an [E] fp32 buffer ``expert_bias`` added to the scores to pick the experts.
        shared_intermediate: width of the shared expert (0: none).
        swiglu: "auto", "kernel", "torch" or "plain" (``cute_ep.swiglu``; "plain" computes the padding).
        sync: dispatch with ``sync=True`` (one host sync per dispatch, views of the real rows).
        comm_stream: run dispatch and combine there (``EpBuffer`` only).
        overlap: run the shared expert while the dispatch moves rows (needs a comm stream; one is made,
            at high priority, when none is given).
        num_sms: SMs the communication may use; must equal the buffer's ``cfg.num_sms`` (the EP kernels
            launch that many CTAs); default: it. The green context gets the device's SMs minus these.
        green_context: confine the compute to ``SMs - num_sms`` SMs (``make_green_context``).
        init_std: the parameters' initial normal standard deviation; generator: their random generator.
        device: where the parameters live (default: the buffer's device).
    """

    def __init__(self, buffer: Any, intermediate: int, *, score: str = "softmax", num_groups: int = 1,
                 topk_groups: int = 1, normalize: bool = False, route_scale: float = 1.0,
                 expert_bias: bool = False, shared_intermediate: int = 0, swiglu: str = "auto",
                 sync: bool = False, comm_stream: Any = None, overlap: bool = False,
                 num_sms: int | None = None, green_context: bool = False, init_std: float = 0.02,
                 generator: torch.Generator | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        cfg = buffer.cfg
        self.buffer = buffer
        self.cfg = cfg
        self.rank = int(buffer.rank)
        self.router_config = RouterConfig(cfg.num_experts, cfg.topk, score, num_groups, topk_groups,
                                          normalize, route_scale)
        if intermediate < 1 or intermediate % 8:
            raise ValueError(f"intermediate must be a positive multiple of 8, got {intermediate}")
        if shared_intermediate < 0 or shared_intermediate % 8:
            raise ValueError(
                f"shared_intermediate must be 0 or a positive multiple of 8, got {shared_intermediate}"
            )
        if cfg.hidden % 8:
            raise ValueError(f"MoELayer needs hidden % 8 == 0 (grouped GEMM strides), got {cfg.hidden}")
        if swiglu not in IMPLS:
            raise ValueError(f"swiglu must be one of {IMPLS}, got {swiglu!r}")
        if not (math.isfinite(init_std) and init_std > 0):
            raise ValueError(f"init_std must be finite and > 0, got {init_std}")
        self.intermediate = intermediate
        self.shared_intermediate = shared_intermediate
        self.swiglu = swiglu
        self.sync = bool(sync)
        self.overlap = bool(overlap)
        if device is None:
            device = getattr(buffer, "device", None) or "cpu"
        device = torch.device(device)

        self.num_sms = self._resolve_num_sms(num_sms)
        streams = _takes_stream(buffer)
        wants_stream = comm_stream is not None or overlap or green_context
        if wants_stream and not streams:
            raise ValueError(
                "comm_stream / overlap / green_context need a buffer whose dispatch takes stream= "
                f"(EpBuffer); {type(buffer).__name__} has none"
            )
        if wants_stream and comm_stream is None:
            comm_stream = torch.cuda.Stream(device=device, priority=-1)  # takes SMs as GEMM CTAs retire
        self.comm_stream = comm_stream
        self._green: Any = None
        self.gemm_stream: Any = None
        if green_context:
            self._green, self.gemm_stream = make_green_context(self.num_sms, device)

        e, el, h, dt = cfg.num_experts, cfg.experts_per_rank, cfg.hidden, cfg.dtype
        make = dict(device=device)
        self.router_weight = nn.Parameter(torch.empty(e, h, dtype=torch.float32, **make))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, **make))
        else:
            self.expert_bias = None
        self.w_gate_up = nn.Parameter(torch.empty(el, 2 * intermediate, h, dtype=dt, **make))
        self.w_down = nn.Parameter(torch.empty(el, h, intermediate, dtype=dt, **make))
        if shared_intermediate:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * shared_intermediate, h, dtype=dt, **make))
            self.shared_down = nn.Parameter(torch.empty(h, shared_intermediate, dtype=dt, **make))
        else:
            self.shared_gate_up = self.shared_down = None
        self.reset_parameters(init_std, generator)
        self._prepare_first_step(device)

    # -- set-up ----------------------------------------------------------------------------------

    def _prepare_first_step(self, device: torch.device) -> None:
        """Before any step: compile (or load) the SwiGLU kernels, put them on the GPU, run the layer's local
        work (router, experts, shared expert) forward and backward once on two dummy rows, wait for it, then
        meet the other ranks.

        Why: a rank's first step should not wait on the host for the GPU, because the peers' dispatch and
        combine kernels may already be waiting for this rank's. Made on first use, the SwiGLU kernels were
        compiled inside the first step: with 8 ranks compiling at once on one GPU's host the peers' combine
        timed out (``PeerTimeout: combine on rank 2: rank 6 did not signal within 60 s``; 8 ranks on one
        H200, 2026-11-26). Compiled ahead, the DSL still put them on the GPU at their first launch, and
        under CUDA MPS the backward's library load waited there until the peers' combine timed out (its
        stack, 8 ranks on one H100, 2026-11-27). The local step loads the other kernels of the step the
        same way (the first forward's host time at 8 ranks on one H100: 0.45 s -> 0.01 s), and its
        backward is given an output gradient as a step's is, so torch imports its symbolic-shape module
        (sympy) here: inside the first step's backward that import took 3.7-3.8 s of host time with 8
        ranks on one host, and 11.8 s on one of them. The host barrier after it (as long as the group's
        timeout allows) starts every rank's first step together."""
        on_gpu = device.type == "cuda"
        kernel = resolve_impl(self.swiglu, device) == "kernel"
        if kernel:
            from cute_ep.swiglu import kernels

            kernels().load(self.cfg.dtype, device)
        if on_gpu:
            with torch.cuda.stream(self.gemm_stream or torch.cuda.current_stream(device)):
                self._local_step(device)
            torch.cuda.synchronize(device)
        group = getattr(getattr(self.buffer, "runtime", None), "cpu_group", None)
        if (on_gpu or kernel) and group is not None and torch.distributed.is_initialized():
            torch.distributed.barrier(group=group)

    def _local_step(self, device: torch.device) -> None:
        """Forward and backward of the layer's local work on two dummy rows (one row for each of the first
        two local experts); gradients are computed and dropped (``.grad`` stays untouched)."""
        el, dt = self.cfg.experts_per_rank, self.cfg.dtype
        x = torch.zeros(2, self.cfg.hidden, dtype=dt, device=device, requires_grad=True)
        topk_w, _ = self.route(x)
        offs = torch.full((el,), 2, dtype=torch.int32, device=device)
        offs[0] = 1
        total = topk_w.sum(1) + self.experts(x, offs).float().sum(1)
        if self.shared_gate_up is not None:
            total = total + self.shared_expert(x).float().sum(1)
        params = [p for p in self.parameters() if p.requires_grad]
        # An explicit output gradient, as a step's backward(grad) passes (the sympy import: docstring above).
        torch.autograd.grad(total, [x, *params], grad_outputs=torch.ones_like(total), allow_unused=True)

    def _resolve_num_sms(self, num_sms: int | None) -> int:
        have = getattr(self.cfg, "num_sms", None)
        if num_sms is None:
            return int(have)
        if num_sms < 1 or num_sms != have:
            raise ValueError(
                f"num_sms must equal the buffer's cfg.num_sms={have} (its kernels launch that many CTAs), "
                f"got {num_sms}"
            )
        return int(num_sms)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Every parameter from N(0, std^2) (``generator``: on the parameters' device, or a CPU one whose
        values are drawn one leading slice at a time and copied over); ``expert_bias`` to zeros."""
        for p in self.parameters():
            if generator is None or generator.device == p.device:
                p.normal_(0.0, std, generator=generator)
                continue
            for part in p.view(p.shape[0], -1):  # slice by slice: a CPU copy of all experts may not fit
                part.copy_(torch.randn(part.shape, generator=generator).mul_(std))
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts."""
        el = self.cfg.experts_per_rank
        return range(self.rank * el, (self.rank + 1) * el)

    @torch.no_grad()
    def load_global_weights(self, router_weight: Tensor, w_gate_up: Tensor, w_down: Tensor,
                            shared_gate_up: Tensor | None = None, shared_down: Tensor | None = None,
                            expert_bias: Tensor | None = None) -> None:
        """Copy the weights of the whole layer in: router [E, H], w_gate_up [E, 2I, H] and w_down
        [E, H, I] of every expert (this rank keeps ``local_experts``), the shared expert's [2Is, H] and
        [H, Is], the bias [E]. Shapes are checked against the layer's."""
        lo, hi = self.local_experts.start, self.local_experts.stop
        pairs = [(self.router_weight, router_weight, "router_weight"),
                 (self.w_gate_up, w_gate_up[lo:hi], "w_gate_up"), (self.w_down, w_down[lo:hi], "w_down")]
        for mine, given, name in ((self.shared_gate_up, shared_gate_up, "shared_gate_up"),
                                  (self.shared_down, shared_down, "shared_down"),
                                  (self.expert_bias, expert_bias, "expert_bias")):
            if (mine is None) != (given is None):
                raise ValueError(f"{name}: the layer has {'none' if mine is None else 'one'}, got "
                                 f"{'none' if given is None else list(given.shape)}")
            if mine is not None:
                pairs.append((mine, given, name))
        for mine, given, name in pairs:
            if tuple(given.shape) != tuple(mine.shape):
                raise ValueError(
                    f"{name} must be {list(mine.shape)} (this rank's part), got {list(given.shape)}"
                )
            mine.copy_(given)

    # -- forward ---------------------------------------------------------------------------------

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(topk_weights [T, K] fp32, topk_idx [T, K] int64) of x [T, H] (``route_tokens``)."""
        return route_tokens(x, self.router_weight, self.router_config, self.expert_bias)

    def shared_expert(self, x: Tensor) -> Tensor:
        """The shared expert's SwiGLU MLP of every token x [T, H]: [T, H] (requires one)."""
        if self.shared_gate_up is None:
            raise ValueError("this MoELayer has no shared expert (shared_intermediate=0)")
        return F.linear(swiglu_plain(F.linear(x, self.shared_gate_up)), self.shared_down)

    def experts(self, recv_x: Tensor, offs: Tensor) -> Tensor:
        """The local experts on the received rows recv_x [N, H] (offs [El] int32): [N, H]; rows past
        offs[-1] are neither computed nor read."""
        gate_up = grouped_mm(recv_x, self.w_gate_up, offs)
        act = offset_swiglu(gate_up, offs, impl=self._swiglu_impl(gate_up.device))
        return grouped_mm(act, self.w_down, offs)

    def _swiglu_impl(self, device: torch.device) -> str:
        return resolve_impl(self.swiglu, device)

    def _check_input(self, x: Tensor) -> None:
        c = self.cfg
        device = self.router_weight.device
        if not isinstance(x, Tensor):
            check_tensor_args(device, ("x", x, f"[T, {c.hidden}] {c.dtype}", c.dtype))
        if x.dim() != 2 or x.shape[1] != c.hidden or x.dtype != c.dtype:
            raise ValueError(f"x must be [T, {c.hidden}] {c.dtype}, got {list(x.shape)} {x.dtype}")
        if x.shape[0] > c.max_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, more than the buffer's max_tokens={c.max_tokens}")
        if x.device != device:
            raise ValueError(
                f"x must be on the layer's device {device}, got {x.device}: pass x.to({str(device)!r})"
            )

    def forward(self, x: Tensor) -> Tensor:
        """out [T, H] cfg.dtype for x [T, H] cfg.dtype (T <= cfg.max_tokens). Collective."""
        self._check_input(x)
        if self.gemm_stream is None:
            return self._forward(x)
        caller = torch.cuda.current_stream(x.device)
        self.gemm_stream.wait_stream(caller)
        x.record_stream(self.gemm_stream)
        with torch.cuda.stream(self.gemm_stream):
            out = self._forward(x)
        caller.wait_stream(self.gemm_stream)
        out.record_stream(caller)
        return out

    def _forward(self, x: Tensor) -> Tensor:
        topk_w, topk_idx = self.route(x)
        idx = topk_idx.to(torch.int32)
        comm = {} if self.comm_stream is None else {"stream": self.comm_stream}
        shared = None
        dispatch_kw = dict(comm)
        if self.overlap and self.shared_gate_up is not None:
            # The dispatch waits only for the router (this event), so the shared expert enqueued next
            # on the compute stream runs while the rows move.
            routed = torch.cuda.Event()
            routed.record()
            dispatch_kw["previous_event"] = routed
            shared = self.shared_expert(x)
        if torch.is_grad_enabled():
            res = ep.dispatch(self.buffer, x, idx, topk_w.detach(), sync=self.sync, **dispatch_kw)
            offs = torch.cumsum(res.tokens_per_expert, 0, dtype=torch.int32)  # before the next dispatch
            y = self.experts(res.recv_x, offs)
            out = ep.combine(self.buffer, y, topk_w, res.handle, sync=self.sync, **comm)
        else:
            out = self._infer(x, idx, topk_w, dispatch_kw, comm)
        if self.shared_gate_up is not None:
            out = out + (self.shared_expert(x) if shared is None else shared)
        return out

    def _infer(self, x: Tensor, idx: Tensor, topk_w: Tensor, dispatch_kw: dict, comm: dict) -> Tensor:
        """The routed experts without autograd (``torch.no_grad`` / ``inference_mode``): the buffer's own
        calls on its receive rows. Why not ``cute_ep.autograd``: its dispatch copies the received rows out
        of the buffer for the graph to keep, and after a sync-free dispatch those are the worst case
        (``cfg.capacity`` rows: 1.9 GB for DeepSeek-V3 shapes at 4 ranks and max_tokens 4096); the experts
        here read the rows before the next dispatch can overwrite them. The same results: the pull
        combine with the router weights, as ``cute_ep.autograd.combine`` runs it."""
        buf = self.buffer
        bound = self._receive_bound(x)
        res = buf.dispatch(x, idx, topk_w, sync=self.sync, **dispatch_kw)
        join(event=getattr(res, "event", None), device=x.device)  # the rows are written on the comm stream
        offs = torch.cumsum(res.tokens_per_expert, 0, dtype=torch.int32)
        rows = res.recv_x.shape[0]
        if bound is None or not 0 < bound < rows or buf.recv_y.shape[0] < rows:
            y = self.experts(res.recv_x, offs)
        else:
            # The GEMMs over the rows this rank can receive, not the worst-case buffer: torch picks its
            # grouped GEMM's tiles by rows per expert of the whole input (64x128 up to 128 rows per
            # expert, 128x256 above), and over the worst case (DeepSeek-V3 shapes, max_tokens 4096, 2
            # ranks: 512 rows per expert) a 128-token forward's two GEMMs took 3819 us instead of 3615
            # (2x H200). Written into the buffer combine reads, so combine stages nothing.
            y = buf.recv_y[:rows]
            y[:bound].copy_(self.experts(res.recv_x[:bound], offs))
        handle = replace(res.handle, topk_weights=topk_w.float().contiguous())
        out = buf.combine(y, handle, algorithm="pull", **comm)
        join(comm.get("stream"))  # the caller's stream waits for the combine on the comm stream
        return out

    def _receive_bound(self, x: Tensor) -> int | None:
        """Before a sync-free dispatch into a buffer whose ``recv_y`` combine reads in place: the most rows
        this rank can receive this step (``receive_bound``: one host all-reduce of the ranks' token
        counts, no GPU sync). None otherwise; the choice depends only on the layer and the buffer's
        class, so every rank makes the same one."""
        if self.sync or not isinstance(getattr(self.buffer, "recv_y", None), Tensor):
            return None
        group = getattr(getattr(self.buffer, "runtime", None), "cpu_group", None)
        if group is None and self.cfg.world_size > 1:
            return None  # the other ranks' counts cannot be summed here
        return receive_bound(x.shape[0], self.cfg.topk, self.cfg.capacity, group)

    def extra_repr(self) -> str:
        c, r = self.cfg, self.router_config
        parts = [f"hidden={c.hidden}", f"intermediate={self.intermediate}", f"experts={c.num_experts}",
                 f"local={c.experts_per_rank}", f"topk={c.topk}", f"score={r.score}"]
        if r.num_groups > 1:
            parts.append(f"groups={r.num_groups}/{r.topk_groups}")
        if self.shared_intermediate:
            parts.append(f"shared={self.shared_intermediate}")
        parts += [f"swiglu={self.swiglu}", f"sync={self.sync}", f"overlap={self.overlap}",
                  f"green_context={self.gemm_stream is not None}"]
        return ", ".join(parts)
