"""The reduced combine on real GPUs, checked bit for bit against ``reference_combine_reduced``.

A buffer built with ``combine_algorithm="reduced"``: every dispatch also records each (token, rank)
group; combine sums each group on the expert's rank (kernels/reduce_push.py) and the token's rank sums
the partial rows (kernels/partial_sum.py). Every case runs several calls on one buffer (the combine
signal row carries 2 * epoch - 1 / 2 * epoch, so calls must stay in step), alternates the reduced and
the pull combine on the same handle, poisons the output and the partial rows first (a row nobody wrote
fails), and covers both dispatch modes, all three dispatch primitives, capacity drops, dropped ids,
ragged and zero token counts and decode-sized batches (rows split over warps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cute_ep.buffer import EpBuffer
from cute_ep.capacity import apply_expert_capacity, effective_topk_from_scatter
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    apply_test_expert,
    global_expert_of_rows,
    reference_combine,
    reference_combine_reduced,
)

pytestmark = pytest.mark.gpu


def _gather(runtime, obj):
    out = [None] * runtime.env.world_size
    dist.all_gather_object(out, obj, group=runtime.cpu_group)
    return out


def _combine_into_poison(buf, handle, algorithm):
    """launch_combine into a NaN-filled output, partial rows poisoned too: unwritten rows show."""
    shape = (handle.num_tokens, buf.cfg.hidden)
    out = torch.full(shape, float("nan"), dtype=buf.cfg.dtype, device=buf.device)
    if buf.cfg.combine_algorithm == "reduced":
        buf.partials.fill_(float("nan"))
    buf.launch_combine(handle, out, algorithm)
    buf.check_faults()
    return out.cpu()


@pytest.mark.parametrize(
    "dtype,hidden,topk,el,routing,tokens,mode,algorithm,factor",
    [
        (torch.bfloat16, 7168, 8, 16, "uniform", (64, 48, 56, 40), "scatter", "dedup", 0.0),
        (torch.float32, 128, 4, 2, "skewed", (33, 0, 17, 25), "atomic", "per_pair", 0.0),
        (torch.float16, 384, 3, 3, "dropped", (40, 32, 48, 24), "scatter", "put_warp", 0.5),
        (torch.bfloat16, 256, 6, 4, "uniform", (3, 1, 0, 2), "scatter", "dedup", 0.0),
        (torch.bfloat16, 1024, 8, 8, "skewed", (96, 80, 64, 72), "atomic", "dedup", 0.75),
    ],
    ids=["bf16-h7168-k8", "fp32-atomic-per_pair-zero", "fp16-put_warp-capacity", "bf16-decode",
         "bf16-atomic-cap"],
)
def test_reduced_combine_matches_reference(runtime, dtype, hidden, topk, el, routing, tokens, mode, algorithm,
                                           factor):
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = el * R
    T = tokens[rank % 4]
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=min(topk, E),
                   hidden=hidden, dtype=dtype, max_tokens=max(tokens), num_sms=min(16, runtime.sm_share),
                   capacity_factor=factor, on_overflow="drop", combine_algorithm="reduced")
    dev = runtime.device
    with EpBuffer(runtime, cfg, registry=runtime.registry, algorithm=algorithm) as buf:
        assert buf.partials.shape == (cfg.max_tokens * R, hidden)
        for it in range(3):
            x, idx, w = make_inputs(rank, T, hidden, E, cfg.topk, dtype, runtime.seed + 777 + it,
                                    routing=routing)
            x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
            eff_all, _ = apply_expert_capacity(_gather(runtime, idx.cpu()), E, cfg.expert_capacity)
            buf.poison()
            res = buf.dispatch(x, idx, w, mode=mode)
            buf.dropped_rows()
            scatter = res.handle.scatter.cpu()
            eff = eff_all[rank] if mode == "scatter" else effective_topk_from_scatter(idx.cpu(), scatter)
            experts = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(dev)
            y = buf.expert_output(res.num_recv)
            y.copy_(apply_test_expert(res.recv_x, experts))
            ys = _gather(runtime, y.cpu())
            want_reduced = reference_combine_reduced(ys, [eff], [w.cpu()], [scatter], num_experts=E)[0]
            want_pull = reference_combine(ys, [eff], [w.cpu()], [scatter], num_experts=E)[0]

            out = buf.combine(y, res.handle)  # the buffer's default: reduced
            assert torch.equal(out.cpu(), want_reduced), f"call {it}: reduced combine differs from reference"
            got = _combine_into_poison(buf, res.handle, "pull")
            assert torch.equal(got, want_pull), f"call {it}: pull combine on a reduced buffer differs"
            got = _combine_into_poison(buf, res.handle, "reduced")
            assert torch.equal(got, want_reduced), f"call {it}: second reduced combine (poisoned) differs"
            if dtype == torch.float32:
                torch.testing.assert_close(want_reduced, want_pull, rtol=1e-5, atol=1e-5)


def test_reduced_combine_refuses_what_it_cannot_do(runtime):
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = 4 * R
    dev = runtime.device
    base = dict(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=2, hidden=128,
                dtype=torch.bfloat16, max_tokens=16, num_sms=min(8, runtime.sm_share))
    x, idx, w = make_inputs(rank, 16, 128, E, 2, torch.bfloat16, runtime.seed + 5)
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    with EpBuffer(runtime, EpConfig(**base), registry=runtime.registry) as buf:
        res = buf.dispatch(x, idx, w)
        y = buf.expert_output(res.num_recv)
        y.copy_(res.recv_x)
        with pytest.raises(ValueError, match="needs EpConfig\\(combine_algorithm='reduced'\\)"):
            buf.combine(y, res.handle, algorithm="reduced")
        buf.combine(y, res.handle)  # still in step on every rank
    with EpBuffer(runtime, EpConfig(**base, combine_algorithm="reduced"), registry=runtime.registry) as buf:
        res = buf.dispatch(x, idx, w)
        y = buf.expert_output(res.num_recv)
        y.copy_(res.recv_x)
        from dataclasses import replace

        with pytest.raises(ValueError, match="weights the latest dispatch sent"):
            buf.combine(y, replace(res.handle, topk_weights=res.handle.topk_weights * 2))
        with pytest.raises(ValueError, match="combine algorithm must be one of"):
            buf.combine(y, res.handle, algorithm="push")
        buf.combine(y, res.handle)
