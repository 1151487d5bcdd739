"""Worker of tests/test_capacity_fp8_torchrun.py: one rank of a gloo world launched by torchrun.

To run (what the tests do; PARTS is "capacity", "fp8" or both, comma-separated):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29543 \
        tests/_torchrun_capacity_fp8_worker.py OUT_DIR capacity,fp8

Every rank runs ``A2aEpBuffer`` and ``ReferenceEpBuffer`` on the same inputs and compares them bit for
bit with each other and with the validators run on every rank's routing (gathered here):
"capacity" checks expert capacity (the effective routing of ``apply_expert_capacity``, drop counts,
both overflow policies, atomic mode), "fp8" checks FP8 dispatch (the received packed rows are the
senders' quantized rows) and that every rank raises alike on a mismatched or unsupported fp8 call.
Nothing here raises between collectives: findings go to OUT_DIR/rank{r}.json, the assertions live in
the tests.
"""

from __future__ import annotations

import torch
from _launch import bit_diff, gloo_worker_main, outcome  # tests/ is this script's sys.path[0]
from _worlds import case_config

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.capacity import apply_expert_capacity, check_atomic_drops, effective_topk_from_scatter
from cute_ep.collectives import all_gather_objects
from cute_ep.fp8 import dequantize_fp8, pack_fp8_rows, quantize_fp8
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import (
    apply_test_expert,
    global_expert_of_rows,
    reference_combine,
    reference_dispatch_rank,
    reference_layout,
)
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.status import CapacityExceeded

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FIELDS = ("recv_x", "recv_weights", "recv_src", "tokens_per_expert")

# name, routing, dtype, topk, hidden, experts per rank, tokens per rank (by rank), max tokens, factor
CAPACITY_CASES = [
    ("skewed-bf16-k2-el2-f0.5", "skewed", BF16, 2, 32, 2, (12, 0, 7, 16), 16, 0.5),
    ("uniform-fp32-k3-el2-f1.0", "uniform", FP32, 3, 16, 2, (9, 16, 3, 5), 16, 1.0),
    ("dropped-fp16-k4-el3-f0.3", "dropped", FP16, 4, 24, 3, (16, 11, 0, 14), 16, 0.3),
    ("skewed-bf16-k1-el2-f0.01", "skewed", BF16, 1, 16, 2, (8, 8, 8, 8), 8, 0.01),  # capacity 1
]
# name, routing, dtype, topk, hidden, experts per rank, tokens per rank, max tokens, factor, mode
FP8_CASES = [
    ("uniform-bf16-k2-el2-h256", "uniform", BF16, 2, 256, 2, (12, 0, 7, 16), 16, 0.0, "scatter"),
    ("skewed-fp16-k2-el1-h128", "skewed", FP16, 2, 128, 1, (5, 9, 16, 2), 16, 0.0, "scatter"),
    ("dropped-fp32-k2-el3-h384-atomic", "dropped", FP32, 2, 384, 3, (10, 4, 0, 13), 16, 0.0, "atomic"),
    ("skewed-bf16-k2-el2-h128-capacity", "skewed", BF16, 2, 128, 2, (16, 16, 9, 3), 16, 0.4, "scatter"),
]


def inputs(rank: int, world: int, case: tuple, rnd: int, number: int) -> tuple:
    _, routing, dtype, topk, hidden, el, tokens = case[:7]
    t = tokens[(rank + rnd) % len(tokens)]
    return make_inputs(
        rank, t, hidden, el * world, topk, dtype, 23 + 31 * rnd + 101 * number, routing=routing
    )


