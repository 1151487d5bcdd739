"""Worker of tests/test_reduced_combine_reference.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29543 \
        tests/_torchrun_reduced_worker.py OUT_DIR

Every rank runs ``A2aEpBuffer`` and ``ReferenceEpBuffer`` built with ``EpConfig(combine_algorithm=
"reduced")`` on the same inputs, and compares their combines (the config's default, an explicit
``algorithm="reduced"`` and ``algorithm="pull"``) bit for bit with ``reference_combine_reduced`` /
``reference_combine`` evaluated on every rank's gathered expert outputs. Then it makes the algorithm
argument invalid in several ways (each must raise on every rank, and the buffers must stay usable).
Nothing here raises between collectives: findings are recorded and written to OUT_DIR/rank{r}.json, the
assertions live in the test.
"""

from __future__ import annotations

import torch
from _launch import bit_diff, gloo_worker_main, outcome  # tests/ is this script's sys.path[0]

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.capacity import effective_topk_from_scatter
from cute_ep.collectives import all_gather_objects
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    apply_test_expert,
    global_expert_of_rows,
    reference_combine,
    reference_combine_reduced,
)
from cute_ep.reference_backend import ReferenceEpBuffer

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# name, routing, dtype, topk, hidden, experts per rank, tokens per rank (by rank), max tokens, extras
CASES = [
    ("uniform-bf16-k4-el2", "uniform", BF16, 4, 64, 2, (12, 0, 7, 16), 16, {}),
    ("dropped-bf16-k3-el1-atomic", "dropped", BF16, 3, 32, 1, (9, 16, 0, 5), 16, {"mode": "atomic"}),
    ("skewed-fp32-k4-el3", "skewed", FP32, 4, 48, 3, (16, 11, 3, 0), 16, {}),
    ("uniform-fp16-k2-el2-int32", "uniform", FP16, 2, 40, 2, (6, 10, 1, 9), 10, {"idx": torch.int32}),
    ("uniform-bf16-k4-el2-capacity", "uniform", BF16, 4, 32, 2, (12, 12, 12, 12), 12,
     {"capacity_factor": 0.5}),
    ("dropped-bf16-k4-el4-alldrop", "dropped", BF16, 4, 48, 4, (20, 9, 0, 14), 24, {"all_dropped": 1}),
    ("uniform-bf16-k2-el2-empty", "uniform", BF16, 2, 32, 2, (0, 0, 0, 0), 8, {}),
]  # fmt: skip


def run_case(rt: Runtime, number: int, case: tuple) -> dict:
    """Two rounds (different seeds and token counts) on one pair of "reduced" buffers."""
    name, routing, dtype, topk, hidden, el, tokens, max_tokens, extra = case
    env = rt.env
    rank, world = env.rank, env.world_size
    limited = "capacity_factor" in extra
    cfg = EpConfig(world_size=world, local_world_size=env.local_world_size, num_experts=el * world,
                   topk=topk, hidden=hidden, dtype=dtype, max_tokens=max_tokens, combine_algorithm="reduced",
                   capacity_factor=extra.get("capacity_factor", 0.0),
                   on_overflow="drop" if limited else "raise")
    mode = extra.get("mode", "scatter")
    found: list[str] = []
    differs_from_pull = 0
    kept_pairs = dropped_pairs = 0
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        for rnd in range(2):
            t = tokens[(rank + rnd) % len(tokens)]
            seed = 23 + 31 * rnd + 101 * number
            x, idx, w = make_inputs(rank, t, hidden, cfg.num_experts, topk, dtype, seed, routing=routing,
                                    idx_dtype=extra.get("idx", torch.int64))
            if extra.get("all_dropped") == rank:
                idx.fill_(-1)
            ra = a2a.dispatch(x, idx, w, mode=mode)
            rr = ref.dispatch(x, idx, w, mode=mode)  # the reference's atomic mode shuffles its rows
            ya = apply_test_expert(ra.recv_x, global_expert_of_rows(ra.tokens_per_expert, rank))
            yr = apply_test_expert(rr.recv_x, global_expert_of_rows(rr.tokens_per_expert, rank))

            # What every combine must give: the references on every rank's expert outputs.
            ys = all_gather_objects(ya.cpu(), rt.cpu_group)
            eff = effective_topk_from_scatter(idx, ra.handle.scatter)
            kept_pairs += int((eff >= 0).sum())
            dropped_pairs += int(((idx >= 0) & (eff < 0)).sum())
            args = (ys, [eff], [w], [ra.handle.scatter])
            want = reference_combine_reduced(*args, num_experts=cfg.num_experts)[0]
            want_pull = reference_combine(*args, num_experts=cfg.num_experts)[0]
            differs_from_pull += int((want != want_pull).sum())

            where = f"round {rnd}"
            for label, got, exp in (
                ("a2a default", a2a.combine(ya, ra.handle), want),
                ("a2a reduced", a2a.combine(ya, ra.handle, algorithm="reduced"), want),
                ("a2a pull", a2a.combine(ya, ra.handle, algorithm="pull"), want_pull),
                ("reference default", ref.combine(yr, rr.handle), want),
                ("reference reduced", ref.combine(yr, rr.handle, algorithm="reduced"), want),
                ("reference pull", ref.combine(yr, rr.handle, algorithm="pull"), want_pull),
            ):
                d = bit_diff(label, got, exp)
                if d:
                    found.append(f"{where}: {d}")
    return {"name": name, "mismatches": found, "differs_from_pull": differs_from_pull,
            "kept_pairs": kept_pairs, "dropped_pairs": dropped_pairs}


