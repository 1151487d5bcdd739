"""FP8 dispatch rows: block-scaled e4m3 quantization and the packed row format that travels.

Every backend (and the GPU dispatch kernel, op by op) quantizes a row of H = hidden elements in blocks
of ``FP8_BLOCK`` = 128 columns:

    xf    = x.float().view(T, H // 128, 128)
    amax  = xf.abs().amax(-1).clamp_min(2**-14)         # FP8_AMAX_FLOOR: an all-zero block stays finite
    scale = amax.div(full_like(amax, 448.0))             # fp32 IEEE division (on CUDA too)
    inv   = full_like(amax, 448.0).div(amax)             # a real division, not reciprocal() * 448
    q     = (xf * inv[..., None]).to(float8_e4m3fn)      # the product rounded to fp32, then RNE to e4m3

A block's largest magnitude maps to +-448 (the product is within an ulp of 448, and e4m3 rounds it
back), and ``q.float() * scale`` restores x up to e4m3's rounding (:func:`dequantize_fp8`).

Packed row (``EpConfig.fp8_row_bytes`` = P bytes, a multiple of 16): bytes [0, H) the e4m3 values,
bytes [H, H + 4 H / 128) the fp32 scales in native (little-endian) byte order, zero bytes up to P.
Inputs are assumed finite (an inf or NaN in a block makes that block's values NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cute_ep.kernels.buffers import FP8_BLOCK, packed_fp8_row_bytes
from cute_ep.kernels.config import FP8_AMAX_FLOOR, FP8_MAX, VECTOR_BYTES

__all__ = [
    "FP8_DTYPE",
    "dequantize_fp8",
    "fp8_check_rows",
    "fp8_row_bytes",
    "pack_fp8_rows",
    "quantize_fp8",
    "unpack_fp8_rows",
]

FP8_DTYPE = torch.float8_e4m3fn
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_hidden(hidden: int) -> None:
    if hidden < FP8_BLOCK or hidden % FP8_BLOCK != 0:
        raise ValueError(
            f"FP8 rows need hidden to be a positive multiple of {FP8_BLOCK} (one scale per {FP8_BLOCK} "
            f"columns), got hidden={hidden}"
        )


def fp8_row_bytes(hidden: int) -> int:
    """P: bytes of one packed row of ``hidden`` columns (e4m3 values, fp32 scales, zeros to 16 bytes)."""
    _check_hidden(hidden)
    return packed_fp8_row_bytes(hidden)


def _check_q_scales(q: Tensor, scales: Tensor, rows: str) -> tuple[int, int, int]:
    """(rows, H, H / 128) of a valid pair q [rows, H] float8_e4m3fn, scales [rows, H / 128] fp32."""
    if q.dim() != 2 or q.dtype != FP8_DTYPE:
        raise ValueError(
            f"q must be a 2-D [{rows}, H] torch.float8_e4m3fn tensor, got {tuple(q.shape)} {q.dtype}"
        )
    n, hidden = q.shape
    _check_hidden(hidden)
    nsc = hidden // FP8_BLOCK
    if tuple(scales.shape) != (n, nsc) or scales.dtype != torch.float32:
        raise ValueError(
            f"scales must be [{rows}={n}, H/{FP8_BLOCK}={nsc}] float32, got {tuple(scales.shape)} "
            f"{scales.dtype}"
        )
    return n, hidden, nsc


def quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize rows to e4m3 with one fp32 scale per 128 columns (the module docstring's arithmetic).

    Args:
        x: [T, H] bf16 / fp16 / fp32, H a multiple of 128, finite values; T may be 0.

    Returns:
        (q, scales): q [T, H] torch.float8_e4m3fn, scales [T, H / 128] fp32 (``amax / 448``, at least
        ``2**-14 / 448``), both on x's device.
    """
    if x.dim() != 2 or x.dtype not in _SOURCE_DTYPES:
        raise ValueError(f"x must be a 2-D [T, H] bf16/fp16/fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    t, hidden = x.shape
    _check_hidden(hidden)
    xf = x.float().reshape(t, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = xf.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR)
    # Two real divisions, tensor by tensor, rounded once on every device as the GPU kernel's div_rn: torch
    # turns `scalar / tensor` into reciprocal() * scalar, and on CUDA `tensor / scalar` into
    # tensor * reciprocal(scalar) (two roundings: about half the scales would differ by an ulp).
    fp8_max = torch.full_like(amax, FP8_MAX)
    scale = amax.div(fp8_max)
    inv = fp8_max.div(amax)
    q = (xf * inv[..., None]).to(FP8_DTYPE)
    return q.reshape(t, hidden), scale


def pack_fp8_rows(q: Tensor, scales: Tensor, row_bytes: int) -> Tensor:
    """Pack e4m3 rows and their scales into the row format that travels.

    Args:
        q: [T, H] torch.float8_e4m3fn, H a multiple of 128.
        scales: [T, H / 128] fp32, on q's device.
        row_bytes: P, a multiple of 16 and at least H + 4 * H / 128 (``EpConfig.fp8_row_bytes``).

    Returns:
        [T, P] uint8 (new, contiguous): bytes [0, H) q, [H, H + 4 H / 128) the scales, zeros after.
    """
    t, hidden, nsc = _check_q_scales(q, scales, "T")
    if scales.device != q.device:
        raise ValueError(f"scales must be on q's device {q.device}, got {scales.device}")
    raw = hidden + 4 * nsc
    if row_bytes < raw or row_bytes % VECTOR_BYTES != 0:
        raise ValueError(
            f"row_bytes must be a multiple of {VECTOR_BYTES} and >= H + 4 * H/{FP8_BLOCK} = {raw}, "
            f"got {row_bytes}"
        )
    packed = torch.zeros((t, row_bytes), dtype=torch.uint8, device=q.device)
    if t == 0:
        return packed  # a zero-row scales tensor may carry strides that forbid the byte view
    packed[:, :hidden] = q.view(torch.uint8)
    packed[:, hidden:raw] = scales.contiguous().view(torch.uint8).view(t, 4 * nsc)
    return packed


def unpack_fp8_rows(packed: Tensor, hidden: int) -> tuple[Tensor, Tensor]:
    """Split packed rows back into e4m3 values and scales (:func:`pack_fp8_rows`'s inverse).

    Args:
        packed: [N, P] uint8, P >= H + 4 * H / 128.
        hidden: H, a multiple of 128.

    Returns:
        (q, scales): q [N, H] torch.float8_e4m3fn and scales [N, H / 128] fp32. Views of ``packed`` (rows
        P bytes apart) when its rows are contiguous and 4-byte aligned, else copies.
    """
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(
            f"packed must be a 2-D [N, P] uint8 tensor, got {tuple(packed.shape)} {packed.dtype}"
        )
    _check_hidden(hidden)
    nsc = hidden // FP8_BLOCK
    raw = hidden + 4 * nsc
    if packed.shape[1] < raw:
        raise ValueError(
            f"packed rows must hold at least H + 4 * H/{FP8_BLOCK} = {raw} bytes for hidden={hidden}, "
            f"got {packed.shape[1]}"
        )
    # Reinterpreting bytes as fp32 needs unit stride and 4-byte aligned rows; anything else is copied.
    aligned = packed.stride(1) == 1 and packed.stride(0) % 4 == 0 and packed.storage_offset() % 4 == 0
    if packed.shape[0] == 0:
        packed = packed.new_empty((0, raw))  # a zero-row tensor may carry any strides
    elif not aligned:
        packed = packed[:, :raw].contiguous()  # a copy: rows raw bytes apart, a multiple of 4
    q = packed[:, :hidden].view(FP8_DTYPE)
    scales = packed[:, hidden:raw].view(torch.float32)
    return q, scales


def dequantize_fp8(q: Tensor, scales: Tensor) -> Tensor:
    """x ~ q * scale, block by block.

    Args:
        q: [N, H] torch.float8_e4m3fn, H a multiple of 128.
        scales: [N, H / 128] fp32.

    Returns:
        [N, H] fp32: ``q[i, 128 b + j].float() * scales[i, b]`` (one rounded fp32 product).
    """
    n, hidden, nsc = _check_q_scales(q, scales, "N")
    blocks = q.float().reshape(n, nsc, FP8_BLOCK) * scales.to(q.device)[..., None]
    return blocks.reshape(n, hidden)


def fp8_check_rows(
    x: Tensor, recv_q: Tensor, recv_scales: Tensor, row_bytes: int
) -> tuple[Tensor, Tensor, Tensor]:
    """What an FP8 dispatch is checked with (the scripts' shared step).

    Args:
        x: [T, H] the sender's rows (any device). recv_q [N, H] float8_e4m3fn and recv_scales [N, H / 128]
            fp32: what this rank received (any device). row_bytes: P, ``EpConfig.fp8_row_bytes``.

    Returns:
        (sent, received, dequantized), on the CPU: the sender's rows quantized and packed [T, P] uint8
        (what must arrive), the received rows packed again [N, P] uint8 (compared with ``sent`` by
        check_dispatch), and the received rows dequantized [N, H] fp32 (the experts' input).
    """
    q, s = recv_q.cpu(), recv_scales.cpu()
    sent = pack_fp8_rows(*quantize_fp8(x.cpu()), row_bytes)
    return sent, pack_fp8_rows(q, s, row_bytes), dequantize_fp8(q, s)
