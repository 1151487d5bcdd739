"""The names kernels are compiled under, as profilers show them."""

from __future__ import annotations

__all__ = ["profiler_name"]


def profiler_name(kernel, scope: str):
    """Compile ``kernel`` (a ``@cute.kernel`` function) under the symbol ``_ZZN7cute_ep<n><scope>EvE6kernel``
    and return it. That is C++'s name of a local entity, so profilers that demangle kernel names (CUPTI,
    PyTorch's profiler, Nsight Systems) show ``cute_ep::<scope>()::kernel``; the ``_<i>`` the DSL appends
    (the kernel's index in its module, 0-16 here) reads as the entity's discriminator. Why: tools find a
    call's kernels by name (DeepEP's ``bench_kineto`` looks for ``::dispatch`` and ``::combine``), and the
    DSL's default name is the Python qualified name followed by the argument signature, which no
    demangler reads. Each kernel class names its own ``kernel`` (the rank layout's variants run their
    base class's body under names of their own); the low-latency dispatch's receiving half shares its
    kernel's name (``bench_kineto`` takes a call's halves from one line of the profiler's table)."""
    kernel.set_name_prefix(f"_ZZN7cute_ep{len(scope)}{scope}EvE6kernel", remove_cutlass_symbol=True,
                           keep_mangled_name=False)
    return kernel
