"""The "reduced" combine: cute_ep.reference.reference_combine_reduced / combine_reduced_rows, and the
host backends' ``combine(..., algorithm=...)`` under ``EpConfig(combine_algorithm="reduced")``.

Reduced: per (token, expert rank) group, the pull formula of reference_combine over the group's k
(ascending), rounded to the row dtype; then the partials summed in fp32 in the order of each group's
first k, and cast. The reference is checked against hand-computed values, against a per-token Python
loop written from the definition, and against the pull combine where the two must agree. The backends
run under torchrun (gloo, 4 ranks; tests/_torchrun_reduced_worker.py) and in a world of one.
(tests/gpu/test_reduced_combine.py checks the kernels against the same reference.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _launch import assert_cases_match, worker_results
from _worlds import assert_raised_on_every_rank, needs_gloo, world_of_one

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.input_checks import resolve_combine_algorithm
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    apply_test_expert,
    combine_reduced_rows,
    global_expert_of_rows,
    reference_combine,
    reference_combine_reduced,
    reference_dispatch,
    reference_expert_outputs,
    reference_layout,
)
from cute_ep.reference_backend import ReferenceEpBuffer

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WORKER = Path(__file__).with_name("_torchrun_reduced_worker.py")
PULL_ONLY = "combine algorithm 'reduced' needs EpConfig\\(combine_algorithm='reduced'\\) \\(got 'pull'\\)"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _naive_reduced(recv_y, idx, w, scatter, num_experts) -> torch.Tensor:
    """The definition, one token at a time (small inputs only)."""
    el = num_experts // len(recv_y)
    dtype, hidden = recv_y[0].dtype, recv_y[0].shape[1]
    out = torch.zeros(idx.shape[0], hidden, dtype=dtype)
    for t in range(idx.shape[0]):
        partials: dict[int, torch.Tensor] = {}  # insertion order = order of each group's first k
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            d = e // el
            p = partials.get(d, torch.zeros(hidden))
            partials[d] = p + (w[t, k] * recv_y[d][int(scatter[t, k])].float())
        acc = torch.zeros(hidden)
        for p in partials.values():
            acc = acc + p.to(dtype).float()
        out[t] = acc.to(dtype)
    return out


def _world(dtype, routing, tokens, *, experts=16, topk=4, hidden=64, seed=7):
    """Inputs of len(tokens) ranks, the layout and the test experts' outputs."""
    world = len(tokens)
    xs, idxs, ws = zip(*[make_inputs(r, n, hidden, experts, topk, dtype, seed, routing=routing)
                         for r, n in enumerate(tokens)], strict=True)  # fmt: skip
    layout = reference_layout(idxs, experts)
    recv_y = reference_expert_outputs(reference_dispatch(xs, idxs, ws, layout, max(max(tokens), 1)), layout)
    assert len(recv_y) == world
    return recv_y, list(idxs), list(ws), layout


# --------------------------------------------------------------------------------------------------
# the reference, hand-computed cases
# --------------------------------------------------------------------------------------------------


def test_bf16_hand_computed_rounding_of_a_partial():
    # Two ranks, one expert each; the token goes to experts [0, 1, 0]: groups rank 0 = {k0, k2}, rank 1
    # = {k1}; rank 0's group comes first. Column 0: rank 0's partial 1 + 2**-8 is a bf16 tie and rounds
    # to 1.0; then 1.0 + 2**-8 rounds to 1.0 again. Pull: 1 + 2**-8 + 2**-8 = 1 + 2**-7 (exact in bf16).
    # Column 1: exact everywhere (3.0 + 0.25 = 3.25, + 0.5 = 3.75). Column 2: weights 0.5, 2, 1.5.
    tiny = 2.0**-8
    recv_y = [
        torch.tensor([[1.0, 3.0, 1.0], [tiny, 0.25, 0.5]], dtype=BF16),  # slots 0 (k0), 1 (k2)
        torch.tensor([[tiny, 0.5, 0.25]], dtype=BF16),  # slot 0 (k1)
    ]
    idx = torch.tensor([[0, 1, 0]])
    scatter = torch.tensor([[0, 0, 1]])
    w = torch.tensor([[1.0, 1.0, 1.0]])
    out = reference_combine_reduced(recv_y, [idx], [w], [scatter], num_experts=2)[0]
    pull = reference_combine(recv_y, [idx], [w], [scatter], num_experts=2)[0]
    assert _same(out, torch.tensor([[1.0, 3.75, 1.75]], dtype=BF16))
    assert _same(pull, torch.tensor([[1.0 + 2.0**-7, 3.75, 1.75]], dtype=BF16))

    # Weights 0.5, 2, 1.5. Column 0: rank 0's partial 0.5 * 1 + 1.5 * 2**-8 = 0.505859375 = 0.5 + 1.5 ulp
    # (bf16 ulp 2**-8 in [0.5, 1)), a tie between 0.50390625 (odd) and 0.5078125 (even): 0.5078125;
    # rank 1's 2 * 2**-8 = 0.0078125; sum 0.515625 (exact). Column 1: 3 * 0.5 + 0.25 * 1.5 = 1.875,
    # 0.5 * 2 = 1 -> 2.875. Column 2: 1 * 0.5 + 0.5 * 1.5 = 1.25, 0.25 * 2 = 0.5 -> 1.75.
    w2 = torch.tensor([[0.5, 2.0, 1.5]])
    out2 = reference_combine_reduced(recv_y, [idx], [w2], [scatter], num_experts=2)[0]
    assert _same(out2, torch.tensor([[0.515625, 2.875, 1.75]], dtype=BF16))


