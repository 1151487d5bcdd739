"""``cute_ep.deep_ep`` on GPUs: the CuTe kernels behind DeepEP's API against the same module on the torch
reference backend (bit for bit), sync-free calls, a CUDA graph of the low-latency calls, and, where
``import deep_ep`` works (DeepEP v1.2.1, 2, 4 or 8 ranks on one host, one GPU each), DeepEP itself on the
same inputs.

Launch as the other GPU tests (``torchrun --nproc-per-node N -m pytest tests/gpu/test_deep_ep.py -m gpu``,
or ``scripts/run_gpu_tests.sh``). The kernels' Buffer uses the session's Runtime (its NVSHMEM and compiled
modules); the reference Buffer runs on the Runtime's gloo group with CPU tensors. The reference backend
itself is checked against DeepEP's own test expectations on CPUs (tests/test_deep_ep_worlds.py).

Against DeepEP (normal mode; its low-latency mode starts an NVSHMEM of its own, which cannot share the
process with the session's): the layout, the received rows per source rank (as sets of (token, row)),
recv_topk_idx / weights, num_recv_tokens_per_expert_list, the rank prefix matrix, cached dispatch, the
num_worst_tokens prefix, FP8 rows and scales, and combine (x within bf16 rounding, weights exactly).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _memory import share_no_byte

import cute_ep.deep_ep as deep_ep
from cute_ep.tools.bench_peers import deepep_skip_reason, import_deep_ep

pytestmark = pytest.mark.gpu

HIDDEN, EXPERTS_PER_RANK, TOPK = 256, 4, 4
SYMMETRIC_BYTES = 1 << 30


@pytest.fixture(scope="module")
def buffers(runtime):
    """(kernels' Buffer, reference Buffer); both collective to make and to destroy."""
    old = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(max(2, min(20, runtime.sm_share) // 2 * 2))
    kern = deep_ep.Buffer(runtime.group, runtime=runtime, symmetric_bytes=SYMMETRIC_BYTES,
                          explicitly_destroy=True)
    ref = deep_ep.Buffer(runtime.cpu_group, backend="reference", explicitly_destroy=True)
    assert kern.backend == "cute" and ref.backend == "reference"
    try:
        yield kern, ref
    finally:
        kern.destroy()
        ref.destroy()
        deep_ep.Buffer.num_sms = old


def make_inputs(rank: int, world: int, tokens: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    experts = EXPERTS_PER_RANK * world
    idx = torch.rand(tokens, experts, generator=g).topk(TOPK, dim=1).indices
    idx[torch.rand(tokens, TOPK, generator=g) < 0.1] = -1
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    if tokens >= 2:  # blocks below either FP8 cast's amax floor (2^-14, DeepEP's 1e-4): zero and tiny
        x[0, :128] = 0
        x[1, 128:256] *= 2**-20
    amax = x.float().view(tokens, HIDDEN // 128, 128).abs().amax(-1).clamp_min(1e-4)
    scaled = x.float().view(tokens, HIDDEN // 128, 128) * (448 / amax)[..., None]
    q = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(tokens, HIDDEN)
    return dict(x=x, idx=idx, w=torch.rand(tokens, TOPK, generator=g), q=q, s=(amax / 448).T.contiguous().T,
                bias=torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16), experts=experts)


def on(device: torch.device, obj: Any) -> Any:
    """``obj`` with its tensors on ``device`` (tuples kept)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(on(device, o) for o in obj)
    return obj


def bits(t: Any) -> Any:
    """A CPU tensor whose equality is bit equality (NaN == NaN, -0.0 != 0.0); tuples element-wise."""
    if isinstance(t, tuple):
        return tuple(bits(v) for v in t)
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same(name: str, a: Any, b: Any) -> None:
    a, b = bits(a), bits(b)
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b), name
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_same(f"{name}[{i}]", u, v)
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(a, b), name
    else:
        assert a == b, (name, a, b)


def expert_rows(recv_x: Any) -> torch.Tensor:
    """What an expert hands combine here: the received rows (FP8: cast back with their scales), bf16."""
    if isinstance(recv_x, tuple):
        return (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)).to(torch.bfloat16)
    return recv_x.to(torch.bfloat16)


def normal_round(buf: Any, inp: dict, device: torch.device, *, kind: str, worst: int = 0) -> dict:
    """Every output of a normal-mode sequence on ``buf``: layout, dispatch (``kind``: "bf16", "bf16-topk",
    "fp8-topk"), cached dispatch, combine (with weights and bias where it applies)."""
    d = {k: on(device, v) for k, v in inp.items()}
    out: dict = {}
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(d["idx"], d["experts"])
    out["layout"] = (per_rank, per_expert, in_rank)
    x = (d["q"], d["s"]) if kind.startswith("fp8") else d["x"]
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                num_worst_tokens=worst)
    if kind.endswith("topk"):
        args.update(topk_idx=d["idx"], topk_weights=d["w"])
    recv_x, recv_idx, recv_w, per_list, handle, _ = buf.dispatch(x, **args)
    out["dispatch"] = (recv_x, recv_idx, recv_w, tuple(per_list), tuple(handle))
    if not kind.endswith("topk"):
        out["cached"] = buf.dispatch(x, handle=handle)[0]
    y = expert_rows(recv_x)
    out["combine"] = buf.combine(y, handle, topk_weights=recv_w if worst == 0 else None)[:2]
    if kind == "bf16":
        out["bias"] = buf.combine(y, handle, bias=(d["bias"], d["bias"]))[0]
    return out


def low_latency_round(buf: Any, inp: dict, device: torch.device, *, fp8: bool, round_scale: bool = False,
                      ue8m0: bool = False, m: int = 32, keep: dict | None = None, hook: bool = True) -> dict:
    """One low-latency dispatch and its two combines (from x, and zero_copy). ``keep``: a dict whose
    tensors the round reuses (made on its first round): inputs, the combines' x and outputs stay where they
    were, only their values new. ``hook``: the dispatch with return_recv_hook (on GPUs: two launches, the
    second from the hook; such calls are not replayed from CUDA graphs)."""
    d = {k: on(device, v) for k, v in inp.items()}
    if keep is not None:
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                d[k] = keep.setdefault(k, v).copy_(v)
    stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32, device=device)
    recv, count, handle, _, receive = buf.low_latency_dispatch(
        d["x"], d["idx"], m, d["experts"], cumulative_local_expert_recv_stats=stats, use_fp8=fp8,
        round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hook)
    if hook:
        receive()
    counts = count.tolist()
    # layout_range is defined everywhere; src_info only in each expert's first count slots
    out: dict = {"count": count, "stats": stats, "layout_range": handle[1],
                 "src_info": tuple(handle[0][e, :n] for e, n in enumerate(counts))}
    if fp8:
        scales = recv[1]
        if ue8m0:  # exponent bytes -> fp32 powers of two
            ints = scales.reshape(scales.shape[0], scales.shape[1], -1).to(torch.int64)
            exps = torch.stack([(ints >> (8 * j)) & 0xFF for j in range(4)], dim=-1).flatten(2)
            scales = (exps[..., : HIDDEN // 128].to(torch.int32) << 23).view(torch.float32)
        y = (recv[0].float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
        out["recv"] = tuple(recv[0][e, :n] for e, n in enumerate(counts)) + tuple(
            recv[1][e, :n] for e, n in enumerate(counts))
    else:
        y = recv
        out["recv"] = tuple(recv[e, :n] for e, n in enumerate(counts))
    y = y.clone()
    for e, n in enumerate(counts):
        y[e, n:] = 0  # rows past the count are undefined on every backend
    outs = (None, None)
    if keep is not None:
        y = keep.setdefault("y", y).copy_(y)
        outs = tuple(keep.setdefault(f"out{i}", torch.empty((d["x"].shape[0], HIDDEN), dtype=y.dtype,
                                                            device=device)) for i in (0, 1))
    out["combine"] = buf.low_latency_combine(y, d["idx"], d["w"], handle, out=outs[0])[0]
    buf.get_next_low_latency_combine_buffer(handle).copy_(y)
    out["zero_copy"] = buf.low_latency_combine(y, d["idx"], d["w"], handle, zero_copy=True, out=outs[1])[0]
    if keep is not None:
        out["combine"], out["zero_copy"] = out["combine"].clone(), out["zero_copy"].clone()
    return out


def compare(kern_out: dict, ref_out: dict) -> None:
    assert kern_out.keys() == ref_out.keys()
    for key in kern_out:
        assert_same(key, kern_out[key], ref_out[key])


# --------------------------------------------------------------------------------------------------
# the kernels against the reference backend
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "bf16-topk", "fp8-topk", "fp8"])
def test_normal_mode_matches_the_reference(runtime, buffers, kind: str) -> None:
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    for seed, tokens in ((1, (48, 0, 17, 64)[rank % 4]), (2, 33)):
        inp = make_inputs(rank, world, tokens, seed)
        compare(normal_round(kern, inp, runtime.device, kind=kind),
                normal_round(ref, inp, torch.device("cpu"), kind=kind))


def test_a_shapes_kernels_take_the_sms_of_the_config_that_builds_its_buffers(runtime, buffers) -> None:
    """A dispatch of rows no other test sends (a new shape) builds its buffers with its config's num_sms (at
    most the share), a later call's config changes nothing, and the results are the reference's."""
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    inp = make_inputs(rank, world, 24, 41)
    inp["x"] = inp["x"][:, :96].contiguous()  # 96 bf16 columns: 192 bytes a row, a shape of its own
    outs = []
    for buf, dev in ((kern, runtime.device), (ref, torch.device("cpu"))):
        d = {k: on(dev, v) for k, v in inp.items()}
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(d["idx"], d["experts"])
        got = []
        for sms in (6, 8):
            got.append(buf.dispatch(d["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, config=deep_ep.Config(sms, 6, 256))[0])
        outs.append(got)
    built = [b.cfg.num_sms for k, b in kern._buffers.items() if k[0] == 96]
    assert built == [min(6, kern._sm_cap)], built
    for a, b in zip(*outs, strict=True):
        assert_same("recv_x", a, b)


def test_num_worst_tokens_matches_the_reference(runtime, buffers) -> None:
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    inp = make_inputs(rank, world, 40, 3)
    a = normal_round(kern, inp, runtime.device, kind="bf16-topk", worst=40 * world)
    b = normal_round(ref, inp, torch.device("cpu"), kind="bf16-topk", worst=40 * world)
    n = int(b["dispatch"][4][0][-1, rank])  # rows really received: the rank prefix matrix's last row
    for i in (0, 1, 2):  # recv_x, recv_topk_idx, recv_topk_weights: equal up to n, ids -1 after
        assert_same(f"dispatch[{i}]", a["dispatch"][i][:n], b["dispatch"][i][:n])
    assert bool((a["dispatch"][1][n:] == -1).all())
    assert_same("combine", a["combine"], b["combine"])


@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-round", "fp8-ue8m0"])
def test_low_latency_matches_the_reference(runtime, buffers, mode: str) -> None:
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    flags = dict(fp8=mode != "bf16", round_scale=mode in ("fp8-round", "fp8-ue8m0"),
                 ue8m0=mode == "fp8-ue8m0")
    inp = make_inputs(rank, world, 32, 4)
    compare(low_latency_round(kern, inp, runtime.device, **flags),
            low_latency_round(ref, inp, torch.device("cpu"), **flags))


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_low_latency_calls_replayed_from_graphs_match_the_reference(runtime, buffers, mode: str) -> None:
    """Rounds of the same shapes with fresh inputs, every round equal to the reference: first in new
    tensors each round (the dispatch's graph on copies of x and the ids, or where the allocator reuses
    places on them), then in the same tensors with new values (the dispatch's and the combines' graphs on
    the tensors themselves). Each graph key runs eagerly first, is captured at its second call and
    replayed after."""
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    graphs = kern._ll_graphs
    graphs.clear()  # this test's graphs only, within the capture budget
    graphs.captures.clear()
    graphs.replays.clear()
    keep: dict = {}
    for seed in range(20, 31):  # 3 low-latency calls a round: a parity recurs every second round
        inp = make_inputs(rank, world, 24, seed)
        kept = keep if seed > 24 else None
        compare(low_latency_round(kern, inp, runtime.device, fp8=mode == "fp8", keep=kept, hook=False),
                low_latency_round(ref, inp, torch.device("cpu"), fp8=mode == "fp8", hook=False))
    if graphs.enabled:
        replayed = dict(graphs.replays)
        assert replayed.get("direct", 0) >= 4 and replayed.get("combine", 0) >= 8, replayed
        assert replayed.get("direct", 0) + replayed.get("copied", 0) >= 6, replayed
        # 33 calls; at most one capture per key: 2 parities x (copied, 2 direct, 4 combines)
        assert sum(graphs.captures.values()) <= 14, dict(graphs.captures)


@pytest.mark.parametrize("calls", ["low-latency", "num_worst_tokens"])
def test_sync_free_calls_make_no_host_sync(runtime, buffers, calls: str) -> None:
    """The low-latency calls, and a num_worst_tokens dispatch + combine (no weights), make no host sync once
    their buffers exist (torch's sync detector raises on one)."""
    kern, _ = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    gloo = world > 1 and "nccl" not in str(torch.distributed.get_backend(runtime.group))
    if calls == "num_worst_tokens" and gloo:
        pytest.skip("dispatch(num_worst_tokens=...) all-gathers every rank's token count (they size the "
                    "handle's recv_channel_prefix_matrix); the group is gloo here (ranks share a GPU, and "
                    "NCCL refuses that), and gloo moves GPU tensors through the host")
    d = {k: on(runtime.device, v) for k, v in make_inputs(rank, world, 32, 5).items()}
    per_rank, _, per_expert, in_rank, _ = kern.get_dispatch_layout(d["idx"], d["experts"])
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=d["idx"], topk_weights=d["w"], num_worst_tokens=32 * world)

    def run() -> None:
        if calls == "low-latency":
            recv, _, handle, _, _ = kern.low_latency_dispatch(d["x"], d["idx"], 32, d["experts"],
                                                              use_fp8=False)
            kern.low_latency_combine(recv, d["idx"], d["w"], handle)
        else:
            recv_x, _, _, _, h, _ = kern.dispatch(d["x"], **args)
            kern.combine(recv_x, h)

    run()  # builds the buffers (collective, with host syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_layout_kernel_matches_torch(runtime, buffers, id_dtype: torch.dtype) -> None:
    """get_dispatch_layout on the kernels' Buffer (one launch of kernels/token_layout.py) against the torch
    form on the CPU, bit for bit: DeepSeek's and DeepEP's low-latency expert counts, top-k 1 to 64, no
    tokens and one token, -1 ids, and ids outside [-1, E) (counted nowhere; a GPU call does not check
    them); then the kernel alone for rank counts up to 64 (its rank and expert slices cut short); no host
    sync once compiled. Local to each rank (no collective)."""
    from cute_ep.deep_ep import normal
    from cute_ep.deep_ep.token_layout import TokenLayout, shared_token_layout

    kern, _ = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    g = torch.Generator().manual_seed(runtime.seed * 1000 + 7 * rank + (id_dtype == torch.int32))
    big = 2**40 if id_dtype == torch.int64 else 2**31 - 1
    # (3000, 7, 70): more tokens than the kernel's threads, and not a multiple of them
    cases = [(0, 8, 256), (1, 1, 1), (4096, 8, 256), (333, 9, 288), (128, 64, 64), (50, 33, 300),
             (3000, 7, 70)]
    for i, (tokens, topk, per) in enumerate(cases):
        experts = world * -(-per // world)
        idx = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices  # distinct experts
        idx[torch.rand(tokens, topk, generator=g) < 0.1] = -1
        if i % 2 and tokens:
            bad = torch.rand(tokens, topk, generator=g) < 0.05
            idx[bad] = torch.tensor([experts, experts + 5, -7, big])[torch.randint(0, 4, (int(bad.sum()),),
                                                                                     generator=g)]
        idx = idx.to(id_dtype)
        gpu = idx.to(runtime.device)
        assert TokenLayout.fits(gpu, experts, world), (tokens, topk, experts)
        got = kern.get_dispatch_layout(gpu, experts)
        want = normal.dispatch_layout(idx, experts, world)
        for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
                              (got[0], got[2], got[3]), want, strict=True):
            assert_same(f"{name} (T={tokens}, K={topk}, E={experts})", a, b)
    # The kernel's grid has a CTA per 8 ranks and per 32 experts: rank counts other than this world's, with
    # partial slices of both (the kernel called directly, as get_dispatch_layout calls it).
    layout = shared_token_layout()
    for n, k, ranks, per_rank in [(1000, 8, 3, 11), (517, 6, 9, 4), (2048, 8, 64, 5), (64, 3, 17, 1),
                                  (5000, 5, 12, 3)]:
        e = ranks * per_rank
        ids = torch.rand(n, e, generator=g).topk(k, dim=1).indices
        ids[torch.rand(n, k, generator=g) < 0.1] = -1
        ids = ids.to(id_dtype)
        got = layout(ids.to(runtime.device), e, ranks)
        want = normal.dispatch_layout(ids, e, ranks)
        for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), got, want,
                              strict=True):
            assert_same(f"{name} (T={n}, K={k}, E={e}, R={ranks})", a, b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kern.get_dispatch_layout(gpu, experts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_layout_calls_of_one_shape_each_return_their_own_tensors(runtime, buffers) -> None:
    """get_dispatch_layout on fresh ids of one shape, every result kept, SPARE_AHEAD + 6 times: from the third
    call on the outputs were made ahead, a batch of calls' at a time (cute_ep.spare), so the calls cross a
    batch's end. After all of them, each call's three tensors hold its own layout, bit for bit against the
    torch form, and share no byte with another call's."""
    from cute_ep.deep_ep import normal
    from cute_ep.spare import SPARE_AHEAD

    kern, _ = buffers
    world = runtime.env.world_size
    g = torch.Generator().manual_seed(runtime.seed * 1000 + 31 * runtime.env.rank + 3)
    experts = world * 32
    kept = []
    for _ in range(SPARE_AHEAD + 6):
        idx = torch.rand(512, experts, generator=g).topk(8, dim=1).indices
        idx[torch.rand(512, 8, generator=g) < 0.1] = -1
        per_rank, _, per_expert, in_rank, _ = kern.get_dispatch_layout(idx.to(runtime.device), experts)
        kept.append((idx, (per_rank, per_expert, in_rank)))
    assert share_no_byte([t for _, got in kept for t in got])
    for i, (idx, got) in enumerate(kept):
        want = normal.dispatch_layout(idx, experts, world)
        for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), got, want,
                              strict=True):
            assert_same(f"{name} of call {i}", a, b)


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_dispatch_fills_only_the_slots_it_counts(runtime, buffers, fp8: bool) -> None:
    """The low-latency dispatch kernel (kernels/low_latency_dispatch.py) over three calls, the third landing
    on the first one's receive tensors (DeepEP's two alternating sets), poisoned after the first: every
    counted slot as the reference has it, every slot past a count still poisoned, the statistics added
    once per call. Token counts differ per rank and call (a rank may send none); the second and third
    calls make no host sync."""
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    m, experts = 24, EXPERTS_PER_RANK * world
    poison_rows, poison_src = 7.0, -5
    first = None
    stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32, device=runtime.device)
    want_stats = torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32)
    for call in range(3):
        tokens = (runtime.seed + 5 * rank + 7 * call) % (m + 1)  # 0 .. m
        inp = make_inputs(rank, world, tokens, runtime.seed * 10 + call)
        want = ref.low_latency_dispatch(inp["x"], inp["idx"], m, experts, use_fp8=fp8)
        want_stats += want[1]
        x, idx = inp["x"].to(runtime.device), inp["idx"].to(runtime.device)
        if call:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            recv, count, handle, _, _ = kern.low_latency_dispatch(
                x, idx, m, experts, cumulative_local_expert_recv_stats=stats, use_fp8=fp8)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rows = recv[0] if fp8 else recv
        if call == 0:
            first = (rows, handle[0])
            if fp8:
                rows.view(torch.uint8).fill_(0x41)
            else:
                rows.fill_(poison_rows)
            handle[0].fill_(poison_src)
            continue
        assert_same("count", count, want[1])
        assert_same("layout_range", handle[1], want[2][1])
        for e, n in enumerate(count.tolist()):
            assert_same(f"rows[{e}]", rows[e, :n], (want[0][0] if fp8 else want[0])[e, :n])
            assert_same(f"src_info[{e}]", handle[0][e, :n], want[2][0][e, :n])
            if fp8:
                assert_same(f"scales[{e}]", recv[1][e, :n], want[0][1][e, :n])
            if call == 2:  # the first call's tensors again: past the count as the poison left them
                assert rows.data_ptr() == first[0].data_ptr()
                tail = rows[e, n:].view(torch.uint8) if fp8 else rows[e, n:]
                assert bool((tail == (0x41 if fp8 else poison_rows)).all()), e
                assert bool((handle[0][e, n:] == poison_src).all()), e
    assert_same("stats", stats, want_stats)


