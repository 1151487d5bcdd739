"""FP8 dispatch in the rank receive layout (``dispatch(..., fp8=True, layout="rank")``) on real GPUs: the
CuTe kernels against the independent all_to_all_single backend (NCCL) and the torch reference, bit for bit.

The kernel quantizes each token once into its packed FP8 row and sends those bytes to the token's row on
every destination rank (``cfg.fp8_row_bytes`` apart in ``recv_x``'s memory); rows, local ids, weights and
source tags are those of the rank layout without FP8. Checked on a poisoned buffer (a row the kernels
never wrote cannot pass), synced and sync-free, in both modes: the e4m3 values (as bytes), the scales,
the local ids and weights, the source tags, tokens per expert, the handle's rows and the rank combine of the
caller's rows (computed from the dequantized rows) equal the all-to-all backend's; the packed rows in the
kernel's receive buffer (values, scales, zero padding) equal every sender's rows quantized by
``cute_ep.fp8`` and placed by ``reference_dispatch_rank_layout``.
"""

from __future__ import annotations

import pytest
import torch
from test_a2a_vs_kernels import _setup  # tests/gpu is on sys.path: the same config and inputs

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.buffer import EpBuffer
from cute_ep.collectives import all_gather_objects
from cute_ep.fp8 import dequantize_fp8, pack_fp8_rows, quantize_fp8
from cute_ep.reference import reference_dispatch_rank_layout, reference_rank_layout

pytestmark = pytest.mark.gpu

# (dtype, hidden, topk, experts per rank, tokens by rank % 4, routing)
CASES = [
    (torch.bfloat16, 7168, 8, 16, (128, 96, 0, 64), "uniform"),
    (torch.float32, 256, 3, 3, (33, 0, 17, 5), "dropped"),
]
IDS = [f"{str(c[0]).removeprefix('torch.')}-h{c[1]}-k{c[2]}-{c[5]}" for c in CASES]
# One placement of the layout is tested here (folded into the dispatch: every case has at most 128
# tokens); test_a2a_vs_kernels varies it.


def _caller_rows(res, n: int, dtype: torch.dtype) -> torch.Tensor:
    """What an expert rank hands combine in the rank layout: one row per received row, here the
    dequantized row (cast to the row dtype) scaled by the sum of its local weights."""
    rows = dequantize_fp8(res.recv_x[:n], res.recv_scales[:n])
    scale = res.recv_topk_weights[:n].sum(dim=1, keepdim=True)
    return (rows.to(dtype).float() * scale).to(dtype)


def _run_rank_layout_fp8(buf, x, idx, w, *, sync=True, mode="scatter"):
    cfg = buf.cfg
    res = buf.dispatch(x, idx, w, mode=mode, fp8=True, layout="rank", sync=sync)
    n = int(res.recv_count.item())
    rows = n if sync else cfg.rank_capacity
    assert res.num_recv == rows and res.recv_weights is None
    assert res.recv_x.dtype == torch.float8_e4m3fn and tuple(res.recv_x.shape) == (rows, cfg.hidden)
    assert res.recv_scales.dtype == torch.float32 and tuple(res.recv_scales.shape) == (rows, cfg.fp8_scales)
    if rows:
        assert res.recv_x.stride() == (cfg.fp8_row_bytes, 1)  # packed rows, fp8_row_bytes apart
    y = buf.expert_output(n)
    y.copy_(_caller_rows(res, n, cfg.dtype))
    out = buf.combine(y, res.handle)
    torch.cuda.synchronize()
    rows_of = {name: getattr(res, name)[:n] for name in ("recv_scales", "recv_topk_idx", "recv_topk_weights",
                                                          "recv_src")}
    return {
        "recv_x": res.recv_x[:n].view(torch.uint8).clone(),  # the e4m3 values as bytes (exact compare)
        **{name: t.clone() for name, t in rows_of.items()},
        "tokens_per_expert": res.tokens_per_expert.clone(), "scatter": res.handle.scatter.clone(), "out": out,
        "num_recv": torch.tensor([n]),
    }  # fmt: skip


def _assert_same(got, want, what):
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fp8_rank_layout_matches_all_to_all_and_reference(runtime, case):
    cfg, rank, (x, idx, w) = _setup(runtime, case, 4545)
    with EpBuffer(runtime, cfg, registry=runtime.registry) as kern, A2aEpBuffer(runtime, cfg) as a2a:
        kern.poison()
        got = _run_rank_layout_fp8(kern, x, idx, w)
        n = int(got["num_recv"][0])
        packed = kern.fp8_packed_rows(n).cpu()  # the kernel's bytes: values, scales and zero padding
        want = _run_rank_layout_fp8(a2a, x, idx, w)
        _assert_same(got, want, f"rank {rank}")
        kern.poison()  # the sync-free call: worst-case views, the count on the device, the same rows
        _assert_same(_run_rank_layout_fp8(kern, x, idx, w, sync=False), want, f"rank {rank} without sync")
        kern.poison()  # atomic mode changes nothing in this layout (its order is fixed)
        _assert_same(_run_rank_layout_fp8(kern, x, idx, w, mode="atomic"), want, f"rank {rank} atomic")
        plain = kern.dispatch(x, idx, w, layout="rank")  # without FP8: the same rows, ids, weights, tags
        assert plain.num_recv == n and plain.recv_scales is None
        for name in ("recv_topk_idx", "recv_topk_weights", "recv_src"):
            assert torch.equal(getattr(plain, name), want[name]), f"rank {rank}: {name} differs without fp8"
        assert torch.equal(plain.tokens_per_expert, want["tokens_per_expert"])

    gathered = all_gather_objects((x.cpu(), idx.cpu(), w.cpu()), runtime.cpu_group)
    xs, idxs, ws = zip(*gathered, strict=True)
    sent = [pack_fp8_rows(*quantize_fp8(v), cfg.fp8_row_bytes) for v in xs]
    expected = reference_dispatch_rank_layout(sent, idxs, ws, reference_rank_layout(idxs, cfg.num_experts),
                                              cfg.max_tokens, rank)
    assert torch.equal(packed, expected.recv_x), f"rank {rank}: packed FP8 rows vs reference"
    for name in ("recv_topk_idx", "recv_topk_weights", "recv_src", "tokens_per_expert"):
        assert torch.equal(got[name].cpu(), getattr(expected, name)), f"rank {rank}: {name} vs reference"
