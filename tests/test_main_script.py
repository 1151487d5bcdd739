"""scripts/dispatch_and_combine.py end to end on the CPU (backend "reference": torch references over gloo).

The script is launched for real (torchrun with 4 ranks as 2 virtual nodes of 2, so all four route
classes occur; a plain single process; a hand-made 4-rank launch where each rank's exit status
matters, since torchrun reports 1 whatever its workers returned). ReferenceEpBuffer itself is also
tested in-process in a world of one.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _launch import RANK0_OF_FOUR, REPO, assert_argument_error, forkrun, launch_ranks, run_single

from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.inputs import make_inputs
from cute_ep.kernels.config import ConfigError, EpConfig
from cute_ep.reference import reference_layout
from cute_ep.reference_backend import ReferenceEpBuffer

SCRIPT = REPO / "scripts" / "dispatch_and_combine.py"
TIMEOUT = 120
WORLD = 4
ROUTE_CLASSES = ("self", "same_node", "other_node_same_local_rank", "other_node_other_local_rank")
SIZES = ["--num-tokens", "64", "--hidden", "256", "--num-experts", "32", "--topk", "2"]
BASE = ["--backend", "reference", *SIZES, "--local-world-size", "2"]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return forkrun(SCRIPT, WORLD, *args, timeout=TIMEOUT)


def _single(*args: str, **env: str) -> subprocess.CompletedProcess:
    return run_single(SCRIPT, *args, timeout=TIMEOUT, **env)


def _launch_ranks(*args: str, patches: str | None = None) -> tuple[list[int], str]:
    """Start WORLD ranks with torchrun's variables by hand; every rank's exit status and all output.

    ``patches``: run the script through _PATCHED with these patches (comma-separated).
    """
    argv = [SCRIPT, *args] if patches is None else ["-c", _PATCHED, SCRIPT, patches, *args]
    return launch_ranks(*argv, world=WORLD, timeout=TIMEOUT)


def _text(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def _assert_passed(proc: subprocess.CompletedProcess) -> str:
    text = _text(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-6000:]}"
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines[-1] == "PASS", text[-6000:]
    assert "FAIL" not in proc.stdout
    return proc.stdout


# --------------------------------------------------------------------------------------------------
# the script under torchrun
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("baseline") / "bf16.npz"
    proc = _torchrun(*BASE, "--save-baseline-to", str(path))
    return path, _assert_passed(proc)


def test_bf16_passes_with_all_route_classes_and_both_modes(baseline):
    path, out = baseline
    for mode in ("scatter", "atomic"):
        for check in ("layout", "dispatch", "combine"):
            assert f"[{mode} #0] {check}: PASS (pairs: self=" in out
    summary = next(ln for ln in out.splitlines() if "dispatch: PASS" in ln)
    counts = dict(item.split("=") for item in summary.split("(pairs: ")[1].rstrip(")").split())
    assert set(counts) == set(ROUTE_CLASSES) and all(int(v) > 0 for v in counts.values()), summary
    assert "world 4 = 2 node(s) x 2 (virtual nodes)" in out
    # GPU-only details stay out of a CPU run's banner: SMs, symmetric memory, a GPU per rank.
    assert "symmetric memory" not in out and "num_sms" not in out and " gpu " not in out
    assert "local 1/2 (4 processes/host) virtual nodes of 2 torchrun" in out
    assert f"baseline saved to {path}" in out and path.is_file()


def test_fp32_passes():
    out = _assert_passed(_torchrun(*BASE, "--dtype", "float32", "--routing", "dropped"))
    assert "float32, routing dropped" in out


def test_reduced_combine_passes_and_is_its_own_baseline_config(baseline, tmp_path):
    """--combine reduced checks the reduced combine against reference_combine_reduced and the pull
    combine of the same handle; its baseline holds another combine output, so the pull baseline is a
    config mismatch, and an a2a run reproduces a reduced baseline made with the reference backend."""
    path, _ = baseline
    red = tmp_path / "reduced.npz"
    out = _assert_passed(_torchrun(*BASE, "--combine", "reduced", "--save-baseline-to", str(red)))
    assert "world 4 = 2 node(s) x 2 (virtual nodes), reduced combine" in out
    for mode in ("scatter", "atomic"):
        assert f"[{mode} #0] combine (reduced): PASS" in out and f"[{mode} #0] combine (pull): PASS" in out
    args = [a if a != "reference" else "a2a" for a in BASE]
    out = _assert_passed(_torchrun(*args, "--combine", "reduced", "--compare-baseline", str(red)))
    assert "arrays, all identical" in out
    codes, out = _launch_ranks(*BASE, "--combine", "reduced", "--compare-baseline", str(path))
    assert codes == [2] * WORLD and "baseline config mismatch" in out, out[-6000:]


def test_same_config_is_identical_to_its_baseline(baseline):
    path, _ = baseline
    out = _assert_passed(_torchrun(*BASE, "--compare-baseline", str(path)))
    assert "arrays, all identical" in out


def test_all_to_all_backend_reproduces_the_reference_baseline(baseline):
    path, _ = baseline
    args = [a if a != "reference" else "a2a" for a in BASE]
    out = _assert_passed(_torchrun(*args, "--compare-baseline", str(path)))
    assert "backend a2a (gloo)" in out and "arrays, all identical" in out


def test_other_seed_is_a_config_mismatch_on_every_rank(baseline):
    path, _ = baseline
    codes, out = _launch_ranks(*BASE, "--seed", "7", "--compare-baseline", str(path))
    assert codes == [2] * WORLD, out[-6000:]
    assert "baseline config mismatch in 'seed': expected 0, got 7" in out
    assert "PASS" not in out


# --------------------------------------------------------------------------------------------------
# single process, argument errors, failures
# --------------------------------------------------------------------------------------------------


def test_single_process_is_a_world_of_one():
    proc = _single("--backend", "reference", "--num-tokens", "16", "--hidden", "64", "--num-experts", "4",
                   "--iters", "2")  # fmt: skip
    out = _assert_passed(proc)
    assert "world 1 = 1 node(s) x 1" in out
    assert "[atomic #1] combine: PASS (pairs: self=32 " in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-experts", "30"], "num_experts must be divisible by world_size=4, got 30"),
        (["--hidden", "12"], "hidden * element size must be a multiple of 16 bytes"),
        (["--benchmark"], "--benchmark needs --backend cute"),
        (["--modes", "scatter,fast"], "--modes must be a comma-separated list of ['atomic', 'scatter']"),
    ],
)
def test_argument_errors_exit_2_with_the_constraint(args, message):
    assert_argument_error(_single(*BASE, *args, **RANK0_OF_FOUR), message)


# python -c _PATCHED SCRIPT PATCHES ARGS...: the script's main(ARGS) with PATCHES (comma-separated):
# "corrupt" (wrong dispatch results in both modes), "no-precheck" (the baseline is first read at
# compare time), "" (none).
_PATCHED = textwrap.dedent(
    """
    import dataclasses, importlib.util, sys
    from cute_ep.reference_backend import ReferenceEpBuffer

    patches = sys.argv[2].split(",")
    original = ReferenceEpBuffer.dispatch

    def dispatch(self, x, topk_idx, topk_weights, mode="scatter", fp8=False):
        res = original(self, x, topk_idx, topk_weights, mode=mode, fp8=fp8)
        if mode == "scatter":
            res.recv_x[3, 5] += 1  # a wrong element
            return res
        scatter = res.handle.scatter.clone()
        scatter[0, 0], scatter[1, 0] = int(scatter[1, 0]), int(scatter[0, 0])  # two swapped slots
        return dataclasses.replace(res, handle=dataclasses.replace(res.handle, scatter=scatter))

    if "corrupt" in patches:
        ReferenceEpBuffer.dispatch = dispatch
    spec = importlib.util.spec_from_file_location("dispatch_and_combine", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its exceptions travel pickled between ranks
    spec.loader.exec_module(script)
    if "no-precheck" in patches:
        script.precheck_baseline = lambda *args, **kwargs: None
    sys.exit(script.main(sys.argv[3:]))
    """
)
SMALL = ["--backend", "reference", "--num-tokens", "16", "--hidden", "64", "--num-experts", "4"]


def _patched(patches: str, *args: str) -> subprocess.CompletedProcess:
    """The script in a single process (a world of one) with _PATCHED's ``patches``."""
    return run_single("-c", _PATCHED, SCRIPT, patches, *args, timeout=TIMEOUT)


def test_wrong_results_fail_with_readable_messages():
    proc = _patched("corrupt", *SMALL)
    out = proc.stdout
    assert proc.returncode == 1, _text(proc)
    assert out.strip().splitlines()[-1] == "FAIL"
    assert "[scatter #0] dispatch: FAIL" in out and "field recv_x differs" in out and "column 5" in out
    assert "[scatter #0] combine: PASS" in out  # combine of what was received is still right
    assert "[atomic #0] layout: FAIL" in out and "handle.scatter[0, 0]" in out
    # check_combine takes the handle's slots on trust (the combine did read what they name): only
    # the layout check can tell that they are wrong.
    assert "[atomic #0] dispatch: PASS" in out and "[atomic #0] combine: PASS" in out


def test_a_failed_run_saves_no_baseline_and_exits_1_on_every_rank(tmp_path):
    path = tmp_path / "bad.npz"
    codes, out = _launch_ranks(*BASE, "--save-baseline-to", str(path), patches="corrupt")
    assert codes == [1] * WORLD, out[-6000:]
    assert "[scatter #0] dispatch: FAIL" in out
    assert f"error: not saving the baseline to {path}: the checks failed" in out
    assert out.count("error: not saving the baseline") == 1  # rank 0 prints it
    assert "baseline saved" not in out and "PASS\n" not in out
    assert [ln.strip() for ln in out.splitlines() if ln.strip()][-1] == "FAIL"
    assert not path.exists() and not list(tmp_path.iterdir())


def test_an_uncorrupted_patched_run_still_saves(tmp_path):
    # The control of the test above: the same wrapper without "corrupt" saves the baseline.
    path = tmp_path / "good.npz"
    proc = _patched("", *SMALL, "--save-baseline-to", str(path))
    assert f"baseline saved to {path}" in _assert_passed(proc) and path.is_file()


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read baseline"), (b"not a zip", "not a readable .npz file")],
    ids=["missing", "malformed"],
)
def test_a_baseline_unreadable_at_compare_time_exits_2(tmp_path, content, message):
    # The pre-check normally reports these before any kernel runs (exit 2); without it, the comparison
    # after the run must give the same exit status.
    path = tmp_path / "base.npz"
    if content is not None:
        path.write_bytes(content)
    for patches in ("no-precheck", ""):
        proc = _patched(patches, *SMALL, "--compare-baseline", str(path))
        assert proc.returncode == 2, (patches, _text(proc))
        assert message in proc.stderr and str(path) in proc.stderr, (patches, _text(proc))
        assert ("[scatter #0] dispatch: PASS" in proc.stdout) == (patches == "no-precheck")


