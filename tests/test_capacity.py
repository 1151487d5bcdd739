"""Expert capacity: validators/capacity.py against a literal Python loop, EpConfig's arithmetic, and the
host backends (reference, all-to-all) dropping rows in a world of one (under torchrun, in gloo worlds of 2
and 4 ranks: tests/test_capacity_fp8_torchrun.py)."""

from __future__ import annotations

import pytest
import torch
from _worlds import HOST_BACKENDS, expected_dispatch, expert_outputs, host_config, world_of_one

from cute_ep.capacity import (
    apply_expert_capacity,
    capacity_keep,
    check_atomic_drops,
    effective_topk_from_scatter,
    expert_counts,
    kept_counts,
)
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import ConfigError, EpConfig
from cute_ep.reference import reference_combine, reference_layout
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.status import CapacityExceeded, capacity_error


def naive_capacity(topk_idx, num_experts, capacity):
    """The rule written out: per expert, sources in rank order, each in (t, k) order; keep the first C."""
    seen = [0] * num_experts
    dropped = [0] * num_experts
    out = []
    for idx in topk_idx:
        eff = idx.clone()
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                if seen[e] >= capacity:
                    eff[t, k] = -1
                    dropped[e] += 1
                seen[e] += 1
        out.append(eff)
    return out, dropped


def random_routing(world, experts, topk, seed, tokens=None, idx_dtype=torch.int64, routing="dropped"):
    """Per rank [T_s, K] routing from make_inputs (distinct experts per token, some -1)."""
    out = []
    for s in range(world):
        t = tokens[s] if tokens is not None else (3 * s + seed) % 11
        _, idx, _ = make_inputs(
            s, t, 8, experts, topk, torch.float32, seed, routing=routing, idx_dtype=idx_dtype
        )
        out.append(idx)
    return out


# --------------------------------------------------------------------------------------------------
# validators/capacity.py
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("capacity", [1, 2, 5, 1000])
@pytest.mark.parametrize("routing", ["dropped", "skewed"])
def test_apply_expert_capacity_matches_the_literal_rule(world, capacity, routing):
    experts, topk = 2 * world, min(3, 2 * world)
    for seed in range(3):
        idx = random_routing(
            world, experts, topk, seed, routing=routing, idx_dtype=torch.int32 if seed == 1 else torch.int64
        )
        eff, dropped = apply_expert_capacity(idx, experts, capacity)
        want, want_dropped = naive_capacity(idx, experts, capacity)
        assert len(eff) == world
        for s in range(world):
            assert eff[s].dtype == idx[s].dtype and eff[s].shape == idx[s].shape
            assert torch.equal(eff[s], want[s]), (s, idx[s], eff[s], want[s])
        assert dropped.dtype == torch.int64 and dropped.tolist() == want_dropped
        # The effective routing's layout keeps at most C rows per expert, and kept + dropped = routed.
        layout = reference_layout(eff, experts)
        assert int(layout.counts.sum(0).max()) <= capacity
        routed = reference_layout(idx, experts).counts
        assert torch.equal(layout.counts.sum(0) + dropped, routed.sum(0))
        assert torch.equal(layout.counts, kept_counts(routed, capacity))
        if capacity >= 1000:
            assert not bool(dropped.any())


def test_capacity_keep_is_the_per_source_view():
    idx = random_routing(3, 6, 2, seed=4, tokens=(9, 0, 10), routing="skewed")
    counts = torch.stack([expert_counts(i, 6) for i in idx])
    before = torch.cumsum(counts, 0) - counts
    eff, _ = apply_expert_capacity(idx, 6, 4)
    for s in range(3):
        keep = capacity_keep(idx[s], before[s], 4)
        assert keep.dtype == torch.bool and torch.equal(keep, eff[s] >= 0)


def test_every_pair_dropped_and_empty_ranks():
    idx = [
        torch.zeros(0, 2, dtype=torch.int64),
        torch.full((4, 2), -1),
        torch.tensor([[0, 1], [1, 0], [0, 1]]),
    ]
    eff, dropped = apply_expert_capacity(idx, 3, 1)
    assert eff[0].shape == (0, 2) and torch.equal(eff[1], idx[1])
    assert eff[2].tolist() == [[0, 1], [-1, -1], [-1, -1]]
    assert dropped.tolist() == [2, 2, 0]


