"""Bit-exact baselines: every rank's output arrays in one compressed ``.npz`` with JSON metadata.

A baseline written by one build (or machine) and compared against another tells whether the outputs
changed at all. Identity metadata (config, seed, dtype, world size, local world size) must match
before any array is compared: a baseline of another configuration raises
:class:`BaselineConfigError` instead of "passing" or "differing". Device, package versions and git sha
differences never fail a comparison: they are kept in ``Comparison.notes`` and shown with a failed
comparison only (where they may explain the difference).

File format: keys ``rank{r}/{name}`` hold numpy arrays; ``__meta__`` holds a JSON string with the
caller's meta plus world_size, local_world_size, device, versions, git_sha, created and ``dtypes``
(the torch dtype of every array). Dtypes numpy lacks (bfloat16, float8) are stored as unsigned
integers of the same width, holding the same bits, and restored exactly by :func:`load_baseline`.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from cute_ep._version import git_sha, package_versions
from cute_ep.collectives import broadcast_from_root, world_of

__all__ = [
    "IDENTITY_KEYS",
    "META_KEY",
    "REPORTED_KEYS",
    "Baseline",
    "BaselineConfigError",
    "BaselineFormatError",
    "Comparison",
    "check_baseline_config",
    "compare_baselines",
    "compare_to_baseline",
    "load_baseline",
    "make_baseline",
    "save_baseline",
    "version_differences",
]

META_KEY = "__meta__"
IDENTITY_KEYS = ("config", "seed", "dtype", "world_size", "local_world_size")
REPORTED_KEYS = ("device", "versions", "git_sha", "created")
_REQUIRED_CALLER_KEYS = ("config", "seed", "dtype")
_MAX_DETAILS_IN_SUMMARY = 3

# torch dtypes numpy holds natively; everything else is stored as same-width unsigned bits.
_NATIVE = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
_UINT_OF_SIZE = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


class BaselineConfigError(ValueError):
    """The two baselines were made with different identity metadata (config, seed, dtype, sizes)."""

    def __init__(self, key: str, expected: Any, actual: Any) -> None:
        self.key, self.expected, self.actual = key, expected, actual
        super().__init__(
            f"baseline config mismatch in {key!r}: expected {json.dumps(expected, sort_keys=True)}, "
            f"got {json.dumps(actual, sort_keys=True)} "
            "(the arrays of different configurations are not comparable)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Custom __init__ arguments: pickle (for broadcasting to other ranks) needs them back.
        return (type(self), (self.key, self.expected, self.actual))


class BaselineFormatError(ValueError):
    """The file is not a baseline written by :func:`save_baseline`."""


_MAKE_ONE = ("make one with --save-baseline-to PATH (scripts/dispatch_and_combine.py) or "
             "cute_ep.validators.baseline.save_baseline")
_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"


def _not_a_baseline(path: Any, data: bytes) -> BaselineFormatError:
    """The error of a file that is no .npz archive at all: what it looks like, what a baseline is."""
    if not data:
        what = "the file is empty"
    elif data.startswith(_NPY_MAGIC):
        what = "it holds one numpy array (.npy)"
    else:
        what = f"it starts with {data[:16]!r}"
    return BaselineFormatError(
        f"{path} is not a readable .npz file: a baseline is the .npz archive (a zip file) of every rank's "
        f"arrays that save_baseline writes, and {what}; {_MAKE_ONE}"
    )


@dataclass
class Baseline:
    """A loaded (or in-memory) baseline.

    Attributes:
        arrays: {"rank{r}/{name}": CPU tensor}, dtypes restored exactly.
        meta: the JSON metadata (identity keys, reported keys, ``dtypes``, caller extras).
        path: where it was loaded from, if anywhere.
    """

    arrays: dict[str, Tensor]
    meta: dict[str, Any]
    path: str | None = None


@dataclass
class Comparison:
    """Result of comparing two baselines.

    Attributes:
        passed: every array present in both, same dtype, shape and bits.
        lines: readable report; lines[0] is the one-line summary.
        num_arrays: arrays in the union of both key sets.
        identical: keys whose arrays are bit-identical.
        differing: keys that differ (missing, extra, dtype, shape or bits).
        notes: what differs besides the arrays and never fails a comparison (device, package versions,
            git sha), one line each; ``lines`` shows them only when the comparison failed.
    """

    passed: bool
    lines: list[str]
    num_arrays: int = 0
    identical: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return self.lines[0] if self.lines else ""


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, (Path, torch.device)):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"baseline meta value {obj!r} of type {type(obj).__name__} is not JSON serialisable")


def _canonical(obj: Any) -> Any:
    """The JSON form of obj, so values compare the same before saving and after loading."""
    return json.loads(json.dumps(obj, default=_json_default, sort_keys=True))


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def _build_meta(meta: Mapping[str, Any], world_size: int, local_world_size: int | None) -> dict[str, Any]:
    missing = [k for k in _REQUIRED_CALLER_KEYS if k not in meta]
    if missing:
        raise ValueError(f"baseline meta must hold {list(_REQUIRED_CALLER_KEYS)}; missing {missing}")
    out = _canonical(dict(meta))
    if "world_size" in out and out["world_size"] != world_size:
        raise ValueError(
            f"meta world_size ({out['world_size']}) differs from the group's world size ({world_size})"
        )
    lws = out.get("local_world_size")
    if local_world_size is not None:
        if lws is not None and lws != local_world_size:
            raise ValueError(
                f"meta local_world_size ({lws}) differs from the local_world_size argument "
                f"({local_world_size})"
            )
        lws = local_world_size
    out["world_size"] = world_size
    out["local_world_size"] = int(lws) if lws is not None else world_size  # default: one node
    out["device"] = _device_name()
    out["versions"] = package_versions()
    out["git_sha"] = git_sha()
    out["created"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return out


# --------------------------------------------------------------------------------------------
# Arrays <-> numpy
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_numpy(t: Tensor) -> np.ndarray:
    """Storage form: native numpy dtype, or same-width unsigned integers holding the same bits."""
    t = t.detach().cpu().contiguous()
    if t.dtype in _NATIVE:
        return t.numpy()
    bits = _UINT_OF_SIZE[t.element_size()]
    return t.reshape(-1).view(bits).reshape(t.shape).numpy()


def _from_numpy(a: np.ndarray, dtype_name: str) -> Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise BaselineFormatError(f"unknown torch dtype {dtype_name!r} in baseline metadata")
    t = torch.from_numpy(np.array(a, order="C", copy=True))  # (ascontiguousarray makes 0-d 1-d)
    if t.dtype == dtype:
        return t
    if t.element_size() != torch.empty(0, dtype=dtype).element_size():
        raise BaselineFormatError(f"stored array of {a.dtype} cannot hold {dtype_name}")
    return t.reshape(-1).view(dtype).reshape(t.shape)


def _byte_view(a: np.ndarray) -> np.ndarray:
    """[..., itemsize] uint8: bitwise comparison for every dtype (NaN==NaN if same bits, -0.0 != 0.0)."""
    a = np.array(a, order="C", copy=True)
    return a.reshape(-1).view(np.uint8).reshape(a.shape + (a.itemsize,))


def make_baseline(
    per_rank: list[Mapping[str, Any]], meta: Mapping[str, Any], *, local_world_size: int | None = None
) -> Baseline:
    """Build an in-memory :class:`Baseline` from every rank's arrays (what save_baseline writes).

    Args:
        per_rank: for rank r, {name: tensor} (any shape / dtype / device).
        meta: caller metadata with keys config (dict), seed, dtype; extra keys are kept.
        local_world_size: L, unless meta holds it (default: the world size, one node).
    """
    arrays: dict[str, Tensor] = {}
    for r, named in enumerate(per_rank):
        for name, t in named.items():
            if not isinstance(name, str) or not name or name.startswith("__"):
                raise ValueError(
                    f"rank {r}: array name {name!r} must be a non-empty str not starting with '__'"
                )
            if not isinstance(t, Tensor):
                raise TypeError(f"rank {r}: array {name!r} must be a torch.Tensor, got {type(t).__name__}")
            arrays[f"rank{r}/{name}"] = t.detach().cpu().contiguous()
    full = _build_meta(meta, len(per_rank), local_world_size)
    full["dtypes"] = {k: _dtype_name(v.dtype) for k, v in arrays.items()}
    return Baseline(arrays=arrays, meta=full)


def _write(path: str | os.PathLike[str], baseline: Baseline) -> None:
    entries = {k: _to_numpy(v) for k, v in baseline.arrays.items()}
    entries[META_KEY] = np.array(json.dumps(baseline.meta, sort_keys=True))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Through a file object so numpy does not append ".npz", and via a temporary file + rename so a
    # crash never leaves a half-written baseline behind.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **entries)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_baseline(path: str | os.PathLike[str]) -> Baseline:
    """Read a baseline written by :func:`save_baseline`.

    Args:
        path: the .npz file.

    Returns:
        The :class:`Baseline` (CPU tensors with their original torch dtypes).

    Raises:
        OSError: the file cannot be read. BaselineFormatError: not a baseline.
    """
    data = Path(path).read_bytes()
    if not data.startswith(_ZIP_MAGIC):  # numpy would try it as a pickle and talk of allow_pickle
        raise _not_a_baseline(path, data)
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as exc:
        raise BaselineFormatError(
            f"{path} is not a readable .npz file ({type(exc).__name__}: {exc}), so not a baseline; "
            f"{_MAKE_ONE}"
        ) from exc
    with npz:
        if META_KEY not in npz.files:
            raise BaselineFormatError(
                f"{path}: no {META_KEY} entry (an .npz archive, but not written by save_baseline); "
                f"{_MAKE_ONE}"
            )
        try:
            meta = json.loads(str(npz[META_KEY]))
        except json.JSONDecodeError as exc:
            raise BaselineFormatError(f"{path}: {META_KEY} is not valid JSON: {exc}") from exc
        dtypes = meta.get("dtypes", {})
        arrays = {}
        for key in npz.files:
            if key == META_KEY:
                continue
            if key not in dtypes:
                raise BaselineFormatError(f"{path}: array {key!r} has no dtype in the metadata")
            arrays[key] = _from_numpy(npz[key], dtypes[key])
    return Baseline(arrays=arrays, meta=meta, path=str(path))


# --------------------------------------------------------------------------------------------
# Comparing
# --------------------------------------------------------------------------------------------


def _fmt_value(t: Tensor) -> str:
    v = t.item()
    return repr(v) if isinstance(v, float) else str(v)


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in idx) + ")"


def _sort_key(key: str) -> tuple[int, str]:
    # "rank10/x" after "rank2/x": numeric rank order.
    head, _, name = key.partition("/")
    rank = head[4:]
    return (int(rank), name) if head.startswith("rank") and rank.isdigit() else (1 << 30, key)


def _compare_array(key: str, exp: Tensor, act: Tensor) -> str | None:
    """None if bit-identical, else a one-line description of the difference."""
    if exp.dtype != act.dtype:
        return f"{key}: dtype differs: expected {_dtype_name(exp.dtype)}, got {_dtype_name(act.dtype)}"
    if exp.shape != act.shape:
        return f"{key}: shape differs: expected {tuple(exp.shape)}, got {tuple(act.shape)}"
    diff = (_byte_view(_to_numpy(exp)) != _byte_view(_to_numpy(act))).any(axis=-1)
    n_diff = int(diff.sum())
    if n_diff == 0:
        return None
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    return (
        f"{key}: {n_diff} of {exp.numel()} elements differ, first at {_fmt_index(first)}: "
        f"expected {_fmt_value(exp[first])}, got {_fmt_value(act[first])}"
    )


def version_differences(expected: Any, actual: Any) -> list[str]:
    """``"package: expected X, got Y"`` for each package whose version both ``versions`` records hold and
    that differs between them, sorted by name.

    A package only one side records is no difference: the list of recorded packages has grown over time,
    so an older baseline names fewer of them than a current run.
    """
    if not isinstance(expected, Mapping) or not isinstance(actual, Mapping):
        return []
    return [
        f"{name}: expected {json.dumps(expected[name])}, got {json.dumps(actual[name])}"
        for name in sorted(set(expected) & set(actual))
        if expected[name] != actual[name]
    ]


def compare_baselines(expected: Baseline, actual: Baseline) -> Comparison:
    """Compare two baselines bit for bit.

    Args:
        expected: the reference baseline.
        actual: the baseline under test.

    Returns:
        A :class:`Comparison`; lines[0] is a summary such as "baseline: 12 arrays, 11 identical,
        1 differs: rank2/recv_x: 1 of 65536 elements differ, first at (3, 17): expected 1.5, got 1.5078125".

    Raises:
        BaselineConfigError: an identity key (config, seed, dtype, world_size, local_world_size) differs.
    """
    for key in IDENTITY_KEYS:
        e, a = expected.meta.get(key), actual.meta.get(key)
        if _canonical(e) != _canonical(a):
            raise BaselineConfigError(key, _canonical(e), _canonical(a))

    keys = sorted(set(expected.arrays) | set(actual.arrays), key=_sort_key)
    identical, differing, details = [], [], []
    for key in keys:
        if key not in actual.arrays:
            line = f"{key}: missing in actual"
        elif key not in expected.arrays:
            line = f"{key}: not in expected (extra array)"
        else:
            line = _compare_array(key, expected.arrays[key], actual.arrays[key])
        if line is None:
            identical.append(key)
        else:
            differing.append(key)
            details.append(line)

    n = len(keys)
    if not differing:
        summary = f"baseline: {n} arrays, all identical"
    else:
        verb = "differs" if len(differing) == 1 else "differ"
        shown = "; ".join(details[:_MAX_DETAILS_IN_SUMMARY])
        if len(details) > _MAX_DETAILS_IN_SUMMARY:
            shown += f"; ... ({len(details) - _MAX_DETAILS_IN_SUMMARY} more)"
        summary = f"baseline: {n} arrays, {len(identical)} identical, {len(differing)} {verb}: {shown}"
    lines = [summary] + [f"  {d}" for d in details]
    notes = []
    for key in REPORTED_KEYS:
        e, a = expected.meta.get(key), actual.meta.get(key)
        if key == "created":
            continue
        if key == "versions":
            changed = version_differences(e, a)
            if changed:
                notes.append(f"versions differ: {'; '.join(changed)}")
        elif e != a:
            notes.append(f"{key} differs: expected {json.dumps(e)}, got {json.dumps(a)}")
    if differing:  # a pass needs no explanation: a baseline from another device or commit is the point
        lines += [f"  note: {note}" for note in notes]
    return Comparison(
        passed=not differing, lines=lines, num_arrays=n, identical=identical, differing=differing,
        notes=notes,
    )


def check_baseline_config(
    path: str | os.PathLike[str],
    meta: Mapping[str, Any],
    *,
    world_size: int,
    local_world_size: int | None = None,
) -> None:
    """Raise unless the baseline at ``path`` was made with the configuration of a run of ``world_size``
    ranks that ``meta`` describes (as given to :func:`save_baseline`): a check from the metadata alone,
    before anything runs.

    Raises:
        OSError: the file cannot be read.
        BaselineFormatError: the file is not a baseline.
        BaselineConfigError: the baseline was made with another configuration.
    """
    empty = make_baseline([{} for _ in range(world_size)], meta, local_world_size=local_world_size)
    compare_baselines(load_baseline(path), empty)


# --------------------------------------------------------------------------------------------
# Distributed entry points
# --------------------------------------------------------------------------------------------


def _root(group: Any) -> int:
    """Global rank of the group's rank 0 (collectives take global ranks)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _gather_to_root(arrays: Mapping[str, Any], group: Any) -> list[dict[str, Any]] | None:
    """Every rank's arrays (as CPU tensors) on group rank 0; None elsewhere."""
    # Only moving to CPU before the collective: validation happens on rank 0 afterwards, so a bad
    # argument on one rank cannot make it skip the gather and hang the others.
    local = {k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in dict(arrays).items()}
    rank, world = world_of(group)
    if not dist.is_initialized():
        return [local]
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(local, out, dst=_root(group), group=group)
    return out


