"""Worker of tests/test_moe_layer_torchrun.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29533 \
        tests/_torchrun_moe_layer_worker.py OUT_DIR

Runs ``cute_ep.validators.moe_checks.layer_check`` for the cases of ``CASES`` (the reference backend)
and the first case again on the all-to-all backend, then the inference forward (``no_grad``) of the
first case against its autograd forward, and writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch
from _launch import gloo_worker_main  # tests/ is this script's sys.path[0]

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.moe_layer import receive_bound
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.moe_checks import (
    MoECase,
    case_inputs,
    global_weights,
    layer_check,
    make_layer,
    record_expert_rows,
    with_case,
)

BASE = MoECase("bf16-softmax", dtype=torch.bfloat16, experts_per_rank=2, topk=2)
CASES = (
    BASE,
    # DeepSeek-style: sigmoid scores, group-limited, normalized and scaled weights, a selection bias and
    # a shared expert; 3 of 4R experts per token.
    with_case(BASE, name="bf16-deepseek", experts_per_rank=4, topk=3, score="sigmoid", num_groups=4,
              topk_groups=2, normalize=True, route_scale=2.5, expert_bias=True, shared_intermediate=16),
    # fp32 with a host sync per dispatch (views of the real rows, no padding).
    with_case(BASE, name="fp32-sync-shared", dtype=torch.float32, sync=True, shared_intermediate=16),
)


def results(rt: Runtime) -> dict:
    """This rank's findings (``gloo_worker_main`` writes them to OUT_DIR/rank{r}.json)."""
    cpu = torch.device("cpu")
    out = {"cases": [layer_check(rt, lambda cfg: ReferenceEpBuffer(rt, cfg), cpu, c) for c in CASES]}
    a2a = layer_check(rt, lambda cfg: A2aEpBuffer(rt, cfg), cpu, with_case(BASE, name="bf16-softmax-a2a"))
    out["cases"].append(a2a)
    out["inference"] = inference(rt, BASE)
    return out


def inference(rt: Runtime, case: MoECase) -> dict:
    """The no_grad forward (the buffer's own calls; sync-free, so the GEMMs run over ``receive_bound``
    rows) against the autograd forward on this rank's tokens, and the bound against the capacity."""
    env, cpu = rt.env, torch.device("cpu")
    x, _ = case_inputs(case, env.rank)
    cfg = case.config(env.world_size, env.local_world_size)
    with ReferenceEpBuffer(rt, cfg) as buf:
        layer = make_layer(buf, case, global_weights(case, env.world_size), cpu)
        trained = layer(x).detach()
        gemm_rows = record_expert_rows(layer)  # the rows the experts' GEMMs ran over in the inference forward
        with torch.no_grad():
            inferred = layer(x)
    return {"equal": bool(torch.equal(inferred, trained)), "tokens": x.shape[0], "capacity": cfg.capacity,
            "bound": receive_bound(x.shape[0], cfg.topk, cfg.capacity, rt.cpu_group), "gemm_rows": gemm_rows}


if __name__ == "__main__":
    gloo_worker_main(results)
