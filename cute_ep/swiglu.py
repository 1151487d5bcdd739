"""SwiGLU over the expert-major receive buffer, touching only its live rows (``offset_swiglu``).

    offs = torch.cumsum(res.tokens_per_expert, 0, dtype=torch.int32)   # the grouped GEMM's offsets
    gate_up = grouped_mm(res.recv_x, w_gate_up, offs)                   # [N, 2I]
    act = offset_swiglu(gate_up, offs)                                  # [N, I], differentiable

After ``dispatch(..., sync=False)`` the buffer has ``cfg.capacity`` rows and only the first
``offs[-1]`` are live (the grouped GEMMs ignore the rest). ``offset_swiglu`` computes
act = dtype(silu(float(g)) * float(u)) with g = gate_up[:, :I], u = gate_up[:, I:] on the live rows and
leaves the others untouched (they are never read or written), in the forward and in the backward, with
no host sync. Three implementations, the same numbers on the live rows:

* ``"kernel"``: the CuTe DSL kernels of ``cute_ep/kernels/swiglu.py`` (GPU): they read ``offs[-1]`` on
  the device and visit only the tiles holding live rows. Compiled on first use, once per direction and
  element type (a few seconds; ``CUTE_EP_COMPILE_CACHE`` keeps the objects like the EP module's).
* ``"torch"``: the same arithmetic in torch. On the CPU it reads the live count (no device to sync) and
  computes the live rows only; on a GPU it computes every row and keeps the padding rows' old contents
  with a device-side mask (no sync, but it pays for the whole buffer). The reference of the kernel.
* ``"plain"``: ``swiglu_plain`` over the whole buffer, padding included: what the others are measured
  against.

``"auto"`` picks the kernel on a CUDA device when CuTe DSL imports, else the torch version. The backward
is torch's ``silu_backward`` formula in fp32: d_gate = d * u * s * (1 + g * (1 - s)) with s = sigmoid(g),
d_up = d * silu(g), each rounded once to the element type (bit-identical on the CPU to autograd through
``swiglu_plain``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "IMPLS",
    "offset_swiglu",
    "swiglu_backward_plain",
    "swiglu_backward_torch",
    "swiglu_plain",
    "swiglu_torch",
]

IMPLS = ("auto", "kernel", "torch", "plain")
"""``offset_swiglu(..., impl=...)`` choices (module docstring)."""

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CTAS_PER_SM = 4  # 256-thread CTAs: 4 per SM keep half the SM's threads busy between tiles
MAX_ELEMENTS = 2**31 - 1  # the kernels index rows x columns in int32


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------


def _check(gate_up: Tensor, offsets: Tensor | None = None, grad_out: Tensor | None = None) -> int:
    """Validate the arguments; return I (half of gate_up's width)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [N, 2 * I] (an even width), got shape {list(gate_up.shape)}")
    if not gate_up.dtype.is_floating_point:
        raise ValueError(f"gate_up must be a floating-point tensor, got {gate_up.dtype}")
    inter = gate_up.shape[1] // 2
    if offsets is not None:
        if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype != torch.int32:
            raise ValueError(
                f"offsets must be a non-empty 1-D int32 tensor (the grouped GEMM's offs), got "
                f"{offsets.dtype} of shape {list(offsets.shape)}"
            )
        if offsets.device != gate_up.device:
            raise ValueError(f"offsets must be on gate_up's device {gate_up.device}, got {offsets.device}")
    bad_grad = grad_out is not None and (
        grad_out.shape != (gate_up.shape[0], inter) or grad_out.dtype != gate_up.dtype
        or grad_out.device != gate_up.device
    )
    if bad_grad:
        raise ValueError(
            f"grad_out must be [{gate_up.shape[0]}, {inter}] {gate_up.dtype} on {gate_up.device}, got "
            f"{list(grad_out.shape)} {grad_out.dtype} on {grad_out.device}"
        )
    return inter


def _check_out(out: Tensor, shape: tuple[int, int], like: Tensor, name: str) -> None:
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{name} must be {list(shape)} {like.dtype} on {like.device}, got {list(out.shape)} {out.dtype} "
            f"on {out.device}"
        )


# --------------------------------------------------------------------------------------------------
# torch implementations
# --------------------------------------------------------------------------------------------------


def swiglu_plain(gate_up: Tensor) -> Tensor:
    """dtype(silu(float(g)) * float(u)) over every row of gate_up [N, 2I]: [N, I] (differentiable)."""
    inter = _check(gate_up)
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    return (F.silu(g.float()) * u.float()).to(gate_up.dtype)


def swiglu_backward_plain(gate_up: Tensor, grad_out: Tensor) -> Tensor:
    """The gradient of ``swiglu_plain`` with respect to gate_up [N, 2I], every row: [N, 2I]."""
    inter = _check(gate_up, grad_out=grad_out)
    g, u = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    d = grad_out.float()
    # The operations autograd runs for swiglu_plain, in its order: the products' backward, then silu's.
    d_gate = torch.ops.aten.silu_backward(d * u, g)
    d_up = d * F.silu(g)
    return torch.cat([d_gate, d_up], dim=1).to(gate_up.dtype)


