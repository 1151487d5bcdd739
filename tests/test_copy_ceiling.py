"""scripts/copy_ceiling.py: its argument checks, and both copy kernels compile for sm_90 without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import copy_ceiling as cc  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "100000"], "multiple of 16 and <= 16384 bytes, got 200000"),
    (["--hidden", "7"], "got 14"),
    (["--modes", "regs4,tma"], "--modes takes regs4, regs8, bulk; got ['tma']"),
    (["--copies", "0"], "--copies in [1, 32]"),
    (["--num-sms", "x"], "comma lists of integers"),
    (["--rows", "0"], "--rows and --iters must be >= 1"),
])
def test_bad_arguments_exit_2_naming_the_value(argv, message, capsys):
    assert cc.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("world, argv, message", [
    ("1", ["--peers-only"], "--peers-only needs a world of 2 or more ranks (launch with torchrun"),
    ("2", ["--timeout", "0"], "--timeout must be > 0, got 0.0"),
    ("1", ["--pull", "--copies", "1"], "--pull needs a world of 2 or more ranks, --copies 1 and no"),
    ("2", ["--pull", "--copies", "1,2"], "got WORLD_SIZE=2, --copies 1,2"),
    ("2", ["--pull", "--copies", "1", "--peers-only"], "--copies 1, --peers-only"),
])
def test_world_arguments_exit_2(world, argv, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)
    assert cc.main(argv) == 2
    assert message in capsys.readouterr().err


def test_copy_kernels_compile_for_sm90():
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from cute_ep.bootstrap.compile import use_cpu_target

    use_cpu_target()
    kernels = cc.make_kernels(cutlass.BFloat16)
    assert sorted(kernels) == ["bulk", "regs4", "regs8"]
    for name in ("regs4", "bulk"):
        compiled = cute.compile(kernels[name], Int64(0), Int64(0), Int32(1), Int32(1), Int32(16), Int32(1))
        assert compiled is not None, name
