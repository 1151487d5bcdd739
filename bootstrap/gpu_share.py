"""Ranks that share a GPU: which GPU a rank binds, how many SMs it may count on, and the CUDA MPS check.

A host may run more ranks than it has GPUs (a workstation or a CI runner with one GPU running 2, 4 or 8
ranks). NVSHMEM supports several processes per GPU, with two conditions this module turns into rules:

* **CUDA MPS must serve the GPU.** Without it NVSHMEM runs in its "limited" multi-process mode: it refuses
  on-stream barriers and the processes' kernels time-slice instead of running together, so kernels that
  wait for each other crawl or time out. ``Runtime`` refuses to start a shared GPU without MPS
  (``GpuShareError`` says how to start it: ``bash scripts/mps.sh start``).
* **Each rank counts on its share of the SMs, and the ranks together leave half the GPU free.** A rank
  that waits in dispatch or combine holds its CTAs' SMs until the slowest rank on the GPU arrives, and
  that rank must still run its own work on what is left, including GEMMs launched as thread-block
  clusters, whose CTAs need free SMs together in one GPC. So the ranks on one GPU may hold at most half
  of it between them: ``num_sms`` may not exceed ``SMs // (2 * ranks on the GPU)`` (``sm_share``; a rank
  alone on its GPU may use every SM). Measured on one H100 (132 SMs) with 8 ranks running an MoE layer's
  training step: at 16 SMs per rank (128 of 132) the peers' combine waited for one rank whose cuBLAS
  GEMM (``nvjet_sm90_tst_64x8_64x16_2x4_h_bz_NNT``) could not start until their waits timed out, in the
  first step and again in a later one; at 12 and 8 SMs per rank every step passed. The layout's CTAs
  also wait for each other, so every rank's grid must be resident at once: within the share it is.
* **No MPS thread percentage.** NVSHMEM asks that the ranks' ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` add up to
  at most 100, unless ``NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1`` (``shared_gpu_environ`` sets
  it). A percentage did not work with these kernels: on an H100 with 2 ranks at 50% each (66 SMs per
  process), the first GPU test whose grids fill each rank's share (66 CTAs, waiting for each other) failed
  and the launch then hung, while unlimited ranks with the same grids passed every test. MPS does not
  promise two limited processes disjoint SMs. A user's percentage is kept, and caps the share.

NCCL refuses two ranks on one GPU, so a launch with a shared GPU uses a gloo-only world group
(``Runtime.group``); see ``cute_ep.a2a_backend`` for how the all-to-all backend moves rows then.

Binding rule: local rank r binds GPU ``r % G``, where G is the number of GPUs the host's ranks use (the
visible count, or ``CUTE_EP_GPUS_PER_HOST`` to use fewer, e.g. 8 ranks on one GPU of a 2-GPU host).
Pure host logic: importable and testable without CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "GPUS_PER_HOST_VAR",
    "MPS_PERCENTAGE_VAR",
    "NVSHMEM_IGNORE_MPS_VAR",
    "GpuPlacement",
    "GpuShareError",
    "gpus_in_use",
    "mps_missing_message",
    "shared_gpu_environ",
    "place",
    "sm_share",
    "sm_share_error",
    "world_group_backend",
]

GPUS_PER_HOST_VAR = "CUTE_EP_GPUS_PER_HOST"
MPS_PERCENTAGE_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
NVSHMEM_IGNORE_MPS_VAR = "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class GpuShareError(RuntimeError):
    """Ranks share a GPU in a way that cannot work (no MPS, a bad GPU count)."""


@dataclass(frozen=True)
class GpuPlacement:
    """Where one rank runs on its host.

    ``gpu``: the index (among the visible GPUs) this rank binds; ``gpus``: how many GPUs the host's ranks
    use; ``ranks_per_gpu``: how many of the host's ranks bind this rank's GPU (itself included);
    ``shared``: some GPU of the host serves more than one rank (then the world group is gloo only).
    """

    gpu: int
    gpus: int
    ranks_per_gpu: int
    shared: bool

    def describe(self) -> str:
        """'gpu 0 of 1, shared by 4 ranks' or 'gpu 3 of 8'."""
        shared = f", shared by {self.ranks_per_gpu} ranks" if self.ranks_per_gpu > 1 else ""
        return f"gpu {self.gpu} of {self.gpus}{shared}"


def gpus_in_use(visible: int, environ: Mapping[str, str]) -> int:
    """How many GPUs this host's ranks use: ``CUTE_EP_GPUS_PER_HOST`` if set (1 .. visible), else all
    ``visible`` GPUs. Raises ``GpuShareError`` for no GPU or a bad value."""
    if visible < 1:
        raise GpuShareError("this host shows no CUDA GPU (check CUDA_VISIBLE_DEVICES and the driver)")
    raw = environ.get(GPUS_PER_HOST_VAR, "").strip()
    if not raw:
        return visible
    try:
        wanted = int(raw)
    except ValueError:
        raise GpuShareError(f"{GPUS_PER_HOST_VAR}={raw!r} is not an integer") from None
    if not 1 <= wanted <= visible:
        raise GpuShareError(f"{GPUS_PER_HOST_VAR}={raw!r} must be in 1..{visible} (the GPUs this host shows)")
    return wanted


def place(local_rank: int, ranks_on_host: int, gpus: int) -> GpuPlacement:
    """The placement of local rank ``local_rank`` of ``ranks_on_host`` ranks on ``gpus`` GPUs: GPU
    ``local_rank % gpus``, shared by the host's ranks with the same remainder."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if not 0 <= local_rank < ranks_on_host:
        raise ValueError(f"local_rank must be in 0..{ranks_on_host - 1}, got {local_rank}")
    gpu = local_rank % gpus
    # Ranks gpu, gpu + G, gpu + 2G, ... below ranks_on_host.
    ranks_per_gpu = (ranks_on_host - 1 - gpu) // gpus + 1
    return GpuPlacement(gpu=gpu, gpus=min(gpus, ranks_on_host), ranks_per_gpu=ranks_per_gpu,
                        shared=ranks_on_host > gpus)


