"""Each rank's share of its GPU: the default num_sms, a budget above it refused on every rank, and the launch
(the GPU a rank binds, MPS, the world group) when ranks share a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from cute_ep.buffer import EpBuffer
from cute_ep.collectives import all_gather_objects
from cute_ep.kernels.config import ConfigError, EpConfig

pytestmark = pytest.mark.gpu


def _cfg(runtime, **kw) -> EpConfig:
    env = runtime.env
    return EpConfig(world_size=env.world_size, local_world_size=env.local_world_size,
                    num_experts=4 * env.world_size, topk=2, hidden=256, dtype=torch.bfloat16, max_tokens=16,
                    **kw)


def test_the_default_num_sms_is_the_least_share_and_more_is_refused(runtime):
    shares = all_gather_objects(runtime.sm_share, runtime.cpu_group)
    placement = runtime.placement
    # The whole GPU for a rank alone on it; ranks that share one hold at most half of it between them
    # (less where MPS limits this process to fewer SMs).
    limit = runtime.mps_sm_limit or runtime.device_sms
    ranks = placement.ranks_per_gpu
    split = runtime.device_sms if ranks == 1 else runtime.device_sms // (2 * ranks)
    assert runtime.sm_share == min(limit, split)
    assert ranks == 1 or runtime.sm_share * ranks <= runtime.device_sms // 2
    with EpBuffer(runtime, _cfg(runtime), registry=runtime.registry) as buf:
        assert buf.cfg.num_sms == min(shares)
        x = torch.randn(16, 256, device=runtime.device).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(buf.cfg.num_experts)[:2] for _ in range(16)]).to(runtime.device)
        w = torch.rand(16, 2, device=runtime.device)
        res = buf.dispatch(x, idx, w)  # the resolved budget runs: every CTA resident beside the other ranks'
        out = buf.combine(buf.expert_output(res.num_recv).copy_(res.recv_x), res.handle)
        assert torch.allclose(out.float(), (x.float() * w.sum(1, keepdim=True)), rtol=2e-2, atol=2e-2)
    # One SM more than the least share: refused on every rank alike, naming the share.
    above = dataclasses.replace(_cfg(runtime), num_sms=min(shares) + 1)
    with pytest.raises(ConfigError, match=f"num_sms must be at most .*{min(shares)}.*got {min(shares) + 1}"):
        EpBuffer(runtime, above, registry=runtime.registry)


def test_ranks_that_share_a_gpu_run_under_mps_on_a_gloo_group(runtime):
    placement = runtime.placement
    gpus = all_gather_objects((placement.gpu, str(torch.cuda.get_device_properties(runtime.device).uuid)),
                              runtime.cpu_group)
    local = [gpus[r] for r in range(runtime.env.world_size) if r // runtime.env.physical_local_world_size
             == runtime.env.rank // runtime.env.physical_local_world_size]
    # Local rank r binds GPU r % G, and the ranks that say they share a GPU are on the same device.
    assert placement.gpu == runtime.env.local_rank % placement.gpus
    assert sum(g == gpus[runtime.env.rank] for g in local) == placement.ranks_per_gpu
    if placement.shared:
        assert dist.get_backend() == "gloo"  # NCCL refuses two ranks on one GPU
        if placement.ranks_per_gpu > 1:
            assert runtime.mps is True
    else:
        assert dist.get_backend() != "gloo"
