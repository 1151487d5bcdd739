"""Worker of tests/test_a2a_backend.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29541 \
        tests/_torchrun_a2a_worker.py OUT_DIR

Every rank runs ``A2aEpBuffer`` and ``ReferenceEpBuffer`` on the same inputs and compares the results
bit for bit, runs the project's distributed checks on the A2A results, the autograd gradient check on
the A2A backend, and a set of bad inputs on one rank (each must raise on every rank). Nothing here
raises between collectives: findings are recorded and written to OUT_DIR/rank{r}.json, the assertions
live in the test.
"""

from __future__ import annotations

import dataclasses

import torch
from _launch import bit_diff, gloo_worker_main, outcome  # tests/ is this script's sys.path[0]

from cute_ep.a2a_backend import A2aDispatchHandle, A2aEpBuffer
from cute_ep.api import DispatchHandle
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.autograd_checks import gradient_check
from cute_ep.validators.checks import check_combine, check_dispatch, check_layout

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# name, routing, dtype, topk, hidden, experts per rank, tokens per rank (by rank), max tokens, extras
CASES = [
    ("uniform-bf16-k2-el2", "uniform", BF16, 2, 64, 2, (12, 0, 7, 16), 16, {}),
    ("skewed-fp16-k4-el3", "skewed", FP16, 4, 128, 3, (9, 16, 0, 5), 16, {}),
    ("dropped-fp32-k3-el2", "dropped", FP32, 3, 24, 2, (16, 11, 3, 0), 16, {}),
    ("uniform-fp32-k1-el1", "uniform", FP32, 1, 32, 1, (5, 8, 0, 13), 16, {}),
    ("skewed-bf16-k2-el1-atomic", "skewed", BF16, 2, 32, 1, (7, 3, 12, 0), 12, {"mode": "atomic"}),
    ("uniform-fp16-k3-el2-int32", "uniform", FP16, 3, 40, 2, (6, 10, 1, 9), 10, {"idx": torch.int32}),
    ("dropped-bf16-k4-el4-alldrop", "dropped", BF16, 4, 48, 4, (20, 9, 0, 14), 24, {"all_dropped": 1}),
    ("uniform-bf16-k2-el2-empty", "uniform", BF16, 2, 32, 2, (0, 0, 0, 0), 8, {}),
    ("uniform-fp32-k4-el4-atomic", "uniform", FP32, 4, 28, 4, (24, 17, 5, 30), 32, {"mode": "atomic"}),
    ("skewed-bf16-k1-el3-expert-output", "skewed", BF16, 1, 96, 3, (11, 0, 4, 8), 16, {"expert_output": 1}),
]
FIELDS = ("recv_x", "recv_weights", "recv_src", "tokens_per_expert")


def inputs(rank: int, tokens: int, case: tuple, seed: int) -> tuple:
    _, routing, dtype, topk, hidden, el, _, _, extra = case
    world = torch.distributed.get_world_size()
    x, idx, w = make_inputs(rank, tokens, hidden, el * world, topk, dtype, seed, routing=routing,
                            idx_dtype=extra.get("idx", torch.int64))
    if extra.get("all_dropped") == rank:
        idx.fill_(-1)
    return x, idx, w