# --------------------------------------------------------------------------------------------------
# ReferenceEpBuffer in-process (world of one, no process group)
# --------------------------------------------------------------------------------------------------


def _buffer(**cfg_kw) -> ReferenceEpBuffer:
    env = DistEnv(rank=0, world_size=1, local_rank=0, physical_local_world_size=1, local_world_size=1)
    runtime = SimpleNamespace(env=env, device=torch.device("cpu"), cpu_group=None)
    kw = dict(world_size=1, local_world_size=1, num_experts=4, topk=2, hidden=64, dtype=torch.bfloat16,
              max_tokens=32)  # fmt: skip
    kw.update(cfg_kw)
    return ReferenceEpBuffer(runtime, EpConfig(**kw))


def test_atomic_mode_shuffles_inside_groups_and_combine_still_matches():
    buf = _buffer()
    x, idx, w = make_inputs(0, 32, 64, 4, 2, torch.bfloat16, seed=3)
    results, outs = {}, {}
    for mode in ("scatter", "atomic", "atomic"):
        buf.poison()
        res = buf.dispatch(x, idx, w, mode=mode)
        y = buf.expert_output(res.num_recv)
        y.copy_(res.recv_x * 2)
        outs.setdefault(mode, []).append(buf.combine(y, res.handle))
        results.setdefault(mode, []).append(
            (res.recv_x.clone(), res.recv_src.clone(), res.handle.scatter.clone(), res.tokens_per_expert)
        )
    s_x, s_src, s_scatter, s_tpe = results["scatter"][0]
    layout = reference_layout([idx], 4)
    assert torch.equal(s_scatter, layout.scatter[0].to(torch.int32))
    assert s_tpe.dtype == torch.int32 and torch.equal(s_tpe.long(), layout.tokens_per_expert[0])
    for a_x, a_src, a_scatter, a_tpe in results["atomic"]:
        assert not torch.equal(a_src, s_src)  # the order changed ...
        assert torch.equal(a_tpe, s_tpe)
        start = 0
        for n in s_tpe.tolist():  # ... but only inside each expert's range (one source here)
            assert sorted(a_src[start : start + n].tolist()) == sorted(s_src[start : start + n].tolist())
            start += n
        # The handle points every (t, k) at the slot where its row went.
        valid = idx >= 0
        assert torch.equal(a_src[a_scatter[valid].long()], s_src[s_scatter[valid].long()])
        assert torch.equal(a_x[a_scatter[valid].long()], s_x[s_scatter[valid].long()])
    assert not torch.equal(results["atomic"][0][1], results["atomic"][1][1])  # seeded by the call count
    for out in outs["atomic"]:
        assert torch.equal(out.view(torch.int16), outs["scatter"][0].view(torch.int16))


