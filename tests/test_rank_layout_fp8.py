"""FP8 dispatch in the rank receive layout (``dispatch(..., fp8=True, layout="rank")``) on the host backends.

What is checked against what: ``ReferenceEpBuffer`` and ``A2aEpBuffer`` against an independent
restatement (every sender's tokens quantized one at a time with ``cute_ep.fp8``, packed, then placed by
the literal specification of tests/_rank_layout_spec.py) and against each other, bit for bit: the received
e4m3 values and fp32 scales (packed again: values, scales, padding), recv_topk_idx, recv_topk_weights,
recv_src, tokens_per_expert, num_recv / recv_count, the handle's rows and the rank combine of the caller's
rows computed from the dequantized rows. In a world of one in process (both modes, three dtypes, ragged,
empty, dropped ids, ``sync=False``) and in gloo worlds of 2 and 4 ranks
(tests/_torchrun_rank_layout_worker.py, PART "fp8": ragged, zero-token ranks, a rank whose ids are all -1,
skew onto rank 0, every token to every rank, no token at all). ``validators.checks.check_rank_dispatch(...,
fp8=True)`` passes the right results and fails one wrong byte of a value or a scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _launch import assert_cases_match
from _rank_layout_spec import (
    assert_cases_cover_skew_ragged_empty_full,
    caller_expert,
    spec_combine,
    spec_dispatch,
    spec_fp8_rows,
    spec_scatter,
)
from _worlds import HOST_BACKENDS, RANK_LAYOUT_WORLDS, host_config, needs_gloo, world_of_one

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.fp8 import dequantize_fp8, pack_fp8_rows, unpack_fp8_rows
from cute_ep.inputs import make_inputs
from cute_ep.validators.checks import check_rank_dispatch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4M3 = torch.float8_e4m3fn
HIDDEN = 256


def _cfg(dtype=BF16, **kw):
    return host_config(num_experts=6, topk=3, hidden=HIDDEN, dtype=dtype, **kw)


def _inputs(tokens: int, dtype, seed: int, routing: str = "uniform"):
    x, idx, w = make_inputs(0, tokens, HIDDEN, 6, 3, dtype, seed, routing=routing)
    x[:, 200:] *= 1000  # blocks of very different magnitudes in one row: the scales differ per block
    if routing == "dropped" and tokens:
        idx[0] = -1  # a token without destination: no row, zeros from combine
    return x, idx, w


def _packed(res, n: int, row_bytes: int) -> torch.Tensor:
    """The first n received rows packed again (e4m3 values, fp32 scales, zero padding)."""
    return pack_fp8_rows(res.recv_x[:n], res.recv_scales[:n], row_bytes)


def _check_fp8_against_spec(res, x, idx, w, cfg, *, rows: int | None = None) -> int:
    """Every field of a world-of-one FP8 rank-layout result against the restatement; returns N."""
    p = cfg.fp8_row_bytes
    spec = spec_dispatch([spec_fp8_rows(x, p)], [idx], [w], num_experts=cfg.num_experts,
                         max_tokens=cfg.max_tokens, dst=0)  # fmt: skip
    n = spec.recv_x.shape[0]
    rows = n if rows is None else rows
    assert res.num_recv == rows and res.recv_count.tolist() == [n]
    assert res.recv_weights is None
    assert res.recv_x.dtype == E4M3 and res.recv_x.shape == (rows, cfg.hidden)
    assert res.recv_scales.dtype == torch.float32 and res.recv_scales.shape == (rows, cfg.hidden // 128)
    if rows:
        assert res.recv_x.stride() == (p, 1) and res.recv_scales.stride() == (p // 4, 1)  # packed rows
    assert torch.equal(_packed(res, n, p), spec.recv_x)  # values, scales and padding, byte for byte
    for f in ("recv_topk_idx", "recv_topk_weights", "recv_src"):
        got = getattr(res, f)
        assert got.shape[0] == rows and torch.equal(got[:n], getattr(spec, f)), f
    assert torch.equal(res.tokens_per_expert, spec.tokens_per_expert)
    assert res.handle.layout == "rank"
    assert torch.equal(res.handle.scatter, spec_scatter([idx], num_experts=cfg.num_experts, src=0))
    return n


def _caller_rows(res, cfg, rank: int = 0) -> torch.Tensor:
    """The caller's rows for the rank combine, from the dequantized rows (cfg.dtype)."""
    rows = dequantize_fp8(res.recv_x, res.recv_scales).to(cfg.dtype)
    return caller_expert(rows, res.recv_topk_idx, res.recv_topk_weights, rank, cfg.experts_per_rank)


