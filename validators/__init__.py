"""Proving a run correct: distributed checks of the layout, dispatch, combine and capacity drops
against the torch references (``cute_ep.reference``), bit-identical ``.npz`` baselines, and the
autograd checks shared by the CPU and GPU tests.

    from cute_ep.validators import check_dispatch, report
    result = check_dispatch(x, topk_idx, w, res.recv_x, res.recv_weights, res.recv_src, max_tokens=M,
                            num_experts=E, local_world_size=L, group=g)   # collective, bit for bit
    ok = report(result, "dispatch", g, print)

Validators may import the library; the library never imports them.
"""

from cute_ep.validators.baseline import (
    Baseline,
    BaselineConfigError,
    BaselineFormatError,
    compare_baselines,
    compare_to_baseline,
    load_baseline,
    make_baseline,
    save_baseline,
)
from cute_ep.validators.checks import (
    CheckResult,
    check_capacity_drops,
    check_combine,
    check_dispatch,
    check_layout,
    check_rank_combine,
    check_rank_dispatch,
    format_summary,
    report,
)

__all__ = [
    "Baseline",
    "BaselineConfigError",
    "BaselineFormatError",
    "CheckResult",
    "check_capacity_drops",
    "check_combine",
    "check_dispatch",
    "check_layout",
    "check_rank_combine",
    "check_rank_dispatch",
    "compare_baselines",
    "compare_to_baseline",
    "format_summary",
    "load_baseline",
    "make_baseline",
    "report",
    "save_baseline",
]
