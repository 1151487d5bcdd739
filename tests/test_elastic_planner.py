"""ElasticExperts (cute_ep.elastic) in one process: the planner against a plain-Python statement of its
rule, its properties over many random loads, routing over R simulated ranks, the fixed-shape / no
host sync property (everything runs on the meta device, where reading a value back fails), a world of
one, the Zipf routing generator and the argument errors. The distributed checks run under torchrun in
tests/test_elastic_torchrun.py."""

from __future__ import annotations

import pytest
import torch

from cute_ep import ElasticExperts
from cute_ep.elastic import ClonePlan, CollectiveTransport, break_even_rows, count_tokens, plan_clones
from cute_ep.skew import zipf_probs, zipf_topk


def python_rule(counts: torch.Tensor, spare: int, cap: int | None, min_gain: int) -> list[list[int]]:
    """The planner's rule as the module docstring states it, in plain Python: slot_expert [R][S]."""
    R, E = counts.shape
    el = E // R
    total = counts.sum(0).tolist()
    holders = [[e // el] for e in range(E)]
    slot_expert = [[-1] * spare for _ in range(R)]
    used = [0] * R

    def share(e: int, hs: list[int], r: int) -> int:  # rows of e on r under the round robin
        hs = sorted(hs)
        return max(0, (total[e] - hs.index(r) + len(hs) - 1) // len(hs)) if r in hs else 0

    def loads(hold: list[list[int]]) -> list[int]:
        return [sum(share(e, hold[e], r) for e in range(E)) for r in range(R)]

    for _ in range(R * spare if cap is None else min(R * spare, cap)):
        load = loads(holders)
        h = load.index(max(load))
        best = None
        for e in range(E):
            if share(e, holders[e], h) == 0:
                continue
            free = [r for r in range(R) if used[r] < spare and r not in holders[e]]
            if not free:
                continue
            d = min(free, key=lambda r: (load[r], r))
            after = loads([hs + [d] if i == e else hs for i, hs in enumerate(holders)])
            if after[d] < load[h] and load[h] - after[h] >= min_gain:
                score = max(after[h], after[d])
                if best is None or score < best[0]:
                    best = (score, e, d)
        if best is None:
            break
        _, e, d = best
        holders[e].append(d)
        slot_expert[d][used[d]] = e
        used[d] += 1
    return slot_expert


def random_counts(g: torch.Generator, R: int, el: int, hot: int = 3) -> torch.Tensor:
    """[R, E] counts: a small uniform background plus a few hot experts."""
    E = R * el
    counts = torch.randint(0, 20, (R, E), generator=g)
    for e in torch.randperm(E, generator=g)[:hot].tolist():
        counts[:, e] += torch.randint(20, 400, (R,), generator=g)
    if torch.rand((), generator=g) < 0.2:
        counts[:, torch.randperm(E, generator=g)[: E // 2]] = 0  # many idle experts
    return counts


SHAPES = [(1, 4, 2), (2, 2, 1), (2, 4, 3), (3, 2, 2), (4, 8, 2), (8, 2, 1), (5, 3, 4)]  # (R, E / R, S)
CASES = [(R, el, S, cap, gain) for R, el, S in SHAPES
         for cap, gain in [(None, 1), (2, 1), (None, 40), (0, 1)]]


@pytest.mark.parametrize(("R", "el", "S", "cap", "gain"), CASES)
def test_planner_follows_its_stated_rule_and_keeps_its_promises(R, el, S, cap, gain):
    g = torch.Generator().manual_seed(R * 1000 + el * 100 + S * 10 + (cap or 0) + gain)
    for trial in range(3):
        counts = random_counts(g, R, el)
        plan = plan_clones(counts, S, max_clones=cap, min_gain_rows=gain)
        assert plan.slot_expert.tolist() == python_rule(counts, S, cap, gain), trial
        check_plan(plan, counts, S, R * S if cap is None else min(R * S, cap))


def check_plan(plan: ClonePlan, counts: torch.Tensor, S: int, cap: int) -> None:
    R, E = counts.shape
    el, P = E // R, E // R + S
    se = plan.slot_expert
    assert se.shape == (R, S) and plan.replicas.shape == (E, R) and plan.rows_per_rank.shape == (R,)
    assert int((se >= 0).sum()) == int(plan.num_clones) <= cap
    for r in range(R):  # a rank holds an expert at most once, and never clones its own
        held = [e for e in se[r].tolist() if e >= 0]
        assert len(set(held)) == len(held) and all(e // el != r for e in held), (r, held)
        assert se[r].tolist() == held + [-1] * (S - len(held))  # slots fill in order
    for e in range(E):  # every logical expert keeps its home slot; replicas ascend
        n = int(plan.num_replicas[e])
        reps = plan.replicas[e].tolist()
        assert reps[n:] == [-1] * (R - n) and reps[:n] == sorted(reps[:n])
        assert (e // el) * P + e % el in reps[:n]
        clones = [r * P + el + s for r in range(R) for s in range(S) if int(se[r, s]) == e]
        assert sorted(clones + [(e // el) * P + e % el]) == reps[:n]
    home_rows = counts.sum(0).view(R, el).sum(1)
    assert plan.rows_without.tolist() == home_rows.tolist()
    assert int(plan.rows_per_rank.sum()) == int(counts.sum())
    assert int(plan.rows_per_rank.max()) <= int(plan.rows_without.max())  # never worse than no cloning


def test_planner_is_deterministic_and_takes_int32_counts():
    counts = random_counts(torch.Generator().manual_seed(3), 4, 8, hot=6)
    a, b = plan_clones(counts, 2), plan_clones(counts.to(torch.int32), 2)
    for f in ("slot_expert", "replicas", "num_replicas", "rows_per_rank", "rows_without", "num_clones"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_zipf_skew_peak_falls_towards_the_mean():
    R, E, K, T = 8, 256, 8, 1024
    idx = [zipf_topk(r, T, E, K, 1.2, seed=4) for r in range(R)]
    plan = plan_clones(torch.stack([count_tokens(i, E) for i in idx]), 2)
    mean = T * K / 1.0  # rows per rank on average: every (token, k) lands somewhere
    assert int(plan.rows_without.max()) > 1.3 * mean  # the skew is real
    assert int(plan.rows_per_rank.max()) < 0.85 * int(plan.rows_without.max()), plan.rows_per_rank


class GatheredCounts:
    """A CloneTransport of one of R simulated ranks whose all-gather returns precomputed counts."""

    def __init__(self, rank: int, counts: torch.Tensor) -> None:
        self.rank, self.world_size, self.counts = rank, counts.shape[0], counts

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        assert torch.equal(t, self.counts[self.rank])
        return self.counts.clone()


class SameEverywhere:
    """A CloneTransport of rank ``rank`` of R whose all-gather gives every rank this rank's tensor."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t[None].expand(self.world_size, *t.shape).clone()


@pytest.mark.parametrize(("R", "el", "S"), [(2, 4, 1), (4, 4, 2), (3, 2, 3)])
def test_routing_spreads_rows_evenly_and_matches_the_plan(R, el, S):
    E, K = R * el, 3
    idx = [zipf_topk(r, 40 + 7 * r, E, K, 1.3, seed=R) for r in range(R)]
    idx[0][::5, 1] = -1  # dropped pairs stay dropped
    counts = torch.stack([count_tokens(i, E) for i in idx])
    assert torch.equal(counts[0], torch.bincount(idx[0][idx[0] >= 0], minlength=E))
    routed, plan = [], None
    for r in range(R):
        ee = ElasticExperts(E, S, transport=GatheredCounts(r, counts))
        plan = ee.plan(idx[r])
        routed.append(ee.route(idx[r], plan))
        assert routed[-1].dtype == torch.int32 and routed[-1].shape == idx[r].shape
    assert int(plan.num_clones) >= 1
    p2l = plan.physical_to_logical()
    P = el + S
    for r in range(R):
        phys = routed[r].long()
        assert torch.equal(torch.where(phys >= 0, p2l[phys.clamp(min=0)], -1), idx[r])
        for row in phys.tolist():  # a token's physical ids stay distinct
            ids = [p for p in row if p >= 0]
            assert len(set(ids)) == len(ids)
    every = torch.cat([p.reshape(-1) for p in routed]).long()
    every = every[every >= 0]
    per_slot = torch.bincount(every, minlength=R * P)
    assert per_slot.view(R, P).sum(1).tolist() == plan.rows_per_rank.tolist()
    for e in range(E):  # a hot expert's rows split evenly over its replicas
        reps = plan.replicas[e][: int(plan.num_replicas[e])]
        got = per_slot[reps]
        assert int(got.max() - got.min()) <= 1 and int(got.sum()) == int(counts[:, e].sum()), (e, got)


def test_plan_and_route_need_no_host_sync_and_have_fixed_shapes():
    # On the meta device a tensor has no values: any read back to the host, or a shape that depends on
    # the data, raises. The shapes must depend on (R, E, S, T, K) only.
    R, E, S = 4, 32, 2
    counts = torch.randint(0, 100, (R, E)).to("meta")
    plan = plan_clones(counts, S, max_clones=5, min_gain_rows=3)
    assert plan.slot_expert.shape == (R, S) and plan.replicas.shape == (E, R) and plan.num_clones.shape == ()
    ee = ElasticExperts(E, S, transport=SameEverywhere(1, R))
    idx = torch.randint(-1, E, (16, 4)).to("meta")
    assert ee.route(idx, ee.plan(idx)).shape == (16, 4)
    # The weight copy and the gradient return on the meta device, in a world of one.
    one = ElasticExperts(8, 2)
    p1 = one.plan(idx.clamp(max=7))
    home = torch.randn(8, 3, 4).to("meta")
    clones = one.clone_weights(home, p1)
    assert clones.shape == (2, 3, 4)
    assert one.reduce_grads(home, clones, p1).shape == (8, 3, 4)


def test_world_of_one_places_no_clone_and_keeps_the_weights():
    ee = ElasticExperts(6, 2)  # no process group: a world of one
    assert (ee.rank, ee.world_size, ee.num_physical) == (0, 1, 8)
    idx = torch.tensor([[0, 1], [0, 2], [0, -1]])
    plan = ee.plan(idx)
    assert int(plan.num_clones) == 0 and plan.rows_per_rank.tolist() == [5]
    assert torch.equal(ee.route(idx, plan), idx.to(torch.int32))  # P = 8: expert e stays in slot e
    home = torch.randn(6, 4, dtype=torch.bfloat16)
    clones = ee.clone_weights(home, plan)
    assert clones.shape == (2, 4) and not clones.any()
    grad = ee.reduce_grads(home, torch.ones(2, 4), plan)  # empty slots add nothing
    assert grad.dtype == torch.float32 and torch.equal(grad, home.float())
    assert torch.equal(ee.reduce_grads(None, None, plan, like=home), torch.zeros(6, 4))
    assert ee.slot_weights(home, clones).shape == (8, 4)


def test_collective_transport_without_a_group_is_a_world_of_one():
    t = CollectiveTransport()
    assert (t.rank, t.world_size) == (0, 1)
    assert torch.equal(t.all_gather(torch.arange(3)), torch.arange(3)[None])


def test_break_even_rows_of_a_deepseek_expert():
    expert = 3 * 7168 * 2048 * 2  # bytes of bf16 weights
    row = 2 * 3 * 7168 * 2048 / 700e12  # seconds per row at 700 TFLOP/s
    rows = break_even_rows(expert, 400e9, row)  # 0.22 ms of copy / 0.126 us per row
    assert 1740 <= rows <= 1760, rows
    assert abs(break_even_rows(expert, 400e9, 2 * row) - rows / 2) <= 1
    assert break_even_rows(0, 1.0, 1.0) == 1
    with pytest.raises(ValueError, match="copy_bytes_per_s > 0"):
        break_even_rows(1, 0, 1)


def test_zipf_routing_is_skewed_distinct_and_moves_with_the_step():
    p = zipf_probs(64, 1.2, seed=1)
    assert abs(float(p.sum()) - 1) < 1e-12 and float(p.max()) > 10 * float(p.median())
    assert torch.equal(zipf_probs(64, 1.2, seed=1), p)  # the same on every rank
    assert not torch.equal(zipf_probs(64, 1.2, seed=1, step=1), p)  # the hot set moves
    assert torch.allclose(zipf_probs(16, 0.0, seed=2), torch.full((16,), 1 / 16, dtype=torch.float64))
    idx = zipf_topk(3, 500, 64, 8, 1.2, seed=1)
    assert idx.shape == (500, 8) and all(len(set(row)) == 8 for row in idx.tolist())
    assert torch.equal(zipf_topk(3, 500, 64, 8, 1.2, seed=1), idx)
    assert not torch.equal(zipf_topk(2, 500, 64, 8, 1.2, seed=1), idx)
    hot = int(torch.argmax(p))
    assert int((idx == hot).sum()) > 300  # the hottest expert is in most tokens' top-8
    assert zipf_topk(0, 0, 8, 2, 1.0, 0, dtype=torch.int32).shape == (0, 2)


ZEROS = torch.zeros(2, 4, dtype=torch.int64)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: plan_clones(torch.zeros(2, 5, dtype=torch.int64), 1), "divisible by the ranks R=2"),
        (lambda: plan_clones(torch.zeros(2, 4), 1), "int32 or int64"),
        (lambda: plan_clones(ZEROS, -1), "spare_slots must be >= 0, got -1"),
        (lambda: plan_clones(ZEROS, 1, max_clones=-2), "max_clones must be >= 0"),
        (lambda: plan_clones(ZEROS, 1, min_gain_rows=0), "min_gain_rows must be >= 1, got 0"),
        (lambda: ElasticExperts(0, 1), "num_experts=0 must be >= 1"),
        (lambda: ElasticExperts(4, -1), "spare_slots must be >= 0"),
        (lambda: ElasticExperts(4, 1).plan(torch.zeros(3, dtype=torch.int64)),
         r"topk_idx must be \[T, K\] int32 or int64, got shape \(3,\)"),
        (lambda: ElasticExperts(4, 1).plan(torch.zeros(3, 2)), "int32 or int64"),
        (lambda: ElasticExperts(4, 1).clone_weights(torch.zeros(3, 2), None), "home must have 4 rows"),
        (lambda: ElasticExperts(4, 1).reduce_grads(torch.zeros(4, 2), torch.zeros(1, 3), None),
         r"must match the home experts' shape \(2,\)"),
        (lambda: ElasticExperts(4, 1).reduce_grads(None, None, None), "pass like="),
        (lambda: zipf_topk(0, 4, 8, 9, 1.0, 0), "topk must be in"),
        (lambda: zipf_probs(8, -1.0, 0), "skew must be >= 0"),
    ],
)
def test_bad_arguments_name_the_constraint_and_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
