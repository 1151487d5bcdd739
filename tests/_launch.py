"""Process launches for the CPU tests: torchrun, ranks started by hand, and a single process.

Not a test module (the leading underscore keeps pytest from collecting it). Test files import it as
``from _launch import ...``: pytest's default import mode ("prepend") puts the folder of a test file
that is not in a package (tests/ has no __init__.py) on sys.path.

Every launch gets a clean environment (``clean_env``), runs from the repository root and captures its
output as text; the caller chooses the timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]

# Variables from an enclosing launch (e.g. pytest itself run under torchrun or inside a SLURM job)
# that would change what the children detect.
LAUNCH_NAMES = frozenset(
    {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "NVSHMEM_SYMMETRIC_SIZE",
    }
)  # fmt: skip
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "CUTE_EP_")

Arg = str | os.PathLike[str]  # a command-line argument: text or a path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launch variables, plus ``extra``.

    Drops ``LAUNCH_NAMES`` and every variable starting with one of ``LAUNCH_PREFIXES``, sets
    OMP_NUM_THREADS=1 (many ranks share the CPU) and GLOO_SOCKET_IFNAME (kept if set, else "lo": gloo
    otherwise picks an interface from the hostname, which may not resolve in containers).
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_NAMES and not k.startswith(LAUNCH_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    env.update(extra)
    return env


def torchrun_cmd(script: Arg, nproc: int, *args: Arg) -> list[str]:
    """The command that runs ``script args`` as ``nproc`` ranks on one node under torchrun."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.fspath(script),
        *map(os.fspath, args),
    ]  # fmt: skip


