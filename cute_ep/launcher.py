"""Calling a compiled ``EpModule`` from the host at the cost of its launches: ``Launcher``; and the kernels
compiled apart from it: ``PreparedCall``, ``CompiledApart``.

Host code only (nothing here is compiled into the module, so editing it invalidates no cached object).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cute_ep.kernels.buffers import BUFFERS, CALL_SCALARS, SIZE_SCALARS, Pointers
from cute_ep.kernels.host import launch_scalars


class Launcher:
    """Calls a compiled ``EpModule`` through argument storage that persists between calls.

    Why: the DSL's generic call converts every argument to C storage anew on each call (the bundle's 20
    scalars and 30 pointers: about 50 us of host time per launch, measured on a 2-core CPU machine),
    and even its run on prepared storage packs the address list again (one ctypes conversion per
    argument: 10-15 us per launch on the H200 test host). A launch changes only the call's scalars, a
    few pointers and the stream. So the storage is made once, from the module's own argument conversion
    (``generate_execution_args``), and so is the packed address list the compiled host function takes
    (``packed_runner``); a launch writes the values that change into the storage and calls that
    function.

    compiled: the module (as ``ModuleRegistry.get`` returns it); sizes: ``size_scalars(cfg)``; pointers:
    a ``Pointers`` with every field set (the per-call ones to any valid stand-in).
    """

    def __init__(self, compiled, sizes: tuple, pointers: Pointers, rank: int) -> None:
        import ctypes

        import cuda.bindings.driver as cuda

        self._compiled = compiled
        self._keep = (sizes, pointers, cuda.CUstream(0))  # the storage the address list points into
        scalars = launch_scalars(sizes, **dict.fromkeys(CALL_SCALARS, 0))
        count = len(CALL_SCALARS) + len(SIZE_SCALARS) + len(BUFFERS) + 1  # and the stream
        exe, self._adapted, addrs = argument_storage(compiled, (scalars, pointers, self._keep[2]), count)
        self._exe = exe
        self.scalars = {n: ctypes.c_int32.from_address(addrs[i]) for i, n in enumerate(CALL_SCALARS)}
        first = len(CALL_SCALARS) + len(SIZE_SCALARS)
        self.pointers = {b.name: ctypes.c_uint64.from_address(addrs[first + j])
                         for j, b in enumerate(BUFFERS)}
        self.stream = ctypes.c_uint64.from_address(addrs[-1])
        self.scalars["rank"].value = rank
        self._run = packed_runner(compiled, exe)

    def __call__(self, stream: int, pointers: Mapping[str, int], **scalars: int) -> None:
        """One launch: ``scalars`` (names of ``CALL_SCALARS``, others keep their values), the device
        addresses of the buffers this call names (others keep theirs), and the CUDA stream handle."""
        for name, value in scalars.items():
            self.scalars[name].value = value
        for name, addr in pointers.items():
            self.pointers[name].value = addr
        self.stream.value = stream
        self._run()


class PreparedCall:
    """Calls a compiled function with separate arguments (pointers, int32 scalars, the stream) through
    argument storage made once, as ``Launcher`` does for the module's bundle: a call writes each
    argument's new value into its storage and runs the packed address list (``packed_runner``), with
    none of the DSL's per-call conversion (nor a ``make_ptr`` per pointer).

    compiled: the function; args: stand-ins of its arguments, in order (``make_ptr`` pointers, ``Int32``
    scalars, a ``CUstream``), kept alive here (the storage is theirs); kinds: per argument "ptr",
    "i32" or "stream".
    """

    _SLOT = {"ptr": "c_uint64", "i32": "c_int32", "stream": "c_uint64"}

    def __init__(self, compiled, args: tuple, kinds: tuple[str, ...]) -> None:
        import ctypes

        if len(args) != len(kinds) or any(k not in self._SLOT for k in kinds):
            raise ValueError(f"kinds must name each of the {len(args)} arguments as one of "
                             f"{sorted(self._SLOT)}, got {kinds}")
        exe, adapted, addrs = argument_storage(compiled, args, len(args))
        self._keep = (args, adapted, exe)
        self._compiled = compiled
        self.slots = [getattr(ctypes, self._SLOT[k]).from_address(a)
                      for k, a in zip(kinds, addrs, strict=True)]
        self._run = self._first_run

    def __call__(self, *values: int) -> None:
        """One call with these argument values (device addresses, integers, the raw stream handle)."""
        for slot, value in zip(self.slots, values, strict=True):
            slot.value = value
        self._run()

    def _first_run(self) -> None:
        """The first call binds the function to the current device (``bound_to_device``) and keeps the
        packed runner for every later call."""
        self._run = packed_runner(bound_to_device(self._compiled), self._keep[2])
        self._run()


class CompiledApart:
    """Base of the launches of kernels compiled apart from the module (no NVSHMEM, registered with
    nothing): the registry they compile or load through, and their ``PreparedCall``s, one per variant,
    made on first use under one lock, which also guards each call's shared argument storage.

    registry: a ``cute_ep.bootstrap.compile.ModuleRegistry`` that registers nothing; default: a new one
    keeping ``max_alive`` functions, which honours ``CUTE_EP_COMPILE_CACHE``."""

    max_alive = 2

    def __init__(self, registry: Any = None) -> None:
        if registry is None:
            from cute_ep.bootstrap.compile import ModuleRegistry

            registry = ModuleRegistry(register=False, max_alive=self.max_alive)
        self.registry = registry
        self._lock = threading.Lock()
        self._calls: dict[Any, PreparedCall] = {}

    def _prepared(self, variant: Any, spec: Callable[[], tuple]) -> PreparedCall:
        """The ``PreparedCall`` of ``variant``, made once from ``spec()`` = (compile key, build, argument
        stand-ins, their kinds): ``registry.get(key, build)`` called through the stand-ins. Why prepared:
        the DSL's own call converts every argument anew each time; why ``spec`` is called only to make
        it: the stand-ins (the DSL's pointer and integer objects) took about 25 us of host time per call
        on an H200 host (2026-11-28)."""
        call = self._calls.get(variant)  # made once: a plain read after that
        if call is not None:
            return call
        with self._lock:
            call = self._calls.get(variant)
            if call is None:
                key, build, args, kinds = spec()
                call = self._calls[variant] = PreparedCall(self.registry.get(key, build), args, kinds)
            return call


def one_per_process(make: Callable[[], Any]) -> Callable[[], Any]:
    """A function returning the process's one ``make()``, made at its first call (under a lock, so
    threads share it too)."""
    lock = threading.Lock()
    made: list = []

    def shared() -> Any:
        with lock:
            if not made:
                made.append(make())
            return made[0]

    return shared


def bound_to_device(compiled):
    """``compiled`` as the DSL's executor on the current device: a function compiled apart and never
    registered with NVSHMEM (which binds it) has no packed-argument members until bound, and its own call
    binds it anew under a lock and packs the address list on every call (under cProfile on a 2x H200
    host, 2026-11-28: 55 us per padded-layout call that way, 10 us per packed run of the bound module).
    Unchanged where already bound, or where it cannot be (a test's stand-in)."""
    if hasattr(compiled, "cuda_result") or not hasattr(compiled, "to"):
        return compiled
    return compiled.to(None)


def argument_storage(compiled, args: tuple, count: int) -> tuple[list, object, list[int]]:
    """``compiled``'s own C storage for ``args`` (``generate_execution_args``): (the storage list, the
    adapted arguments it belongs to, the address of each argument's storage). RuntimeError unless there
    are ``count`` addresses (the compiled function's argument layout is not the one expected)."""
    exe, adapted = compiled.generate_execution_args(*args)
    addrs = [a if isinstance(a, int) else a.value for a in exe]
    if len(addrs) != count:
        raise RuntimeError(f"unexpected argument layout of the compiled function: {len(addrs)} storage "
                           f"addresses, {count} expected")
    return exe, adapted, addrs


def packed_runner(compiled, exe: list) -> Callable[[], None]:
    """A function that runs ``compiled`` on the argument storage ``exe`` points into.

    The DSL's ``run_compiled_program`` packs ``exe`` (one address per argument, plus the module's own
    trailing ones: its result word and kernel handles) into a ctypes array on every call; here that array
    is packed once and the compiled host function is called on it directly, its result checked as the DSL
    does. A module without those members (another DSL version, a test's stand-in) runs through
    ``run_compiled_program``."""
    import ctypes

    try:
        capi, result, extra = compiled.capi_func, compiled.cuda_result, compiled._num_extra_args
        packed = compiled._get_invoke_packed_args(exe)
    except AttributeError:
        return lambda: compiled.run_compiled_program(exe)
    total = len(exe) + extra
    own = (ctypes.c_void_p * total)(*packed[:total])  # ours: the DSL reuses its array on every call

    def run() -> None:
        capi(own)
        if result is not None and result.value != 0:
            raise RuntimeError(f"launching the cute-ep module failed: {cuda_error_name(result.value)}")

    return run


def cuda_error_name(code: int) -> str:
    """``cudaErrorX (code): description`` for a CUDA runtime error code."""
    try:
        import cuda.bindings.runtime as cudart

        err = cudart.cudaError_t(code)
        name, text = cudart.cudaGetErrorName(err)[1], cudart.cudaGetErrorString(err)[1]
        return f"{name.decode()} ({code}): {text.decode()}"
    except (ImportError, ValueError):
        return f"CUDA error {code}"


def current_stream_handle(device_index: int) -> int:
    """The raw handle of device ``device_index``'s current CUDA stream, through torch's own accessor (~0.2 us
    of host time; ``torch.cuda.current_stream`` builds a Stream object first). Builds of torch without it
    (CPU-only ones) take the public path."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return raw(device_index)


def storage_addresses(own: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[int, int, int]:
    """The device addresses of a dispatch handle's own (slots, ids, weights), as a launch takes them;
    ``ValueError`` for ids or weights the kernels could not read as 4-byte words."""
    slots, ids, weights = (t.data_ptr() for t in own)
    for name, addr in (("own_idx", ids), ("own_w", weights)):
        if addr % 4:
            raise ValueError(f"{name} must be 4-byte aligned, got address {addr:#x}")
    return slots, ids, weights


def delivery_scalars(cfg, device: torch.device, deliver: tuple[int, tuple[torch.Tensor, ...]],
                     addrs: dict[str, int]) -> dict[str, int]:
    """The launch scalars of a dispatch that copies its first ``rows`` received rows into ``parts``
    (``EpBuffer.launch_dispatch``'s ``deliver`` = (rows, parts)); the parts' addresses go into ``addrs``.
    ``ValueError`` for a part the kernel could not write as asked (kernels/deliver.py)."""
    rows, parts = deliver
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"deliver takes 1 to 3 parts, got {len(parts)}")
    scalars, end = {"deliver_rows": min(int(rows), cfg.capacity)}, 0
    for i, part in enumerate(parts):
        width = part.shape[1] * part.element_size() if part.dim() == 2 else -1
        addr = part.data_ptr() if part.device == device else -1
        if width < 0 or width % 4 or not part.is_contiguous() or part.shape[0] < rows or addr % 16:
            raise ValueError(f"deliver part {i} must be a contiguous 2-D tensor of at least {rows} rows on "
                             f"{device}, 16-byte aligned, its rows a multiple of 4 bytes; got shape "
                             f"{tuple(part.shape)}, strides {part.stride()}, on {part.device}"
                             + (f", address {addr:#x}" if addr >= 0 else ""))
        end += width
        addrs[f"deliver{i}"] = addr
        scalars[f"deliver_end{i}"] = end
    row_bytes = cfg.hidden * cfg.element_size
    if end > row_bytes:
        raise ValueError(f"deliver's parts take {end} bytes of each row; a received row has {row_bytes}")
    for i in range(len(parts), 3):  # the absent parts: empty
        scalars[f"deliver_end{i}"] = end
    return scalars


def assembly_scalars(cfg, device: torch.device, num_tokens: int, assemble: tuple[torch.Tensor, torch.Tensor],
                     addrs: dict[str, int]) -> dict[str, int]:
    """The launch scalars of a dispatch whose rows of x the same launch puts together first from
    ``assemble`` = (values, words) (``EpBuffer.launch_dispatch``'s ``assemble``); their addresses go into
    ``addrs``. ``ValueError`` for parts the kernel could not read as asked (kernels/assemble.py)."""
    values, words = assemble
    width = values.shape[1] * values.element_size() if values.dim() == 2 else -1
    if (width < 0 or width % 4 or not values.is_contiguous() or values.shape[0] != num_tokens
            or values.device != device or values.data_ptr() % 4):
        raise ValueError(f"assemble's values must be a contiguous 2-D tensor of {num_tokens} rows (x's) "
                         f"on {device}, its rows a multiple of 4 bytes; got shape {tuple(values.shape)}, "
                         f"strides {values.stride()}, on {values.device}")
    if (words.dim() != 2 or words.element_size() != 4 or words.shape[0] != num_tokens
            or words.device != device or min(words.stride()) < 0 or words.data_ptr() % 4):
        raise ValueError(f"assemble's words must be a 2-D tensor of 4-byte elements, {num_tokens} rows "
                         f"(x's), on {device}, any strides >= 0; got {words.dtype} of shape "
                         f"{tuple(words.shape)}, strides {words.stride()}, on {words.device}")
    end = width + 4 * words.shape[1]
    row_bytes = cfg.hidden * cfg.element_size
    if end > row_bytes:
        raise ValueError(f"assemble's values and words take {end} bytes of each row; a row of x has "
                         f"{row_bytes}")
    addrs["assemble0"], addrs["assemble1"] = values.data_ptr(), words.data_ptr()
    t_stride, j_stride = words.stride()
    return {"assemble_rows": num_tokens, "assemble_end0": width, "assemble_end1": end,
            "assemble_stride_t": t_stride, "assemble_stride_j": j_stride}
