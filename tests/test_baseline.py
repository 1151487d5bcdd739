"""Baselines: save/load round trip, bitwise comparison, config mismatch, CLI exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cute_ep.validators.baseline import (
    Baseline,
    BaselineConfigError,
    BaselineFormatError,
    check_baseline_config,
    compare_baselines,
    compare_to_baseline,
    load_baseline,
    make_baseline,
    save_baseline,
)

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "compare_baseline.py"
META = {"config": {"hidden": 16, "topk": 2, "experts": 8}, "seed": 7, "dtype": torch.bfloat16}


def sample_arrays() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    bf = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    bf[0, 0] = float("nan")
    bf[0, 1] = -0.0
    return {
        "recv_x": bf,
        "out_fp16": torch.randn(5, 3, generator=g).to(torch.float16),
        "recv_w": torch.rand(8, generator=g),
        "recv_src": torch.arange(8, dtype=torch.int32) * 3,
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.numel():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.reshape(-1).view(width), b.reshape(-1).view(width))


def test_round_trip_without_process_group(tmp_path):
    assert not dist.is_initialized()
    arrays = sample_arrays()
    path = tmp_path / "sub" / "base.npz"
    save_baseline(path, arrays, META, local_world_size=1)
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    base = load_baseline(path)
    assert set(base.arrays) == {f"rank0/{k}" for k in arrays}
    for k, v in arrays.items():
        assert_bit_equal(base.arrays[f"rank0/{k}"], v)
    meta = base.meta
    assert meta["config"] == META["config"] and meta["seed"] == 7 and meta["dtype"] == "bfloat16"
    assert meta["world_size"] == 1 and meta["local_world_size"] == 1 and meta["device"] == "cpu"
    assert meta["dtypes"]["rank0/recv_x"] == "bfloat16" and meta["dtypes"]["rank0/recv_src"] == "int32"
    assert set(meta["versions"]) >= {"torch", "numpy", "nvidia-cutlass-dsl", "nvshmem4py-cu13", "cute-ep"}
    assert meta["versions"]["torch"] and meta["versions"]["numpy"] == np.__version__
    assert "git_sha" in meta and "created" in meta
    # bf16 is stored as its raw bits.
    with np.load(path) as raw:
        assert raw["rank0/recv_x"].dtype == np.uint16
    result = compare_baselines(base, load_baseline(path))
    assert result.passed and result.summary == f"baseline: {len(arrays)} arrays, all identical"


def test_one_ulp_detected_with_index(tmp_path):
    path = tmp_path / "a.npz"
    arrays = sample_arrays()
    save_baseline(path, arrays, META)
    changed = {k: v.clone() for k, v in arrays.items()}
    changed["recv_x"].view(torch.int16)[3, 5] += 1
    result = compare_to_baseline(path, changed, META)
    assert not result.passed and result.differing == ["rank0/recv_x"]
    expected = float(arrays["recv_x"][3, 5])
    got = float(changed["recv_x"][3, 5])
    assert result.summary == (
        f"baseline: 6 arrays, 5 identical, 1 differs: rank0/recv_x: 1 of 128 elements differ, "
        f"first at (3, 5): expected {expected!r}, got {got!r}"
    )
    # -0.0 vs 0.0 and NaN payloads are bit differences too; the same NaN is not.
    zero = {k: v.clone() for k, v in arrays.items()}
    zero["recv_x"][0, 1] = 0.0
    assert compare_to_baseline(path, zero, META).differing == ["rank0/recv_x"]
    assert compare_to_baseline(path, arrays, META).passed


def test_missing_dtype_and_shape_differences(tmp_path):
    a = make_baseline([sample_arrays()], META)
    b_arrays = sample_arrays()
    del b_arrays["scalar"]
    b_arrays["recv_src"] = b_arrays["recv_src"].long()
    b_arrays["recv_w"] = b_arrays["recv_w"][:4]
    b_arrays["extra"] = torch.zeros(1)
    result = compare_baselines(a, make_baseline([b_arrays], META))
    assert not result.passed
    text = "\n".join(result.lines)
    assert "rank0/scalar: missing in actual" in text
    assert "rank0/recv_src: dtype differs: expected int32, got int64" in text
    assert "rank0/recv_w: shape differs: expected (8,), got (4,)" in text
    assert "rank0/extra: not in expected" in text
    assert result.summary.startswith("baseline: 7 arrays, 3 identical, 4 differ: ")


def test_config_mismatch_raises(tmp_path):
    a = make_baseline([sample_arrays()], META)
    for key, value in (("config", {**META["config"], "topk": 4}), ("seed", 8), ("dtype", torch.float16)):
        with pytest.raises(BaselineConfigError, match=key) as info:
            compare_baselines(a, make_baseline([sample_arrays()], {**META, key: value}))
        assert info.value.key == key
    with pytest.raises(BaselineConfigError, match="local_world_size"):
        compare_baselines(a, make_baseline([sample_arrays()], META, local_world_size=2))
    with pytest.raises(BaselineConfigError, match="world_size.*expected 1, got 2"):
        compare_baselines(a, make_baseline([sample_arrays(), sample_arrays()], META))
    # Device / version differences are kept as notes, never failures.
    b = make_baseline([sample_arrays()], META)
    b.meta["device"] = "NVIDIA H200"
    result = compare_baselines(a, b)
    assert result.passed and any("device differs" in note for note in result.notes)
    with pytest.raises(ValueError, match="missing"):
        make_baseline([sample_arrays()], {"seed": 1})


def test_versions_note_names_only_packages_both_record_with_other_versions():
    """A baseline made when fewer packages were recorded matches a current run without a versions note;
    a package whose version changed is named with both versions."""
    a = make_baseline([sample_arrays()], META)
    a.meta["versions"] = {"torch": "2.13.0+cpu", "numpy": "2.4.6"}
    b = make_baseline([sample_arrays()], META)
    b.meta["versions"] = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "cuda-python": "13.4.4"}
    b.meta["git_sha"] = a.meta["git_sha"]
    result = compare_baselines(a, b)
    assert result.passed and result.notes == [], result.notes
    b.meta["versions"].update(numpy="2.5.0", torch="2.14.0")
    notes = compare_baselines(a, b).notes
    assert notes == ['versions differ: numpy: expected "2.4.6", got "2.5.0"; '
                     'torch: expected "2.13.0+cpu", got "2.14.0"'], notes


def test_a_pass_prints_no_notes_and_a_failure_prints_them():
    """A baseline made on another device or commit that matches bit for bit is the point of a baseline: its
    lines carry no note (the notes stay in ``Comparison.notes``). A failed comparison shows them, since a
    changed commit or package may explain the difference."""
    changed = sample_arrays()
    changed["recv_w"][2] += 1.0
    a, same, other = (make_baseline([arrays], META) for arrays in (sample_arrays(), sample_arrays(), changed))
    a.meta.update(git_sha="1111111", device="cpu")
    for b in (same, other):
        b.meta.update(git_sha="2222222", device="NVIDIA H100 80GB HBM3", versions=a.meta["versions"])
    notes = ['device differs: expected "cpu", got "NVIDIA H100 80GB HBM3"',
             'git_sha differs: expected "1111111", got "2222222"']
    passed = compare_baselines(a, same)
    assert passed.passed and passed.lines == [passed.summary] and passed.notes == notes, passed.lines
    failed = compare_baselines(a, other)
    assert not failed.passed and failed.notes == notes
    assert failed.lines[-2:] == [f"  note: {note}" for note in notes], failed.lines


def test_check_baseline_config_reads_only_the_configuration(tmp_path):
    path = tmp_path / "base.npz"
    save_baseline(path, sample_arrays(), META, local_world_size=1)
    check_baseline_config(path, META, world_size=1)  # no arrays: only the metadata is compared
    with pytest.raises(BaselineConfigError, match="seed"):
        check_baseline_config(path, {**META, "seed": 8}, world_size=1)
    with pytest.raises(BaselineConfigError, match="world_size.*expected 1, got 2"):
        check_baseline_config(path, META, world_size=2)
    with pytest.raises(FileNotFoundError):
        check_baseline_config(tmp_path / "absent.npz", META, world_size=1)


def test_round_trip_in_gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=(tmp_path / "store").resolve().as_uri(), rank=0, world_size=1)
    try:
        path = tmp_path / "g.npz"
        save_baseline(path, sample_arrays(), META)
        assert load_baseline(path).meta["world_size"] == 1
        assert compare_to_baseline(path, sample_arrays(), META).passed
        with pytest.raises(BaselineConfigError):
            compare_to_baseline(path, sample_arrays(), {**META, "seed": 99})
        with pytest.raises(FileNotFoundError):
            compare_to_baseline(tmp_path / "absent.npz", sample_arrays(), META)
    finally:
        dist.destroy_process_group()


def test_format_errors(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(BaselineFormatError):
        load_baseline(junk)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.zeros(2))
    with pytest.raises(BaselineFormatError, match="__meta__"):
        load_baseline(foreign)
    assert isinstance(make_baseline([{}], META), Baseline)


@pytest.mark.parametrize(
    ("content", "what"),
    [(b"rows,12\n", re.escape("it starts with b'rows,12\\n'")),
     (b"", "the file is empty"),
     (None, r"it holds one numpy array \(\.npy\)")],
)
def test_a_file_that_is_no_npz_gets_what_a_baseline_is_and_how_to_make_one(tmp_path, content, what):
    """Not numpy's "Cannot load file containing pickled data when allow_pickle=False": the message says
    what a baseline is and how to make one."""
    path = tmp_path / "some.txt"
    if content is None:
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    else:
        path.write_bytes(content)
    with pytest.raises(BaselineFormatError) as info:
        load_baseline(path)
    message = str(info.value)
    assert message.startswith(f"{path} is not a readable .npz file: a baseline is the .npz archive"), message
    assert re.search(what, message), message
    assert "make one with --save-baseline-to PATH (scripts/dispatch_and_combine.py)" in message
    assert "pickle" not in message


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_cli_exit_codes(tmp_path):
    a, b, c = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "c.npz"
    save_baseline(a, sample_arrays(), META)
    save_baseline(b, sample_arrays(), META)
    changed = sample_arrays()
    changed["recv_w"][2] += 1.0
    save_baseline(c, changed, META)
    same = run_cli(str(a), str(b))
    assert same.returncode == 0 and "all identical" in same.stdout
    diff = run_cli(str(a), str(c))
    assert diff.returncode == 1 and "rank0/recv_w: 1 of 8 elements differ, first at (2)" in diff.stdout
    other = tmp_path / "other.npz"
    save_baseline(other, sample_arrays(), {**META, "seed": 8})
    cfg = run_cli(str(a), str(other))
    assert cfg.returncode == 2 and "seed" in cfg.stderr
    missing = run_cli(str(a), str(tmp_path / "nope.npz"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    # The metadata survives as plain JSON for other tools.
    with np.load(a) as raw:
        assert json.loads(str(raw["__meta__"]))["seed"] == 7