def _live_count(offsets: Tensor, rows: int) -> int:
    """min(offsets[-1], rows) clamped at 0: on the CPU only (reading a CUDA tensor would sync)."""
    return max(0, min(int(offsets[-1]), rows))


def _live_mask(offsets: Tensor, rows: int) -> Tensor:
    """[rows, 1] bool on the device: row < offsets[-1] (no host sync)."""
    return (torch.arange(rows, device=offsets.device) < offsets[-1:].to(torch.int64))[:, None]


def swiglu_torch(gate_up: Tensor, offsets: Tensor, out: Tensor | None = None) -> Tensor:
    """``swiglu_plain`` on the live rows r < offsets[-1] of gate_up [N, 2I] into out [N, I] (allocated if
    None; its other rows are left as they were). Returns out."""
    inter = _check(gate_up, offsets)
    n = gate_up.shape[0]
    if out is None:
        out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    _check_out(out, (n, inter), gate_up, "out")
    if gate_up.device.type == "cpu":
        live = _live_count(offsets, n)
        out[:live] = swiglu_plain(gate_up[:live])
    else:
        out.copy_(torch.where(_live_mask(offsets, n), swiglu_plain(gate_up), out))
    return out


def swiglu_backward_torch(gate_up: Tensor, grad_out: Tensor, offsets: Tensor,
                          grad: Tensor | None = None) -> Tensor:
    """``swiglu_backward_plain`` on the live rows into grad [N, 2I] (allocated if None; its other rows
    are left as they were). Returns grad."""
    _check(gate_up, offsets, grad_out)
    n = gate_up.shape[0]
    if grad is None:
        grad = torch.empty_like(gate_up)
    _check_out(grad, tuple(gate_up.shape), gate_up, "grad")
    if gate_up.device.type == "cpu":
        live = _live_count(offsets, n)
        grad[:live] = swiglu_backward_plain(gate_up[:live], grad_out[:live])
    else:
        grad.copy_(torch.where(_live_mask(offsets, n), swiglu_backward_plain(gate_up, grad_out), grad))
    return grad


# --------------------------------------------------------------------------------------------------
# the CuTe DSL kernels (GPU)
# --------------------------------------------------------------------------------------------------


