"""The on-disk compile cache (bootstrap.compile.ObjectCache): a compiled module round-trips through an
object file, a second registry loads it instead of compiling, and anything that shapes the code
(kernel sources, versions, target architecture) changes the file it is looked up in."""

from __future__ import annotations

import shutil

import pytest
import torch
from _sm90 import sm90_group

from cute_ep.bootstrap import compile as compile_mod
from cute_ep.bootstrap.compile import CACHE_ENV, ModuleRegistry, ObjectCache, code_fingerprint
from cute_ep.kernels.config import EpConfig

CFG = EpConfig(world_size=2, local_world_size=1, num_experts=8, topk=2, hidden=128, dtype=torch.float32,
               max_tokens=16, num_sms=4)
FP32 = sm90_group(torch.float32)  # the tests that use the run's fp32 module run where it was compiled


@pytest.fixture(scope="module")
def stored(sm90_module):
    """A registry with a disk cache compiles once and stores the module: the fp32 module of this test
    run (tests/_sm90.py; tests/test_kernel_compile.py reads its PTX), compiled for sm_90 through a
    ``ModuleRegistry`` with an ``ObjectCache``. Its key holds the dtype alone, so it is CFG's module."""
    module = sm90_module(torch.float32)
    assert module.key == CFG.compile_key()
    return module.cache, module.registry, module.compiled


@FP32
def test_a_compile_is_stored_as_an_object_file(stored):
    cache, reg, _ = stored
    path = cache.path(CFG.compile_key())
    assert reg.compiles == 1 and reg.loads == 0
    assert path.is_file() and path.stat().st_size > 100_000
    assert path.name.startswith("cute_ep_ep_module_torch_float32-")


@FP32
def test_a_second_registry_loads_instead_of_compiling(stored):
    cache, _, first = stored
    reg = ModuleRegistry(register=False, disk=ObjectCache(cache.folder, cache.fingerprint))
    loaded = reg.get(CFG.compile_key(), lambda: pytest.fail("must not compile"))
    assert reg.loads == 1 and reg.compiles == 0
    assert type(loaded) is type(first) and loaded.has_gpu_module  # a GPU module with its launcher
    assert reg.get(CFG.compile_key(), lambda: pytest.fail("cached in memory")) is loaded


@FP32
def test_a_damaged_file_is_recompiled_and_replaced(stored, tmp_path, monkeypatch):
    cache, _, first = stored
    other = ObjectCache(tmp_path, cache.fingerprint)
    shutil.copy(cache.path(CFG.compile_key()), other.path(CFG.compile_key()))
    other.path(CFG.compile_key()).write_bytes(b"not an object file")
    # The "recompile" hands back the module compiled above (a real compile takes minutes on a CPU).
    monkeypatch.setattr(compile_mod, "compile_kernel", lambda fn, *args: first)
    reg = ModuleRegistry(register=False, disk=other)
    reg.get(CFG.compile_key(), lambda: (None, ()))
    assert reg.compiles == 1 and other.path(CFG.compile_key()).stat().st_size > 100_000


def test_the_fingerprint_follows_sources_and_arch(tmp_path):
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    base = code_fingerprint(src, arch="sm_90")
    assert code_fingerprint(src, arch="sm_90") == base
    assert code_fingerprint(src, arch="sm_100") != base
    (src / "a.py").write_text("x = 2\n")
    assert code_fingerprint(src, arch="sm_90") != base


def test_the_cache_is_opt_in(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert ModuleRegistry(register=False).disk is None
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert ModuleRegistry(register=False).disk.folder == tmp_path


def _precompile_main():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "precompile.py"
    spec = importlib.util.spec_from_file_location("precompile_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@FP32
def test_precompile_script_stores_then_finds_the_module(stored, tmp_path, monkeypatch, capsys):
    """scripts/precompile.py fills an empty cache folder and, run again, loads instead of compiling."""
    _, _, first = stored
    calls = []
    monkeypatch.setattr(compile_mod, "compile_kernel", lambda fn, *args: calls.append(fn) or first)
    main = _precompile_main()
    assert main(["--cache", str(tmp_path), "--dtype", "float32", "--no-swiglu"]) == 0
    # the EP module, then the DeepEP front's layout kernel per id type
    assert [type(fn).__name__ for fn in calls] == ["EpModule", "TokenLayoutKernel", "TokenLayoutKernel"]
    assert "float32: compiled" in capsys.readouterr().out
    assert ObjectCache(tmp_path).path(CFG.compile_key()).stat().st_size > 100_000
    assert main(["--cache", str(tmp_path), "--dtype", "float32", "--no-swiglu"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 3 and "float32: loaded (already there)" in out
    assert "token layout (int64 ids): loaded (already there)" in out


def test_precompile_script_refuses_a_bad_dtype(tmp_path):
    with pytest.raises(SystemExit) as exc:
        _precompile_main()(["--cache", str(tmp_path), "--dtype", "int8"])
    assert exc.value.code == 2
