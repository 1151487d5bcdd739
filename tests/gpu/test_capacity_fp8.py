"""Capacity drops and FP8 dispatch on real GPUs, checked exactly against the torch references.

Capacity: with ``capacity_factor`` > 0 each expert keeps its first ``cfg.expert_capacity`` rows
(sources in rank order, each source's pairs in (t, k) order) and drops the rest. The kernels must
match the references evaluated on the "effective" routing (dropped pairs as -1) bit for bit in
scatter mode; in atomic mode they may keep other rows of a source but exactly as many per (expert,
source), and combine must use exactly the rows kept. Drops are counted on the device: "drop" reports
them through ``dropped_rows``, "raise" raises ``CapacityExceeded`` on every rank with the complete
result.

FP8: the received packed rows (e4m3 values, fp32 scales, zero padding) must equal the senders' rows
quantized by ``cute_ep.fp8`` byte for byte, in both modes and with capacity drops; combine of the
dequantized rows through a non-identity expert is checked against the reference as usual.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cute_ep.buffer import EpBuffer
from cute_ep.capacity import apply_expert_capacity, check_atomic_drops, effective_topk_from_scatter
from cute_ep.fp8 import dequantize_fp8, pack_fp8_rows, quantize_fp8
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows, reference_layout
from cute_ep.status import CapacityExceeded
from cute_ep.validators.checks import check_combine, check_dispatch

pytestmark = pytest.mark.gpu


def _gather(runtime, obj):
    out = [None] * runtime.env.world_size
    dist.all_gather_object(out, obj, group=runtime.cpu_group)
    return out


def _check_call(runtime, buf, x, idx, w, res, mode, fp8, eff_scatter_all):
    """Check one dispatch (+ combine) against the references on the effective routing."""
    env = runtime.env
    rank, L = env.rank, env.local_world_size
    cfg = buf.cfg
    dev = runtime.device
    eff = eff_scatter_all[rank]
    if mode == "atomic":
        eff = effective_topk_from_scatter(idx.cpu(), res.handle.scatter.cpu())
        problems = check_atomic_drops(_gather(runtime, eff), eff_scatter_all, cfg.num_experts)
        assert not problems, f"atomic drops: {problems}"
    eff_all = _gather(runtime, eff)
    ref = reference_layout(eff_all, cfg.num_experts)
    assert res.num_recv == int(ref.num_recv[rank])
    assert torch.equal(res.tokens_per_expert.cpu().long(), ref.tokens_per_expert[rank].long())
    if mode == "scatter":
        assert torch.equal(res.handle.scatter.cpu().long(), ref.scatter[rank].long())

    rows, recv_rows = x, res.recv_x
    if fp8:
        q, s = quantize_fp8(x.cpu())
        rows = pack_fp8_rows(q, s, cfg.fp8_row_bytes)
        recv_rows = buf.fp8_packed_rows(res.num_recv)
        assert res.recv_x.dtype == torch.float8_e4m3fn and res.recv_scales.dtype == torch.float32
    r = check_dispatch(
        rows, eff, w, recv_rows, res.recv_weights, res.recv_src, max_tokens=cfg.max_tokens,
        num_experts=cfg.num_experts, local_world_size=L, ordered=(mode == "scatter"), require_coverage=False,
        group=runtime.cpu_group,
    )
    assert r.passed, f"dispatch {mode} fp8={fp8}: {r.message}"

    experts = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(dev)
    rows_in = res.recv_x
    if fp8:
        rows_in = dequantize_fp8(res.recv_x.cpu(), res.recv_scales.cpu()).to(cfg.dtype).to(dev)
    y = buf.expert_output(res.num_recv)
    y.copy_(apply_test_expert(rows_in, experts))
    out = buf.combine(y, res.handle)
    rc = check_combine(out, eff.to(dev), w, y, local_world_size=L, num_experts=cfg.num_experts,
                       scatter=res.handle.scatter, require_coverage=False, group=runtime.cpu_group)
    assert rc.passed, f"combine after {mode} fp8={fp8}: {rc.message}"


@pytest.mark.parametrize(
    "dtype,hidden,topk,el,factor,routing",
    [
        (torch.bfloat16, 256, 4, 4, 0.5, "skewed"),
        (torch.float32, 128, 2, 2, 1.0, "skewed"),
        (torch.bfloat16, 7168, 8, 16, 1.0, "uniform"),
        (torch.float16, 384, 3, 3, 0.25, "dropped"),
    ],
    ids=["bf16-f0.5-skewed", "fp32-f1-skewed", "bf16-h7168-f1", "fp16-f0.25-dropped"],
)
def test_capacity_drops_and_fp8(runtime, dtype, hidden, topk, el, factor, routing):
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = el * R
    tokens = (48, 40, 32, 56)
    T = tokens[rank % 4]
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=min(topk, E),
                   hidden=hidden, dtype=dtype, max_tokens=max(tokens), num_sms=min(16, runtime.sm_share),
                   capacity_factor=factor, on_overflow="drop")
    dev = runtime.device
    total_dropped = 0
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        assert buf.recv_x.shape[0] == cfg.required_capacity
        for it, (mode, fp8) in enumerate((("scatter", False), ("atomic", False), ("scatter", True),
                                          ("atomic", True))):
            x, idx, w = make_inputs(rank, T, hidden, E, cfg.topk, dtype, runtime.seed + 4321 + it,
                                    routing=routing)
            x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
            eff_all, dropped = apply_expert_capacity(_gather(runtime, idx.cpu()), E, cfg.expert_capacity)
            buf.poison()
            res = buf.dispatch(x, idx, w, mode=mode, fp8=fp8)
            got = buf.dropped_rows()
            assert torch.equal(got, dropped), f"dropped: {got.tolist()}, expected {dropped.tolist()}"
            total_dropped += int(dropped.sum())
            _check_call(runtime, buf, x, idx, w, res, mode, fp8, eff_all)
        assert torch.equal(buf.dropped_rows(), torch.zeros(E, dtype=torch.int64))  # reset after reading
    if factor <= 0.5:
        assert total_dropped > 0, "the case was meant to drop rows"


def test_capacity_raise_names_experts_and_keeps_result(runtime):
    env = runtime.env
    R, rank = env.world_size, env.rank
    E = 4 * R
    cfg = EpConfig(world_size=R, local_world_size=env.local_world_size, num_experts=E, topk=2, hidden=256,
                   dtype=torch.bfloat16, max_tokens=32, num_sms=min(8, runtime.sm_share), capacity_factor=0.5)
    dev = runtime.device
    with EpBuffer(runtime, cfg, registry=runtime.registry) as buf:
        x, idx, w = make_inputs(rank, 32, 256, E, 2, torch.bfloat16, runtime.seed + 99, routing="skewed")
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        eff_all, dropped = apply_expert_capacity(_gather(runtime, idx.cpu()), E, cfg.expert_capacity)
        assert int(dropped.sum()) > 0
        with pytest.raises(CapacityExceeded) as info:
            buf.dispatch(x, idx, w)
        exc = info.value
        assert exc.total == int(dropped.sum())
        assert exc.dropped == {e: int(n) for e, n in enumerate(dropped.tolist()) if n}
        first = min(exc.dropped)
        assert f"expert {first} (rank {first // cfg.experts_per_rank}): {exc.dropped[first]}" in str(exc)
        # The result travels with the error, complete: combine still works on every rank.
        _check_call(runtime, buf, x, idx, w, exc.result, "scatter", False, eff_all)
        # Drops reported once: the next dispatch without drops does not raise again.
        x2, idx2, w2 = make_inputs(rank, 1, 256, E, 2, torch.bfloat16, runtime.seed + 100)
        buf.dispatch(x2.to(dev), idx2.to(dev), w2.to(dev))
