"""scripts/call_stages.py on a machine without a GPU: its help and refusals, how a call's stamps become its
stages, and the stamps its instrumented steps leave (a stand-in buffer whose calls make those steps)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from _launch import REPO, import_script


@pytest.fixture(scope="module")
def cs():
    return import_script(REPO / "scripts" / "call_stages.py", "call_stages_script")


def test_help_no_gpu_and_bad_arguments(cs, capsys, monkeypatch):
    from cute_ep.tools import cli

    with pytest.raises(SystemExit) as e:
        cs.main(["--help"])
    assert e.value.code == 0 and "host time" in capsys.readouterr().out
    monkeypatch.setattr(cli, "cuda_gpus", lambda: 0)
    assert cs.main(["--tokens", "128"]) == 2
    assert "needs a CUDA GPU (torch sees none)" in capsys.readouterr().err
    for argv, says in ((["--iters", "0"], "--iters >= 1"), (["--layouts", "diagonal"], "--layouts"),
                       (["--tokens", "70000"], "<= 65536")):
        assert cs.main(argv) == 2
        assert says in capsys.readouterr().err


def test_stages_are_the_gaps_between_the_stamps(cs):
    us = 1e-6
    synced = dict(start=0, launch=20 * us, launched=32 * us, wait=45 * us, waited=62 * us, views=66 * us,
                  viewed=67 * us, end=71 * us)
    got = cs.stage_times(synced)
    assert got == pytest.approx({"before the launch": 20, "the launch": 12, "launch to wait": 13,
                                 "the wait": 17, "to the views": 4, "the views": 1, "after them": 4,
                                 "host total": 71})
    sync_free = {k: v for k, v in synced.items() if k not in ("wait", "waited")}
    assert cs.stage_times(sync_free) == pytest.approx({"before the launch": 20, "the launch": 12,
                                                       "launch to views": 34, "the views": 1, "after them": 4,
                                                       "host total": 71})
    combine = dict(start=0, launch=14 * us, launched=23 * us, end=25 * us)
    assert cs.stage_times(combine) == pytest.approx({"before the launch": 14, "the launch": 9,
                                                     "after the launch": 2, "host total": 25})
    named = set(got) | set(cs.stage_times(sync_free)) | set(cs.stage_times(combine))
    assert named == {*cs.STAGES, "host total"}


def test_instrumented_steps_stamp_around_themselves_and_pass_their_results_through(cs):
    order: list[str] = []
    status = SimpleNamespace(wait_mirror=lambda seq, stream: order.append("wait") or True)
    buf = SimpleNamespace(_launcher=lambda stream, addrs, **kw: order.append("launch"),
                          _received=lambda n, by_rank, fp8: ("views", n), status=status)
    stamps: dict[str, float] = {}
    cs.instrument(buf, stamps)

    def synced_dispatch():  # the steps in a synced dispatch's order
        buf._launcher(0, {}, op=1)
        assert buf.status.wait_mirror(1, 0) is True
        return buf._received(3, True, False)

    medians = cs.call_stages(synced_dispatch, stamps, lambda: time.sleep(0), iters=5, warmup=1)
    assert order == ["launch", "wait"] * 6
    assert list(stamps) == ["start", "launch", "launched", "wait", "waited", "views", "viewed", "end"]
    times = list(stamps.values())
    assert times == sorted(times)
    assert set(medians) == {"before the launch", "the launch", "launch to wait", "the wait", "to the views",
                            "the views", "after them", "host total"}
    assert medians["host total"] >= max(v for k, v in medians.items() if k != "host total")
    line = cs.format_row(0, 128, "rank", "dispatch()", medians)
    assert line.startswith("rank 0   128 rank   dispatch()") and "the wait" in line and "host total" in line
