"""The rank receive layout (``dispatch(..., layout="rank")``, DeepEP's) on the host backends.

What is checked against what: the torch references (``cute_ep.reference.reference_*_rank_layout``)
against hand-computed values and against the literal specification (tests/_rank_layout_spec.py,
Python loops over ranks, tokens and k) in worlds of 1, 2 and 4 ranks; ``ReferenceEpBuffer`` and
``A2aEpBuffer`` against both, bit for bit, in a world of one in process and in gloo worlds of 2 and 4
ranks (tests/_torchrun_rank_layout_worker.py); the errors (layout value, capacity factor, an fp8 flag
that differs between ranks, an algorithm for a rank handle) with messages that name the constraint and
the value, on every rank. FP8 in the rank layout: tests/test_rank_layout_fp8.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _launch import assert_cases_match
from _rank_layout_spec import (
    assert_cases_cover_skew_ragged_empty_full,
    caller_expert,
    rank0_routing,
    spec_combine,
    spec_dispatch,
    spec_scatter,
)
from _worlds import (
    HOST_BACKENDS,
    RANK_LAYOUT_WORLDS,
    assert_raised_on_every_rank,
    host_config,
    needs_gloo,
    world_of_one,
)

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.api import LAYOUTS, DispatchHandle, DispatchResult
from cute_ep.input_checks import check_combine_layout, check_layout
from cute_ep.inputs import decode_sender, make_inputs, sender_check_ok
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    reference_combine_rank_layout,
    reference_dispatch_rank_layout,
    reference_rank_layout,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN equals only the same NaN, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# the API: fields, config, checks
# --------------------------------------------------------------------------------------------------


def test_new_fields_are_appended_so_positional_constructions_still_work():
    handle_fields = [f.name for f in dataclasses.fields(DispatchHandle)]
    assert handle_fields == ["topk_idx", "topk_weights", "scatter", "num_tokens", "mode", "layout"]
    result_fields = [f.name for f in dataclasses.fields(DispatchResult)]
    assert result_fields == ["recv_x", "recv_weights", "recv_src", "tokens_per_expert", "num_recv", "handle",
                             "recv_scales", "recv_count", "event", "recv_topk_idx", "recv_topk_weights"]
    z = torch.zeros(2, 2, dtype=torch.int32)
    h = DispatchHandle(z, z.float(), z, 2, "scatter")  # the five positional fields of before
    assert h.layout == "expert"
    r = DispatchResult(z, z[0].float(), z[0], z[0], 2, h, None, None, None)
    assert r.recv_topk_idx is None and r.recv_topk_weights is None
    assert LAYOUTS == ("expert", "rank")


@pytest.mark.parametrize(("world", "max_tokens", "topk", "experts"), [(1, 16, 2, 4), (4, 64, 8, 32),
                                                                      (8, 3, 1, 8)])
def test_rank_capacity_is_one_row_per_source_token(world, max_tokens, topk, experts):
    cfg = EpConfig(world_size=world, local_world_size=world, num_experts=experts, topk=topk, hidden=64,
                   dtype=BF16, max_tokens=max_tokens)
    assert cfg.rank_capacity == world * max_tokens
    assert cfg.rank_capacity <= cfg.capacity  # no capacity factor: the buffers always hold it


def test_check_layout_accepts_both_layouts_and_both_modes():
    cfg = host_config()
    for layout in LAYOUTS:
        for mode in ("scatter", "atomic"):
            for fp8 in (False, True):  # FP8 works in both layouts (its own constraints: check_fp8)
                check_layout(cfg, layout, mode, fp8)
    check_layout(host_config(capacity_factor=1.0), "expert", "scatter", False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(layout="fancy"), r"layout must be one of \['expert', 'rank'\], got 'fancy'"),
        (dict(layout=None), r"layout must be one of \['expert', 'rank'\], got None"),
        (dict(layout="Rank"), r"got 'Rank'"),
        (dict(cfg=host_config(capacity_factor=1.25)),
         r"layout='rank' needs capacity_factor == 0 \(no expert capacity\), got capacity_factor=1.25"),
    ],
)  # fmt: skip
def test_check_layout_names_the_constraint_and_the_value(kwargs, message):
    args = dict(cfg=host_config(), layout="rank", mode="scatter", fp8=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_layout(args["cfg"], args["layout"], args["mode"], args["fp8"])


def test_check_combine_layout():
    z = torch.zeros(1, 1, dtype=torch.int32)
    expert = DispatchHandle(z, z.float(), z, 1, "scatter")
    rank = dataclasses.replace(expert, layout="rank")
    assert check_combine_layout(expert, "reduced") == "expert"  # left to resolve_combine_algorithm
    assert check_combine_layout(rank, None) == "rank"
    assert check_combine_layout(object(), None) == "expert"  # a handle without the field
    for algo in ("pull", "reduced", "fancy"):
        with pytest.raises(ValueError, match=rf"layout='rank' handle takes algorithm=None .*, got '{algo}'"):
            check_combine_layout(rank, algo)
    with pytest.raises(ValueError, match=r"handle.layout must be one of \['expert', 'rank'\], got 'x'"):
        check_combine_layout(dataclasses.replace(expert, layout="x"), None)


# --------------------------------------------------------------------------------------------------
# the references: by hand, then against the literal specification
# --------------------------------------------------------------------------------------------------


def test_reference_rank_layout_by_hand():
    # R = 2, E = 4 (El = 2: rank 0 owns 0, 1; rank 1 owns 2, 3), K = 2, M = 4.
    idx0 = torch.tensor([[0, 3], [2, -1], [-1, -1], [1, 0]])
    idx1 = torch.tensor([[3, 2], [1, -1]])
    w0 = torch.tensor([[0.5, 0.25], [1.0, 7.0], [3.0, 4.0], [0.125, 2.0]])
    w1 = torch.tensor([[0.75, -0.5], [1.5, 9.0]])
    x0 = torch.arange(4 * 4, dtype=FP32).view(4, 4)
    x1 = 100 + torch.arange(2 * 4, dtype=FP32).view(2, 4)
    layout = reference_rank_layout([idx0, idx1], 4)
    # Rank 0 receives (0, t0), (0, t3), (1, t1); rank 1 receives (0, t0), (0, t1), (1, t0).
    assert layout.counts.tolist() == [[2, 2], [1, 1]]
    assert layout.num_recv.tolist() == [3, 3]
    assert layout.offsets.tolist() == [[0, 2], [0, 2]]
    assert layout.tokens_per_expert.tolist() == [[2, 2], [2, 2]]
    assert layout.scatter[0].tolist() == [[0, 0], [1, -1], [-1, -1], [1, 1]]
    assert layout.scatter[1].tolist() == [[2, 2], [2, -1]]

    got0 = reference_dispatch_rank_layout([x0, x1], [idx0, idx1], [w0, w1], layout, 4, 0)
    assert torch.equal(got0.recv_x, torch.stack([x0[0], x0[3], x1[1]]))
    assert got0.recv_src.tolist() == [0, 3, 4 + 1] and got0.recv_src.dtype == torch.int32
    assert got0.recv_topk_idx.tolist() == [[0, -1], [1, 0], [1, -1]]
    assert got0.recv_topk_weights.tolist() == [[0.5, 0.0], [0.125, 2.0], [1.5, 0.0]]
    assert got0.tokens_per_expert.tolist() == [2, 2] and got0.tokens_per_expert.dtype == torch.int32
    got1 = reference_dispatch_rank_layout([x0, x1], [idx0, idx1], [w0, w1], layout, 4, 1)
    assert torch.equal(got1.recv_x, torch.stack([x0[0], x0[1], x1[0]]))
    assert got1.recv_src.tolist() == [0, 1, 4]
    assert got1.recv_topk_idx.tolist() == [[-1, 1], [0, -1], [1, 0]]
    assert got1.recv_topk_weights.tolist() == [[0.0, 0.25], [1.0, 0.0], [0.75, -0.5]]
    # A weight of a pair on another rank is +0.0, whatever the input held there.
    assert not torch.signbit(got1.recv_topk_weights[0, 0])


def test_reference_combine_rank_layout_by_hand():
    # R = 3, El = 1. Ascending rank order, fp32 from +0.0, one rounding at the end.
    big = float(2**24)
    ys = [torch.tensor([[1.0], [2.0**-8], [-0.0]]), torch.tensor([[big], [2.0**-8]]),
          torch.tensor([[-big], [1.0]])]
    idx = torch.tensor([[2, 0, 1], [1, 2, -1], [0, -1, -1], [-1, -1, -1]])
    scatter = torch.tensor([[0, 0, 0], [1, 1, -1], [2, -1, -1], [-1, -1, -1]])
    out32 = reference_combine_rank_layout(ys, [idx], [scatter], num_experts=3)[0]
    # t0: ((0 + 1) + 2^24) + (-2^24) = 0 in fp32 (1 is lost); any other order gives 1.
    # t1: 0 + 2^-8 + 1 = 1.00390625 on ranks 1, 2; t2: 0 + (-0.0) = +0.0; t3: no destination.
    assert out32.flatten().tolist() == [0.0, 1.0 + 2.0**-8, 0.0, 0.0]
    assert not torch.signbit(out32[2, 0]) and out32.dtype == FP32
    # bf16: 1 + 2^-8 + 2^-8 is exact in fp32 (1 + 2^-7, a bf16 value); rounding after every add
    # would give 1.0 (1 + 2^-8 ties to even).
    yb = [torch.tensor([[1.0]], dtype=BF16), torch.tensor([[2.0**-8]], dtype=BF16),
          torch.tensor([[2.0**-8]], dtype=BF16)]
    outb = reference_combine_rank_layout(yb, [torch.tensor([[0, 1, 2]])], [torch.tensor([[0, 0, 0]])],
                                         num_experts=3)[0]
    assert outb.dtype == BF16 and outb.item() == 1.0 + 2.0**-7


def test_reference_combine_rank_layout_refuses_bad_rows():
    ys = [torch.zeros(2, 4), torch.zeros(2, 4)]
    idx = torch.tensor([[0, 1]])  # El = 2 (E = 4): both on rank 0
    with pytest.raises(ValueError, match=r"its pairs on rank 0 name rows 0 and 1"):
        reference_combine_rank_layout(ys, [idx], [torch.tensor([[0, 1]])], num_experts=4)
    with pytest.raises(ValueError, match=r"row range \[5, 5\] outside recv_y\[0\] rows \[0, 2\)"):
        reference_combine_rank_layout(ys, [idx], [torch.tensor([[5, 5]])], num_experts=4)


def _world_inputs(world: int, tokens: tuple[int, ...], routing: str, *, el: int = 2, topk: int = 3,
                  dtype: torch.dtype = BF16, hidden: int = 16, seed: int = 3) -> tuple[list, list, list]:
    xs, idxs, ws = [], [], []
    for s in range(world):
        base = "uniform" if routing == "rank0" else routing
        x, idx, w = make_inputs(s, tokens[s], hidden, el * world, topk, dtype, seed, routing=base)
        if routing == "rank0":
            idx = rank0_routing(tokens[s], topk, el, seed + s)
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


WORLDS = [
    (1, (13,)), (1, (0,)), (2, (9, 0)), (2, (16, 16)), (4, (12, 0, 7, 16)), (4, (0, 0, 0, 0)),
]  # fmt: skip


@pytest.mark.parametrize(("world", "tokens"), WORLDS, ids=lambda v: str(v))
@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped", "rank0"])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_references_match_the_literal_specification(world, tokens, routing, dtype):
    el, topk, m = 3, 3, 16
    num_e = el * world
    xs, idxs, ws = _world_inputs(world, tokens, routing, el=el, topk=topk, dtype=dtype)
    layout = reference_rank_layout(idxs, num_e)
    ys = []
    for d in range(world):
        spec = spec_dispatch(xs, idxs, ws, num_experts=num_e, max_tokens=m, dst=d)
        got = reference_dispatch_rank_layout(xs, idxs, ws, layout, m, d)
        for f in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert"):
            assert _bits_equal(getattr(got, f), getattr(spec, f)), (d, f)
        assert got.num_recv == int(layout.num_recv[d]) <= world * m
        ys.append(caller_expert(got.recv_x, got.recv_topk_idx, got.recv_topk_weights, d, el))
    if routing == "rank0":
        assert int(layout.num_recv[0]) == sum(tokens) and int(layout.num_recv[1:].sum()) == 0
    for s in range(world):
        want_scatter = spec_scatter(idxs, num_experts=num_e, src=s)
        assert torch.equal(layout.scatter[s].to(torch.int32), want_scatter), s
        want = spec_combine(ys, idxs[s], want_scatter, num_experts=num_e)
        got = reference_combine_rank_layout(ys, [idxs[s]], [layout.scatter[s]], num_experts=num_e)[0]
        assert _bits_equal(got, want), s


def test_the_specification_comparison_can_fail():
    """A wrong order of rows, or of the combine's sum, is caught by the comparisons above."""
    xs, idxs, ws = _world_inputs(2, (9, 7), "uniform", el=2, topk=3, dtype=FP32)
    layout = reference_rank_layout(idxs, 4)
    spec = spec_dispatch(xs, idxs, ws, num_experts=4, max_tokens=16, dst=1)
    got = reference_dispatch_rank_layout(xs, idxs, ws, layout, 16, 1)
    assert spec.recv_x.shape[0] > 2
    assert not _bits_equal(got.recv_x.flip(0), spec.recv_x)
    # Descending rank order gives other bits for some token (fp32 addition is not associative).
    ys = [torch.tensor([[1.0]]), torch.tensor([[float(2**24)]]), torch.tensor([[-float(2**24)]])]
    idx, scatter = torch.tensor([[0, 1, 2]]), torch.tensor([[0, 0, 0]])
    want = spec_combine(ys, idx, scatter, num_experts=3)
    assert not _bits_equal(want, spec_combine(ys[::-1], idx, scatter, num_experts=3))


