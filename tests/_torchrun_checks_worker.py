"""Worker of tests/test_checks_torchrun.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29511 \
        tests/_torchrun_checks_worker.py OUT_DIR

Each rank builds the reference receive buffers as a correct kernel would leave them (NaN-poisoned
tail), runs the distributed checks on correct and on corrupted buffers, and writes OUT_DIR/rank{r}.json
with every scenario's result. Virtual nodes of 2 ranks make all four route classes occur.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cute_ep.inputs import make_inputs
from cute_ep.reference import (
    reference_combine,
    reference_dispatch,
    reference_expert_outputs,
    reference_layout,
    unpack_source,
)
from cute_ep.validators.checks import check_combine, check_dispatch, format_summary

LOCAL_WORLD_SIZE = 2
EXPERTS, TOPK, HIDDEN, SEED = 8, 3, 24, 5
TOKENS = [16, 12, 0, 9]  # ragged; rank 2 sends nothing but still receives
MAX_TOKENS = 20
DTYPE = torch.bfloat16


def flip_low_bit(t: torch.Tensor, index: tuple[int, ...]) -> None:
    """Change one element by one ulp (in place), through an integer view of its bits."""
    view = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    view[index] ^= 1


def poisoned(rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """A capacity-row buffer holding rows, the unwritten tail poisoned (NaN / -1)."""
    fill = float("nan") if rows.dtype.is_floating_point else -1
    buf = torch.full((capacity, *rows.shape[1:]), fill, dtype=rows.dtype)
    buf[: rows.shape[0]] = rows
    return buf


def roll_permutation(layout, dst: int) -> torch.Tensor:
    """perm[j] = the old slot now at slot j, rotating every (local expert, source) group by one."""
    n = int(layout.num_recv[dst])
    perm = torch.arange(n)
    for lx in range(layout.experts_per_rank):
        for s in range(layout.world_size):
            a, b = layout.group_range(dst, lx, s)
            if b - a >= 2:
                perm[a:b] = torch.roll(perm[a:b], 1)
    return perm


def result_dict(res) -> dict:
    return dataclasses.asdict(res)


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == len(TOKENS), f"this worker is written for {len(TOKENS)} ranks, got {world}"

    # Every rank regenerates everyone's inputs (deterministic), to play a correct kernel.
    ins = [make_inputs(r, TOKENS[r], HIDDEN, EXPERTS, TOPK, DTYPE, SEED) for r in range(world)]
    xs, idxs, ws = ([i[j] for i in ins] for j in range(3))
    x, idx, w = ins[rank]
    layout = reference_layout(idxs, EXPERTS)
    dispatched = reference_dispatch(xs, idxs, ws, layout, MAX_TOKENS)
    exp = dispatched[rank]
    n = exp.num_recv
    capacity = world * MAX_TOKENS * min(TOPK, EXPERTS // world)
    recv_x, recv_w, recv_src = (poisoned(t, capacity) for t in (exp.recv_x, exp.recv_w, exp.recv_src))
    common = {"max_tokens": MAX_TOKENS, "num_experts": EXPERTS, "local_world_size": LOCAL_WORLD_SIZE}
    results: dict = {"rank": rank, "num_recv": n, "total_pairs": int(layout.counts.sum())}

    def dispatch(name, rx=recv_x, rw=recv_w, rs=recv_src, **kw):
        res = check_dispatch(x, idx, w, rx, rw, rs, **common, **kw)
        results[name] = result_dict(res)
        results[name]["summary"] = format_summary(res, name)

    dispatch("dispatch_ok")

    # Atomic mode: same group ranges, another order inside each group.
    perms = [roll_permutation(layout, d) for d in range(world)]
    perm = perms[rank]
    rolled = [t.clone() for t in (recv_x, recv_w, recv_src)]
    for t, src in zip(rolled, (recv_x, recv_w, recv_src), strict=True):
        t[:n] = src[:n][perm]
    results["rolled_changed"] = bool((perm != torch.arange(n)).any())
    dispatch("dispatch_unordered_ok", *rolled, ordered=False)
    dispatch("dispatch_rolled_but_ordered", *rolled, ordered=True)

    # One flipped bit in one row on rank 1.
    bad_x = recv_x.clone()
    slot = n // 2
    if rank == 1:
        flip_low_bit(bad_x, (slot, 5))
        s, t, k = unpack_source(int(exp.recv_src[slot]), MAX_TOKENS, TOPK)
        results["corrupted_pair"] = {"s": s, "t": t, "k": k, "e": int(idxs[s][t, k]), "slot": slot}
    dispatch("dispatch_bad_row", rx=bad_x)

    # One weight one ulp off on rank 2 (which receives rows though it sends none).
    bad_w = recv_w.clone()
    if rank == 2:
        flip_low_bit(bad_w, (0,))
    dispatch("dispatch_bad_weight", rw=bad_w)

    # A too-short buffer on rank 3: must be a failure message, not an exception that hangs the rest.
    dispatch("dispatch_short", rx=recv_x[: max(n - 1, 0)] if rank == 3 else recv_x)

    # Unordered mode still catches a duplicated row (one row written twice, another never).
    dup = [t.clone() for t in rolled]
    if rank == 0:
        dup[0][1] = dup[0][0]
        dup[1][1] = dup[1][0]
        dup[2][1] = dup[2][0]
    dispatch("dispatch_unordered_duplicate", *dup, ordered=False)

    # Combine: expert outputs of the test expert, and the output a correct combine would produce.
    ys = reference_expert_outputs(dispatched, layout)
    out = reference_combine(ys, [idx], [w], [layout.scatter[rank]], num_experts=EXPERTS)[0]
    recv_y = poisoned(ys[rank], capacity)

    def combine(name, o=out, y=recv_y, **kw):
        res = check_combine(o, idx, w, y, local_world_size=LOCAL_WORLD_SIZE, num_experts=EXPERTS, **kw)
        results[name] = result_dict(res)
        results[name]["summary"] = format_summary(res, name)

    combine("combine_ok")
    bad_out = out.clone()
    if rank == 0:
        flip_low_bit(bad_out, (1, 6))
    combine("combine_bad_element", o=bad_out)

    # Atomic mode combine: rows sit at rolled slots, and the kernel's own scatter says where.
    rolled_y = recv_y.clone()
    rolled_y[:n] = recv_y[:n][perm]
    inverse = [torch.argsort(p) for p in perms]  # old slot -> new slot, per destination
    el = EXPERTS // world
    my_scatter = layout.scatter[rank].clone()
    valid = idx >= 0
    for d in range(world):
        m = valid & (idx // el == d)
        my_scatter[m] = inverse[d][layout.scatter[rank][m]]
    combine("combine_atomic_scatter", y=rolled_y, scatter=my_scatter)
    combine("combine_atomic_default_scatter", y=rolled_y)

    # Routing that only ever stays on the own rank: a coverage failure.
    self_idx = (rank * el + torch.arange(TOKENS[rank]) % el)[:, None]
    self_w = w[:, :1].contiguous()
    self_layout = reference_layout(
        [(r * el + torch.arange(TOKENS[r]) % el)[:, None] for r in range(world)], EXPERTS
    )
    self_exp = reference_dispatch(
        xs,
        [(r * el + torch.arange(TOKENS[r]) % el)[:, None] for r in range(world)],
        [i[2][:, :1].contiguous() for i in ins],
        self_layout,
        MAX_TOKENS,
    )[rank]
    sx, sw, ss = (poisoned(t, capacity) for t in (self_exp.recv_x, self_exp.recv_w, self_exp.recv_src))
    for name, req in (("coverage_missing", True), ("coverage_not_required", False)):
        res = check_dispatch(x, self_idx, self_w, sx, sw, ss, **common, require_coverage=req)
        results[name] = result_dict(res)

    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