# --------------------------------------------------------------------------------------------------
# a world of one, in process
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=str)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped"])
@pytest.mark.parametrize("mode", ["scatter", "atomic"])
def test_world_of_one_fp8_rank_layout_follows_the_specification(backend, dtype, routing, mode):
    cfg = _cfg(dtype)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        buf.poison()
        for seed, tokens in ((1, 13), (2, 0), (3, 16)):
            x, idx, w = _inputs(tokens, dtype, seed, routing)
            res = buf.dispatch(x, idx, w, mode=mode, fp8=True, layout="rank")
            n = _check_fp8_against_spec(res, x, idx, w, cfg)
            fp8_fields = [t.clone() for t in (res.recv_topk_idx, res.recv_topk_weights, res.recv_src,
                                              res.tokens_per_expert, res.handle.scatter)]
            check = check_rank_dispatch(res, x, idx, w, max_tokens=cfg.max_tokens, num_experts=6,
                                        local_world_size=1, require_coverage=False, fp8=True)  # fmt: skip
            assert check.passed and check.wrong_rows == 0, check.message
            # Combine is unchanged: one cfg.dtype row per received row, here from the dequantized rows.
            y = _caller_rows(res, cfg)
            out = buf.combine(y, res.handle)
            assert out.dtype == dtype and out.shape == (tokens, HIDDEN)
            assert torch.equal(out, spec_combine([y], idx, res.handle.scatter, num_experts=6))
            if routing == "dropped" and tokens:
                assert n < tokens and not bool(out[0].any())
            # Everything but the rows is what the dispatch without FP8 gives.
            plain = buf.dispatch(x, idx, w, mode=mode, layout="rank")
            assert plain.recv_scales is None and plain.recv_x.dtype == dtype and plain.num_recv == n
            for a, b in zip((plain.recv_topk_idx, plain.recv_topk_weights, plain.recv_src,
                             plain.tokens_per_expert, plain.handle.scatter), fp8_fields, strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=str)
def test_world_of_one_a2a_is_bit_identical_to_the_reference_backend(dtype):
    cfg = _cfg(dtype)
    rt = world_of_one()
    with A2aEpBuffer(rt, cfg) as a2a, HOST_BACKENDS["reference"](rt, cfg) as ref:
        for seed, tokens, routing in ((1, 16, "uniform"), (2, 5, "dropped"), (3, 0, "uniform"),
                                      (4, 11, "skewed")):
            x, idx, w = _inputs(tokens, dtype, seed, routing)
            ra, rr = (b.dispatch(x, idx, w, fp8=True, layout="rank") for b in (a2a, ref))
            assert ra.num_recv == rr.num_recv
            assert torch.equal(ra.recv_x.view(torch.uint8), rr.recv_x.view(torch.uint8))
            for f in ("recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert"):
                assert torch.equal(getattr(ra, f), getattr(rr, f)), f
            assert torch.equal(ra.handle.scatter, rr.handle.scatter)
            y = _caller_rows(ra, cfg)
            assert torch.equal(a2a.combine(y, ra.handle), ref.combine(y, rr.handle))


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_sync_false_views_cover_rank_capacity(backend):
    cfg = _cfg()
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        buf.poison()
        x, idx, w = _inputs(11, BF16, 5, "dropped")
        idx[3] = -1
        res = buf.dispatch(x, idx, w, fp8=True, sync=False, layout="rank")
        n = _check_fp8_against_spec(res, x, idx, w, cfg, rows=cfg.rank_capacity)
        assert n == int((idx >= 0).any(dim=1).sum()) < 11 and res.num_recv == cfg.rank_capacity == 16
        # The rows past N were never written: poison (NaN values and scales).
        assert bool(torch.isnan(res.recv_x[n:].float()).all())
        assert bool(torch.isnan(res.recv_scales[n:]).all())
        y = _caller_rows(res, cfg)
        buf.expert_output(res.num_recv).copy_(y)
        out = buf.combine(buf.expert_output(res.num_recv), res.handle)
        assert torch.equal(out, spec_combine([y[:n]], idx, res.handle.scatter, num_experts=6))
        assert torch.equal(buf.combine(y[:n].clone(), res.handle), out)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_world_of_one_fp8_rank_layout_errors_leave_the_buffer_usable(backend):
    with HOST_BACKENDS[backend](world_of_one(), host_config(hidden=64)) as buf:
        x, idx, w = make_inputs(0, 4, 64, 4, 2, BF16, 1)
        with pytest.raises(ValueError, match="multiple of 128"):  # FP8's own constraint, either layout
            buf.dispatch(x, idx, w, fp8=True, layout="rank")
        assert buf.dispatch(x, idx, w, layout="rank").num_recv == 4
    with HOST_BACKENDS[backend](world_of_one(), _cfg(capacity_factor=1.0)) as capped:
        x, idx, w = _inputs(4, BF16, 1)
        with pytest.raises(ValueError, match=r"layout='rank' needs capacity_factor == 0"):
            capped.dispatch(x, idx, w, fp8=True, layout="rank")


