"""Where this process sits in a launch: rank, node, GPU, rendezvous address.

`DistEnv.from_environ()` reads what the launcher exported (torchrun, SLURM's srun, or nothing for a
single process) and validates it up front, so that a bad launch fails with a message naming the
variable and its value instead of hanging in a collective or faulting in a kernel.

Two notions of "node" exist here:

* the *physical* node: the processes on one host (`physical_local_world_size`), which the launcher
  decides;
* the *effective* node used for routing (`local_world_size`), normally the same, but it may be
  made smaller with `CUTE_EP_LOCAL_WORLD_SIZE` (or the `local_world_size=` keyword) so that one host
  acts as several "virtual nodes". The cross-node code path then runs over NVLink, which lets it be
  tested on a single machine. torchrun already owns `LOCAL_WORLD_SIZE`, hence a separate variable.

Ranks are assumed to be placed in contiguous blocks per node (rank = node * L + local rank), which
is what torchrun and srun's default block distribution do; `from_environ` checks it.

The route classes at the bottom of the module name the four kinds of (source, destination) pairs
the kernels treat differently; the validators import them from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "LAUNCHERS",
    "LOCAL_WORLD_SIZE_OVERRIDE_VAR",
    "OTHER_NODE_OTHER_LOCAL",
    "OTHER_NODE_SAME_LOCAL",
    "ROUTE_CLASSES",
    "SAME_NODE",
    "SELF",
    "DistEnv",
    "DistEnvError",
    "parse_slurm_tasks_per_node",
    "possible_route_classes",
    "route_class",
]

LOCAL_WORLD_SIZE_OVERRIDE_VAR = "CUTE_EP_LOCAL_WORLD_SIZE"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
LAUNCHERS = ("torchrun", "slurm", "single")

_SLURM_MASTER_HINT = (
    "under srun, export them in the batch script before srun, e.g. "
    "`export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)` and "
    "`export MASTER_PORT=29500`"
)


class DistEnvError(ValueError):
    """The launch environment is missing something or is inconsistent.

    ``alike``: every rank of the launch gets this same error (a virtual node size that does not divide
    the ranks per host, say), so one rank's line tells the user everything; otherwise (the default) each
    rank may get its own, and each prints it (``cute_ep.tools.cli.report_setup_error``).
    """

    def __init__(self, message: str, *, alike: bool = False) -> None:
        super().__init__(message)
        self.alike = alike


# --------------------------------------------------------------------------------------------------
# small parsing helpers
# --------------------------------------------------------------------------------------------------


def _require(environ: Mapping[str, str], name: str, hint: str = "") -> str:
    value = environ.get(name)
    if value is None:
        extra = f" ({hint})" if hint else ""
        raise DistEnvError(f"environment variable {name} is not set{extra}")
    return value


def _parse_int(name: str, value: str, *, minimum: int = 0) -> int:
    """Parse `value` as an integer >= minimum; errors quote the variable and the raw value."""
    try:
        number = int(value.strip())
    except (ValueError, AttributeError):
        raise DistEnvError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        what = "negative" if minimum == 0 else f"less than {minimum}"
        raise DistEnvError(f"{name}={value!r} is {what}")
    return number


def _parse_port(name: str, value: str) -> int:
    port = _parse_int(name, value)
    if not 1 <= port <= 65535:
        raise DistEnvError(f"{name}={value!r} is not a TCP port (must be in 1..65535)")
    return port


_SLURM_TPN_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_slurm_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list into one count per node.

    SLURM writes runs of equal counts as ``N(xK)``: ``"4(x2),3"`` means two nodes with 4 tasks and
    one node with 3, and expands to ``[4, 4, 3]``.
    """
    counts: list[int] = []
    items = value.strip().split(",") if value.strip() else []
    if not items:
        raise DistEnvError(f"SLURM_TASKS_PER_NODE={value!r} is empty")
    for item in items:
        match = _SLURM_TPN_ITEM.match(item.strip())
        if match is None:
            raise DistEnvError(
                f"SLURM_TASKS_PER_NODE={value!r} is not in SLURM's format (e.g. '4', '4(x2)', '4(x2),3'): "
                f"cannot read {item!r}"
            )
        count = int(match.group(1))
        repeat = int(match.group(2)) if match.group(2) is not None else 1
        if repeat < 1:
            raise DistEnvError(f"SLURM_TASKS_PER_NODE={value!r} has a repeat count of 0 in {item!r}")
        counts.extend([count] * repeat)
    return counts


