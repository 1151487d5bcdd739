"""DeepEP drop-in: an MoE token dispatcher written against DeepEP's API, run on cute-ep or on DeepEP itself.

The dispatcher is shaped like Megatron's flex dispatcher: route each token to its top-k experts, dispatch
(``Buffer.get_dispatch_layout`` + ``Buffer.dispatch``), permute the received rows into one block per local
expert, run a grouped expert MLP, unpermute with the routing weights, and combine (``Buffer.combine``).
With ``--mode low-latency`` it is the decode path instead: ``low_latency_dispatch`` into per-expert padded
rows, the experts on each block, ``low_latency_combine`` with the weights. The only line that names the
library is ``importlib.import_module(args.module)``: ``cute_ep.deep_ep`` (default) or ``deep_ep``.

Every rank then checks its output against a dense single-process torch reference of the same layer (every
rank's tokens, every expert, fp32) and rank 0 prints one line per rank and PASS (exit status 0) or FAIL
(exit status 1).

To run:
    # CPU: cute_ep.deep_ep on the torch reference backend over gloo (a world of one without torchrun)
    python examples/deep_ep_drop_in.py
    torchrun --nproc-per-node 2 examples/deep_ep_drop_in.py --mode low-latency

    # GPUs: cute_ep.deep_ep on the CuTe kernels (an NCCL group), or DeepEP itself, one rank per GPU
    torchrun --nproc-per-node 2 examples/deep_ep_drop_in.py
    torchrun --nproc-per-node 2 examples/deep_ep_drop_in.py --module deep_ep --hidden 2048

DeepEP's low-latency kernels take only some hidden sizes (2048 ... 8192) and need NVSHMEM with IBGDA; on
GPUs the CuTe kernels' buffers grow with the tokens (set CUTE_EP_DEEP_EP_SYMMETRIC_BYTES for large runs).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep.bootstrap import DistEnv
from cute_ep.collectives import all_gather_objects
from cute_ep.kernels.config import MAX_EXPERTS, MAX_TOPK, nearest_valid_experts, nearest_valid_hidden
from cute_ep.tools.cli import Printer, script_main
from cute_ep.tools.usage import UsageError, script_parser

MODES = ("normal", "low-latency")


# --------------------------------------------------------------------------------------------------
# the layer: router, grouped expert MLP (weights of every expert made from the seed on every rank)
# --------------------------------------------------------------------------------------------------


def expert_weights(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """W1 [E, H, F] and W2 [E, F, H] fp32 of every expert (the same on every rank)."""
    g = torch.Generator().manual_seed(args.seed)
    w1 = torch.randn(args.experts, args.hidden, args.ffn, generator=g) / args.hidden**0.5
    w2 = torch.randn(args.experts, args.ffn, args.hidden, generator=g) / args.ffn**0.5
    return w1, w2


def tokens_of(rank: int, args: argparse.Namespace) -> tuple[Tensor, Tensor, Tensor]:
    """Rank ``rank``'s tokens x [T, H] bf16 and their routing: top-k ids [T, K] int64 and softmax weights
    [T, K] fp32 of a random router (a few ids dropped to -1, as a capacity-limited router would)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(args.tokens, args.experts, generator=g)
    weights, idx = logits.softmax(dim=-1).topk(args.topk, dim=-1)
    idx[torch.rand(idx.shape, generator=g) < 0.05] = -1
    return x, idx, weights


