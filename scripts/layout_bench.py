"""``get_dispatch_layout`` of ``cute_ep.deep_ep`` against DeepEP's on the same ids, timed as DeepEP's own
test times it, and their results compared.

    torchrun --nproc-per-node 2 scripts/layout_bench.py                  # 4096 tokens, top-8 of 256
    torchrun --nproc-per-node 4 scripts/layout_bench.py --tokens 128 --experts 288

Each rank draws DeepEP's test inputs (|randn| + 1 scores, their top-k, about 5% of the pairs set to -1),
builds a ``cute_ep.deep_ep.Buffer`` and, where ``import deep_ep`` works, DeepEP's ``Buffer`` on the same
group, and times each one's ``get_dispatch_layout(topk_idx, E)`` with DeepEP's ``bench`` (its
tests/utils.py: ``--warmup`` calls, the L2 flushed, ``--iters`` calls between CUDA events, the first
dropped, the average). Rank 0 prints every rank's average and minimum, whether the three outputs equal
DeepEP's, and the slowest rank's average per module. Needs CUDA GPUs (one per rank) and NCCL; exit status
0, 1 when the results differ from DeepEP's, 2 for bad arguments or no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096, DeepEP's)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256, help="a multiple of the ranks")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--iters", type=int, default=50, help="timed calls (the first is dropped), >= 2")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("layout_bench.py: needs CUDA GPUs (one per rank) and NCCL; none here", file=sys.stderr)
        return 2
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world or args.topk > args.experts or args.iters < 2 or args.tokens < 0:
        if rank == 0:
            print(f"layout_bench.py: --experts must be a multiple of {world} ranks and >= --topk, --iters "
                  f">= 2, --tokens >= 0; got {args.experts}, {args.topk}, {args.iters}, {args.tokens}",
                  file=sys.stderr)
        dist.destroy_process_group()
        return 2
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import cute_ep.deep_ep as ours
    from cute_ep.tools.bench_peers import import_deep_ep
    from cute_ep.tools.bench_timing import deepep_bench as bench

    theirs, why = import_deep_ep()
    torch.manual_seed(rank)
    scores = torch.randn(args.tokens, args.experts, device="cuda").abs() + 1
    idx = torch.topk(scores, args.topk, dim=-1).indices
    idx[torch.rand(idx.shape, device="cuda") < 0.05] = -1
    group = dist.new_group(list(range(world)))
    times, same = {}, None
    buf = ours.Buffer(group, int(1e9), explicitly_destroy=True)
    got = buf.get_dispatch_layout(idx, args.experts)
    times["cute_ep"] = bench(lambda: buf.get_dispatch_layout(idx, args.experts), args.warmup, args.iters)
    if theirs is not None:
        peer = theirs.Buffer(group, int(1e9), explicitly_destroy=True)
        want = peer.get_dispatch_layout(idx, args.experts)
        same = all(torch.equal(got[i], want[i]) for i in (0, 2, 3))
        times["deep_ep"] = bench(lambda: peer.get_dispatch_layout(idx, args.experts), args.warmup, args.iters)
        peer.destroy()
    buf.destroy()
    rows = [None] * world
    dist.all_gather_object(rows, (rank, times, same))
    if rank == 0:
        print(f"get_dispatch_layout, {world} ranks, {args.tokens} tokens, top-{args.topk} of {args.experts}"
              + ("" if theirs is not None else f" (DeepEP: {why})"))
        for r, t, s in rows:
            line = ", ".join(f"{k} avg {v[0]:.2f} us min {v[1]:.2f} us" for k, v in t.items())
            print(f"rank {r}: {line}" + ("" if s is None else f"; same results as DeepEP: {s}"))
        for k in times:
            print(f"{k}: slowest rank's average {max(t[k][0] for _, t, _ in rows):.2f} us")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any(s is False for _, _, s in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
