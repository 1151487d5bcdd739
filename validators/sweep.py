"""The coverage sweep: one declared table of dispatch + combine cases at the edges of ``EpConfig``, and a
runner that checks a case on any backend, bit for bit.

The table (``CASES``) covers what no other test does: top-k 1, 2, 8, 9, 16, 32, 33 and 64 (each in both
receive layouts; 9 is the first above the layout kernel's ``TOKEN_REGS`` = 8 ids in registers, 33 the first
above the dispatch's lane-per-pair path, K <= 32), both expert-layout combines ("pull" and "reduced") and
the rank layout's own combine, FP8 dispatch in both layouts, rows of 16 bytes (fp32 hidden 4, bf16 hidden
8: the smallest ``EpConfig`` accepts), 7168 and hidden sizes that are not powers of two, 288 experts
(DeepEP's low-latency default), a rank without tokens, every token of every rank on one expert set
(``hot_set``; with K = 1 every token on one expert) and every token's first choice on one expert
(``hot_first``), the three dispatch primitives and the layout in a kernel of its own.

A case (``SweepCase``) is one buffer (``case_config``) and a few calls (``Call``: mode, FP8, dispatch
primitive) with fresh inputs each (``case_inputs``: a function of the case, the call, the rank and the
launch's seed offset only).
``run_case`` takes a buffer factory (``cfg -> buffer``: ``EpBuffer``, ``ReferenceEpBuffer``, ``A2aEpBuffer``)
and checks every call on receive buffers poisoned first:

- expert layout: the layout (``check_layout``: tokens per expert, rows received, the handle's slots), the
  received rows, weights and source tags (``check_dispatch``; in order in scatter mode, inside each
  (expert, source) group in atomic mode; after an FP8 dispatch the packed rows byte for byte, with the
  GPU buffer's own packed rows and padding where it has ``fp8_packed_rows``), and the combine of the test
  expert's outputs (y = x * (expert + 1)) against the fixed-order fp32 reference: ``reference_combine``
  for "pull", ``reference_combine_reduced`` for "reduced" (a buffer built for the reduced combine runs
  both on the same handle, the reduced one first, with its partial rows poisoned where it has them);
- rank layout: every received field, the counts and the handle (``check_rank_dispatch``; FP8 rows as
  packed rows) and the rank combine of the caller's per-row outputs (``rank_caller_rows``,
  ``check_rank_combine``): pulled from ``expert_output`` ("rank"), or on a buffer built for the reduced
  combine pushed from a tensor of the caller's, the partial rows poisoned first ("reduced");
- after every call, where the buffer has ``check_ran`` (the GPU buffer): every kernel completed.

Every check is collective and its verdict is reduced over the ranks; the runner never raises between
collectives on its own (an unreadable result becomes a failure), and each call ends with an all-gather
of every rank's failures, so every rank returns the same ``CaseReport``. Every rank must run the same
case with the same configuration; ``skip_reason`` decides a skip from the world size alone (the same on
every rank).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from cute_ep.collectives import all_gather_objects
from cute_ep.fp8 import dequantize_fp8, pack_fp8_rows, quantize_fp8
from cute_ep.inputs import ROUTINGS as INPUT_ROUTINGS
from cute_ep.inputs import make_inputs
from cute_ep.kernels.buffers import FP8_BLOCK
from cute_ep.kernels.config import LAYOUT_SMEM_INTS, MAX_EXPERTS, EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows
from cute_ep.validators.checks import (
    CheckResult,
    check_combine,
    check_dispatch,
    check_layout,
    check_rank_combine,
    check_rank_dispatch,
)

__all__ = [
    "CASES",
    "Call",
    "CallRecord",
    "CaseReport",
    "ROUTINGS",
    "SweepCase",
    "SweepContext",
    "case_config",
    "case_inputs",
    "case_seed",
    "combines_of",
    "rank_caller_rows",
    "routing_ids",
    "run_case",
    "skip_reason",
    "tokens_of",
    "world_sizes_of",
]

ROUTINGS = (*INPUT_ROUTINGS, "hot_set", "hot_first")
"""make_inputs' routings, and two built here: "hot_set", every token of every rank names the same K
experts (each token in its own order; with K = 1 every token goes to one expert), and "hot_first", every
token's first choice is the same expert, its other K - 1 drawn uniformly from the rest."""