# --------------------------------------------------------------------------------------------------
# the host backends in a world of one, in process
# --------------------------------------------------------------------------------------------------


def _check_against_spec(res, x, idx, w, cfg, *, rows: int | None = None) -> int:
    """Every field of a world-of-one rank-layout result against the specification; returns N."""
    spec = spec_dispatch([x], [idx], [w], num_experts=cfg.num_experts, max_tokens=cfg.max_tokens, dst=0)
    n = spec.recv_x.shape[0]
    rows = n if rows is None else rows
    assert res.num_recv == rows and res.recv_count.tolist() == [n] and res.recv_count.dtype == torch.int32
    assert res.recv_weights is None and res.recv_scales is None
    for f in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src"):
        got = getattr(res, f)
        assert got.shape[0] == rows, f
        assert _bits_equal(got[:n], getattr(spec, f)), f
    assert _bits_equal(res.tokens_per_expert, spec.tokens_per_expert)
    assert res.handle.layout == "rank"
    assert torch.equal(res.handle.scatter, spec_scatter([idx], num_experts=cfg.num_experts, src=0))
    src_rank, src_tok = decode_sender(res.recv_x[:n])
    assert torch.equal(src_rank, torch.zeros_like(src_rank)) and bool(sender_check_ok(res.recv_x[:n]).all())
    assert torch.equal(src_tok, res.recv_src[:n].long())
    return n


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("mode", ["scatter", "atomic"])
def test_world_of_one_dispatch_and_combine_follow_the_specification(backend, dtype, routing, mode):
    cfg = host_config(num_experts=6, topk=3, dtype=dtype, hidden=32)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        buf.poison()
        for seed, tokens in ((1, 13), (2, 0), (3, 16)):
            x, idx, w = make_inputs(0, tokens, 32, 6, 3, dtype, seed, routing=routing)
            if routing == "dropped" and tokens:
                idx[0] = -1  # a token without destination: no row, zeros from combine
            res = buf.dispatch(x, idx, w, mode=mode, layout="rank")
            assert res.handle.mode == mode
            n = _check_against_spec(res, x, idx, w, cfg)
            y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, 0, 6)
            out = buf.combine(y, res.handle)
            want = spec_combine([y], idx, res.handle.scatter, num_experts=6)
            assert _bits_equal(out, want)
            assert out.shape == (tokens, 32) and out.dtype == dtype
            if routing == "dropped" and tokens:
                assert n < tokens and not bool(out[0].any())


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_world_of_one_a2a_is_bit_identical_to_the_reference_backend(dtype):
    cfg = host_config(num_experts=8, topk=4, dtype=dtype, hidden=48)
    rt = world_of_one()
    with A2aEpBuffer(rt, cfg) as a2a, HOST_BACKENDS["reference"](rt, cfg) as ref:
        for seed, tokens, routing in ((1, 16, "uniform"), (2, 5, "dropped"), (3, 0, "uniform")):
            x, idx, w = make_inputs(0, tokens, 48, 8, 4, dtype, seed, routing=routing)
            ra, rr = a2a.dispatch(x, idx, w, layout="rank"), ref.dispatch(x, idx, w, layout="rank")
            for f in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert"):
                assert _bits_equal(getattr(ra, f), getattr(rr, f)), f
            assert torch.equal(ra.handle.scatter, rr.handle.scatter) and ra.num_recv == rr.num_recv
            y = caller_expert(ra.recv_x, ra.recv_topk_idx, ra.recv_topk_weights, 0, 8)
            assert _bits_equal(a2a.combine(y, ra.handle), ref.combine(y, rr.handle))


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_sync_false_views_cover_rank_capacity(backend):
    cfg = host_config(num_experts=4, topk=2, max_tokens=16)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        buf.poison()
        x, idx, w = make_inputs(0, 11, 32, 4, 2, BF16, 5, routing="dropped")
        idx[3] = -1
        res = buf.dispatch(x, idx, w, sync=False, layout="rank")
        n = _check_against_spec(res, x, idx, w, cfg, rows=cfg.rank_capacity)
        assert n == int((idx >= 0).any(dim=1).sum()) < 11 and res.num_recv == cfg.rank_capacity == 16
        # The rows past N were never written: poison (-1 ids, NaN weights and rows, -1 tags).
        assert bool(torch.isnan(res.recv_x[n:]).all()) and bool((res.recv_topk_idx[n:] == -1).all())
        assert bool(torch.isnan(res.recv_topk_weights[n:]).all()) and bool((res.recv_src[n:] == -1).all())
        # The experts write into expert_output(num_recv) (rank_capacity rows); combine reads it.
        y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, 0, 4)
        buf.expert_output(res.num_recv).copy_(y)
        out = buf.combine(buf.expert_output(res.num_recv), res.handle)
        assert _bits_equal(out, spec_combine([y[:n]], idx, res.handle.scatter, num_experts=4))
        # A y of only the N real rows gives the same.
        assert _bits_equal(buf.combine(y[:n].clone(), res.handle), out)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_poison_and_sizing(backend):
    cfg = host_config(num_experts=4, topk=2, max_tokens=16)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 9, 32, 4, 2, BF16, 6)
        res = buf.dispatch(x, idx, w, layout="rank")
        assert buf.recv_topk_idx.shape[0] >= res.num_recv == 9
        buf.poison()
        assert bool((res.recv_topk_idx == -1).all()) and bool(torch.isnan(res.recv_topk_weights).all())
        assert bool(torch.isnan(res.recv_x).all()) and bool((res.recv_src == -1).all())
        # Skew, full batch: every token of the rank is a row, N = rank_capacity (a world of one).
        full = make_inputs(0, 16, 32, 4, 2, BF16, 7)
        res = buf.dispatch(*full, layout="rank")
        assert res.num_recv == cfg.rank_capacity and buf.recv_x.shape[0] >= cfg.rank_capacity
    with A2aEpBuffer(world_of_one(), cfg, preallocate=True) as a2a:
        assert a2a.recv_topk_idx.shape == (cfg.rank_capacity, 2) == a2a.recv_topk_w.shape
        assert bool((a2a.recv_topk_idx == -1).all()) and bool(torch.isnan(a2a.recv_topk_w).all())
    with A2aEpBuffer(world_of_one(), host_config(capacity_factor=1.0), preallocate=True) as a2a:
        assert a2a.recv_topk_idx.shape[0] == 0  # the rank layout is refused there: nothing to hold


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_expert_layout_is_unchanged(backend):
    """layout="expert" (explicit) equals the default call, and its new fields are None."""
    cfg = host_config(num_experts=4, topk=2)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 12, 32, 4, 2, BF16, 8, routing="dropped")
        a = buf.dispatch(x, idx, w)
        a_fields = [a.recv_x.clone(), a.recv_weights.clone(), a.recv_src.clone(), a.tokens_per_expert]
        _ = buf.dispatch(x, idx, w, layout="rank")  # a rank-layout call in between changes nothing
        b = buf.dispatch(x, idx, w, layout="expert")
        for got, want in zip([b.recv_x, b.recv_weights, b.recv_src, b.tokens_per_expert], a_fields,
                             strict=True):
            assert _bits_equal(got, want)
        assert b.recv_topk_idx is None and b.recv_topk_weights is None and b.handle.layout == "expert"
        assert torch.equal(a.handle.scatter, b.handle.scatter)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_errors_name_the_constraint_and_the_value(backend):
    cfg = host_config(num_experts=4, topk=2)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 6, 32, 4, 2, BF16, 2)
        with pytest.raises(ValueError, match=r"layout must be one of \['expert', 'rank'\], got 'ranks'"):
            buf.dispatch(x, idx, w, layout="ranks")
        with pytest.raises(ValueError, match=r"fp8 must be True or False, got 1"):
            buf.dispatch(x, idx, w, fp8=1, layout="rank")
        res = buf.dispatch(x, idx, w, layout="rank")
        y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, 0, 4)
        for algo in ("pull", "reduced"):
            message = rf"layout='rank' handle takes algorithm=None .*, got '{algo}'"
            with pytest.raises(ValueError, match=message):
                buf.combine(y, res.handle, algorithm=algo)
        with pytest.raises(ValueError, match="y must be"):
            buf.combine(y.float(), res.handle)
        # Still usable after the refused calls.
        assert _bits_equal(buf.combine(y, res.handle), spec_combine([y], idx, res.handle.scatter,
                                                                     num_experts=4))
    with HOST_BACKENDS[backend](world_of_one(), host_config(capacity_factor=2.0)) as capped:
        with pytest.raises(ValueError, match=r"layout='rank' needs capacity_factor == 0 \(no expert "
                                             r"capacity\), got capacity_factor=2.0"):
            capped.dispatch(x, idx, w, layout="rank")


