"""scripts/precompile.py says what it does while a module compiles (minutes per dtype on a CPU machine) and
keeps LLVM's harmless data layout warning out of stderr. A fake compile stands in for the real one (138-146 s
per dtype on one machine, about 7 min per dtype on a 2-core machine, 2026-11-27)."""

from __future__ import annotations

import os
import time

import pytest
from _launch import REPO, import_script

from cute_ep.bootstrap import compile as compile_mod

WARNING = (b"warning: Linking two modules of different data layouts: 'libnvshmem_device.bc' is "
           b"'e-i64:64-i128:128-v16:16-v32:32-n16:32:64' whereas 'LLVMDialectModule' is "
           b"'e-p6:32:32-i64:64-i128:128-v16:16-v32:32-n16:32:64'\n")


@pytest.fixture(scope="module")
def precompile():
    return import_script(REPO / "scripts" / "precompile.py", "precompile_progress_script")


def fake_compile(seconds: float = 0.0):
    """What the native compiler does to fd 2 during a compile: the layout warning twice (the second
    followed by an empty line), other output around it; then ``seconds`` of work."""
    def run():
        os.write(2, b"before the link\n" + WARNING)
        os.write(2, b"a warning of another kind\n")
        os.write(2, WARNING + b"\n" + b"ptxas info    : 0 bytes gmem\npartial line without newline")
        time.sleep(seconds)
        return "module"

    return run


def test_the_layout_warning_is_dropped_and_everything_else_passes(precompile, capfd):
    with precompile.watched_compile("bfloat16", 0):
        assert fake_compile()() == "module"
    err = capfd.readouterr().err
    assert "Linking two modules" not in err, err
    assert err == ("before the link\na warning of another kind\nptxas info    : 0 bytes gmem\n"
                   "partial line without newline"), err
    os.write(2, b"after\n")  # fd 2 is the real stderr again
    assert capfd.readouterr().err == "after\n"


def test_stderr_comes_back_when_the_compile_raises(precompile, capfd):
    def failing():
        os.write(2, WARNING + b"ptxas fatal   : out of memory\n")
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError, match="compile failed"):
        precompile.compile_with_progress("bfloat16", failing, cached=False, every=0)
    assert capfd.readouterr().err == "ptxas fatal   : out of memory\n"
    os.write(2, b"restored\n")
    assert capfd.readouterr().err == "restored\n"


GIL_BOUND = "import re; re.match(r'(a+)+$', 'a' * 23 + 'b')"  # C code holding the GIL (~0.7 s on 2 cores)


def test_a_long_compile_says_how_long_it_has_run_even_while_it_holds_the_gil(precompile, capfd):
    def holds_the_gil():
        os.write(2, WARNING)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.6:
            exec(GIL_BOUND)
        return "module"

    result, took = precompile.compile_with_progress("float16", holds_the_gil, cached=False, every=0.1)
    out, err = capfd.readouterr()
    assert result == "module" and took >= 0.6
    lines = out.splitlines()
    assert len(lines) >= 3, (lines, took)  # a thread of this process would have printed none
    for line in lines:
        assert line.startswith("  float16: compiling, ") and line.endswith(
            "s so far (measured 138-420 s per dtype)"), line
    assert "Linking two modules" not in err
    precompile.compile_with_progress("float16", fake_compile(0.25), cached=True, every=0.1)
    assert capfd.readouterr().out == ""  # a load from the cache takes seconds: no ticking


def test_the_plan_names_the_dtypes_and_the_time_to_expect(precompile):
    assert precompile.plan_line(["bfloat16", "float16", "float32"], [], "sm_90") == (
        "precompile: 3 dtype(s) for sm_90: compiling bfloat16, float16, float32; "
        f"measured {precompile.MEASURED}: 7-21 min in all, longer beside other work")
    assert precompile.plan_line(["bfloat16", "float32"], ["float32"], "sm_90") == (
        "precompile: 2 dtype(s) for sm_90: compiling bfloat16; float32 from the cache; "
        f"measured {precompile.MEASURED}: 2-7 min in all, longer beside other work")
    assert precompile.plan_line(["float32"], ["float32"], "sm_90") == (
        "precompile: 1 dtype(s) for sm_90, all in the cache already")


def test_main_prints_progress_per_dtype_and_no_layout_warning(precompile, monkeypatch, capfd, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90")  # what use_cpu_target sets (it is not run here)
    monkeypatch.setattr(compile_mod, "use_cpu_target", lambda arch=None: None)
    compiled: list[tuple] = []

    def fake_get(self, key, build):
        compiled.append(key)
        self.compiles += 1
        return fake_compile(0.25)()

    monkeypatch.setattr(compile_mod.ModuleRegistry, "get", fake_get)
    argv = ["--cache", str(tmp_path), "--dtype", "bfloat16", "--dtype", "float32", "--progress-every", "0.1"]
    assert precompile.main(argv) == 0
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("precompile: 2 dtype(s) for sm_90: compiling bfloat16, float32; measured "
                               "138-146 s per dtype"), out
    assert lines[1] == "bfloat16 (1/2): compiling ...", out
    assert any(line.startswith("  bfloat16: compiling, ") for line in lines), out
    assert any(line.startswith("bfloat16: compiled in ") for line in lines), out
    assert "float32 (2/2): compiling ..." in lines
    assert any(line.startswith("float32: compiled in ") for line in lines), out
    # per dtype the EP module, then the MoE layer's SwiGLU kernels (--no-swiglu: the EP modules only);
    # then the DeepEP front's layout kernel per id type
    layouts = [("token_layout", "int64"), ("token_layout", "int32")]
    assert [k[0] for k in compiled[:-2]] == ["ep_module", "swiglu", "swiglu"] * 2, compiled
    assert compiled[-2:] == layouts, compiled
    assert "bfloat16 SwiGLU backward: compiled in " in out, out
    assert "token layout (int32 ids): compiled in " in out, out
    compiled.clear()
    assert precompile.main([*argv, "--no-swiglu"]) == 0
    assert [k[0] for k in compiled[:-2]] == ["ep_module"] * 2 and compiled[-2:] == layouts, compiled
    assert "Linking two modules" not in err and "ptxas info" in err, err