COMBINES = {"expert": ("pull", "reduced"), "rank": ("rank", "reduced")}
"""The buffer's combine of each receive layout. The rank layout has one result (its handle takes no
algorithm): "rank" pulls it, "reduced" (a buffer built for the reduced combine) pushes it from a y the
caller keeps in a tensor of its own (``launch_combine(..., "reduced")`` where the buffer has it)."""

BF16, FP32 = torch.bfloat16, torch.float32
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_SALT_SHARED = 0x5EE9  # the hot routings' shared draw (the same on every rank)
_SALT_RANK = 0x7A11  # their per-rank draws


@dataclass(frozen=True)
class Call:
    """One dispatch + combine of a case.

    mode: "scatter" or "atomic". fp8: an FP8 dispatch (the case's hidden must be a multiple of 128).
    algorithm: the dispatch primitive of this call ("dedup", "per_pair", "put_warp"), None: the buffer's
    (dedup); the expert layout only (the rank layout has one way to send).
    """

    mode: str = "scatter"
    fp8: bool = False
    algorithm: str | None = None

    @property
    def label(self) -> str:
        extra = (["fp8"] if self.fp8 else []) + ([self.algorithm] if self.algorithm else [])
        return "-".join([self.mode, *extra])


PLAIN = (Call("scatter"), Call("atomic"))


@dataclass(frozen=True)
class SweepCase:
    """One buffer and its calls (see the module docstring).

    topk, num_experts (global; divisible by every world size the launches use: 1, 2, 4, 8, 16), hidden,
    dtype: the ``EpConfig`` fields. layout: "expert" or "rank". combine: the buffer's combine ("pull" or
    "reduced"; "rank" for the rank layout). tokens: this call's tokens per rank by (rank + call) % 4
    (``tokens_of``); max_tokens is their largest. routing: one of ``ROUTINGS``. calls: the calls, in order.
    fold: the layout folded into the dispatch launch (``EpConfig.layout_in_dispatch`` default), else a
    kernel of its own (0). coverage: the checks also require every route class the topology allows.
    """

    topk: int
    layout: str
    combine: str
    dtype: torch.dtype
    hidden: int
    num_experts: int
    tokens: tuple[int, int, int, int]
    routing: str = "uniform"
    calls: tuple[Call, ...] = PLAIN
    fold: bool = True
    coverage: bool = False

    @property
    def fp8(self) -> bool:
        return any(c.fp8 for c in self.calls)

    @property
    def max_tokens(self) -> int:
        return max(self.tokens)

    @property
    def id(self) -> str:
        """e.g. ``k33-rank-bf16-fp8-h7168-e288`` or ``k64-expert-reduced-bf16-h384-e288-hot_first-kernel``."""
        parts = [f"k{self.topk}", self.layout]
        if self.layout == "expert" or self.combine != "rank":
            parts.append(self.combine)
        parts.append(_DTYPE_NAMES[self.dtype])
        if self.fp8:
            parts.append("fp8")
        parts += [f"h{self.hidden}", f"e{self.num_experts}"]
        if self.routing != "uniform":
            parts.append(self.routing)
        if not self.fold:
            parts.append("kernel")
        return "-".join(parts)


def _case(topk: int, layout: str, combine: str, dtype: torch.dtype, hidden: int, experts: int,
          tokens: tuple[int, int, int, int], routing: str = "uniform", calls: tuple[Call, ...] = PLAIN,
          fold: bool = True, coverage: bool = False) -> SweepCase:
    return SweepCase(topk, layout, combine, dtype, hidden, experts, tokens, routing, calls, fold, coverage)


