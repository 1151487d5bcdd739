"""Proving a run correct: distributed checks of the layout, dispatch, combine and capacity drops
against the torch references (``cute_ep.reference``), bit-identical ``.npz`` baselines, and the
autograd checks shared by the CPU and GPU tests.

    from cute_ep.validators import check_dispatch, report
    result = check_dispatch(x, topk_idx, w, res.recv_x, res.recv_weights, res.recv_src, max_tokens=M,
                            num_experts=E, local_world_size=L, group=g)   # collective, bit for bit
    ok = report(result, "dispatch", g, print)

Validators may import the library; the library never imports them.
"""

from cute_ep.validators import baseline, checks

# The package offers each module's public names, as the module's __all__ lists them: one list to keep.
from cute_ep.validators.baseline import *  # noqa: F403
from cute_ep.validators.checks import *  # noqa: F403

__all__ = [*baseline.__all__, *checks.__all__]