def test_low_latency_combine_skips_the_pairs_the_caller_masks(runtime, buffers) -> None:
    """The low-latency combine (kernels/low_latency_combine.py pushes every received row back) sums only
    the pairs whose id the caller left as the dispatch's; pairs set to -1 are skipped: bit for bit the
    reference, from x and from the zero_copy buffer, on a strided x too (made contiguous first), and split
    by return_recv_hook (the sending half, then the hook's receiving half; into a strided out too)."""
    kern, ref = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    m, experts = 32, EXPERTS_PER_RANK * world
    inp = make_inputs(rank, world, 29, runtime.seed * 10 + 3)
    g = torch.Generator().manual_seed(runtime.seed + 17 * rank)
    masked = inp["idx"].clone()
    masked[torch.rand(masked.shape, generator=g) < 0.3] = -1
    y = torch.randn(EXPERTS_PER_RANK, world * m, HIDDEN, generator=g).to(torch.bfloat16)
    outs = []
    for buf, dev in ((kern, runtime.device), (ref, torch.device("cpu"))):
        idx = on(dev, inp["idx"])
        handle = buf.low_latency_dispatch(on(dev, inp["x"]), idx, m, experts, use_fp8=False)[2]
        wide = torch.zeros(EXPERTS_PER_RANK, world * m, 2 * HIDDEN, dtype=torch.bfloat16, device=dev)
        wide[..., ::2] = on(dev, y)
        got = [buf.low_latency_combine(on(dev, y), on(dev, masked), on(dev, inp["w"]), handle)[0],
               buf.low_latency_combine(wide[..., ::2], on(dev, masked), on(dev, inp["w"]), handle)[0]]
        buf.get_next_low_latency_combine_buffer(handle).copy_(on(dev, y))
        combined, _, hook = buf.low_latency_combine(on(dev, y), idx, on(dev, inp["w"]), handle,
                                                    zero_copy=True, return_recv_hook=True)
        hook()  # the receiving half (on GPUs the kernel's second launch)
        got.append(combined)
        strided = torch.zeros(29, 2 * HIDDEN, dtype=torch.bfloat16, device=dev)[:, ::2]
        combined, _, hook = buf.low_latency_combine(on(dev, y), idx, on(dev, inp["w"]), handle, out=strided,
                                                    return_recv_hook=True)
        hook()  # and the copy into the strided out after it
        assert combined is strided
        got.append(combined)
        outs.append(tuple(got))
    assert_same("combine", outs[0], outs[1])