def bad_algorithms(rt: Runtime) -> dict:
    """Each scenario makes the algorithm argument invalid on one or every rank; every rank records what
    happened. The buffers must still combine afterwards."""
    env = rt.env
    world = env.world_size
    shape = dict(world_size=world, local_world_size=env.local_world_size, num_experts=2 * world, topk=3,
                 hidden=32, dtype=BF16, max_tokens=8)
    out: dict[str, dict] = {}
    pull_cfg, reduced_cfg = EpConfig(**shape), EpConfig(**shape, combine_algorithm="reduced")
    for backend, cls in (("a2a", A2aEpBuffer), ("reference", ReferenceEpBuffer)):
        with cls(rt, pull_cfg) as pull_buf, cls(rt, reduced_cfg) as red_buf:
            out.update(bad_algorithms_of(rt, backend, pull_buf, red_buf))
    return out


def bad_algorithms_of(rt: Runtime, backend: str, pull_buf, red_buf) -> dict:
    """The scenarios of :func:`bad_algorithms` on one backend (a "pull" and a "reduced" buffer)."""
    rank, world = rt.env.rank, rt.env.world_size
    last = world - 1
    x, idx, w = make_inputs(rank, 7, 32, 2 * world, 3, BF16, 5)
    rp, rd = pull_buf.dispatch(x, idx, w), red_buf.dispatch(x, idx, w)
    yp = apply_test_expert(rp.recv_x, global_expert_of_rows(rp.tokens_per_expert, rank))
    yd = apply_test_expert(rd.recv_x, global_expert_of_rows(rd.tokens_per_expert, rank))
    scenarios = {
        "reduced_on_pull_config": lambda: pull_buf.combine(yp, rp.handle, algorithm="reduced"),
        "reduced_on_pull_config_on_last": lambda: pull_buf.combine(
            yp, rp.handle, algorithm="reduced" if rank == last else None),
        "unknown_on_rank0": lambda: red_buf.combine(yd, rd.handle, algorithm="fancy" if rank == 0 else None),
        "mismatch": lambda: red_buf.combine(yd, rd.handle, algorithm="pull" if rank == 0 else None),
    }  # fmt: skip
    out = {f"{backend}_{key}": outcome(fn) for key, fn in scenarios.items()}
    ys_p = all_gather_objects(yp.cpu(), rt.cpu_group)
    ys_d = all_gather_objects(yd.cpu(), rt.cpu_group)
    want_p = reference_combine(ys_p, [idx], [w], [rp.handle.scatter], num_experts=2 * world)[0]
    want_d = reference_combine_reduced(ys_d, [idx], [w], [rd.handle.scatter], num_experts=2 * world)[0]
    ok = (
        torch.equal(pull_buf.combine(yp, rp.handle), want_p)
        and torch.equal(pull_buf.combine(yp, rp.handle, algorithm="pull"), want_p)
        and torch.equal(red_buf.combine(yd, rd.handle), want_d)
    )
    out[f"{backend}_usable_after_errors"] = {"raised": None, "message": "", "ok": ok}
    return out


def results(rt: Runtime) -> dict:
    """This rank's findings (``gloo_worker_main`` writes them to OUT_DIR/rank{r}.json)."""
    return {"cases": [run_case(rt, i, case) for i, case in enumerate(CASES)], "bad": bad_algorithms(rt)}


if __name__ == "__main__":
    gloo_worker_main(results)
