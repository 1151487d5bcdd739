"""``import cute_ep`` is light, and the public names resolve to the real objects."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cute_ep


def test_import_does_not_pull_torch():
    code = "import sys, cute_ep; print(cute_ep.__version__); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    version, torch_loaded = out.split()
    assert version == cute_ep.__version__ and torch_loaded == "False"


def test_public_names_resolve():
    from cute_ep.a2a_backend import A2aEpBuffer
    from cute_ep.api import DispatchHandle, DispatchResult, EpBackend
    from cute_ep.buffer import EpBuffer
    from cute_ep.kernels.config import ConfigError, EpConfig
    from cute_ep.reference_backend import ReferenceEpBuffer
    from cute_ep.replication import ReplicaMap
    from cute_ep.status import CapacityExceeded, KernelDidNotRun, PeerTimeout

    assert cute_ep.EpBuffer is EpBuffer and cute_ep.EpConfig is EpConfig
    assert cute_ep.DispatchResult is DispatchResult and cute_ep.DispatchHandle is DispatchHandle
    assert cute_ep.PeerTimeout is PeerTimeout and cute_ep.KernelDidNotRun is KernelDidNotRun
    assert cute_ep.CapacityExceeded is CapacityExceeded
    assert cute_ep.ReferenceEpBuffer is ReferenceEpBuffer and cute_ep.ReplicaMap is ReplicaMap
    assert cute_ep.A2aEpBuffer is A2aEpBuffer and cute_ep.EpBackend is EpBackend
    assert cute_ep.ConfigError is ConfigError
    assert callable(cute_ep.autograd.dispatch) and callable(cute_ep.autograd.combine)
    assert set(cute_ep.__all__) >= {"EpBuffer", "EpConfig", "autograd", "__version__"}


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        cute_ep.Nope  # noqa: B018


def test_every_test_file_name_is_unique():
    """pytest collects tests/ and tests/gpu/ without packages: two files of one name stop the whole run
    ("import file mismatch") — a GPU test named like a CPU one broke CI twice."""
    from collections import Counter

    from _launch import REPO

    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