def torchrun(script: Arg, nproc: int, *args: Arg, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``script args`` as ``nproc`` ranks under torchrun and wait; ``env``: extra variables.

    torchrun's own exit status is 1 whatever status a failing worker returned (see ``launch_ranks``).
    """
    return _run_group(torchrun_cmd(script, nproc, *args), timeout, clean_env(**env))


FORKRUN = Path(__file__).resolve().parent / "_forkrun.py"


def _run_group(cmd: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own, capturing its output as text; on a timeout kill the whole
    session (a launcher's ranks too, which would otherwise hold the pipes open) and raise TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def forkrun(script: Arg, nproc: int, *args: Arg, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """``torchrun`` for the tests that need ranks, not torchrun itself: the ranks are forked from one
    process that has imported torch and cute_ep (tests/_forkrun.py), a few seconds of CPU less per rank.
    Same launch variables, output and exit status (0, or 1 if any rank failed; the others are stopped)."""
    cmd = [sys.executable, os.fspath(FORKRUN), str(nproc), os.fspath(script), *map(os.fspath, args)]
    return _run_group(cmd, timeout, clean_env(**env))


def run_single(*argv: Arg, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``python argv...`` as one process (a world of one, with a free MASTER_PORT) and wait.

    ``argv``: a script and its arguments, or ``"-c", code, ...``; ``env``: extra variables.
    """
    cmd = [sys.executable, *map(os.fspath, argv)]
    run_env = clean_env(MASTER_PORT=str(free_port()), **env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=REPO)


def assert_imports_none(code: str, modules: Sequence[str], *, timeout: float = 60) -> None:
    """Run the Python statements ``code`` in a fresh interpreter (``run_single``) and assert that they
    imported none of ``modules`` (torch, the GPU stack, ...: what a torch-free module or --help must not
    pull in)."""
    check = (
        f"{code}\nimport sys\nbad = [m for m in {tuple(modules)!r} if m in sys.modules]\n"
        "print('imported:', bad)\nsys.exit(1 if bad else 0)\n"
    )
    res = run_single("-c", check, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr


def import_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` imported as a module named ``name`` (its ``__main__`` block does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_worker(folder: Path, code: str) -> Path:
    """``folder``/worker.py: ``code`` after a line that puts scripts/ and tests/ first on sys.path, so a
    worker that a test writes imports the scripts as modules and the tests' shared stand-ins."""
    worker = Path(folder) / "worker.py"
    paths = [str(REPO / "scripts"), str(REPO / "tests")]
    worker.write_text(f"import sys\nsys.path[:0] = {paths!r}\n{code}")
    return worker


RANK0_OF_FOUR = dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1")
"""The launch variables of rank 0 of a 4-rank world (for ``run_single``: an argument error must stop a
launched script before any rendezvous, so the lone rank never waits for the other three)."""


def example_rank_lines(proc: subprocess.CompletedProcess, world: int) -> tuple[list[str], str]:
    """An example's run: exit 0, ``PASS`` last, one "rows received" line per rank (from rank 0). Returns
    those lines and the output's tail (for assertion messages)."""
    text = f"{proc.stdout}\n{proc.stderr}"[-6000:]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text}"
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines[-1] == "PASS", text
    rank_lines = [ln for ln in lines if "rows received" in ln]
    assert len(rank_lines) == world, text
    return rank_lines, text


def assert_argument_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """A script's run stopped by a bad argument: exit status 2, ``error: message`` on stderr, and no
    traceback."""
    text = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 2, text
    assert f"error: {message}" in proc.stderr, text
    assert "Traceback" not in proc.stderr + proc.stdout, text


def assert_help_and_no_gpu_refusal(main: Callable[[list[str]], int], says: str, argv: list[str], capsys,
                                   monkeypatch) -> None:
    """A GPU script's ``main``: ``--help`` exits 0 with a text that ``says`` something, and ``argv`` on a
    machine without CUDA returns 2 with "needs CUDA GPUs" on stderr (a refusal, not a traceback)."""
    import pytest
    import torch

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and says in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 2
    assert "needs CUDA GPUs" in capsys.readouterr().err


def launch_ranks(*argv: Arg, world: int, timeout: float, **env: str) -> tuple[list[int], str]:
    """Start ``python argv...`` as ``world`` ranks with torchrun's variables, forked from one process that
    has imported torch and cute_ep (tests/_forkrun.py ``--each``).

    Unlike ``torchrun``, every rank's own exit status comes back and no rank is stopped when another
    fails. Returns the exit statuses in rank order and the ranks' output (stdout and stderr together),
    rank by rank. On a timeout every rank is killed (and ``subprocess.TimeoutExpired`` propagates).
    """
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, os.fspath(FORKRUN), str(world), "--each", folder, *map(os.fspath, argv)]
        proc = _run_group(cmd, timeout, clean_env(**env))
        assert proc.returncode == 0, f"the launcher failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        outputs = Path(folder)
        codes = [int((outputs / f"rank{r}.status").read_text()) for r in range(world)]
        return codes, "\n".join((outputs / f"rank{r}.out").read_text() for r in range(world))


def worker_results(worker: Arg, world: int, out_dir: Path, *args: Arg, timeout: float) -> list[dict]:
    """Run a ``worker`` (``forkrun``) that writes ``OUT_DIR/rank{r}.json`` on every rank (its arguments
    are the folder, then ``args``), assert it exited 0, and return the ranks' JSON objects in rank order."""
    import json

    proc = forkrun(worker, world, out_dir, *args, timeout=timeout)
    tail = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"the launch failed ({proc.returncode}):\n{tail}"
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def gloo_worker_main(results: Callable[..., dict]) -> None:
    """The ``__main__`` of a torchrun worker that ``worker_results`` runs: in a gloo Runtime of the launch
    (60 s timeout), ``results(rt, *args)`` with ``args`` the command-line arguments after OUT_DIR; then
    meet the other ranks, write the result to OUT_DIR/rank{r}.json and end without teardown."""
    import json
    from datetime import timedelta

    from cute_ep.bootstrap.dist_env import DistEnv
    from cute_ep.bootstrap.runtime import Runtime

    out_dir, *args = sys.argv[1:]
    env = DistEnv.from_environ()
    with Runtime(env, backend="gloo", timeout=timedelta(seconds=60)) as rt:
        result = results(rt, *args)
        rt.barrier()
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(result))
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End a torchrun worker whose results are written and whose process group is destroyed, skipping
    the interpreter's teardown: about one gloo launch in 15-30 aborts there ("terminate called without
    an active exception", no Python frame), which would fail a launch after a complete run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def bit_diff(name: str, a, b) -> str | None:
    """None if tensors ``a`` and ``b`` are equal bit for bit (same dtype and shape), else a short
    description (torchrun workers report it)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{name}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    if a.dtype == torch.float8_e4m3fn:  # torch.equal has no float8 kernel: compare the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if torch.equal(a, b):
        return None
    bad = a != b
    first = torch.nonzero(bad)[0].tolist()
    return f"{name}: {int(bad.sum())} of {a.numel()} elements differ (first at {first})"


def assert_cases_match(ranks: list[dict], cases: int) -> None:
    """Every rank's worker (``worker_results``) ran ``cases`` cases and found no mismatch in any."""
    for r, res in enumerate(ranks):
        assert len(res["cases"]) == cases, (r, len(res["cases"]))
        for case in res["cases"]:
            assert case["mismatches"] == [], (r, case["name"], case["mismatches"])


def outcome(fn) -> dict:
    """What calling fn() did on this rank (torchrun workers report it): the exception's type and
    message, or nothing."""
    try:
        fn()
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}
