"""The package version, and the versions of the stack a result was produced with."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable

__version__ = "0.1.0"

# Distributions whose versions are recorded with baselines and benchmark reports.
STACK_PACKAGES = (
    "cute-ep",
    "torch",
    "numpy",
    "nvidia-cutlass-dsl",
    "nvshmem4py-cu13",
    "nvidia-nvshmem-cu13",
    "cuda-python",
)


def package_versions(packages: Iterable[str] = STACK_PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution (None where it is not installed)."""
    out: dict[str, str | None] = {}
    for pkg in packages:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out