def mlp(rows: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """One expert on its rows: silu(rows @ W1) @ W2, in fp32."""
    return torch.nn.functional.silu(rows.float() @ w1) @ w2


class GroupedMLP:
    """This rank's experts, run block by block on rows grouped by local expert."""

    def __init__(self, w1: Tensor, w2: Tensor, first: int, count: int, device: torch.device) -> None:
        self.w1 = w1[first : first + count].to(device)
        self.w2 = w2[first : first + count].to(device)

    def __call__(self, rows: Tensor, tokens_per_expert: list[int]) -> Tensor:
        """rows [sum(tokens_per_expert), H]: local expert e's rows in block e -> [rows, H] fp32."""
        outs = [self.one(e, block) for e, block in enumerate(rows.split(tokens_per_expert))]
        return torch.cat(outs) if outs else rows.float()

    def one(self, e: int, rows: Tensor) -> Tensor:
        """Local expert e on its rows [n, H] -> [n, H] fp32."""
        return mlp(rows, self.w1[e], self.w2[e])


# --------------------------------------------------------------------------------------------------
# the dispatcher, on DeepEP's API only
# --------------------------------------------------------------------------------------------------


class FlexDispatcher:
    """Megatron-style token dispatcher on a DeepEP ``Buffer`` (normal mode).

    dispatch: rows to the ranks of their experts, then one row per (received row, local expert) grouped
    by expert; combine: expert outputs weighted and summed back into one row per received row, then home.
    """

    def __init__(self, buffer: Any, num_experts: int) -> None:
        self.buffer = buffer
        self.num_experts = num_experts

    def dispatch(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> tuple[Tensor, list[int]]:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx,
                                                                                          self.num_experts)
        recv_x, recv_idx, recv_w, tokens_per_expert, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)
        self.handle, self.num_recv = handle, recv_x.shape[0]
        rows, slots = torch.nonzero(recv_idx >= 0, as_tuple=True)
        order = torch.sort(recv_idx[rows, slots], stable=True).indices  # by local expert, then row
        self.rows = rows[order]
        self.weights = recv_w[rows, slots][order]
        return recv_x[self.rows], list(tokens_per_expert)

    def combine(self, expert_out: Tensor) -> Tensor:
        weighted = expert_out.float() * self.weights[:, None]
        per_row = torch.zeros((self.num_recv, expert_out.shape[1]), device=expert_out.device)
        per_row.index_add_(0, self.rows, weighted)
        out, _, _ = self.buffer.combine(per_row.to(torch.bfloat16), self.handle)
        return out


def moe_normal(ep: ModuleType, buffer: Any, experts: GroupedMLP, x: Tensor, idx: Tensor, w: Tensor,
               num_experts: int) -> tuple[Tensor, int]:
    """The layer through FlexDispatcher; returns (output [T, H], rows the experts got)."""
    del ep
    dispatcher = FlexDispatcher(buffer, num_experts)
    rows, tokens_per_expert = dispatcher.dispatch(x, idx, w)
    assert rows.shape[0] == sum(tokens_per_expert), (rows.shape, tokens_per_expert)
    return dispatcher.combine(experts(rows, tokens_per_expert)), rows.shape[0]


def moe_low_latency(ep: ModuleType, buffer: Any, experts: GroupedMLP, x: Tensor, idx: Tensor, w: Tensor,
                    num_experts: int) -> tuple[Tensor, int]:
    """The decode path: padded per-expert rows in, padded expert outputs back, weighted combine."""
    del ep
    m = x.shape[0]  # every rank passes the same num_max_dispatch_tokens_per_rank
    recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(x, idx, m, num_experts, use_fp8=False,
                                                                      return_recv_hook=True)
    hook()  # the rows are complete after the hook
    counts = recv_count.tolist()
    out = torch.zeros_like(recv_x)
    for e, n in enumerate(counts):
        out[e, :n] = experts.one(e, recv_x[e, :n]).to(out.dtype)
    combined, _, _ = buffer.low_latency_combine(out, idx, w, handle)
    return combined, sum(counts)


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


def dense_reference(rank: int, args: argparse.Namespace, w1: Tensor, w2: Tensor) -> Tensor:
    """This rank's output of the same layer in one process, fp32: sum over k of w[t, k] * expert(x[t])."""
    x, idx, w = tokens_of(rank, args)
    out = torch.zeros(x.shape[0], args.hidden)
    for k in range(args.topk):
        for e in idx[:, k].unique().tolist():
            if e < 0:
                continue
            sel = idx[:, k] == e
            out[sel] += w[sel, k : k + 1] * mlp(x[sel], w1[e], w2[e])
    return out


def start_group(env: DistEnv) -> tuple[torch.device, Any]:
    """torch.distributed for this launch: NCCL on GPUs (one per rank), gloo on CPUs; a world of one started
    without a launcher uses an in-process store."""
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kwargs: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size}
    if env.launcher == "single":
        kwargs["store"] = dist.HashStore()
    else:
        kwargs["init_method"] = env.init_method
    dist.init_process_group(backend, **kwargs)
    return device, dist.group.WORLD


