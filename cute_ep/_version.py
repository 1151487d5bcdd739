"""The package version, and the provenance recorded with results: stack versions and git sha."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

__version__ = "0.1.0"

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout, for an editable install

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


def git_sha(repo: str | os.PathLike = REPO_ROOT) -> str | None:
    """``git rev-parse HEAD`` of ``repo`` with "-dirty" appended when tracked files are modified;
    None without git or outside a repository."""

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    sha = head.stdout.strip()
    status = git("status", "--porcelain", "--untracked-files=no")
    if status is not None and status.returncode == 0 and status.stdout.strip():
        sha += "-dirty"
    return sha
