"""cute-ep: expert-parallel dispatch and combine in CuTe DSL on NVSHMEM.

The front door (imported on first use, so ``import cute_ep`` stays light):
  cute_ep.EpConfig, cute_ep.EpBuffer, cute_ep.DispatchResult, cute_ep.DispatchHandle,
  cute_ep.EpBackend (the interface the three backends implement, cute_ep/api.py),
  cute_ep.PeerTimeout, cute_ep.CapacityExceeded, cute_ep.KernelDidNotRun, cute_ep.ConfigError,
  cute_ep.ReferenceEpBuffer (same API on the CPU),
  cute_ep.A2aEpBuffer (same API on all_to_all_single: NCCL or gloo),
  cute_ep.ReplicaMap (hot-expert replication, static), cute_ep.ElasticExperts (hot experts cloned every
  step: planner, routing, weight and gradient coherence),
  cute_ep.autograd (differentiable dispatch / combine),
  cute_ep.MoELayer (router -> dispatch -> grouped expert GEMMs with an offset-aware SwiGLU -> combine,
  a torch.nn.Module on any backend), cute_ep.RouterConfig, cute_ep.offset_swiglu.

Subpackages (installed from the top-level folders of the repository):
  cute_ep.bootstrap   -- launcher environment, torch.distributed + NVSHMEM init, kernel compile cache
  cute_ep.kernels     -- the CuTe DSL kernels (layout, dispatch, fan-out, combine) and the table of buffers
  cute_ep.validators  -- distributed checks against the torch references (cute_ep.reference), .npz baselines

Beside them, cute_ep.tools (cute_ep/tools/) holds what the scripts, examples and benchmarks share:
argument parsing and messages, the checking scripts' printing, the benchmark peers and reports. It imports
the library; the library never imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

from cute_ep._version import __version__

_EXPORTS = {
    "EpConfig": "cute_ep.kernels.config",
    "EpBuffer": "cute_ep.buffer",
    "EpBackend": "cute_ep.api",
    "DispatchResult": "cute_ep.api",
    "DispatchHandle": "cute_ep.api",
    "PeerTimeout": "cute_ep.status",
    "CapacityExceeded": "cute_ep.status",
    "KernelDidNotRun": "cute_ep.status",
    "ConfigError": "cute_ep.kernels.config",
    "ReferenceEpBuffer": "cute_ep.reference_backend",
    "A2aEpBuffer": "cute_ep.a2a_backend",
    "ReplicaMap": "cute_ep.replication",
    "ElasticExperts": "cute_ep.elastic",
    "MoELayer": "cute_ep.moe_layer",
    "RouterConfig": "cute_ep.moe_layer",
    "offset_swiglu": "cute_ep.swiglu",
}

__all__ = ["__version__", "autograd", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "autograd":
        return importlib.import_module("cute_ep.autograd")
    raise AttributeError(f"module 'cute_ep' has no attribute {name!r}")