# --------------------------------------------------------------------------------------------------
# the validators' check: it passes the right result and fails a wrong byte
# --------------------------------------------------------------------------------------------------


def _with_packed(res, packed: torch.Tensor):
    """``res`` with its FP8 rows replaced by views of ``packed`` ([N, P] uint8)."""
    q, scales = unpack_fp8_rows(packed, HIDDEN)
    return dataclasses.replace(res, recv_x=q, recv_scales=scales)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_check_rank_dispatch_fp8_fails_a_wrong_value_or_scale_byte(backend):
    cfg = _cfg()
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        x, idx, w = _inputs(16, BF16, 7, "dropped")
        res = buf.dispatch(x, idx, w, fp8=True, layout="rank")
        n, p = res.num_recv, cfg.fp8_row_bytes
        assert 3 < n < 16

        def check(r, fp8=True):
            return check_rank_dispatch(r, x, idx, w, max_tokens=cfg.max_tokens, num_experts=6,
                                       local_world_size=1, fp8=fp8)  # fmt: skip

        assert check(res).passed
        packed = _packed(res, n, p)
        scale_byte = HIDDEN + 5  # a byte of row 3's second scale
        for col, where in ((5, "byte 5 (recv_x column 5)"), (scale_byte, f"byte {scale_byte} (recv_scales "
                                                                         "column 1)")):
            bad = packed.clone()
            bad[3, col] ^= 1
            result = check(_with_packed(res, bad))
            assert not result.passed and result.wrong_rows == 1, result.message
            assert "row 3): field recv_x differs" in result.message and where in result.message
        swapped = packed[torch.tensor([1, 0, *range(2, n)])]  # one order in this layout: two wrong rows
        assert check(_with_packed(res, swapped)).wrong_rows == 2
        # No scales, or an FP8 result checked as a non-FP8 one (and the reverse): failures, not errors.
        no_scales = check(dataclasses.replace(res, recv_scales=None))
        assert not no_scales.passed and "recv_scales is None" in no_scales.message
        assert not check(res, fp8=False).passed
        plain = buf.dispatch(x, idx, w, layout="rank")
        assert check(plain, fp8=False).passed and not check(plain).passed


# --------------------------------------------------------------------------------------------------
# gloo worlds of 2 and 4 ranks
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fp8_ranks(rank_layout_worlds: list[dict]) -> list[dict]:
    """The worker's "fp8" part (tests/conftest.py launches it with the "layout" part)."""
    return [res["fp8"] for res in rank_layout_worlds]
FP8_CASE_NAMES = ["fp8-uniform-bf16-k4-el2-ragged", "fp8-dropped-fp32-k3-el2-alldrop",
                  "fp8-skewed-fp16-k2-el3-atomic", "fp8-rank0-bf16-k2-el4-skew", "fp8-everyone-bf16-full",
                  "fp8-uniform-bf16-k2-el2-empty"]


@needs_gloo
@RANK_LAYOUT_WORLDS
def test_gloo_both_backends_deliver_the_specified_fp8_rows(fp8_ranks):
    assert_cases_match(fp8_ranks, len(FP8_CASE_NAMES))
    assert [c["name"] for c in fp8_ranks[0]["cases"]] == FP8_CASE_NAMES


@needs_gloo
@RANK_LAYOUT_WORLDS
def test_gloo_fp8_cases_cover_skew_ragged_empty_and_full_receives(fp8_ranks):
    assert_cases_cover_skew_ragged_empty_full(fp8_ranks, FP8_CASE_NAMES, "fp8-")
