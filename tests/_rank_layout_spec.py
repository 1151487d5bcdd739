"""The rank layout (``dispatch(..., layout="rank")``) written as literally as the specification reads:
Python loops over source ranks, tokens and k, one row at a time. The tests compare the library's
references (``cute_ep.reference.reference_*_rank_layout``) and both host backends with this, so a
vectorised formula that drifts from the words cannot pass by agreeing with itself.

Not a test module (the leading underscore keeps pytest from collecting it); test files and torchrun
workers import it as ``from _rank_layout_spec import ...``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cute_ep.fp8 import pack_fp8_rows, quantize_fp8


@dataclass
class SpecRecv:
    """What destination ``dst`` receives, and where every (source s, token t, k) of every source lands."""

    recv_x: Tensor  # [N, H]
    recv_topk_idx: Tensor  # [N, K] int32
    recv_topk_weights: Tensor  # [N, K] fp32
    recv_src: Tensor  # [N] int32
    tokens_per_expert: Tensor  # [El] int32


def spec_dispatch(xs: Sequence[Tensor], idxs: Sequence[Tensor], ws: Sequence[Tensor], *, num_experts: int,
                  max_tokens: int, dst: int) -> SpecRecv:
    """One row per (s, t) such that some topk_idx_s[t, k] is owned by ``dst`` (e // El == dst), s
    ascending, then t ascending."""
    world = len(xs)
    el = num_experts // world
    k_top = idxs[0].shape[1]
    rows, ids, wts, src = [], [], [], []
    tpe = [0] * el
    for s in range(world):
        for t in range(xs[s].shape[0]):
            mine = [int(e) >= 0 and int(e) // el == dst for e in idxs[s][t].tolist()]
            if not any(mine):
                continue
            rows.append(xs[s][t])
            ids.append([int(idxs[s][t, k]) - dst * el if mine[k] else -1 for k in range(k_top)])
            wts.append([float(ws[s][t, k]) if mine[k] else 0.0 for k in range(k_top)])
            src.append(s * max_tokens + t)
            for k in range(k_top):
                if mine[k]:
                    tpe[int(idxs[s][t, k]) - dst * el] += 1
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    return SpecRecv(
        recv_x=torch.stack(rows) if rows else torch.empty(0, hidden, dtype=dtype),
        recv_topk_idx=torch.tensor(ids, dtype=torch.int32).view(-1, k_top),
        recv_topk_weights=torch.tensor(wts, dtype=torch.float32).view(-1, k_top),
        recv_src=torch.tensor(src, dtype=torch.int32),
        tokens_per_expert=torch.tensor(tpe, dtype=torch.int32),
    )


def spec_fp8_rows(x: Tensor, row_bytes: int) -> Tensor:
    """[T, row_bytes] uint8: what an FP8 dispatch sends of each token of ``x``, each quantized on its own
    (``cute_ep.fp8.quantize_fp8`` of that one row) and packed (values, scales, zero padding). Given to
    ``spec_dispatch`` in x's place, they are the packed rows an FP8 rank-layout dispatch must deliver."""
    rows = [pack_fp8_rows(*quantize_fp8(x[t : t + 1]), row_bytes) for t in range(x.shape[0])]
    return torch.cat(rows) if rows else torch.zeros(0, row_bytes, dtype=torch.uint8)


def spec_scatter(idxs: Sequence[Tensor], *, num_experts: int, src: int) -> Tensor:
    """[T, K] int32 of source ``src``: the row of token t on the rank owning topk_idx[t, k], -1 for -1."""
    world = len(idxs)
    el = num_experts // world
    out = torch.full(tuple(idxs[src].shape), -1, dtype=torch.int32)
    for d in range(world):
        row = 0
        for s in range(world):
            for t in range(idxs[s].shape[0]):
                owners = [int(e) // el for e in idxs[s][t].tolist() if int(e) >= 0]
                if d not in owners:
                    continue
                if s == src:
                    for k, e in enumerate(idxs[s][t].tolist()):
                        if int(e) >= 0 and int(e) // el == d:
                            out[t, k] = row
                row += 1
    return out


def spec_combine(ys: Sequence[Tensor], idx: Tensor, scatter: Tensor, *, num_experts: int) -> Tensor:
    """out[t] = dtype(0.0 + y_r0[row] + y_r1[row] + ...) over t's destination ranks r ascending, each add
    in fp32; zeros for a token without destination."""
    world = len(ys)
    el = num_experts // world
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    out = torch.empty(idx.shape[0], hidden, dtype=dtype)
    for t in range(idx.shape[0]):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for r in range(world):
            ks = [k for k, e in enumerate(idx[t].tolist()) if int(e) >= 0 and int(e) // el == r]
            if ks:
                acc = acc + ys[r][int(scatter[t, ks[0]])].float()
        out[t] = acc.to(dtype)
    return out


def caller_expert(recv_x: Tensor, recv_topk_idx: Tensor, recv_topk_weights: Tensor, rank: int,
                  experts_per_rank: int) -> Tensor:
    """What a caller hands the rank-layout combine: each row already reduced over this rank's experts
    and weighted, y[i] = dtype(sum over k with a local id of w[i, k] * (global expert + 1) * x[i]) in
    fp32 (a row sent to the wrong rank or expert comes back scaled wrongly)."""
    valid = recv_topk_idx >= 0
    scale = torch.where(valid, recv_topk_weights * (recv_topk_idx + rank * experts_per_rank + 1).float(),
                        torch.zeros_like(recv_topk_weights)).sum(dim=1)
    return (recv_x.float() * scale[:, None]).to(recv_x.dtype)


def rank0_routing(num_tokens: int, topk: int, experts_per_rank: int, seed: int) -> Tensor:
    """[T, K] int64: every token names K distinct experts of rank 0 (needs K <= El): all rows go to rank 0."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(num_tokens, experts_per_rank, generator=g)
    return torch.argsort(noise, dim=1)[:, :topk].contiguous()


def assert_cases_cover_skew_ragged_empty_full(results: Sequence[dict], names: Sequence[str],
                                              prefix: str = "") -> None:
    """The gloo worker's cases (``names``, in order, each ``prefix`` + its base name) received what they are
    for: the skewed case only on rank 0, the full case every row on every rank, the empty case nothing,
    the ragged case something while a rank sent nothing."""
    by_case = {name: [res["cases"][i] for res in results] for i, name in enumerate(names)}
    skew = by_case[f"{prefix}rank0-bf16-k2-el4-skew"]
    assert all(n > 0 for n in skew[0]["num_recv"]) and all(n == 0 for c in skew[1:] for n in c["num_recv"])
    full = by_case[f"{prefix}everyone-bf16-full"]  # every token of every rank reaches every rank
    assert all(n == c["rank_capacity"] for c in full for n in c["num_recv"])
    assert all(n == 0 for c in by_case[f"{prefix}uniform-bf16-k2-el2-empty"] for n in c["num_recv"])
    ragged = by_case[f"{prefix}uniform-bf16-k4-el2-ragged"]
    assert sum(sum(c["num_recv"]) for c in ragged) > 0 and 0 in [t for c in ragged for t in c["sent"]]