class SwiGLUKernels:
    """The compiled forward and backward kernels of ``cute_ep/kernels/swiglu.py`` and their launch.

    One compiled function per (direction, element type), made on first use (``registry``: a
    ``cute_ep.bootstrap.compile.ModuleRegistry`` without NVSHMEM registration; default: a new one, which
    honours ``CUTE_EP_COMPILE_CACHE``). Every size is a launch argument.
    """

    def __init__(self, registry: Any = None) -> None:
        if registry is None:
            from cute_ep.bootstrap.compile import ModuleRegistry

            registry = ModuleRegistry(register=False, max_alive=8)
        self.registry = registry
        self._lock = threading.Lock()
        self._sms: dict[int, int] = {}

    def compiled(self, direction: str, dtype: torch.dtype) -> Any:
        """The compiled ``SwiGLUForward`` ("forward") or ``SwiGLUBackward`` ("backward") for ``dtype``."""
        from cute_ep.kernels import swiglu as k

        if dtype not in _KERNEL_DTYPES:
            raise ValueError(f"the SwiGLU kernels take {[str(d) for d in _KERNEL_DTYPES]}, got {dtype}")
        with self._lock:
            return self.registry.get(k.compile_key(direction, dtype), lambda: k.build(direction, dtype))

    def _ctas(self, device: torch.device, rows: int, inter: int, dtype: torch.dtype) -> int:
        from cute_ep.kernels.swiglu import worst_case_tiles

        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sms:
            self._sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return max(1, min(self._sms[index] * CTAS_PER_SM, worst_case_tiles(rows, inter, dtype)))

    @staticmethod
    def _check_kernel_args(gate_up: Tensor, *others: Tensor) -> None:
        inter = gate_up.shape[1] // 2
        vec = 16 // gate_up.element_size()
        if inter % vec:
            raise ValueError(
                f"the SwiGLU kernels move 128-bit vectors: I = {inter} must be a multiple of {vec} for "
                f"{gate_up.dtype}"
            )
        if gate_up.numel() > MAX_ELEMENTS:
            raise ValueError(
                f"the SwiGLU kernels index in int32: gate_up has {gate_up.numel()} elements, more than "
                f"{MAX_ELEMENTS}"
            )
        for t in (gate_up, *others):
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError("the SwiGLU kernels need contiguous, 16-byte aligned tensors")

    @staticmethod
    def _pointer(t: Tensor, align: int) -> Any:
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        from cute_ep.kernels.config import cute_dtype

        elem = cutlass.Int32 if t.dtype == torch.int32 else cute_dtype(t.dtype)
        return make_ptr(elem, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)

    def _launch(self, direction: str, gate_up: Tensor, tensors: tuple[Tensor, ...], offsets: Tensor) -> None:
        import cuda.bindings.driver as cuda
        from cutlass import Int32

        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        if rows == 0:
            return
        fn = self.compiled(direction, gate_up.dtype)
        stream = torch.cuda.current_stream(gate_up.device).cuda_stream
        ptrs = [self._pointer(t, 16) for t in (gate_up, *tensors)]
        fn(*ptrs, self._pointer(offsets, 4), Int32(rows), Int32(inter), Int32(offsets.numel()),
           Int32(self._ctas(gate_up.device, rows, inter, gate_up.dtype)), cuda.CUstream(stream))

    def load(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compile (or load) both kernels of ``dtype`` and put them on ``device`` now, with one launch each
        over a row that is not live, then wait for it: the DSL loads a compiled kernel's CUDA library at its
        first launch, and made there inside a step, with 8 ranks on one H100 under CUDA MPS, a layer's first
        backward was found waiting in the SwiGLU backward's library load while the peers' combine timed
        out (``PeerTimeout: combine on rank 0: rank 3 did not signal``, 2026-11-27)."""
        vec = 16 // torch.empty((), dtype=dtype).element_size()
        gate_up = torch.zeros(1, 2 * vec, dtype=dtype, device=device)
        none_live = torch.zeros(1, dtype=torch.int32, device=device)
        self.forward(gate_up, none_live, torch.empty(1, vec, dtype=dtype, device=device))
        self.backward(gate_up, torch.zeros(1, vec, dtype=dtype, device=device), none_live,
                      torch.empty_like(gate_up))
        torch.cuda.synchronize(device)

    def forward(self, gate_up: Tensor, offsets: Tensor, out: Tensor) -> Tensor:
        """out[:offsets[-1]] = SwiGLU of gate_up's live rows, enqueued on the current stream."""
        self._check_kernel_args(gate_up, out)
        offsets = offsets.contiguous()
        self._launch("forward", gate_up, (out,), offsets)
        return out

    def backward(self, gate_up: Tensor, grad_out: Tensor, offsets: Tensor, grad: Tensor) -> Tensor:
        """grad[:offsets[-1]] = the SwiGLU gradient of the live rows, enqueued on the current stream."""
        self._check_kernel_args(gate_up, grad_out, grad)
        offsets = offsets.contiguous()
        self._launch("backward", gate_up, (grad_out, grad), offsets)
        return grad


_KERNELS: SwiGLUKernels | None = None


def kernels() -> SwiGLUKernels:
    """The process's ``SwiGLUKernels`` (made on first use)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = SwiGLUKernels()
    return _KERNELS


def kernel_available(device: torch.device) -> bool:
    """Whether ``impl="auto"`` takes the CuTe DSL kernel on ``device``: CUDA, and the DSL imports."""
    if device.type != "cuda":
        return False
    try:
        import cutlass.cute  # noqa: F401
    except Exception:  # not installed, or a broken build: the torch version serves
        return False
    return True


def resolve_impl(impl: str, device: torch.device) -> str:
    """"kernel", "torch" or "plain" for ``impl`` on ``device``; ValueError for an unknown name or the
    kernel off a CUDA device."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "kernel" if kernel_available(device) else "torch"
    if impl == "kernel" and device.type != "cuda":
        raise ValueError(f"impl='kernel' runs on a CUDA device, got a tensor on {device}")
    return impl


# --------------------------------------------------------------------------------------------------
# the differentiable entry point
# --------------------------------------------------------------------------------------------------


class _OffsetSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate_up: Tensor, offsets: Tensor, impl: str) -> Tensor:
        gate_up = gate_up.contiguous()
        n, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
        if impl == "kernel":
            kernels().forward(gate_up, offsets, out)
        else:
            swiglu_torch(gate_up, offsets, out)
        ctx.save_for_backward(gate_up, offsets)
        ctx.impl = impl
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        gate_up, offsets = ctx.saved_tensors
        grad_out = grad_out.to(gate_up.dtype).contiguous()
        grad = torch.empty_like(gate_up)
        if ctx.impl == "kernel":
            kernels().backward(gate_up, grad_out, offsets, grad)
        else:
            swiglu_backward_torch(gate_up, grad_out, offsets, grad)
        return grad, None, None


def offset_swiglu(gate_up: Tensor, offsets: Tensor, impl: str = "auto") -> Tensor:
    """SwiGLU of the live rows r < offsets[-1] of gate_up [N, 2I]: a new [N, I] tensor (differentiable
    in gate_up) whose other rows are left unwritten (never read them), and whose gradient's other rows
    are too.

    offsets: [G] int32 on gate_up's device, the inclusive prefix sum of the per-expert row counts (the
    grouped GEMM's ``offs``). impl: "auto", "kernel", "torch" or "plain" (module docstring; "plain"
    computes every row). No host sync on a GPU.
    """
    _check(gate_up, offsets)
    which = resolve_impl(impl, gate_up.device)
    if which == "plain":
        return swiglu_plain(gate_up)
    return _OffsetSwiGLU.apply(gate_up, offsets, which)