S, A = "scatter", "atomic"
CASES: tuple[SweepCase, ...] = (
    # ---- expert layout (one row per (token, k), expert-major) ------------------------------------------
    # 16-byte fp32 rows; every token of every rank on one expert (its owner receives everything)
    _case(1, "expert", "pull", FP32, 4, 64, (48, 0, 33, 17), "hot_set"),
    # 16-byte bf16 rows through the reduced combine; the per-pair primitive
    _case(2, "expert", "reduced", BF16, 8, 64, (64, 17, 0, 40),
          calls=(Call(S), Call(A, algorithm="per_pair"))),
    # DeepSeek-sized rows, decode-sized batch, 288 experts; FP8 on the second call
    _case(8, "expert", "pull", BF16, 7168, 288, (128, 96, 0, 64), calls=(Call(S), Call(A, fp8=True))),
    # the first top-k past TOKEN_REGS; FP8 with 9 scale blocks (hidden 1152: not a power of two)
    _case(9, "expert", "pull", BF16, 1152, 288, (40, 0, 24, 64),
          calls=(Call(S, fp8=True), Call(A, fp8=True), Call(S, algorithm="put_warp"))),
    # hidden 1000 (not a power of two, no FP8); every token's first choice on one expert; layout kernel
    _case(16, "expert", "reduced", BF16, 1000, 128, (56, 33, 0, 12), "hot_first",
          calls=(Call(S), Call(A, algorithm="put_warp")), fold=False),
    # K = 32: the last top-k of the lane-per-pair path; dropped ids; fp32 rows of 2880 (not a power of two)
    _case(32, "expert", "pull", FP32, 2880, 64, (24, 40, 0, 9), "dropped",
          calls=(Call(S), Call(A, algorithm="per_pair"))),
    # K = 33: the first past the lane-per-pair path; dedup and per-pair; FP8 through the reduced combine
    _case(33, "expert", "reduced", BF16, 512, 288, (32, 0, 48, 20),
          calls=(Call(S), Call(A, algorithm="per_pair"), Call(S, fp8=True)), coverage=True),
    # K = E = 64: every token names every expert; FP8 on the second call
    _case(64, "expert", "pull", BF16, 256, 64, (16, 40, 0, 25), calls=(Call(S), Call(A, fp8=True)),
          coverage=True),
    # K = 64 of 288 experts through the reduced combine, every token's first choice on one expert;
    # the put_warp primitive; the layout in a kernel of its own
    _case(64, "expert", "reduced", BF16, 384, 288, (24, 0, 31, 8), "hot_first",
          calls=(Call(S), Call(A, algorithm="put_warp")), fold=False),
    # ---- rank layout (one row per (source rank, token), DeepEP's) ----------------------------------------
    # 16-byte bf16 rows, every token of every rank on one expert
    _case(1, "rank", "rank", BF16, 8, 64, (40, 0, 64, 9), "hot_set"),
    # 16-byte fp32 rows, 288 experts
    _case(2, "rank", "rank", FP32, 4, 288, (33, 64, 0, 5)),
    # K = 8 (the last in registers), hidden 2880 (rows of 5760 bytes: pushed in a 4 KiB part and a rest),
    # decode-sized batch; the combine pushed
    _case(8, "rank", "reduced", BF16, 2880, 64, (128, 0, 77, 100)),
    # K = 9 with FP8 (9 scale blocks), 288 experts; the layout in a kernel of its own
    _case(9, "rank", "rank", BF16, 1152, 288, (48, 20, 0, 64), calls=(Call(S, fp8=True), Call(A)),
          fold=False),
    # every token of every rank on the same 16 experts
    _case(16, "rank", "rank", BF16, 256, 128, (64, 0, 31, 50), "hot_set"),
    # K = 32 with dropped ids; the combine pushed
    _case(32, "rank", "reduced", BF16, 512, 64, (36, 8, 0, 64), "dropped"),
    # K = 33, DeepSeek-sized rows in FP8, 288 experts
    _case(33, "rank", "rank", BF16, 7168, 288, (32, 0, 24, 16), calls=(Call(S, fp8=True), Call(A)),
          coverage=True),
    # K = E = 64: every token to every rank; FP8 on the second call; the combine pushed
    _case(64, "rank", "reduced", BF16, 256, 64, (20, 44, 0, 7), calls=(Call(S), Call(A, fp8=True)),
          coverage=True),
    # K = 64 of 288, fp32 rows in FP8, every token's first choice on one expert
    _case(64, "rank", "rank", FP32, 128, 288, (28, 0, 40, 13), "hot_first",
          calls=(Call(S, fp8=True), Call(S))),
)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# configuration and inputs
# --------------------------------------------------------------------------------------------------


