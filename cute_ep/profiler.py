"""Pick the fastest correct dispatch/combine backend for a shape, on the hardware at hand.

    choice = profile(runtime, cfg, {"cute": lambda c: EpBuffer(runtime, c),
                                    "a2a": lambda c: A2aEpBuffer(runtime, c)}, tokens=4096)
    print(format_table(choice))          # rank 0
    buf = choice.build(cfg)              # the winner's buffer

Every candidate runs the same inputs (``cute_ep.inputs.make_inputs``, this rank's seed) through
dispatch -> the test expert -> combine: first once to check it against the first candidate bit for
bit (receive rows, slots, tokens per expert, combine output; the scatter-mode layout is the same on
every backend), then ``warmup`` + ``iters`` timed times. A rank's time for a call is its median; a
candidate's time is the slowest rank's (every rank waits for it). Candidates that fail the check or
raise are reported and never chosen. The winner has the least dispatch + combine time (dispatch and
combine must come from the same backend: a handle belongs to the buffer that made it); the fastest
dispatch and the fastest combine are reported too.

``ProfileCache`` keeps choices per (device, world, local world, tokens, hidden, top-k, experts,
dtype) in a JSON file, so a later run can skip profiling: ``choose(...)`` does both. Collective:
every rank calls these with the same arguments.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cute_ep.collectives import all_gather_objects, broadcast_from_root
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import EpConfig
from cute_ep.reference import apply_test_expert, global_expert_of_rows

__all__ = [
    "CandidateResult",
    "ProfileCache",
    "ProfileResult",
    "choose",
    "choose_dispatch_algorithm",
    "format_table",
    "pick_fastest_algorithm",
    "profile",
]

BufferFactory = Callable[[EpConfig], Any]


@dataclass
class CandidateResult:
    """One candidate's outcome: times in microseconds (slowest rank's median), or why it was excluded."""

    name: str
    dispatch_us: float | None = None
    combine_us: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def total_us(self) -> float:
        return (self.dispatch_us or 0.0) + (self.combine_us or 0.0)


@dataclass
class ProfileResult:
    """The candidates' results and the choice (None when every candidate failed)."""

    key: str
    candidates: list[CandidateResult]
    winner: str | None
    fastest_dispatch: str | None
    fastest_combine: str | None
    factories: Mapping[str, BufferFactory] = field(default_factory=dict, repr=False, compare=False)

    def build(self, cfg: EpConfig) -> Any:
        """The winner's buffer for ``cfg`` (collective)."""
        if self.winner is None:
            raise RuntimeError(f"no candidate passed for {self.key}: " + "; ".join(
                f"{c.name}: {c.error}" for c in self.candidates))
        return self.factories[self.winner](cfg)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "winner": self.winner, "fastest_dispatch": self.fastest_dispatch,
                "fastest_combine": self.fastest_combine, "candidates": [asdict(c) for c in self.candidates]}


