"""Pure-torch references for the expert-parallel dispatch and combine (all ranks' data at once).

These functions define what the kernels must produce (docs/design.md,
"Receive layout"). They run on CPU (or any device the inputs live on) over the inputs of every rank,
so a test or a distributed check can compute any rank's expected receive buffers.

Conventions (R ranks, E experts, El = E // R experts per rank, K = top-k, M = max tokens per rank):
  owner(e) = e // El, local expert l = e % El.
  count[s][e] = pairs (t, k) on source rank s routed to expert e (dropped -1 pairs not counted).
  On destination d, local expert l: the rows of all sources back to back (source 0's, then 1's...);
  within (l, s) the source's (t, k) row-major order. offsets[d][l][s] is the first slot of (l, s).
  Source tag: (src_rank * M + token) * K + k, as int32.
  Combine: fp32 acc = 0; for k ascending (skipping -1): acc = acc + (w * y.float()), the product
  rounded to fp32 first, then the add (no fused multiply-add); cast to the input dtype (RNE).
  Reduced combine: the same sum per (token, expert rank) group, rounded to the input dtype, then the
  partials summed in fp32 in the order of each group's first k, and cast (reference_combine_reduced).

Rank layout (``dispatch(..., layout="rank")``, DeepEP's; reference_rank_layout,
reference_dispatch_rank_layout, reference_combine_rank_layout):
  Destination d receives one row per (source s, token t of s) with at least one id owned by d,
  s ascending, then t ascending; recv_src = s * M + t; recv_topk_idx[row, k] = the local id
  (e - d * El) where topk_idx_s[t, k] = e is owned by d, else -1; recv_topk_weights the weight there,
  else 0.0. Combine: out[t] = the sum over t's destination ranks r ascending of y_r[row of t on r],
  fp32 from 0.0, cast once; zeros for a token without destination; no weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import overload

import torch
from torch import Tensor

__all__ = [
    "COMBINE_REFERENCES",
    "INT32_MAX",
    "ExpectedRankRecv",
    "ExpectedRecv",
    "Layout",
    "RankLayout",
    "apply_test_expert",
    "combine_reduced_rows",
    "global_expert_of_rows",
    "local_expert_of_rows",
    "pack_source",
    "reference_combine",
    "reference_combine_rank_layout",
    "reference_combine_reduced",
    "reference_dispatch",
    "reference_dispatch_rank",
    "reference_dispatch_rank_layout",
    "reference_expert_outputs",
    "reference_layout",
    "reference_rank_layout",
    "unpack_source",
]

INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Source tags
# --------------------------------------------------------------------------------------------


def _range_of(v: int | Tensor) -> tuple[int, int] | None:
    """(min, max) of an int or a tensor; None for an empty tensor."""
    if isinstance(v, Tensor):
        if v.numel() == 0:
            return None
        return int(v.min().item()), int(v.max().item())
    return int(v), int(v)


@overload
def pack_source(src_rank: int, token: int, k: int, max_tokens: int, topk: int) -> int: ...
@overload
def pack_source(
    src_rank: int | Tensor, token: int | Tensor, k: int | Tensor, max_tokens: int, topk: int
) -> Tensor: ...


def pack_source(
    src_rank: int | Tensor, token: int | Tensor, k: int | Tensor, max_tokens: int, topk: int
) -> int | Tensor:
    """Pack (source rank, token, k) into the int32 source tag ``(src_rank * max_tokens + token) * topk + k``.

    Args:
        src_rank: source rank, an int or an integer tensor (any shape broadcastable with the others).
        token: token index on the source rank, in [0, max_tokens); int or integer tensor.
        k: top-k position, in [0, topk); int or integer tensor.
        max_tokens: M, the most tokens per rank the buffers were built for (int >= 1).
        topk: K, the number of experts per token (int >= 1).

    Returns:
        A Python int when all of src_rank, token, k are ints, else an int32 tensor of the broadcast shape.

    Raises:
        ValueError: a value is out of range or the tag does not fit in int32 (the message names the values).
    """
    if max_tokens < 1 or topk < 1:
        raise ValueError(f"pack_source: max_tokens ({max_tokens}) and topk ({topk}) must be >= 1")
    for name, v, hi in (("src_rank", src_rank, None), ("token", token, max_tokens), ("k", k, topk)):
        r = _range_of(v)
        if r is None:
            continue
        if r[0] < 0 or (hi is not None and r[1] >= hi):
            bound = f"[0, {hi})" if hi is not None else ">= 0"
            raise ValueError(f"pack_source: {name} must be {bound}, got range [{r[0]}, {r[1]}]")
    rank_range = _range_of(src_rank)
    if rank_range is not None:
        # The largest tag this rank range can produce (token = M-1, k = K-1): check it fits int32.
        worst = (rank_range[1] * max_tokens + max_tokens - 1) * topk + topk - 1
        if worst > INT32_MAX:
            raise ValueError(
                f"pack_source: tag (src_rank={rank_range[1]}, max_tokens={max_tokens}, topk={topk}) "
                f"can reach "
                f"{worst}, which exceeds int32 max {INT32_MAX}"
            )
    if not any(isinstance(v, Tensor) for v in (src_rank, token, k)):
        return (int(src_rank) * max_tokens + int(token)) * topk + int(k)
    # int64 arithmetic first: the intermediate products are only known to fit after the check above.
    s = torch.as_tensor(src_rank, dtype=torch.int64)
    t = torch.as_tensor(token, dtype=torch.int64)
    kk = torch.as_tensor(k, dtype=torch.int64)
    return ((s * max_tokens + t) * topk + kk).to(torch.int32)


@overload
def unpack_source(tag: int, max_tokens: int, topk: int) -> tuple[int, int, int]: ...
@overload
def unpack_source(tag: Tensor, max_tokens: int, topk: int) -> tuple[Tensor, Tensor, Tensor]: ...


def unpack_source(
    tag: int | Tensor, max_tokens: int, topk: int
) -> tuple[int, int, int] | tuple[Tensor, Tensor, Tensor]:
    """Invert :func:`pack_source`.

    Args:
        tag: a source tag (int) or an integer tensor of tags (any shape, int32 or int64).
        max_tokens: M used when packing (int >= 1).
        topk: K used when packing (int >= 1).

    Returns:
        (src_rank, token, k): ints for an int tag, else three int64 tensors of tag's shape.
        Negative tags (e.g. a -1 poison) give a negative rank.
    """
    if max_tokens < 1 or topk < 1:
        raise ValueError(f"unpack_source: max_tokens ({max_tokens}) and topk ({topk}) must be >= 1")
    if isinstance(tag, Tensor):
        t64 = tag.to(torch.int64)
        return t64 // (max_tokens * topk), (t64 // topk) % max_tokens, t64 % topk
    tag = int(tag)
    return tag // (max_tokens * topk), (tag // topk) % max_tokens, tag % topk


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


@dataclass
class _Routing:
    """The shape of one routing over all ranks, validated (:func:`_validate_topk`): what both receive
    layouts (:class:`Layout`, :class:`RankLayout`) start with.

    Attributes:
        num_experts: E.
        world_size: R.
        topk: K.
    """

    num_experts: int
    world_size: int
    topk: int

    @property
    def experts_per_rank(self) -> int:
        """El = E // R."""
        return self.num_experts // self.world_size


