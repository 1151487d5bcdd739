"""Worker of tests/test_elastic_torchrun.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29541 \
        tests/_torchrun_elastic_worker.py OUT_DIR

Runs ``cute_ep.validators.elastic_checks`` (plan and routing through ReferenceEpBuffer, weight and
gradient coherence, exact gradients), trains examples/echo_training.py's toy MoE with and without
cloning, and calls ElasticExperts with bad arguments; then writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import argparse

import torch
from _launch import REPO, gloo_worker_main, import_script, outcome  # tests/ is this script's sys.path[0]

from cute_ep.bootstrap.runtime import Runtime
from cute_ep.elastic import ElasticExperts
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.elastic_checks import coherence_check, exact_gradient_check, routing_check


def training(rt: Runtime) -> dict:
    """The example's two runs (4 steps, E = 4R): the largest weight difference relative to the largest
    weight, and each run's rows per rank per step and losses."""
    example = import_script(REPO / "examples" / "echo_training.py", "echo_training_example")
    args = argparse.Namespace(backend="reference", tokens=48, hidden=16, experts=4 * rt.env.world_size,
                              topk=2, spare_slots=2, skew=1.2, steps=4, lr=0.1, seed=3)
    runs = {name: example.train(args, rt, rt.cpu_group, cloning) for name, cloning in (("plain", False),
                                                                                        ("echo", True))}
    pairs = zip([runs["plain"]["experts"], *runs["plain"]["router"]],
                [runs["echo"]["experts"], *runs["echo"]["router"]], strict=True)
    diff = max(float((a - b).abs().max()) for a, b in pairs)
    scale = float(runs["plain"]["experts"].abs().max())
    return {"relative_diff": diff / max(scale, 1.0), "tolerance": example.TOLERANCE,
            **{f"{k}_{name}": run[k] for name, run in runs.items() for k in ("rows", "losses")}}


def results(rt: Runtime) -> dict:
    """This rank's findings (``gloo_worker_main`` writes them to OUT_DIR/rank{r}.json)."""
    cpu, group = torch.device("cpu"), rt.cpu_group
    make = lambda cfg: ReferenceEpBuffer(rt, cfg)  # noqa: E731
    R = rt.env.world_size
    return {
        "routing": routing_check(rt, make, cpu, group, steps=3),
        "routing_capped": routing_check(rt, make, cpu, group, steps=1, max_clones=1),
        "coherence": coherence_check(rt, cpu, group),
        "exact": exact_gradient_check(rt, make, cpu, group),
        "training": training(rt),
        "bad": {
            "experts": outcome(lambda: ElasticExperts(3 * R + 1, 1, group=group)),
            "idx": outcome(lambda: ElasticExperts(4 * R, 1, group=group).route(
                torch.zeros(4, dtype=torch.int64), None)),
        },
    }


if __name__ == "__main__":
    gloo_worker_main(results)
