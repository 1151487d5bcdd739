"""The coverage sweep on real GPUs: top-k 1, 2, 8, 9, 16, 32, 33 and 64 in both receive layouts, both
expert-layout combines, FP8 dispatch, 16-byte rows, hidden 7168 and sizes that are not powers of two, 288
experts, a rank without tokens and every token on one expert (set), each checked bit for bit.

The table and the runner are ``cute_ep.validators.sweep`` (its docstring says what each call checks); the
same runner passes every case on the CPU reference backend in tests/test_coverage_sweep_cpu.py. Each case
builds one ``EpBuffer`` (num_sms: at most 16, within this rank's share of its GPU) and runs its two or
three calls on fresh inputs (a function of the case, the call and the rank), on receive buffers poisoned
before every dispatch: the expert layout's layout, rows, weights and source tags against the torch
reference (in order in scatter mode, per (expert, source) group in atomic mode; FP8 rows as the buffer's
packed bytes, padding included) and its combine(s) bit-identical to ``reference_combine`` /
``reference_combine_reduced``; the rank layout's every received field against
``reference_dispatch_rank_layout`` and its combine against ``reference_combine_rank_layout``. Every kernel
must have completed (``check_ran``) after each call. Every check is collective with its verdict reduced
over the ranks, and the report (every rank's failures) is the same on every rank, so the ranks fail
together.

Launch (one process per GPU, or several per GPU under MPS; see scripts/run_gpu_tests.sh):
    torchrun --nproc-per-node 4 -m pytest tests/gpu/test_coverage_sweep.py -m gpu -q
"""

from __future__ import annotations

import pytest

from cute_ep.buffer import EpBuffer
from cute_ep.validators import sweep

pytestmark = pytest.mark.gpu

CASES = sweep.CASES


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_coverage_sweep(runtime, case):
    env = runtime.env
    # Decided from the world size alone: every rank skips alike, before any collective.
    reason = sweep.skip_reason(case, env.world_size)
    if reason is not None:
        pytest.skip(reason)
    cfg = sweep.case_config(case, env.world_size, env.local_world_size, num_sms=min(16, runtime.sm_share))
    ctx = sweep.SweepContext(rank=env.rank, world_size=env.world_size, local_world_size=env.local_world_size,
                             group=runtime.cpu_group, device=runtime.device,
                             seed=runtime.seed)  # the launch's GPU_TEST_SEED
    report = sweep.run_case(lambda c: EpBuffer(runtime, c, registry=runtime.registry), case, ctx, cfg)
    assert [c.label for c in report.calls] == [c.label for c in case.calls]
    assert report.passed, report.text()