@dataclass
class Layout(_Routing):
    """The expert-major receive layout of one routing over all ranks.

    Attributes (besides num_experts E, world_size R and topk K, from :class:`_Routing`):
        counts: [R_src, E] int64, count[s][e] = pairs on source s routed to expert e.
        tokens_per_expert: [R_dst, El] int64, rows each destination receives per local expert.
        offsets: [R_dst, El, R_src] int64, first slot of (local expert l, source s) on destination d.
        num_recv: [R_dst] int64, rows each destination receives.
        scatter: per source rank s, [T_s, K] int64: the slot of (t, k) in owner(topk_idx[t, k])'s
            receive buffer, -1 for dropped pairs.
    """

    counts: Tensor
    tokens_per_expert: Tensor
    offsets: Tensor
    num_recv: Tensor
    scatter: list[Tensor] = field(default_factory=list)

    def owner(self, expert: int | Tensor) -> int | Tensor:
        """Rank owning global expert id(s) ``expert`` (int or integer tensor): expert // El."""
        return expert // self.experts_per_rank

    def local_expert(self, expert: int | Tensor) -> int | Tensor:
        """Local index on the owner of global expert id(s) ``expert``: expert % El."""
        return expert % self.experts_per_rank

    def group_range(self, dst: int, local_expert: int, src: int) -> tuple[int, int]:
        """[start, end) slots of the rows source ``src`` sends to ``local_expert`` on ``dst``."""
        start = int(self.offsets[dst, local_expert, src])
        n = int(self.counts[src, dst * self.experts_per_rank + local_expert])
        return start, start + n

    def group_sizes(self, dst: int) -> Tensor:
        """[El * R] rows of each (local expert l, source s) group on ``dst``, in slot order (l-major)."""
        world = self.world_size
        return self.counts.view(world, world, self.experts_per_rank)[:, dst, :].t().reshape(-1)


