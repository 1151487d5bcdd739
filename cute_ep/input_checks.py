"""Backend-neutral checks of the public calls' arguments and of a buffer's configuration.

Every backend (``EpBuffer``, ``ReferenceEpBuffer``, ``A2aEpBuffer``) validates with these, so a bad
argument gets the same message everywhere; messages name the constraint and the value. Importing
this module imports no GPU library.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from cute_ep.api import LAYOUTS, DispatchResult
from cute_ep.kernels.config import DISPATCH_ALGORITHMS, MODES, ConfigError, EpConfig
from cute_ep.kernels.variants import COMBINE_ALGORITHMS

__all__ = [
    "InputTypeError",
    "check_buffer_config",
    "check_combine_input",
    "check_combine_layout",
    "check_combine_out",
    "check_dispatch_algorithm",
    "check_dispatch_call",
    "check_dispatch_inputs",
    "check_dispatch_options",
    "check_layout",
    "check_sm_budget",
    "check_tensor_args",
    "check_topk_values",
    "dispatch_rows",
    "fit_hint",
    "max_tokens_that_fit",
    "note_dispatch_rows",
    "resolve_combine_algorithm",
]


class InputTypeError(TypeError, ValueError):
    """An argument that should be a tensor (or a dispatch handle) is something else, e.g. a Python list.

    A ``TypeError``, and a ``ValueError`` too: code that catches the ValueError every other bad input
    raises (the backends do, to tell their peers before a collective) catches this one as well."""


def check_tensor_args(device: torch.device, *args: tuple[str, Any, str, torch.dtype]) -> None:
    """Raise ``InputTypeError`` for the first of ``args`` = (name, value, expected shape and dtype,
    dtype to convert to) whose value is not a ``torch.Tensor``: the message names the argument, the type
    it got, what is expected and how to convert it. The messages are built only on failure."""
    for name, value, expected, dtype in args:
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(
                f"{name} must be a torch.Tensor {expected} on {device}, got {type(value).__name__}; "
                f"convert it with torch.as_tensor({name}, dtype={dtype}, device={str(device)!r})"
            )


def check_dispatch_algorithm(algorithm: str | None, *, allow_auto: bool = False) -> None:
    """A dispatch primitive name (``kernels.config.DISPATCH_ALGORITHMS``), None (the buffer's own), or
    with ``allow_auto`` also "auto" (a buffer's constructor: time them and keep the fastest)."""
    if algorithm is None or algorithm in DISPATCH_ALGORITHMS or (allow_auto and algorithm == "auto"):
        return
    auto = "'auto' or " if allow_auto else ""
    raise ValueError(f"algorithm must be {auto}one of {sorted(DISPATCH_ALGORITHMS)}, got {algorithm!r}")


def resolve_combine_algorithm(cfg: EpConfig, algorithm: str | None = None) -> str:
    """The combine algorithm of one call: ``algorithm``, or ``cfg.combine_algorithm`` when None.

    "pull" always works; "reduced" needs a buffer built for it (``EpConfig(combine_algorithm=
    "reduced")``: only then does the GPU buffer allocate its partial rows and its dispatches record
    group lists under every dispatch primitive, not only dedup). Shared by ``EpBuffer`` and the host
    backends (``ReferenceEpBuffer``, ``A2aEpBuffer``).

    Raises:
        ValueError: an unknown name, or "reduced" on a "pull" configuration.
    """
    if algorithm is None:
        return cfg.combine_algorithm
    if not isinstance(algorithm, str) or algorithm not in COMBINE_ALGORITHMS:
        raise ValueError(f"combine algorithm must be one of {sorted(COMBINE_ALGORITHMS)}, got {algorithm!r}")
    if algorithm == "reduced" and cfg.combine_algorithm != "reduced":
        raise ValueError(
            "combine algorithm 'reduced' needs EpConfig(combine_algorithm='reduced') "
            f"(got {cfg.combine_algorithm!r}): only then does it hold the partial rows this combine sums "
            "into, and do its dispatches list every token's group under every dispatch primitive"
        )
    return algorithm


def check_dispatch_options(cfg: EpConfig, mode: str, fp8: Any) -> None:
    """Validate dispatch's mode ("scatter" | "atomic") and fp8 flag (a bool; True needs H % 128 == 0)
    for ``cfg`` (the host backends share it). Errors name the constraint and the value."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if not isinstance(fp8, bool):
        raise ValueError(f"fp8 must be True or False, got {fp8!r}")
    if fp8:
        cfg.check_fp8()


def check_layout(cfg: EpConfig, layout: Any, mode: str, fp8: Any) -> None:
    """Validate dispatch's receive layout ("expert" | "rank", ``cute_ep.api.LAYOUTS``) for ``cfg``.

    "rank" needs ``cfg.capacity_factor == 0`` (its rows are per (token, rank): there is no expert
    capacity to apply). ``mode`` and ``fp8`` are accepted as they are in both layouts: rank-layout rows
    are in one deterministic order in either mode, and an FP8 dispatch sends each token's packed FP8 row
    to its row on every destination rank as the expert layout does (``check_dispatch_options`` checks
    both values). Errors name the constraint and the value.
    """
    del mode, fp8  # accepted in both layouts (see above)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if layout != "rank":
        return
    if cfg.capacity_factor != 0:
        raise ValueError(
            f"layout='rank' needs capacity_factor == 0 (no expert capacity), got "
            f"capacity_factor={cfg.capacity_factor}"
        )


def check_combine_layout(handle: Any, algorithm: Any) -> str:
    """The receive layout of a combine's ``handle`` ("expert" | "rank"; a handle without the field is
    "expert"). A rank-layout combine has one formula (the caller's per-rank rows summed in rank order),
    so its ``algorithm`` must be None; on the expert layout ``algorithm`` is left to
    ``resolve_combine_algorithm``."""
    layout = getattr(handle, "layout", "expert")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"handle.layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if layout == "rank" and algorithm is not None:
        raise ValueError(
            "combine of a layout='rank' handle takes algorithm=None (it sums the caller's per-rank "
            f"rows in rank order; 'pull' and 'reduced' are expert-layout combines), got {algorithm!r}"
        )
    return layout


def check_dispatch_inputs(cfg: EpConfig, device: torch.device, x: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor, *, values: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate dispatch inputs against ``cfg`` (every backend uses this); returns (x, topk_idx as
    contiguous int32, topk_weights). Errors name the constraint and the value; an argument that is not a
    tensor raises ``InputTypeError``.

    Devices, shapes, dtypes and contiguity are checked on the host (no sync). ``values``: also check the
    ids' values (``check_topk_values``, one host sync). The GPU buffer passes False: its layout kernel
    checks them on the device, and the int64 ids are clamped to [-2, E] before they become int32, so a
    value no int32 holds is still refused there."""
    c = cfg
    if not (isinstance(x, torch.Tensor) and isinstance(topk_idx, torch.Tensor)
            and isinstance(topk_weights, torch.Tensor)):
        check_tensor_args(device, ("x", x, f"[T, {c.hidden}] {c.dtype}", c.dtype),
                          ("topk_idx", topk_idx, f"[T, {c.topk}] int32/int64", torch.int32),
                          ("topk_weights", topk_weights, f"[T, {c.topk}] float32", torch.float32))
    for name, ten in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if ten.device != device:
            raise ValueError(f"{name} must be on {device}, got {ten.device}")
        if not ten.is_contiguous():
            raise ValueError(f"{name} must be contiguous (stride {ten.stride()})")
    if x.dim() != 2 or x.shape[1] != c.hidden or x.dtype != c.dtype:
        raise ValueError(f"x must be [T, {c.hidden}] {c.dtype}, got {list(x.shape)} {x.dtype}")
    t = x.shape[0]
    if t > c.max_tokens:
        raise ValueError(f"x has {t} tokens, more than max_tokens={c.max_tokens}")
    if tuple(topk_idx.shape) != (t, c.topk) or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_idx must be [{t}, {c.topk}] int32/int64, got {list(topk_idx.shape)} {topk_idx.dtype}"
        )
    if tuple(topk_weights.shape) != (t, c.topk) or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be [{t}, {c.topk}] float32, got {list(topk_weights.shape)} "
            f"{topk_weights.dtype}"
        )
    if values:
        check_topk_values(cfg, topk_idx)
    elif topk_idx.dtype == torch.int64:
        topk_idx = topk_idx.clamp(-2, c.num_experts)
    if topk_idx.dtype != torch.int32:  # (contiguous, checked above, and so is the converted copy)
        topk_idx = topk_idx.to(torch.int32)
    return x, topk_idx, topk_weights