def skip_reason(case: SweepCase, world_size: int) -> str | None:
    """Why ``case`` cannot run in a world of ``world_size`` ranks (None: it runs). A function of the world
    size only, so every rank decides alike before any buffer is made."""
    if case.num_experts % world_size:
        return f"{case.num_experts} experts do not split over {world_size} ranks"
    if case.layout == "rank" and 2 * case.num_experts + world_size > LAYOUT_SMEM_INTS:
        return f"the rank layout needs 2 * experts + ranks <= {LAYOUT_SMEM_INTS}"
    return None


def case_config(case: SweepCase, world_size: int, local_world_size: int, num_sms: int = 0) -> EpConfig:
    """The case's ``EpConfig`` in a world of ``world_size`` ranks, ``local_world_size`` per node."""
    extra: dict[str, Any] = {} if case.fold else {"layout_in_dispatch": 0}
    combine = "pull" if case.combine == "rank" else case.combine
    return EpConfig(world_size=world_size, local_world_size=local_world_size, num_experts=case.num_experts,
                    topk=case.topk, hidden=case.hidden, dtype=case.dtype, max_tokens=case.max_tokens,
                    num_sms=num_sms, combine_algorithm=combine, **extra)  # fmt: skip


def combines_of(case: SweepCase) -> tuple[str, ...]:
    """The combines each call of ``case`` runs, in order: a reduced buffer runs "reduced", then "pull"
    on the same handle; a pull buffer "pull"; the rank layout its one combine ("rank" pulled, "reduced"
    pushed)."""
    return ("reduced", "pull") if case.combine == "reduced" and case.layout == "expert" else (case.combine,)


def tokens_of(case: SweepCase, rank: int, world_size: int, call: int) -> int:
    """Tokens of ``rank`` in call ``call``: ``case.tokens[(rank + call) % 4]`` (so the rank without tokens
    moves from call to call, in a world of one too), except that the world is never empty as a whole
    (rank 0 then has ``max_tokens``)."""
    counts = [case.tokens[(r + call) % len(case.tokens)] for r in range(world_size)]
    if not any(counts):
        counts[0] = case.max_tokens
    return counts[rank]


def case_seed(case: SweepCase, call: int, offset: int = 0) -> int:
    """The inputs' seed of call ``call``: a function of the case's id (stable across processes), the call
    and ``offset`` (a launch's seed, e.g. the GPU tests' ``GPU_TEST_SEED``)."""
    return (zlib.crc32(case.id.encode()) + 7919 * call + offset) & 0x7FFFFFFF


def routing_ids(routing: str, num_tokens: int, num_experts: int, topk: int, seed: int, rank: int) -> Tensor:
    """[T, K] int64 ids of the routings built here ("hot_set", "hot_first"; ``ROUTINGS``), distinct in
    every token. The hot experts come from ``seed`` alone (the same on every rank); each rank's own
    draws from (seed, rank)."""
    shared = torch.Generator().manual_seed(seed * 2 + _SALT_SHARED)
    own = torch.Generator().manual_seed((seed * 1009 + rank) * 2 + _SALT_RANK)
    if routing == "hot_set":
        chosen = torch.randperm(num_experts, generator=shared)[:topk]
        order = torch.argsort(torch.rand(num_tokens, topk, generator=own), dim=1)  # each token its own order
        return chosen[order].contiguous()
    if routing == "hot_first":
        hot = int(torch.randint(num_experts, (1,), generator=shared))
        noise = torch.rand(num_tokens, num_experts, generator=own)
        noise[:, hot] = 2.0  # sorts after every other expert: never among the K - 1 drawn
        rest = torch.argsort(noise, dim=1)[:, : topk - 1]
        return torch.cat([torch.full((num_tokens, 1), hot, dtype=torch.int64), rest], dim=1).contiguous()
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")


