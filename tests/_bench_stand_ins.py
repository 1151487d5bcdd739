"""Stand-ins for the GPU parts of scripts/benchmark.py and scripts/decode_breakdown.py, so that their
whole runs go over gloo on the CPU: the workers that tests/test_bench_report.py, test_bench_peers.py and
test_decode_report.py write (``_launch.write_worker``) import them.

``Launching`` stands in for EpBuffer (the torch reference with EpBuffer's two launches), ``StepTimer`` for
the CUDA-event timer, and ``deep_ep`` (opened by ``deepep_peer``, the drivers' ``make_deepep``) for
DeepEP: its intranode dispatch / combine semantics, slowly, over the group's all_gather_object.

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.tools import bench_peers as bp


class Launching(ReferenceEpBuffer):
    """ReferenceEpBuffer plus the sync-free launches of EpBuffer (here: synchronous)."""

    def launch_dispatch(self, x, idx, w, mode="scatter", fp8=False, layout="expert"):
        assert idx.dtype.itemsize == 4  # the script converts topk_idx to int32 once
        self.dispatch(x, idx, w, mode, fp8=fp8, layout=layout)

    def launch_cached_dispatch(self, x, handle, fp8=False):  # the same routing again: the rows land alike
        self.dispatch(x, handle.topk_idx, handle.topk_weights, fp8=fp8, layout=handle.layout)
        return handle

    def fp8_packed_rows(self, num_recv):  # EpBuffer's name for the packed FP8 receive rows
        return self._fp8_rows(num_recv)

    def launch_combine(self, handle, out, algorithm=None):  # y: the rows the sync-free views cover
        rank = handle.layout == "rank"  # one result, pulled or pushed: the reference takes no algorithm
        rows = self.cfg.rank_capacity if rank else self.cfg.capacity
        out.copy_(self.combine(self.expert_output(rows), handle, algorithm=None if rank else algorithm))

    def check_ran(self):  # the launches above are synchronous: nothing can be left unrun
        pass


class StepTimer:
    """The timer: rank r's iterations take 10 (r + 1) + i us (the median: 10 (r + 1) + 1)."""

    def __init__(self, runtime):
        self.runtime = runtime

    def run(self, step, warmup, iters):
        self.runtime.barrier()
        for i in range(warmup + 1 + iters):
            step(i)
        return [10.0 * (1 + self.runtime.env.rank) + i for i in range(iters)]


class Config:
    def __init__(self, num_sms, *rest):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self.num_sms * hidden_bytes * num_ranks


class Buffer:
    """DeepEP's intranode semantics, slowly, over the group's all_gather_object.

    ``made``: the SM count of every Buffer made, in order. ``short_on_rank0``: rank 0's dispatch receives
    a row too few (output the benchmark must refuse to time); ``fp8_scales_off_on_rank0``: rank 0's FP8
    dispatch receives wrong scales. x may be DeepEP's FP8 pair (values, scales).
    """

    num_sms = 20
    made = []
    short_on_rank0 = False
    fp8_scales_off_on_rank0 = False  # rank 0's FP8 receive: scales doubled (wrong output again)

    @staticmethod
    def set_num_sms(n):
        assert n % 2 == 0
        Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 explicitly_destroy=False, comm=None):
        self.group, self.sms = group, Buffer.num_sms
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        Buffer.made.append(self.sms)

    def _gather(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dtype == torch.int64
        el = num_experts // self.world
        owner = torch.where(topk_idx >= 0, topk_idx // el, torch.full_like(topk_idx, -1))
        in_rank = torch.stack([(owner == r).any(dim=1) for r in range(self.world)], dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        assert config.num_sms == self.sms, "a handle works at the SM count it was made with"
        cached = handle is not None
        if cached:
            assert topk_idx is None and topk_weights is None
        in_rank = handle[0] if cached else is_token_in_rank
        el = handle[2] if cached else num_tokens_per_expert.numel() // self.world
        rows, ids, ws, src = [], [], [], []
        fp8 = isinstance(x, tuple)  # DeepEP's FP8 pair; e4m3 does not pickle: it travels as bytes
        sent = (x[0].view(torch.uint8), x[1]) if fp8 else x
        for s, (xs, ins, idx, w) in enumerate(self._gather((sent, in_rank, topk_idx, topk_weights))):
            toks = torch.nonzero(ins[:, self.rank]).view(-1)
            rows.append((xs[0][toks].view(x[0].dtype), xs[1][toks]) if fp8 else xs[toks])
            src += [(s, int(t)) for t in toks]
            if idx is not None:
                loc = idx[toks] - self.rank * el
                mine = (idx[toks] >= 0) & (loc >= 0) & (loc < el)
                ids.append(torch.where(mine, loc, torch.full_like(loc, -1)))
                ws.append(torch.where(mine, w[toks], torch.zeros_like(w[toks])))
        recv_x = tuple(map(torch.cat, zip(*rows, strict=True))) if fp8 else torch.cat(rows)
        if Buffer.short_on_rank0 and self.rank == 0:
            recv_x = recv_x[1:]
        if Buffer.fp8_scales_off_on_rank0 and self.rank == 0 and isinstance(recv_x, tuple):
            recv_x = (recv_x[0], recv_x[1] * 2)
        if cached:
            return recv_x, None, None, None, None, None
        recv_idx = torch.cat(ids)
        counts = [int((recv_idx == j).sum()) for j in range(el)]
        return recv_x, recv_idx, torch.cat(ws), counts, (in_rank, src, el), None

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        assert config.num_sms == self.sms
        in_rank, src, _ = handle
        out = torch.zeros(in_rank.shape[0], x.shape[1], dtype=torch.float32)
        for ys, srcs in self._gather((x, src)):
            for row, (s, t) in zip(ys, srcs, strict=False):  # rank 0 may hold a row short
                if s == self.rank:
                    out[t] += row.float()
        return out.to(x.dtype), None, None

    def destroy(self):
        pass


deep_ep = types.ModuleType("deep_ep")
deep_ep.Buffer, deep_ep.Config = Buffer, Config


def deepep_peer(runtime, cfg, args):
    """The drivers' ``make_deepep`` on the stand-in: the CPU world passes DeepEP's device check only
    because this module is injected here."""
    return bp.DeepEpPeer(runtime.group, world_size=runtime.env.world_size, hidden=cfg.hidden,
                         num_experts=cfg.num_experts, module=deep_ep), None