def test_group_order_follows_the_first_k():
    # Three ranks, one expert each; the token goes to experts [2, 0, 2, 1]: groups (first k order)
    # rank 2 = {k0, k2} (partial 0.75 + 0.25 = 1), rank 0 = {k1} (2**-24), rank 1 = {k3} (2**-24).
    # First-k order: (1 + 2**-24) + 2**-24 = 1 (each add a tie to even). Rank order:
    # (2**-24 + 2**-24) + 1 = 1 + 2**-23.
    eps = 2.0**-24
    recv_y = [
        torch.tensor([[eps]], dtype=FP32),
        torch.tensor([[eps]], dtype=FP32),
        torch.tensor([[0.75], [0.25]], dtype=FP32),
    ]
    idx = torch.tensor([[2, 0, 2, 1]])
    scatter = torch.tensor([[0, 0, 1, 0]])
    w = torch.ones(1, 4)
    out = reference_combine_reduced(recv_y, [idx], [w], [scatter], num_experts=3)[0]
    p = {2: torch.tensor([1.0]), 0: torch.tensor([eps]), 1: torch.tensor([eps])}
    first_k = torch.zeros(1)
    for d in (2, 0, 1):
        first_k = first_k + p[d]
    by_rank = torch.zeros(1)
    for d in (0, 1, 2):
        by_rank = by_rank + p[d]
    assert first_k.item() == 1.0 and by_rank.item() == 1.0 + 2.0**-23
    assert _same(out, first_k[None])
    assert not torch.equal(out, by_rank[None])
    # Experts [0, 1, 2, 2]: the first-k order is now the rank order, (eps + eps) + 1 = 1 + 2**-23.
    idx2, scatter2 = torch.tensor([[0, 1, 2, 2]]), torch.tensor([[0, 0, 0, 1]])
    out2 = reference_combine_reduced(recv_y, [idx2], [w], [scatter2], num_experts=3)[0]
    assert _same(out2, by_rank[None])


# --------------------------------------------------------------------------------------------------
# the reference against the pull combine and the definition
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_reduced_equals_pull_when_every_token_uses_one_rank(dtype):
    # 4 ranks, 4 experts each, K = 3: a token's valid ids all lie on one rank (some set to -1). One
    # group: the partial is the pull sum, and adding it to zero and rounding again changes nothing.
    world, el, k_top, t, hidden = 4, 4, 3, 40, 48
    g = torch.Generator().manual_seed(3)
    rank_of = torch.randint(0, world, (t,), generator=g)
    local = torch.stack([torch.randperm(el, generator=g)[:k_top] for _ in range(t)])
    idx = rank_of[:, None] * el + local
    idx[torch.rand(t, k_top, generator=g) < 0.2] = -1
    xs = [torch.randn(t, hidden, generator=g).to(dtype)] + [torch.zeros(0, hidden, dtype=dtype)] * (world - 1)
    idxs = [idx] + [torch.zeros(0, k_top, dtype=torch.int64)] * (world - 1)
    ws = [torch.rand(t, k_top, generator=g)] + [torch.zeros(0, k_top)] * (world - 1)
    layout = reference_layout(idxs, world * el)
    recv_y = reference_expert_outputs(reference_dispatch(xs, idxs, ws, layout, t), layout)
    red = reference_combine_reduced(recv_y, idxs, ws, layout.scatter, num_experts=world * el)
    pull = reference_combine(recv_y, idxs, ws, layout.scatter, num_experts=world * el)
    for a, b in zip(red, pull, strict=True):
        assert _same(a, b)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_reduced_equals_pull_with_topk_1(dtype):
    recv_y, idxs, ws, layout = _world(dtype, "dropped", (9, 0, 13, 5), topk=1)
    red = reference_combine_reduced(recv_y, idxs, ws, layout.scatter, num_experts=16)
    pull = reference_combine(recv_y, idxs, ws, layout.scatter, num_experts=16)
    for a, b in zip(red, pull, strict=True):
        assert _same(a, b)