def _at_root(
    arrays: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    group: Any,
    local_world_size: int | None,
    action: Callable[[Baseline], Any],
) -> Any:
    """Gather every rank's arrays to rank 0, make their baseline there and return ``action(baseline)``
    on every rank (collective): its result, or the exception it (or making the baseline) raised on
    rank 0, is broadcast, so every rank returns the same result or raises the same exception."""
    rank, _ = world_of(group)
    gathered = _gather_to_root(arrays, group)
    outcome: Any = None
    if rank == 0:
        try:
            outcome = action(make_baseline(gathered, meta, local_world_size=local_world_size))
        except Exception as exc:  # shared with every rank, then raised everywhere
            outcome = exc
    outcome = broadcast_from_root(outcome, group)
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def save_baseline(
    path: str | os.PathLike[str],
    arrays: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    group: Any = None,
    *,
    local_world_size: int | None = None,
) -> None:
    """Gather every rank's arrays to rank 0 and write one compressed .npz there (collective).

    Args:
        path: output file (rank 0 writes it; parent folders are created).
        arrays: this rank's {name: tensor} (any shape / dtype / device); stored as "rank{r}/{name}".
        meta: keys config (dict), seed, dtype, plus any extras (JSON-serialisable; torch dtypes become
            their names). world_size, local_world_size, device, versions, git_sha, created and dtypes
            are added.
        group: the process group (None: default group, or a world of 1 without one).
        local_world_size: L, unless meta holds it (default: the world size).

    Raises:
        On every rank, whatever failed on rank 0 (bad arguments, write errors).
    """
    _at_root(arrays, meta, group, local_world_size, lambda baseline: _write(path, baseline))


def compare_to_baseline(
    path: str | os.PathLike[str],
    arrays: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    group: Any = None,
    *,
    local_world_size: int | None = None,
) -> Comparison:
    """Compare the running code's arrays against a saved baseline (collective).

    Every rank's arrays are gathered to rank 0, compared there with :func:`compare_baselines`, and the
    :class:`Comparison` (or the error) is broadcast, so every rank returns the same result or raises
    the same exception.

    Args:
        path: the expected baseline file.
        arrays: this rank's {name: tensor}, as given to :func:`save_baseline`.
        meta: this run's metadata (config, seed, dtype, ...), as given to :func:`save_baseline`.
        group: the process group (None: default group, or a world of 1 without one).
        local_world_size: L, unless meta holds it.

    Raises:
        BaselineConfigError: the baseline was made with another configuration.
    """
    return _at_root(
        arrays, meta, group, local_world_size, lambda actual: compare_baselines(load_baseline(path), actual)
    )
