"""scripts/ptx_diff.py on small PTX texts: what is normalized away (launch-site suffixes, labels, call
numbers), and how a function is judged (identical, reordered, changed, only on one side), with the exit
status the command returns."""

from __future__ import annotations

import subprocess
import sys

from _launch import REPO

sys.path.insert(0, str(REPO / "scripts"))
import ptx_diff  # noqa: E402

ENTRY = "kernel_cutlass_kernel_cute_epkernelsdispatchDispatchKernel_object_at__EpParamsopInt32_{site}"


def _module(site: int, body: str, label: int = 3, extra: str = "") -> str:
    return (f"//\n.version 8.8\n.target sm_90\n\t// .globl\t{ENTRY.format(site=site)}\n"
            f".visible .entry {ENTRY.format(site=site)}(\n\t.param .b64 p\n)\n{{\n{body}"
            f"$L__BB{label}_1:\n\t{{ // callseq {site}, 0\n\tret;\n}}\n{extra}")


BODY = ("\tmov.u32 \t%r1, %ctaid.x;\n\tadd.s64 \t%rd2, %rd1, 16;\n"
        "\tst.global.v4.b32 \t[%rd2], {%r1, %r1, %r1, %r1};\n")


def test_launch_order_alone_is_identical():
    diffs = ptx_diff.compare(_module(0, BODY, label=3), _module(4, BODY, label=7))
    assert [(ptx_diff.short_name(d.name), d.verdict) for d in diffs] == [("<header>", "identical"),
                                                                         ("DispatchKernel", "identical")]


def test_profiler_names_lose_their_launch_site_too(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ENTRY", "_ZZN7cute_ep13rank_dispatchEvE6kernel_{site}")
    diffs = ptx_diff.compare(_module(4, BODY, label=3), _module(7, BODY, label=7))
    named = [(ptx_diff.short_name(d.name), d.verdict) for d in diffs]
    assert named == [("<header>", "identical"), ("cute_ep::rank_dispatch", "identical")]


def test_kernels_under_one_name_are_compared_each_with_its_counterpart(monkeypatch):
    """Two kernels compiled under one profiler name (a kernel and its receiving half) are the name's first
    and second function, each compared with the same one of the other side."""
    monkeypatch.setattr(sys.modules[__name__], "ENTRY", "_ZZN7cute_ep20dispatch_low_latencyEvE6kernel_{site}")
    other = BODY.replace("st.global.v4.b32", "st.global.b32")
    second = _module(5, other).split("\t// .globl", 1)[1]
    before = _module(4, BODY) + "\t// .globl" + second
    after = _module(6, BODY) + "\t// .globl" + second.replace("st.global.b32", "ld.global.b32")
    named = {ptx_diff.short_name(d.name): d.verdict for d in ptx_diff.compare(before, after)}
    assert named == {"<header>": "identical", "cute_ep::dispatch_low_latency": "identical",
                     "cute_ep::dispatch_low_latency#2": "changed"}


def test_the_same_instructions_in_another_order_have_the_same_counts():
    lines = BODY.splitlines(keepends=True)
    diffs = ptx_diff.compare(_module(0, BODY), _module(0, "".join([lines[1], lines[0], lines[2]])))
    assert diffs[-1].verdict == "same counts" and diffs[-1].changes == {}


def test_changed_counts_are_listed_and_one_sided_functions_named():
    after = BODY.replace("st.global.v4.b32", "st.global.b32")
    extra = ".func helper(\n)\n{\n\tret;\n}\n"
    diffs = {ptx_diff.short_name(d.name): d for d in ptx_diff.compare(_module(0, BODY),
                                                                      _module(0, after, extra=extra))}
    assert diffs["DispatchKernel"].verdict == "changed"
    assert diffs["DispatchKernel"].changes == {"st.global.b32": (0, 1), "st.global.v4.b32": (1, 0)}
    assert diffs["helper"].verdict == "only after"
    text = ptx_diff.report(list(diffs.values()))
    assert "st.global.v4.b32: 1 -> 0" in text and "helper: only after" in text


def test_modifiers_after_double_colons_name_the_instruction():
    """A cache hint is part of the instruction: the same store with and without one is a change of
    counts, named in full."""
    after = BODY.replace("st.global.v4.b32", "st.global.L1::no_allocate.v4.b32")
    (diff,) = [d for d in ptx_diff.compare(_module(0, BODY), _module(0, after)) if d.name != "<header>"]
    assert diff.changes == {"st.global.L1::no_allocate.v4.b32": (0, 1), "st.global.v4.b32": (1, 0)}


def test_command_exit_status(tmp_path):
    a, b, c = tmp_path / "a.ptx", tmp_path / "b.ptx", tmp_path / "c.ptx"
    a.write_text(_module(0, BODY))
    b.write_text(_module(2, BODY, label=9))
    c.write_text(_module(0, BODY.replace("16", "32")))  # same instructions, another offset: not identical
    d = tmp_path / "d.ptx"
    d.write_text(_module(0, BODY + "\tadd.s64 \t%rd3, %rd2, 16;\n"))

    def run(*args):
        return subprocess.run([sys.executable, str(REPO / "scripts" / "ptx_diff.py"), *map(str, args)],
                              capture_output=True, text=True)

    assert run(a, b).returncode == 0 and "2 identical" in run(a, b).stdout
    assert run(a, c).returncode == 1 and "1 same counts" in run(a, c).stdout
    assert run(a, d).returncode == 1 and "add.s64: 1 -> 2" in run(a, d).stdout
    bad = run(a)
    assert bad.returncode == 2 and "give two PTX files" in bad.stderr
    assert run(a, tmp_path / "missing.ptx").returncode == 2