def test_low_latency_in_a_cuda_graph(runtime, buffers) -> None:
    """low_latency_dispatch -> experts -> low_latency_combine captured once, replayed with new inputs: the
    same outputs as eager calls."""
    kern, _ = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    static = {k: on(runtime.device, v) for k, v in make_inputs(rank, world, 32, 6).items()}

    def step() -> torch.Tensor:
        recv, _, handle, _, _ = kern.low_latency_dispatch(static["x"], static["idx"], 32, static["experts"],
                                                          use_fp8=False)
        return kern.low_latency_combine(recv * 2, static["idx"], static["w"], handle)[0]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (7, 8):
        fresh = {k: on(runtime.device, v) for k, v in make_inputs(rank, world, 32, seed).items()}
        for key in ("x", "idx", "w"):
            static[key].copy_(fresh[key])
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert_same(f"replay {seed}", replayed, step())


# --------------------------------------------------------------------------------------------------
# DeepEP itself, side by side
# --------------------------------------------------------------------------------------------------


def _deepep(runtime) -> Any:
    module, why = import_deep_ep()
    env = runtime.env
    shared = runtime.placement is not None and runtime.placement.shared
    reason = deepep_skip_reason(import_error=why, device_type=runtime.device.type,
                                world_size=env.world_size, ranks_per_host=env.physical_local_world_size,
                                dtype="bfloat16", hidden=HIDDEN, experts_per_rank=EXPERTS_PER_RANK, topk=TOPK)
    reason = reason or ("ranks share a GPU" if shared else None)
    if reason:
        pytest.skip(reason)
    return module


