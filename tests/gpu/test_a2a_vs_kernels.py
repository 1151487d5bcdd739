"""The CuTe kernels against the independent all_to_all_single backend (NCCL), bit for bit, in both
receive layouts (expert-major, and the rank layout also against the torch reference).

Two implementations that share nothing but the specification must agree exactly on every rank:
receive rows, weights, source tags, tokens per expert, slots and the combine output (scatter mode),
with the layout folded into the dispatch launch, in a kernel of its own, and mixed across ranks.
"""

from __future__ import annotations

import pytest
import torch

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.buffer import EpBuffer
from cute_ep.collectives import all_gather_objects
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    apply_test_expert,
    global_expert_of_rows,
    reference_dispatch_rank_layout,
    reference_rank_layout,
)

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
# EpConfig.layout_in_dispatch: every rank's layout folded into its dispatch launch (all cases have at most
# 128 tokens), every rank's in a kernel of its own, or each rank its own way (ranks with 128 tokens
# launch the layout kernel, the others fold it; the protocol between ranks is the same).
FOLDS = {"folded": 256, "kernel": 0, "mixed": 100}


def _setup(runtime, case, seed, fold="folded"):
    """The case's config and this rank's inputs (int32 ids) on its GPU."""
    dtype, hidden, topk, el, tokens, routing = case
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = el * R
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=min(topk, E),
                   hidden=hidden, dtype=dtype, max_tokens=max(tokens), num_sms=min(16, runtime.sm_share),
                   layout_in_dispatch=FOLDS[fold])
    x, idx, w = make_inputs(rank, tokens[rank % 4], hidden, E, cfg.topk, dtype, runtime.seed + seed,
                            routing=routing, idx_dtype=torch.int32)
    return cfg, rank, (x.to(runtime.device), idx.to(runtime.device), w.to(runtime.device))


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernels_and_all_to_all_agree_bit_for_bit(runtime, case, fold):
    cfg, rank, (x, idx, w) = _setup(runtime, case, 4242, fold)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as kern, A2aEpBuffer(runtime, cfg) as a2a:
        got, want = _run(kern, rank, x, idx, w), _run(a2a, rank, x, idx, w)
    for name in want:
        assert torch.equal(got[name], want[name]), f"rank {rank}: {name} differs"


def _caller_reduction(res) -> torch.Tensor:
    """What an expert rank hands combine in the rank layout: one row per received row, here the row scaled
    by the sum of its local weights (any deterministic function of the received data would do)."""
    scale = res.recv_topk_weights.sum(dim=1, keepdim=True)
    return (res.recv_x.float() * scale).to(res.recv_x.dtype)


def _run_rank_layout(buf, x, idx, w, sync=True):
    res = buf.dispatch(x, idx, w, layout="rank", sync=sync)
    n = int(res.recv_count.item())
    y = buf.expert_output(n)
    y.copy_(_caller_reduction(res)[:n])
    out = buf.combine(y, res.handle)
    torch.cuda.synchronize()
    return {
        "recv_x": res.recv_x[:n].clone(), "recv_topk_idx": res.recv_topk_idx[:n].clone(),
        "recv_topk_weights": res.recv_topk_weights[:n].clone(), "recv_src": res.recv_src[:n].clone(),
        "tokens_per_expert": res.tokens_per_expert.clone(), "scatter": res.handle.scatter.clone(),
        "out": out, "num_recv": torch.tensor([n]),
    }


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rank_layout_matches_all_to_all_and_reference(runtime, case, fold):
    """The rank layout (one row per (source rank, token) bound for a rank): rows, local ids, weights,
    source tags, tokens per expert, handle rows and the combine output agree exactly with the
    all-to-all backend and the torch reference, synced and sync-free, in both modes, on a poisoned
    buffer (a row the kernels never wrote cannot pass); an expert-layout call right after agrees."""
    cfg, rank, (x, idx, w) = _setup(runtime, case, 4343, fold)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as kern, A2aEpBuffer(runtime, cfg) as a2a:
        kern.poison()
        got, want = _run_rank_layout(kern, x, idx, w), _run_rank_layout(a2a, x, idx, w)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank}: {name} differs"
        kern.poison()  # the sync-free call: worst-case views, the count on the device, the same rows
        free = _run_rank_layout(kern, x, idx, w, sync=False)
        for name in want:
            assert torch.equal(free[name], want[name]), f"rank {rank}: {name} differs without sync"
        kern.poison()  # atomic mode changes nothing in this layout (its order is fixed)
        res = kern.dispatch(x, idx, w, mode="atomic", layout="rank")
        assert torch.equal(res.recv_x, want["recv_x"]) and torch.equal(res.recv_src, want["recv_src"])
        res = kern.dispatch(x, idx, w)  # the expert layout right after: the same tokens per expert
        assert torch.equal(res.tokens_per_expert, want["tokens_per_expert"])
        assert res.num_recv == int(res.tokens_per_expert.sum())

    xs, idxs, ws = zip(*all_gather_objects((x.cpu(), idx.cpu(), w.cpu()), runtime.cpu_group), strict=True)
    expected = reference_dispatch_rank_layout(xs, idxs, ws, reference_rank_layout(idxs, cfg.num_experts),
                                              cfg.max_tokens, rank)
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert"):
        assert torch.equal(got[name].cpu(), getattr(expected, name)), f"rank {rank}: {name} vs reference"
