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
from _worlds import case_config, case_inputs, expert_outputs, on_host_backends, world_config

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.capacity import effective_topk_from_scatter
from cute_ep.collectives import all_gather_objects
from cute_ep.inputs import make_inputs
from cute_ep.reference import reference_combine, reference_combine_reduced
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
    name, _, _, _, _, _, tokens, _, extra = case
    env = rt.env
    rank, world = env.rank, env.world_size
    factor = extra.get("capacity_factor", 0.0)
    cfg = case_config(env, case, combine_algorithm="reduced", capacity_factor=factor,
                      on_overflow="drop" if "capacity_factor" in extra else "raise")
    mode = extra.get("mode", "scatter")
    found: list[str] = []
    differs_from_pull = 0
    kept_pairs = dropped_pairs = 0
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        for rnd in range(2):
            t = tokens[(rank + rnd) % len(tokens)]
            x, idx, w = case_inputs(rank, world, t, case, seed=23 + 31 * rnd + 101 * number)
            ra = a2a.dispatch(x, idx, w, mode=mode)
            rr = ref.dispatch(x, idx, w, mode=mode)  # the reference's atomic mode shuffles its rows
            ya = expert_outputs(ra, rank=rank)
            yr = expert_outputs(rr, rank=rank)

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
    shape = dict(num_experts=2 * env.world_size, topk=3, hidden=32, dtype=BF16, max_tokens=8)
    pull, reduced = world_config(env, **shape), world_config(env, **shape, combine_algorithm="reduced")
    return on_host_backends(rt, pull, reduced, bad_algorithms_of)


def bad_algorithms_of(rt: Runtime, backend: str, pull_buf, red_buf) -> dict:
    """The scenarios of :func:`bad_algorithms` on one backend (a "pull" and a "reduced" buffer)."""
    rank, world = rt.env.rank, rt.env.world_size
    last = world - 1
    x, idx, w = make_inputs(rank, 7, 32, 2 * world, 3, BF16, 5)
    rp, rd = pull_buf.dispatch(x, idx, w), red_buf.dispatch(x, idx, w)
    yp = expert_outputs(rp, rank=rank)
    yd = expert_outputs(rd, rank=rank)
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
