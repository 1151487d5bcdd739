"""The CuTe kernels against the independent all_to_all_single backend (NCCL), bit for bit.

Two implementations that share nothing but the specification must agree exactly on every rank:
receive rows, weights, source tags, tokens per expert, slots and the combine output (scatter mode).
Written in a session whose device time was spent: first run is due (docs/gpu-runbook.md).
"""

from __future__ import annotations

import pytest
import torch

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.buffer import EpBuffer
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows

pytestmark = pytest.mark.gpu

# (dtype, hidden, topk, experts per rank, tokens by rank % 4, routing)
CASES = [
    (torch.bfloat16, 7168, 8, 16, (128, 96, 0, 64), "uniform"),
    (torch.float32, 132, 3, 3, (33, 0, 17, 5), "dropped"),
    (torch.float16, 512, 4, 4, (64, 64, 64, 64), "skewed"),
]


def _run(buf, rank, x, idx, w):
    res = buf.dispatch(x, idx, w)
    y = buf.expert_output(res.num_recv)
    experts = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(x.device)
    y.copy_(apply_test_expert(res.recv_x, experts))
    out = buf.combine(y, res.handle)
    torch.cuda.synchronize()
    return {
        "recv_x": res.recv_x.clone(), "recv_w": res.recv_weights.clone(), "recv_src": res.recv_src.clone(),
        "tokens_per_expert": res.tokens_per_expert.clone(), "scatter": res.handle.scatter.clone(), "out": out,
    }


IDS = [f"{str(c[0]).removeprefix('torch.')}-h{c[1]}-k{c[2]}-{c[5]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernels_and_all_to_all_agree_bit_for_bit(runtime, case):
    dtype, hidden, topk, el, tokens, routing = case
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = el * R
    topk = min(topk, E)
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=topk,
                   hidden=hidden, dtype=dtype, max_tokens=max(tokens), num_sms=16)
    x, idx, w = make_inputs(rank, tokens[rank % 4], hidden, E, topk, dtype, 4242, routing=routing,
                            idx_dtype=torch.int32)
    x, idx, w = x.to(runtime.device), idx.to(runtime.device), w.to(runtime.device)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as kern, A2aEpBuffer(runtime, cfg) as a2a:
        got, want = _run(kern, rank, x, idx, w), _run(a2a, rank, x, idx, w)
    for name in want:
        assert torch.equal(got[name], want[name]), f"rank {rank}: {name} differs"
