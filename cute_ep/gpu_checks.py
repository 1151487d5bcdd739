"""The GPU buffer's own checks, beyond the backend-neutral ``cute_ep.input_checks``: a runtime that can
carry it, and what its kernels need of a call's arguments (shared memory for the rank layout, routing
tensors they read where they are, the handle the reduced combine weights rows with). Messages name the
constraint and the value. Importing this module imports no GPU library.
"""

from __future__ import annotations

from typing import Any

import torch

from cute_ep.api import DispatchHandle
from cute_ep.input_checks import check_combine_layout, check_layout, resolve_combine_algorithm
from cute_ep.kernels.config import LAYOUT_SMEM_INTS, EpConfig

__all__ = ["check_gpu_runtime", "check_kernel_handle", "check_kernel_layout", "check_reduced_handle",
           "is_latest_dispatch"]


def check_gpu_runtime(runtime: Any) -> None:
    """RuntimeError unless ``runtime`` can carry the GPU backend: CUDA present and a Runtime started with
    backend "nvshmem" (its device a GPU). The message names the CPU backends, so that a machine without
    CUDA gets the way out instead of torch's "Torch not compiled with CUDA enabled" from deep inside."""
    cpu_way = ('on a CPU use cute_ep.ReferenceEpBuffer(runtime, cfg) (or A2aEpBuffer) on '
               'Runtime(env, backend="gloo")')
    if not torch.cuda.is_available():
        raise RuntimeError(
            "EpBuffer runs the CuTe kernels on a CUDA GPU, and torch.cuda.is_available() is False here; "
            + cpu_way
        )
    backend, device = getattr(runtime, "backend", None), getattr(runtime, "device", None)
    if backend != "nvshmem" or device is None or device.type != "cuda":
        raise RuntimeError(
            f'EpBuffer needs a started Runtime(env, backend="nvshmem") (one GPU per rank), got backend='
            f"{backend!r} with device {device}; ReferenceEpBuffer and A2aEpBuffer run on "
            'Runtime(env, backend="gloo")'
        )


def check_kernel_layout(cfg: EpConfig, layout: str, mode: str, fp8: bool) -> None:
    """``check_layout``, and for the rank layout the layout kernel's shared-memory limit."""
    check_layout(cfg, layout, mode, fp8)
    if layout == "rank" and 2 * cfg.num_experts + cfg.world_size > LAYOUT_SMEM_INTS:
        raise ValueError(  # the layout kernel's per-warp counts of experts and ranks in shared memory
            f"layout='rank' needs 2 * num_experts + world_size <= {LAYOUT_SMEM_INTS}, got "
            f"{2 * cfg.num_experts + cfg.world_size}"
        )


def check_kernel_handle(handle: DispatchHandle) -> None:
    """The kernels read the handle's ids as contiguous int32 and its weights as contiguous fp32 where
    they are (``check_combine_input`` has checked the shapes and the other dtypes)."""
    idx, w = handle.topk_idx, handle.topk_weights
    if idx.dtype != torch.int32 or not idx.is_contiguous():
        raise ValueError(
            f"handle.topk_idx must be contiguous int32 for the kernels, got {idx.dtype} with stride "
            f"{idx.stride()}: pass topk_idx.to(torch.int32).contiguous()"
        )
    if not w.is_contiguous():
        raise ValueError(
            f"handle.topk_weights must be contiguous for the kernels, got stride {w.stride()}: pass "
            f"topk_weights.contiguous()"
        )


def is_latest_dispatch(handle: DispatchHandle, sent: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether ``handle`` is the buffer's latest dispatch's: its routing tensors are ``sent`` (the ones that
    dispatch's kernels read; None: no dispatch since the last layout), so what the buffer holds of that
    dispatch (its count, source tags, group lists) is this handle's."""
    return sent is not None and handle.topk_idx is sent[0] and handle.topk_weights is sent[1]


def check_reduced_handle(cfg: EpConfig, handle: DispatchHandle, algorithm: str | None,
                         sent: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The combine's layout and algorithm; an expert-layout reduced combine also needs the handle of the
    buffer's latest dispatch, whose routing tensors are ``sent`` (None: no dispatch yet)."""
    if check_combine_layout(handle, algorithm) == "rank":
        return
    if resolve_combine_algorithm(cfg, algorithm) != "reduced":
        return
    if not is_latest_dispatch(handle, sent):
        raise ValueError(
            "combine algorithm 'reduced' weights rows with the weights the latest dispatch sent: pass "
            "that dispatch's handle unchanged (this one has other ids or weights, or comes from an "
            "earlier dispatch), or use algorithm='pull'"
        )