def test_fp32_random_routing_is_close_to_pull_but_need_not_equal_it():
    # Reduced and pull sum the same fp32 products in different association; they are NOT required to be
    # equal, only within the rounding error of a K-term sum: |red - pull| <= 2 (K - 1) eps sum_k |w y|.
    k_top = 4
    recv_y, idxs, ws, layout = _world(FP32, "uniform", (64, 31, 0, 50), topk=k_top, hidden=128)
    red = reference_combine_reduced(recv_y, idxs, ws, layout.scatter, num_experts=16)
    pull = reference_combine(recv_y, idxs, ws, layout.scatter, num_experts=16)
    differ = 0
    for s, (a, b) in enumerate(zip(red, pull, strict=True)):
        # sum_k |w y| with the same routing: the pull combine of |y| with |w|.
        mag = reference_combine([y.abs() for y in recv_y], [idxs[s]], [ws[s].abs()], [layout.scatter[s]],
                                num_experts=16)[0]
        bound = 2 * (k_top - 1) * torch.finfo(FP32).eps * mag
        assert bool(((a - b).abs() <= bound).all()), s
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
        differ += int((a != b).sum())
    assert differ > 0  # this routing does exercise a different association (seeded, deterministic)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
def test_matches_the_definition_with_dropped_ids_and_ragged_ranks(dtype, routing):
    tokens = (5, 0, 17, 9)
    recv_y, idxs, ws, layout = _world(dtype, routing, tokens, hidden=24)
    idxs[3][2].fill_(-1)  # one all-dropped token (its scatter is stale: slots of -1 ids are ignored)
    red = reference_combine_reduced(recv_y, idxs, ws, layout.scatter, num_experts=16)
    assert [tuple(o.shape) for o in red] == [(n, 24) for n in tokens]
    assert all(o.dtype == dtype for o in red)
    for s in range(len(tokens)):
        assert _same(red[s], _naive_reduced(recv_y, idxs[s], ws[s], layout.scatter[s], 16)), s
    assert not bool(red[3][2].any()) and red[1].numel() == 0
    if dtype != FP32 and routing == "uniform":  # the rounding of partials shows somewhere
        pull = reference_combine(recv_y, idxs, ws, layout.scatter, num_experts=16)
        assert any(not torch.equal(a, b) for a, b in zip(red, pull, strict=True))


def test_only_this_ranks_routing_and_int32_ids():
    recv_y, idxs, ws, layout = _world(BF16, "dropped", (7, 12, 3, 0))
    full = reference_combine_reduced(recv_y, idxs, ws, layout.scatter, num_experts=16)
    one = reference_combine_reduced(recv_y, [idxs[1].int()], [ws[1]], [layout.scatter[1].int()],
                                    num_experts=16)
    assert len(one) == 1 and _same(one[0], full[1])


