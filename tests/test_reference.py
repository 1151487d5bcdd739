"""The torch references against naive per-(s, t, k) Python loops, plus input generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_ep.inputs import decode_sender, make_inputs, sender_check_ok
from cute_ep.reference import (
    INT32_MAX,
    apply_test_expert,
    global_expert_of_rows,
    local_expert_of_rows,
    pack_source,
    reference_combine,
    reference_dispatch,
    reference_expert_outputs,
    reference_layout,
    unpack_source,
)

# --------------------------------------------------------------------------------------------
# Naive references: the layout rules written out literally
# --------------------------------------------------------------------------------------------


def naive_layout(topk_idx, num_experts):
    world = len(topk_idx)
    el = num_experts // world
    count = [[0] * num_experts for _ in range(world)]
    for s, idx in enumerate(topk_idx):
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    count[s][e] += 1
    offsets = [[[0] * world for _ in range(el)] for _ in range(world)]
    for d in range(world):
        run = 0
        for lx in range(el):
            for s in range(world):
                offsets[d][lx][s] = run
                run += count[s][d * el + lx]
    scatter = []
    for s, idx in enumerate(topk_idx):
        seen = [0] * num_experts
        sc = [[-1] * idx.shape[1] for _ in range(idx.shape[0])]
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    sc[t][k] = offsets[e // el][e % el][s] + seen[e]
                    seen[e] += 1
        scatter.append(sc)
    return count, offsets, scatter


def naive_dispatch(x, topk_idx, topk_weights, num_experts, max_tokens):
    world = len(x)
    el = num_experts // world
    count, offsets, scatter = naive_layout(topk_idx, num_experts)
    nrecv = [sum(count[s][d * el + lx] for s in range(world) for lx in range(el)) for d in range(world)]
    out = [
        (
            torch.full((nrecv[d], x[0].shape[1]), float("nan"), dtype=x[0].dtype),
            [None] * nrecv[d],
            [None] * nrecv[d],
        )
        for d in range(world)
    ]
    k_total = topk_idx[0].shape[1]
    for s in range(world):
        for t in range(x[s].shape[0]):
            for k in range(k_total):
                e = int(topk_idx[s][t, k])
                if e < 0:
                    continue
                d, slot = e // el, scatter[s][t][k]
                out[d][0][slot] = x[s][t]
                out[d][1][slot] = float(topk_weights[s][t, k])
                out[d][2][slot] = (s * max_tokens + t) * k_total + k
    return out, scatter


def bf16_rne(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits by round-to-nearest-even, written independently of torch."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def naive_combine(recv_y, topk_idx, topk_weights, scatter, num_experts):
    """numpy float32 scalar loop: product rounded to fp32, then the add (numpy never fuses)."""
    world = len(recv_y)
    el = num_experts // world
    dtype = recv_y[0].dtype
    ys = [y.float().numpy() for y in recv_y]
    outs = []
    for s in range(len(topk_idx)):
        n_tok, k_total = topk_idx[s].shape
        acc = np.zeros((n_tok, recv_y[0].shape[1]), dtype=np.float32)
        for t in range(n_tok):
            for k in range(k_total):
                e = int(topk_idx[s][t, k])
                if e < 0:
                    continue
                w = np.float32(topk_weights[s][t, k].item())
                prod = (w * ys[e // el][int(scatter[s][t][k])]).astype(np.float32)
                acc[t] = (acc[t] + prod).astype(np.float32)
        if dtype == torch.bfloat16:
            out = torch.from_numpy(bf16_rne(acc).view(np.int16)).view(torch.bfloat16)
        elif dtype == torch.float16:
            out = torch.from_numpy(acc.astype(np.float16))
        else:
            out = torch.from_numpy(acc)
        outs.append(out)
    return outs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.dtype.is_floating_point else t


# --------------------------------------------------------------------------------------------
# Inputs for the comparisons
# --------------------------------------------------------------------------------------------

CASES = [
    # (world, experts, topk, tokens per rank, routing, dtype)
    (1, 4, 1, [9], "uniform", torch.float32),
    (1, 8, 8, [5], "dropped", torch.bfloat16),
    (2, 4, 2, [11, 0], "uniform", torch.bfloat16),
    (2, 8, 3, [7, 13], "dropped", torch.float16),
    (2, 6, 6, [4, 6], "skewed", torch.float32),
    (4, 8, 1, [10, 3, 0, 8], "skewed", torch.bfloat16),
    (4, 8, 4, [12, 0, 9, 5], "uniform", torch.bfloat16),
    (4, 16, 8, [6, 9, 4, 0], "dropped", torch.float32),
    (4, 4, 3, [8, 8, 8, 8], "uniform", torch.bfloat16),
]


def build(world, experts, topk, tokens, routing, dtype, seed=3, hidden=12):
    ins = [
        make_inputs(r, tokens[r], hidden, experts, topk, dtype, seed, routing=routing) for r in range(world)
    ]
    return [i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c[0]}E{c[1]}K{c[2]}-{c[4]}-{str(c[5])[6:]}")
def test_layout_dispatch_combine_match_naive(case):
    world, experts, topk, tokens, routing, dtype = case
    x, idx, w = build(*case)
    max_tokens = max(tokens) + 2
    layout = reference_layout(idx, experts)
    count, offsets, scatter = naive_layout(idx, experts)
    assert layout.counts.tolist() == count
    assert layout.offsets.tolist() == offsets
    assert [s.tolist() for s in layout.scatter] == scatter
    el = experts // world
    assert layout.tokens_per_expert.tolist() == [
        [sum(count[s][d * el + lx] for s in range(world)) for lx in range(el)] for d in range(world)
    ]
    assert layout.num_recv.tolist() == [sum(r) for r in layout.tokens_per_expert.tolist()]

    got = reference_dispatch(x, idx, w, layout, max_tokens)
    want, _ = naive_dispatch(x, idx, w, experts, max_tokens)
    for d in range(world):
        assert torch.equal(bits(got[d].recv_x), bits(want[d][0]))
        assert got[d].recv_w.dtype == torch.float32 and got[d].recv_w.tolist() == want[d][1]
        assert got[d].recv_src.dtype == torch.int32 and got[d].recv_src.tolist() == want[d][2]
        # Every received row names its sender in columns 0..3, and that sender matches the tag.
        rank, token = decode_sender(got[d].recv_x)
        s, t, _ = unpack_source(got[d].recv_src, max_tokens, topk)
        assert torch.equal(rank, s) and torch.equal(token, t)
        assert bool(sender_check_ok(got[d].recv_x).all())

    recv_y = reference_expert_outputs(got, layout)
    out = reference_combine(recv_y, idx, w, layout.scatter, num_experts=experts)
    naive = naive_combine(recv_y, idx, w, scatter, experts)
    for s in range(world):
        assert out[s].dtype == dtype and out[s].shape == x[s].shape
        assert torch.equal(bits(out[s]), bits(naive[s]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_bitwise_vs_separate_mul_add(dtype):
    # Values chosen so a fused multiply-add or a different order would round differently.
    torch.manual_seed(0)
    world, experts, topk, n_tok, hidden = 2, 4, 4, 64, 32
    recv_y = [(torch.randn(300, hidden) * 1e3).to(dtype) for _ in range(world)]
    idx = torch.stack([torch.randperm(experts)[:topk] for _ in range(n_tok)])
    idx[::5, 1] = -1
    idx[7] = -1  # a fully dropped token gives zeros
    w = torch.rand(n_tok, topk) * 3 + 1e-3
    slots = torch.randint(0, 300, (n_tok, topk))
    out = reference_combine(recv_y, [idx], [w], [slots], num_experts=experts)[0]
    naive = naive_combine(recv_y, [idx], [w], [slots.tolist()], experts)[0]
    assert torch.equal(bits(out), bits(naive))
    assert torch.equal(out[7], torch.zeros(hidden, dtype=dtype))
    # Sanity of the test data: an fp64 accumulation (no intermediate fp32 rounding, as with a fused
    # multiply-add) gives different bits on these values, so the exact order is really being tested.
    fused = torch.zeros(n_tok, hidden, dtype=torch.float64)
    for k in range(topk):
        valid = idx[:, k] >= 0
        y = torch.stack(
            [recv_y[int(e) // 2][int(s)] for e, s in zip(idx[:, k].clamp(min=0), slots[:, k], strict=True)]
        )
        fused += torch.where(valid[:, None], w[:, k, None].double() * y.double(), 0)
    if dtype == torch.float32:
        assert not torch.equal(fused.float(), out)


def test_empty_and_single_rank_all_to_one_expert():
    idx = [torch.zeros(6, 1, dtype=torch.int32)]
    layout = reference_layout(idx, 3)
    assert layout.counts.tolist() == [[6, 0, 0]]
    assert layout.scatter[0].flatten().tolist() == list(range(6))
    assert layout.tokens_per_expert.tolist() == [[6, 0, 0]]
    empty = reference_layout([torch.empty(0, 2, dtype=torch.int64)] * 2, 4)
    assert empty.num_recv.tolist() == [0, 0]
    assert empty.scatter[0].shape == (0, 2)


def test_pack_unpack_round_trip_and_overflow():
    max_tokens, topk = 1000, 8
    s = torch.tensor([0, 3, 7, 7])
    t = torch.tensor([0, 999, 5, 999])
    k = torch.tensor([0, 7, 3, 7])
    tag = pack_source(s, t, k, max_tokens, topk)
    assert tag.dtype == torch.int32
    for a, b in zip(unpack_source(tag, max_tokens, topk), (s, t, k), strict=True):
        assert torch.equal(a, b)
    assert pack_source(2, 3, 1, max_tokens, topk) == (2 * 1000 + 3) * 8 + 1
    assert unpack_source((2 * 1000 + 3) * 8 + 1, max_tokens, topk) == (2, 3, 1)
    # The largest tag of a configuration that just fits.
    assert pack_source(0, 0, 0, INT32_MAX // 8 + 1, 8) == 0
    with pytest.raises(ValueError, match=r"src_rank=64, max_tokens=4194304, topk=8.*exceeds int32"):
        pack_source(64, 0, 0, 4194304, 8)
    with pytest.raises(ValueError, match="token must be"):
        pack_source(0, 1000, 0, max_tokens, topk)
    with pytest.raises(ValueError, match="k must be"):
        pack_source(0, 0, 8, max_tokens, topk)


def test_layout_validation_errors():
    ok = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by the world size \(4\)"):
        reference_layout([ok] * 4, 6)
    with pytest.raises(ValueError, match=r"\[-1, 4\).*got range \[0, 4\]"):
        reference_layout([ok, torch.tensor([[4, 0]])], 4)
    with pytest.raises(ValueError, match=r"got range \[-2, 0\]"):
        reference_layout([torch.tensor([[-2, 0]])], 4)
    with pytest.raises(ValueError, match=r"same topk K, got K values \[2, 3\]"):
        reference_layout([ok, torch.zeros(3, 3, dtype=torch.int64)], 4)
    with pytest.raises(ValueError, match="integer"):
        reference_layout([ok.float()], 4)
    with pytest.raises(ValueError, match="2-D"):
        reference_layout([torch.zeros(3, dtype=torch.int64)], 4)


def test_dispatch_and_combine_validation_errors():
    x, idx, w = build(2, 4, 2, [5, 3], "uniform", torch.bfloat16)
    layout = reference_layout(idx, 4)
    with pytest.raises(ValueError, match="more than max_tokens"):
        reference_dispatch(x, idx, w, layout, max_tokens=4)
    with pytest.raises(ValueError, match="float32"):
        reference_dispatch(x, idx, [a.double() for a in w], layout, max_tokens=8)
    with pytest.raises(ValueError, match="exceeds int32"):
        reference_dispatch(x, idx, w, layout, max_tokens=2**30)
    y = reference_expert_outputs(reference_dispatch(x, idx, w, layout, 8), layout)
    with pytest.raises(ValueError, match="outside recv_y"):
        reference_combine(y, idx, w, [s + 100 for s in layout.scatter], num_experts=4)
    with pytest.raises(ValueError, match="divisible"):
        reference_combine(y, idx, w, layout.scatter, num_experts=5)


def test_test_expert_helpers():
    tpe = torch.tensor([2, 0, 3])
    assert local_expert_of_rows(tpe).tolist() == [0, 0, 2, 2, 2]
    assert global_expert_of_rows(tpe, 2).tolist() == [6, 6, 8, 8, 8]
    rows = torch.ones(5, 4, dtype=torch.bfloat16) * 1.5
    y = apply_test_expert(rows, global_expert_of_rows(tpe, 2))
    assert y.dtype == torch.bfloat16 and y[:, 0].tolist() == [10.5, 10.5, 13.5, 13.5, 13.5]


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def test_make_inputs_deterministic_and_decodable():
    a = make_inputs(3, 600, 16, 32, 4, torch.bfloat16, seed=11)
    b = make_inputs(3, 600, 16, 32, 4, torch.bfloat16, seed=11)
    c = make_inputs(2, 600, 16, 32, 4, torch.bfloat16, seed=11)
    d = make_inputs(3, 600, 16, 32, 4, torch.bfloat16, seed=12)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(u, v)
    assert not torch.equal(a[0][:, 4:], c[0][:, 4:]) and not torch.equal(a[1], d[1])
    x, idx, w = a
    rank, token = decode_sender(x)
    assert rank.tolist() == [3] * 600 and token.tolist() == list(range(600))
    assert bool(sender_check_ok(x).all())
    assert not bool(sender_check_ok(torch.full((1, 16), float("nan"))).any())
    # K distinct experts per token, positive weights.
    assert idx.dtype == torch.int64 and bool((idx.sort(dim=1).values.diff(dim=1) > 0).all())
    assert w.dtype == torch.float32 and bool((w > 0).all())
    assert torch.allclose(w.sum(1), torch.ones(600))


def test_make_inputs_routings():
    _, skew, _ = make_inputs(0, 400, 8, 16, 3, torch.float32, 1, routing="skewed")
    hot = (skew < 3).all(dim=1).float().mean()
    assert 0.8 < hot < 1.0
    assert bool((skew.sort(dim=1).values.diff(dim=1) > 0).all())
    _, dropped, _ = make_inputs(0, 400, 8, 16, 3, torch.float32, 1, routing="dropped", idx_dtype=torch.int32)
    frac = (dropped == -1).float().mean()
    assert dropped.dtype == torch.int32 and 0.15 < frac < 0.35
    x, idx, w = make_inputs(1, 0, 8, 16, 3, torch.float16, 1)
    assert x.shape == (0, 8) and idx.shape == (0, 3) and w.shape == (0, 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden": 3}, "hidden must be >= 4"),
        ({"topk": 17}, "topk must be in"),
        ({"num_experts": 0}, "num_experts must be >= 1"),
        ({"rank": 257}, "rank must be in"),
        ({"routing": "zipf"}, "routing must be one of"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"num_tokens": -1}, "num_tokens must be in"),
    ],
)
def test_make_inputs_validation(kwargs, match):
    args = {"rank": 0, "num_tokens": 4, "hidden": 8, "num_experts": 16, "topk": 2, "dtype": torch.bfloat16}
    args.update(kwargs)
    routing = args.pop("routing", "uniform")
    with pytest.raises(ValueError, match=match):
        make_inputs(**args, seed=0, routing=routing)
