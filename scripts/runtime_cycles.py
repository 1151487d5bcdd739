"""Start, use and close a Runtime and a buffer several times in one process, each time with another
configuration: what a program that rebuilds its expert-parallel setup (a new model, a resized group)
does. Every cycle moves fresh random rows and checks them exactly.

    python scripts/runtime_cycles.py --backend reference                      # a world of one, CPU
    torchrun --nproc-per-node 2 scripts/runtime_cycles.py --backend reference  # gloo ranks, CPU
    torchrun --nproc-per-node 4 scripts/runtime_cycles.py                     # GPUs, the kernels

Prints one line per rank and cycle and PASS / FAIL; exit 0 when every cycle of every rank passed, 1 when
one failed, 2 for bad arguments.
"""

from __future__ import annotations

import sys

CONFIGS = (  # (hidden, experts per rank, top-k, dtype name, max tokens): each cycle another module key too
    (256, 4, 2, "bfloat16", 64),
    (512, 2, 1, "float32", 32),
    (128, 8, 4, "bfloat16", 96),
)


def main(argv: list[str] | None = None) -> int:
    from cute_ep.tools.usage import script_parser

    p = script_parser(__doc__)
    p.add_argument("--backend", choices=("cute", "reference"), default="cute",
                   help="the kernels on GPUs, or the torch reference on the CPU (gloo)")
    p.add_argument("--cycles", type=int, default=3, help="start-use-close cycles (configurations repeat)")
    args = p.parse_args(argv)
    if args.cycles < 1:
        p.error(f"--cycles must be >= 1, got {args.cycles}")

    import torch

    from cute_ep import EpBuffer, EpConfig, ReferenceEpBuffer
    from cute_ep.bootstrap import DistEnv, Runtime
    from cute_ep.tools.cli import DTYPES

    env = DistEnv.from_environ()
    ok = True
    for cycle in range(args.cycles):
        hidden, per_rank, topk, dtype, max_tokens = CONFIGS[cycle % len(CONFIGS)]
        cfg = EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                       num_experts=per_rank * env.world_size, topk=topk, hidden=hidden,
                       dtype=DTYPES[dtype], max_tokens=max_tokens)
        backend = "nvshmem" if args.backend == "cute" else "gloo"
        with Runtime(env, symmetric_bytes=cfg.symmetric_bytes(), backend=backend) as rt:
            make = EpBuffer if args.backend == "cute" else ReferenceEpBuffer
            with make(rt, cfg) as buf:
                gen = torch.Generator().manual_seed(1000 * cycle + env.rank)
                tokens = max_tokens - env.rank % 3
                x = torch.randn(tokens, hidden, generator=gen).to(cfg.dtype).to(rt.device)
                idx = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:topk]
                                   for _ in range(tokens)]).to(rt.device)
                w = torch.rand(tokens, topk, generator=gen).to(rt.device)
                res = buf.dispatch(x, idx, w)
                y = buf.expert_output(res.num_recv)
                y.copy_(res.recv_x)  # the identity expert: combine gives sum_k w[t, k] * x[t]
                out = buf.combine(y, res.handle).float()
                want = x.float() * w.sum(-1, keepdim=True)
                err = (out - want).abs().max().item()
                bound = 0.05 if cfg.dtype == torch.bfloat16 else 1e-5  # the combine's rounding of sum_k
                passed = res.num_recv >= 0 and err <= bound * max(1.0, want.abs().max().item())
                sent = torch.tensor([tokens * topk])
                torch.distributed.all_reduce(sent, group=rt.cpu_group)
                got = torch.tensor([res.num_recv])
                torch.distributed.all_reduce(got, group=rt.cpu_group)
                passed = passed and int(got) == int(sent)  # every (token, k) pair arrived somewhere
                print(f"rank {env.rank}: cycle {cycle} H={hidden} E={cfg.num_experts} K={topk} {dtype}: "
                      f"{res.num_recv} rows received, largest error {err:.3g} "
                      f"{'PASS' if passed else 'FAIL'}", flush=True)
                ok = ok and passed
    print(f"rank {env.rank}: {'PASS' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