def world_group_backend(placement: GpuPlacement) -> str:
    """The torch.distributed backend of the world group: NCCL for CUDA tensors beside gloo for the host's,
    or gloo alone when the host's ranks share GPUs (NCCL refuses two ranks on one GPU)."""
    return "gloo" if placement.shared else "cpu:gloo,cuda:nccl"


def shared_gpu_environ(placement: GpuPlacement, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a rank of ``placement`` sets before NVSHMEM starts: on a GPU it shares, NVSHMEM's leave
    to run without MPS thread percentages, unless the user set a percentage or the variable."""
    if placement.ranks_per_gpu < 2 or environ.get(MPS_PERCENTAGE_VAR, "").strip():
        return {}
    if NVSHMEM_IGNORE_MPS_VAR in environ:
        return {}
    return {NVSHMEM_IGNORE_MPS_VAR: "1"}


def sm_share(device_sms: int, ranks_per_gpu: int, context_sms: int | None = None) -> int:
    """SMs one rank may count on: every SM of the GPU (``device_sms``) for a rank alone on it; half of
    them split evenly over ``ranks_per_gpu`` > 1 ranks (module docstring: the other half runs the work of
    a rank the others wait for); and no more than its context may use (``context_sms``: the MPS limit,
    None if unknown)."""
    if device_sms < 1 or ranks_per_gpu < 1:
        raise ValueError(f"device_sms and ranks_per_gpu must be >= 1, got {device_sms}, {ranks_per_gpu}")
    share = device_sms if ranks_per_gpu == 1 else device_sms // (2 * ranks_per_gpu)
    if context_sms is not None and context_sms >= 1:
        share = min(share, context_sms)
    return max(share, 1)


def sm_share_error(num_sms: int, shares: list[tuple[int, int, int]]) -> str | None:
    """Why ``num_sms`` CTAs per rank cannot run, or None. ``shares``: (share, device SMs, ranks on the GPU)
    per rank with a GPU: at most the least share (``sm_share``, module docstring)."""
    if not shares:
        return None
    share, device_sms, ranks = min(shares)
    if num_sms <= share:
        return None
    if ranks > 1:
        return (f"num_sms must be at most a rank's share of its GPU, {share} SMs ({device_sms} SMs shared by "
                f"{ranks} ranks, which may hold half of them between them: a rank the others wait for "
                f"needs the rest for its own work), got {num_sms}: pass num_sms <= {share} (0 takes it)")
    return (f"num_sms must be at most the GPU's SM count, {share}: the layout's CTAs wait for each other, "
            f"one per SM, got {num_sms}")


def mps_missing_message(gpu: int, ranks_per_gpu: int) -> str:
    """The error for ranks sharing GPU ``gpu`` without CUDA MPS, with the way out."""
    return (
        f"{ranks_per_gpu} ranks share GPU {gpu}, but CUDA MPS is not serving it: without MPS their kernels "
        f"time-slice and NVSHMEM refuses on-stream barriers, so the ranks' kernels, which wait for each "
        f"other, would stall. Start MPS before the launch (`bash scripts/mps.sh start`, or "
        f"`nvidia-cuda-mps-control -d` with CUDA_MPS_PIPE_DIRECTORY set alike for the daemon and the "
        f"ranks), or run one rank per GPU"
    )
