"""``ModuleLaunch``: the one launch of an ``EpBuffer``'s compiled module (part of
``cute_ep.buffer.EpBuffer``), through which every dispatch, combine and low-latency call enqueues its kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from cute_ep.kernels.config import OP_COMBINE, OP_DISPATCH, OP_LAYOUT, PHASE_ALL, PHASE_RECEIVE
from cute_ep.launcher import assembly_scalars, current_stream_handle, delivery_scalars

__all__ = ["ModuleLaunch"]


class ModuleLaunch:
    """``_launch`` of an ``EpBuffer``: it uses the buffer's ``cfg``, ``device``, ``_device_index``,
    ``scatter``, ``_launcher`` (a ``cute_ep.launcher.Launcher``), ``_empty_addr`` / ``_align`` (the
    per-call tensors' stand-in addresses and alignments) and ``_calls`` (launches per operation)."""

    cfg: Any
    device: torch.device
    _device_index: int
    scatter: torch.Tensor
    _launcher: Any
    _empty_addr: dict[str, int]
    _align: dict[str, int]
    _calls: list[int]
    _latest_scatter: torch.Tensor | None
    _sent: Any

    def _launch(self, op: int, num_tokens: int, *, x=None, idx=None, w=None, out=None, scatter=None, y=None,
                own=None, mirror_seq: int = 0, mode: int = 0, fp8: bool | int = False, algo: int = 0,
                combine_algo: int = 0, layout: int = 0, y_rows: int = 0, y_slot=None, named=None,
                phase: int = PHASE_ALL, deliver: tuple[int, tuple[torch.Tensor, ...]] | None = None,
                assemble: tuple[torch.Tensor, torch.Tensor] | None = None, routed: int = 0) -> None:
        """Enqueue one op of the module on the current stream (absent or empty per-call tensors: their
        stand-ins). ``scatter``: the slots to read (default the buffer's); ``own``: the addresses of the
        handle's own (slots, ids, weights), see ``EpBuffer._enqueue_dispatch``; ``y`` / ``y_rows`` /
        ``y_slot``: see ``EpBuffer._staging``; ``named``: more call tensors by buffer name; ``phase``:
        PHASE_* of the low-latency layout (its receiving half completes the op its sending half counted);
        ``deliver``, ``assemble``: see ``EpBuffer.launch_dispatch``; ``routed``: launch_cached_dispatch's."""
        # The stand-ins' addresses, then the tensors given (most are absent; each read costs host time: this
        # loop 1.6 us instead of 3.7 for a combine's tensors, 2-core CPU, 2026-11-28).
        addrs = dict(self._empty_addr)
        if own is None:
            addrs["scatter"] = (self.scatter if scatter is None else scatter).data_ptr()
        else:  # addresses, checked where they came from (``storage_addresses``, or dispatch's own block)
            addrs["scatter"], addrs["own_idx"], addrs["own_w"] = own
        for name, tensor in (("x", x), ("topk_idx", idx), ("topk_w", w), ("out", out), ("y", y),
                             ("y_slot", y_slot), *(named or {}).items()):
            if tensor is not None and tensor.numel():
                addr = addrs[name] = tensor.data_ptr()
                if addr % self._align[name]:
                    raise ValueError(f"{name} must be {self._align[name]}-byte aligned, got address "
                                     f"{addr:#x}")
        delivered = {"deliver_rows": 0, "assemble_rows": 0}
        if deliver is not None and deliver[0] > 0:
            delivered |= delivery_scalars(self.cfg, self.device, deliver, addrs)
        if assemble is not None:
            delivered |= assembly_scalars(self.cfg, self.device, num_tokens, assemble, addrs)
        self._launcher(current_stream_handle(self._device_index), addrs, op=op, mode=mode,
                       fp8=int(fp8), algo=algo, combine_algo=combine_algo, layout=layout,
                       num_tokens=num_tokens, own_routing=int(own is not None), routed=routed,
                       mirror_seq=mirror_seq, y_rows=y_rows, y_gather=int(y_slot is not None), phase=phase,
                       **delivered)
        if op != OP_COMBINE:  # a layout rewrites the count a later combine's staging or push reads
            self._latest_scatter = self._sent = None
        if phase != PHASE_RECEIVE and not torch.cuda.is_current_stream_capturing():  # replays: not counted
            for ran in (OP_LAYOUT, OP_DISPATCH) if op == OP_DISPATCH else (op,):  # OP_DISPATCH: both
                self._calls[ran] += 1
