"""Worker of tests/test_rank_layout.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29547 \
        tests/_torchrun_rank_layout_worker.py OUT_DIR

Every rank dispatches with ``layout="rank"`` on ``A2aEpBuffer`` and ``ReferenceEpBuffer`` and compares
every field bit for bit with the literal specification (tests/_rank_layout_spec.py) and with the torch
references, evaluated on every rank's gathered inputs; the rows must also name their sender. Then the
caller's per-rank rows are combined on both backends and compared with the specification's sum and
``reference_combine_rank_layout``; ``sync=False`` and an expert-layout dispatch on the same buffers are
checked too. Last, invalid layouts and algorithms on one or every rank (each must raise on every rank,
and the buffers must stay usable). Nothing here raises between collectives: findings are recorded and
written to OUT_DIR/rank{r}.json, the assertions live in the test.
"""

from __future__ import annotations

import torch
from _launch import bit_diff, gloo_worker_main, outcome  # tests/ is this script's sys.path[0]
from _rank_layout_spec import caller_expert, spec_combine, spec_dispatch, spec_scatter
from _worlds import case_config, case_inputs, on_host_backends, world_config

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.collectives import all_gather_objects
from cute_ep.inputs import decode_sender, make_inputs, sender_check_ok
from cute_ep.reference import (
    reference_combine,
    reference_combine_rank_layout,
    reference_dispatch_rank_layout,
    reference_rank_layout,
)
from cute_ep.reference_backend import ReferenceEpBuffer

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
FIELDS = ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert")


def run_case(rt: Runtime, number: int, case: tuple) -> dict:
    """Two rounds (different seeds and token counts) on one pair of buffers, then sync=False and an
    expert-layout dispatch on the same buffers."""
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
            spec = spec_dispatch(xs, idxs, ws, num_experts=num_e, max_tokens=max_tokens, dst=rank)
            n = spec.recv_x.shape[0]
            num_recv.append(n)
            sent.append(t)
            layout = reference_rank_layout(idxs, num_e)
            want = reference_dispatch_rank_layout(xs, idxs, ws, layout, max_tokens, rank)
            want_scatter = spec_scatter(idxs, num_experts=num_e, src=rank)

            results = {"a2a": a2a.dispatch(x, idx, w, mode=mode, sync=sync, layout="rank"),
                       "reference": ref.dispatch(x, idx, w, mode=mode, sync=sync, layout="rank")}
            for label, res in results.items():
                rows = n if sync else cfg.rank_capacity
                if res.num_recv != rows or int(res.recv_count[0]) != n:
                    found.append(f"{where} {label}: num_recv {res.num_recv}, recv_count "
                                 f"{res.recv_count.tolist()}, want {rows} / {n}")
                if res.recv_weights is not None or res.recv_scales is not None:
                    found.append(f"{where} {label}: recv_weights / recv_scales must be None")
                for f in FIELDS:
                    got = getattr(res, f)
                    if f != "tokens_per_expert":
                        if got.shape[0] != rows:
                            found.append(f"{where} {label}: {f} has {got.shape[0]} rows, want {rows}")
                        got = got[:n]
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
                # The rows name their sender: columns 0-3 against the tag s * M + t.
                src_rank, src_tok = decode_sender(res.recv_x[:n])
                tag = res.recv_src[:n].long()
                if not (torch.equal(src_rank, tag // max_tokens) and torch.equal(src_tok, tag % max_tokens)
                        and bool(sender_check_ok(res.recv_x[:n]).all())):
                    found.append(f"{where} {label}: rows do not name the sender their tag says")

            # Combine: the caller's rows (reduced over this rank's experts, weighted), one per row.
            ys = {}
            for label, res in results.items():
                ys[label] = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, rank, el)
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
        ra, rr = a2a.dispatch(x, idx, w), ref.dispatch(x, idx, w)
        for f in ("recv_x", "recv_weights", "recv_src", "tokens_per_expert"):
            d = bit_diff(f"expert layout {f}", getattr(ra, f), getattr(rr, f))
            if d:
                found.append(d)
        if ra.recv_topk_idx is not None or ra.handle.layout != "expert" or rr.handle.layout != "expert":
            found.append("expert layout: recv_topk_idx must be None and handle.layout 'expert'")
        y = ra.recv_x.clone()
        all_y = all_gather_objects(y, rt.cpu_group)
        want_out = reference_combine(all_y, [idx], [w], [ra.handle.scatter], num_experts=num_e)[0]
        for label, out in (("a2a", a2a.combine(y, ra.handle)), ("reference", ref.combine(y, rr.handle))):
            d = bit_diff(f"expert layout combine {label}", out, want_out)
            if d:
                found.append(d)
    return {"name": name, "mismatches": found, "num_recv": num_recv, "sent": sent,
            "rank_capacity": cfg.rank_capacity}


def bad_calls(rt: Runtime) -> dict:
    """Each scenario makes the layout or the combine algorithm invalid on one or every rank; every rank
    records what happened. The buffers must still work afterwards."""
    env = rt.env
    shape = dict(num_experts=2 * env.world_size, topk=2, hidden=32, dtype=BF16, max_tokens=8)
    plain, capped = world_config(env, **shape), world_config(env, **shape, capacity_factor=1.0)
    return on_host_backends(rt, plain, capped, bad_calls_of)


def bad_calls_of(rt: Runtime, backend: str, buf, capped) -> dict:
    rank, world = rt.env.rank, rt.env.world_size
    last = world - 1
    x, idx, w = make_inputs(rank, 7, 32, 2 * world, 2, BF16, 5)
    res = buf.dispatch(x, idx, w, layout="rank")
    y = caller_expert(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, rank, 2)
    scenarios = {
        "bad_layout_on_last": lambda: buf.dispatch(x, idx, w, layout="fancy" if rank == last else "rank"),
        "layout_mismatch": lambda: buf.dispatch(x, idx, w, layout="expert" if rank == 0 else "rank"),
        "fp8_rank": lambda: buf.dispatch(x, idx, w, fp8=True, layout="rank"),
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


def results(rt: Runtime) -> dict:
    """This rank's findings (``gloo_worker_main`` writes them to OUT_DIR/rank{r}.json)."""
    return {"cases": [run_case(rt, i, case) for i, case in enumerate(CASES)], "bad": bad_calls(rt)}


if __name__ == "__main__":
    gloo_worker_main(results)