def run_case(rt: Runtime, number: int, case: tuple) -> dict:
    """Two rounds (different seeds and token counts) on the same pair of buffers."""
    name, _, dtype, topk, hidden, el, tokens, max_tokens, extra = case
    env = rt.env
    rank, world = env.rank, env.world_size
    cfg = EpConfig(world_size=world, local_world_size=env.local_world_size, num_experts=el * world,
                   topk=topk, hidden=hidden, dtype=dtype, max_tokens=max_tokens)
    mode = extra.get("mode", "scatter")
    found: list[str] = []
    checks: dict[str, bool] = {}
    messages: dict[str, str] = {}
    num_recv = []
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        for rnd in range(2):
            t = tokens[(rank + rnd) % len(tokens)]
            x, idx, w = inputs(rank, t, case, seed=17 + 31 * rnd + 101 * number)
            ra = a2a.dispatch(x, idx, w, mode=mode)
            rr = ref.dispatch(x, idx, w)  # the reference layout (the reference's own atomic mode shuffles)
            where = f"round {rnd}"
            for f in FIELDS:
                d = bit_diff(f, getattr(ra, f), getattr(rr, f))
                if d:
                    found.append(f"{where}: {d}")
            if ra.num_recv != rr.num_recv:
                found.append(f"{where}: num_recv {ra.num_recv} vs {rr.num_recv}")
            ha, hr = ra.handle, rr.handle
            for f in ("scatter", "topk_idx", "topk_weights"):
                d = bit_diff(f"handle.{f}", getattr(ha, f), getattr(hr, f))
                if d:
                    found.append(f"{where}: {d}")
            if (ha.num_tokens, ha.mode) != (t, mode) or not isinstance(ha, DispatchHandle):
                found.append(f"{where}: handle num_tokens/mode/type {ha.num_tokens} {ha.mode} {type(ha)}")
            num_recv.append(ra.num_recv)

            ya = apply_test_expert(ra.recv_x, global_expert_of_rows(ra.tokens_per_expert, rank))
            yr = apply_test_expert(rr.recv_x, global_expert_of_rows(rr.tokens_per_expert, rank))
            if extra.get("expert_output"):
                buf_y = a2a.expert_output(ra.num_recv)
                buf_y.copy_(ya)
                ya = buf_y
            oa = a2a.combine(ya, ha)
            orr = ref.combine(yr, hr)
            d = bit_diff("combine", oa, orr)
            if d:
                found.append(f"{where}: {d}")

            common = dict(num_experts=cfg.num_experts, local_world_size=env.local_world_size,
                          require_coverage=False, group=rt.cpu_group)
            results = {
                "dispatch": check_dispatch(x, idx, w, ra.recv_x, ra.recv_weights, ra.recv_src,
                                           max_tokens=max_tokens, **common),
                "layout": check_layout(ra, idx, max_tokens=max_tokens, num_experts=cfg.num_experts,
                                       local_world_size=env.local_world_size, group=rt.cpu_group),
                "combine": check_combine(oa, idx, w, ya, scatter=ha.scatter, **common),
            }
            for key, res in results.items():
                checks[f"{key}{rnd}"] = res.passed
                if not res.passed:
                    messages[f"{key}{rnd}"] = res.message
    return {"name": name, "mismatches": found, "checks": checks, "messages": messages, "num_recv": num_recv}


