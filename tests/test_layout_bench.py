"""scripts/layout_bench.py on a machine without a GPU: its help, and a clear refusal (exit 2) instead of a
traceback (its timer, ``cute_ep.tools.bench_timing.deepep_bench``: tests/test_deepep_bench.py)."""

from __future__ import annotations

import pytest
import torch
from _launch import REPO, import_script


@pytest.fixture(scope="module")
def lb():
    return import_script(REPO / "scripts" / "layout_bench.py", "layout_bench_script")


def test_help_and_no_gpu(lb, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        lb.main(["--help"])
    assert e.value.code == 0 and "get_dispatch_layout" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lb.main(["--tokens", "128"]) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err