@pytest.mark.parametrize(
    "args, match",
    [
        (([torch.zeros(2, 2, dtype=torch.int64)], 4, 0), "expert_capacity must be an int >= 1"),
        (([torch.zeros(2, 2, dtype=torch.int64)], 4, -3), "expert_capacity must be an int >= 1"),
        (([torch.zeros(2, 2, dtype=torch.int64)], 4, 2.5), "expert_capacity must be an int >= 1"),
        (([torch.zeros(2, 2, dtype=torch.int64)], 4, True), "expert_capacity must be an int >= 1"),
        (([torch.zeros(2, 2, dtype=torch.int64)], 0, 2), "num_experts must be an int >= 1"),
        (([], 4, 2), "one \\[T, K\\] tensor per rank"),
        (([torch.tensor([[0, 4]])], 4, 2), r"ids must be in \[-1, 4\), got range \[0, 4\]"),
        (([torch.tensor([[-2, 1]])], 4, 2), r"ids must be in \[-1, 4\)"),
        (([torch.zeros(2, 2), torch.zeros(2, 2)], 4, 2), "must be an integer tensor"),
        (([torch.zeros(2, dtype=torch.int64)], 4, 2), "must be 2-D"),
        (([torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64)], 4, 2), "same K"),
    ],
)
def test_apply_expert_capacity_argument_errors(args, match):
    with pytest.raises(ValueError, match=match):
        apply_expert_capacity(*args)


def test_kept_counts_and_capacity_keep_argument_errors():
    with pytest.raises(ValueError, match="counts must be a 2-D"):
        kept_counts(torch.zeros(4), 2)
    with pytest.raises(ValueError, match="expert_capacity must be an int >= 1"):
        kept_counts(torch.zeros(2, 4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="before must be 1-D"):
        capacity_keep(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 4), 2)


def test_effective_topk_from_scatter():
    idx = random_routing(2, 4, 2, seed=7, tokens=(10, 6), routing="skewed")
    eff, _ = apply_expert_capacity(idx, 4, 3)
    layout = reference_layout(eff, 4)
    for s in range(2):
        got = effective_topk_from_scatter(idx[s], layout.scatter[s].to(torch.int32))
        assert got.dtype == idx[s].dtype and torch.equal(got, eff[s])
    with pytest.raises(ValueError, match="same \\[T, K\\] shape"):
        effective_topk_from_scatter(idx[0], layout.scatter[1])
    with pytest.raises(ValueError, match="scatter must be an integer tensor"):
        effective_topk_from_scatter(idx[0], layout.scatter[0].float())


def test_check_atomic_drops_accepts_other_pairs_but_not_other_counts():
    # Source 0 routes 4 tokens to expert 0 and keeps 2 of them (capacity 2).
    idx = [torch.tensor([[0, 1], [0, 2], [0, -1], [0, 3]]), torch.tensor([[1, 0]])]
    eff, _ = apply_expert_capacity(idx, 4, 2)
    assert eff[0][:, 0].tolist() == [0, 0, -1, -1] and eff[1].tolist() == [[1, -1]]
    assert check_atomic_drops(eff, eff, 4) == []
    other = [eff[0].clone(), eff[1].clone()]
    other[0][:, 0] = torch.tensor([-1, 0, 0, -1])  # atomic mode kept other rows of the same group
    assert check_atomic_drops(other, eff, 4) == []
    wrong = [eff[0].clone(), eff[1].clone()]
    wrong[0][2, 0] = 0  # one row too many for (expert 0, source 0)
    problems = check_atomic_drops(wrong, eff, 4)
    assert problems == ["expert 0, source 0: atomic mode kept 3 rows, scatter mode 2"]
    moved = [eff[0].clone(), eff[1].clone()]
    moved[0][0, 1] = 3  # a kept pair that names another expert
    problems = check_atomic_drops(moved, eff, 4)
    assert any("pair (t=0, k=1) goes to expert 3 in atomic mode, 1 in scatter mode" in p for p in problems)
    assert check_atomic_drops(eff[:1], eff, 4) == ["atomic routing covers 1 ranks, scatter routing 2"]
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        check_atomic_drops(eff, eff, 0)


# --------------------------------------------------------------------------------------------------
# EpConfig arithmetic
# --------------------------------------------------------------------------------------------------


def _config(**kw) -> EpConfig:
    return host_config(**{**dict(world_size=2, local_world_size=2, num_experts=8, max_tokens=20), **kw})


