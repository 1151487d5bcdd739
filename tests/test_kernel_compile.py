"""Every kernel variant traces and compiles for sm_90 on a machine without a GPU.

The kernels are specialized on the element type only (sizes and the dispatch mode are run-time
arguments), so one compile per dtype covers every mode and shape. Beyond "it compiled", the PTX is
read for what correctness and speed depend on: the NVSHMEM calls each kernel makes, 128-bit loads in
combine that bypass L1 (``.cg``: rows written by other GPUs or rewritten staging rows must not come from
a stale L1 line), separately rounded multiply/add (no FMA) in its accumulation, 128-bit stores in
dispatch's peer-pointer row copies and in the fan-out.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from _sm90 import DTYPES, ptx_ops, sm90_params

from cute_ep.bootstrap.compile import ModuleRegistry
from cute_ep.kernels.dispatch_senders import DISPATCH_ROW_UNROLL
from cute_ep.kernels.low_latency_combine import PUSH_UNROLL
from cute_ep.kernels.low_latency_dispatch import RECEIVE_ROW_UNROLL, SEND_ROW_UNROLL
from cute_ep.kernels.rows import ROW_COPY_UNROLL

LOW_LATENCY = ("DispatchLowLatency", "CombineLowLatency")


def _entries(ptx: str) -> list[tuple[str, str]]:
    """(kind, PTX text) of each entry point in order; kind is Layout / Dispatch / Fanout / StageY / Combine /
    ReducePush / PartialSum / RankLayout / RankDispatch / RankCombine (the rank layout's variants), read
    from the symbol each is compiled under: ``cute_ep::<step>()::kernel``, C++-mangled
    (``kernels/naming.py``), e.g. ``_ZZN7cute_ep13rank_dispatchEvE6kernel_4``."""
    out = []
    for part in re.split(r"(?m)^(?=\.visible \.entry|\.func|\.visible \.func|\.weak \.func)", ptx):
        m = re.match(r"\.visible \.entry _ZZN7cute_ep(\d+)(\w+)EvE6kernel_\d+\(", part)
        if m:
            step = m.group(2)
            assert len(step) == int(m.group(1)), m.group(0)  # a well-formed mangled name
            out.append(("".join(w.capitalize() for w in step.split("_")), part))
    return out


def _kernels(ptx: str) -> dict[str, str]:
    """PTX text of each kernel (the first entry point of its kind). The low-latency kernels compile two
    kernels each under one name (kernels/naming.py): the whole one as "DispatchLowLatency" /
    "CombineLowLatency", and its receiving half alone as "DispatchLowLatencyReceive" /
    "CombineLowLatencyReceive", the one of the two that sends no signal."""
    out: dict[str, str] = {}
    for kind, part in _entries(ptx):
        if kind in LOW_LATENCY and "nvshmemx_signal_op" not in part:
            kind += "Receive"
        out.setdefault(kind, part)
    return out


@pytest.fixture(scope="module", params=sm90_params())
def compiled_ptx(request, sm90_module):
    """(dtype, PTX) of the dtype's module, compiled once per test run (tests/_sm90.py)."""
    module = sm90_module(request.param)
    return module.dtype, module.ptx


def test_targets_sm90_with_eighteen_kernels(compiled_ptx):
    _, ptx = compiled_ptx
    assert re.search(r"(?m)^\.target sm_90$", ptx)
    kinds = Counter(kind for kind, _ in _entries(ptx))
    assert sorted(kinds) == ["Assemble", "Combine", "CombineLowLatency", "Deliver", "Dispatch",
                             "DispatchLowLatency", "Fanout", "Layout", "PartialSum", "RankCombine",
                             "RankDispatch", "RankLayout", "RankPush", "RankSum", "ReducePush", "StageY"]
    # The DSL emits an entry point per launch site: the module launches each kernel from one site; each
    # low-latency kernel's two (the whole one, its receiving half) share a name.
    assert kinds == {kind: 2 if kind in LOW_LATENCY else 1 for kind in kinds}
    assert {"DispatchLowLatencyReceive", "CombineLowLatencyReceive"} <= set(_kernels(ptx))


def test_rank_layout_variants_carry_only_their_own_code(compiled_ptx):
    """The rank dispatch writes each row's local ids and weights and no fan-out source; the expert-layout
    dispatch writes from-slots and no ids (the variants are compiled apart, not branched at run time)."""
    _, ptx = compiled_ptx
    kernels = _kernels(ptx)
    expert, rank = ptx_ops(kernels["Dispatch"]), ptx_ops(kernels["RankDispatch"])
    assert sum(n for op, n in rank.items() if op.startswith("call")) > 0
    assert "nvshmem_int32_p" in kernels["RankDispatch"]  # local ids and the source tag
    assert "nvshmem_float_p" in kernels["RankDispatch"]  # the per-k weights
    assert sum(expert.values()) != sum(rank.values())


def test_links_the_nvshmem_calls_each_step_needs(compiled_ptx):
    dtype, ptx = compiled_ptx
    name = DTYPES[dtype]
    for fn in (
        f"nvshmemx_{name}_put_warp",  # dispatch rows
        f"nvshmemx_{name}_get_warp",  # combine, other-node rows
        "nvshmemx_int32_put_signal_warp",  # layout count exchange
        "nvshmemx_signal_op",
        "nvshmem_float_p",  # weights
        "nvshmem_int32_p",  # source tags
        "_Z23nvshmemi_transfer_quietIL13threadgroup_t0EEvbiPii",  # nvshmem_quiet, inlined
    ):
        assert re.search(rf"\b{fn}\b", ptx), f"{fn} not in the PTX"


@pytest.mark.parametrize("kernel",
                         ["Combine", "ReducePush", "PartialSum", "RankCombine", "CombineLowLatency"])
def test_combine_accumulates_without_fma_and_loads_128_bit_past_l1(compiled_ptx, kernel):
    """The pull combine, both phases of the reduced combine and the low-latency combine share
    kernels/rowsum.py."""
    _, ptx = compiled_ptx
    ops = ptx_ops(_kernels(ptx)[kernel])
    assert ops["mul.rn.f32"] > 0 and ops["mul.rn.f32"] == ops["add.rn.f32"]
    assert ops["fma.rn.f32"] == 0
    loads = {op: n for op, n in ops.items() if op.startswith("ld.global") and ".v4." in op}
    if kernel == "CombineLowLatency":  # its push reads the caller's rows, written before the launch
        assert loads.pop("ld.global.v4.b32") == PUSH_UNROLL, loads
    assert loads and all(".cg" in op for op in loads), loads  # 8-, 4- and 1-row groups, all .cg
    assert ops["st.global.v4.b32"] > 0


@pytest.mark.parametrize("kernel", ["Combine", "RankCombine", "PartialSum"])
def test_last_cta_of_a_launch_is_counted_after_a_gpu_fence(compiled_ptx, kernel):
    """The combines' ``finish`` counts their CTAs' arrivals after a fence within the GPU
    (``last_cta_arrives(system=False)``): the epochs they advance are read after the launch ends, so no
    system fence is needed there."""
    _, ptx = compiled_ptx
    assert ptx_ops(_kernels(ptx)[kernel])["fence.acq_rel.gpu"] >= 1


@pytest.mark.parametrize("kernel", LOW_LATENCY)
def test_low_latency_receiving_halves_hold_only_the_receive(compiled_ptx, kernel):
    """Each low-latency kernel's receiving half (``return_recv_hook``) is a kernel of its own: it sends
    nothing (no put, no signal, no single-element put), counts no arrival (no fence; its one global atomic
    is a timed-out wait's fault record), and its waits for the peers are bounded after it checks for a
    recorded fault; it is the smaller of the two. The dispatch's copies rows into the padded layout 128
    bits at a time (RECEIVE_ROW_UNROLL in flight per lane), its stores allocating no L1 line (nothing in
    the launch reads those rows again); the combine's sums rows read past L1."""
    _, ptx = compiled_ptx
    kernels = _kernels(ptx)
    text = kernels[kernel + "Receive"]
    ops = ptx_ops(text)
    assert "put" not in text and "nvshmemx_signal_op" not in text and "nvshmem_int32_p" not in text
    synchronizing = {op: n for op, n in ops.items() if op.startswith(("atom.", "red.", "fence.", "membar."))}
    assert synchronizing == {"atom.global.add.u32": 1}, synchronizing
    assert "ld.acquire.sys.global.u64" in text and text.count("%globaltimer") >= 2
    assert "ld.volatile.global.b32" in text
    assert sum(ops.values()) < sum(ptx_ops(kernels[kernel]).values())
    if kernel == "DispatchLowLatency":
        no_l1 = ops["st.global.L1::no_allocate.v4.b32"]
        assert no_l1 >= RECEIVE_ROW_UNROLL and ops["ld.global.v4.b32"] >= RECEIVE_ROW_UNROLL, ops
        assert ops["st.global.v4.b32"] == 0, ops  # every row store of the receive skips L1
    else:
        assert ops["ld.global.cg.v4.b32"] > 0 and not any(op.startswith("fma.") for op in ops), ops


@pytest.mark.parametrize("kernel", ["CombineLowLatency", "DispatchLowLatency"])
def test_low_latency_receive_ends_without_an_arrival(compiled_ptx, kernel):
    """The low-latency kernels advance their epochs in the sending half (its last CTA, which counted every
    CTA's sends or pushes): no CTA counts an arrival after its receiving work, so there is no GPU fence
    for one, and the one arrival counter left is the sending half's (``cta_arrives_last``: a system fence
    and one atomic add)."""
    _, ptx = compiled_ptx
    ops = ptx_ops(_kernels(ptx)[kernel])
    assert ops["fence.acq_rel.gpu"] == 0, ops["fence.acq_rel.gpu"]
    assert ops["fence.sc.sys"] + ops["fence.acq_rel.sys"] >= 1


def test_reduced_combine_pushes_partials_and_signals(compiled_ptx):
    """Phase 1 moves partial rows to other nodes with put_warp and raises the combine signal; the
    dispatch records group lists with single-element puts."""
    dtype, ptx = compiled_ptx
    kernels = _kernels(ptx)
    assert re.search(rf"\bnvshmemx_{DTYPES[dtype]}_put_warp\b", kernels["ReducePush"])
    assert "nvshmemx_signal_op" in kernels["ReducePush"]
    assert "nvshmem_quiet" in kernels["ReducePush"] or "transfer_quiet" in kernels["ReducePush"]
    assert "put_warp" not in kernels["PartialSum"]  # phase 2 reads local memory only


def test_rank_push_stores_rows_and_signals_and_its_sum_waits_only(compiled_ptx):
    """The rank layout's pushed combine: phase 1 puts rows to other nodes (put_warp, after the CTA's
    quiet) and raises the combine signal; phase 2 gets nothing from peers (its rows are here) and signals
    no one (it waits for the pushes), where the pull combine of the same layout gets other nodes' rows."""
    dtype, ptx = compiled_ptx
    kernels = _kernels(ptx)
    assert re.search(rf"\bnvshmemx_{DTYPES[dtype]}_put_warp\b", kernels["RankPush"])
    assert "nvshmemx_signal_op" in kernels["RankPush"]
    assert "nvshmem_quiet" in kernels["RankPush"] or "transfer_quiet" in kernels["RankPush"]
    assert "get_warp" not in kernels["RankSum"] and "get_warp" in kernels["RankCombine"]
    assert "nvshmemx_signal_op" not in kernels["RankSum"] and "nvshmemx_signal_op" in kernels["RankCombine"]
    assert re.search(r"\.minnctapersm 2\b", kernels["RankPush"])


def test_kernels_declare_their_ctas_per_sm(compiled_ptx):
    """Both phases of the reduced combine launch 2 CTAs per SM of the budget and say so (.minnctapersm),
    so ptxas may give them up to 128 registers instead of spilling in the row sum (kernels/base.py); the
    dispatch kernels, the fan-out and the pull combines (16 warps per CTA: 512 threads) declare one CTA per
    SM, for the same 128 registers (the fan-out spilled at the 64 registers of two CTAs)."""
    _, ptx = compiled_ptx
    kernels = _kernels(ptx)
    for name in ("ReducePush", "PartialSum", "CombineLowLatency"):
        assert re.search(r"\.minnctapersm 2\b", kernels[name]), name
    for name in ("Dispatch", "RankDispatch", "DispatchLowLatency", "Fanout", "Combine", "RankCombine",
                 "RankSum"):
        assert re.search(r"\.minnctapersm 1\b", kernels[name]), name
    for name in ("Combine", "RankCombine", "RankSum"):  # twice the other combines' warps (kernels/combine.py)
        assert re.search(r"\.reqntid 512\b", kernels[name]), name
    assert ".minnctapersm" not in kernels["Layout"]


def test_row_copies_are_128_bit(compiled_ptx):
    _, ptx = compiled_ptx
    kernels = _kernels(ptx)
    # unrolled pieces in flight per lane: ROW_COPY_UNROLL in the fan-out, DISPATCH_ROW_UNROLL in dispatch,
    # the low-latency dispatch's rows sent and copied into the padded layout: both of its own
    for name, unroll in (("Dispatch", DISPATCH_ROW_UNROLL), ("Fanout", ROW_COPY_UNROLL),
                         ("RankDispatch", DISPATCH_ROW_UNROLL),
                         ("DispatchLowLatency", SEND_ROW_UNROLL + RECEIVE_ROW_UNROLL)):
        ops = ptx_ops(kernels[name])
        assert ops["st.global.v4.b32"] + ops["st.global.L1::no_allocate.v4.b32"] >= unroll, (name, ops)
        assert ops["ld.global.v4.b32"] >= unroll, (name, ops)


@pytest.mark.parametrize("kernel", ["Deliver", "Assemble"])
def test_local_row_copies_move_pieces_where_aligned_and_words_elsewhere(compiled_ptx, kernel):
    """The delivery kernel (received rows into the caller's tensors) and the assembly kernel (the caller's
    values and words into the rows a dispatch sends) copy rows as 128-bit pieces (ROW_COPY_UNROLL in flight
    per lane) and, for parts whose offset or width is not a multiple of 16 bytes (scales, ids) or words at
    any stride, as 4-byte words; neither calls NVSHMEM (every row they touch is this rank's)."""
    _, ptx = compiled_ptx
    text = _kernels(ptx)[kernel]
    ops = ptx_ops(text)
    assert ops["st.global.v4.b32"] >= ROW_COPY_UNROLL and ops["ld.global.v4.b32"] >= ROW_COPY_UNROLL, ops
    assert ops["ld.global.u32"] + ops["ld.global.b32"] >= 1, ops
    assert ops["st.global.u32"] + ops["st.global.b32"] >= 1, ops
    assert "nvshmem" not in text


def test_layout_steps_use_warp_votes(compiled_ptx):
    """The expert layout's slots count earlier lanes with one match.any per step (not 32 shuffles); the
    rank layout takes a lane per token and counts and places tokens per destination rank by ballots; the
    rank dispatch holds a token's pairs in lanes."""
    _, ptx = compiled_ptx
    kernels = _kernels(ptx)
    assert ptx_ops(kernels["Layout"])["match.any.sync.b32"] >= 1
    rank = ptx_ops(kernels["RankLayout"])
    assert rank["vote.sync.ballot.b32"] >= 2 and rank["popc.b32"] >= 2, rank
    assert "match.any.sync.b32" not in rank
    # the rank dispatch finds a token's first pair per rank with one match.any over the token's lanes
    assert ptx_ops(kernels["RankDispatch"])["match.any.sync.b32"] >= 1


def test_layout_ctas_meet_once_and_dispatch_runs_the_layout_folded_in(compiled_ptx):
    """The layout's CTAs add their counts into one row with global atomics, arrive on a counter, and the
    others poll the leader's announcements with acquire loads; both dispatch kernels carry the layout's
    steps (shared-memory histograms) for batches folded into their launch."""
    _, ptx = compiled_ptx
    kernels = _kernels(ptx)
    for name in ("Layout", "RankLayout", "Dispatch", "RankDispatch"):
        ops = ptx_ops(kernels[name])
        assert ops["atom.shared.add.u32"] > 0, name  # per-warp histograms
        global_adds = sum(n for op, n in ops.items() if op.startswith(("atom.global.add", "red.global.add")))
        assert global_adds >= 2, name  # the counts into the totals row, the arrival
        assert "ld.acquire.sys.global.u64" in kernels[name], name


def test_every_wait_for_a_peer_is_bounded(compiled_ptx):
    _, ptx = compiled_ptx
    assert "signal_wait_until" not in ptx  # NVSHMEM's wait has no timeout: one missing peer hangs all
    kernels = _kernels(ptx)
    for name in ("Layout", "RankLayout", "Dispatch", "Combine", "ReducePush", "PartialSum", "RankDispatch",
                 "RankCombine", "DispatchLowLatency", "CombineLowLatency"):
        text = kernels[name]
        assert "ld.acquire.sys.global.u64" in text, name  # polls the signal with acquire semantics
        assert text.count("%globaltimer") >= 2, name  # start time + a fresh read inside the loop
    for name in ("Layout", "Dispatch", "Fanout", "Combine", "ReducePush", "PartialSum",
                 "DispatchLowLatency"):  # fault record first
        assert "ld.volatile.global.b32" in kernels[name], name


def test_dispatch_has_the_atomic_slot_path(compiled_ptx):
    _, ptx = compiled_ptx
    assert ptx_ops(_kernels(ptx)["Dispatch"])["atom.global.add.u32"] > 0
    assert ptx_ops(_kernels(ptx)["Layout"])["atom.shared.add.u32"] > 0


def test_dispatch_quantizes_fp8_like_the_reference(compiled_ptx):
    """FP8 dispatch (kernels/quantize.py): e4m3 conversion with rounding to nearest and saturation,
    true IEEE divisions for scale and inverse (an approximate reciprocal would break bit-identity with
    cute_ep.fp8), a butterfly max inside each 128-column block, and no fused multiply-add."""
    dtype, ptx = compiled_ptx
    text = _kernels(ptx)["Dispatch"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in text
    ops = ptx_ops(text)
    assert ops["div.rn.f32"] >= 2 and ops["shfl.sync.bfly.b32"] >= 4, ops
    assert not any(op.startswith(("rcp.", "div.approx", "div.full", "fma.")) for op in ops), ops
    assert ops["st.global.b32"] > 0, ops  # the scales and padding (and fp32 rows' FP8 words)
    if dtype != torch.float32:  # a lane's 8 FP8 values of a 2-byte row: one 64-bit store
        assert ops["st.global.v2.b32"] > 0, ops


def test_low_latency_dispatch_numbers_pairs_and_signals_counts(compiled_ptx):
    """The low-latency dispatch (kernels/low_latency_dispatch.py) numbers each step of 32 pairs with one
    match.any, writes each pair's token index with a single-element put, announces its counts with signal
    ops, quantizes FP8 rows by the same conversion as the dispatch, and moves rows to other nodes with
    put_warp."""
    dtype, ptx = compiled_ptx
    text = _kernels(ptx)["DispatchLowLatency"]
    ops = ptx_ops(text)
    assert ops["match.any.sync.b32"] >= 2, ops  # the numbering and the destination ranks of a token
    assert "nvshmem_int32_p" in text and "nvshmemx_signal_op" in text
    assert re.search(rf"\bnvshmemx_{DTYPES[dtype]}_put_warp\b", text)
    assert "cvt.rn.satfinite.e4m3x2.f32" in text and ops["div.rn.f32"] >= 2, ops
    assert "fence.sc.sys" in text


def test_low_latency_combine_pushes_rows_then_signals(compiled_ptx):
    """The low-latency combine (kernels/low_latency_combine.py) pushes rows to other nodes with put_warp,
    quiets them, and raises the combine signal, with 128-bit peer-pointer stores on this node."""
    dtype, ptx = compiled_ptx
    text = _kernels(ptx)["CombineLowLatency"]
    assert re.search(rf"\bnvshmemx_{DTYPES[dtype]}_put_warp\b", text)
    assert "nvshmemx_signal_op" in text and ("nvshmem_quiet" in text or "transfer_quiet" in text)
    assert ptx_ops(text)["st.global.v4.b32"] > 0


class _FakeLib:
    def __init__(self, name):
        self.name = name


def test_registry_caches_by_tuple_and_bounds_alive_modules(monkeypatch):
    finalized = []
    reg = ModuleRegistry(register=True, max_alive=3)
    monkeypatch.setattr("cute_ep.bootstrap.compile.compile_kernel", lambda fn, *a: f"compiled-{fn}")
    monkeypatch.setattr(reg, "_register", lambda compiled: (compiled, _FakeLib(compiled)))
    monkeypatch.setattr(ModuleRegistry, "_finalize", staticmethod(lambda lib: finalized.append(lib.name)))
    for k in ("a", "b", "c"):
        assert reg.get((k,), lambda k=k: (k, ())) == f"compiled-{k}"
    assert reg.get(("a",), lambda: pytest.fail("cached key recompiled")) == "compiled-a"
    assert reg.compiles == 3 and finalized == []
    reg.get(("d",), lambda: ("d", ()))  # evicts the least recently used: b
    assert finalized == ["compiled-b"] and len(reg) == 3 and ("b",) not in reg
    reg.finalize_all()
    assert sorted(finalized) == ["compiled-a", "compiled-b", "compiled-c", "compiled-d"] and len(reg) == 0


def test_registry_rejects_implicit_keys():
    with pytest.raises(TypeError, match="explicit tuples"):
        ModuleRegistry(register=False).get("bf16", lambda: ("f", ()))
    with pytest.raises(ValueError, match="max_alive must be >= 1, got 0"):
        ModuleRegistry(max_alive=0)


@pytest.mark.parametrize("kernel",
                         ["Combine", "ReducePush", "PartialSum", "RankCombine", "CombineLowLatency"])
def test_combine_widens_bf16_from_bits(compiled_ptx, kernel):
    """kernels/rowsum.py widens BF16 rows to fp32 from their 32-bit words (a shift or a mask an element),
    not through the conversion instruction, whose lowering took more; FP16 keeps the conversion (FP32 has
    none)."""
    dtype, ptx = compiled_ptx
    ops = ptx_ops(_kernels(ptx)[kernel])
    if dtype == torch.bfloat16:
        assert ops["cvt.f32.bf16"] == 0, ops
    elif dtype == torch.float16:
        assert ops["cvt.f32.f16"] > 0, ops
