"""The low-latency mode's padded-layout kernel (kernels/padded_layout.py) traces and compiles for sm_90 on a
machine without a GPU, apart from the EP module: one entry point under its profiler name, no NVSHMEM, the
rows moved as 128-bit pieces, the 64-bit slots and layout ranges stored as such; and the host compiles it
under its own key. (Its results against the torch form: tests/gpu/test_deep_ep_padded_layout.py.)"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from cute_ep.bootstrap.compile import ModuleRegistry, compile_kernel, ptx_options, use_cpu_target


def _ops(text: str) -> Counter:
    return Counter(re.findall(r"(?m)^\s*([a-z]+(?:\.[\w]+)+)", text))


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    use_cpu_target()
    from cute_ep.kernels.padded_layout import build

    fn, args = build()
    return compile_kernel(fn, *args, options=ptx_options(tmp_path_factory.mktemp("padded_ptx"))).artifacts.PTX


def test_one_sm90_entry_without_nvshmem(ptx):
    assert re.search(r"(?m)^\.target sm_90$", ptx)
    entries = re.findall(r"\.visible \.entry (\w+)", ptx)
    assert entries == ["_ZZN7cute_ep18low_latency_layoutEvE6kernel_0"], entries
    assert "nvshmem" not in ptx


def test_rows_move_as_128_bit_pieces_and_slots_as_64_bit_words(ptx):
    ops = _ops(ptx)
    assert ops["ld.global.v4.u32"] >= 1 or ops["ld.global.v4.b32"] >= 1, ops
    assert ops["st.global.v4.u32"] >= 1 or ops["st.global.v4.b32"] >= 1, ops
    assert ops["st.global.b64"] >= 2 or ops["st.global.u64"] >= 2, ops  # slot, layout_range


def test_the_host_compiles_it_under_its_own_key():
    use_cpu_target()
    from cute_ep.kernels import padded_layout as k

    reg = ModuleRegistry(register=False)
    first = reg.get(k.COMPILE_KEY, k.build)
    assert reg.get(k.COMPILE_KEY, k.build) is first and reg.compiles == 1