def run(args: argparse.Namespace, env: DistEnv, cfg: Any) -> int:
    del cfg
    say = Printer(env.rank)
    ep = importlib.import_module(args.module)
    device, group = start_group(env)
    try:
        world, rank = env.world_size, env.rank
        el = args.experts // world
        w1, w2 = expert_weights(args)
        experts = GroupedMLP(w1, w2, rank * el, el, device)
        x, idx, w = (t.to(device) for t in tokens_of(rank, args))
        low_latency = args.mode == "low-latency"
        if low_latency:
            rdma = ep.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, world, args.experts)
            buffer = ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=el,
                               explicitly_destroy=True)
        else:
            configs = (ep.Buffer.get_dispatch_config(world), ep.Buffer.get_combine_config(world))
            nvl = max(c.get_nvl_buffer_size_hint(args.hidden * 2, world) for c in configs)
            buffer = ep.Buffer(group, max(nvl, 1 << 30), 0, explicitly_destroy=True)
        layer = moe_low_latency if low_latency else moe_normal
        out, rows = layer(ep, buffer, experts, x, idx, w, args.experts)
        want = dense_reference(rank, args, w1, w2)
        got = out.float().cpu()
        diff = (got - want).abs().max().item() if got.numel() else 0.0
        ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=args.rtol, atol=args.atol))
        buffer.destroy()
        ranks = all_gather_objects((args.tokens, rows, diff, ok), group)
    finally:
        dist.destroy_process_group()
    for r, (tokens, n, d, good) in enumerate(ranks):
        say(f"[{args.module}, {args.mode}] rank {r}: {tokens} tokens, {n} rows received by its experts, "
            f"max |out - dense| {d:.3g}" + ("" if good else ", MISMATCH"))
    return say.verdict(all(good for *_, good in ranks))


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--module", default="cute_ep.deep_ep",
                   help="the DeepEP implementation to import: cute_ep.deep_ep, or deep_ep (DeepEP itself)")
    p.add_argument("--mode", choices=MODES, default="normal",
                   help="normal: dispatch / combine (training, prefill); low-latency: the decode calls")
    p.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H")
    p.add_argument("--ffn", type=int, default=64, help="each expert's inner size")
    p.add_argument("--experts", type=int, default=8, help="experts in total, divisible by the ranks")
    p.add_argument("--topk", type=int, default=3, help="experts per token")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of every rank's tokens")
    p.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance against the dense reference")
    p.add_argument("--atol", type=float, default=2e-2, help="absolute tolerance against the dense reference")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of a run-time error")
    return p


def validate_args(args: argparse.Namespace) -> None:
    """UsageError naming the first bad flag and its value (before any rank starts)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.experts < 1 or args.experts % world:
        raise UsageError(f"--experts must be positive and divisible by the world size ({world}), got "
                         f"{args.experts}; {nearest_valid_experts(args.experts, world)}")
    if not 1 <= args.topk <= args.experts:
        raise UsageError(f"--topk must be in [1, --experts={args.experts}], got {args.topk}")
    for flag, value in (("--tokens", args.tokens), ("--ffn", args.ffn)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.hidden < 1 or args.hidden % 8:
        raise UsageError(f"--hidden must be a positive multiple of 8 (rows of bfloat16 move in 16-byte "
                         f"pieces), got {args.hidden}; {nearest_valid_hidden(args.hidden, torch.bfloat16)}")
    # On cute_ep.deep_ep the low-latency mode routes to --experts experts, --topk per token, in EpConfig's
    # limits (the normal mode routes to ranks, without these two)
    if args.module == "cute_ep.deep_ep" and args.mode == "low-latency":
        if args.experts > MAX_EXPERTS:
            raise UsageError(f"--mode low-latency takes --experts <= {MAX_EXPERTS} on cute_ep.deep_ep (the "
                             f"layout kernel's shared memory), got {args.experts}")
        if args.topk > MAX_TOPK:
            raise UsageError(f"--mode low-latency takes --topk <= {MAX_TOPK} on cute_ep.deep_ep (a token's "
                             f"top-k is staged in shared memory), got {args.topk}")
    try:
        importlib.import_module(args.module)
    except ImportError as exc:
        raise UsageError(f"--module {args.module} does not import ({exc})") from None


def main(argv: list[str] | None = None) -> int:
    # script_main: a bad argument is one line `error: ...` and exit status 2 before any rank starts.
    return script_main(argv, build_parser, validate_args, lambda args, env: None, run)


if __name__ == "__main__":
    sys.exit(main())
