"""``Buffer.get_dispatch_layout`` on a GPU in one launch: the compiled ``TokenLayoutKernel``
(kernels/token_layout.py) and its call. Its results equal ``cute_ep.deep_ep.normal.dispatch_layout``'s,
the torch form the CPU backends use (and the GPU where the kernel's bounds do not hold).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from cute_ep.launcher import CompiledApart, current_stream_handle, one_per_process
from cute_ep.spare import SpareOutputs

__all__ = ["TokenLayout"]

_ID_TYPES = {torch.int64: "int64", torch.int32: "int32"}
# the kernel's arguments (kernels/token_layout.py): topk_idx, in_rank, per_rank, per_expert, T, K, E, R,
# stream
_KINDS = ("ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "stream")


class TokenLayout(CompiledApart):
    """The layout launch and its compiled functions, one per id type, made on first use (``registry``: see
    ``cute_ep.launcher.CompiledApart``)."""

    max_alive = 4

    def __init__(self, registry: Any = None) -> None:
        super().__init__(registry)
        self._spare = SpareOutputs(_outputs)  # the next calls' outputs, made while this one's kernel runs

    @staticmethod
    def fits(topk_idx: Tensor, num_experts: int, num_ranks: int, *, on_gpu: bool | None = None) -> bool:
        """Whether the kernel takes this layout: CUDA ids (``on_gpu`` overrides the device check) of int64
        or int32, E and R within its shared-memory bounds, sizes that index in int32."""
        on_gpu = topk_idx.is_cuda if on_gpu is None else on_gpu
        t, k = topk_idx.shape
        max_experts, max_ranks = _bounds()
        return (on_gpu and topk_idx.dtype in _ID_TYPES and num_experts <= max_experts
                and num_ranks <= max_ranks and t * max(k, num_ranks) < 2**31)

    def compiled(self, id_dtype: torch.dtype) -> Any:
        """The compiled layout for topk_idx of ``id_dtype`` (torch.int64 or torch.int32)."""
        with self._lock:
            return self.registry.get(*_source(_ID_TYPES[id_dtype]))

    def prepared(self, id_dtype: torch.dtype) -> Any:
        """The compiled layout for ``id_dtype`` behind a ``cute_ep.launcher.PreparedCall`` (made once)."""
        return self._prepared(id_dtype, lambda: _spec(_ID_TYPES[id_dtype]))

    def __call__(self, topk_idx: Tensor, num_experts: int, num_ranks: int) -> tuple[Tensor, Tensor, Tensor]:
        """(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)
        of topk_idx [T, K] (``fits``), enqueued on the current stream; new tensors, no host sync."""
        ids = topk_idx.contiguous()
        t, k = ids.shape
        dev = ids.device
        stream = current_stream_handle(dev.index)
        key = (t, num_ranks, num_experts, dev, stream)
        call = self.prepared(ids.dtype)
        with self._lock:  # the call's argument storage, and the outputs made ahead, are shared
            per_rank, per_expert, in_rank = got = self._spare.take(key)
            call(ids.data_ptr(), in_rank.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(), t, k,
                 num_experts, num_ranks, stream)
            self._spare.refill(key, 4 * (num_ranks + num_experts) + t * num_ranks)  # while the kernel runs
        return got


def _outputs(key: tuple, n: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``n`` new sets of (num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank
    [T, R] bool) for ``TokenLayout``'s key (T, R, E, device, stream): one allocation per output, unbound into
    the sets' contiguous views (``cute_ep.spare``)."""
    t, r, e, dev, _ = key
    return list(zip(torch.empty((n, r), dtype=torch.int32, device=dev).unbind(0),
                    torch.empty((n, e), dtype=torch.int32, device=dev).unbind(0),
                    torch.empty((n, t, r), dtype=torch.bool, device=dev).unbind(0), strict=True))


@functools.cache
def _bounds() -> tuple[int, int]:
    """The kernel's (MAX_EXPERTS, MAX_RANKS), imported once (an import statement per call costs host time)."""
    from cute_ep.kernels.token_layout import MAX_EXPERTS, MAX_RANKS

    return MAX_EXPERTS, MAX_RANKS


def _source(name: str) -> tuple:
    """The layout's (compile key, build) for ids of type ``name``."""
    from cute_ep.kernels import token_layout as k

    return k.compile_key(name), lambda: k.build(name)


def _spec(name: str) -> tuple:
    """The layout's (compile key, build, argument stand-ins, their kinds) for ids of type ``name``."""
    from cute_ep.kernels import token_layout as k

    return *_source(name), k.example_args(name), _KINDS


shared_token_layout = one_per_process(TokenLayout)
"""The process's ``TokenLayout`` (its compiled functions serve every Buffer)."""
