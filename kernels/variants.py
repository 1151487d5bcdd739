"""The variants of the EP module, declared once: a receive layout with its combine algorithm.

A call runs one variant: the receive layout is a run-time argument of every call, and the expert layout's
combine is the buffer's default or the call's choice. A variant's declaration says which kernels each step
launches, in order, and which configurations can run it; the rest follows from it:

- ``kernels/module.py`` emits the launch sequence of every step from ``LAYOUT_STEP``, ``DISPATCH_STEP`` and
  ``COMBINE_STEP`` (each kernel at one launch site: the DSL emits an entry point per site);
- ``kernels/buffers.py`` allocates a buffer that only some variants use at full size only where the
  configuration can run one of them (``runs``);
- the host passes ``variant(layout, combine).scalars`` (the ``layout`` and ``combine_algo`` scalars).

A new variant is one more entry in ``VARIANTS`` (and its kernels as ``EpModule`` attributes). The receive
layouts and combine algorithms themselves (their names and run-time codes) are declared here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Receive layouts (run-time argument of every op): "expert" gives one row per kept (token, k), grouped by
# local expert (ready for a grouped GEMM); "rank" one row per (source rank, token) bound for this rank,
# source-major, with the token's local expert ids and weights beside it (DeepEP's layout).
LAYOUT_EXPERT = 0
LAYOUT_RANK = 1
LAYOUTS = {"expert": LAYOUT_EXPERT, "rank": LAYOUT_RANK}
# DeepEP's low-latency layout (``cute_ep.deep_ep``'s low-latency mode, buffers built with ``low_latency``):
# one padded block of R * M rows per local expert; its combine pushes each row back to its token's rank.
LAYOUT_LOW_LATENCY = 2

# Combine algorithms (run-time argument of the combine op): "pull" reads every (token, k) row from its
# expert's rank and sums them on the token's rank in ascending k (bit-identical to
# cute_ep.reference.reference_combine); "reduced" sums a token's rows on each expert rank first
# (ascending k, rounded to the row dtype) and moves one partial row per (token, rank), summed on the
# token's rank in the order of each rank's first kept k (cute_ep.reference.reference_combine_reduced).
# In the rank layout, whose rows are one per (token, rank) already, "pull" reads them from each rank and
# "reduced" pushes them to the token's rank; both sum them in ascending rank (the same result).
COMBINE_PULL = 0
COMBINE_REDUCED = 1
COMBINE_ALGORITHMS = {"pull": COMBINE_PULL, "reduced": COMBINE_REDUCED}


@dataclass(frozen=True)
class Variant:
    """One receive layout with one combine algorithm.

    name:     "<layout>" or "<layout>+<combine>" (the layout's names in ``LAYOUTS``, the combine's in
              ``COMBINE_ALGORITHMS``).
    layout:   LAYOUT_* scalar.
    combine:  COMBINE_* scalar the combine launch passes (a layout with one combine passes COMBINE_PULL).
    layout_kernels / dispatch_kernels / combine_kernels: ``EpModule`` attributes each step launches, in
              order, on one stream.
    runs:     configuration -> whether buffers built for it can run this variant.
    reads_y:  its combine reads the caller's y itself (no staging into ``recv_y`` first).
    """

    name: str
    layout: int
    combine: int
    layout_kernels: tuple[str, ...]
    dispatch_kernels: tuple[str, ...]
    combine_kernels: tuple[str, ...]
    runs: Callable[[Any], bool]
    reads_y: bool = False

    @property
    def scalars(self) -> dict[str, int]:
        """The launch scalars that select this variant."""
        return {"layout": self.layout, "combine_algo": self.combine}


VARIANTS: tuple[Variant, ...] = (
    # One row per kept (token, k), grouped by local expert; combine pulls every row to the token's rank.
    # After the dispatch, the fan-out copies a row sent once per rank to its other slots.
    Variant("expert+pull", LAYOUT_EXPERT, COMBINE_PULL, ("layout",), ("dispatch", "fanout"), ("combine",),
            runs=lambda c: True),
    # The same rows; each expert rank sums a token's rows first and pushes one partial per (token, rank)
    # (two launches: every rank's partials are out before any is summed).
    Variant("expert+reduced", LAYOUT_EXPERT, COMBINE_REDUCED, ("layout",), ("dispatch", "fanout"),
            ("reduce_push", "partial_sum"), runs=lambda c: c.combine_algorithm == "reduced"),
    # One row per (source rank, token) with its local ids and weights beside it (no expert capacity).
    Variant("rank", LAYOUT_RANK, COMBINE_PULL, ("rank_layout",), ("rank_dispatch",), ("rank_combine",),
            runs=lambda c: c.capacity_factor == 0),
    # The same rows; the combine pushes each row (the caller's y, read where it is) back into its token's
    # rank's partial rows, which that rank sums in rank order: the rank combine's result by another way.
    Variant("rank+reduced", LAYOUT_RANK, COMBINE_REDUCED, ("rank_layout",), ("rank_dispatch",),
            ("rank_push", "rank_sum"), reads_y=True,
            runs=lambda c: c.capacity_factor == 0 and c.combine_algorithm == "reduced"),
    # DeepEP's padded layout in one launch each way: the dispatch places it (kernels/low_latency_dispatch.py),
    # the combine pushes the caller's padded rows back and sums them (kernels/low_latency_combine.py).
    Variant("low-latency", LAYOUT_LOW_LATENCY, COMBINE_PULL, (), ("low_latency_dispatch",),
            ("low_latency_combine",), runs=lambda c: c.low_latency, reads_y=True),
)
BY_NAME = {v.name: v for v in VARIANTS}


def variant(layout: str, combine: str | None = None) -> Variant:
    """The variant of receive layout ``layout`` ("expert" or "rank") with combine algorithm ``combine``
    ("pull" or "reduced"; the rank layout's pull when None)."""
    if layout == "low-latency":
        return BY_NAME[layout]
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if layout == "rank" and combine in (None, "pull"):
        return BY_NAME[layout]
    if combine not in COMBINE_ALGORITHMS:
        raise ValueError(f"combine algorithm must be one of {sorted(COMBINE_ALGORITHMS)}, got {combine!r}")
    return BY_NAME[f"{layout}+{combine}"]


def runs(name: str) -> Callable[[Any], bool]:
    """configuration -> whether it can run variant ``name`` (a buffer's ``needed``)."""
    return BY_NAME[name].runs


def _steps(kernels_of: Callable[[Variant], tuple[str, ...]], key: Callable[[Variant], Any]) -> tuple:
    """((key, kernels), ...) of one step over the variants, each distinct key once in declaration order
    (variants that share a step share its launch site)."""
    seen: dict[Any, tuple[str, ...]] = {}
    for v in VARIANTS:
        if seen.setdefault(key(v), kernels_of(v)) != kernels_of(v):
            raise ValueError(f"variants with key {key(v)} launch different kernels in one step")
    return tuple(seen.items())


LAYOUT_STEP = _steps(lambda v: v.layout_kernels, lambda v: v.layout)
DISPATCH_STEP = _steps(lambda v: v.dispatch_kernels, lambda v: v.layout)
COMBINE_STEP = _steps(lambda v: v.combine_kernels, lambda v: (v.layout, v.combine))
# (layout, combine) of the variants whose combine reads the caller's y itself (no staging kernel first)
READS_Y = tuple((v.layout, v.combine) for v in VARIANTS if v.reads_y)
