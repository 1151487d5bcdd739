"""Worker of tests/test_autograd_reference.py: one rank of a gloo world launched by torchrun.

To run (what the test does):
    python -m torch.distributed.run --nproc-per-node 4 --master-port 29531 \
        tests/_torchrun_autograd_worker.py OUT_DIR

Runs ``cute_ep.validators.autograd_checks`` (gradient check and two-layer MoE training) with the
reference backend on the CPU, and the mode constraint, then writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch
from _launch import gloo_worker_main  # tests/ is this script's sys.path[0]

from cute_ep import autograd as ep
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.reference_backend import ReferenceEpBuffer
from cute_ep.validators.autograd_checks import gradient_check, train


def results(rt: Runtime) -> dict:
    """This rank's findings (``gloo_worker_main`` writes them to OUT_DIR/rank{r}.json)."""
    cpu = torch.device("cpu")
    make = lambda cfg: ReferenceEpBuffer(rt, cfg)  # noqa: E731
    result = {"gradients": gradient_check(rt, make, cpu), "training": train(rt, make, cpu)}
    try:  # the mode constraint, on every rank alike
        ep.dispatch(None, torch.zeros(1, 16), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2),
                    mode="atomic")
    except ValueError as exc:
        result["atomic_error"] = str(exc)
    return result


if __name__ == "__main__":
    gloo_worker_main(results)