def _validate_topk(topk_idx: Sequence[Tensor], num_experts: int) -> _Routing:
    """Check the routing of all ranks; return its shape (E, R, K)."""
    world = len(topk_idx)
    if world < 1:
        raise ValueError("topk_idx must hold one tensor per rank (got an empty sequence)")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts % world != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the world size ({world})")
    ks = set()
    for s, idx in enumerate(topk_idx):
        if idx.dim() != 2:
            raise ValueError(f"topk_idx[{s}] must be 2-D [T, K], got shape {tuple(idx.shape)}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"topk_idx[{s}] must be an integer tensor (int64/int32), got {idx.dtype}")
        ks.add(idx.shape[1])
        if idx.numel():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -1 or hi >= num_experts:
                raise ValueError(
                    f"topk_idx[{s}] ids must be in [-1, {num_experts}) (num_experts={num_experts}), "
                    f"got range [{lo}, {hi}]"
                )
    if len(ks) != 1:
        raise ValueError(f"all ranks must use the same topk K, got K values {sorted(ks)}")
    k = ks.pop()
    if k < 1:
        raise ValueError("topk K must be >= 1 (topk_idx has 0 columns)")
    return _Routing(num_experts=num_experts, world_size=world, topk=k)


def reference_layout(topk_idx: Sequence[Tensor], num_experts: int) -> Layout:
    """Compute counts, offsets and every pair's slot for the routing of all ranks.

    Args:
        topk_idx: one tensor per rank s, [T_s, K] int64 or int32, ids in [-1, E) (-1 = dropped).
            T_s may differ between ranks and may be 0.
        num_experts: E, divisible by R = len(topk_idx).

    Returns:
        The :class:`Layout` (on the device of topk_idx[0]).

    Raises:
        ValueError: E not divisible by R, ids outside [-1, E), K differing between ranks, bad shapes.
    """
    routing = _validate_topk(topk_idx, num_experts)
    world, el = routing.world_size, routing.experts_per_rank
    device = topk_idx[0].device
    counts = torch.zeros(world, num_experts, dtype=torch.int64, device=device)
    flat_ids = []
    for s, idx in enumerate(topk_idx):
        ids = idx.reshape(-1).to(torch.int64)
        # Dropped pairs go to a virtual expert E so they sort last and are not counted.
        ids = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
        flat_ids.append(ids)
        counts[s] = torch.bincount(ids, minlength=num_experts + 1)[:num_experts]

    # [R_src, R_dst, El] -> [R_dst, El, R_src]: per destination, the groups in l-major order.
    groups = counts.view(world, world, el).permute(1, 2, 0).reshape(world, el * world)
    offsets = (torch.cumsum(groups, dim=1) - groups).view(world, el, world)
    tokens_per_expert = counts.sum(dim=0).view(world, el)
    num_recv = tokens_per_expert.sum(dim=1)

    scatter = []
    for s, ids in enumerate(flat_ids):
        n = ids.numel()
        # A stable sort by expert keeps (t, k) row-major order inside each expert, so a pair's
        # position in the sorted order minus its expert's first position is its index in the group.
        order = torch.sort(ids, stable=True).indices
        start = torch.cumsum(counts[s], 0) - counts[s]
        start = torch.cat([start, start.new_tensor([0])])  # virtual expert E: value unused
        within_sorted = torch.arange(n, device=device) - start[ids[order]]
        within = torch.empty_like(within_sorted)
        within[order] = within_sorted
        valid = ids < num_experts
        e = ids.clamp(max=num_experts - 1)
        slot = offsets[e // el, e % el, s] + within
        slot = torch.where(valid, slot, torch.full_like(slot, -1))
        scatter.append(slot.view(topk_idx[s].shape))

    return Layout(
        **asdict(routing),
        counts=counts,
        tokens_per_expert=tokens_per_expert,
        offsets=offsets,
        num_recv=num_recv,
        scatter=scatter,
    )


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


@dataclass
class _ExpectedRows:
    """What the expected receive buffers of both layouts (:class:`ExpectedRecv`,
    :class:`ExpectedRankRecv`) start with: the token rows, whose count is the rows received.

    Attributes:
        recv_x: [num_recv, H], the input dtype: the token rows.
    """

    recv_x: Tensor

    @property
    def num_recv(self) -> int:
        return int(self.recv_x.shape[0])


@dataclass
class ExpectedRecv(_ExpectedRows):
    """Expected receive buffers of one destination rank (exactly num_recv rows, no tail).

    Attributes:
        recv_x: [num_recv, H], the input dtype: the token rows.
        recv_w: [num_recv] float32: the routing weight of each row.
        recv_src: [num_recv] int32: the packed (source rank, token, k) of each row.
    """

    recv_w: Tensor
    recv_src: Tensor


def _check_one_per_rank(
    x: Sequence[Tensor], topk_idx: Sequence[Tensor], topk_weights: Sequence[Tensor], world: int
) -> None:
    """The dispatch references' first check: one x, topk_idx and topk_weights per rank."""
    if not (len(x) == len(topk_idx) == len(topk_weights) == world):
        raise ValueError(
            f"need one x, topk_idx, topk_weights per rank (world size {world}), "
            f"got {len(x)}, {len(topk_idx)}, {len(topk_weights)}"
        )


def _check_weights_and_tokens(
    s: int, num_tokens: int, topk_weights: Sequence[Tensor], max_tokens: int
) -> None:
    """The dispatch references' checks of source rank ``s`` after its shapes: float32 weights, and no more
    than ``max_tokens`` tokens."""
    if topk_weights[s].dtype != torch.float32:
        raise ValueError(f"topk_weights[{s}] must be float32, got {topk_weights[s].dtype}")
    if num_tokens > max_tokens:
        raise ValueError(f"rank {s} has {num_tokens} tokens, more than max_tokens ({max_tokens})")


def _validate_dispatch_inputs(
    x: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    layout: Layout,
    max_tokens: int,
) -> None:
    world = layout.world_size
    _check_one_per_rank(x, topk_idx, topk_weights, world)
    hidden = {xs.shape[1] if xs.dim() == 2 else None for xs in x}
    dtypes = {xs.dtype for xs in x}
    if None in hidden or len(hidden) != 1:
        shapes = [tuple(a.shape) for a in x]
        raise ValueError(f"every x must be 2-D [T, H] with the same H, got shapes {shapes}")
    if len(dtypes) != 1:
        raise ValueError(f"every x must have the same dtype, got {sorted(map(str, dtypes))}")
    for s in range(world):
        t = x[s].shape[0]
        if tuple(topk_idx[s].shape) != (t, layout.topk):
            raise ValueError(f"topk_idx[{s}] shape {tuple(topk_idx[s].shape)} != (T={t}, K={layout.topk})")
        if tuple(topk_weights[s].shape) != (t, layout.topk):
            raise ValueError(
                f"topk_weights[{s}] shape {tuple(topk_weights[s].shape)} != (T={t}, K={layout.topk})"
            )
        _check_weights_and_tokens(s, t, topk_weights, max_tokens)
    # Every tag must fit int32: check the largest one once.
    pack_source(world - 1, max_tokens - 1, layout.topk - 1, max_tokens, layout.topk)


def reference_dispatch_rank(
    x: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    layout: Layout,
    max_tokens: int,
    dst: int,
) -> ExpectedRecv:
    """Expected receive buffers of destination rank ``dst`` (see :func:`reference_dispatch`)."""
    _validate_dispatch_inputs(x, topk_idx, topk_weights, layout, max_tokens)
    if not 0 <= dst < layout.world_size:
        raise ValueError(f"dst ({dst}) must be in [0, {layout.world_size})")
    k_total = layout.topk
    el = layout.experts_per_rank
    n = int(layout.num_recv[dst])
    hidden = x[0].shape[1]
    device = x[0].device
    recv_x = torch.empty(n, hidden, dtype=x[0].dtype, device=device)
    if recv_x.dtype.is_floating_point:
        recv_x.fill_(float("nan"))  # an unwritten row would show as NaN, never as valid data
    recv_w = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    recv_src = torch.full((n,), -1, dtype=torch.int32, device=device)
    for s in range(layout.world_size):
        ids = topk_idx[s].reshape(-1).to(torch.int64)
        mask = (ids >= 0) & (torch.div(ids, el, rounding_mode="floor") == dst)
        pair = torch.nonzero(mask).flatten()  # flat (t, k) row-major indices routed to dst
        slot = layout.scatter[s].reshape(-1)[pair].to(device)
        tok = pair // k_total
        kk = pair % k_total
        recv_x[slot] = x[s][tok.to(x[s].device)].to(device)
        recv_w[slot] = topk_weights[s].reshape(-1)[pair.to(topk_weights[s].device)].to(device)
        recv_src[slot] = pack_source(torch.full_like(tok, s), tok, kk, max_tokens, k_total).to(device)
    return ExpectedRecv(recv_x=recv_x, recv_w=recv_w, recv_src=recv_src)


def reference_dispatch(
    x: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    layout: Layout,
    max_tokens: int,
) -> list[ExpectedRecv]:
    """Expected receive buffers of every destination rank.

    Args:
        x: per source rank s, [T_s, H] (bf16 / fp16 / fp32; same dtype and H on every rank).
        topk_idx: per rank, [T_s, K] int64 or int32 in [-1, E).
        topk_weights: per rank, [T_s, K] float32.
        layout: :func:`reference_layout` of topk_idx.
        max_tokens: M, the most tokens per rank (>= every T_s); used for the source tags.

    Returns:
        One :class:`ExpectedRecv` per destination rank d with recv_x [num_recv_d, H] (x's dtype),
        recv_w [num_recv_d] float32, recv_src [num_recv_d] int32.
    """
    return [
        reference_dispatch_rank(x, topk_idx, topk_weights, layout, max_tokens, d)
        for d in range(layout.world_size)
    ]


# --------------------------------------------------------------------------------------------
# Rank layout (DeepEP's): one row per (source rank, token, destination rank)
# --------------------------------------------------------------------------------------------


@dataclass
class RankLayout(_Routing):
    """The rank-major receive layout (``layout="rank"``) of one routing over all ranks.

    Attributes (besides num_experts E, world_size R and topk K, from :class:`_Routing`):
        dest: per source rank s, [T_s, R] bool: token t names at least one expert owned by rank r.
        counts: [R_src, R_dst] int64: rows source s sends destination d (its tokens bound for d).
        offsets: [R_dst, R_src] int64: first row of source s's tokens on destination d.
        num_recv: [R_dst] int64: rows each destination receives.
        tokens_per_expert: [R_dst, El] int64: rows naming each local expert of each destination.
        scatter: per source rank s, [T_s, K] int64: the row of token t on owner(topk_idx[t, k]), the
            same for every k of t bound for one rank; -1 where the id is -1.
    """

    dest: list[Tensor]
    counts: Tensor
    offsets: Tensor
    num_recv: Tensor
    tokens_per_expert: Tensor
    scatter: list[Tensor]


def reference_rank_layout(topk_idx: Sequence[Tensor], num_experts: int) -> RankLayout:
    """Rows, offsets and every (token, k)'s row in the rank layout, for the routing of all ranks.

    Destination d's rows: one per (s, t) with ``dest[s][t, d]``, source s ascending, then t ascending;
    so the row of (s, t) on d is offsets[d, s] + the number of s's tokens before t bound for d.

    Args and Raises: those of :func:`reference_layout`. Returns the :class:`RankLayout` (on the device of
    topk_idx[0]).
    """
    routing = _validate_topk(topk_idx, num_experts)
    world, el = routing.world_size, routing.experts_per_rank
    device = topk_idx[0].device
    dest, owners = [], []
    counts = torch.zeros(world, world, dtype=torch.int64, device=device)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=device)
    for s, idx in enumerate(topk_idx):
        ids = idx.to(device=device, dtype=torch.int64)
        valid = ids >= 0
        # A -1 id goes to a virtual rank R / expert E, cut off below.
        owner = torch.where(valid, torch.div(ids, el, rounding_mode="floor"), world)
        to_rank = torch.zeros(ids.shape[0], world + 1, dtype=torch.bool, device=device)
        to_rank.scatter_(1, owner, True)
        to_expert = torch.zeros(ids.shape[0], num_experts + 1, dtype=torch.bool, device=device)
        to_expert.scatter_(1, torch.where(valid, ids, num_experts), True)
        dest.append(to_rank[:, :world])
        owners.append(owner)
        counts[s] = to_rank[:, :world].sum(dim=0)
        # A row names an expert if any of its k does (a token names an expert at most once).
        tokens_per_expert += to_expert[:, :num_experts].sum(dim=0)
    offsets = (torch.cumsum(counts, dim=0) - counts).t().contiguous()  # [dst, src]
    scatter = []
    for s, (d, owner) in enumerate(zip(dest, owners, strict=True)):
        # Row of (s, t) on r: offsets[r, s] + the tokens of s before t bound for r.
        row = offsets[:, s][None, :] + torch.cumsum(d.to(torch.int64), dim=0) - d.to(torch.int64)
        row = torch.cat([row, row.new_full((row.shape[0], 1), -1)], dim=1)  # virtual rank R: -1
        scatter.append(row.gather(1, owner))
    return RankLayout(
        **asdict(routing),
        dest=dest,
        counts=counts,
        offsets=offsets,
        num_recv=counts.sum(dim=0),
        tokens_per_expert=tokens_per_expert.view(world, el),
        scatter=scatter,
    )


@dataclass
class ExpectedRankRecv(_ExpectedRows):
    """Expected rank-layout receive buffers of one destination rank (exactly num_recv rows).

    Attributes:
        recv_x: [N, H], the input dtype: x_s[t] of every row (s ascending, then t).
        recv_topk_idx: [N, K] int32: local expert ids on this rank, -1 where the pair is not for it.
        recv_topk_weights: [N, K] float32: the pair's weight where recv_topk_idx >= 0, else 0.0.
        recv_src: [N] int32: s * max_tokens + t.
        tokens_per_expert: [El] int32: rows naming each local expert.
    """

    recv_topk_idx: Tensor
    recv_topk_weights: Tensor
    recv_src: Tensor
    tokens_per_expert: Tensor


def reference_dispatch_rank_layout(
    x: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    layout: RankLayout,
    max_tokens: int,
    dst: int,
) -> ExpectedRankRecv:
    """Expected rank-layout receive buffers of destination rank ``dst`` (``dispatch(...,
    layout="rank")``; see the module docstring).

    Args:
        x: per source rank s, [T_s, H] (bf16 / fp16 / fp32; same dtype and H on every rank).
        topk_idx: per rank, [T_s, K] int64 or int32 in [-1, E).
        topk_weights: per rank, [T_s, K] float32.
        layout: :func:`reference_rank_layout` of topk_idx.
        max_tokens: M (>= every T_s): recv_src = s * M + t.
        dst: the destination rank, in [0, R).

    Returns:
        :class:`ExpectedRankRecv` on x[0]'s device.

    Raises:
        ValueError: mismatched shapes or dtypes, a rank with more than max_tokens tokens, dst out of
            range, or R * M beyond int32.
    """
    world, k_total = layout.world_size, layout.topk
    _check_one_per_rank(x, topk_idx, topk_weights, world)
    hidden = {xs.shape[1] if xs.dim() == 2 else None for xs in x}
    if None in hidden or len(hidden) != 1 or len({xs.dtype for xs in x}) != 1:
        raise ValueError(
            f"every x must be 2-D [T, H] with the same H and dtype, got "
            f"{[(tuple(a.shape), str(a.dtype)) for a in x]}"
        )
    for s in range(world):
        t = x[s].shape[0]
        if tuple(topk_idx[s].shape) != (t, k_total) or tuple(topk_weights[s].shape) != (t, k_total):
            raise ValueError(
                f"rank {s}: topk_idx {tuple(topk_idx[s].shape)} and topk_weights "
                f"{tuple(topk_weights[s].shape)} must be (T={t}, K={k_total})"
            )
        _check_weights_and_tokens(s, t, topk_weights, max_tokens)
    if world * max_tokens - 1 > INT32_MAX:
        raise ValueError(f"recv_src s * M + t must fit int32: R={world}, M={max_tokens}")
    if not 0 <= dst < world:
        raise ValueError(f"dst ({dst}) must be in [0, {world})")
    el = layout.experts_per_rank
    device = x[0].device
    parts_x, parts_idx, parts_w, parts_src = [], [], [], []
    for s in range(world):
        tok = torch.nonzero(layout.dest[s][:, dst]).flatten().to(device)  # ascending t
        ids = topk_idx[s].to(device=device, dtype=torch.int64)[tok]
        mine = (ids >= 0) & (torch.div(ids, el, rounding_mode="floor") == dst)
        parts_x.append(x[s].to(device)[tok])
        parts_idx.append(torch.where(mine, ids - dst * el, -1).to(torch.int32))
        w = topk_weights[s].to(device)[tok]
        parts_w.append(torch.where(mine, w, torch.zeros_like(w)))  # +0.0 where the pair is not here
        parts_src.append((s * max_tokens + tok).to(torch.int32))
    return ExpectedRankRecv(
        recv_x=torch.cat(parts_x),
        recv_topk_idx=torch.cat(parts_idx),
        recv_topk_weights=torch.cat(parts_w),
        recv_src=torch.cat(parts_src),
        tokens_per_expert=layout.tokens_per_expert[dst].to(device=device, dtype=torch.int32),
    )


# --------------------------------------------------------------------------------------------
# Test expert
# --------------------------------------------------------------------------------------------


def apply_test_expert(rows: Tensor, global_expert: Tensor) -> Tensor:
    """The non-identity expert of the tests: y = rows * (global_expert + 1), computed in rows' dtype.

    A row delivered to the wrong expert comes back scaled wrongly. The product of two bf16/fp16
    values is exact in fp32, so the single rounding to the dtype matches a GPU multiply bit for bit.

    Args:
        rows: [N, H] floating (bf16 / fp16 / fp32).
        global_expert: [N] integer, the global expert id of each row.

    Returns:
        [N, H] in rows' dtype.
    """
    if rows.dim() != 2 or global_expert.shape != (rows.shape[0],):
        raise ValueError(
            f"rows must be [N, H] and global_expert [N], "
            f"got {tuple(rows.shape)} and {tuple(global_expert.shape)}"
        )
    scale = (global_expert.to(torch.int64) + 1).to(rows.dtype).to(rows.device)
    return rows * scale[:, None]


def local_expert_of_rows(tokens_per_expert: Tensor) -> Tensor:
    """Local expert index of each received row (rows are expert-major).

    Args:
        tokens_per_expert: [El] integer, rows per local expert on one rank.

    Returns:
        [N] int64 with N = tokens_per_expert.sum(): row i's local expert.
    """
    if tokens_per_expert.dim() != 1:
        raise ValueError(f"tokens_per_expert must be 1-D [El], got shape {tuple(tokens_per_expert.shape)}")
    counts = tokens_per_expert.to(torch.int64)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


def global_expert_of_rows(tokens_per_expert: Tensor, rank: int) -> Tensor:
    """Global expert id of each row received on ``rank``.

    Args:
        tokens_per_expert: [El] integer, rows per local expert on ``rank``.
        rank: the receiving rank.

    Returns:
        [N] int64: rank * El + local expert.
    """
    return rank * tokens_per_expert.numel() + local_expert_of_rows(tokens_per_expert)


def reference_expert_outputs(dispatched: Sequence[ExpectedRecv], layout: Layout) -> list[Tensor]:
    """Apply :func:`apply_test_expert` to every rank's expected receive rows.

    Args:
        dispatched: per destination rank, its :class:`ExpectedRecv`.
        layout: the routing's :class:`Layout`.

    Returns:
        Per rank d, recv_y [num_recv_d, H] in recv_x's dtype.
    """
    return [
        apply_test_expert(r.recv_x, global_expert_of_rows(layout.tokens_per_expert[d], d).to(r.recv_x.device))
        for d, r in enumerate(dispatched)
    ]


# --------------------------------------------------------------------------------------------
# Combine
# --------------------------------------------------------------------------------------------


def _check_combine_args(
    recv_y: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    scatter: Sequence[Tensor],
    num_experts: int,
) -> tuple[torch.dtype, int]:
    """The checks shared by the combine references; returns (recv_y's dtype, H)."""
    world = len(recv_y)
    if world < 1:
        raise ValueError("recv_y must hold one tensor per rank (got an empty sequence)")
    if num_experts < 1 or num_experts % world != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be >= 1 and divisible by the world size ({world})"
        )
    if not (len(topk_idx) == len(topk_weights) == len(scatter)):
        raise ValueError(
            "topk_idx, topk_weights, scatter lengths differ: "
            f"{len(topk_idx)}, {len(topk_weights)}, {len(scatter)}"
        )
    dtype = recv_y[0].dtype
    hidden = recv_y[0].shape[1] if recv_y[0].dim() == 2 else -1
    for d, y in enumerate(recv_y):
        if y.dim() != 2 or y.shape[1] != hidden or y.dtype != dtype:
            raise ValueError(
                f"recv_y[{d}] must be [N, H={hidden}] of {dtype}, got {tuple(y.shape)} {y.dtype}"
            )
    if not dtype.is_floating_point:
        raise ValueError(f"recv_y must be floating point, got {dtype}")
    return dtype, hidden


