"""Worker of tests/test_rank_layout.py and tests/test_rank_layout_fp8.py: one rank of a gloo world launched
by torchrun.

To run (what the tests do; PARTS is "layout", "fp8" or both, comma-separated, the default):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29547 \
        tests/_torchrun_rank_layout_worker.py OUT_DIR [PARTS]

Every rank dispatches with ``layout="rank"`` on ``A2aEpBuffer`` and ``ReferenceEpBuffer`` and compares
every field bit for bit with the literal specification (tests/_rank_layout_spec.py) and with the torch
references, evaluated on every rank's gathered inputs; the rows must also name their sender. Then the
caller's per-rank rows are combined on both backends and compared with the specification's sum and
``reference_combine_rank_layout``; ``sync=False`` and an expert-layout dispatch on the same buffers are
checked too. Last, invalid layouts, fp8 flags and algorithms on one or every rank (each must raise on
every rank, and the buffers must stay usable). PART "fp8" runs the same cases with ``fp8=True``
(FP8_CASES, H a multiple of 128): the received e4m3 rows and scales, packed again, must equal the
specification's placement of every sender's tokens quantized one by one (``spec_fp8_rows``), the
reference's and the other backend's, ``validators.checks.check_rank_dispatch(..., fp8=True)`` must pass,
and the caller's rows come from the dequantized rows. Nothing here raises between collectives: findings
are recorded and written to OUT_DIR/rank{r}.json, the assertions live in the tests.
"""

from __future__ import annotations

import torch
from _launch import bit_diff, gloo_worker_main, outcome  # tests/ is this script's sys.path[0]
from _rank_layout_spec import caller_expert, spec_combine, spec_dispatch, spec_fp8_rows, spec_scatter
from _worlds import case_config, case_inputs, on_host_backends, world_config

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.collectives import all_gather_objects
from cute_ep.fp8 import dequantize_fp8, pack_fp8_rows
from cute_ep.inputs import decode_sender, make_inputs, sender_check_ok
from cute_ep.reference import (
    reference_combine,
    reference_combine_rank_layout,
    reference_dispatch_rank_layout,
    reference_rank_layout,
)
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.checks import check_rank_dispatch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# name, routing, dtype, topk, hidden, experts per rank, tokens per rank (by rank), max tokens, extras
CASES = [
    ("uniform-bf16-k4-el2-ragged", "uniform", BF16, 4, 64, 2, (12, 0, 7, 16), 16, {}),
    ("dropped-fp32-k3-el2-alldrop", "dropped", FP32, 3, 24, 2, (16, 11, 3, 0), 16, {"all_dropped": 1}),
    ("skewed-fp16-k2-el3-atomic", "skewed", FP16, 2, 40, 3, (9, 16, 0, 5), 16, {"mode": "atomic"}),
    ("rank0-bf16-k2-el4-skew", "rank0", BF16, 2, 32, 4, (10, 6, 8, 3), 10, {}),
    ("uniform-fp32-k1-el1-int32", "uniform", FP32, 1, 32, 1, (5, 8, 0, 13), 16, {"idx": torch.int32}),
    ("everyone-bf16-full", "everyone", BF16, 0, 48, 1, (8, 8, 8, 8), 8, {}),  # K = R: every rank
    ("uniform-bf16-k2-el2-empty", "uniform", BF16, 2, 32, 2, (0, 0, 0, 0), 8, {}),
]  # fmt: skip
# The same with fp8=True: H a multiple of 128 (ragged, zero-token ranks, dropped ids, skew, every rank).
FP8_CASES = [
    ("fp8-uniform-bf16-k4-el2-ragged", "uniform", BF16, 4, 256, 2, (12, 0, 7, 16), 16, {}),
    ("fp8-dropped-fp32-k3-el2-alldrop", "dropped", FP32, 3, 128, 2, (16, 11, 3, 0), 16, {"all_dropped": 1}),
    ("fp8-skewed-fp16-k2-el3-atomic", "skewed", FP16, 2, 384, 3, (9, 16, 0, 5), 16, {"mode": "atomic"}),
    ("fp8-rank0-bf16-k2-el4-skew", "rank0", BF16, 2, 128, 4, (10, 6, 8, 3), 10, {"idx": torch.int32}),
    ("fp8-everyone-bf16-full", "everyone", BF16, 0, 256, 1, (8, 8, 8, 8), 8, {}),
    ("fp8-uniform-bf16-k2-el2-empty", "uniform", BF16, 2, 128, 2, (0, 0, 0, 0), 8, {}),
]  # fmt: skip
FIELDS = ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert")