# --------------------------------------------------------------------------------------------------
# DistEnv
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    """One process of a launch. Construct with `DistEnv.from_environ()`, or directly in tests.

    `local_rank` and `physical_local_world_size` describe the host (which GPU to bind);
    `local_world_size` is the node size used for routing (smaller when virtual nodes are in use).
    """

    rank: int
    world_size: int
    local_rank: int
    physical_local_world_size: int
    local_world_size: int
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    launcher: str = "single"

    def __post_init__(self) -> None:
        # Structural invariants only; launcher-specific checks live in from_environ.
        if self.world_size < 1:
            raise DistEnvError(f"world_size={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise DistEnvError(f"rank={self.rank} is outside 0..{self.world_size - 1} (world_size)")
        if self.physical_local_world_size < 1:
            raise DistEnvError(f"physical_local_world_size={self.physical_local_world_size} must be >= 1")
        if not 0 <= self.local_rank < self.physical_local_world_size:
            raise DistEnvError(
                f"local_rank={self.local_rank} is outside 0..{self.physical_local_world_size - 1} "
                f"(physical_local_world_size)"
            )
        if self.world_size % self.physical_local_world_size:
            raise DistEnvError(
                f"world_size={self.world_size} is not a multiple of "
                f"physical_local_world_size={self.physical_local_world_size}"
            )
        if self.local_world_size < 1 or self.physical_local_world_size % self.local_world_size:
            raise DistEnvError(
                f"local_world_size={self.local_world_size} must be >= 1 and divide "
                f"physical_local_world_size={self.physical_local_world_size}"
            )
        if not 1 <= self.master_port <= 65535:
            raise DistEnvError(f"master_port={self.master_port} is not in 1..65535")
        if self.launcher not in LAUNCHERS:
            raise DistEnvError(f"launcher={self.launcher!r} is not one of {LAUNCHERS}")

    # -- derived topology ------------------------------------------------------------------------

    @property
    def nnodes(self) -> int:
        """Number of (possibly virtual) nodes."""
        return self.world_size // self.local_world_size

    @property
    def node_id(self) -> int:
        """Index of the (possibly virtual) node this rank belongs to."""
        return self.rank // self.local_world_size

    @property
    def local_index(self) -> int:
        """Index of this rank inside its (possibly virtual) node."""
        return self.rank % self.local_world_size

    @property
    def is_virtual(self) -> bool:
        """True when nodes are smaller than hosts (one host split into several virtual nodes)."""
        return self.local_world_size != self.physical_local_world_size

    @property
    def init_method(self) -> str:
        """The torch.distributed rendezvous URL."""
        host = self.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal needs brackets in a URL
        return f"tcp://{host}:{self.master_port}"

    def route_class_to(self, dst_rank: int) -> str:
        """Route class of sending from this rank to `dst_rank` (see `route_class`)."""
        return route_class(self.rank, dst_rank, self.local_world_size)

    # -- text --------------------------------------------------------------------------------------

    def describe(self) -> str:
        """One line for logs, e.g. 'rank 5/8 node 1/2 local 1/4 gpu 1 (4/host) torchrun tcp://h:29500'."""
        virtual = f" virtual nodes of {self.local_world_size}" if self.is_virtual else ""
        return (
            f"rank {self.rank}/{self.world_size} node {self.node_id}/{self.nnodes} "
            f"local {self.local_index}/{self.local_world_size} "
            f"gpu {self.local_rank} ({self.physical_local_world_size}/host){virtual} "
            f"{self.launcher} {self.init_method}"
        )

    def __str__(self) -> str:
        return self.describe()

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, local_world_size: int | None = None,
        local_world_size_name: str = "local_world_size",
    ) -> DistEnv:
        """Read the launcher's variables (torchrun, then srun, else a single process) and validate.

        `local_world_size` (or, if it is None, `CUTE_EP_LOCAL_WORLD_SIZE`) splits each host into
        virtual nodes of that many ranks; it must divide the number of processes per host (the error,
        the same on every rank, is a `DistEnvError` with `alike` set, naming the valid sizes).
        `local_world_size_name`: what the error calls the keyword, e.g. a script's "--local-world-size".
        """
        if environ is None:
            import os

            environ = os.environ

        if "RANK" in environ:
            launch = _from_torchrun(environ)
        elif "SLURM_PROCID" in environ:
            launch = _from_slurm(environ)
        else:
            launch = _from_single(environ)
        rank, world_size, local_rank, physical = (
            launch.rank,
            launch.world_size,
            launch.local_rank,
            launch.physical,
        )
        # Checks phrased with the launcher's variables; __post_init__ would catch the same but with
        # field names the user never typed.
        rank_var, ws_var, lr_var, lws_var = launch.names
        if world_size < 1:
            raise DistEnvError(f"{ws_var}={world_size} must be >= 1")
        if rank >= world_size:
            raise DistEnvError(f"{rank_var}={rank} is not less than {ws_var}={world_size}")
        if physical < 1:
            raise DistEnvError(f"{lws_var}={physical} must be >= 1")
        if local_rank >= physical:
            raise DistEnvError(f"{lr_var}={local_rank} is not less than {lws_var}={physical}")
        if world_size % physical:
            raise DistEnvError(
                f"{ws_var}={world_size} is not a multiple of {lws_var}={physical}: every node must run "
                f"the same number of ranks"
            )
        # Routing derives the node from the rank, so ranks must be numbered node by node.
        if rank % physical != local_rank:
            raise DistEnvError(
                f"{rank_var}={rank} with {lr_var}={local_rank} and {lws_var}={physical}: ranks are not "
                f"placed in contiguous blocks per node (expected local rank {rank % physical}); "
                f"use block distribution (srun's default, not --distribution=cyclic)"
            )

        effective = _resolve_override(environ, local_world_size, physical, world_size, local_world_size_name)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            physical_local_world_size=physical,
            local_world_size=effective,
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            launcher=launch.launcher,
        )