@pytest.fixture(scope="module")
def deepep_buffer(runtime):
    ep = _deepep(runtime)
    world = runtime.env.world_size
    hints = [c.get_nvl_buffer_size_hint(HIDDEN * 2, world)
             for c in (ep.Buffer.get_dispatch_config(world), ep.Buffer.get_combine_config(world))]
    buf = ep.Buffer(runtime.group, max(hints), 0, explicitly_destroy=True)
    try:
        yield buf
    finally:
        buf.destroy()


def _by_source(recv_x: Any, recv_idx: Any, recv_w: Any, handle: tuple, rank: int) -> dict:
    """{(source rank, token): (row bits, ids, weights)}: a dispatch's rows as a set per source."""
    prefix, src_idx = handle[0].cpu(), handle[3].cpu()
    rows = {}
    start = 0
    for s in range(prefix.shape[0]):
        end = int(prefix[s, rank])
        for i in range(start, end):
            row = bits(recv_x[0][i]) if isinstance(recv_x, tuple) else bits(recv_x[i])
            extra = (bits(recv_x[1][i]),) if isinstance(recv_x, tuple) else ()
            ids = tuple(recv_idx[i].tolist()) if recv_idx is not None else None
            ws = tuple(bits(recv_w[i]).tolist()) if recv_w is not None else None
            rows[(s, int(src_idx[i]))] = (tuple(row.tolist()), extra and tuple(extra[0].tolist()), ids, ws)
        start = end
    return rows


