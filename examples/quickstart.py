"""Quickstart: one expert-parallel dispatch -> toy expert -> combine, checked against the torch reference.

Every rank routes its tokens to K of E experts (E / world_size on each rank), applies a toy expert to
the rows it receives (row * (global expert id + 1)), and combine returns each token's weighted sum to
its rank, which must equal the pure-torch reference (cute_ep.reference) bit for bit.

To run:
    # GPUs: the CuTe DSL kernels on NVSHMEM (EpBuffer), one rank per GPU
    torchrun --nproc-per-node 2 examples/quickstart.py

    # CPU only: the pure-torch reference backend over gloo (also a world of one, without torchrun)
    torchrun --nproc-per-node 2 examples/quickstart.py --backend reference
    python examples/quickstart.py --backend reference

    # the all_to_all_single fallback (NCCL on GPUs, gloo on CPUs)
    torchrun --nproc-per-node 2 examples/quickstart.py --backend a2a

Rank 0 prints one line per rank, then PASS (exit status 0) or FAIL (exit status 1). A bad argument, a
configuration EpConfig refuses or the GPU backend on a machine without CUDA stops the run before it
starts, with one line ``error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor

import cute_ep.reference as ref
from cute_ep import EpConfig
from cute_ep.bootstrap import DistEnv, Runtime
from cute_ep.collectives import all_gather_objects, world_of
from cute_ep.tools.cli import BACKENDS, DTYPES, Printer, make_buffer, runtime_backend, script_main
from cute_ep.tools.usage import script_parser


def make_inputs(rank: int, args: argparse.Namespace, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Random tokens x [T, H], top-k expert ids [T, K] (distinct per token) and fp32 weights [T, K]."""
    g = torch.Generator().manual_seed(1000 * args.seed + rank)  # CPU generator: same inputs on any device
    x = torch.randn(args.tokens, args.hidden, generator=g).to(DTYPES[args.dtype])
    idx = torch.rand(args.tokens, args.experts, generator=g).topk(args.topk, dim=1).indices
    w = torch.rand(args.tokens, args.topk, generator=g)
    return x.to(device), idx.to(device), w.to(device)


def round_trip(buf: Any, x: Tensor, idx: Tensor, w: Tensor, rank: int) -> tuple[Tensor, int]:
    """dispatch -> toy expert -> combine on any backend's buffer; returns (output [T, H], rows received)."""
    res = buf.dispatch(x, idx, w)
    # Received rows are expert-major: tokens_per_expert[l] rows for each local expert l in turn.
    experts = ref.global_expert_of_rows(res.tokens_per_expert, rank)
    y = buf.expert_output(res.num_recv)  # write into the buffer combine reads: saves a copy
    y.copy_(ref.apply_test_expert(res.recv_x, experts))
    return buf.combine(y, res.handle), res.num_recv


def check(out: Tensor, x: Tensor, idx: Tensor, w: Tensor, num_experts: int, group: Any) -> tuple[bool, float]:
    """Collective: (out is bit-identical to the reference, max |out - reference|) for this rank."""
    rank, _ = world_of(group)  # (0, 1) without a process group
    xs, idxs, ws = zip(*all_gather_objects((x.cpu(), idx.cpu(), w.cpu()), group), strict=True)
    layout = ref.reference_layout(idxs, num_experts)
    max_tokens = max(1, *(t.shape[0] for t in xs))  # only sizes the source tags, unused here
    recv_y = ref.reference_expert_outputs(ref.reference_dispatch(xs, idxs, ws, layout, max_tokens), layout)
    want = ref.reference_combine(recv_y, [idxs[rank]], [ws[rank]], [layout.scatter[rank]],
                                 num_experts=num_experts)[0]
    got = out.detach().cpu().contiguous()
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, float("inf")
    # Compare raw bits: on floats torch.equal calls NaN != NaN and -0.0 == 0.0.
    same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    return same, diff


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--backend", choices=BACKENDS, default="cute",
                   help="cute: the CuTe kernels, one GPU per rank; reference: the torch reference on the CPU "
                        "(gloo); a2a: all_to_all_single (NCCL on GPUs, gloo on CPUs)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (T, also max_tokens)")
    p.add_argument("--hidden", type=int, default=256, help="elements per token row (H)")
    p.add_argument("--experts", type=int, default=16, help="experts in total (E), divisible by the ranks")
    p.add_argument("--topk", type=int, default=4, help="experts per token (K)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="element type of the token rows and of the combine output")
    p.add_argument("--seed", type=int, default=0,
                   help="input seed: rank r's tokens, experts and weights come from seed 1000 * SEED + r")
    p.add_argument("--traceback", action="store_true", help="print the full traceback of a run-time error")
    return p


FLAGS = {"max_tokens": "--tokens", "hidden": "--hidden", "num_experts": "--experts", "topk": "--topk",
         "dtype": "--dtype", "world_size": "the world size"}
"""The flag of each EpConfig field this example sets: a configuration error names the flag."""


def make_config(args: argparse.Namespace, env: DistEnv) -> EpConfig:
    """The configuration every rank builds alike (EpConfig raises ConfigError naming a bad value, which
    ``main`` reports under the flag that set it: ``FLAGS``)."""
    return EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                    num_experts=args.experts, topk=args.topk, hidden=args.hidden, dtype=DTYPES[args.dtype],
                    max_tokens=args.tokens)


def run(args: argparse.Namespace, env: DistEnv, cfg: EpConfig) -> int:
    """The round trip on every rank, the check, and rank 0's report; returns the exit status."""
    say = Printer(env.rank)
    with Runtime(env, backend=runtime_backend(args.backend), symmetric_bytes=cfg.symmetric_bytes()) as rt:
        with make_buffer(args.backend, rt, cfg) as buf:
            x, idx, w = make_inputs(env.rank, args, rt.device)
            out, num_recv = round_trip(buf, x, idx, w, env.rank)
        ok, diff = check(out, x, idx, w, cfg.num_experts, rt.cpu_group)
        ranks = all_gather_objects((args.tokens, num_recv, diff, ok), rt.cpu_group)
    for r, (tokens, rows, d, good) in enumerate(ranks):
        say(f"[{args.backend}] rank {r}: {tokens} tokens, {rows} rows received, max |out - ref| {d:.3g}"
            + ("" if good else ", MISMATCH"))
    passed = all(good for *_, good in ranks)  # the same verdict on every rank
    return say.verdict(passed)


def main(argv: list[str] | None = None) -> int:
    # script_main: a bad argument or configuration, or the GPU backend without CUDA, is one line
    # `error: ...` and exit status 2 before any rank starts; run-time errors exit 1.
    return script_main(argv, build_parser, lambda args: None, make_config, run, flags=FLAGS)


if __name__ == "__main__":
    raise SystemExit(main())