class _Launch(NamedTuple):
    """What a launcher's variables say, before the cross-checks in `DistEnv.from_environ`."""

    rank: int
    world_size: int
    local_rank: int
    physical: int
    master_addr: str
    master_port: int
    launcher: str
    names: tuple[str, str, str, str]  # variables behind rank, world size, local rank, local world size


_TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _from_torchrun(environ: Mapping[str, str]) -> _Launch:
    rank = _parse_int("RANK", _require(environ, "RANK"))
    local_rank = _parse_int("LOCAL_RANK", _require(environ, "LOCAL_RANK"))
    world_size = _parse_int("WORLD_SIZE", _require(environ, "WORLD_SIZE"))
    physical = _parse_int("LOCAL_WORLD_SIZE", _require(environ, "LOCAL_WORLD_SIZE"))
    master_addr = _require(environ, "MASTER_ADDR")
    master_port = _parse_port("MASTER_PORT", _require(environ, "MASTER_PORT"))
    if not master_addr.strip():
        raise DistEnvError("MASTER_ADDR='' is empty")
    return _Launch(
        rank, world_size, local_rank, physical, master_addr.strip(), master_port, "torchrun", _TORCHRUN_NAMES
    )


def _from_slurm(environ: Mapping[str, str]) -> _Launch:
    rank = _parse_int("SLURM_PROCID", _require(environ, "SLURM_PROCID"))
    local_rank = _parse_int("SLURM_LOCALID", _require(environ, "SLURM_LOCALID"))
    world_size = _parse_int("SLURM_NTASKS", _require(environ, "SLURM_NTASKS"))

    # SLURM_NTASKS_PER_NODE exists only with --ntasks-per-node; SLURM_TASKS_PER_NODE is always set
    # but in the compressed per-node form.
    if environ.get("SLURM_NTASKS_PER_NODE"):
        tpn_var = "SLURM_NTASKS_PER_NODE"
        tasks_per_node = _parse_int(tpn_var, environ[tpn_var], minimum=1)
    else:
        tpn_var = "SLURM_TASKS_PER_NODE"
        raw = _require(
            environ,
            "SLURM_TASKS_PER_NODE",
            "neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set; launch with srun",
        )
        per_node_list = parse_slurm_tasks_per_node(raw)
        distinct = sorted(set(per_node_list))
        if len(distinct) != 1:
            raise DistEnvError(
                f"SLURM_TASKS_PER_NODE={raw!r} gives different task counts per node {per_node_list}: "
                f"this project needs the same number of ranks on every node "
                f"(use --ntasks-per-node)"
            )
        tasks_per_node = distinct[0]
        if tasks_per_node < 1:
            raise DistEnvError(f"SLURM_TASKS_PER_NODE={raw!r} gives 0 tasks per node")
        if sum(per_node_list) != world_size:
            raise DistEnvError(
                f"SLURM_NTASKS={world_size} does not match SLURM_TASKS_PER_NODE={raw!r} "
                f"({sum(per_node_list)} tasks in all)"
            )

    for nodes_var in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if environ.get(nodes_var):
            nnodes = _parse_int(nodes_var, environ[nodes_var], minimum=1)
            if world_size != tasks_per_node * nnodes:
                raise DistEnvError(
                    f"SLURM_NTASKS={world_size} is not tasks per node ({tasks_per_node}) x "
                    f"{nodes_var}={nnodes}: every node must run the same number of ranks"
                )
            break  # the step's own count (SLURM_NNODES) wins over the job's

    if environ.get("SLURM_NODEID"):
        node = _parse_int("SLURM_NODEID", environ["SLURM_NODEID"])
        if rank // tasks_per_node != node:
            raise DistEnvError(
                f"SLURM_PROCID={rank} is on SLURM_NODEID={node}, but with {tasks_per_node} tasks per "
                f"node it should be on node {rank // tasks_per_node}: ranks must be placed in "
                f"contiguous blocks per node (srun's default block distribution)"
            )

    master_addr = _require(environ, "MASTER_ADDR", _SLURM_MASTER_HINT)
    port_raw = _require(environ, "MASTER_PORT", _SLURM_MASTER_HINT)
    if not master_addr.strip():
        raise DistEnvError(f"MASTER_ADDR='' is empty ({_SLURM_MASTER_HINT})")
    master_port = _parse_port("MASTER_PORT", port_raw)
    return _Launch(
        rank,
        world_size,
        local_rank,
        tasks_per_node,
        master_addr.strip(),
        master_port,
        "slurm",
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", tpn_var),
    )


