"""The rank layout's walks (kernels/layout_warps.py) find an id's destination rank as
``trunc((e + 0.5) * fp32(1 / El))`` instead of ``e // El``. This checks, on the CPU in IEEE fp32 (what the
GPU's ``add.rn`` / ``mul.rn`` compute), that the two agree for every expert count the kernels accept: every
experts-per-rank El up to ``MAX_EXPERTS`` and every expert id below ``MAX_EXPERTS``."""

from __future__ import annotations

import numpy as np

from cute_ep.kernels.config import MAX_EXPERTS


def rank_by_reciprocal(e: np.ndarray, experts_per_rank: int, offset: float = 0.5) -> np.ndarray:
    """The kernel's arithmetic, step by step in fp32: (e + offset) times the rounded reciprocal, truncated
    (the kernel's offset is 0.5)."""
    inv = np.float32(1.0) / np.float32(experts_per_rank)
    shifted = e.astype(np.float32) + np.float32(offset)
    return (shifted * inv).astype(np.float32).astype(np.int64)


def test_reciprocal_rank_equals_integer_division_for_every_accepted_expert_count() -> None:
    ids = np.arange(MAX_EXPERTS, dtype=np.int64)
    wrong = [el for el in range(1, MAX_EXPERTS + 1)
             if not np.array_equal(rank_by_reciprocal(ids, el), ids // el)]
    assert wrong == [], f"fp32 reciprocal disagrees with e // El for El in {wrong[:10]}"


def test_the_half_offset_is_what_makes_it_exact() -> None:
    """Without the 0.5 some exact multiples round below their quotient, so the check above can fail."""
    ids = np.arange(MAX_EXPERTS, dtype=np.int64)
    wrong = sum(int((rank_by_reciprocal(ids, el, offset=0.0) != ids // el).sum())
                for el in range(1, MAX_EXPERTS + 1))
    assert wrong > 0
