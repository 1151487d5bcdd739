"""The committed baselines agree with the torch reference, bit for bit.

Each baselines/*.npz holds every rank's inputs and outputs of one run of
scripts/dispatch_and_combine.py (scatter mode, first iteration). Here the inputs are regenerated from
the recorded seed and configuration, and layout, dispatch, the test expert and combine are recomputed
with cute_ep.reference; every stored array must match exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cute_ep.inputs import make_inputs
from cute_ep.reference import (
    reference_combine,
    reference_dispatch,
    reference_expert_outputs,
    reference_layout,
)
from cute_ep.validators.baseline import load_baseline

BASELINES = sorted((Path(__file__).resolve().parents[1] / "baselines").glob("*.npz"))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(view), b.view(view))
    return torch.equal(a, b)


def test_baselines_are_committed():
    names = {p.name for p in BASELINES}
    assert {"ep4_l4_bf16.npz", "ep4_l4_fp32.npz", "ep4_l2_bf16.npz", "ep4_l2_fp32.npz"} <= names


@pytest.mark.parametrize("path", BASELINES, ids=[p.stem for p in BASELINES])
def test_baseline_matches_reference(path):
    base = load_baseline(path)
    meta, cfg = base.meta, base.meta["config"]
    world = meta["world_size"]
    dtype = getattr(torch, meta["dtype"])
    E, K, H, T = cfg["num_experts"], cfg["topk"], cfg["hidden"], cfg["num_tokens"]
    assert cfg["mode"] == "scatter"

    inputs = [make_inputs(r, T, H, E, K, dtype, meta["seed"], routing=cfg["routing"]) for r in range(world)]
    xs, idxs, ws = zip(*inputs, strict=True)
    layout = reference_layout(list(idxs), E)
    dispatched = reference_dispatch(list(xs), list(idxs), list(ws), layout, cfg["max_tokens"])
    recv_y = reference_expert_outputs(dispatched, layout)
    outs = reference_combine(recv_y, list(idxs), list(ws), layout.scatter, num_experts=E)

    expected = {}
    for r in range(world):
        expected.update({
            f"rank{r}/x": xs[r],
            f"rank{r}/topk_idx": idxs[r],
            f"rank{r}/topk_weights": ws[r],
            f"rank{r}/recv_x": dispatched[r].recv_x,
            f"rank{r}/recv_w": dispatched[r].recv_w,
            f"rank{r}/recv_src": dispatched[r].recv_src,
            f"rank{r}/tokens_per_expert": layout.tokens_per_expert[r].to(torch.int32),
            f"rank{r}/combine_out": outs[r],
        })
    assert sorted(base.arrays) == sorted(expected)
    for key, want in expected.items():
        got = base.arrays[key]
        want = want.to(got.dtype) if key.endswith(("topk_idx", "tokens_per_expert")) else want
        assert _same_bits(got, want), f"{path.name}: {key} differs from the reference"
