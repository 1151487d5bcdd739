"""cute-ep: expert-parallel dispatch and combine in CuTe DSL on NVSHMEM.

Subpackages (installed from the top-level folders of the repository):
  cute_ep.bootstrap   -- launcher environment, torch.distributed + NVSHMEM init, kernel compile cache
  cute_ep.kernels     -- the CuTe DSL kernels (layout, dispatch, combine)
  cute_ep.validators  -- torch references, distributed checks, .npz baselines
"""

from cute_ep._version import __version__

__all__ = ["__version__"]