def _combine_rank_args(
    s: int, idx: Tensor, w: Tensor, slots: Tensor, num_experts: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Check source rank ``s``'s routing; return (ids int64, weights, slots int64) on ``device``."""
    if idx.dim() != 2 or w.shape != idx.shape or slots.shape != idx.shape:
        raise ValueError(
            f"rank {s}: topk_idx {tuple(idx.shape)}, topk_weights {tuple(w.shape)}, scatter "
            f"{tuple(slots.shape)} must all be the same [T, K]"
        )
    if w.dtype != torch.float32:
        raise ValueError(f"rank {s}: topk_weights must be float32, got {w.dtype}")
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ValueError(f"rank {s}: topk_idx ids must be in [-1, {num_experts})")
    return (
        idx.to(device=device, dtype=torch.int64),
        w.to(device),
        slots.to(device=device, dtype=torch.int64),
    )


def _gather_combine_rows(
    recv_y: Sequence[Tensor], s: int, k: int, ids: Tensor, slots: Tensor, experts_per_rank: int
) -> Tensor:
    """[T, H] in recv_y's dtype: row ``recv_y[owner(ids[t])][slots[t]]`` of every (t, k), zeros where the
    id is -1. ``ids`` / ``slots``: column k of source rank ``s``'s routing (int64, [T])."""
    y = torch.zeros(ids.shape[0], recv_y[0].shape[1], dtype=recv_y[0].dtype, device=recv_y[0].device)
    valid = ids >= 0
    owner = torch.div(ids, experts_per_rank, rounding_mode="floor")
    for d in range(len(recv_y)):
        m = valid & (owner == d)
        if not bool(m.any()):
            continue
        sl = slots[m]
        if int(sl.min()) < 0 or int(sl.max()) >= recv_y[d].shape[0]:
            raise ValueError(
                f"rank {s}, k {k}: slot range [{int(sl.min())}, {int(sl.max())}] outside recv_y[{d}] "
                f"rows [0, {recv_y[d].shape[0]})"
            )
        y[m] = recv_y[d][sl]
    return y


@dataclass(frozen=True)
class _RankCombine:
    """One source rank's checked combine inputs (:func:`_combine_ranks`), on recv_y's device.

    Attributes:
        idx: [T_s, K] int64 global expert ids in [-1, E).
        w: [T_s, K] float32 weights.
        slots: [T_s, K] int64 slots on the owners (ignored where the id is -1).
        s: the source rank (for error messages).
        recv_y: every rank's expert outputs, as given to the reference.
        experts_per_rank: El = E // R.
        hidden: H.
        dtype: recv_y's dtype (that of the output).
    """

    idx: Tensor
    w: Tensor
    slots: Tensor
    s: int
    recv_y: Sequence[Tensor]
    experts_per_rank: int
    hidden: int
    dtype: torch.dtype

    def column(self, k: int) -> Tensor:
        """[T_s, H] in recv_y's dtype: the expert output of each (t, k) of column k, zeros where the id
        is -1 (:func:`_gather_combine_rows`)."""
        return _gather_combine_rows(
            self.recv_y, self.s, k, self.idx[:, k], self.slots[:, k], self.experts_per_rank
        )


def _combine_ranks(
    recv_y: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    scatter: Sequence[Tensor],
    num_experts: int,
) -> Iterator[_RankCombine]:
    """The argument handling both combine references share: check the arguments (their ``Raises``),
    then yield each entry of topk_idx's checked routing, in order.

    Lazy: rank s's routing is checked after rank s - 1's combine has run, as the caller consumes it.
    """
    dtype, hidden = _check_combine_args(recv_y, topk_idx, topk_weights, scatter, num_experts)
    el = num_experts // len(recv_y)
    device = recv_y[0].device
    for s, (idx, w, slots) in enumerate(zip(topk_idx, topk_weights, scatter, strict=True)):
        idx, w, slots = _combine_rank_args(s, idx, w, slots, num_experts, device)
        yield _RankCombine(idx, w, slots, s, recv_y, el, hidden, dtype)


def reference_combine(
    recv_y: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    scatter: Sequence[Tensor],
    *,
    num_experts: int,
) -> list[Tensor]:
    """Weighted sum of each token's expert outputs, in the fixed fp32 order the kernels follow.

    For each token: acc = zeros(H, fp32); for k ascending, skipping -1:
    ``acc = acc + (w * y.float())`` (the product rounded to fp32, then the add; no FMA), where
    y = recv_y[owner][slot]; finally cast to recv_y's dtype. All-dropped tokens give zeros.
    This is the "pull" combine algorithm (see :func:`reference_combine_reduced` for "reduced").

    Args:
        recv_y: per rank d (all R ranks), [N_d, H] expert outputs (bf16 / fp16 / fp32); N_d may
            exceed the rows received (only the slots read matter).
        topk_idx: per source rank to combine for, [T_s, K] int64/int32 in [-1, E). May cover fewer
            ranks than recv_y (e.g. only this rank's routing).
        topk_weights: matching [T_s, K] float32.
        scatter: matching [T_s, K] integer: the slot each (t, k) was written to (e.g. layout.scatter);
            ignored where topk_idx is -1.
        num_experts: E (owner(e) = e // (E // R) with R = len(recv_y)).

    Returns:
        Per entry of topk_idx, [T_s, H] in recv_y's dtype.

    Raises:
        ValueError: mismatched shapes/dtypes, E not divisible by R, a slot outside its owner's recv_y.
    """
    outs = []
    for r in _combine_ranks(recv_y, topk_idx, topk_weights, scatter, num_experts):
        n_tok, k_total = r.idx.shape
        acc = torch.zeros(n_tok, r.hidden, dtype=torch.float32, device=r.idx.device)
        for k in range(k_total):
            valid = r.idx[:, k] >= 0
            # Two separate fp32 ops: the product is rounded before the add, as in the kernels.
            prod = r.w[:, k][:, None] * r.column(k).float()
            summed = acc + prod
            acc = torch.where(valid[:, None], summed, acc)
        outs.append(acc.to(r.dtype))
    return outs


def combine_reduced_rows(
    rows: Tensor, topk_idx: Tensor, topk_weights: Tensor, *, experts_per_rank: int
) -> Tensor:
    """The "reduced" combine of one rank's tokens from their gathered expert outputs (both formulas of
    :func:`reference_combine_reduced`): shared by that reference and ``A2aEpBuffer.combine``.

    Group G(t, d): the k (ascending) with ``topk_idx[t, k] >= 0`` and owner ``topk_idx[t, k] //
    experts_per_rank == d``. Partial: ``p = zeros(H, fp32)``; for k in G(t, d) ascending,
    ``p = p + (w[t, k] * rows[t, k].float())`` (product rounded to fp32, then the add; no FMA); then p is
    rounded to rows' dtype. Output: ``acc = zeros(H, fp32)``; for the groups of t in the order of their
    smallest k, ``acc = acc + partial.float()``; finally cast to rows' dtype. Tokens without a valid id
    give zeros. Rows and weights of pairs whose id is -1 are never read (they may hold NaN).

    Works on any device without host syncs (no ``.item()``); loops over k0 <= k (K (K + 1) / 2 steps
    of [T, H] element-wise ops), so it needs no [T, K, H] fp32 temporary.

    Args:
        rows: [T, K, H] floating (bf16 / fp16 / fp32): the expert output of each (t, k).
        topk_idx: [T, K] integer (int32 / int64) global expert ids in [-1, E); -1 = dropped.
        topk_weights: [T, K] float32.
        experts_per_rank: El = E // R (>= 1): owner(e) = e // El.

    Returns:
        [T, H] in rows' dtype, on rows' device.

    Raises:
        ValueError: mismatched shapes, non-floating rows, non-integer ids, weights not float32, El < 1.
    """
    pairs = tuple(rows.shape[:2])
    if rows.dim() != 3 or tuple(topk_idx.shape) != pairs or tuple(topk_weights.shape) != pairs:
        raise ValueError(
            f"rows must be [T, K, H] and topk_idx, topk_weights [T, K], got {tuple(rows.shape)}, "
            f"{tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}"
        )
    if not rows.dtype.is_floating_point:
        raise ValueError(f"rows must be floating point, got {rows.dtype}")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise ValueError(f"topk_idx must be an integer tensor (int64/int32), got {topk_idx.dtype}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if experts_per_rank < 1:
        raise ValueError(f"experts_per_rank must be >= 1, got {experts_per_rank}")
    n_tok, k_total, hidden = rows.shape
    device = rows.device
    ids = topk_idx.to(device=device, dtype=torch.int64)
    w = topk_weights.to(device)
    valid = ids >= 0
    owner = torch.where(valid, torch.div(ids, experts_per_rank, rounding_mode="floor"), -1)
    # lead[t, k]: (t, k) is the first valid pair of its owner (no valid k' < k with the same owner).
    earlier = torch.ones(k_total, k_total, dtype=torch.bool, device=device).tril(-1)  # [k, k'], k' < k
    seen = (owner[:, :, None] == owner[:, None, :]) & valid[:, None, :] & earlier
    lead = valid & ~seen.any(dim=2)
    acc = torch.zeros(n_tok, hidden, dtype=torch.float32, device=device)
    for k0 in range(k_total):
        # The partial of the group whose first k is k0 (computed for every t; used where lead).
        part = torch.zeros(n_tok, hidden, dtype=torch.float32, device=device)
        for k in range(k0, k_total):
            member = valid[:, k] & (owner[:, k] == owner[:, k0])
            # Two separate fp32 ops: the product is rounded before the add, as in the kernels.
            prod = w[:, k][:, None] * rows[:, k].float()
            summed = part + prod
            part = torch.where(member[:, None], summed, part)
        # The partial travels in the row dtype: round it before the token's rank adds it.
        partial = part.to(rows.dtype).float()
        acc = torch.where(lead[:, k0][:, None], acc + partial, acc)
    return acc.to(rows.dtype)


def reference_combine_reduced(
    recv_y: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    topk_weights: Sequence[Tensor],
    scatter: Sequence[Tensor],
    *,
    num_experts: int,
) -> list[Tensor]:
    """The "reduced" combine: each expert rank sums a token's rows first, the token's rank sums the partials.

    For token t and rank d, the group G(t, d) holds the k (ascending) with topk_idx[t, k] >= 0 and
    owner(topk_idx[t, k]) == d. The partial of (t, d) is the pull formula of :func:`reference_combine`
    restricted to the group, rounded to recv_y's dtype: ``p = zeros(H, fp32)``; for k in G(t, d),
    ``p = p + (w * y.float())`` (the product rounded to fp32, then the add; no FMA), y =
    recv_y[d][slot]; partial = p cast to the dtype (RNE). Then ``acc = zeros(H, fp32)``; for the groups
    of t in the order of their first (smallest) k, ``acc = acc + partial.float()``; finally cast to
    recv_y's dtype. All-dropped tokens give zeros.

    For fp32 rows the cast of a partial is exact, so the result differs from :func:`reference_combine`
    only by association (a few ulp, not required to be equal); for bf16 / fp16 it also differs by the
    rounding of the partials. A token whose valid ids all live on one rank (or K == 1) gives the same
    result as the pull combine in fp32.

    Args, Returns and Raises: those of :func:`reference_combine` (the same argument handling).
    """
    outs = []
    for r in _combine_ranks(recv_y, topk_idx, topk_weights, scatter, num_experts):
        n_tok, k_total = r.idx.shape
        rows = torch.empty(n_tok, k_total, r.hidden, dtype=r.dtype, device=r.idx.device)
        for k in range(k_total):
            rows[:, k] = r.column(k)
        outs.append(combine_reduced_rows(rows, r.idx, r.w, experts_per_rank=r.experts_per_rank))
    return outs


def reference_combine_rank_layout(
    recv_y: Sequence[Tensor],
    topk_idx: Sequence[Tensor],
    scatter: Sequence[Tensor],
    *,
    num_experts: int,
) -> list[Tensor]:
    """The rank-layout combine (DeepEP's): sum each token's per-rank rows on the token's rank.

    The destination ranks of token t are D(t) = {owner(topk_idx[t, k]) : topk_idx[t, k] >= 0}; its row
    on r is scatter[t, k] for any such k with owner r (they must agree). ``acc = zeros(H, fp32)``; for
    r in D(t) ascending: ``acc = acc + recv_y[r][row].float()``; the result is acc cast to recv_y's
    dtype once (RNE). A token without a destination gives zeros. No weights: the rows are the caller's,
    already reduced over r's experts and weighted.

    Args:
        recv_y: per rank r (all R ranks), [N_r, H] floating (bf16 / fp16 / fp32): one row per row r
            received; N_r may exceed that (only the rows read matter).
        scatter: matching [T_s, K] integer, the rank-layout rows (:func:`reference_rank_layout`, a
            rank-layout handle's ``scatter``); ignored where topk_idx is -1.
        topk_idx, num_experts: those of :func:`reference_combine`.

    Returns:
        Per entry of topk_idx, [T_s, H] in recv_y's dtype.

    Raises:
        ValueError: mismatched shapes/dtypes, E not divisible by R, a row outside its rank's recv_y, or
            two k of one token bound for one rank naming different rows.
    """
    weights = [torch.zeros(tuple(i.shape), dtype=torch.float32) for i in topk_idx]  # unused by this sum
    outs = []
    for c in _combine_ranks(recv_y, topk_idx, weights, scatter, num_experts):
        n_tok = c.idx.shape[0]
        device = c.idx.device
        valid = c.idx >= 0
        owner = torch.where(valid, torch.div(c.idx, c.experts_per_rank, rounding_mode="floor"), -1)
        acc = torch.zeros(n_tok, c.hidden, dtype=torch.float32, device=device)
        for r in range(len(recv_y)):
            on_r = valid & (owner == r)
            has = on_r.any(dim=1)
            hi = torch.where(on_r, c.slots, -1).max(dim=1).values
            lo = torch.where(on_r, c.slots, torch.iinfo(torch.int64).max).min(dim=1).values
            split = has & (lo != hi)
            if bool(split.any()):
                t = int(torch.nonzero(split)[0])
                raise ValueError(
                    f"rank {c.s}, token {t}: its pairs on rank {r} name rows {int(lo[t])} and {int(hi[t])}; "
                    f"the rank layout has one row per (token, rank)"
                )
            rows = hi[has]
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= recv_y[r].shape[0]):
                raise ValueError(
                    f"rank {c.s}: row range [{int(rows.min())}, {int(rows.max())}] outside recv_y[{r}] "
                    f"rows [0, {recv_y[r].shape[0]})"
                )
            y = torch.zeros(n_tok, c.hidden, dtype=c.dtype, device=device)
            y[has] = recv_y[r][rows]
            # One fp32 add per destination rank, in ascending r; the cast to the dtype comes last.
            acc = torch.where(has[:, None], acc + y.float(), acc)
        outs.append(acc.to(c.dtype))
    return outs


# The reference of each combine algorithm (kernels.variants.COMBINE_ALGORITHMS), by name.
COMBINE_REFERENCES = {"pull": reference_combine, "reduced": reference_combine_reduced}
