"""The offset-aware SwiGLU kernels (kernels/swiglu.py) trace and compile for sm_90 on a machine without a
GPU, apart from the EP module: one bf16 compile per direction (a few seconds each).

Beyond "it compiled", the PTX is read for what the design promises: one entry point per direction and
no NVSHMEM in it (a separate function, not part of the EP module), 128-bit loads and stores of the rows
(the gate and up halves and, backward, the output gradient in; the activation or the two gradient halves
out), one scalar load of the live count from the offsets, a grid-stride loop over the tiles (the grid
size is read on the device), and IEEE division and no approximate one in the sigmoid.
"""

from __future__ import annotations

import re

import pytest
import torch
from _sm90 import ptx_ops

from cute_ep.bootstrap.compile import ModuleRegistry, compile_kernel, ptx_options, use_cpu_target

DTYPE = torch.bfloat16


@pytest.fixture(scope="module", params=["forward", "backward"])
def compiled(request, tmp_path_factory):
    use_cpu_target()
    from cute_ep.kernels.swiglu import build

    fn, args = build(request.param, DTYPE)
    out = compile_kernel(fn, *args, options=ptx_options(tmp_path_factory.mktemp("swiglu_ptx")))
    return request.param, fn, out.artifacts.PTX


def test_one_sm90_entry_without_nvshmem(compiled):
    direction, _, ptx = compiled
    assert re.search(r"(?m)^\.target sm_90$", ptx)
    entries = re.findall(r"\.visible \.entry (\w+)", ptx)
    assert len(entries) == 1 and f"SwiGLU{direction.capitalize()}" in entries[0], entries
    assert "nvshmem" not in ptx


def test_rows_move_in_128_bit_vectors(compiled):
    direction, fn, ptx = compiled
    ops = ptx_ops(ptx)
    per_half = fn.vectors_per_lane  # vectors of each [rows, I] operand a lane moves per tile
    loads_in, stores_out = (2, 1) if direction == "forward" else (3, 2)
    assert ops["ld.global.v4.b32"] == loads_in * per_half, ops
    assert ops["st.global.v4.b32"] == stores_out * per_half, ops
    narrow = [op for op in ops if op.startswith(("ld.global", "st.global")) and ".v4." not in op]
    assert narrow == ["ld.global.b32"] and ops["ld.global.b32"] == 1, ops  # the live count, once


def test_walks_the_live_tiles_in_a_grid_stride_loop(compiled):
    _, _, ptx = compiled
    assert "%nctaid.x" in ptx  # the stride is the launched grid, read on the device
    assert "min.relu.s32" in ptx or "min.s32" in ptx  # live rows clamped to the buffer's rows


def test_the_sigmoid_divides_exactly(compiled):
    _, _, ptx = compiled
    ops = ptx_ops(ptx)
    assert ops["div.rn.f32"] > 0
    assert not any(op.startswith(("div.approx", "div.full")) for op in ops), ops


def test_the_host_compiles_it_under_its_own_key():
    """SwiGLUKernels (cute_ep/swiglu.py) compiles through a ModuleRegistry that registers nothing with
    NVSHMEM, keyed apart from the EP module's ("ep_module", dtype)."""
    use_cpu_target()
    from cute_ep.kernels.swiglu import compile_key
    from cute_ep.swiglu import SwiGLUKernels

    registry = ModuleRegistry(register=False)
    registry.disk = None  # never read or write a cache folder named by the environment here
    kernels = SwiGLUKernels(registry)
    fn = kernels.compiled("forward", DTYPE)
    assert callable(fn) and registry.compiles == 1
    assert compile_key("forward", DTYPE) == ("swiglu", "forward", "bfloat16")
    assert ("swiglu", "forward", "bfloat16") in registry
    assert kernels.compiled("forward", DTYPE) is fn and registry.compiles == 1  # cached
    with pytest.raises(ValueError, match="direction must be one of"):
        compile_key("sideways", DTYPE)