def test_combine_reduced_rows_never_reads_dropped_pairs():
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 3, 8, generator=g).to(BF16)
    idx = torch.tensor([[0, 5, 1], [-1, 2, 3], [-1, -1, -1], [7, -1, 6], [4, 4 + 1, -1], [3, 0, 2]])
    w = torch.rand(6, 3, generator=g)
    poisoned_rows, poisoned_w = rows.clone(), w.clone()
    poisoned_rows[idx < 0] = float("nan")
    poisoned_w[idx < 0] = float("inf")
    out = combine_reduced_rows(rows, idx, w, experts_per_rank=2)
    assert _same(out, combine_reduced_rows(poisoned_rows, idx.int(), poisoned_w, experts_per_rank=2))
    assert not bool(out[2].any()) and bool(torch.isfinite(out).all())
    # The same as the list-of-ranks reference with every (t, k) its own slot on its owner.
    el, world = 2, 4
    recv_y = [torch.zeros(18, 8, dtype=BF16) for _ in range(world)]
    scatter = torch.arange(18).view(6, 3)
    for t in range(6):
        for k in range(3):
            if idx[t, k] >= 0:
                recv_y[int(idx[t, k]) // el][3 * t + k] = rows[t, k]
    ref = reference_combine_reduced(recv_y, [idx], [w], [scatter], num_experts=el * world)[0]
    assert _same(out, ref)
    empty = combine_reduced_rows(rows[:0], idx[:0], w[:0], experts_per_rank=2)
    assert empty.shape == (0, 8) and empty.dtype == BF16


# --------------------------------------------------------------------------------------------------
# argument errors
# --------------------------------------------------------------------------------------------------


def test_argument_errors_raise_value_error():
    recv_y, idxs, ws, layout = _world(BF16, "uniform", (6, 4))
    sc = layout.scatter
    call = lambda *a, **kw: reference_combine_reduced(*a, **{"num_experts": 16, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="must all be the same"):
        call(recv_y, idxs, [ws[0][:, :2], ws[1]], sc)
    with pytest.raises(ValueError, match="must all be the same"):
        call(recv_y, idxs, ws, [sc[0][:3], sc[1]])
    with pytest.raises(ValueError, match="outside recv_y"):
        call(recv_y, idxs, ws, [s + 100 for s in sc])
    with pytest.raises(ValueError, match="outside recv_y"):
        call(recv_y, idxs, ws, [torch.where(i >= 0, -2, s) for i, s in zip(idxs, sc, strict=True)])
    with pytest.raises(ValueError, match="divisible by the world size"):
        call(recv_y, idxs, ws, sc, num_experts=15)
    with pytest.raises(ValueError, match="lengths differ"):
        call(recv_y, idxs, ws[:1], sc)
    with pytest.raises(ValueError, match="must be float32"):
        call(recv_y, idxs, [w.double() for w in ws], sc)
    with pytest.raises(ValueError, match=r"must be \[N, H=64\]"):
        call([recv_y[0], recv_y[1].float()], idxs, ws, sc)
    with pytest.raises(ValueError, match="ids must be in"):
        call(recv_y, [idxs[0] + 16, idxs[1]], ws, sc)
    with pytest.raises(ValueError, match="empty sequence"):
        call([], idxs, ws, sc)
    rows = torch.zeros(6, 4, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"rows must be \[T, K, H\]"):
        combine_reduced_rows(rows, idxs[0][:, :3], ws[0][:, :3], experts_per_rank=8)
    with pytest.raises(ValueError, match=r"rows must be \[T, K, H\]"):
        combine_reduced_rows(rows[0], idxs[0], ws[0], experts_per_rank=8)
    with pytest.raises(ValueError, match="must be float32"):
        combine_reduced_rows(rows, idxs[0], ws[0].half(), experts_per_rank=8)
    with pytest.raises(ValueError, match="integer tensor"):
        combine_reduced_rows(rows, idxs[0].float(), ws[0], experts_per_rank=8)
    with pytest.raises(ValueError, match="floating point"):
        combine_reduced_rows(rows.int(), idxs[0], ws[0], experts_per_rank=8)
    with pytest.raises(ValueError, match="experts_per_rank"):
        combine_reduced_rows(rows, idxs[0], ws[0], experts_per_rank=0)


def test_resolve_combine_algorithm():
    shape = dict(world_size=1, local_world_size=1, num_experts=4, topk=2, hidden=32, dtype=BF16, max_tokens=8)
    pull, reduced = EpConfig(**shape), EpConfig(**shape, combine_algorithm="reduced")
    assert resolve_combine_algorithm(pull) == "pull" and resolve_combine_algorithm(reduced) == "reduced"
    assert resolve_combine_algorithm(reduced, "pull") == "pull"
    assert resolve_combine_algorithm(reduced, "reduced") == "reduced"
    with pytest.raises(ValueError, match=PULL_ONLY):
        resolve_combine_algorithm(pull, "reduced")
    with pytest.raises(ValueError, match="combine algorithm must be one of"):
        resolve_combine_algorithm(reduced, "push")


# --------------------------------------------------------------------------------------------------
# the host backends: a world of one in process
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [A2aEpBuffer, ReferenceEpBuffer], ids=["a2a", "reference"])
def test_world_of_one_backends(cls):
    # One rank: every token's group is on rank 0, so reduced equals pull; this checks the plumbing
    # (default, explicit, pull on a reduced config, the error on a pull config, dropped pairs).
    shape = dict(world_size=1, local_world_size=1, num_experts=8, topk=3, hidden=32, dtype=BF16,
                 max_tokens=16)
    x, idx, w = make_inputs(0, 13, 32, 8, 3, BF16, 11, routing="dropped")
    with cls(world_of_one(), EpConfig(**shape, combine_algorithm="reduced")) as buf:
        res = buf.dispatch(x, idx, w)
        y = apply_test_expert(res.recv_x, global_expert_of_rows(res.tokens_per_expert, 0))
        args = ([y], [idx], [w], [res.handle.scatter])
        want = reference_combine_reduced(*args, num_experts=8)[0]
        assert _same(buf.combine(y, res.handle), want)
        assert _same(buf.combine(y, res.handle, algorithm="reduced"), want)
        assert _same(buf.combine(y, res.handle, algorithm="pull"), reference_combine(*args, num_experts=8)[0])
        only0 = res.handle.topk_idx.clone()
        only0[:, 1:] = -1
        h = dataclasses.replace(res.handle, topk_idx=only0)
        want0 = reference_combine_reduced([y], [only0], [w], args[3], num_experts=8)[0]
        assert _same(buf.combine(y, h), want0)
        with pytest.raises(ValueError, match="combine algorithm must be one of"):
            buf.combine(y, res.handle, algorithm="push")
    with cls(world_of_one(), EpConfig(**shape)) as buf:
        res = buf.dispatch(x, idx, w)
        y = apply_test_expert(res.recv_x, global_expert_of_rows(res.tokens_per_expert, 0))
        with pytest.raises(ValueError, match=PULL_ONLY):
            buf.combine(y, res.handle, algorithm="reduced")
        want = reference_combine([y], [idx], [w], [res.handle.scatter], num_experts=8)[0]
        assert _same(buf.combine(y, res.handle), want)  # still usable
        assert _same(buf.combine(y, res.handle, algorithm="pull"), want)


# --------------------------------------------------------------------------------------------------
# the host backends: a gloo world of 4 ranks
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return worker_results(WORKER, 4, tmp_path_factory.mktemp("reduced4"), timeout=120)


@needs_gloo
def test_backends_match_reference_combine_reduced_bit_for_bit(ranks):
    assert_cases_match(ranks, 7)


@needs_gloo
def test_the_cases_differ_from_pull_and_drop_pairs(ranks):
    # Otherwise a backend that ignored the algorithm would pass the test above.
    by_case: dict[str, list[dict]] = {}
    for res in ranks:
        for case in res["cases"]:
            by_case.setdefault(case["name"], []).append(case)
    for name, cases in by_case.items():
        differs = sum(c["differs_from_pull"] for c in cases)
        assert (differs == 0) == name.endswith("-empty"), (name, differs)
    capacity = by_case["uniform-bf16-k4-el2-capacity"]
    assert sum(c["dropped_pairs"] for c in capacity) > 0 and sum(c["kept_pairs"] for c in capacity) > 0


# scenario -> (rank at fault, or None when every rank is; what the rank at fault reads; what the others read)
BAD = {
    "reduced_on_pull_config": (None, "combine algorithm 'reduced' needs "
                               "EpConfig(combine_algorithm='reduced') (got 'pull')", ""),
    "reduced_on_pull_config_on_last": (3, "needs EpConfig(combine_algorithm='reduced') (got 'pull')",
                                       "on another rank: rank 3:"),
    "unknown_on_rank0": (0, "combine algorithm must be one of ['pull', 'reduced'], got 'fancy'",
                         "on another rank: rank 0:"),
    "mismatch": (None, "every rank must use the same combine algorithm, got ['pull', 'reduced', 'reduced', "
                 "'reduced'] (by rank)", ""),
}  # fmt: skip


@needs_gloo
@pytest.mark.parametrize("backend", ["a2a", "reference"])
@pytest.mark.parametrize("scenario", sorted(BAD))
def test_a_bad_algorithm_raises_on_every_rank(ranks, backend, scenario):
    at_fault, own, others = BAD[scenario]
    assert_raised_on_every_rank(ranks, f"{backend}_{scenario}", at_fault, own, [others, own])


@needs_gloo
@pytest.mark.parametrize("backend", ["a2a", "reference"])
def test_the_buffers_stay_usable_after_bad_algorithms(ranks, backend):
    for res in ranks:
        assert res["bad"][f"{backend}_usable_after_errors"]["ok"]
