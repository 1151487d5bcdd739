"""Deterministic test inputs whose rows name their sender.

Columns 0..3 of every row of ``x`` hold small integers, exact in bf16 (which holds integers up to 256
exactly): col0 = rank, col1 = token // 256, col2 = token % 256, col3 = (rank * 7 + token) % 251 (a
check value). The rest of the row is random normal, so a misplaced row is both visibly misplaced
and unlikely to match any other row.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MAX_TOKENS",
    "ROUTINGS",
    "SENDER_COLUMNS",
    "decode_sender",
    "make_inputs",
    "sender_check_ok",
    "sender_check_value",
]

ROUTINGS = ("uniform", "skewed", "dropped")
SENDER_COLUMNS = 4
_MAX_RANK = 256  # col0 must stay exact in bf16
MAX_TOKENS = 256 * 256  # tokens per rank at most: col1 = token // 256 must stay <= 255
_SKEW_FRACTION = 0.9  # share of tokens sent to the hot experts 0..K-1 in "skewed"
_DROP_FRACTION = 0.25  # share of (t, k) entries set to -1 in "dropped"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _generator(seed: int, rank: int) -> torch.Generator:
    """A CPU generator seeded from (seed, rank) only, so CPU and GPU runs draw the same inputs."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(rank)]).generate_state(2, dtype=np.uint32)
    g = torch.Generator(device="cpu")
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def sender_check_value(rank: int | Tensor, token: int | Tensor) -> int | Tensor:
    """The check value stored in column 3: (rank * 7 + token) % 251 (int or int64 tensor)."""
    return (rank * 7 + token) % 251


def _random_topk(num_tokens: int, num_experts: int, topk: int, g: torch.Generator) -> Tensor:
    """[T, K] int64: K distinct experts per token, uniformly (argsort of noise is a random permutation)."""
    noise = torch.rand(num_tokens, num_experts, generator=g)
    return torch.argsort(noise, dim=1)[:, :topk].contiguous()


def make_inputs(
    rank: int,
    num_tokens: int,
    hidden: int,
    num_experts: int,
    topk: int,
    dtype: torch.dtype,
    seed: int,
    *,
    routing: str = "uniform",
    device: str | torch.device = "cpu",
    idx_dtype: torch.dtype = torch.int64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Deterministic inputs of one rank (a function of (seed, rank) and the sizes only).

    Args:
        rank: this rank (0 <= rank <= 256, so it is exact in column 0).
        num_tokens: T, tokens on this rank (0 <= T <= 65536).
        hidden: H >= 4 (columns 0..3 name the sender).
        num_experts: E >= 1.
        topk: K, 1 <= K <= E.
        dtype: torch.bfloat16, torch.float16 or torch.float32.
        seed: the run's seed.
        routing: "uniform" (K distinct experts per token, uniform), "skewed" (about 90% of tokens go to
            experts 0..K-1 in a random order, the rest uniform; still distinct per token) or "dropped"
            (uniform, then about 25% of the entries set to -1).
        device: where the returned tensors live (drawn on CPU, then moved).
        idx_dtype: torch.int64 or torch.int32 for topk_idx.

    Returns:
        x [T, H] in dtype, topk_idx [T, K] idx_dtype in [-1, E), topk_weights [T, K] float32 (> 0,
        a softmax over K of random normals).

    Raises:
        ValueError: any argument outside the ranges above.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
    if idx_dtype not in (torch.int64, torch.int32):
        raise ValueError(f"idx_dtype must be torch.int64 or torch.int32, got {idx_dtype}")
    if not 0 <= rank <= _MAX_RANK:
        raise ValueError(f"rank must be in [0, {_MAX_RANK}] (exact in bf16), got {rank}")
    if not 0 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"num_tokens must be in [0, {MAX_TOKENS}], got {num_tokens}")
    if hidden < SENDER_COLUMNS:
        raise ValueError(f"hidden must be >= {SENDER_COLUMNS} (columns 0..3 name the sender), got {hidden}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")

    g = _generator(seed, rank)
    tokens = torch.arange(num_tokens, dtype=torch.int64)
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float32)
    x[:, 0] = float(rank)
    x[:, 1] = (tokens // 256).float()
    x[:, 2] = (tokens % 256).float()
    x[:, 3] = sender_check_value(rank, tokens).float()
    x = x.to(dtype)

    topk_idx = _random_topk(num_tokens, num_experts, topk, g)
    if routing == "skewed":
        hot = torch.argsort(torch.rand(num_tokens, topk, generator=g), dim=1)  # a permutation of 0..K-1
        use_hot = torch.rand(num_tokens, generator=g) < _SKEW_FRACTION
        topk_idx = torch.where(use_hot[:, None], hot, topk_idx)
    elif routing == "dropped":
        drop = torch.rand(num_tokens, topk, generator=g) < _DROP_FRACTION
        topk_idx = torch.where(drop, torch.full_like(topk_idx, -1), topk_idx)

    topk_weights = torch.softmax(torch.randn(num_tokens, topk, generator=g, dtype=torch.float32), dim=1)
    return x.to(device), topk_idx.to(device=device, dtype=idx_dtype), topk_weights.to(device)


def decode_sender(x: Tensor) -> tuple[Tensor, Tensor]:
    """Read back the sender of each row of x (or of received rows).

    Args:
        x: [N, H >= 4] rows made by :func:`make_inputs` (any float dtype, any device).

    Returns:
        (rank, token): two [N] int64 CPU tensors. Rows that are not sender rows (NaN poison, wrong
        data) decode to arbitrary values; use :func:`sender_check_ok` to tell.
    """
    if x.dim() != 2 or x.shape[1] < SENDER_COLUMNS:
        raise ValueError(f"x must be [N, H >= {SENDER_COLUMNS}], got shape {tuple(x.shape)}")
    cols = x[:, :SENDER_COLUMNS].detach().float().cpu()
    cols = torch.nan_to_num(cols, nan=-1.0, posinf=-1.0, neginf=-1.0).to(torch.int64)
    return cols[:, 0], cols[:, 1] * 256 + cols[:, 2]


def sender_check_ok(x: Tensor) -> Tensor:
    """[N] bool: rows whose columns 0..3 are exact integers consistent with the check value.

    Args:
        x: [N, H >= 4] rows made by :func:`make_inputs`.
    """
    if x.dim() != 2 or x.shape[1] < SENDER_COLUMNS:
        raise ValueError(f"x must be [N, H >= {SENDER_COLUMNS}], got shape {tuple(x.shape)}")
    cols = x[:, :SENDER_COLUMNS].detach().float().cpu()
    integral = (cols == cols.round()).all(dim=1) & (cols >= 0).all(dim=1)
    rank, token = decode_sender(x)
    ok_check = cols[:, 3].to(torch.int64) == sender_check_value(rank, token)
    in_range = (cols[:, 1] < 256) & (cols[:, 2] < 256)
    return integral & ok_check & in_range
