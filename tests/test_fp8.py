"""FP8 dispatch: cute_ep/fp8.py against an independent numpy formulation (its own e4m3 encoder), the
packed row format, the dequantization error bound, and the host backends' FP8 dispatch in a world of
one (under torchrun, in gloo worlds of 2 and 4 ranks: tests/test_capacity_fp8_torchrun.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _worlds import HOST_BACKENDS, expected_dispatch, expert_outputs, host_config, world_of_one

from cute_ep.fp8 import dequantize_fp8, fp8_row_bytes, pack_fp8_rows, quantize_fp8, unpack_fp8_rows
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import reference_combine

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
E4M3 = torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------------
# An independent formulation: numpy fp32 per block and an e4m3fn encoder built from the bit layout
# --------------------------------------------------------------------------------------------------


def _e4m3_magnitudes() -> np.ndarray:
    """Value of each non-negative finite e4m3fn code 0x00..0x7E (1 sign, 4 exponent bits with bias 7,
    3 mantissa bits; exponent 0 is subnormal; 0x7F is NaN)."""
    vals = []
    for code in range(0x7F):
        exp, man = code >> 3, code & 7
        vals.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(vals, dtype=np.float64)


MAGS = _e4m3_magnitudes()


def encode_e4m3(v: np.ndarray) -> np.ndarray:
    """Round fp32 values (|v| < 464) to the nearest e4m3fn code, ties to the even code: uint8 codes."""
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(MAGS, a, side="left"), 0, len(MAGS) - 1)  # first magnitude >= a
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a - MAGS[lo], MAGS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(a >= MAGS[hi], hi, np.where(pick_hi, hi, lo)).astype(np.uint8)
    return code | (np.signbit(v).astype(np.uint8) << 7)


def numpy_quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row and block of 128, in numpy fp32 scalars: (codes [T, H] uint8, scales [T, H/128] fp32)."""
    xf = x.float().numpy()
    t, h = xf.shape
    codes = np.zeros((t, h), dtype=np.uint8)
    scales = np.zeros((t, h // 128), dtype=np.float32)
    for i in range(t):
        for b in range(h // 128):
            block = xf[i, 128 * b : 128 * (b + 1)]
            amax = max(np.float32(np.abs(block).max()), np.float32(2.0**-14))
            scales[i, b] = np.float32(amax) / np.float32(448.0)
            inv = np.float32(448.0) / np.float32(amax)
            codes[i, 128 * b : 128 * (b + 1)] = encode_e4m3((block * inv).astype(np.float32))
    return codes, scales


def codes_of(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def test_the_encoder_reproduces_the_e4m3_table():
    assert MAGS[-1] == 448.0 and MAGS[1] == 2.0**-9 and MAGS[8] == 2.0**-6
    all_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float().numpy()
    finite = np.isfinite(all_codes)
    assert (encode_e4m3(all_codes[finite].astype(np.float32)) == np.arange(256)[finite]).all()


# --------------------------------------------------------------------------------------------------
# quantize / pack / unpack / dequantize
# --------------------------------------------------------------------------------------------------


def _rows(dtype: torch.dtype, t: int = 6, h: int = 384, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.logspace(-6, 3, t)[:, None]  # magnitudes far apart
    x[0, :128] = 0.0  # an all-zero block
    x[1, 128:256] = -x[1, 128:256].abs()  # an all-negative block
    # Magnitudes over five decades in one block: the small ones land on e4m3 subnormals (< 2**-6).
    ramp = torch.logspace(-5, 0, 128) * torch.tensor([1.0, -1.0]).repeat(64)
    x[3, -128:] = ramp * x[3].abs().max()
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_matches_the_independent_per_block_formulation(dtype):
    for seed in range(3):
        x = _rows(dtype, seed=seed)
        q, scales = quantize_fp8(x)
        assert q.dtype == E4M3 and q.shape == x.shape and scales.dtype == torch.float32
        assert scales.shape == (x.shape[0], x.shape[1] // 128)
        codes, want_scales = numpy_quantize(x)
        assert np.array_equal(codes_of(q), codes)
        assert ((codes & 0x7F) < 8).sum() > 10 and (codes & 0x7F).max() == 0x7E  # subnormals and 448
        assert np.array_equal(scales.numpy().view(np.uint32), want_scales.view(np.uint32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_amax_maps_to_448_and_zero_and_negative_blocks(dtype):
    x = _rows(dtype)
    q, scales = quantize_fp8(x)
    xf = x.float().view(x.shape[0], -1, 128)
    qf = q.float().view(x.shape[0], -1, 128)
    at = xf.abs().argmax(-1, keepdim=True)
    peak = qf.gather(-1, at).squeeze(-1)
    # Every block whose amax reaches the floor 2**-14 has its peak at +-448 exactly (below the floor,
    # e.g. the rows scaled by 1e-6 here, the scale stops shrinking and the peak stays under 448).
    amax = xf.abs().amax(-1)
    full = amax >= 2.0**-14
    assert 0 < int(full.sum()) < full.numel()
    assert torch.equal(peak[full].abs(), torch.full_like(peak[full], 448.0))
    assert bool((peak[~full].abs() < 448.0).all())
    assert torch.equal(torch.sign(peak[full]), torch.sign(xf.gather(-1, at).squeeze(-1)[full]))
    # The all-zero block: zero codes, the floor's scale, an exact zero after dequantizing.
    assert (codes_of(q)[0, :128] == 0).all()
    assert scales[0, 0].item() == np.float32(2.0**-14) / np.float32(448.0)
    assert torch.equal(dequantize_fp8(q, scales)[0, :128], torch.zeros(128))
    # The all-negative block stays negative (sign bit set, -448 at its peak).
    assert (codes_of(q)[1, 128:256] >= 0x80).all() and qf[1, 1].min().item() == -448.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_error_bound(dtype):
    # e4m3 keeps 3 mantissa bits: rounding a normal value v costs at most half an ulp, <= 2**-4 |v|;
    # below 2**-6 (subnormals) at most half the spacing 2**-9, i.e. 2**-10 in units of the scale. The
    # fp32 products around it add a few 2**-24 relative, covered by the factor (1 + 2**-10).
    x = _rows(dtype, t=8, h=512, seed=4)
    q, scales = quantize_fp8(x)
    deq = dequantize_fp8(q, scales)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    xf = x.float()
    scale = scales.repeat_interleave(128, dim=1)
    bound = torch.maximum(xf.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2.0**-10)
    err = (xf - deq).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float((err / xf.abs().clamp_min(1e-30)).max()) > 0.03  # the bound is not vacuous


def test_pack_unpack_round_trip_and_byte_layout():
    x = _rows(torch.bfloat16, t=5, h=256)
    q, scales = quantize_fp8(x)
    p = fp8_row_bytes(256)
    assert p == 272 and fp8_row_bytes(128) == 144 and fp8_row_bytes(384) == 400
    assert host_config(num_experts=2, topk=1, hidden=384, max_tokens=4).fp8_row_bytes == fp8_row_bytes(384)
    packed = pack_fp8_rows(q, scales, p)
    assert packed.dtype == torch.uint8 and packed.shape == (5, p) and packed.is_contiguous()
    raw = packed.numpy()
    assert np.array_equal(raw[:, :256], codes_of(q))
    for i in range(5):  # the scales in native (little-endian) fp32 bytes
        assert np.array_equal(np.frombuffer(raw[i, 256:264].tobytes(), dtype="<f4"), scales[i].numpy())
    assert (raw[:, 264:] == 0).all()
    q2, s2 = unpack_fp8_rows(packed, 256)
    assert q2.dtype == E4M3 and s2.dtype == torch.float32 and s2.shape == (5, 2)
    assert q2.data_ptr() == packed.data_ptr() and s2.stride() == (p // 4, 1)  # views
    assert np.array_equal(codes_of(q2.contiguous()), codes_of(q)) and torch.equal(s2, scales)
    assert torch.equal(pack_fp8_rows(q2, s2, p), packed)
    wider = pack_fp8_rows(q, scales, 288)  # a larger row: more zero padding
    assert torch.equal(wider[:, :p], packed) and not bool(wider[:, p:].any())
    # Misaligned or strided rows are copied; zero rows work.
    shifted = torch.zeros(5, p + 1, dtype=torch.uint8)
    shifted[:, 1:] = packed
    q3, s3 = unpack_fp8_rows(shifted[:, 1:], 256)
    assert torch.equal(s3, scales) and np.array_equal(codes_of(q3.contiguous()), codes_of(q))
    q0, s0 = unpack_fp8_rows(packed[:0], 256)
    assert q0.shape == (0, 256) and s0.shape == (0, 2)
    e_q, e_s = quantize_fp8(torch.zeros(0, 128))
    assert pack_fp8_rows(e_q, e_s, 144).shape == (0, 144)


def test_fp8_argument_errors():
    x = torch.randn(2, 256)
    q, s = quantize_fp8(x)
    cases = [
        (lambda: quantize_fp8(torch.randn(2, 64)), "multiple of 128"),
        (lambda: quantize_fp8(torch.randn(256)), r"2-D \[T, H\]"),
        (lambda: quantize_fp8(torch.ones(2, 128, dtype=torch.int32)), "bf16/fp16/fp32"),
        (lambda: pack_fp8_rows(x, s, 272), "float8_e4m3fn"),
        (lambda: pack_fp8_rows(q, s[:, :1], 272), r"scales must be \[T=2, H/128=2\] float32"),
        (lambda: pack_fp8_rows(q, s.double(), 272), "float32"),
        (lambda: pack_fp8_rows(q, s, 256), r"row_bytes must be a multiple of 16 and >= .* = 264, got 256"),
        (lambda: pack_fp8_rows(q, s, 276), "multiple of 16"),
        (lambda: unpack_fp8_rows(torch.zeros(2, 260, dtype=torch.uint8), 256), "at least .* = 264 bytes"),
        (lambda: unpack_fp8_rows(torch.zeros(2, 272), 256), r"\[N, P\] uint8"),
        (lambda: unpack_fp8_rows(torch.zeros(2, 272, dtype=torch.uint8), 100), "multiple of 128"),
        (lambda: dequantize_fp8(q, s[:1]), r"scales must be \[N=2, H/128=2\]"),
        (lambda: dequantize_fp8(x, s), "float8_e4m3fn"),
        (lambda: fp8_row_bytes(0), "positive multiple of 128"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


# --------------------------------------------------------------------------------------------------
# backends in a world of one
# --------------------------------------------------------------------------------------------------


def _cfg(dtype=torch.bfloat16, hidden=256, factor=0.0) -> EpConfig:
    return host_config(hidden=hidden, dtype=dtype, capacity_factor=factor, on_overflow="drop")


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [0.0, 0.5])
def test_fp8_dispatch_delivers_the_senders_packed_rows(backend, dtype, factor):
    cfg = _cfg(dtype, factor=factor)
    with HOST_BACKENDS[backend](world_of_one(), cfg) as buf:
        for seed, tokens in ((1, 16), (2, 0), (3, 11)):
            x, idx, w = make_inputs(0, tokens, 256, 4, 2, dtype, seed, routing="skewed")
            x[:, 200:] *= 1000  # blocks of very different magnitudes in one row
            res = buf.dispatch(x, idx, w, fp8=True)
            sent = pack_fp8_rows(*quantize_fp8(x), cfg.fp8_row_bytes)
            eff, _, layout, want = expected_dispatch(cfg, sent, idx, w)
            assert res.recv_x.dtype == E4M3 and res.recv_x.shape == (res.num_recv, 256)
            assert res.recv_scales.dtype == torch.float32 and res.recv_scales.shape == (res.num_recv, 2)
            got = pack_fp8_rows(res.recv_x, res.recv_scales, cfg.fp8_row_bytes)
            assert torch.equal(got, want.recv_x)  # the bytes, values and scales and padding
            if res.num_recv:
                assert res.recv_x.stride() == (cfg.fp8_row_bytes, 1)  # rows fp8_row_bytes apart
            assert torch.equal(res.recv_weights, want.recv_w) and torch.equal(res.recv_src, want.recv_src)
            assert torch.equal(res.handle.scatter, layout.scatter[0].to(torch.int32))
            # Everything but the rows equals the non-FP8 dispatch; combine takes cfg.dtype outputs.
            fp8_fields = (
                res.recv_weights.clone(),
                res.recv_src.clone(),
                res.tokens_per_expert.clone(),
                res.handle.scatter.clone(),
            )
            y = expert_outputs(res, dequantize_fp8(res.recv_x, res.recv_scales).to(dtype))
            out = buf.combine(y, res.handle)
            assert out.dtype == dtype
            assert torch.equal(out, reference_combine([y], [eff], [w], layout.scatter, num_experts=4)[0])
            plain = buf.dispatch(x, idx, w)
            assert plain.recv_scales is None and plain.recv_x.dtype == dtype
            for a, b in zip(
                (plain.recv_weights, plain.recv_src, plain.tokens_per_expert, plain.handle.scatter),
                fp8_fields,
                strict=True,
            ):
                assert torch.equal(a, b)


@pytest.mark.parametrize("backend", sorted(HOST_BACKENDS))
def test_fp8_dispatch_errors_leave_the_buffer_usable(backend):
    with HOST_BACKENDS[backend](world_of_one(), _cfg(hidden=64)) as buf:
        x, idx, w = make_inputs(0, 4, 64, 4, 2, torch.bfloat16, 1)
        with pytest.raises(ValueError, match="multiple of 128"):  # a ConfigError on the a2a backend
            buf.dispatch(x, idx, w, fp8=True)
        assert buf.dispatch(x, idx, w).num_recv == 8
    with HOST_BACKENDS[backend](world_of_one(), _cfg()) as buf:
        x, idx, w = make_inputs(0, 4, 256, 4, 2, torch.bfloat16, 1)
        with pytest.raises(ValueError, match="fp8 must be True or False"):
            buf.dispatch(x, idx, w, fp8=1)
        res = buf.dispatch(x, idx, w, fp8=True)
        buf.poison()  # poisoned FP8 rows read as NaN
        assert torch.isnan(res.recv_x.float()).all() and torch.isnan(res.recv_scales).all()
