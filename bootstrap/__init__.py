"""Launch plumbing: where this process sits (``DistEnv``), torch.distributed + NVSHMEM start-up
(``Runtime``), and compiling the kernels once (``ModuleRegistry``, with an on-disk ``ObjectCache``).

    from cute_ep.bootstrap import DistEnv, Runtime
    env = DistEnv.from_environ()                     # torchrun or srun variables; virtual nodes
    with Runtime(env, symmetric_bytes=cfg.symmetric_bytes()) as rt:
        ...

Importing this package imports neither torch's CUDA stack, CuTe DSL nor NVSHMEM (they load on start).
"""

from cute_ep.bootstrap.compile import ModuleRegistry, ObjectCache, use_cpu_target
from cute_ep.bootstrap.dist_env import DistEnv, DistEnvError, possible_route_classes, route_class
from cute_ep.bootstrap.runtime import HeapConfigError, Runtime, start

__all__ = [
    "DistEnv",
    "DistEnvError",
    "HeapConfigError",
    "ModuleRegistry",
    "ObjectCache",
    "Runtime",
    "possible_route_classes",
    "route_class",
    "start",
    "use_cpu_target",
]