def test_expert_capacity_and_required_capacity():
    # share = R * M * K / E = 2 * 20 * 2 / 8 = 10 rows per expert at full batch.
    assert _config().expert_capacity == 40  # no limit: R * M, the most one expert can get
    assert _config().required_capacity == 2 * 20 * 2 == _config().capacity
    c = _config(capacity_factor=1.1)
    assert c.expert_capacity == 11  # not ceil(11.000000000000002) = 12
    assert c.required_capacity == min(2 * 20 * 2, 4 * 11) == 44 == c.capacity
    assert _config(capacity_factor=1.0).expert_capacity == 10
    assert _config(capacity_factor=1.25).expert_capacity == 13  # ceil(12.5)
    assert _config(capacity_factor=0.001).expert_capacity == 1  # at least one row
    assert _config(capacity_factor=100.0).expert_capacity == 40  # at most R * M
    assert _config(capacity_factor=100.0).required_capacity == 80
    assert _config(capacity_factor=1.1, capacity=60).capacity == 60
    with pytest.raises(ConfigError, match="capacity must be >= .* = 44, got 43"):
        _config(capacity_factor=1.1, capacity=43)
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="capacity_factor must be a finite number >= 0"):
            _config(capacity_factor=bad)
    with pytest.raises(ConfigError, match="on_overflow must be one of"):
        _config(on_overflow="ignore")


def test_capacity_error_message_names_experts_and_counts():
    cfg = _config(capacity_factor=0.5)
    assert capacity_error(cfg, torch.zeros(8, dtype=torch.int64)) is None
    err = capacity_error(cfg, torch.tensor([0, 3, 0, 0, 0, 7, 0, 0]), result="r")
    assert isinstance(err, CapacityExceeded) and err.dropped == {1: 3, 5: 7} and err.total == 10
    assert err.result == "r"
    assert "expert 1 (rank 0): 3" in str(err) and "expert 5 (rank 1): 7" in str(err)


# --------------------------------------------------------------------------------------------------
# backends in a world of one
# --------------------------------------------------------------------------------------------------


def _cfg1(factor: float, overflow: str, dtype=torch.bfloat16, topk=2) -> EpConfig:
    return host_config(topk=topk, dtype=dtype, capacity_factor=factor, on_overflow=overflow)


def _check_result(res, cfg, x, idx, w, buf, check_scatter=True):
    eff, dropped, layout, recv = expected_dispatch(cfg, x, idx, w)
    assert res.num_recv == recv.num_recv
    assert torch.equal(res.recv_x, recv.recv_x)
    assert torch.equal(res.recv_weights, recv.recv_w) and torch.equal(res.recv_src, recv.recv_src)
    assert torch.equal(res.tokens_per_expert, layout.tokens_per_expert[0].to(torch.int32))
    assert int(res.tokens_per_expert.max()) <= cfg.expert_capacity
    if check_scatter:
        assert torch.equal(res.handle.scatter, layout.scatter[0].to(torch.int32))
    assert torch.equal(effective_topk_from_scatter(idx, res.handle.scatter), eff)
    assert torch.equal(res.handle.topk_idx, idx.to(torch.int32))  # the caller's routing, kept
    y = expert_outputs(res)
    want = reference_combine([y], [eff], [w], [res.handle.scatter], num_experts=cfg.num_experts)[0]
    assert torch.equal(buf.combine(y, res.handle), want)
    return dropped


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_drop_policy_returns_the_effective_routing_and_counts(backend, dtype):
    cfg = _cfg1(0.5, "drop", dtype)  # expert_capacity = ceil(0.5 * 16 * 2 / 4) = 4
    assert cfg.expert_capacity == 4
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        total = torch.zeros(4, dtype=torch.int64)
        for seed, tokens in ((1, 16), (2, 9), (3, 0)):
            x, idx, w = make_inputs(0, tokens, 32, 4, 2, dtype, seed, routing="skewed")
            res = buf.dispatch(x, idx, w)
            total += _check_result(res, cfg, x, idx, w, buf)
            buf.check_capacity(res)  # "drop": never raises
        assert int(total.sum()) > 0
        assert torch.equal(buf.dropped_rows(), total)
        assert torch.equal(buf.dropped_rows(), torch.zeros(4, dtype=torch.int64))  # reset


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_raise_policy_raises_with_a_complete_result(backend):
    cfg = _cfg1(0.25, "raise")  # expert_capacity 2
    x, idx, w = make_inputs(0, 16, 32, 4, 2, torch.bfloat16, 5, routing="skewed")
    _, dropped, _, _ = expected_dispatch(cfg, x, idx, w)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        with pytest.raises(CapacityExceeded) as info:
            buf.dispatch(x, idx, w)
        exc = info.value
        assert exc.dropped == {e: int(n) for e, n in enumerate(dropped.tolist()) if n}
        assert exc.total == int(dropped.sum()) > 0
        for e, n in exc.dropped.items():
            assert f"expert {e} (rank 0): {n}" in str(exc)
        assert "expert_capacity=2" in str(exc)
        _check_result(exc.result, cfg, x, idx, w, buf)  # complete and usable for combine
        assert not bool(buf.dropped_rows().any())  # the raise reported (and reset) the drops
        buf.check_capacity()  # nothing pending
        # A routing within capacity does not raise.
        few = torch.tensor([[0, 1], [2, 3]])
        res = buf.dispatch(x[:2].contiguous(), few, w[:2].contiguous())
        assert res.num_recv == 4