def _from_single(environ: Mapping[str, str]) -> _Launch:
    master_addr = environ.get("MASTER_ADDR", "").strip() or DEFAULT_MASTER_ADDR
    port_raw = environ.get("MASTER_PORT")
    master_port = _parse_port("MASTER_PORT", port_raw) if port_raw else DEFAULT_MASTER_PORT
    return _Launch(0, 1, 0, 1, master_addr, master_port, "single", _TORCHRUN_NAMES)


def _resolve_override(environ: Mapping[str, str], keyword: int | None, physical: int, world_size: int,
                      keyword_name: str = "local_world_size") -> int:
    """Effective local world size: keyword (called ``keyword_name`` in errors), else
    CUTE_EP_LOCAL_WORLD_SIZE, else the physical one."""
    if keyword is not None:
        name = keyword_name
        shown = f" {keyword!r}" if keyword_name.startswith("--") else f"={keyword!r}"
        if isinstance(keyword, bool) or not isinstance(keyword, int):
            raise DistEnvError(f"{name}{shown} is not an integer", alike=True)
        value = keyword
    else:
        raw = environ.get(LOCAL_WORLD_SIZE_OVERRIDE_VAR, "")
        if not raw.strip():
            return physical  # unset or empty: no override
        name, shown = LOCAL_WORLD_SIZE_OVERRIDE_VAR, f"={raw!r}"
        value = _parse_int(name, raw, minimum=1)
    if value < 1:
        raise DistEnvError(f"{name}{shown} must be >= 1", alike=True)
    # Virtual nodes must not straddle hosts: a straddling "node" would route its "same node"
    # traffic over the network path it claims not to use. Dividing the host size also makes the
    # override divide world_size, since every host runs the same number of ranks.
    if physical % value:
        sizes = [d for d in range(1, physical + 1) if physical % d == 0]
        choices = ", ".join(map(str, sizes[:-1])) + f" or {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
        raise DistEnvError(
            f"{name}{shown} does not divide the {physical} processes on this host "
            f"(and world size {world_size}): virtual nodes must not straddle hosts; use {choices}",
            alike=True,
        )
    return value


# --------------------------------------------------------------------------------------------------
# route classes
# --------------------------------------------------------------------------------------------------

SELF = "self"
SAME_NODE = "same_node"
OTHER_NODE_SAME_LOCAL = "other_node_same_local_rank"
OTHER_NODE_OTHER_LOCAL = "other_node_other_local_rank"
ROUTE_CLASSES: tuple[str, ...] = (SELF, SAME_NODE, OTHER_NODE_SAME_LOCAL, OTHER_NODE_OTHER_LOCAL)


def route_class(src_rank: int, dst_rank: int, local_world_size: int) -> str:
    """Classify a (source, destination) pair of ranks with nodes of `local_world_size` ranks.

    The kernels use different paths for each class (local copy, NVLink, direct RDMA to the peer
    with the same local index, or a relay through it), so tests need to cover all of them.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size} must be >= 1")
    if src_rank < 0 or dst_rank < 0:
        raise ValueError(f"ranks must be non-negative, got src_rank={src_rank}, dst_rank={dst_rank}")
    if src_rank == dst_rank:
        return SELF
    if src_rank // local_world_size == dst_rank // local_world_size:
        return SAME_NODE
    if src_rank % local_world_size == dst_rank % local_world_size:
        return OTHER_NODE_SAME_LOCAL
    return OTHER_NODE_OTHER_LOCAL


def possible_route_classes(world_size: int, local_world_size: int) -> tuple[str, ...]:
    """The route classes that occur for some pair of ranks in this topology, in ROUTE_CLASSES order."""
    if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"world_size={world_size} must be a positive multiple of local_world_size={local_world_size}"
        )
    nnodes = world_size // local_world_size
    found = [SELF]
    if local_world_size >= 2:
        found.append(SAME_NODE)
    if nnodes >= 2:
        found.append(OTHER_NODE_SAME_LOCAL)
        if local_world_size >= 2:
            found.append(OTHER_NODE_OTHER_LOCAL)
    return tuple(found)