def check_dispatch_call(cfg: EpConfig, device: torch.device, x: torch.Tensor, topk_idx: torch.Tensor,
                        topk_weights: torch.Tensor, *, mode: str, fp8: Any, algorithm: str | None, layout: Any
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A host backend's dispatch arguments, checked in order: the layout (``check_layout``), mode and fp8
    (``check_dispatch_options``), the dispatch primitive (``check_dispatch_algorithm``: a GPU primitive
    gives the same result, so a host backend has nothing to imitate), then the tensors and the ids' values
    (``check_dispatch_inputs``, whose result it returns)."""
    check_layout(cfg, layout, mode, fp8)
    check_dispatch_options(cfg, mode, fp8)
    check_dispatch_algorithm(algorithm)
    return check_dispatch_inputs(cfg, device, x, topk_idx, topk_weights)


def check_topk_values(cfg: EpConfig, topk_idx: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every id is in [-1, E) and no token names an expert twice (-1 may
    repeat): the message names the constraint, the values found and the first offending token. One host
    sync (the GPU buffer calls it only after its kernels refused a call, to say why)."""
    t = topk_idx.shape[0]
    if not t:
        return
    # One host sync for all value checks: min, max and the first token naming an expert twice.
    ids = topk_idx.sort(dim=1).values
    repeated = ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any(dim=1)
    tokens = torch.arange(t, device=ids.device)
    first_rep = torch.where(repeated, tokens, t).min()
    stats = torch.stack([ids[:, 0].min().long(), ids[:, -1].max().long(), first_rep.long()])
    lo, hi, tok = stats.tolist()
    if lo < -1 or hi >= cfg.num_experts:
        raise ValueError(f"topk_idx values must be in [-1, {cfg.num_experts}), got min {lo}, max {hi}")
    # Distinct experts per token bound the rows a rank can receive (the buffers' capacity).
    if tok < t:
        raise ValueError(
            f"topk_idx must name distinct experts per token (-1 may repeat): token {tok} has "
            f"{topk_idx[tok].tolist()}"
        )


# The rows of expert outputs each dispatch's combine takes, by the handle's ``scatter`` tensor: every copy
# of a handle made with ``dataclasses.replace`` (as cute_ep.autograd makes them) shares it, and a dispatch
# makes a new one. id -> (weak reference, num_recv, a reader of the count on the device, or None); an
# entry goes when its tensor does.
_DISPATCH_ROWS: dict[int, tuple[weakref.ref, int | Callable[[], int | None] | None]] = {}


def note_dispatch_rows(handle: Any, num_recv: int | Callable[[], int | None] | None) -> None:
    """Remember how many rows the dispatch that made ``handle`` received, for ``check_combine_input``:
    ``num_recv``; a function that reads the count on the device (a host sync; None once a later dispatch
    has overwritten it) where the host has not read it (``dispatch(sync=False)`` on the GPU buffer); or
    None where nothing is known (``launch_dispatch``)."""
    scatter = handle.scatter
    key = id(scatter)
    entry = _DISPATCH_ROWS.get(key)
    if entry is not None and entry[1] is num_recv and entry[0]() is scatter:  # noted so already (a replay)
        return

    def forget(ref: weakref.ref, key: int = key, rows: dict = _DISPATCH_ROWS) -> None:
        # the table itself, not the module's name for it: at interpreter exit that name is None first
        entry = rows.get(key)
        if entry is not None and entry[0] is ref:
            del rows[key]

    _DISPATCH_ROWS[key] = (weakref.ref(scatter, forget), num_recv)


def dispatch_rows(handle: Any, num_recv: int | None) -> int | None:
    """The rows the dispatch that made ``handle`` received: what ``note_dispatch_rows`` recorded, or, for
    a handle not seen before (made by hand, or by a backend that records nothing at its dispatch),
    ``num_recv`` (the caller's best knowledge: its latest dispatch's count, or None where the host does
    not know it), which is then recorded for it."""
    scatter = getattr(handle, "scatter", None)
    entry = _DISPATCH_ROWS.get(id(scatter))
    if entry is not None and entry[0]() is scatter:
        return entry[1]
    if isinstance(scatter, torch.Tensor):
        note_dispatch_rows(handle, num_recv)
    return num_recv


_ID_DTYPES = (torch.int32, torch.int64)
_HANDLE_TENSORS = (("topk_idx", _ID_DTYPES, "int32/int64"), ("topk_weights", (torch.float32,), "float32"),
                   ("scatter", _ID_DTYPES, "int32/int64"))


def _check_handle(cfg: EpConfig, device: torch.device, handle: Any) -> None:
    """A combine's handle: a ``DispatchHandle`` (or one with its fields) whose routing tensors are
    [num_tokens, K] on ``device``: topk_idx and scatter int32/int64, topk_weights float32."""
    try:  # the common case in a few comparisons; the messages below only on failure
        idx, w, scatter = handle.topk_idx, handle.topk_weights, handle.scatter
        shape = (handle.num_tokens, cfg.topk)
        if (idx.shape == shape and w.shape == shape and scatter.shape == shape and idx.dtype in _ID_DTYPES
                and w.dtype == torch.float32 and scatter.dtype in _ID_DTYPES and idx.device == device
                and w.device == device and scatter.device == device):
            return
    except AttributeError:
        pass
    if isinstance(handle, DispatchResult):
        raise InputTypeError(
            "handle must be the DispatchHandle of a dispatch, got its DispatchResult: pass res.handle"
        )
    if any(not hasattr(handle, f) for f in ("topk_idx", "topk_weights", "scatter", "num_tokens")):
        raise InputTypeError(
            f"handle must be a DispatchHandle (DispatchResult.handle of a dispatch), got "
            f"{type(handle).__name__}"
        )
    t, k = handle.num_tokens, cfg.topk
    for name, dtypes, what in _HANDLE_TENSORS:
        ten = getattr(handle, name)
        if (not isinstance(ten, torch.Tensor) or tuple(ten.shape) != (t, k) or ten.dtype not in dtypes
                or ten.device != device):
            got = (f"{list(ten.shape)} {ten.dtype} on {ten.device}" if isinstance(ten, torch.Tensor)
                   else type(ten).__name__)
            raise ValueError(
                f"handle.{name} must be [{t}, {k}] {what} on {device} (num_tokens={t}), got {got}"
            )


def _check_combine_rows(cfg: EpConfig, y: torch.Tensor, handle: Any, num_recv: int | None) -> None:
    """y's rows against the dispatch of ``handle`` (module comment above ``note_dispatch_rows``)."""
    n = dispatch_rows(handle, num_recv)
    rows = y.shape[0]
    if rows == n:
        return
    rank = getattr(handle, "layout", "expert") == "rank"
    full, full_name = (cfg.rank_capacity, "rank_capacity") if rank else (cfg.capacity, "capacity")
    if rows == full:
        return
    when = ""
    if callable(n):
        # y holds fewer rows than the views of dispatch(sync=False): read the count the kernels wrote (a
        # host sync, which a caller sizing y by res.recv_count has already paid), except while capturing.
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            n, when = None, " (while a CUDA graph is being captured the count cannot be read)"
        else:
            n = n()
            if rows == n:
                return
            when = "" if n is not None else " (a later dispatch has overwritten its count)"
    if n is None:
        raise ValueError(
            f"y has {rows} rows, but the dispatch of this handle ran with sync=False: the host does not know "
            f"num_recv{when}, so y must have the {full} rows (cfg.{full_name}) the result's views cover "
            f"(res.num_recv; rows past res.recv_count are never read): pass buf.expert_output(res.num_recv)"
        )
    raise ValueError(
        f"y has {rows} rows, but the dispatch of this handle received num_recv={n}: y must have one row "
        f"per received row, in recv_x's order (buf.expert_output(res.num_recv) has them; {full} rows, "
        f"cfg.{full_name}, as after dispatch(sync=False), are accepted too)"
    )


def check_combine_input(cfg: EpConfig, device: torch.device, y: Any, handle: Any = None,
                        num_recv: int | None = None) -> None:
    """Validate combine's expert outputs y [num_recv, H] cfg.dtype on ``device`` (every backend).

    With ``handle`` (the combine's ``DispatchHandle``): the handle's routing tensors ([num_tokens, K] on
    ``device``) and y's row count, which must be the num_recv of the dispatch that made the handle, or
    the rows the views of a ``dispatch(sync=False)`` cover (``cfg.capacity``; ``cfg.rank_capacity`` in
    the rank layout). Fewer rows would leave combine reading rows nobody passed (poison, or an earlier
    call's). That num_recv is what the backend noted at the dispatch (``note_dispatch_rows``); for a
    handle it did not note, ``num_recv``: its best knowledge (None: not known on the host, so only the
    whole capacity is accepted). Without ``handle`` only ``rows <= cfg.capacity`` is checked.

    Raises:
        InputTypeError: y is not a tensor, or handle is not a dispatch handle (a DispatchResult, say).
        ValueError: any other violated constraint; the message names it and the value.
    """
    if not isinstance(y, torch.Tensor):
        check_tensor_args(device, ("y", y, f"[num_recv, {cfg.hidden}] {cfg.dtype}", cfg.dtype))
    if y.dtype != cfg.dtype or y.dim() != 2 or y.shape[1] != cfg.hidden or y.device != device:
        raise ValueError(
            f"y must be [num_recv, {cfg.hidden}] {cfg.dtype} on {device}, got "
            f"{list(y.shape)} {y.dtype} on {y.device}"
        )
    if y.shape[0] > cfg.capacity:
        raise ValueError(f"y has {y.shape[0]} rows, more than the capacity {cfg.capacity}")
    if handle is None:
        return
    _check_handle(cfg, device, handle)
    _check_combine_rows(cfg, y, handle, num_recv)


def check_combine_out(cfg: EpConfig, device: torch.device, out: Any, num_tokens: int) -> None:
    """``EpBuffer.launch_combine``'s ``out``, which the kernels write without bounds: [num_tokens, H]
    cfg.dtype, contiguous, on ``device`` (host-side checks only: no sync, capturable)."""
    if not isinstance(out, torch.Tensor):
        check_tensor_args(device, ("out", out, f"[{num_tokens}, {cfg.hidden}] {cfg.dtype}", cfg.dtype))
    if (tuple(out.shape) != (num_tokens, cfg.hidden) or out.dtype != cfg.dtype or out.device != device
            or not out.is_contiguous()):
        layout = "contiguous" if out.is_contiguous() else f"stride {out.stride()}"
        raise ValueError(
            f"out must be [{num_tokens}, {cfg.hidden}] {cfg.dtype}, contiguous, on {device} (num_tokens="
            f"{num_tokens} of the handle), got {list(out.shape)} {out.dtype}, {layout}, on {out.device}: "
            f"the kernels write handle.num_tokens rows into it"
        )


def check_buffer_config(runtime: Any, cfg: EpConfig, *, kernels: bool = False) -> EpConfig:
    """A buffer's configuration must fit the launch and be the same on every rank (collective); with
    ``kernels`` (the GPU backend) ``cfg.num_sms`` must also fit every rank's share of its GPU
    (``check_sm_budget``). Returns ``cfg``, with ``num_sms`` 0 (the default) resolved to the least share
    of any rank when ``kernels`` is set.

    A mismatch between ranks would otherwise hang in the first kernel; the error names the ranks.
    """
    import torch.distributed as dist

    env = runtime.env
    mine = (cfg.key(), sm_share_of(runtime))
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Gather before raising anything, so that every rank raises (none waits alone).
        group = getattr(runtime, "cpu_group", None)
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    else:
        every = [mine]
    keys = [k for k, _ in every]
    if cfg.world_size != env.world_size:
        raise ConfigError(f"cfg.world_size={cfg.world_size} but the launch has world_size={env.world_size}")
    if any(k != keys[0] for k in keys):
        diff = {r: k for r, k in enumerate(keys) if k != keys[0]}
        raise ConfigError(f"ranks built different EpConfigs: rank 0 has {keys[0]}, others {diff}")
    if not kernels:
        return cfg
    shares = [s for _, s in every if s is not None]
    if cfg.num_sms == 0 and shares:
        return dataclasses.replace(cfg, num_sms=min(shares)[0])
    check_sm_budget(cfg.num_sms, shares)
    return cfg


def sm_share_of(runtime: Any) -> tuple[int, int, int] | None:
    """(SMs this rank may count on, its GPU's SM count, ranks on that GPU), or None without a GPU. A
    started nvshmem ``Runtime`` knows its share (``Runtime.sm_share``); any other runtime on a GPU has the
    whole GPU."""
    share = getattr(runtime, "sm_share", None)
    if share is not None:
        return share, runtime.device_sms, runtime.placement.ranks_per_gpu
    device = getattr(runtime, "device", None)
    if device is None or device.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return sms, sms, 1


def check_sm_budget(num_sms: int, shares: list[tuple[int, int, int]]) -> None:
    """``num_sms`` CTAs of the layout (and of a dispatch with the layout folded in) wait for each other, so
    every rank's grid must be resident at once, one CTA per SM beside the other ranks on its GPU: num_sms
    may not exceed any rank's share (``shares``: ``sm_share_of`` per rank with a GPU; empty on CPU
    runtimes)."""
    from cute_ep.bootstrap.gpu_share import sm_share_error

    why = sm_share_error(num_sms, shares)
    if why is not None:
        raise ConfigError(why)


def max_tokens_that_fit(cfg: EpConfig, symmetric_budget: int) -> int:
    """The largest ``max_tokens`` (at most ``cfg.max_tokens``) whose symmetric buffers, with the least
    capacity that always fits, take at most ``symmetric_budget`` bytes per rank; 0 if not even one token
    fits. The bytes grow with max_tokens, so a bisection finds it."""
    def fits(m: int) -> bool:
        return dataclasses.replace(cfg, max_tokens=m, capacity=0).symmetric_bytes() <= symmetric_budget

    lo, hi = 0, cfg.max_tokens  # fits(lo) holds (0 tokens: nothing to check), the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_hint(cfg: EpConfig) -> Callable[[int], str]:
    """``Runtime(fit_hint=...)`` for ``cfg``: given the symmetric bytes one rank may have, a sentence
    naming the largest max_tokens that fits."""
    def hint(symmetric_budget: int) -> str:
        m = max_tokens_that_fit(cfg, symmetric_budget)
        if m == 0:
            return f"not even max_tokens=1 fits with world_size={cfg.world_size}, hidden={cfg.hidden}"
        return f"max_tokens={m} fits with this configuration's other fields (it asks for {cfg.max_tokens})"

    return hint