def test_world_of_one_a2a_refuses_a_handle_whose_layout_was_replaced():
    cfg = host_config(num_experts=4, topk=2)
    with A2aEpBuffer(world_of_one(), cfg) as a2a:
        x, idx, w = make_inputs(0, 6, 32, 4, 2, BF16, 3)
        res = a2a.dispatch(x, idx, w, layout="rank")
        y = res.recv_x.clone()
        with pytest.raises(ValueError, match=r"handle.layout is 'expert', its dispatch used layout='rank'"):
            a2a.combine(y, dataclasses.replace(res.handle, layout="expert"))


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_a_replaced_routing_drops_destinations(backend):
    """handle.topk_idx may set pairs to -1 (as for the expert layout): a token whose every pair is -1
    then gets zeros; its weights are never applied."""
    cfg = host_config(num_experts=4, topk=2)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 8, 32, 4, 2, BF16, 4)
        res = buf.dispatch(x, idx, w, layout="rank")
        y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, 0, 4)
        full = buf.combine(y, res.handle)
        assert _bits_equal(buf.combine(y, dataclasses.replace(res.handle, topk_weights=w * 3)), full)
        dropped = res.handle.topk_idx.clone()
        dropped[2] = -1
        out = buf.combine(y, dataclasses.replace(res.handle, topk_idx=dropped))
        assert not bool(out[2].any()) and _bits_equal(out[:2], full[:2]) and _bits_equal(out[3:], full[3:])