def test_reference_buffer_validates_like_epbuffer():
    buf = _buffer()
    x, idx, w = make_inputs(0, 32, 64, 4, 2, torch.bfloat16, seed=0)
    big = torch.zeros(33, 64, dtype=torch.bfloat16)
    cases = [
        ((x.float(), idx, w), "x must be [T, 64] torch.bfloat16, got [32, 64] torch.float32"),
        (
            (big, torch.zeros(33, 2, dtype=torch.int64), torch.zeros(33, 2)),
            "x has 33 tokens, more than max_tokens=32",
        ),
        ((x, idx[:, :1].contiguous(), w), "topk_idx must be [32, 2] int32/int64"),
        ((x, idx, w.double()), "topk_weights must be [32, 2] float32"),
        ((x, idx.t().contiguous().t(), w), "topk_idx must be contiguous"),
        ((x, torch.full_like(idx, 4), w), "topk_idx values must be in [-1, 4), got min 4, max 4"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            buf.dispatch(*args)
    with pytest.raises(ValueError, match="mode must be one of"):
        buf.dispatch(x, idx, w, mode="fast")
    res = buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match="y must be"):
        buf.combine(torch.zeros(res.num_recv, 64), res.handle)
    buf.close()
    buf.close()
    with pytest.raises(RuntimeError, match="closed"):
        buf.dispatch(x, idx, w)
    with pytest.raises(ConfigError, match="world_size"):
        ReferenceEpBuffer(
            SimpleNamespace(env=SimpleNamespace(world_size=2)), EpConfig(1, 1, 4, 2, 64, torch.bfloat16, 8)
        )


def test_dispatch_result_is_the_gpu_buffers_dataclass():
    from cute_ep.api import DispatchHandle, DispatchResult

    buf = _buffer()
    x, idx, w = make_inputs(0, 8, 64, 4, 2, torch.bfloat16, seed=1)
    res = buf.dispatch(x, idx, w)
    assert isinstance(res, DispatchResult) and isinstance(res.handle, DispatchHandle)
    assert dataclasses.is_dataclass(res)
    assert res.handle.topk_idx.dtype == torch.int32 and res.handle.scatter.dtype == torch.int32
    assert res.recv_weights.dtype == torch.float32 and res.recv_src.dtype == torch.int32
    assert res.handle.num_tokens == 8 and res.handle.mode == "scatter"
