"""One compiled module holding the layout, dispatch (+ fan-out) and combine kernels (pull, or the
reduced combine's two phases) of one element type, and the rank layout's dispatch and combine.

Why one module: each module that calls NVSHMEM must be registered with ``nvshmem.core.library_init``,
and on a 4x H200 host a process faulted ("illegal memory access") once a 4th registered module was
alive; compiling one also takes tens of seconds (NVSHMEM's device library is linked in). With all
kernels behind one host entry point (``op`` picks the launch) and every size a run-time argument, one
registration per dtype serves every configuration.

Arguments: the launch's ``Scalars`` and one raw device pointer per buffer (``Pointers``, in the order of
``kernels.buffers.BUFFERS``), so a call builds no DLPack views. Every kernel receives both in one
``EpParams`` bundle, whose ``p.<buffer>`` is the buffer as a CuTe tensor with the row-major layout of its
table shape.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from cute_ep.kernels.assemble import AssembleKernel
from cute_ep.kernels.buffers import EpParams, Pointers, Scalars
from cute_ep.kernels.combine import CombineKernel
from cute_ep.kernels.config import OP_COMBINE, OP_DISPATCH, OP_LAYOUT
from cute_ep.kernels.deliver import DeliverKernel
from cute_ep.kernels.dispatch import DispatchKernel
from cute_ep.kernels.fanout import FanoutKernel
from cute_ep.kernels.layout import LayoutKernel
from cute_ep.kernels.low_latency_combine import LowLatencyCombineKernel
from cute_ep.kernels.low_latency_dispatch import LowLatencyDispatchKernel
from cute_ep.kernels.partial_sum import PartialSumKernel
from cute_ep.kernels.rank_combine import RankCombineKernel, RankSumKernel
from cute_ep.kernels.rank_dispatch import RankDispatchKernel
from cute_ep.kernels.rank_layout import RankLayoutKernel
from cute_ep.kernels.rank_push import RankPushKernel
from cute_ep.kernels.reduce_push import ReducePushKernel
from cute_ep.kernels.stage_y import StageYKernel
from cute_ep.kernels.variants import COMBINE_STEP, DISPATCH_STEP, LAYOUT_STEP, READS_Y


class EpModule:
    """Host entry point: ``scalars.op`` selects the launch: OP_LAYOUT the layout alone, OP_DISPATCH the
    layout (none when ``routed`` is not 0: the latest layout's slots are reused) and the dispatch (+
    fan-out; before them, when ``assemble_rows`` is not 0, the assembly of x's rows from the caller's
    parts; after them, when ``deliver_rows`` is not 0, the delivery of the received rows into the
    caller's tensors), OP_COMBINE the combine (after the staging of the caller's y when
    ``y_rows`` is not 0 and the variant does not read y itself); ``scalars.layout`` and
    ``scalars.combine_algo`` the variant (kernels/variants.py) whose kernels run. Every kernel a variant
    names is an attribute here."""

    def __init__(self, dtype) -> None:
        self.dtype = dtype
        self.layout = LayoutKernel(dtype)
        self.rank_layout = RankLayoutKernel(dtype)
        self.dispatch = DispatchKernel(dtype)
        self.rank_dispatch = RankDispatchKernel(dtype)
        self.fanout = FanoutKernel(dtype)
        self.combine = CombineKernel(dtype)
        self.rank_combine = RankCombineKernel(dtype)
        self.rank_push = RankPushKernel(dtype)
        self.rank_sum = RankSumKernel(dtype)
        self.reduce_push = ReducePushKernel(dtype)
        self.partial_sum = PartialSumKernel(dtype)
        self.stage_y = StageYKernel(dtype)
        self.deliver = DeliverKernel(dtype)
        self.assemble = AssembleKernel(dtype)
        self.low_latency_dispatch = LowLatencyDispatchKernel(dtype)
        self.low_latency_combine = LowLatencyCombineKernel(dtype)

    @cute.jit
    def __call__(self, scalars: Scalars, pointers: Pointers, stream):
        p = EpParams(*scalars, *pointers)
        # A dispatch's rows put together from the caller's parts first (kernels/assemble.py), when it asks.
        if p.op == OP_DISPATCH:
            if p.assemble_rows != 0:
                self.assemble(p, stream)
        # The layout: alone, or before a dispatch of more than layout_in_dispatch tokens (up to that the
        # dispatch kernel runs its steps).
        layout_kernel = Int32(0)
        if p.op == OP_LAYOUT:
            layout_kernel = Int32(1)
        if p.op == OP_DISPATCH:
            if p.routed == 0:  # a routed dispatch sends on the slots of the latest layout: none runs
                if p.num_tokens > p.layout_in_dispatch:
                    layout_kernel = Int32(1)
        # Each step launches what the call's variant declares (kernels/variants.py), in order on one
        # stream; the loops run at trace time, so every kernel has one launch site.
        if layout_kernel != 0:
            for layout, kernels in LAYOUT_STEP:
                if p.layout == layout:
                    self.launch(kernels, p, stream)
        if p.op == OP_DISPATCH:
            for layout, kernels in DISPATCH_STEP:
                if p.layout == layout:
                    self.launch(kernels, p, stream)
            # The received rows copied into the caller's tensors (kernels/deliver.py), when it asks.
            if p.deliver_rows != 0:
                self.deliver(p, stream)
        if p.op == OP_COMBINE:
            # The combines that read recv_y: the caller's y (when it is not recv_y) is staged there first,
            # on the device, so a sync-free combine copies only the rows received (variants that read the
            # caller's y themselves, READS_Y, do not).
            if p.y_rows != 0:
                staged = Int32(1)
                for layout, combine in READS_Y:
                    if p.layout == layout:
                        if p.combine_algo == combine:
                            staged = Int32(0)
                if staged != 0:
                    self.stage_y(p, stream)
            for (layout, combine), kernels in COMBINE_STEP:
                if p.layout == layout:
                    if p.combine_algo == combine:
                        self.launch(kernels, p, stream)

    def launch(self, kernels: tuple[str, ...], p: EpParams, stream) -> None:
        """Launch the named kernels in order on ``stream``."""
        for name in kernels:
            getattr(self, name)(p, stream)
