"""Usage and configuration errors reach the user: one line ``error: ...``, exit status 2, from every entry
point, under torchrun too; the GPU backend on a machine without CUDA names the way out (scripts and
``EpBuffer``).

Most cases call a script's ``main`` in-process (a world of one, CUDA reported absent); the quick start runs
once as a real process, and the main script as 4 ranks under torchrun.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _launch import LAUNCH_NAMES, LAUNCH_PREFIXES, REPO, assert_imports_none, run_single, torchrun

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.kernels.config import EpConfig
from cute_ep.tools import cli, usage

QUICKSTART = REPO / "examples" / "quickstart.py"
MAIN_SCRIPT = REPO / "scripts" / "dispatch_and_combine.py"
NO_CUDA = "needs a CUDA GPU (torch sees none)"


@pytest.fixture()
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launch variables (a world of one, rank 0) and no CUDA, whatever this machine has."""
    import os

    for name in list(os.environ):
        if name in LAUNCH_NAMES or name.startswith(LAUNCH_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture()
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses ``time.sleep`` was asked for (none is taken)."""
    taken: list[float] = []
    monkeypatch.setattr("time.sleep", taken.append)
    return taken


def _script(path: Path) -> ModuleType:
    """The script at ``path`` as a module (its ``__main__`` block does not run), imported once."""
    import importlib.util
    import sys

    name = f"usage_test_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _one_error_line(err: str) -> str:
    """The message of stderr's only line, which must read ``error: ...``."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0][len("error: "):]


# --------------------------------------------------------------------------------------------------
# cute_ep.tools.usage: who prints, when
# --------------------------------------------------------------------------------------------------


def test_rank_0_prints_at_once(monkeypatch, capsys, sleeps):
    monkeypatch.setenv("RANK", "0")
    assert usage.report_usage_error(ValueError("num_experts must be divisible")) == usage.EXIT_USAGE
    assert capsys.readouterr().err == "error: num_experts must be divisible\n"
    assert sleeps == []


@pytest.mark.parametrize("variable", ["RANK", "SLURM_PROCID"])
def test_other_ranks_print_the_same_line_after_a_pause(monkeypatch, capsys, sleeps, variable):
    # A launcher that stops this rank once rank 0 has exited leaves rank 0's line alone; if it does not
    # (rank 0 late, or a launcher that stops nobody), this rank's line still reaches the user.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(variable, "3")
    assert usage.report_usage_error("bad value") == 2
    assert capsys.readouterr().err == "error: bad value\n"
    assert sleeps == [usage.REPEAT_DELAY_S]


def test_errors_that_may_differ_per_rank_are_printed_at_once(monkeypatch, capsys, sleeps):
    monkeypatch.setenv("RANK", "2")
    usage.report_usage_error("LOCAL_RANK=7 is not below LOCAL_WORLD_SIZE=4", alike=False)
    assert capsys.readouterr().err == "error: LOCAL_RANK=7 is not below LOCAL_WORLD_SIZE=4\n"
    assert sleeps == []


def test_a_syntax_error_is_one_line_naming_help(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    p = usage.ScriptArgumentParser(prog="tool.py")
    p.add_argument("--count", type=int)
    p.add_argument("--mode", choices=("a", "b"))
    for argv, message in ((["--count", "x"], "argument --count: invalid int value: 'x'"),
                          (["--mode", "c"], "argument --mode: invalid choice: 'c'"),
                          (["--size", "3"], "unrecognized arguments: --size 3")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            p.parse_args(argv)
        assert exc.value.code == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith(message) and line.endswith("(see tool.py --help)"), line


def test_usage_module_imports_no_torch():
    # The scripts report argument errors before they import torch (seconds per rank).
    assert_imports_none("import cute_ep.tools.usage, cute_ep.tools.bench_report", ("torch",))


def test_leave_without_meeting_lets_rank_0_print_first(capsys, sleeps):
    """``leave(meet=False)``: rank 0 prints; the others pause before they return (and exit), so that a
    launcher does not stop rank 0 before its line is out."""
    for rank, out, pauses in ((0, "error: baseline differs\n", []), (1, "", [usage.REPEAT_DELAY_S])):
        runtime = SimpleNamespace(env=SimpleNamespace(rank=rank))
        assert cli.leave(runtime, ValueError("baseline differs"), 2, meet=False) == 2
        assert capsys.readouterr().err == out and sleeps == pauses
        sleeps.clear()


def test_a_bad_heap_size_is_a_usage_error_on_every_rank(monkeypatch, capsys, sleeps):
    from cute_ep.bootstrap.runtime import HeapConfigError

    def run(args, env, cfg):
        raise HeapConfigError("NVSHMEM_SYMMETRIC_SIZE='1M' is too small")

    monkeypatch.setenv("RANK", "1")
    env = SimpleNamespace(rank=1)
    assert cli.run_guarded(run, argparse.Namespace(traceback=False), env, None) == 2
    assert capsys.readouterr().err == "error: NVSHMEM_SYMMETRIC_SIZE='1M' is too small\n"
    assert sleeps == [usage.REPEAT_DELAY_S]  # printed by rank 1 too, after rank 0's turn


# --------------------------------------------------------------------------------------------------
# the GPU backend without CUDA: every entry point
# --------------------------------------------------------------------------------------------------


_WAY_OUT = "on a CPU, scripts/profile_backends.py --backends reference,a2a times the CPU backends"


@pytest.mark.parametrize(("path", "argv", "message"), [
    (QUICKSTART, [], f"--backend cute {NO_CUDA}; on a CPU use --backend reference"),
    (MAIN_SCRIPT, [], f"--backend cute {NO_CUDA}; on a CPU use --backend reference"),
    (REPO / "scripts" / "soak.py", [], f"--backend cute {NO_CUDA}; on a CPU use --backend reference"),
    (REPO / "scripts" / "profile_backends.py", [],
     f"--backends cute,a2a: cute {NO_CUDA}; on a CPU use --backends reference,a2a"),
    (REPO / "scripts" / "benchmark.py", [],
     f"scripts/benchmark.py (it times the GPU kernels) {NO_CUDA}; {_WAY_OUT}"),
    (REPO / "scripts" / "decode_breakdown.py", [],
     f"scripts/decode_breakdown.py (it times the GPU kernels) {NO_CUDA}; {_WAY_OUT}"),
    (REPO / "scripts" / "kernel_times.py", [],
     f"scripts/kernel_times.py (it times the GPU kernels) {NO_CUDA}; {_WAY_OUT}"),
    (REPO / "scripts" / "status_read_ab.py", [],
     f"scripts/status_read_ab.py (it times the GPU kernels) {NO_CUDA}"),
    (REPO / "scripts" / "copy_ceiling.py", [], f"scripts/copy_ceiling.py {NO_CUDA}"),
], ids=lambda v: v.stem if isinstance(v, Path) else None)  # fmt: skip
def test_the_gpu_backend_without_cuda_is_one_line_naming_the_way_out(world_of_one, capsys, path, argv,
                                                                     message):
    assert _script(path).main(argv) == 2
    assert _one_error_line(capsys.readouterr().err) == message


@pytest.mark.parametrize("backend", ["reference", "a2a"])
def test_the_cpu_backends_need_no_cuda(world_of_one, backend):
    cli.check_backends_run_here(argparse.Namespace(backend=backend))
    cli.check_backends_run_here(argparse.Namespace(backend_list=["reference", backend]))


def test_quickstart_on_a_cpu_machine_says_to_use_the_reference_backend():
    """``python examples/quickstart.py`` as a new user types it, as a real process: one line, exit 2."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the default backend runs")
    proc = run_single(QUICKSTART, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert _one_error_line(proc.stderr) == f"--backend cute {NO_CUDA}; on a CPU use --backend reference"


def _gpu_buffer_args(backend: str, device: str) -> tuple[SimpleNamespace, EpConfig]:
    env = DistEnv(rank=0, world_size=1, local_rank=0, physical_local_world_size=1, local_world_size=1)
    runtime = SimpleNamespace(env=env, backend=backend, device=torch.device(device), cpu_group=None)
    cfg = EpConfig(world_size=1, local_world_size=1, num_experts=4, topk=2, hidden=64, dtype=torch.bfloat16,
                   max_tokens=8)  # fmt: skip
    return runtime, cfg


def test_ep_buffer_without_cuda_names_the_cpu_backends(monkeypatch):
    from cute_ep.buffer import EpBuffer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runtime, cfg = _gpu_buffer_args("gloo", "cpu")
    with pytest.raises(RuntimeError) as exc:
        EpBuffer(runtime, cfg)
    text = str(exc.value)
    assert "torch.cuda.is_available() is False" in text and "ReferenceEpBuffer(runtime, cfg)" in text
    assert 'Runtime(env, backend="gloo")' in text and "not compiled with CUDA" not in text


def test_ep_buffer_on_a_gloo_runtime_asks_for_nvshmem(monkeypatch):
    from cute_ep.buffer import EpBuffer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, but a CPU runtime
    runtime, cfg = _gpu_buffer_args("gloo", "cpu")
    with pytest.raises(RuntimeError, match=r'needs a started Runtime\(env, backend="nvshmem"\) \(one GPU per '
                                           r"rank\), got backend='gloo' with device cpu; ReferenceEpBuffer"):
        EpBuffer(runtime, cfg)


# --------------------------------------------------------------------------------------------------
# the quick start: configuration errors, syntax errors, help
# --------------------------------------------------------------------------------------------------


# What a user of an example reads names the example's flags, never an EpConfig or RouterConfig field.
CONFIG_FIELD = re.compile(r"(?<![-\w])(max_tokens|num_experts|world_size|hidden|topk|dtype|num_groups|"
                          r"topk_groups)(?![-\w])")


@pytest.mark.parametrize(("argv", "message"), [
    (["--topk", "0"], "--topk must be in [1, min(--experts=16, 64)], got 0"),
    (["--hidden", "12"], "--hidden * element size must be a multiple of 16 bytes: --hidden=12 x 2 B = 24 B; "
                         "the nearest valid sizes are 8 and 16 (multiples of 8 for torch.bfloat16)"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--experts", "7000"], "--experts must be <= 6144 (layout kernel shared memory), got 7000"),
    (["--tokens", "300000000", "--topk", "8"], "the world size * --tokens * --topk must be < 2**31"),
])  # fmt: skip
def test_quickstart_config_errors_are_one_line_naming_the_flag(world_of_one, capsys, argv, message):
    assert _script(QUICKSTART).main(["--backend", "reference", *argv]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(message) and not CONFIG_FIELD.search(line), line


MOE, ECHO, DROP_IN = "moe_layer.py", "echo_training.py", "deep_ep_drop_in.py"


@pytest.mark.parametrize(("example", "argv", "message"), [
    (MOE, ["--topk", "0"], "--topk must be in [1, min(--experts-per-rank x the world size (8), 64)], got 0"),
    (MOE, ["--groups", "3"],
     "router: --groups must be >= 1 and divide --experts-per-rank x the world size (8), got 3"),
    (MOE, ["--topk-groups", "5"], "router: --topk-groups must be in [1, --groups=4], got 5"),
    (MOE, ["--hidden", "100"], "--hidden * element size must be a multiple of 16 bytes"),
    (MOE, ["--tokens", "-3"], "--tokens must be >= 0, got -3"),
    (MOE, ["--experts-per-rank", "0"], "--experts-per-rank must be >= 1, got 0"),
    (MOE, ["--experts-per-rank", "7000"], "--experts-per-rank x the world size must be <= 6144"),
    (MOE, ["--intermediate", "12"], "--intermediate must be a positive multiple of 8"),
    (ECHO, ["--spare-slots", "-1"], "--spare-slots must be >= 0, got -1"),
    (ECHO, ["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (ECHO, ["--topk", "0"], "--topk must be in [1, min(--experts=16, 64)], got 0"),
    (ECHO, ["--topk", "70", "--experts", "128"], "--topk must be in [1, min(--experts=128, 64)], got 70"),
    (ECHO, ["--experts", "0"],
     "--experts must be positive and divisible by the world size (1), got 0; use 1"),
    (ECHO, ["--hidden", "30"], "--hidden * element size must be a multiple of 16 bytes: --hidden=30 x 4 B = "
                               "120 B; the nearest valid sizes are 28 and 32"),
    (ECHO, ["--experts", "6144"], "the expert slots (--experts + the world size x --spare-slots) must be <= "
                                  "6144 (layout kernel shared memory), got 6146"),
    (DROP_IN, ["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (DROP_IN, ["--ffn", "0"], "--ffn must be >= 1, got 0"),
    (DROP_IN, ["--hidden", "100"], "--hidden must be a positive multiple of 8 (rows of bfloat16 move in "
                                   "16-byte pieces), got 100; the nearest valid sizes are 96 and 104"),
    (DROP_IN, ["--topk", "9"], "--topk must be in [1, --experts=8], got 9"),
    (DROP_IN, ["--mode", "low-latency", "--experts", "128", "--topk", "70"],
     "--mode low-latency takes --topk <= 64 on cute_ep.deep_ep"),
])  # fmt: skip
def test_the_other_examples_report_config_errors_in_one_line_naming_the_flag(world_of_one, capsys, example,
                                                                              argv, message):
    backend = [] if example == DROP_IN else ["--backend", "reference"]
    assert _script(REPO / "examples" / example).main([*backend, *argv]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(message) and not CONFIG_FIELD.search(line), line


@pytest.mark.parametrize(("example", "message"), [
    ("quickstart.py", "--experts must be divisible by the world size (3), got 16; use 15 or 18"),
    (ECHO, "--experts must be positive and divisible by the world size (3), got 16; use 15 or 18"),
    (DROP_IN, "--experts must be positive and divisible by the world size (3), got 8; use 6 or 9"),
])  # fmt: skip
def test_the_default_experts_on_three_ranks_names_valid_values_near_it(world_of_one, monkeypatch, capsys,
                                                                         sleeps, example, message):
    """Rank 0 of 3: the default --experts does not split over 3 ranks; the line names the nearest counts
    that do."""
    launch = dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29500")  # fmt: skip
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    backend = [] if example == DROP_IN else ["--backend", "reference"]
    assert _script(REPO / "examples" / example).main(backend) == 2
    assert _one_error_line(capsys.readouterr().err) == message


def test_in_flags_names_what_sets_each_field():
    flags = {"max_tokens": "--tokens", "num_experts": "--experts", "world_size": "the world size"}
    assert cli.in_flags("max_tokens must be >= 1, got 0", flags) == "--tokens must be >= 1, got 0"
    assert (cli.in_flags("num_experts must be divisible by world_size=3, got 16; use 15 or 18", flags)
            == "--experts must be divisible by the world size (3), got 16; use 15 or 18")
    assert cli.in_flags("topk must be in [1, min(num_experts=16, 64)]", flags) == (
        "topk must be in [1, min(--experts=16, 64)]")  # a field without a flag stays
    assert cli.in_flags("local_world_size must divide world_size=4", flags) == (
        "local_world_size must divide the world size (4)")  # whole names only
    assert cli.in_flags("max_tokens must be >= 1", {}) == "max_tokens must be >= 1"


def test_quickstart_config_error_of_a_launch(world_of_one, monkeypatch, capsys, sleeps):
    """Rank 2 of 4: the error every rank finds (30 experts on 4 ranks) comes out after rank 0's turn."""
    launch = dict(RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29500")  # fmt: skip
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    assert _script(QUICKSTART).main(["--backend", "reference", "--experts", "30"]) == 2
    assert (_one_error_line(capsys.readouterr().err)
            == "--experts must be divisible by the world size (4), got 30; use 28 or 32")
    assert sleeps == [usage.REPEAT_DELAY_S]


def test_quickstart_syntax_error_is_one_line(world_of_one, capsys):
    with pytest.raises(SystemExit) as exc:
        _script(QUICKSTART).main(["--backend", "gpu"])
    assert exc.value.code == 2
    assert "invalid choice: 'gpu'" in _one_error_line(capsys.readouterr().err)


def test_quickstart_help_names_the_default_backend_and_every_option():
    text = " ".join(_script(QUICKSTART).build_parser().format_help().split())  # unwrapped
    assert "(default: cute)" in text and "reference: the torch reference on the CPU" in text
    assert "--dtype {bfloat16,float16,float32} element type of the token rows" in text
    assert "--seed SEED input seed" in text


def test_main_script_syntax_error_is_one_line(world_of_one, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [str(MAIN_SCRIPT)])  # argparse names the program after argv[0]
    with pytest.raises(SystemExit) as exc:
        _script(MAIN_SCRIPT).main(["--backend", "reference", "--num-experts", "many"])
    assert exc.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == "argument --num-experts: invalid int value: 'many' (see dispatch_and_combine.py --help)"


@pytest.mark.parametrize(("rank", "pauses"), [("0", []), ("3", [usage.REPEAT_DELAY_S])])
def test_a_local_world_size_that_does_not_divide_the_host_is_one_line_of_rank_0(
        world_of_one, monkeypatch, capsys, sleeps, rank, pauses):
    """Every rank gets the same error (the flag and the ranks per host are the same everywhere): rank 0
    prints it at once and the others only after the pause, so the user reads one line naming the flag,
    the value and the sizes that work."""
    launch = dict(RANK=rank, WORLD_SIZE="4", LOCAL_RANK=rank, LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29500")  # fmt: skip
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    assert _script(MAIN_SCRIPT).main(["--backend", "reference", "--local-world-size", "3"]) == 2
    assert _one_error_line(capsys.readouterr().err) == (
        "--local-world-size 3 does not divide the 4 processes on this host (and world size 4): virtual nodes "
        "must not straddle hosts; use 1, 2 or 4")
    assert sleeps == pauses


def test_a_launch_environment_error_of_one_rank_is_still_printed_at_once(world_of_one, monkeypatch, capsys,
                                                                         sleeps):
    """An error of the launch environment that may differ per rank (here LOCAL_RANK) is printed by every
    rank at once: a launcher stopping the others must not lose it."""
    launch = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="7", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="29500")  # fmt: skip
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    assert _script(MAIN_SCRIPT).main(["--backend", "reference"]) == 2
    assert _one_error_line(capsys.readouterr().err) == "LOCAL_RANK=7 is not less than LOCAL_WORLD_SIZE=4"
    assert sleeps == []


def test_an_error_line_is_one_write(monkeypatch, capfd):
    """``print`` writes a line and its newline apart; with unbuffered output each part is a write of its
    own, and lines of ranks printing together ran into one another. Each line is one write now."""
    writes: list[bytes] = []
    real_write = usage.os.write
    monkeypatch.setattr(usage.os, "write",
                        lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    monkeypatch.setenv("RANK", "0")
    usage.report_usage_error("--local-world-size 3 does not divide the 4 processes on this host")
    assert writes == [b"error: --local-world-size 3 does not divide the 4 processes on this host\n"]
    writes.clear()
    cli.print_run_error(2, RuntimeError("peer 1 timed out"), show_traceback=False)
    assert writes == [b"rank 2: error: RuntimeError: peer 1 timed out\n"
                      b"rank 2: (run with --traceback for the traceback)\n"]
    assert capfd.readouterr().err.count("\n") == 3


def test_ranks_printing_at_once_never_run_their_lines_together():
    """Four unbuffered processes (PYTHONUNBUFFERED=1, as under many launchers) print 300 error lines each
    into one pipe at the same moment: every line arrives whole."""
    import os
    import subprocess
    import sys

    code = ("import sys; from cute_ep.tools import usage\n"
            "for i in range(300): usage.report_usage_error(f'rank {sys.argv[1]} line {i} ' + 'x' * 80, "
            "alike=False)\n")
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stderr=write_fd, env=env, cwd=REPO)
             for r in range(4)]
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        text = pipe.read().decode()
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    lines = text.splitlines()
    assert len(lines) == 4 * 300, text[-2000:]
    assert all(re.fullmatch(r"error: rank [0-3] line \d+ x{80}", line) for line in lines), text[-2000:]


# --------------------------------------------------------------------------------------------------
# 4 ranks under torchrun
# --------------------------------------------------------------------------------------------------

LATE_RANK_0 = """import os, time
if os.environ.get("RANK") == "0":
    time.sleep(2)  # rank 0 starts last: the others reach the error first
"""
"""A ``sitecustomize`` that holds rank 0 back at start-up, before it imports anything."""


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("rank_0", ["as launched", "late"])
def test_a_config_error_of_four_ranks_reaches_the_user(tmp_path, rank_0):
    """torchrun stops every rank as soon as one exits with an error, so a rank that exits before the rank
    that prints can leave the user without any message (when only rank 0 printed, 2 of 4 launches showed
    no ``error:`` line). Every rank now detects the error and the ranks other than 0 print it only after
    a pause. "late" forces the order that lost the line: rank 0 starts 2 s after the others; the user
    still reads rank 0's line, and the launch's first failure is a usage error (status 2)."""
    env = {}
    if rank_0 == "late":
        (tmp_path / "sitecustomize.py").write_text(LATE_RANK_0)
        env["PYTHONPATH"] = str(tmp_path)
    expected = "error: num_experts must be divisible by world_size=4, got 30; use 28 or 32"
    proc = torchrun(MAIN_SCRIPT, 4, "--backend", "reference", "--num-experts", "30", timeout=120, **env)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    assert expected in proc.stderr.splitlines(), text[-4000:]
    # torchrun exits 1 whatever its workers returned; its report names the first failure's status.
    root_cause = text.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(r"exitcode\s*:\s*2\b", root_cause), text[-4000:]
    assert "ConfigError" not in text, text[-4000:]  # no rank's traceback


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_a_local_world_size_error_of_four_ranks_is_one_clean_line():
    """``--local-world-size 3`` on 4 ranks of one host, unbuffered output: one line, rank 0's (the others
    wait before they print, and torchrun stops them once rank 0 has exited)."""
    proc = torchrun(MAIN_SCRIPT, 4, "--backend", "reference", "--local-world-size", "3", timeout=120,
                    PYTHONUNBUFFERED="1")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-4000:]
    errors = [line for line in proc.stderr.splitlines() if "error: " in line]
    assert errors == ["error: --local-world-size 3 does not divide the 4 processes on this host (and world "
                      "size 4): virtual nodes must not straddle hosts; use 1, 2 or 4"], text[-4000:]