def bad_inputs(rt: Runtime) -> dict:
    """Each scenario makes one rank's input invalid; every rank records what happened."""
    env = rt.env
    rank, world = env.rank, env.world_size
    cfg = EpConfig(world_size=world, local_world_size=env.local_world_size, num_experts=2 * world, topk=2,
                   hidden=32, dtype=BF16, max_tokens=8)
    out: dict[str, dict] = {}
    last = world - 1

    def good(tokens: int = 6, seed: int = 3):
        return make_inputs(rank, tokens, 32, cfg.num_experts, 2, BF16, seed)

    with A2aEpBuffer(rt, cfg) as buf, ReferenceEpBuffer(rt, cfg) as ref:
        x, idx, w = good()

        def wrong_hidden():
            bad_x = torch.zeros(6, 16, dtype=BF16) if rank == 1 else x
            buf.dispatch(bad_x, idx, w)

        def repeated_expert():
            bad = idx.clone()
            if rank == 0:
                bad[2, 1] = bad[2, 0]
            buf.dispatch(x, bad, w)

        def too_many_tokens():
            n = 9 if rank == last else 6
            buf.dispatch(*good(tokens=n))

        def none_input():
            buf.dispatch(None if rank == last else x, idx, w)

        def mode_mismatch():
            buf.dispatch(x, idx, w, mode="atomic" if rank == 0 else "scatter")

        def unknown_mode():
            buf.dispatch(x, idx, w, mode="fancy" if rank == last else "scatter")

        out["dispatch_wrong_hidden_on_rank1"] = outcome(wrong_hidden)
        out["dispatch_repeated_expert_on_rank0"] = outcome(repeated_expert)
        out["dispatch_too_many_tokens_on_last"] = outcome(too_many_tokens)
        out["dispatch_none_on_last"] = outcome(none_input)
        out["dispatch_mode_mismatch"] = outcome(mode_mismatch)
        out["dispatch_unknown_mode_on_last"] = outcome(unknown_mode)

        # The buffer still works after the refused calls (nothing moved, no collective left hanging).
        x, idx, w = good(seed=4)
        res1 = buf.dispatch(x, idx, w)
        res2 = buf.dispatch(*good(seed=5))
        y2 = apply_test_expert(res2.recv_x, global_expert_of_rows(res2.tokens_per_expert, rank))
        rr2 = ref.dispatch(*good(seed=5))
        ok_after = torch.equal(buf.combine(y2, res2.handle), ref.combine(y2, rr2.handle))
        out["usable_after_errors"] = {"raised": None, "message": "", "ok": ok_after}

        def bad_y():
            y = y2.float() if rank == 0 else y2
            buf.combine(y, res2.handle)

        def handles_of_different_calls():  # each rank's y fits its handle: only the dispatch calls differ
            if rank == last:
                buf.combine(buf.expert_output(res1.num_recv), res1.handle)
            else:
                buf.combine(y2, res2.handle)

        def foreign_handle():
            buf.combine(y2, rr2.handle if rank == 1 else res2.handle)

        def moved_pair():
            h = res2.handle
            if rank == 0:
                moved = h.topk_idx.clone()
                t = int(torch.nonzero(moved[:, 0] >= 0)[0])
                moved[t, 0] = (moved[t, 0] + 1) % cfg.num_experts
                while bool((moved[t, 1:] == moved[t, 0]).any()):
                    moved[t, 0] = (moved[t, 0] + 1) % cfg.num_experts
                h = dataclasses.replace(h, topk_idx=moved)
            buf.combine(y2, h)

        out["combine_bad_y_on_rank0"] = outcome(bad_y)
        out["combine_handles_of_different_calls"] = outcome(handles_of_different_calls)
        out["combine_foreign_handle_on_rank1"] = outcome(foreign_handle)
        out["combine_moved_pair_on_rank0"] = outcome(moved_pair)

        # A replaced handle that only drops pairs and changes weights (what cute_ep.autograd does).
        h = res2.handle
        only0 = h.topk_idx.clone()
        only0[:, 1] = -1
        ones = torch.ones_like(h.topk_weights)
        a = buf.combine(y2, dataclasses.replace(h, topk_idx=only0, topk_weights=ones))
        b = ref.combine(y2, dataclasses.replace(rr2.handle, topk_idx=only0, topk_weights=ones))
        out["replaced_handle"] = {"raised": None, "message": "", "ok": torch.equal(a, b),
                                  "type_kept": isinstance(dataclasses.replace(h), A2aDispatchHandle)}
        ok_final = torch.equal(buf.combine(y2, res2.handle), ref.combine(y2, rr2.handle))
        out["usable_after_combine_errors"] = {"raised": None, "message": "", "ok": ok_final}

    # Capacity: a configuration forced below the worst case (EpConfig refuses one; the check must
    # still hold for the receiving side), every rank sends everything to rank 0's experts.
    small = EpConfig(world_size=world, local_world_size=env.local_world_size, num_experts=2 * world, topk=2,
                     hidden=32, dtype=BF16, max_tokens=8)
    object.__setattr__(small, "capacity", 5)
    with A2aEpBuffer(rt, small) as buf:
        x, _, w = good()
        hot = torch.tensor([[0, 1]] * 6)
        out["capacity"] = outcome(lambda: buf.dispatch(x, hot, w))
    return out


def results(rt: Runtime) -> dict:
    """This rank's findings (``gloo_worker_main`` writes them to OUT_DIR/rank{r}.json)."""
    result = {"cases": [run_case(rt, i, case) for i, case in enumerate(CASES)]}
    result["bad"] = bad_inputs(rt)
    make = lambda cfg: A2aEpBuffer(rt, cfg)  # noqa: E731
    result["gradients"] = gradient_check(rt, make, torch.device("cpu"))
    return result


if __name__ == "__main__":
    gloo_worker_main(results)