def case_inputs(case: SweepCase, rank: int, world_size: int, call: int,
                device: torch.device | str | None = None, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(x [T, H], topk_idx [T, K] int64, topk_weights [T, K] fp32) of ``rank`` in call ``call``, on
    ``device``: ``make_inputs`` rows (their first columns name the sender) and weights, and the case's
    routing; ``seed``: the launch's seed offset (``case_seed``)."""
    t = tokens_of(case, rank, world_size, call)
    seed = case_seed(case, call, seed)
    base = case.routing if case.routing in INPUT_ROUTINGS else "uniform"
    x, idx, w = make_inputs(rank, t, case.hidden, case.num_experts, case.topk, case.dtype, seed, routing=base)
    if case.routing not in INPUT_ROUTINGS:
        idx = routing_ids(case.routing, t, case.num_experts, case.topk, seed, rank)
    dev = torch.device("cpu") if device is None else device
    return x.to(dev), idx.to(dev), w.to(dev)


# --------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepContext:
    """Where a case runs: this rank, the world (size, ranks per node), the group of the checks (a gloo
    group or one that reduces CPU tensors; None in a world of one without a process group), the device
    of the inputs and the launch's seed offset (the same on every rank)."""

    rank: int
    world_size: int
    local_world_size: int
    group: Any
    device: torch.device
    seed: int = 0


@dataclass
class CallRecord:
    """What one call did on this rank: its label, tokens, rows received and the checks it ran."""

    call: int
    label: str
    tokens: int
    num_recv: int
    checks: list[str] = field(default_factory=list)


@dataclass
class CaseReport:
    """The outcome of one case: the same on every rank (failures are all-gathered after every call)."""

    case_id: str
    seed: int = 0
    failures: list[str] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def text(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        head = f"{self.case_id}: {verdict} ({len(self.calls)} calls, seed offset {self.seed})"
        return "\n".join([head, *(f"  {f}" for f in self.failures)])


class _Call:
    """The state of one call on this rank: its local failures (shared at the end of the call)."""

    def __init__(self, number: int, call: Call, ctx: SweepContext) -> None:
        self.where = f"call {number} ({call.label})"
        self.ctx = ctx
        self.local: list[str] = []
        self.record = CallRecord(number, call.label, 0, 0)

    def verdict(self, name: str, result: CheckResult) -> None:
        """Record a check (collective verdict): this rank's message if it failed here."""
        self.record.checks.append(name)
        if not result.local_passed:
            self.local.append(f"rank {self.ctx.rank}: {self.where} {name}: {result.message}")

    def problem(self, text: str) -> None:
        self.local.append(f"rank {self.ctx.rank}: {self.where}: {text}")


def _packed_received(buf: Any, res: Any, cfg: EpConfig) -> Tensor:
    """[num_recv, fp8_row_bytes] uint8: the received FP8 rows as packed rows. The GPU buffer's own bytes
    (values, scales and the zero padding) where it has them, else the received values and scales packed
    again (``cute_ep.fp8.pack_fp8_rows``)."""
    n = int(res.num_recv)
    packed_rows = getattr(buf, "fp8_packed_rows", None)
    if packed_rows is not None:
        return packed_rows(n).cpu()
    return pack_fp8_rows(res.recv_x[:n].cpu(), res.recv_scales[:n].cpu(), cfg.fp8_row_bytes)


def _expert_rows(res: Any, cfg: EpConfig, fp8: bool, device: torch.device) -> Tensor:
    """The received rows as the experts read them: recv_x, or after an FP8 dispatch the dequantized rows
    cast to the row dtype."""
    n = int(res.num_recv)
    if not fp8:
        return res.recv_x[:n]
    return dequantize_fp8(res.recv_x[:n].cpu(), res.recv_scales[:n].cpu()).to(cfg.dtype).to(device)


def rank_caller_rows(rows: Tensor, recv_topk_idx: Tensor, recv_topk_weights: Tensor, rank: int,
                     experts_per_rank: int) -> Tensor:
    """What an expert rank hands the rank-layout combine: ``y[i] = rows[i] * s[i]``, ``s[i]`` the sum over
    k ascending of ``recv_topk_weights[i, k] * (global expert + 1)`` where ``recv_topk_idx[i, k] >= 0``
    (fp32), the product rounded once to the rows' dtype. A wrong local id or weight shows in the combine
    too."""
    ids = recv_topk_idx.to(torch.int64)
    scale = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
    for k in range(ids.shape[1]):
        term = recv_topk_weights[:, k].float() * (ids[:, k] + (rank * experts_per_rank + 1)).to(torch.float32)
        scale = scale + torch.where(ids[:, k] >= 0, term, torch.zeros_like(term))
    return (rows.float() * scale[:, None]).to(rows.dtype)


def _fill(y: Tensor, rows: Callable[[], Tensor], state: _Call, what: str) -> None:
    """y <- rows(), or NaN (and a failure on this rank) when the result cannot give them: combine still
    gets defined input, and every rank still reaches the collectives that follow."""
    try:
        y.copy_(rows())
    except Exception as exc:  # a result the checks already refuse (e.g. unreadable counts)
        y.fill_(float("nan"))
        state.problem(f"cannot compute {what}: {type(exc).__name__}: {exc}")


def _expert_call(buf: Any, case: SweepCase, call: Call, x: Tensor, idx: Tensor, w: Tensor,
                 ctx: SweepContext, state: _Call) -> None:
    cfg = buf.cfg
    kw = dict(max_tokens=cfg.max_tokens, num_experts=cfg.num_experts, local_world_size=cfg.local_world_size,
              group=ctx.group)  # fmt: skip
    buf.poison()
    res = buf.dispatch(x, idx, w, mode=call.mode, fp8=call.fp8, algorithm=call.algorithm)
    state.record.num_recv = int(res.num_recv)
    lay = check_layout(res, idx, **kw)
    state.verdict("layout", lay)
    sent, received = x, res.recv_x
    if call.fp8:  # what travels: packed rows (e4m3 values, fp32 scales, padding)
        sent = pack_fp8_rows(*quantize_fp8(x.cpu()), cfg.fp8_row_bytes)
        received = _packed_received(buf, res, cfg)
    disp = check_dispatch(sent, idx, w, received, res.recv_weights, res.recv_src,
                          ordered=call.mode == "scatter", require_coverage=case.coverage, **kw)
    state.verdict("dispatch", disp)

    y = buf.expert_output(res.num_recv)

    def expert_out() -> Tensor:
        experts = global_expert_of_rows(res.tokens_per_expert.cpu(), ctx.rank)
        rows = _expert_rows(res, cfg, call.fp8, x.device)
        return apply_test_expert(rows, experts.to(rows.device))

    _fill(y, expert_out, state, "the expert outputs")
    y_given = y.detach().cpu().clone()  # what combine reads, kept apart from the buffer
    for algorithm in combines_of(case):
        partials = getattr(buf, "partials", None)
        if algorithm == "reduced" and partials is not None:
            partials.fill_(float("nan"))  # the GPU buffer's partial rows: a row nobody wrote shows
        out = buf.combine(y, res.handle, algorithm=algorithm)
        comb = check_combine(out, idx, w, y_given, local_world_size=cfg.local_world_size,
                             num_experts=cfg.num_experts, scatter=res.handle.scatter,
                             require_coverage=case.coverage, group=ctx.group, algorithm=algorithm)
        state.verdict(f"combine {algorithm}", comb)


def _rank_call(buf: Any, case: SweepCase, call: Call, x: Tensor, idx: Tensor, w: Tensor,
               ctx: SweepContext, state: _Call) -> None:
    cfg = buf.cfg
    buf.poison()
    res = buf.dispatch(x, idx, w, mode=call.mode, fp8=call.fp8, layout="rank")
    state.record.num_recv = int(res.num_recv)
    # Every rank's inputs; after an FP8 dispatch what travels: every sender's rows quantized and packed.
    xs, idxs, ws = zip(*all_gather_objects((x.cpu(), idx.cpu(), w.cpu()), ctx.group), strict=True)
    got: Any = res
    if call.fp8:
        xs = tuple(pack_fp8_rows(*quantize_fp8(v), cfg.fp8_row_bytes) for v in xs)
        fields = ("num_recv", "tokens_per_expert", "handle", "recv_topk_idx", "recv_topk_weights", "recv_src")
        got = SimpleNamespace(**{n: getattr(res, n) for n in fields}, recv_x=_packed_received(buf, res, cfg))
    disp = check_rank_dispatch(got, list(xs), list(idxs), list(ws), max_tokens=cfg.max_tokens,
                               num_experts=cfg.num_experts, local_world_size=cfg.local_world_size,
                               require_coverage=case.coverage, group=ctx.group)  # fmt: skip
    state.verdict("rank dispatch", disp)

    n = int(res.num_recv)
    pushed = case.combine == "reduced"
    # a pushing combine reads y where the caller keeps it: a tensor of its own; its partial rows poisoned
    y = torch.empty_like(buf.expert_output(n)) if pushed else buf.expert_output(n)
    if pushed and getattr(buf, "partials", None) is not None:
        buf.partials.fill_(float("nan"))

    def caller_rows() -> Tensor:
        rows = _expert_rows(res, cfg, call.fp8, x.device)
        return rank_caller_rows(rows, res.recv_topk_idx[:n], res.recv_topk_weights[:n], ctx.rank,
                                cfg.experts_per_rank)

    _fill(y, caller_rows, state, "the caller's rows")
    y_given = y.detach().cpu().clone()
    if pushed and hasattr(buf, "launch_combine"):  # the push is asked for by name
        out = torch.empty((res.handle.num_tokens, cfg.hidden), dtype=cfg.dtype, device=x.device)
        buf.launch_combine(res.handle, out, "reduced", y=y)
    else:
        out = buf.combine(y, res.handle)
    comb = check_rank_combine(out, idx, res.handle.scatter, y_given, num_experts=cfg.num_experts,
                              local_world_size=cfg.local_world_size, require_coverage=case.coverage,
                              group=ctx.group)  # fmt: skip
    state.verdict("rank combine", comb)


def run_case(make_buffer: Callable[[EpConfig], Any], case: SweepCase, ctx: SweepContext,
             cfg: EpConfig | None = None) -> CaseReport:
    """Run ``case`` on a buffer from ``make_buffer(cfg)`` (a context manager: it is closed at the end) and
    check every call (collective: every rank of ``ctx.group`` runs the same case). ``cfg``: the case's
    configuration (default ``case_config`` with the buffer's own num_sms default). Returns the
    ``CaseReport``, the same on every rank. A call the buffer refuses raises (on every rank alike)."""
    if cfg is None:
        cfg = case_config(case, ctx.world_size, ctx.local_world_size)
    bad = [c.label for c in case.calls if c.fp8 and case.hidden % FP8_BLOCK]
    if bad or case.combine not in COMBINES[case.layout] or case.routing not in ROUTINGS:
        raise ValueError(f"{case.id}: not a valid case (FP8 calls {bad} need hidden % {FP8_BLOCK} == 0; "
                         f"combines of {case.layout!r}: {COMBINES[case.layout]}; routings: {ROUTINGS})")
    if not 1 <= case.num_experts <= MAX_EXPERTS:
        raise ValueError(f"{case.id}: num_experts must be in [1, {MAX_EXPERTS}]")
    report = CaseReport(case.id, ctx.seed)
    run_call = _rank_call if case.layout == "rank" else _expert_call
    with make_buffer(cfg) as buf:
        for number, call in enumerate(case.calls):
            state = _Call(number, call, ctx)
            x, idx, w = case_inputs(case, ctx.rank, ctx.world_size, number, ctx.device, ctx.seed)
            state.record.tokens = int(x.shape[0])
            run_call(buf, case, call, x, idx, w, ctx, state)
            check_ran = getattr(buf, "check_ran", None)  # the GPU buffer: every kernel completed
            if check_ran is not None:
                check_ran()
            # Every rank's failures, on every rank: one report everywhere.
            for local in all_gather_objects(state.local, ctx.group):
                report.failures += local
            report.calls.append(state.record)
    return report


def world_sizes_of(cases: Sequence[SweepCase],
                   sizes: Sequence[int] = (1, 2, 4, 8, 16)) -> dict[int, list[str]]:
    """The cases that would be skipped at each of ``sizes`` ranks (by id): empty lists for the table."""
    return {r: [c.id for c in cases if skip_reason(c, r)] for r in sizes}