def test_reference_atomic_mode_keeps_the_scatter_rows():
    cfg = _cfg1(0.5, "drop")
    with ReferenceEpBuffer(world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 16, 32, 4, 2, torch.bfloat16, 6, routing="skewed")
        sc = buf.dispatch(x, idx, w)
        eff_sc = effective_topk_from_scatter(idx, sc.handle.scatter)
        y_sc = expert_outputs(sc)
        out_sc = buf.combine(y_sc, sc.handle)
        at = buf.dispatch(x, idx, w, mode="atomic")
        eff_at = effective_topk_from_scatter(idx, at.handle.scatter)
        assert torch.equal(eff_at, eff_sc) and check_atomic_drops([eff_at], [eff_sc], 4) == []
        assert torch.equal(at.tokens_per_expert, sc.tokens_per_expert)
        y_at = expert_outputs(at)
        assert torch.equal(buf.combine(y_at, at.handle), out_sc)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_no_factor_never_drops(backend, layout):
    cfg = _cfg1(0.0, "raise", topk=4)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = make_inputs(0, 16, 32, 4, 4, torch.bfloat16, 8, routing="skewed")
        # Every expert gets all 16 tokens: R * M = expert_capacity (rank layout: one row per token,
        # naming all 4 local experts).
        res = buf.dispatch(x, idx, w, layout=layout)
        assert res.num_recv == (64 if layout == "expert" else 16) and cfg.rank_capacity == 16
        assert res.tokens_per_expert.tolist() == [16] * 4 and not bool(buf.dropped_rows().any())


# --------------------------------------------------------------------------------------------------
# check_capacity_drops (validators.checks): the distributed check the scripts run, in a world of one
# --------------------------------------------------------------------------------------------------


def _one_rank_case():
    from cute_ep.reference import reference_layout

    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]], dtype=torch.int32)  # expert 0 gets 4 pairs
    eff, dropped = apply_expert_capacity([idx], 4, 2)
    scatter = reference_layout(eff, 4).scatter[0].to(torch.int32)
    return idx, eff[0], dropped, scatter


def test_check_capacity_drops_passes_the_rule_and_returns_the_effective_routing():
    from cute_ep.validators.checks import check_capacity_drops

    idx, eff, dropped, scatter = _one_rank_case()
    assert dropped.tolist() == [2, 0, 0, 0]
    res, got = check_capacity_drops(idx, scatter, dropped, num_experts=4, expert_capacity=2)
    assert res.passed, res.message
    assert torch.equal(got, eff) and got.dtype == idx.dtype
    assert got[:, 0].tolist() == [0, 0, -1, 3] and got[3, 1] == -1  # expert 0 keeps its first 2 pairs
    res, _ = check_capacity_drops(idx, scatter, dropped, num_experts=4, expert_capacity=2, ordered=False)
    assert res.passed, res.message


def test_check_capacity_drops_catches_wrong_counts_and_wrong_pairs():
    from cute_ep.validators.checks import check_capacity_drops

    idx, _, dropped, scatter = _one_rank_case()
    res, _ = check_capacity_drops(idx, scatter, dropped + 1, num_experts=4, expert_capacity=2)
    assert not res.passed and "dropped per expert [3, 1, 1, 1], expected [2, 0, 0, 0]" in res.message
    swapped = scatter.clone()
    swapped[0, 0], swapped[2, 0] = -1, 5  # keeps pair (2, 0), drops (0, 0): the wrong rows of expert 0
    res, _ = check_capacity_drops(idx, swapped, dropped, num_experts=4, expert_capacity=2)
    assert not res.passed and "pair (t=0, k=0) to expert 0 was dropped, the rule keeps it" in res.message
    # Atomic mode may keep other pairs of a source, as many as the rule: the same swap passes there.
    res, _ = check_capacity_drops(idx, swapped, dropped, num_experts=4, expert_capacity=2, ordered=False)
    assert res.passed, res.message
    fewer = scatter.clone()
    fewer[0, 0] = -1  # one pair too few kept for expert 0
    res, _ = check_capacity_drops(idx, fewer, dropped, num_experts=4, expert_capacity=2, ordered=False)
    assert not res.passed and "expert 0, source 0: atomic mode kept 1 rows, scatter mode 2" in res.message
