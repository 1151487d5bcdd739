"""``cute_ep.deep_ep`` in worlds of 1, 2 and 4 ranks on the reference backend: the checks DeepEP v1.2.1's own
tests (tests/test_intranode.py, tests/test_low_latency.py) make, written against plain loops over every
rank's gathered inputs.

This file is also the torchrun worker (``python -m torch.distributed.run --nproc-per-node 4
tests/test_deep_ep_worlds.py OUT_DIR``): every rank runs ``run_checks`` on the launch's gloo group and writes
what failed, check by check, to OUT_DIR/rank{r}.json; the tests assert on it. A world of one also runs
in-process, without a process group (``Buffer(None)``).

Normal mode: the layout (counts and is_token_in_rank), dispatch of BF16 rows (random, and rows equal to
their source rank as DeepEP's tests use), FP8 rows with per-128-column scales (column-major scales, as
DeepEP's test passes them) and FP32 rows, with and without top-k, synchronous and async, with
``previous_event``; received rows per source rank (in order, and as sets), the rank prefix matrix (this
rank's column, the rest 0, as DeepEP's handle), the
handle's other matrices, ``num_recv_tokens_per_expert_list`` with ``expert_alignment``,
``num_worst_tokens`` padding, the cached-handle dispatch, combine with and without top-k weights and with
bias. Low-latency mode: dispatch in BF16 and FP8 (``round_scale``, ``use_ue8m0``), with and without
``return_recv_hook``: the per-expert counts, statistics, layout ranges, received rows and source indices,
the FP8 bytes against the sender's cast, and combine (with ``zero_copy`` and ``out``) against the fp32
weighted sum.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

RANK_OFFSET = 128  # the low-latency test's rows hold rank - 128 (exact in bf16)


# --------------------------------------------------------------------------------------------------
# helpers of the checks (independent of cute_ep.deep_ep's own code)
# --------------------------------------------------------------------------------------------------


def cast_fp8_reference(x: torch.Tensor, round_scale: bool = False, margin: float = 1e-4
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 cast, one scale per 128 columns, element by element in Python floats rounded to fp32
    where the GPU rounds: amax = max(margin, max |x|); scale_inv = amax * fp32(1/448) (or the next power
    of two of it with ``round_scale``); q = e4m3(x * fp32(448 / amax)) (or x / scale_inv). Returns (q [T, H]
    float8_e4m3fn, scale_inv [T, H / 128] fp32)."""
    t, h = x.shape
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731 (round to fp32)
    xf = x.float()
    q = torch.empty((t, h), dtype=torch.float32)
    scales = torch.empty((t, h // 128), dtype=torch.float32)
    inv448 = f32(1.0 / 448.0)
    for i in range(t):
        for b in range(h // 128):
            block = xf[i, 128 * b : 128 * (b + 1)]
            amax = max(f32(margin), float(block.abs().max()))
            if round_scale:
                mant, exp = math.frexp(f32(amax * inv448))  # value = mant * 2**exp, 0.5 <= mant < 1
                e = exp - 1 if mant == 0.5 else exp
                scale, scale_inv = 2.0 ** -e, 2.0 ** e
            else:
                scale, scale_inv = f32(448.0 / amax), f32(amax * inv448)
            prod = (block * torch.tensor(scale, dtype=torch.float32)).clamp(-448, 448)
            q[i, 128 * b : 128 * (b + 1)] = prod
            scales[i, b] = scale_inv
    return q.to(torch.float8_e4m3fn), scales


def fp8_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [N, H] e4m3 and scales [N, H / 128] (fp32, or UE8M0 bytes packed in int32) -> [N, H] fp32."""
    if scales.dtype == torch.int32:
        scales = (ue8m0_bytes(scales, q.shape[1] // 128).to(torch.int32) << 23).view(torch.float32)
    n, h = q.shape
    return (q.float().reshape(n, h // 128, 128) * scales.float().reshape(n, h // 128, 1)).reshape(n, h)


def ue8m0_bytes(packed: torch.Tensor, count: int) -> torch.Tensor:
    """[N, count] uint8: the exponent bytes of UE8M0 scales packed four to an int32 [N, ceil(count / 4)]
    (byte j of int p is scale 4p + j)."""
    ints = packed.reshape(packed.shape[0], packed.shape[-1]).to(torch.int64)
    parts = torch.stack([(ints >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    return parts.reshape(packed.shape[0], 4 * ints.shape[1])[:, :count].to(torch.uint8)


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cosine similarity of a + 1 and b + 1 (DeepEP's tests' measure)."""
    a, b = a.double() + 1, b.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def channel_ranges(tokens: int, channels: int) -> list[tuple[int, int]]:
    """DeepEP's split of ``tokens`` into ``channels`` contiguous ranges."""
    per = -(-tokens // channels)
    out = []
    for c in range(channels):
        start = min(per * c, tokens)
        out.append((start, min(start + per, tokens)))
    return out


class Recorder:
    """Collects the failed expectations of one check (nothing raises between collectives)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, ok: Any, what: str) -> None:
        if not bool(ok):
            self.failures.append(what)

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """Local checks between collective calls: an exception is recorded, and the rank goes on to the
        next collective with its peers."""
        try:
            yield
        except Exception:
            self.failures.append(traceback.format_exc())


# --------------------------------------------------------------------------------------------------
# the normal mode
# --------------------------------------------------------------------------------------------------


def normal_inputs(rank: int, tokens: int, hidden: int, experts: int, topk: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    scores = torch.randn(tokens, experts, generator=g).abs() + 1
    idx = scores.topk(topk, dim=-1, sorted=False).indices
    drop = torch.rand(tokens, topk, generator=g) < 0.2
    idx = idx.masked_fill(drop, -1)
    x_rank = torch.full((tokens, hidden), float(rank), dtype=torch.bfloat16)
    x_rand = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w_rank = torch.full((tokens, topk), float(rank))
    w_rand = torch.randn(tokens, topk, generator=g)
    q, s = cast_fp8_reference(x_rank)
    return dict(idx=idx, x_rank=x_rank, x_rand=x_rand, w_rank=w_rank, w_rand=w_rand,
                x_fp8=(q, s.T.contiguous().T), x_f32=torch.randn(tokens, hidden, generator=g))


def layout_reference(idx: torch.Tensor, experts: int, world: int
                     ) -> tuple[list[int], list[int], torch.Tensor]:
    el = experts // world
    per_expert = [0] * experts
    in_rank = torch.zeros(idx.shape[0], world, dtype=torch.bool)
    for t in range(idx.shape[0]):
        for e in idx[t].tolist():
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // el] = True
    return in_rank.sum(0).tolist(), per_expert, in_rank


def check_normal(buf: Any, rank: int, world: int, gather: Callable[[Any], list], tokens_by_rank: list[int],
                 hidden: int = 256, el: int = 3, topk: int = 3) -> dict[str, list[str]]:
    import cute_ep.deep_ep as deep_ep

    experts = el * world
    t_me = tokens_by_rank[rank]
    inp = normal_inputs(rank, t_me, hidden, experts, topk, seed=7)
    # float8 tensors do not pickle here: their bytes travel as uint8
    every = gather({k: (v[0].view(torch.uint8), v[1]) if k == "x_fp8" else v for k, v in inp.items()})
    for e in every:
        e["x_fp8"] = (e["x_fp8"][0].view(torch.float8_e4m3fn), e["x_fp8"][1])
    out: dict[str, list[str]] = {}

    rec = Recorder()
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(inp["idx"], experts)
    ref_rank, ref_expert, ref_in = layout_reference(inp["idx"], experts, world)
    rec.expect(per_rdma is None, "num_tokens_per_rdma_rank is not None")
    rec.expect(per_rank.dtype == torch.int32 and per_rank.tolist() == ref_rank, f"per rank {per_rank}")
    rec.expect(per_expert.dtype == torch.int32 and per_expert.tolist() == ref_expert, "per expert")
    rec.expect(in_rank.dtype == torch.bool and torch.equal(in_rank, ref_in), "is_token_in_rank")
    rec.expect(isinstance(event, deep_ep.EventOverlap), "layout event")
    out["layout"] = rec.failures

    ins = [layout_reference(e["idx"], experts, world)[2] for e in every]
    counts = [[int(ins[s][:, d].sum()) for d in range(world)] for s in range(world)]
    prefix = torch.tensor(counts).cumsum(0).to(torch.int32)
    per_expert_all = [layout_reference(e["idx"], experts, world)[1] for e in every]
    sum_experts = [sum(c[rank * el + i] for c in per_expert_all) for i in range(el)]

    def expected_rows(key: str) -> list[torch.Tensor]:
        """Per source rank, the rows of ``key`` this rank must receive, in token order."""
        def rows(e: dict, s: int) -> Any:
            sel = torch.nonzero(ins[s][:, rank]).flatten()
            v = e[key]
            return (v[0][sel], v[1][sel]) if isinstance(v, tuple) else v[sel]
        return [rows(e, s) for s, e in enumerate(every)]

    def expected_topk(wkey: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids, ws = [], []
        for s, e in enumerate(every):
            sel = torch.nonzero(ins[s][:, rank]).flatten()
            g = e["idx"][sel]
            mine = (g >= rank * el) & (g < (rank + 1) * el)
            ids.append(torch.where(mine, g - rank * el, -1))
            ws.append(torch.where(mine, e[wkey][sel], torch.zeros(())))
        return torch.cat(ids), torch.cat(ws)

    channels = deep_ep.Buffer.get_dispatch_config(world).num_sms // 2
    variants = [("rand", "x_rand", "w_rand"), ("rank", "x_rank", "w_rank"), ("fp8", "x_fp8", "w_rank"),
                ("f32", "x_f32", "w_rand")]
    for previous in (False, True):
        for async_mode in (False, True):
            for name, xkey, wkey in variants:
                for with_topk in (False, True):
                    kind = "topk" if with_topk else "plain"
                    tag = f"dispatch-{name}-{kind}-async{int(async_mode)}-prev{int(previous)}"
                    rec = Recorder()
                    try:
                        _normal_case(buf, rec, rank, world, gather, inp, xkey, wkey, with_topk, async_mode,
                                     previous, per_rank, in_rank, per_expert, expected_rows, expected_topk,
                                     prefix, sum_experts, counts, every, ins, channels, el)
                    except Exception:
                        rec.failures.append(traceback.format_exc())
                    out[tag] = rec.failures
    return out


def _normal_case(buf, rec, rank, world, gather, inp, xkey, wkey, with_topk, async_mode, previous, per_rank,
                 in_rank, per_expert, expected_rows, expected_topk, prefix, sum_experts, counts, every, ins,
                 channels, el) -> None:
    import cute_ep.deep_ep as deep_ep

    x = inp[xkey]
    args = dict(x=x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                async_finish=async_mode)
    if with_topk:
        args.update(topk_idx=inp["idx"], topk_weights=inp[wkey])
    if previous:
        args["previous_event"] = deep_ep.Buffer.capture()
    recv_x, recv_idx, recv_w, per_list, handle, event = buf.dispatch(**args)
    if async_mode:
        event.current_stream_wait()
    else:
        rec.expect(event.event is None, "a synchronous dispatch returned an event")
    n = sum(counts[s][rank] for s in range(world))
    fp8 = isinstance(x, tuple)
    with rec.section():
        _check_dispatch(rec, rank, world, x, xkey, wkey, with_topk, recv_x, recv_idx, recv_w, per_list,
                        handle, in_rank, expected_rows, expected_topk, prefix, sum_experts, ins, every,
                        channels, el, n)
    if with_topk:
        # num_worst_tokens: padded to the worst case, no host sync, same prefix, -1 after
        worst = max(e["idx"].shape[0] for e in every) * world
        wx, widx, ww, wlist, _, wevent = buf.dispatch(**args, num_worst_tokens=worst)
        if async_mode:
            wevent.current_stream_wait()
        aligned = buf.dispatch(**{**args, "expert_alignment": 4})[3]
        with rec.section():
            rx = recv_x[0] if fp8 else recv_x
            wrx = wx[0] if fp8 else wx
            rec.expect(wlist == [] and wrx.shape[0] == widx.shape[0] == ww.shape[0] == worst,
                       "num_worst_tokens shapes")
            rec.expect(same_bits(wrx[:n], rx) and torch.equal(widx[:n], recv_idx)
                       and same_bits(ww[:n], recv_w), "num_worst_tokens prefix")
            rec.expect(bool((widx[n:] == -1).all()), "num_worst_tokens padding ids")
            rec.expect(aligned == [-(-c // 4) * 4 for c in per_list], f"expert_alignment 4: {aligned}")
    else:
        cargs = dict(x=x, handle=handle, async_finish=async_mode)
        if previous:
            cargs["previous_event"] = deep_ep.Buffer.capture()
        cached = buf.dispatch(**cargs)
        if async_mode:
            cached[5].current_stream_wait()
        with rec.section():
            crx = cached[0]
            rec.expect(cached[1:5] == (None, None, None, None), "cached dispatch extras")
            pairs = zip(crx, recv_x, strict=True) if fp8 else [(crx, recv_x)]
            rec.expect(all(same_bits(a, b) for a, b in pairs), "cached dispatch rows")
    # combine: the rows summed over the destination ranks, fp32 from 0.0, one rounding
    y = fp8_back(*recv_x).to(torch.bfloat16) if fp8 else recv_x
    cargs = dict(x=y, handle=handle, async_finish=async_mode)
    if with_topk:
        cargs["topk_weights"] = recv_w
    if previous:
        cargs["previous_event"] = deep_ep.Buffer.capture()
    combined, combined_w, cevent = buf.combine(**cargs)
    if async_mode:
        cevent.current_stream_wait()
    ys = gather(y)
    ws = gather(recv_w) if with_topk else None
    bias_case = not with_topk and not async_mode and not previous
    if bias_case:
        g = torch.Generator().manual_seed(rank + 99)
        b0 = torch.randn(combined.shape, generator=g).to(y.dtype)
        b1 = torch.randn(combined.shape, generator=g).to(y.dtype)
        with_bias = buf.combine(y, handle, bias=(b0, b1))[0]
        one = buf.combine(y, handle, bias=b0)[0]
    with rec.section():
        t_me = in_rank.shape[0]
        acc = torch.zeros(t_me, y.shape[1])
        wacc = torch.zeros(t_me, inp["idx"].shape[1])
        for d in range(world):
            lo = int(prefix[rank - 1][d]) if rank else 0
            sel = torch.nonzero(in_rank[:, d]).flatten()
            acc[sel] = acc[sel] + ys[d][lo : lo + sel.numel()].float()
            if with_topk:
                wacc[sel] = wacc[sel] + ws[d][lo : lo + sel.numel()]
        rec.expect(same_bits(combined, acc.to(y.dtype)), "combined_x bits")
        dest = in_rank.sum(1, keepdim=True)
        if not fp8 and t_me:  # DeepEP's check: the sum over the destinations / their number is x
            mean = combined.float() / dest.clamp(min=1)
            rec.expect(calc_diff(mean, x.float() * (dest > 0)) < 5e-6, "combined_x / destinations vs x")
        if with_topk:
            rec.expect(same_bits(combined_w, wacc), "combined_topk_weights")
        else:
            rec.expect(combined_w is None, "combined_topk_weights without topk_weights")
        if bias_case:
            rounded = acc.to(y.dtype).float()
            want = (rounded + (b0.float() + b1.float())).to(y.dtype)
            rec.expect(same_bits(with_bias, want), "bias after the rounding")
            # DeepEP adds the bias before rounding: apart by at most the rounding of the rows' sum
            deepep_order = ((b0.float() + b1.float()) + acc).to(y.dtype).float()
            slack = (acc - rounded).abs() + deepep_order.abs() * 2**-7 + 2**-126
            rec.expect(bool(((with_bias.float() - deepep_order).abs() <= slack).all()),
                       "bias within one rounding of DeepEP's order")
            rec.expect(same_bits(one, (rounded + b0.float()).to(y.dtype)), "single bias")


def _check_dispatch(rec, rank, world, x, xkey, wkey, with_topk, recv_x, recv_idx, recv_w, per_list, handle,
                    in_rank, expected_rows, expected_topk, prefix, sum_experts, ins, every, channels, el,
                    n) -> None:
    fp8 = isinstance(x, tuple)
    rx = recv_x[0] if fp8 else recv_x
    hidden = x[0].shape[1] if fp8 else x.shape[1]
    rec.expect(rx.shape == (n, hidden), f"recv_x shape {rx.shape}, want {n} rows")
    rec.expect(per_list == sum_experts, f"num_recv_tokens_per_expert_list {per_list} != {sum_experts}")
    rec.expect(isinstance(handle, tuple) and len(handle) == 6, "handle is not a 6-tuple")
    # DeepEP's handle holds this rank's column of the prefix matrix, the other entries 0 (v1.2.1, on GPUs)
    column = torch.zeros_like(prefix)
    column[:, rank] = prefix[:, rank]
    rec.expect(same_bits(handle[0], column), f"rank_prefix_matrix {handle[0].tolist()} != {column.tolist()}")
    want = expected_rows(xkey)
    got_parts = []
    for s in range(world):
        lo = int(prefix[s - 1][rank]) if s else 0
        hi = int(prefix[s][rank])
        if fp8:
            part = (recv_x[0][lo:hi], recv_x[1][lo:hi])
            rec.expect(same_bits(part[0], want[s][0]) and same_bits(part[1], want[s][1].contiguous()),
                       f"FP8 rows from rank {s}")
        else:
            part = recv_x[lo:hi]
            rec.expect(same_bits(part, want[s]), f"rows from rank {s}")
            # as sets too (DeepEP's check_data: rows from source s hold s)
            got = sorted(tuple(r) for r in part.float().tolist())
            exp = sorted(tuple(r) for r in want[s].float().tolist())
            rec.expect(got == exp, f"rows from rank {s} as a set")
        got_parts.append(part)
        src_tokens = torch.nonzero(ins[s][:, rank]).flatten().to(torch.int32)
        rec.expect(torch.equal(handle[3][lo:hi], src_tokens), f"recv_src_idx of rank {s}")
    if xkey == "x_rank":
        held = all(torch.all(p == s) for s, p in enumerate(got_parts))
        rec.expect(held, "check_data: rows hold the source")
    # the handle's matrices, from DeepEP's definitions
    tokens = [e["idx"].shape[0] for e in every]
    ranges = channel_ranges(tokens[rank], channels)
    cpm = torch.tensor([[int(in_rank[a:b, d].sum()) for a, b in ranges] for d in range(world)]).cumsum(1)
    rec.expect(same_bits(handle[1], cpm.to(torch.int32)), "channel_prefix_matrix")
    rcpm = torch.zeros(world, channels, dtype=torch.int32)
    for s in range(world):
        acc = 0
        for c, (a, b) in enumerate(channel_ranges(tokens[s], channels)):
            rcpm[s, c] = acc
            acc += int(ins[s][a:b, rank].sum())
    rec.expect(same_bits(handle[2], rcpm), f"recv_channel_prefix_matrix {handle[2].tolist()} {rcpm.tolist()}")
    rec.expect(handle[4] is in_rank, "handle[4] is not the caller's is_token_in_rank")
    head = torch.full((tokens[rank], world), -1, dtype=torch.int32)
    for a, b in ranges:
        for d in range(world):
            k = 0
            for t in range(a, b):
                if in_rank[t, d]:
                    head[t, d] = k
                    k += 1
    rec.expect(same_bits(handle[5], head), "send_head")
    if with_topk:
        want_idx, want_w = expected_topk(wkey)
        rec.expect(recv_idx.dtype == torch.int64 and torch.equal(recv_idx, want_idx), "recv_topk_idx")
        rec.expect(same_bits(recv_w, want_w), "recv_topk_weights")
        rec.expect(bool(((recv_idx >= -1) & (recv_idx < el)).all()), "recv_topk_idx range")
        rec.expect([int((recv_idx == i).sum()) for i in range(el)] == per_list, "topk counts vs list")
    else:
        rec.expect(recv_idx is None and recv_w is None, "top-k outputs without top-k")


def check_bad_counts(buf: Any, rank: int, world: int) -> list[str]:
    """num_tokens_per_rank that disagrees with is_token_in_rank on one rank raises on every rank."""
    rec = Recorder()
    idx = torch.tensor([[0], [world - 1]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, world)
    wrong = per_rank.clone()
    if rank == world - 1:
        wrong[0] += 1
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    try:
        buf.dispatch(x, num_tokens_per_rank=wrong, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        rec.failures.append("no error")
    except ValueError as exc:
        rec.expect(f"rank(s) [{world - 1}]" in str(exc), f"message: {exc}")
    from cute_ep.deep_ep import checks as deep_ep_checks

    # the buffer stays usable: token 0 of every rank goes to rank 0, token 1 to the last rank; with good
    # arguments the agreement rides in the count table (no collective of its own once the buffers of
    # this shape are built)
    agreements = []
    real = deep_ep_checks._all_alike
    for call in range(2):
        deep_ep_checks._all_alike = lambda *args, call=call: agreements.append(call) or real(*args)
        try:
            res = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert)
        finally:
            deep_ep_checks._all_alike = real
        rec.expect(res[0].shape[0] == (world if rank in (0, world - 1) else 0), "dispatch after the error")
    rec.expect(1 not in agreements, f"a good dispatch ran agreements of its own: {agreements}")
    return rec.failures


# --------------------------------------------------------------------------------------------------
# the low-latency mode
# --------------------------------------------------------------------------------------------------


def check_low_latency(buf: Any, rank: int, world: int, gather: Callable[[Any], list], tokens: int = 24,
                      hidden: int = 256, el: int = 4, topk: int = 3) -> dict[str, list[str]]:
    experts = el * world
    random.seed(rank + 5)
    g = torch.Generator().manual_seed(rank + 5)
    x = torch.full((tokens, hidden), float(rank - RANK_OFFSET), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(tokens).to(torch.bfloat16).view(-1, 1)
    x_rand = (torch.randn(tokens, hidden, generator=g) * 0.1).to(torch.bfloat16)
    scores = torch.randn(tokens, experts, generator=g).abs() + 1
    topk_idx = scores.topk(topk, dim=-1, sorted=True).indices
    for _ in range(4):
        topk_idx[random.randint(0, tokens - 1), random.randint(0, topk - 1)] = -1
    topk_w = torch.randn(tokens, topk, generator=g).abs()
    all_idx = gather(topk_idx)
    all_x = gather(x)
    all_x_rand = gather(x_rand)
    out: dict[str, list[str]] = {}
    m = tokens
    for xname, cur, every_x in (("ranked", x, all_x), ("rand", x_rand, all_x_rand)):
        for hook_mode in (False, True):
            for use_fp8 in (False, True):
                for round_scale in (False, True) if use_fp8 else (False,):
                    for ue8m0 in (False, True) if round_scale else (False,):
                        flags = f"hook{int(hook_mode)}-fp8{int(use_fp8)}-rs{int(round_scale)}-ue{int(ue8m0)}"
                        tag = f"ll-{xname}-{flags}"
                        rec = Recorder()
                        try:
                            _ll_case(buf, rec, rank, world, gather, cur, every_x, topk_idx, all_idx, topk_w,
                                     m, experts, el, hidden, hook_mode, use_fp8, round_scale, ue8m0,
                                     xname == "ranked")
                        except Exception:
                            rec.failures.append(traceback.format_exc())
                        out[tag] = rec.failures
    return out


def _ll_case(buf, rec, rank, world, gather, cur, every_x, topk_idx, all_idx, topk_w, m, experts, el, hidden,
             hook_mode, use_fp8, round_scale, ue8m0, ranked) -> None:
    stats = torch.zeros(el, dtype=torch.int32)
    recv, count, handle, event, hook = buf.low_latency_dispatch(
        cur, topk_idx, m, experts, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
        round_scale=round_scale, use_ue8m0=ue8m0, async_finish=not hook_mode, return_recv_hook=hook_mode)
    if hook_mode:
        rec.expect(callable(hook), "no hook")
        hook()
    else:
        rec.expect(hook is None, "hook without return_recv_hook")
        event.current_stream_wait()
    slots = world * m
    with rec.section():
        _check_ll_dispatch(rec, rank, world, recv, count, handle, stats, every_x, all_idx, m, experts, el,
                           hidden, use_fp8, round_scale, ue8m0, ranked)
    # simulated expert outputs: the received rows (FP8: cast back to bf16), zeros past each count
    full = torch.zeros(el, slots, hidden, dtype=torch.bfloat16)
    with rec.section():
        for i in range(el):
            n = int(count[i])
            rows = fp8_back(recv[0][i, :n], recv[1][i, :n]) if use_fp8 else recv[i, :n]
            full[i, :n] = rows.to(torch.bfloat16)
    results = []
    for zero_copy in (False, True):
        if zero_copy:
            buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = full
        out = torch.empty(cur.shape, dtype=torch.bfloat16)
        combined, cevent, chook = buf.low_latency_combine(full, topk_idx, topk_w, handle, zero_copy=zero_copy,
                                                          async_finish=not hook_mode,
                                                          return_recv_hook=hook_mode, out=out)
        if hook_mode:
            chook()
        else:
            cevent.current_stream_wait()
        rec.expect(combined is out, "out= not returned")
        results.append(combined)
    rec.expect(same_bits(results[0], results[1]), "zero_copy differs")
    owners = gather(full)
    src_all = gather(handle[0])
    ranges_all = gather(handle[1])
    with rec.section():
        _check_ll_combine(rec, rank, el, cur, topk_idx, topk_w, results[0], owners, src_all, ranges_all,
                          use_fp8)


def _check_ll_dispatch(rec, rank, world, recv, count, handle, stats, every_x, all_idx, m, experts, el, hidden,
                       use_fp8, round_scale, ue8m0, ranked) -> None:
    slots = world * m
    rec.expect(len(handle) == 5 and handle[2:] == (m, hidden, experts), "handle entries")
    rec.expect(count.dtype == torch.int32 and count.shape == (el,), "recv_count")
    if use_fp8:
        q, scales = recv
        rec.expect(q.shape == (el, slots, hidden) and q.dtype == torch.float8_e4m3fn, "FP8 recv shape")
        s_cols = -(-hidden // 512) if ue8m0 else hidden // 128
        s_dtype = torch.int32 if ue8m0 else torch.float32
        rec.expect(scales.shape == (el, slots, s_cols) and scales.dtype == s_dtype, f"scales {scales.shape}")
        rec.expect(scales.stride()[1:] == (1, slots), f"scales column-major: stride {scales.stride()}")
    else:
        rec.expect(recv.shape == (el, slots, hidden) and recv.dtype == every_x[rank].dtype, "BF16 recv shape")
    src_info, layout_range = handle[0], handle[1]
    rec.expect(src_info.shape == (el, slots) and src_info.dtype == torch.int32, "src_info")
    rec.expect(layout_range.shape == (el, world) and layout_range.dtype == torch.int64, "layout_range")
    for i in range(el):
        expert = rank * el + i
        n = int(count[i])
        rec.expect(int(stats[i]) == n, f"stats of local expert {i}")
        rec.expect(n == int((layout_range[i] & 0xFFFFFFFF).sum()), f"layout_range counts of expert {i}")
        rec.expect(n == sum(int((a == expert).sum()) for a in all_idx), f"count of expert {i}")
        if use_fp8:  # cast back to bf16, as DeepEP's test does
            got = fp8_back(recv[0][i, :n], recv[1][i, :n]).to(torch.bfloat16).float()
        else:
            got = recv[i, :n].float()
        for j in range(world):
            begin, cnt = int(layout_range[i, j] >> 32), int(layout_range[i, j] & 0xFFFFFFFF)
            toks = torch.nonzero((all_idx[j] == expert).any(dim=1)).flatten()
            rec.expect(cnt == toks.numel(), f"expert {i} rows from rank {j}")
            rec.expect(torch.equal(src_info[i, begin : begin + cnt], toks.to(torch.int32)),
                       f"src_info of expert {i} from rank {j}")
            sent = every_x[j][toks]
            if use_fp8:
                want_q, want_s = cast_fp8_reference(sent, round_scale)
                where = f"expert {i} rank {j}"
                rec.expect(same_bits(recv[0][i, begin : begin + cnt], want_q), f"FP8 values, {where}")
                got_s = recv[1][i, begin : begin + cnt]
                if ue8m0:
                    exps = ue8m0_bytes(got_s, hidden // 128)
                    want_e = ((want_s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                    rec.expect(torch.equal(exps, want_e), f"UE8M0 scales, {where}")
                else:
                    rec.expect(same_bits(got_s, want_s), f"scales, {where}")
            else:
                rec.expect(same_bits(recv[i, begin : begin + cnt], sent), f"BF16 rows, expert {i} rank {j}")
            if ranked and not round_scale:  # DeepEP's check: the rows name their source rank and token
                block = got[begin : begin + cnt]
                rec.expect(bool((block[:, :-128] == j - RANK_OFFSET).all()), f"rows of rank {j} hold it")
                rec.expect(torch.equal(block[:, -128:], src_info[i, begin : begin + cnt].float().view(-1, 1)
                                       .expand(-1, 128)), f"last columns hold the token, rank {j}")


def _check_ll_combine(rec, rank, el, cur, topk_idx, topk_w, combined, owners, src_all, ranges_all,
                      use_fp8) -> None:
    # the reference: sum over k ascending of w * (the row expert e got from this rank's token t)
    acc = torch.zeros(cur.shape)
    for t in range(cur.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            d, i = divmod(e, el)
            begin = int(ranges_all[d][i, rank] >> 32)
            cnt = int(ranges_all[d][i, rank] & 0xFFFFFFFF)
            pos = begin + int(torch.nonzero(src_all[d][i, begin : begin + cnt] == t)[0, 0])
            acc[t] = acc[t] + topk_w[t, k] * owners[d][i, pos].float()
    rec.expect(same_bits(combined, acc.to(torch.bfloat16)), "combined_x bits vs the fp32 weighted sum")
    want = cur.float() * topk_w.masked_fill(topk_idx == -1, 0).sum(dim=1, keepdim=True)
    diff = calc_diff(want, combined)
    rec.expect(diff < (9e-4 if use_fp8 else 1e-5), f"calc_diff {diff}")
    rec.expect(not torch.isnan(combined).any(), "NaN in combined_x")


# --------------------------------------------------------------------------------------------------
# one rank's run (torchrun worker, or in-process in a world of one)
# --------------------------------------------------------------------------------------------------


def run_checks(group: Any) -> dict[str, list[str]]:
    """Every check on one rank of ``group`` (None: a world of one without a process group)."""
    from cute_ep.collectives import all_gather_objects, world_of
    from cute_ep.deep_ep import Buffer

    rank, world = world_of(group)
    gather = lambda obj: all_gather_objects(obj, group)  # noqa: E731
    buf = Buffer(group, num_nvl_bytes=0, explicitly_destroy=True)
    results: dict[str, list[str]] = {}
    # ragged token counts, one rank without tokens in the world of 4
    tokens_by_rank = [12, 9, 0, 7][:world] if world > 1 else [12]
    results.update(check_normal(buf, rank, world, gather, tokens_by_rank))
    results["bad-counts"] = check_bad_counts(buf, rank, world) if world > 1 else []
    results.update(check_low_latency(buf, rank, world, gather))
    buf.destroy()
    return results


def _worker_results(rt: Any) -> dict:
    return {"rank": rt.env.rank, "results": run_checks(rt.group)}


def _assert_clean(results: dict[str, list[str]], rank: int) -> None:
    bad = {name: fails for name, fails in results.items() if fails}
    assert not bad, f"rank {rank}: " + "\n".join(f"{n}: {f}" for n, f in bad.items())


@pytest.fixture(scope="module", params=[1, 2, 4], ids=["ep1", "ep2", "ep4"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from _launch import worker_results

    world = request.param
    return worker_results(__file__, world, tmp_path_factory.mktemp(f"deep_ep{world}"), timeout=240)


pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def test_world_of_one_in_process() -> None:
    """Buffer(None) without torch.distributed: every check on a world of one, in this process."""
    _assert_clean(run_checks(None), 0)


def test_every_rank_passes_every_check(ranks: list[dict]) -> None:
    for res in ranks:
        _assert_clean(res["results"], res["rank"])


def test_the_checks_ran(ranks: list[dict]) -> None:
    """Both modes' cases reached every rank (no check silently missing)."""
    for res in ranks:
        names = res["results"]
        assert sum(n.startswith("dispatch-") for n in names) == 32, sorted(names)
        assert sum(n.startswith("ll-") for n in names) == 16, sorted(names)
        assert "layout" in names and "bad-counts" in names


if __name__ == "__main__":
    from _launch import gloo_worker_main  # tests/ is sys.path[0] when run as a script

    sys.exit(gloo_worker_main(_worker_results))