def shape_key(runtime: Any, cfg: EpConfig, tokens: int) -> str:
    """What a choice depends on: the device, the placement and the shape (and the combine algorithm
    when it is not the default: the reduced combine's buffers are other candidates)."""
    dev = getattr(runtime, "device", None)
    on_gpu = dev is not None and torch.device(dev).type == "cuda"
    device = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    combine = "|reduced" if cfg.combine_algorithm == "reduced" else ""
    return (f"{device}|R{cfg.world_size}|L{cfg.local_world_size}|T{tokens}|H{cfg.hidden}|K{cfg.topk}|"
            f"E{cfg.num_experts}|{str(cfg.dtype).removeprefix('torch.')}{combine}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[..., Any], *args: Any, device: torch.device) -> tuple[Any, float]:
    """fn(*args) and its wall time in microseconds, with the device drained before and after (each
    call of a candidate includes its host work and syncs: that is what a caller waits for)."""
    _sync(device)
    start = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return out, (time.perf_counter() - start) * 1e6


def _run_candidate(runtime: Any, cfg: EpConfig, make: BufferFactory, inputs: tuple, iters: int,
                   warmup: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    rank = runtime.env.rank
    x, idx, w = inputs
    device = x.device
    d_times: list[float] = []
    c_times: list[float] = []
    with make(cfg) as buf:
        outputs: dict[str, torch.Tensor] = {}
        for it in range(1 + warmup + iters):
            res, d_us = _timed(buf.dispatch, x, idx, w, device=device)
            experts = global_expert_of_rows(res.tokens_per_expert.cpu(), rank).to(device)
            y = buf.expert_output(res.num_recv)
            y.copy_(apply_test_expert(res.recv_x, experts))
            out, c_us = _timed(buf.combine, y, res.handle, device=device)
            if it == 0:
                outputs = {
                    "recv_x": res.recv_x.detach().cpu().clone(),
                    "recv_src": res.recv_src.detach().cpu().clone(),
                    "tokens_per_expert": res.tokens_per_expert.detach().cpu().clone(),
                    "scatter": res.handle.scatter.detach().cpu().clone(),
                    "out": out.detach().cpu().clone(),
                }
            elif it > warmup:
                d_times.append(d_us)
                c_times.append(c_us)
    return outputs, d_times, c_times


def profile(runtime: Any, cfg: EpConfig, candidates: Mapping[str, BufferFactory], *, tokens: int,
            iters: int = 10, warmup: int = 2, seed: int = 0) -> ProfileResult:
    """Time every candidate for ``tokens`` tokens per rank (<= cfg.max_tokens); see the module docstring.

    candidates: name -> factory building that backend's buffer for a config (in the order given; the
    first is the correctness reference for the others). Collective.
    """
    if not candidates:
        raise ValueError("candidates must name at least one backend")
    if not 0 <= tokens <= cfg.max_tokens:
        raise ValueError(f"tokens must be in [0, cfg.max_tokens={cfg.max_tokens}], got {tokens}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    rank = runtime.env.rank
    dev = getattr(runtime, "device", None)
    device = torch.device(dev) if dev is not None else torch.device("cpu")
    x, idx, w = make_inputs(rank, tokens, cfg.hidden, cfg.num_experts, cfg.topk, cfg.dtype, seed,
                            idx_dtype=torch.int32)
    inputs = (x.to(device), idx.to(device), w.to(device))
    group = getattr(runtime, "cpu_group", None)

    results: list[CandidateResult] = []
    reference: dict[str, torch.Tensor] | None = None
    for name, make in candidates.items():
        error = None
        d_med = c_med = 0.0
        try:
            outputs, d_times, c_times = _run_candidate(runtime, cfg, make, inputs, iters, warmup)
            d_med, c_med = statistics.median(d_times), statistics.median(c_times)
            if reference is None:
                reference = outputs
            else:
                bad = [k for k, v in outputs.items() if not torch.equal(v, reference[k])]
                if bad:
                    error = f"differs from {next(iter(candidates))} in {', '.join(bad)} on rank {rank}"
        except Exception as exc:  # a backend that cannot run here is reported, not fatal
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
        # Every rank learns every rank's verdict and times: the slowest rank decides.
        gathered = all_gather_objects((error, d_med, c_med), group)
        errors = [e for e, _, _ in gathered if e is not None]
        if errors:
            results.append(CandidateResult(name, error="; ".join(errors)))
        else:
            results.append(CandidateResult(name, max(g[1] for g in gathered), max(g[2] for g in gathered)))

    passed = [c for c in results if c.ok]
    pick = lambda attr: min(passed, key=attr).name if passed else None  # noqa: E731
    return ProfileResult(
        key=shape_key(runtime, cfg, tokens),
        candidates=results,
        winner=pick(lambda c: c.total_us),
        fastest_dispatch=pick(lambda c: c.dispatch_us),
        fastest_combine=pick(lambda c: c.combine_us),
        factories=dict(candidates),
    )


def format_table(result: ProfileResult) -> str:
    """A short table of the candidates and the choice."""
    header = f"{'backend':>12} {'dispatch us':>12} {'combine us':>12} {'total us':>10}"
    lines = [f"profile {result.key}", header]
    for c in result.candidates:
        if c.ok:
            mark = "  <- chosen" if c.name == result.winner else ""
            lines.append(f"{c.name:>12} {c.dispatch_us:12.1f} {c.combine_us:12.1f} {c.total_us:10.1f}{mark}")
        else:
            lines.append(f"{c.name:>12} excluded: {c.error}")
    lines.append(f"fastest dispatch: {result.fastest_dispatch}, fastest combine: {result.fastest_combine}")
    return "\n".join(lines)


class ProfileCache:
    """Choices per shape key in a JSON file (written atomically by rank 0, read by every rank)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"profile cache {self.path} is unreadable: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"profile cache {self.path} must hold a JSON object, got {type(data).__name__}")
        return data

    def get(self, key: str) -> str | None:
        entry = self.load().get(key)
        return entry.get("winner") if isinstance(entry, dict) else None

    def put(self, result: ProfileResult) -> None:
        self._write(result.key, result.to_json())

    def put_choice(self, key: str, winner: str, table: str) -> None:
        """Keep a choice made outside ``profile`` (e.g. EpBuffer's dispatch primitive) under ``key``."""
        self._write(key, {"key": key, "winner": winner, "table": table})

    def _write(self, key: str, entry: dict[str, Any]) -> None:
        data = self.load()
        data[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.path)


def cached_choice(runtime: Any, cache: ProfileCache | None, key: str) -> str | None:
    """The choice ``cache`` holds for ``key`` as rank 0 reads it, on every rank (collective), or None."""
    cached = cache.get(key) if cache is not None and runtime.env.rank == 0 else None
    return broadcast_from_root(cached, getattr(runtime, "cpu_group", None))


def choose(runtime: Any, cfg: EpConfig, candidates: Mapping[str, BufferFactory], *, tokens: int,
           cache: ProfileCache | None = None, say: Callable[[str], None] | None = None,
           **profile_kwargs: Any) -> tuple[str, Any]:
    """(name, buffer) of the best backend for this shape: from ``cache`` when it holds a choice that is
    still a candidate, else by ``profile`` (then stored in the cache by rank 0). Collective: rank 0's
    view of the cache decides for everyone."""
    key = shape_key(runtime, cfg, tokens)
    cached = cached_choice(runtime, cache, key)
    if cached in candidates:
        if say:
            say(f"profile {key}: {cached} (cached in {cache.path})")
        return cached, candidates[cached](cfg)
    result = profile(runtime, cfg, candidates, tokens=tokens, **profile_kwargs)
    if say:
        say(format_table(result))
    if cache is not None and runtime.env.rank == 0 and result.winner is not None:
        cache.put(result)
    return result.winner, result.build(cfg)


# --------------------------------------------------------------------------------------------------
# EpBuffer(algorithm="auto"): the dispatch primitive of one buffer
# --------------------------------------------------------------------------------------------------


def pick_fastest_algorithm(medians_per_rank: list[dict[str, float]], key: str) -> tuple[str, str]:
    """The dispatch primitive whose slowest rank's median (microseconds) is least, and a short table.

    medians_per_rank: one {primitive: median us} per rank (all with the same primitives)."""
    names = list(medians_per_rank[0])
    slowest = {n: max(m[n] for m in medians_per_rank) for n in names}
    best = min(names, key=lambda n: slowest[n])
    lines = [f"dispatch primitive {key} (slowest rank's median of the dispatch launch)"]
    for n in names:
        lines.append(f"  {n:>9} {slowest[n]:10.1f} us" + ("  <- chosen" if n == best else ""))
    return best, "\n".join(lines)


def choose_dispatch_algorithm(buf: Any, cache: ProfileCache | None = None, iters: int = 10,
                              warmup: int = 3) -> tuple[str, str]:
    """(primitive, table): time every dispatch primitive of the GPU buffer ``buf`` at cfg.max_tokens
    tokens (CUDA events around ``launch_dispatch``), gather every rank's medians and pick the fastest;
    or take the choice ``cache`` holds for this shape. Collective."""
    from cute_ep.kernels.config import DISPATCH_ALGORITHMS

    c, runtime = buf.cfg, buf.runtime
    key = shape_key(runtime, c, c.max_tokens) + "|dispatch-primitive"
    cached = cached_choice(runtime, cache, key)
    if cached in DISPATCH_ALGORITHMS:
        return cached, f"dispatch primitive {key}: {cached} (cached in {cache.path})"
    x, idx, w = make_inputs(buf.rank, c.max_tokens, c.hidden, c.num_experts, c.topk, c.dtype, 0,
                            device=buf.device, idx_dtype=torch.int32)
    medians = {}
    for name in DISPATCH_ALGORITHMS:
        times = []
        for i in range(warmup + iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            buf.launch_dispatch(x, idx, w, algorithm=name)
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end) * 1e3)
        buf.check_ran()
        medians[name] = sorted(times)[len(times) // 2]
    name, table = pick_fastest_algorithm(all_gather_objects(medians, runtime.cpu_group), key)
    if cache is not None and buf.rank == 0:
        cache.put_choice(key, name, table)
    return name, table
