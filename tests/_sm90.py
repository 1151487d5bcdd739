"""The EP module of each element type compiled for sm_90 on a machine without a GPU, once per test run.

Every test that needs a compiled module shares one per dtype: ``tests/conftest.py``'s session fixture
``sm90_module`` compiles on first use, through a ``ModuleRegistry`` with an on-disk ``ObjectCache`` as a
GPU host would, keeping the PTX for the tests that read it.

What the tests compile: the same PTX as any compile (NVVM at the DSL's opt-level 3; the PTX tests read
it), assembled for sm_90 by ptxas with ``--Ofast-compile=max``. ptxas's optimizing passes over the
NVSHMEM-linked kernels are ~90% of a default compile (about 8 of 9 CPU minutes per dtype, against ~10 s
at this level), and no CPU test reads the machine code: they read the PTX, and the object file is only
stored and loaded again. GPU hosts and scripts/precompile.py compile with the default options.

Under pytest-xdist each worker has its own session, so the tests of one dtype carry
``sm90_group(dtype)`` (an ``xdist_group`` mark): with ``--dist loadgroup`` they all run on one worker,
which compiles that dtype once, and the three dtypes compile on different workers side by side.

Not a test module (the leading underscore keeps pytest from collecting it); test files import it as
``from _sm90 import ...``, like ``_launch``.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cute_ep.bootstrap import compile as compile_mod
from cute_ep.bootstrap.compile import ModuleRegistry, ObjectCache, ptx_options, use_cpu_target
from cute_ep.kernels.config import EpConfig
from cute_ep.kernels.host import build

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "half", torch.float32: "float"}
"""The element types the module is compiled for, with the name NVSHMEM's typed calls use."""


def ptx_ops(text: str) -> Counter:
    """How often each PTX instruction occurs, named by its opcode and every modifier, ``::`` ones included
    (``st.global.L1::no_allocate.v4.b32``, not ``st.global.L1``)."""
    return Counter(re.findall(r"(?m)^\s*([a-z]+(?:(?:\.|::)\w+)+)", text))


def sm90_group(dtype: torch.dtype) -> pytest.MarkDecorator:
    """The ``xdist_group`` mark of the tests that use ``dtype``'s compiled module."""
    return pytest.mark.xdist_group(f"sm90_{DTYPES[dtype]}")


def sm90_params() -> list[Any]:
    """One ``pytest.param`` per dtype (id: its NVSHMEM name), grouped with ``sm90_group``: the params of
    a fixture that hands out a compiled module."""
    return [pytest.param(dtype, id=name, marks=sm90_group(dtype)) for dtype, name in DTYPES.items()]


@dataclass(frozen=True)
class Sm90Module:
    """One dtype's module: ``registry`` compiled it under ``key`` and stored it in ``cache``."""

    dtype: torch.dtype
    key: tuple
    compiled: Any
    ptx: str
    registry: ModuleRegistry
    cache: ObjectCache


def compile_sm90(dtype: torch.dtype, folder: Path) -> Sm90Module:
    """Compile ``dtype``'s module for sm_90 into an object cache under ``folder``, keeping its PTX.

    The sizes are run-time arguments (the key holds the dtype alone), so any configuration compiles the
    module every configuration of that dtype runs.
    """
    use_cpu_target()
    cfg = EpConfig(world_size=4, local_world_size=2, num_experts=32, topk=2, hidden=256, dtype=dtype,
                   max_tokens=64, num_sms=8)
    dump = folder / "ptx"  # --keep-ptx writes a file: keep it out of the checkout
    dump.mkdir(parents=True)
    cache = ObjectCache(folder / "objects")
    registry = ModuleRegistry(register=False, disk=cache)
    # The registry's own compile, with the PTX kept (the artifact is read back from the dump folder) and
    # ptxas at its fast level (the module docstring says why).
    options = ptx_options(dump, fast_ptxas=True)
    compile_kernel = functools.partial(compile_mod.compile_kernel, options=options)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compile_mod, "compile_kernel", compile_kernel)
        compiled = registry.get(cfg.compile_key(), lambda: build(cfg))
    return Sm90Module(dtype=dtype, key=cfg.compile_key(), compiled=compiled, ptx=compiled.artifacts.PTX,
                      registry=registry, cache=cache)
