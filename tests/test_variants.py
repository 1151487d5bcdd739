"""The variant declaration (kernels/variants.py): every variant's kernels exist in the module, each
kernel has one launch site, the host's scalars select the declared variant, and the buffers a variant
alone uses are allocated exactly where a configuration can run it."""

from __future__ import annotations

import pytest
import torch

from cute_ep.kernels.buffers import BY_NAME as BUFFERS_BY_NAME
from cute_ep.kernels.config import EpConfig
from cute_ep.kernels.variants import (
    BY_NAME,
    COMBINE_PULL,
    COMBINE_REDUCED,
    COMBINE_STEP,
    DISPATCH_STEP,
    LAYOUT_EXPERT,
    LAYOUT_LOW_LATENCY,
    LAYOUT_RANK,
    LAYOUT_STEP,
    READS_Y,
    VARIANTS,
    Variant,
    variant,
)


def _cfg(**kw) -> EpConfig:
    base = dict(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=64, dtype=torch.bfloat16,
                max_tokens=16, num_sms=4)
    return EpConfig(**(base | kw))


def test_every_declared_kernel_is_a_module_kernel():
    from cute_ep.kernels.module import EpModule

    module = EpModule(object)  # the kernel classes keep the dtype; nothing is traced here
    for v in VARIANTS:
        for name in v.layout_kernels + v.dispatch_kernels + v.combine_kernels:
            assert callable(getattr(module, name)), (v.name, name)


def test_each_kernel_has_one_launch_site():
    # The module emits one launch per (step, key): a kernel named under two keys would get two entry points.
    steps = (LAYOUT_STEP, DISPATCH_STEP, COMBINE_STEP)
    sites = [name for step in steps for _, names in step for name in names]
    assert len(sites) == len(set(sites)) == 13
    assert dict(COMBINE_STEP) == {(LAYOUT_EXPERT, COMBINE_PULL): ("combine",),
                                  (LAYOUT_EXPERT, COMBINE_REDUCED): ("reduce_push", "partial_sum"),
                                  (LAYOUT_RANK, COMBINE_PULL): ("rank_combine",),
                                  (LAYOUT_RANK, COMBINE_REDUCED): ("rank_push", "rank_sum"),
                                  (LAYOUT_LOW_LATENCY, COMBINE_PULL): ("low_latency_combine",)}
    # the combines that read the caller's y themselves (no staging kernel before them)
    assert set(READS_Y) == {(LAYOUT_RANK, COMBINE_REDUCED), (LAYOUT_LOW_LATENCY, COMBINE_PULL)}
    assert dict(DISPATCH_STEP)[LAYOUT_EXPERT] == ("dispatch", "fanout")  # the fan-out right after
    # the low-latency layout: no layout step (its dispatch counts on the sender), one kernel each way
    assert dict(DISPATCH_STEP)[LAYOUT_LOW_LATENCY] == ("low_latency_dispatch",)
    assert dict(LAYOUT_STEP)[LAYOUT_LOW_LATENCY] == ()


def test_the_host_scalars_select_the_declared_variant():
    assert variant("expert", "pull").scalars == {"layout": LAYOUT_EXPERT, "combine_algo": COMBINE_PULL}
    assert variant("expert", "reduced").scalars == {"layout": LAYOUT_EXPERT, "combine_algo": COMBINE_REDUCED}
    # the rank layout's one result, pulled (the default) or pushed (a reduced buffer's)
    assert variant("rank", "pull") is variant("rank") is BY_NAME["rank"]
    assert variant("rank").scalars == {"layout": LAYOUT_RANK, "combine_algo": COMBINE_PULL}
    assert variant("rank", "reduced").scalars == {"layout": LAYOUT_RANK, "combine_algo": COMBINE_REDUCED}
    assert variant("rank", "reduced").combine_kernels == ("rank_push", "rank_sum")
    for v in VARIANTS:
        key = (v.layout, v.combine)
        assert key in dict(COMBINE_STEP) and dict(COMBINE_STEP)[key] == v.combine_kernels


def test_bad_names_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"layout must be one of \['expert', 'rank'\], got 'token'"):
        variant("token", "pull")
    with pytest.raises(ValueError, match="combine algorithm must be one of .*got 'push'"):
        variant("expert", "push")
    with pytest.raises(ValueError, match="got None"):
        variant("expert")


def test_two_variants_sharing_a_step_must_launch_the_same_kernels(monkeypatch):
    from cute_ep.kernels import variants

    clash = Variant("expert+other", LAYOUT_EXPERT, 7, ("rank_layout",), ("dispatch", "fanout"), ("combine",),
                    runs=lambda c: True)
    monkeypatch.setattr(variants, "VARIANTS", (*VARIANTS, clash))
    with pytest.raises(ValueError, match="launch different kernels in one step"):
        variants._steps(lambda v: v.layout_kernels, lambda v: v.layout)


@pytest.mark.parametrize("combine,capacity_factor", [("pull", 0.0), ("reduced", 0.0), ("pull", 1.5),
                                                     ("reduced", 2.0)])
def test_buffers_of_one_variant_follow_whether_the_config_runs_it(combine, capacity_factor):
    cfg = _cfg(combine_algorithm=combine, capacity_factor=capacity_factor)
    runs = {v.name for v in VARIANTS if v.runs(cfg)}
    assert "expert+pull" in runs
    assert ("expert+reduced" in runs) == (combine == "reduced")
    assert ("rank" in runs) == (capacity_factor == 0)
    assert ("rank+reduced" in runs) == (capacity_factor == 0 and combine == "reduced")
    for name in ("recv_topk_idx", "recv_topk_w"):
        assert BUFFERS_BY_NAME[name].is_needed(cfg) == ("rank" in runs)
    assert BUFFERS_BY_NAME["recv_group"].is_needed(cfg)  # the fan-out's groups, with either combine
    assert BUFFERS_BY_NAME["partials"].is_needed(cfg) == ("expert+reduced" in runs)
    full = BUFFERS_BY_NAME["partials"].alloc_shape(cfg)
    assert (len(full) == 2) == (combine == "reduced")  # else a one-piece placeholder