@pytest.mark.parametrize("kind", ["bf16", "bf16-topk", "fp8-topk"])
def test_same_results_as_deepep(runtime, buffers, deepep_buffer, kind: str) -> None:
    kern, _ = buffers
    rank, world = runtime.env.rank, runtime.env.world_size
    inp = make_inputs(rank, world, (96, 40, 8, 64)[rank % 4], 9)
    d = {k: on(runtime.device, v) for k, v in inp.items()}
    outs = []
    for buf in (kern, deepep_buffer):
        layout = buf.get_dispatch_layout(d["idx"], d["experts"])
        per_rank, _, per_expert, in_rank, _ = layout
        x = (d["q"], d["s"]) if kind.startswith("fp8") else d["x"]
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        if kind.endswith("topk"):
            args.update(topk_idx=d["idx"], topk_weights=d["w"])
        recv_x, recv_idx, recv_w, per_list, handle, _ = buf.dispatch(x, **args)
        cached = buf.dispatch(x, handle=handle)[0]
        combined, combined_w, _ = buf.combine(expert_rows(recv_x), handle, topk_weights=recv_w)
        torch.cuda.synchronize()
        outs.append(dict(layout=(per_rank, per_expert, in_rank), per_list=list(per_list), prefix=handle[0],
                         rows=_by_source(recv_x, recv_idx, recv_w, handle, rank),
                         cached=_by_source(cached, None, None, handle, rank), combined=combined,
                         combined_w=combined_w))
    ours, theirs = outs
    for i in range(3):
        assert_same(f"layout[{i}]", ours["layout"][i], theirs["layout"][i])
    assert ours["per_list"] == theirs["per_list"]
    # DeepEP fills only this rank's column (the others are whatever its torch.empty held: seen 0 and 1 on
    # H100s); ours holds that column and zeros elsewhere (docs/deep_ep.md).
    assert_same("rank_prefix_matrix", ours["prefix"][:, rank], theirs["prefix"][:, rank])
    others = torch.arange(world, device=ours["prefix"].device) != rank
    assert not ours["prefix"][:, others].any(), "rank_prefix_matrix: other columns"
    assert ours["rows"] == theirs["rows"]  # the same (source, token) rows, ids and weights
    assert ours["cached"] == theirs["cached"]
    a, b = ours["combined"].float().cpu(), theirs["combined"].float().cpu()
    assert a.shape == b.shape
    assert bool(((a - b).abs() <= b.abs() * 2**-7 + 1e-30).all()), (a - b).abs().max()  # bf16 rounding
    if kind.endswith("topk"):
        assert_same("combined_topk_weights", ours["combined_w"], theirs["combined_w"])