def received_rows(res, n: int, fp8: bool, row_bytes: int) -> torch.Tensor:
    """The first n received rows as they travelled: recv_x, or after an FP8 dispatch recv_x and
    recv_scales packed again ([n, row_bytes] uint8)."""
    return pack_fp8_rows(res.recv_x[:n], res.recv_scales[:n], row_bytes) if fp8 else res.recv_x[:n]


def expert_in(res, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """The rows an expert reads: recv_x, or after an FP8 dispatch its rows dequantized to ``dtype``."""
    return dequantize_fp8(res.recv_x, res.recv_scales).to(dtype) if fp8 else res.recv_x


def run_case(rt: Runtime, number: int, case: tuple, fp8: bool = False) -> dict:
    """Two rounds (different seeds and token counts) on one pair of buffers, then sync=False and an
    expert-layout dispatch on the same buffers; with ``fp8`` every dispatch is an FP8 one."""
    name, _, _, _, _, el, tokens, max_tokens, extra = case
    env = rt.env
    rank, world = env.rank, env.world_size
    cfg = case_config(env, case)
    num_e = cfg.num_experts
    mode = extra.get("mode", "scatter")
    found: list[str] = []
    num_recv: list[int] = []
    sent: list[int] = []
    with A2aEpBuffer(rt, cfg) as a2a, ReferenceEpBuffer(rt, cfg) as ref:
        a2a.poison()
        ref.poison()
        for rnd in range(3):
            where = f"round {rnd}"
            t = tokens[(rank + rnd) % len(tokens)]
            x, idx, w = case_inputs(rank, world, t, case, seed=41 + 31 * rnd + 101 * number)
            sync = rnd < 2  # round 2: sync=False
            gathered = all_gather_objects((x, idx, w), rt.cpu_group)
            xs, idxs, ws = ([g[i] for g in gathered] for i in range(3))
            # What travels: the rows, or with fp8 every sender's tokens quantized one by one and packed.
            rows_of = [spec_fp8_rows(v, cfg.fp8_row_bytes) for v in xs] if fp8 else xs
            spec = spec_dispatch(rows_of, idxs, ws, num_experts=num_e, max_tokens=max_tokens, dst=rank)
            n = spec.recv_x.shape[0]
            num_recv.append(n)
            sent.append(t)
            layout = reference_rank_layout(idxs, num_e)
            want = reference_dispatch_rank_layout(rows_of, idxs, ws, layout, max_tokens, rank)
            want_scatter = spec_scatter(idxs, num_experts=num_e, src=rank)

            results = {"a2a": a2a.dispatch(x, idx, w, mode=mode, fp8=fp8, sync=sync, layout="rank"),
                       "reference": ref.dispatch(x, idx, w, mode=mode, fp8=fp8, sync=sync, layout="rank")}
            for label, res in results.items():
                rows = n if sync else cfg.rank_capacity
                if res.num_recv != rows or int(res.recv_count[0]) != n:
                    found.append(f"{where} {label}: num_recv {res.num_recv}, recv_count "
                                 f"{res.recv_count.tolist()}, want {rows} / {n}")
                if res.recv_weights is not None:
                    found.append(f"{where} {label}: recv_weights must be None")
                scales = res.recv_scales
                want_x = (torch.float8_e4m3fn if fp8 else cfg.dtype, (rows, cfg.hidden))
                want_s = (torch.float32, (rows, cfg.hidden // 128)) if fp8 else None
                got_s = None if scales is None else (scales.dtype, tuple(scales.shape))
                if (res.recv_x.dtype, tuple(res.recv_x.shape)) != want_x or got_s != want_s:
                    found.append(f"{where} {label}: recv_x {res.recv_x.dtype} {list(res.recv_x.shape)}, "
                                 f"recv_scales {got_s}; want {want_x}, {want_s}")
                    continue
                for f in FIELDS:
                    got = getattr(res, f)
                    if f != "tokens_per_expert":
                        if got.shape[0] != rows:
                            found.append(f"{where} {label}: {f} has {got.shape[0]} rows, want {rows}")
                        got = received_rows(res, n, fp8, cfg.fp8_row_bytes) if f == "recv_x" else got[:n]
                    for what, exp in (("spec", getattr(spec, f)), ("reference", getattr(want, f))):
                        d = bit_diff(f"{label} {f} vs {what}", got, exp)
                        if d:
                            found.append(f"{where}: {d}")
                h = res.handle
                d = bit_diff(f"{label} handle.scatter", h.scatter, want_scatter)
                if d:
                    found.append(f"{where}: {d}")
                if (h.layout, h.mode, h.num_tokens) != ("rank", mode, t):
                    found.append(f"{where} {label}: handle {h.layout} {h.mode} {h.num_tokens}")
                # The rows name their sender: columns 0-3 against the tag s * M + t (exact in bf16, not
                # in e4m3: an FP8 row's bytes are checked against its sender's quantized row above).
                if not fp8:
                    src_rank, src_tok = decode_sender(res.recv_x[:n])
                    tag = res.recv_src[:n].long()
                    named = torch.equal(src_rank, tag // max_tokens)
                    named = named and torch.equal(src_tok, tag % max_tokens)
                    if not (named and bool(sender_check_ok(res.recv_x[:n]).all())):
                        found.append(f"{where} {label}: rows do not name the sender their tag says")
            if sync:  # the validators' check (collective: every rank, the same rounds)
                for label, res in results.items():
                    verdict = check_rank_dispatch(
                        res, xs, idxs, ws, max_tokens=max_tokens, num_experts=num_e,
                        local_world_size=env.local_world_size, require_coverage=False, fp8=fp8,
                        group=rt.cpu_group,
                    )  # fmt: skip
                    if not verdict.passed:
                        found.append(f"{where} {label}: check_rank_dispatch: {verdict.message}")

            # Combine: the caller's rows (reduced over this rank's experts, weighted), one per row, from the
            # rows an expert reads (dequantized after an FP8 dispatch).
            ys = {}
            for label, res in results.items():
                ys[label] = caller_expert(expert_in(res, fp8, cfg.dtype), res.recv_topk_idx,
                                          res.recv_topk_weights, rank, el)
            d = bit_diff("caller rows a2a vs reference", ys["a2a"][:n], ys["reference"][:n])
            if d:
                found.append(f"{where}: {d}")
            all_y = all_gather_objects(ys["reference"][:n].clone(), rt.cpu_group)
            want_out = spec_combine(all_y, idx, want_scatter, num_experts=num_e)
            ref_out = reference_combine_rank_layout(all_y, [idx], [want_scatter], num_experts=num_e)[0]
            y_a2a = ys["a2a"]
            if rnd == 1:  # the experts wrote into expert_output: combine reads its own buffer
                buf_y = a2a.expert_output(results["a2a"].num_recv)
                buf_y.copy_(y_a2a)
                y_a2a = buf_y
            outs = {"a2a": a2a.combine(y_a2a, results["a2a"].handle),
                    "reference": ref.combine(ys["reference"], results["reference"].handle),
                    "reference function": ref_out}
            for label, out in outs.items():
                d = bit_diff(f"combine {label}", out, want_out)
                if d:
                    found.append(f"{where}: {d}")

        # The expert layout still works on the same buffers after rank-layout calls (bit for bit).
        x, idx, w = case_inputs(rank, world, tokens[rank % len(tokens)], case, seed=7 + number)
        ra, rr = a2a.dispatch(x, idx, w, fp8=fp8), ref.dispatch(x, idx, w, fp8=fp8)
        fields = ["recv_x", "recv_weights", "recv_src", "tokens_per_expert"] + ["recv_scales"] * fp8
        for f in fields:
            d = bit_diff(f"expert layout {f}", getattr(ra, f), getattr(rr, f))
            if d:
                found.append(d)
        if ra.recv_topk_idx is not None or ra.handle.layout != "expert" or rr.handle.layout != "expert":
            found.append("expert layout: recv_topk_idx must be None and handle.layout 'expert'")
        y = expert_in(ra, fp8, cfg.dtype).clone()
        all_y = all_gather_objects(y, rt.cpu_group)
        want_out = reference_combine(all_y, [idx], [w], [ra.handle.scatter], num_experts=num_e)[0]
        for label, out in (("a2a", a2a.combine(y, ra.handle)), ("reference", ref.combine(y, rr.handle))):
            d = bit_diff(f"expert layout combine {label}", out, want_out)
            if d:
                found.append(d)
    return {"name": name, "mismatches": found, "num_recv": num_recv, "sent": sent,
            "rank_capacity": cfg.rank_capacity}


def bad_calls(rt: Runtime) -> dict:
    """Each scenario makes the layout, the fp8 flag or the combine algorithm invalid on one or every rank;
    every rank records what happened. The buffers must still work afterwards."""
    env = rt.env
    shape = dict(num_experts=2 * env.world_size, topk=2, hidden=128, dtype=BF16, max_tokens=8)
    plain, capped = world_config(env, **shape), world_config(env, **shape, capacity_factor=1.0)
    return on_host_backends(rt, plain, capped, bad_calls_of)


def bad_calls_of(rt: Runtime, backend: str, buf, capped) -> dict:
    rank, world = rt.env.rank, rt.env.world_size
    last = world - 1
    x, idx, w = make_inputs(rank, 7, 128, 2 * world, 2, BF16, 5)
    res = buf.dispatch(x, idx, w, layout="rank")
    y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, rank, 2)
    scenarios = {
        "bad_layout_on_last": lambda: buf.dispatch(x, idx, w, layout="fancy" if rank == last else "rank"),
        "layout_mismatch": lambda: buf.dispatch(x, idx, w, layout="expert" if rank == 0 else "rank"),
        "fp8_mismatch": lambda: buf.dispatch(x, idx, w, fp8=rank == 0, layout="rank"),
        "capacity_factor": lambda: capped.dispatch(x, idx, w, layout="rank"),
        "algorithm_on_rank0": lambda: buf.combine(y, res.handle, algorithm="pull" if rank == 0 else None),
        "algorithm_everywhere": lambda: buf.combine(y, res.handle, algorithm="reduced"),
    }  # fmt: skip
    out = {f"{backend}_{key}": outcome(fn) for key, fn in scenarios.items()}
    # Still usable: the same call again, combined against the specification.
    res = buf.dispatch(x, idx, w, layout="rank")
    y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, rank, 2)
    all_y = all_gather_objects(y.clone(), rt.cpu_group)
    want = spec_combine(all_y, idx, res.handle.scatter, num_experts=2 * world)
    out[f"{backend}_usable_after_errors"] = {"raised": None, "message": "",
                                             "ok": torch.equal(buf.combine(y, res.handle), want)}
    return out


def part_results(rt: Runtime, part: str) -> dict:
    """This rank's findings for one PART."""
    if part == "layout":
        return {"cases": [run_case(rt, i, case) for i, case in enumerate(CASES)], "bad": bad_calls(rt)}
    if part == "fp8":
        return {"cases": [run_case(rt, i, case, fp8=True) for i, case in enumerate(FP8_CASES)]}
    raise SystemExit(f"unknown part {part!r} (layout or fp8)")


def results(rt: Runtime, parts: str = "layout,fp8") -> dict:
    """This rank's findings by part, for the comma-separated PARTS (``gloo_worker_main`` writes them to
    OUT_DIR/rank{r}.json): one launch runs several parts, as the world's start-up is the slow part."""
    return {part: part_results(rt, part) for part in parts.split(",")}


if __name__ == "__main__":
    gloo_worker_main(results)
