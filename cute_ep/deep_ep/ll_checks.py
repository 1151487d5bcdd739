"""The low-latency calls' argument checks (``LowLatencyChecks``, a part of ``LowLatencyMode``), run on this
rank: on the kernels' backend once per argument signature (``_ll_agreed``), since a signature that passed
passes again; on the host backends on every call, where they also compare ids that would cost a GPU a
host sync.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from cute_ep.deep_ep.checks import _ID_DTYPES, _check_row_dtype, check_expert_ids, check_tensors
from cute_ep.deep_ep.handles import LowLatencyHandle, _LowLatencyRoute

__all__ = ["LowLatencyChecks"]


class LowLatencyChecks:
    """``LowLatencyMode``'s argument checks. They read what the Buffer's other parts set (``backend``,
    ``device``, ``group_size``, ``_ll_index``, ``_agreed``, ``_route``, ``_check_device``,
    ``_check_num_experts``) and ``LowLatencyMode``'s ``_ll_kept_of`` and ``_staging``."""

    def _ll_signature(self, args: tuple) -> tuple | None:
        """``_signature(args)`` on the kernels' backend (its checks and graphs are kept by it), else None."""
        return _signature(args) if self.backend == "cute" else None

    def _ll_agreed(self, what: str, sig: tuple | None, check: Callable[[], Any],
                   same: Callable[[Any], dict[str, Any]]) -> Any:
        """``_agreed(what, check, same, synced=False)``; on the kernels' backend only once per signature
        ``sig`` of the call's arguments (``_ll_signature``; None where it has none): there a low-latency
        call agrees with no peer (it is sync-free) and its checks read only what the signature holds (the
        tensors' types, shapes, dtypes, strides and devices, and the plain values), so a signature that
        passed passes again. Why: the checks took about 35 us of host time per call on a 2x H200 host
        (cProfile, 2026-11-28), a tenth of a low-latency pair. Returns ``check()``'s result, or None when
        skipped."""
        seen = self._ll_kept_of(("agreed",), dict)
        if sig is not None and (what, sig) in seen:
            return None
        result = self._agreed(what, check, same, synced=False)
        if sig is not None:
            if len(seen) >= _MAX_SIGNATURES:  # many token counts and shapes: start over
                seen.clear()
            seen[what, sig] = True
        return result

    def _ll_combine_args(self, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, zero_copy: bool,
                         out: Any, both_flags: bool) -> tuple[_LowLatencyRoute, Tensor]:
        """``low_latency_combine``'s arguments checked on this rank: (the handle's route, the rows to read:
        x, or with ``zero_copy`` the next staging tensor)."""
        if both_flags:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        route = self._route(handle, LowLatencyHandle).cute_ep
        world, el = self.group_size, route.num_experts // self.group_size
        slots, hidden, t = world * route.max_tokens, route.hidden, route.num_tokens
        k = route.dispatch_handle.topk_idx.shape[1]
        check_tensors(self.device, x=(x, f"[{el}, {slots}, {hidden}] bfloat16", torch.bfloat16),
                      topk_idx=(topk_idx, f"[{t}, {k}] int64", torch.int64),
                      topk_weights=(topk_weights, f"[{t}, {k}] float32", torch.float32),
                      out=(out, f"[{t}, {hidden}] bfloat16", torch.bfloat16))
        src = self._staging(route)[self._ll_index] if zero_copy else x
        if tuple(src.shape) != (el, slots, hidden):
            raise ValueError(f"x must be [{el}, {slots}, {hidden}] (local experts, ranks x "
                             f"num_max_dispatch_tokens_per_rank, hidden: the dispatch's padded layout), got "
                             f"{list(src.shape)}")
        _check_row_dtype("x", src, " (combine sums in float32)")
        if tuple(topk_idx.shape) != (t, k) or topk_idx.dtype not in _ID_DTYPES:
            raise ValueError(f"topk_idx must be [{t}, {k}] int64 (the dispatch's), got "
                             f"{list(topk_idx.shape)} {topk_idx.dtype}")
        if tuple(topk_weights.shape) != (t, k) or topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_weights must be [{t}, {k}] float32, got {list(topk_weights.shape)} "
                             f"{topk_weights.dtype}")
        if out is not None and (tuple(out.shape) != (t, hidden) or out.dtype != src.dtype):
            raise ValueError(f"out must be [{t}, {hidden}] {src.dtype}, got {list(out.shape)} {out.dtype}")
        self._check_device(x=src, topk_idx=topk_idx, topk_weights=topk_weights, out=out)
        if self.backend == "reference" or not topk_idx.is_cuda:  # on a GPU: a host sync, so not checked
            self._check_same_ids(topk_idx, route.dispatch_handle.topk_idx)
        return route, src

    @staticmethod
    def _check_same_ids(topk_idx: Tensor, sent: Tensor) -> None:
        """low_latency_combine's ids: the dispatch's, or -1 (the pair is skipped)."""
        differ = (topk_idx >= 0) & (topk_idx.long() != sent.long())
        if bool(differ.any()):
            t, j = (int(i) for i in differ.nonzero()[0])
            raise ValueError(f"topk_idx must be the ids low_latency_dispatch was given, or -1 to skip a "
                             f"pair, got {int(topk_idx[t, j])} at [{t}, {j}] where the dispatch had "
                             f"{int(sent[t, j])}")

    def _ll_dispatch_args(self, x: Any, topk_idx: Any, m: Any, num_experts: Any, stats: Any, use_fp8: bool,
                          round_scale: bool, use_ue8m0: bool, async_finish: bool,
                          return_recv_hook: bool) -> None:
        """``low_latency_dispatch``'s arguments checked on this rank."""
        check_tensors(self.device, x=(x, "[T, H] bfloat16", torch.bfloat16),
                      topk_idx=(topk_idx, "[T, K] int64", torch.int64),
                      cumulative_local_expert_recv_stats=(stats, "[El] int32", torch.int32))
        self._check_ll_inputs(x, topk_idx, m, num_experts, use_fp8)
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (as DeepEP)")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set (as DeepEP)")
        el = num_experts // self.group_size
        if stats is not None and (tuple(stats.shape) != (el,) or stats.dtype != torch.int32):
            raise ValueError(f"cumulative_local_expert_recv_stats must be [{el}] int32, got "
                             f"{list(stats.shape)} {stats.dtype}")
        self._check_device(x=x, topk_idx=topk_idx, cumulative_local_expert_recv_stats=stats)
        if self.backend == "reference" or not topk_idx.is_cuda:  # on a GPU the kernels check them
            check_expert_ids(topk_idx, num_experts)

    def _check_ll_inputs(self, x: Tensor, topk_idx: Tensor, m: Any, num_experts: Any, use_fp8: bool) -> None:
        if x.dim() != 2 or (x.shape[1] * x.element_size()) % 16:
            raise ValueError(f"x must be [T, H] with rows a multiple of 16 bytes, got {list(x.shape)} "
                             f"{x.dtype}")
        _check_row_dtype("x", x)
        if use_fp8 and x.shape[1] % 128:
            raise ValueError(f"use_fp8 needs hidden to be a multiple of 128, got {x.shape[1]}")
        if not isinstance(m, numbers.Integral) or m < 1:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be an int >= 1, got {m!r}")
        if x.shape[0] > m:
            raise ValueError(f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={m}")
        t = x.shape[0]
        if topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_idx.dtype not in _ID_DTYPES:
            raise ValueError(f"topk_idx must be [{t}, K] int64, got {list(topk_idx.shape)} {topk_idx.dtype}")
        self._check_num_experts(num_experts)


_MAX_SIGNATURES = 1024  # argument signatures (and token counts) remembered per Buffer before starting over


def _signature(args: tuple) -> tuple | None:
    """``args`` with each tensor replaced by what a low-latency call's checks read of it (type, shape,
    dtype, device, strides), if the result is hashable; else None. Its callers, ``low_latency_dispatch``
    and ``low_latency_combine``, run under ``without_function_modes``: a caller's default device sees none
    of these reads."""
    try:
        sig = tuple((type(a), a.shape, a.dtype, a.device, a.stride()) if isinstance(a, Tensor) else a
                    for a in args)
        hash(sig)
    except TypeError:
        return None
    return sig
