"""Zipf-skewed routings for examples, tests and benchmarks of hot-expert handling (``cute_ep.elastic``).

Expert popularity follows Zipf's law: the i-th most popular expert is chosen with probability
proportional to 1 / i**skew (skew 0: uniform; 1.0-1.2: a few experts take a large share). Which experts
are the popular ones is a random permutation drawn from ``(seed, step)`` only, so every rank agrees on it
and it changes from step to step; each rank then draws its tokens' top-k experts (distinct per token)
from those probabilities with a generator of ``(seed, step, rank)``. Drawn on the CPU, so CPU and GPU runs
see the same routing.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["zipf_probs", "zipf_topk"]


def _generator(*key: int) -> torch.Generator:
    state = np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def zipf_probs(num_experts: int, skew: float, seed: int, step: int = 0) -> Tensor:
    """[E] float64 on the CPU: each expert's probability, 1 / i**skew for the expert of popularity rank i
    (1-based), normalised; the experts' popularity order is a permutation drawn from (seed, step).

    num_experts: E >= 1; skew: >= 0 (0 is uniform)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not skew >= 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    weight = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    order = torch.randperm(num_experts, generator=_generator(seed, step, 0x21F))
    probs = torch.empty_like(weight)
    probs[order] = weight
    return probs / probs.sum()


def zipf_topk(rank: int, num_tokens: int, num_experts: int, topk: int, skew: float, seed: int,
              step: int = 0, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.int64) -> Tensor:
    """[T, K] expert ids (``dtype``, int64 or int32) of rank ``rank``'s ``num_tokens`` tokens at ``step``:
    K distinct experts per token, drawn without replacement from ``zipf_probs(E, skew, seed, step)``.

    rank >= 0; num_tokens T >= 0; 1 <= topk <= num_experts."""
    if rank < 0 or num_tokens < 0:
        raise ValueError(f"rank and num_tokens must be >= 0, got {rank} and {num_tokens}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    if dtype not in (torch.int64, torch.int32):
        raise ValueError(f"dtype must be torch.int64 or torch.int32, got {dtype}")
    probs = zipf_probs(num_experts, skew, seed, step)
    if num_tokens == 0:
        return torch.zeros(0, topk, dtype=dtype, device=device)
    g = _generator(seed, step, rank + 1)
    idx = torch.multinomial(probs.expand(num_tokens, num_experts), topk, replacement=False, generator=g)
    return idx.to(dtype=dtype, device=device)