def expected_of(
    rt: Runtime, cfg: EpConfig, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, fp8: bool
) -> dict:
    """This rank's expected receive buffers, from every rank's inputs: the effective routing's layout,
    with the senders' packed FP8 rows as the rows when fp8."""
    rows = pack_fp8_rows(*quantize_fp8(x), cfg.fp8_row_bytes) if fp8 else x
    gathered = all_gather_objects((rows, idx, w), rt.cpu_group)
    rows_all, idx_all, w_all = ([g[i] for g in gathered] for i in range(3))
    eff, dropped = apply_expert_capacity(idx_all, cfg.num_experts, cfg.expert_capacity)
    layout = reference_layout(eff, cfg.num_experts)
    exp = reference_dispatch_rank(rows_all, eff, w_all, layout, cfg.max_tokens, rt.env.rank)
    return {"layout": layout, "eff": eff, "dropped": dropped, "recv": exp}


def compare(
    found: list[str],
    where: str,
    res,
    exp: dict,
    rank: int,
    fp8: bool,
    cfg: EpConfig,
    check_scatter: bool = True,
) -> None:
    """Record every difference between a DispatchResult and the expected buffers."""
    recv = exp["recv"]
    if fp8:
        got = pack_fp8_rows(res.recv_x, res.recv_scales, cfg.fp8_row_bytes)
        d = bit_diff("packed fp8 rows", got, recv.recv_x)
    else:
        d = bit_diff("recv_x", res.recv_x, recv.recv_x)
    tpe = exp["layout"].tokens_per_expert[rank].to(torch.int32)
    for dd in (
        d,
        bit_diff("recv_weights", res.recv_weights, recv.recv_w),
        bit_diff("recv_src", res.recv_src, recv.recv_src),
        bit_diff("tokens_per_expert", res.tokens_per_expert, tpe),
    ):
        if dd:
            found.append(f"{where}: {dd}")
    if check_scatter:
        dd = bit_diff("handle.scatter", res.handle.scatter, exp["layout"].scatter[rank].to(torch.int32))
        if dd:
            found.append(f"{where}: {dd}")


def expert_rows(res, rank: int, cfg: EpConfig, fp8: bool) -> torch.Tensor:
    """The test expert's outputs for a result (FP8 rows are dequantized to cfg.dtype first)."""
    rows = dequantize_fp8(res.recv_x, res.recv_scales).to(cfg.dtype) if fp8 else res.recv_x
    return apply_test_expert(rows, global_expert_of_rows(res.tokens_per_expert, rank))


def combine_expected(
    rt: Runtime,
    cfg: EpConfig,
    y: torch.Tensor,
    eff: list[torch.Tensor],
    w: torch.Tensor,
    scatter: torch.Tensor,
) -> torch.Tensor:
    ys = all_gather_objects(y.clone(), rt.cpu_group)
    return reference_combine(ys, [eff[rt.env.rank]], [w], [scatter], num_experts=cfg.num_experts)[0]


