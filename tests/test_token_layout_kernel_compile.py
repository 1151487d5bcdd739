"""The DeepEP front's layout kernel (kernels/token_layout.py) traces and compiles for sm_90 on a machine
without a GPU, apart from the EP module, once per id type; its PTX holds what the design promises: one
entry point, no NVSHMEM, one CTA's shared-memory histograms (shared atomics, no global ones), ids read at
their own width (64-bit compares for int64 ids), the in-rank flags stored as bytes; and the host compiles
it under its own key."""

from __future__ import annotations

import re

import pytest
import torch
from _sm90 import ptx_ops

from cute_ep.bootstrap.compile import ModuleRegistry, compile_kernel, ptx_options, use_cpu_target


@pytest.fixture(scope="module", params=["int64", "int32"])
def compiled(request, tmp_path_factory):
    use_cpu_target()
    from cute_ep.kernels.token_layout import build

    fn, args = build(request.param)
    out = compile_kernel(fn, *args, options=ptx_options(tmp_path_factory.mktemp("token_layout_ptx")))
    return request.param, out.artifacts.PTX


def test_one_sm90_entry_without_nvshmem(compiled):
    _, ptx = compiled
    assert re.search(r"(?m)^\.target sm_90$", ptx)
    entries = re.findall(r"\.visible \.entry (\w+)", ptx)
    # compiled under a C++ local-entity name, so profilers show cute_ep::get_dispatch_layout()::kernel
    assert entries == ["_ZZN7cute_ep19get_dispatch_layoutEvE6kernel_0"], entries
    assert "nvshmem" not in ptx


def test_counts_gather_in_shared_memory_and_are_stored_once(compiled):
    _, ptx = compiled
    ops = ptx_ops(ptx)
    assert ops["atom.shared.add.u32"] >= 2, ops  # per-expert and per-rank histograms
    assert not any(op.startswith(("atom.global", "red.global")) for op in ops), ops
    assert ops["bar.sync"] == 2, ops  # after zeroing, before the counts go out
    assert ops["st.global.b8"] >= 1 and ops["st.global.b32"] >= 2, ops  # flags; per-expert, per-rank


def test_ids_are_compared_at_their_own_width(compiled):
    id_type, ptx = compiled
    ops = ptx_ops(ptx)
    if id_type == "int64":
        wide = [op for op in ops if op.startswith("setp") and op.endswith("s64")]
        assert ops["ld.global.b64"] >= 1 and wide, ops
    else:
        assert ops["ld.global.b32"] >= 1 and "ld.global.b64" not in ops, ops


def test_the_host_compiles_it_under_its_own_key():
    use_cpu_target()
    from cute_ep.deep_ep.token_layout import TokenLayout
    from cute_ep.kernels.token_layout import compile_key

    registry = ModuleRegistry(register=False)
    registry.disk = None  # never read or write a cache folder named by the environment here
    layout = TokenLayout(registry)
    fn = layout.compiled(torch.int64)
    assert callable(fn) and registry.compiles == 1 and ("token_layout", "int64") in registry
    assert layout.compiled(torch.int64) is fn and registry.compiles == 1  # cached
    assert compile_key("int32") == ("token_layout", "int32")
    with pytest.raises(ValueError, match="id_type must be one of"):
        compile_key("int16")


def test_fits_names_what_the_kernel_takes():
    from cute_ep.deep_ep.token_layout import TokenLayout
    from cute_ep.kernels.token_layout import MAX_EXPERTS, MAX_RANKS

    ids = torch.zeros(4, 8, dtype=torch.int64)
    assert not TokenLayout.fits(ids, 256, 4)  # CPU ids: the torch form
    assert TokenLayout.fits(ids, 256, 4, on_gpu=True)
    assert TokenLayout.fits(ids.int(), MAX_EXPERTS, MAX_RANKS, on_gpu=True)
    assert not TokenLayout.fits(ids.short(), 256, 4, on_gpu=True)  # int16 ids: torch
    assert not TokenLayout.fits(ids, MAX_EXPERTS + MAX_RANKS, MAX_RANKS, on_gpu=True)
    assert not TokenLayout.fits(ids, 2 * MAX_RANKS, 2 * MAX_RANKS, on_gpu=True)
    huge = torch.empty(2**28, 8, dtype=torch.int64, device="meta")  # 2**31 pairs: past int32 indexing
    assert not TokenLayout.fits(huge, 256, 4, on_gpu=True)
    assert TokenLayout.fits(huge[: 2**28 - 1], 256, 4, on_gpu=True)


def test_the_prepared_call_writes_each_argument_where_the_compiled_function_reads_it():
    """TokenLayout launches through a PreparedCall: its slots are the compiled function's own argument
    storage (they read back the stand-ins' values in argument order), and a call writes each value into
    its slot before the packed launch (run here by a stand-in: no GPU)."""
    use_cpu_target()
    from cute_ep.deep_ep.token_layout import TokenLayout
    from cute_ep.launcher import PreparedCall

    registry = ModuleRegistry(register=False)
    registry.disk = None
    layout = TokenLayout(registry)
    call = layout.prepared(torch.int32)
    assert layout.prepared(torch.int32) is call  # made once
    # kernels/token_layout.py's example_args: four pointers, then T, K, E, R, then stream 0
    assert [s.value for s in call.slots] == [1 << 20, 1 << 21, 1 << 22, 1 << 23, 64, 8, 256, 4, 0]
    seen = []
    call._run = lambda: seen.append([s.value for s in call.slots])
    call(0x7000, 0x8000, 0x9000, 0xA000, 4096, 9, 288, 8, 0x1234)
    assert seen == [[0x7000, 0x8000, 0x9000, 0xA000, 4096, 9, 288, 8, 0x1234]]
    call(0x7000, 0x8000, 0x9000, 0xA000, 0, 9, 288, 8, 0x1234)
    assert seen[-1][4] == 0
    with pytest.raises(ValueError, match="kinds must name each of the 2 arguments"):
        PreparedCall(layout.compiled(torch.int32), (1, 2), ("ptr", "float"))