# --------------------------------------------------------------------------------------------------
# gloo worlds of 2 and 4 ranks
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def ranks(rank_layout_worlds: list[dict]) -> list[dict]:
    """The worker's "layout" part (tests/conftest.py launches it with the "fp8" part)."""
    return [res["layout"] for res in rank_layout_worlds]


CASE_NAMES = ["uniform-bf16-k4-el2-ragged", "dropped-fp32-k3-el2-alldrop", "skewed-fp16-k2-el3-atomic",
              "rank0-bf16-k2-el4-skew", "uniform-fp32-k1-el1-int32", "everyone-bf16-full",
              "uniform-bf16-k2-el2-empty"]


@needs_gloo
@RANK_LAYOUT_WORLDS
def test_gloo_both_backends_match_the_specification_and_the_references(ranks):
    assert_cases_match(ranks, len(CASE_NAMES))
    assert [c["name"] for c in ranks[0]["cases"]] == CASE_NAMES


@needs_gloo
@RANK_LAYOUT_WORLDS
def test_gloo_cases_cover_skew_ragged_empty_and_full_receives(ranks):
    assert_cases_cover_skew_ragged_empty_full(ranks, CASE_NAMES, "")


# scenario -> (rank at fault, or None when every rank is; what the rank at fault reads; what the others read)
BAD = {
    "bad_layout_on_last": ("last", "layout must be one of ['expert', 'rank'], got 'fancy'",
                           "on another rank: rank {last}:"),
    "layout_mismatch": (None, "every rank must use the same layout, got ['expert', 'rank'", ""),
    "fp8_mismatch": (None, "every rank must pass the same fp8 flag, got [True, False", ""),
    "capacity_factor": (None, "layout='rank' needs capacity_factor == 0 (no expert capacity), got "
                        "capacity_factor=1.0", ""),
    "algorithm_on_rank0": (0, "layout='rank' handle takes algorithm=None", "on another rank: rank 0:"),
    "algorithm_everywhere": (None, "layout='rank' handle takes algorithm=None", ""),
}  # fmt: skip


@needs_gloo
@RANK_LAYOUT_WORLDS
@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("scenario", sorted(BAD))
def test_gloo_an_invalid_call_raises_on_every_rank(ranks, backend, scenario):
    last = len(ranks) - 1
    at_fault, own, others = BAD[scenario]
    at_fault = last if at_fault == "last" else at_fault
    assert_raised_on_every_rank(ranks, f"{backend}_{scenario}", at_fault, own, [others.format(last=last)])
    if scenario.startswith("algorithm"):
        want = "'pull'" if scenario == "algorithm_on_rank0" else "'reduced'"
        assert want in ranks[0]["bad"][f"{backend}_{scenario}"]["message"]


@needs_gloo
@RANK_LAYOUT_WORLDS
@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_gloo_the_buffers_stay_usable_after_invalid_calls(ranks, backend):
    for res in ranks:
        assert res["bad"][f"{backend}_usable_after_errors"]["ok"]
