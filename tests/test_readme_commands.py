"""The README's CPU install-and-run block runs as written: every command of the shell blocks under
"## Install and run" / "### On a CPU", except the ``pip install`` lines (this environment is installed
already), exits 0 and prints ``PASS`` last. ``python`` is this interpreter and ``torchrun`` its
``torch.distributed.run`` (on a free port); nothing else in a command changes.

The GPU block beside it must name the same examples, without ``--backend reference``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from _launch import REPO, clean_env, free_port

README = REPO / "README.md"
SECTION = "## Install and run"
CPU, GPU = "### On a CPU", "### On GPUs"
TIMEOUT = 120


def subsection(title: str) -> str:
    """The text of the README subsection whose heading starts with ``title`` inside SECTION."""
    text = README.read_text()
    assert SECTION in text, f"README has no heading {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### ", section, flags=re.M)
    found = [p for p in parts if ("### " + p).startswith(title)]
    assert len(found) == 1, f"README's {SECTION!r} has no single subsection {title!r}"
    return found[0]


def commands(title: str) -> list[str]:
    """The command lines of the subsection's shell blocks, comments and ``pip install`` lines left out."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", subsection(title), re.S):
        for line in block.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#") and not command.startswith("pip install"):
                lines.append(command)
    return lines


def argv(command: str) -> list[str]:
    """The command as it runs here: ``python`` -> this interpreter, ``torchrun`` -> its module."""
    words = shlex.split(command)
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    raise AssertionError(f"the README's CPU block runs {command!r}: only python and torchrun are expected")


CPU_COMMANDS = commands(CPU)


def test_the_cpu_block_installs_and_runs():
    text = subsection(CPU)
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    assert 'pip install -e ".[dev]"' in text
    assert len(CPU_COMMANDS) >= 2, CPU_COMMANDS
    for command in CPU_COMMANDS:
        assert "--backend reference" in command, command


@pytest.mark.parametrize("command", CPU_COMMANDS)
def test_a_cpu_command_passes(command):
    # torchrun takes its options from PET_* variables too: a free port instead of the default 29500
    env = clean_env(PET_MASTER_PORT=str(free_port()), MASTER_PORT=str(free_port()))
    proc = subprocess.run(argv(command), capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=REPO)
    tail = f"$ {command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, tail
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines and lines[-1] == "PASS", tail


def test_the_gpu_block_runs_the_same_examples_on_the_kernels():
    gpu = [c for c in commands(GPU) if not c.startswith("export ")]
    want = [c.replace(" --backend reference", "") for c in CPU_COMMANDS]
    assert gpu == want, (gpu, want)
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in subsection(GPU)