def compare_combines(found: list, where: str, rt, cfg: EpConfig, a2a_run: tuple, ref_run: tuple, exp: dict,
                     w: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Both backends' combine of their own dispatch result (a (buffer, result) pair each) against the
    reference combine of the a2a run's expert rows on the effective routing; problems go to found.
    Returns that reference output."""
    rank = rt.env.rank
    (a2a, ra), (ref, rr) = a2a_run, ref_run
    ya, yr = expert_rows(ra, rank, cfg, fp8), expert_rows(rr, rank, cfg, fp8)
    want = combine_expected(rt, cfg, ya, exp["eff"], w, exp["layout"].scatter[rank])
    for name, out in (("a2a", a2a.combine(ya, ra.handle)), ("reference", ref.combine(yr, rr.handle))):
        dd = bit_diff(f"{name} combine", out, want)
        if dd:
            found.append(f"{where}: {dd}")
    return want


# --------------------------------------------------------------------------------------------------
# capacity
# --------------------------------------------------------------------------------------------------


def capacity_case(rt: Runtime, number: int, case: tuple) -> dict:
    env = rt.env
    rank, world = env.rank, env.world_size
    cfg = case_config(env, case, capacity_factor=case[8], on_overflow="drop")
    found: list[str] = []
    dropped_total = 0
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        expect_dropped = torch.zeros(cfg.num_experts, dtype=torch.int64)
        for rnd in range(2):
            x, idx, w = inputs(rank, world, case, rnd, number)
            exp = expected_of(rt, cfg, x, idx, w, fp8=False)
            expect_dropped += exp["dropped"]
            where = f"round {rnd}"
            ra, rr = a2a.dispatch(x, idx, w), ref.dispatch(x, idx, w)
            compare(found, f"{where} a2a", ra, exp, rank, False, cfg)
            compare(found, f"{where} reference", rr, exp, rank, False, cfg)
            want = compare_combines(found, where, rt, cfg, (a2a, ra), (ref, rr), exp, w, False)
            # Atomic mode (the reference shuffles inside groups): the same pairs, the same sums.
            at = ref.dispatch(x, idx, w, mode="atomic")
            eff_at = all_gather_objects(effective_topk_from_scatter(idx, at.handle.scatter), rt.cpu_group)
            found += [f"{where} atomic: {p}" for p in check_atomic_drops(eff_at, exp["eff"], cfg.num_experts)]
            dd = bit_diff("atomic combine", ref.combine(expert_rows(at, rank, cfg, False), at.handle), want)
            if dd:
                found.append(f"{where}: {dd}")
            dropped_total += int(exp["dropped"].sum())
        for name, buf, scale in (("a2a", a2a, 1), ("reference", ref, 2)):  # ref dispatched twice a round
            dd = bit_diff(f"{name} dropped_rows", buf.dropped_rows(), expect_dropped * scale)
            if dd:
                found.append(dd)
            if bool(buf.dropped_rows().any()):
                found.append(f"{name}: dropped_rows did not reset")
    return {"name": case[0], "mismatches": found, "dropped": dropped_total}


def capacity_raise(rt: Runtime) -> dict:
    """on_overflow="raise": every rank raises CapacityExceeded with the same counts and a complete
    result; the buffer stays usable."""
    env = rt.env
    rank, world = env.rank, env.world_size
    case = CAPACITY_CASES[0]
    cfg = case_config(env, case, capacity_factor=0.25)
    out: dict = {}
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        x, idx, w = inputs(rank, world, case, 0, 7)
        exp = expected_of(rt, cfg, x, idx, w, fp8=False)
        want_dropped = {e: int(n) for e, n in enumerate(exp["dropped"].tolist()) if n}
        for name, buf in (("a2a", a2a), ("reference", ref)):
            found: list[str] = []
            try:
                buf.dispatch(x, idx, w)
                got = {"raised": None}
            except CapacityExceeded as exc:
                got = {
                    "raised": "CapacityExceeded",
                    "message": str(exc),
                    "total": exc.total,
                    "dropped_ok": exc.dropped == want_dropped,
                }
                compare(found, name, exc.result, exp, rank, False, cfg)
                y = expert_rows(exc.result, rank, cfg, False)
                want = combine_expected(rt, cfg, y, exp["eff"], w, exp["layout"].scatter[rank])
                dd = bit_diff("combine after the raise", buf.combine(y, exc.result.handle), want)
                if dd:
                    found.append(dd)
            got["mismatches"] = found
            got["reset"] = not bool(buf.dropped_rows().any())
            got["want_total"] = sum(want_dropped.values())
            out[name] = got
    return out


# --------------------------------------------------------------------------------------------------
# fp8
# --------------------------------------------------------------------------------------------------


def fp8_case(rt: Runtime, number: int, case: tuple) -> dict:
    env = rt.env
    rank, world = env.rank, env.world_size
    factor, mode = case[8], case[9]
    cfg = case_config(env, case, capacity_factor=factor, on_overflow="drop")
    found: list[str] = []
    num_recv = []
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        for rnd in range(2):
            x, idx, w = inputs(rank, world, case, rnd, number)
            exp = expected_of(rt, cfg, x, idx, w, fp8=True)
            where = f"round {rnd}"
            ra = a2a.dispatch(x, idx, w, mode=mode, fp8=True)
            rr = ref.dispatch(x, idx, w, fp8=True)  # the reference's atomic mode shuffles: scatter here
            compare(found, f"{where} a2a", ra, exp, rank, True, cfg)
            compare(found, f"{where} reference", rr, exp, rank, True, cfg)
            for name, res in (("a2a", ra), ("reference", rr)):
                if res.recv_x.dtype != torch.float8_e4m3fn or res.recv_scales is None:
                    found.append(f"{where} {name}: recv_x {res.recv_x.dtype}, recv_scales {res.recv_scales}")
            num_recv.append(ra.num_recv)
            compare_combines(found, where, rt, cfg, (a2a, ra), (ref, rr), exp, w, True)
            # The same dispatch without fp8: every field but the rows is the same.
            kept = {f: getattr(ra, f).clone() for f in ("recv_weights", "recv_src", "tokens_per_expert")}
            plain = a2a.dispatch(x, idx, w, mode=mode)
            for f, v in kept.items():
                dd = bit_diff(f"non-fp8 {f}", getattr(plain, f), v)
                if dd:
                    found.append(f"{where}: {dd}")
            dd = bit_diff("non-fp8 handle.scatter", plain.handle.scatter, ra.handle.scatter)
            if dd:
                found.append(f"{where}: {dd}")
            if plain.recv_scales is not None or plain.recv_x.dtype != cfg.dtype:
                found.append(f"{where}: the non-fp8 dispatch returned {plain.recv_x.dtype} rows and scales")
        a2a.dropped_rows()
        ref.dropped_rows()
    return {"name": case[0], "mismatches": found, "num_recv": num_recv}


def fp8_bad(rt: Runtime) -> dict:
    env = rt.env
    rank, world = env.rank, env.world_size
    case = FP8_CASES[0]
    out: dict = {}
    cfg = case_config(env, case)
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        x, idx, w = inputs(rank, world, case, 0, 9)
        for name, buf in (("a2a", a2a), ("reference", ref)):
            out[f"{name}_mismatch"] = outcome(lambda b=buf: b.dispatch(x, idx, w, fp8=rank == 0))
            out[f"{name}_not_bool_on_last"] = outcome(
                lambda b=buf: b.dispatch(x, idx, w, fp8="yes" if rank == world - 1 else False)
            )
            res = buf.dispatch(x, idx, w, fp8=True)  # still usable
            out[f"{name}_usable"] = {"ok": res.recv_x.dtype == torch.float8_e4m3fn}
    small = case_config(env, ("h64", "uniform", BF16, 2, 64, 2, (4,), 8))
    with A2aEpBuffer(rt, small) as a2a, ReferenceEpBuffer(rt, small) as ref:
        x, idx, w = make_inputs(rank, 4, 64, small.num_experts, 2, BF16, 5)
        for name, buf in (("a2a", a2a), ("reference", ref)):
            out[f"{name}_hidden64"] = outcome(lambda b=buf: b.dispatch(x, idx, w, fp8=True))
    return out


def part_results(rt: Runtime, part: str) -> dict:
    """This rank's findings for one PART."""
    if part == "capacity":
        return {
            "cases": [capacity_case(rt, i, c) for i, c in enumerate(CAPACITY_CASES)],
            "raise": capacity_raise(rt),
        }
    if part == "fp8":
        return {"cases": [fp8_case(rt, i, c) for i, c in enumerate(FP8_CASES)], "bad": fp8_bad(rt)}
    raise SystemExit(f"unknown part {part!r} (capacity or fp8)")


def results(rt: Runtime, parts: str) -> dict:
    """This rank's findings by part, for the comma-separated PARTS (``gloo_worker_main`` writes them to
    OUT_DIR/rank{r}.json): one launch runs several parts, as the world's start-up is the slow part."""
    return {part: part_results(rt, part) for part in parts.split(",")}


if __name__ == "__main__":
    gloo_worker_main(results)
