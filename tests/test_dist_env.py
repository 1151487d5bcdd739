"""DistEnv parsing/validation, route classes, and symmetric-heap sizing (CPU only, no processes)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest

from cute_ep.bootstrap.dist_env import (
    OTHER_NODE_OTHER_LOCAL,
    OTHER_NODE_SAME_LOCAL,
    ROUTE_CLASSES,
    SAME_NODE,
    SELF,
    DistEnv,
    DistEnvError,
    parse_slurm_tasks_per_node,
    possible_route_classes,
    route_class,
)
from cute_ep.bootstrap.runtime import (
    GIB,
    HEAP_ENV_VAR,
    MIB,
    HeapConfigError,
    Runtime,
    configure_symmetric_heap,
    format_size,
    heap_bytes_for,
    parse_size,
)


def torchrun_env(rank: int = 5, local_rank: int = 1, world: int = 8, local_world: int = 4, **extra: str):
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29400",
    }
    env.update(extra)
    return env


def slurm_env(procid: int = 5, localid: int = 1, ntasks: int = 8, **extra: str) -> dict[str, str]:
    env = {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NTASKS": str(ntasks),
        "MASTER_ADDR": "gpu-a01",
        "MASTER_PORT": "29555",
    }
    env.update(extra)
    return env


@contextlib.contextmanager
def raises_naming(*fragments: str) -> Iterator[pytest.ExceptionInfo[DistEnvError]]:
    """Expect a DistEnvError whose message contains every fragment (the variable and its value)."""
    with pytest.raises(DistEnvError) as info:
        yield info
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# --------------------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------------------


def test_torchrun_env() -> None:
    env = DistEnv.from_environ(torchrun_env())
    assert env == DistEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        physical_local_world_size=4,
        local_world_size=4,
        master_addr="node0",
        master_port=29400,
        launcher="torchrun",
    )
    assert (env.nnodes, env.node_id, env.local_index, env.is_virtual) == (2, 1, 1, False)
    assert env.init_method == "tcp://node0:29400"
    text = str(env)
    assert text == env.describe()
    assert "rank 5/8" in text and "node 1/2" in text and "torchrun" in text and "\n" not in text


def test_torchrun_wins_over_slurm_variables() -> None:
    # torchrun started by srun: the children carry both sets; torchrun's are the per-process ones.
    environ = {**slurm_env(procid=0, localid=0, ntasks=2, SLURM_NTASKS_PER_NODE="1"), **torchrun_env()}
    assert DistEnv.from_environ(environ).launcher == "torchrun"


@pytest.mark.parametrize(
    "missing", ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
)
def test_torchrun_missing_variable(missing: str) -> None:
    environ = torchrun_env()
    del environ[missing]
    if missing == "RANK":
        # Without RANK this is not a torchrun launch at all: a single process.
        assert DistEnv.from_environ(environ).launcher == "single"
        return
    with raises_naming(missing, "not set"):
        DistEnv.from_environ(environ)


@pytest.mark.parametrize("var", ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"])
def test_torchrun_non_integer(var: str) -> None:
    with raises_naming(f"{var}='abc' is not an integer"):
        DistEnv.from_environ(torchrun_env(**{var: "abc"}))


@pytest.mark.parametrize("var", ["RANK", "LOCAL_RANK"])
def test_torchrun_negative(var: str) -> None:
    with raises_naming(f"{var}='-1'", "negative"):
        DistEnv.from_environ(torchrun_env(**{var: "-1"}))


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ({"RANK": "8"}, ("RANK=8", "WORLD_SIZE=8")),
        ({"LOCAL_RANK": "4"}, ("LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4")),
        ({"WORLD_SIZE": "6", "RANK": "5"}, ("WORLD_SIZE=6", "LOCAL_WORLD_SIZE=4", "same number")),
        ({"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0"}, ("WORLD_SIZE=0",)),
        ({"LOCAL_WORLD_SIZE": "0"}, ("LOCAL_WORLD_SIZE=0",)),
        ({"LOCAL_RANK": "2"}, ("RANK=5", "LOCAL_RANK=2", "contiguous")),
        ({"MASTER_PORT": "0"}, ("MASTER_PORT='0'", "1..65535")),
        ({"MASTER_PORT": "70000"}, ("MASTER_PORT='70000'", "1..65535")),
        ({"MASTER_ADDR": " "}, ("MASTER_ADDR",)),
    ],
)
def test_torchrun_inconsistent(fields: dict[str, str], fragments: tuple[str, ...]) -> None:
    with raises_naming(*fragments):
        DistEnv.from_environ(torchrun_env(**fields))


def test_error_is_value_error() -> None:
    assert issubclass(DistEnvError, ValueError)


# --------------------------------------------------------------------------------------------------
# srun
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("4", [4]),
        ("4(x2)", [4, 4]),
        ("4(x2),4", [4, 4, 4]),
        ("2(x3),2", [2, 2, 2, 2]),
        ("4,2", [4, 2]),
        ("4(x2),3", [4, 4, 3]),
        (" 8 ", [8]),
    ],
)
def test_parse_slurm_tasks_per_node(value: str, expected: list[int]) -> None:
    assert parse_slurm_tasks_per_node(value) == expected


@pytest.mark.parametrize("value", ["", "x", "4(2)", "4(x)", "4,,4", "4(x0)", "-4", "4(x2"])
def test_parse_slurm_tasks_per_node_rejects(value: str) -> None:
    with raises_naming("SLURM_TASKS_PER_NODE", repr(value)):
        parse_slurm_tasks_per_node(value)


def test_slurm_ntasks_per_node() -> None:
    env = DistEnv.from_environ(slurm_env(SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="2"))
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 8, 1)
    assert (env.physical_local_world_size, env.local_world_size, env.nnodes, env.node_id) == (4, 4, 2, 1)
    assert env.init_method == "tcp://gpu-a01:29555"


@pytest.mark.parametrize(
    ("tasks_per_node", "ntasks", "per_node", "nnodes"),
    [("4", 4, 4, 1), ("4(x2)", 8, 4, 2), ("4(x2),4", 12, 4, 3), ("2(x3),2", 8, 2, 4)],
)
def test_slurm_tasks_per_node_uniform(tasks_per_node: str, ntasks: int, per_node: int, nnodes: int) -> None:
    last = ntasks - 1
    environ = slurm_env(
        procid=last,
        localid=last % per_node,
        ntasks=ntasks,
        SLURM_TASKS_PER_NODE=tasks_per_node,
        SLURM_NNODES=str(nnodes),
        SLURM_NODEID=str(nnodes - 1),
    )
    env = DistEnv.from_environ(environ)
    assert (env.physical_local_world_size, env.nnodes, env.node_id) == (per_node, nnodes, nnodes - 1)


@pytest.mark.parametrize("tasks_per_node", ["4,2", "4(x2),3"])
def test_slurm_tasks_per_node_non_uniform(tasks_per_node: str) -> None:
    ntasks = sum(parse_slurm_tasks_per_node(tasks_per_node))
    environ = slurm_env(procid=0, localid=0, ntasks=ntasks, SLURM_TASKS_PER_NODE=tasks_per_node)
    with raises_naming(f"SLURM_TASKS_PER_NODE={tasks_per_node!r}", "same number of ranks"):
        DistEnv.from_environ(environ)


def test_slurm_tasks_per_node_total_mismatch() -> None:
    environ = slurm_env(procid=0, localid=0, ntasks=6, SLURM_TASKS_PER_NODE="4(x2)")
    with raises_naming("SLURM_NTASKS=6", "SLURM_TASKS_PER_NODE='4(x2)'"):
        DistEnv.from_environ(environ)


def test_slurm_no_tasks_per_node() -> None:
    with raises_naming("SLURM_TASKS_PER_NODE", "not set"):
        DistEnv.from_environ(slurm_env())


@pytest.mark.parametrize("nodes_var", ["SLURM_NNODES", "SLURM_JOB_NUM_NODES"])
def test_slurm_node_count_mismatch(nodes_var: str) -> None:
    environ = slurm_env(SLURM_NTASKS_PER_NODE="4", **{nodes_var: "3"})
    with raises_naming("SLURM_NTASKS=8", f"{nodes_var}=3"):
        DistEnv.from_environ(environ)


def test_slurm_step_node_count_wins_over_job() -> None:
    # A 1-node step inside a 2-node allocation: SLURM_NNODES (step) is the one that matters.
    environ = slurm_env(
        procid=1, localid=1, ntasks=4, SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="1", SLURM_JOB_NUM_NODES="2"
    )
    assert DistEnv.from_environ(environ).nnodes == 1


def test_slurm_cyclic_distribution_rejected() -> None:
    # --distribution=cyclic: rank 1 is on node 1 with local id 0.
    environ = slurm_env(procid=1, localid=0, ntasks=8, SLURM_NTASKS_PER_NODE="4")
    with raises_naming("SLURM_PROCID=1", "SLURM_LOCALID=0", "contiguous"):
        DistEnv.from_environ(environ)
    environ = slurm_env(procid=4, localid=0, ntasks=8, SLURM_NTASKS_PER_NODE="4", SLURM_NODEID="0")
    with raises_naming("SLURM_PROCID=4", "SLURM_NODEID=0", "contiguous"):
        DistEnv.from_environ(environ)


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
def test_slurm_missing_master(missing: str) -> None:
    environ = slurm_env(SLURM_NTASKS_PER_NODE="4")
    del environ[missing]
    with raises_naming(missing, "not set", "export", "scontrol show hostnames"):
        DistEnv.from_environ(environ)


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ({"SLURM_PROCID": "x"}, ("SLURM_PROCID='x' is not an integer",)),
        ({"SLURM_LOCALID": "-2"}, ("SLURM_LOCALID='-2'", "negative")),
        ({"SLURM_NTASKS": "4.0"}, ("SLURM_NTASKS='4.0' is not an integer",)),
        ({"SLURM_NTASKS_PER_NODE": "0"}, ("SLURM_NTASKS_PER_NODE='0'",)),
        ({"SLURM_NTASKS_PER_NODE": "3"}, ("SLURM_NTASKS=8", "SLURM_NTASKS_PER_NODE=3")),
        ({"SLURM_PROCID": "9"}, ("SLURM_PROCID=9", "SLURM_NTASKS=8")),
        ({"SLURM_LOCALID": "5"}, ("SLURM_LOCALID=5", "SLURM_NTASKS_PER_NODE=4")),
        ({"MASTER_PORT": "http"}, ("MASTER_PORT='http' is not an integer",)),
    ],
)
def test_slurm_bad_values(fields: dict[str, str], fragments: tuple[str, ...]) -> None:
    environ = slurm_env(SLURM_NTASKS_PER_NODE="4")
    environ.update(fields)
    with raises_naming(*fragments):
        DistEnv.from_environ(environ)


# --------------------------------------------------------------------------------------------------
# single process
# --------------------------------------------------------------------------------------------------


def test_single_process_defaults() -> None:
    env = DistEnv.from_environ({})
    assert env == DistEnv(0, 1, 0, 1, 1, "127.0.0.1", 29500, "single")
    assert (env.nnodes, env.node_id, env.local_index, env.is_virtual) == (1, 0, 0, False)
    assert env.init_method == "tcp://127.0.0.1:29500"


def test_single_process_master_from_env() -> None:
    env = DistEnv.from_environ({"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "31000"})
    assert env.init_method == "tcp://10.0.0.7:31000"
    with raises_naming("MASTER_PORT='99999'"):
        DistEnv.from_environ({"MASTER_PORT": "99999"})


def test_from_environ_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT", "CUTE_EP_LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "30123")
    assert DistEnv.from_environ().master_port == 30123


def test_ipv6_master_addr_is_bracketed() -> None:
    assert DistEnv.from_environ({"MASTER_ADDR": "::1"}).init_method == "tcp://[::1]:29500"


# --------------------------------------------------------------------------------------------------
# local world size override (virtual nodes)
# --------------------------------------------------------------------------------------------------


def test_override_env_var_makes_virtual_nodes() -> None:
    environ = torchrun_env(rank=3, local_rank=3, world=4, local_world=4, CUTE_EP_LOCAL_WORLD_SIZE="2")
    env = DistEnv.from_environ(environ)
    assert (env.local_world_size, env.physical_local_world_size, env.local_rank) == (2, 4, 3)
    assert (env.nnodes, env.node_id, env.local_index, env.is_virtual) == (2, 1, 1, True)
    assert "virtual" in env.describe()


def test_override_keyword_wins_over_env_var() -> None:
    environ = torchrun_env(rank=3, local_rank=3, world=4, local_world=4, CUTE_EP_LOCAL_WORLD_SIZE="2")
    env = DistEnv.from_environ(environ, local_world_size=1)
    assert (env.local_world_size, env.nnodes, env.node_id, env.local_index) == (1, 4, 3, 0)
    # The keyword is used even when the env var is malformed.
    environ["CUTE_EP_LOCAL_WORLD_SIZE"] = "junk"
    assert DistEnv.from_environ(environ, local_world_size=4).local_world_size == 4


def test_override_empty_env_var_is_unset() -> None:
    env = DistEnv.from_environ(torchrun_env(CUTE_EP_LOCAL_WORLD_SIZE=""))
    assert env.local_world_size == 4 and not env.is_virtual


def test_override_on_slurm() -> None:
    environ = slurm_env(SLURM_NTASKS_PER_NODE="4", CUTE_EP_LOCAL_WORLD_SIZE="1")
    env = DistEnv.from_environ(environ)
    assert (env.launcher, env.nnodes, env.node_id, env.local_index) == ("slurm", 8, 5, 0)


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ("0", ("CUTE_EP_LOCAL_WORLD_SIZE='0'",)),
        ("-2", ("CUTE_EP_LOCAL_WORLD_SIZE='-2'",)),
        ("two", ("CUTE_EP_LOCAL_WORLD_SIZE='two' is not an integer",)),
        ("3", ("CUTE_EP_LOCAL_WORLD_SIZE='3'", "does not divide", "straddle")),
        ("8", ("CUTE_EP_LOCAL_WORLD_SIZE='8'", "does not divide")),
    ],
)
def test_override_env_var_bad(value: str, fragments: tuple[str, ...]) -> None:
    with raises_naming(*fragments):
        DistEnv.from_environ(torchrun_env(CUTE_EP_LOCAL_WORLD_SIZE=value))


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        (0, ("local_world_size=0", ">= 1")),
        (3, ("local_world_size=3", "does not divide")),
        (8, ("local_world_size=8", "does not divide")),
        ("2", ("local_world_size='2'", "not an integer")),
        (True, ("local_world_size=True", "not an integer")),
    ],
)
def test_override_keyword_bad(value: object, fragments: tuple[str, ...]) -> None:
    with raises_naming(*fragments):
        DistEnv.from_environ(torchrun_env(), local_world_size=value)  # type: ignore[arg-type]


def test_override_single_process() -> None:
    assert DistEnv.from_environ({}, local_world_size=1).local_world_size == 1
    with raises_naming("CUTE_EP_LOCAL_WORLD_SIZE='2'"):
        DistEnv.from_environ({"CUTE_EP_LOCAL_WORLD_SIZE": "2"})


# --------------------------------------------------------------------------------------------------
# direct construction
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"rank": 4}, "rank=4"),
        ({"world_size": 0, "rank": 0}, "world_size=0"),
        ({"local_rank": 4}, "local_rank=4"),
        ({"local_world_size": 3}, "local_world_size=3"),
        ({"physical_local_world_size": 3, "local_world_size": 3}, "world_size=4"),
        ({"master_port": 0}, "master_port=0"),
        ({"launcher": "mpirun"}, "launcher='mpirun'"),
    ],
)
def test_direct_construction_validates(kwargs: dict[str, object], fragment: str) -> None:
    base: dict[str, object] = {
        "rank": 1,
        "world_size": 4,
        "local_rank": 1,
        "physical_local_world_size": 4,
        "local_world_size": 2,
    }
    base.update(kwargs)
    with raises_naming(fragment):
        DistEnv(**base)  # type: ignore[arg-type]


def test_dist_env_is_frozen_and_hashable() -> None:
    env = DistEnv(1, 4, 1, 4, 2)
    with pytest.raises(AttributeError):
        env.rank = 2  # type: ignore[misc]
    assert len({env, DistEnv(1, 4, 1, 4, 2)}) == 1
    assert env.route_class_to(3) == OTHER_NODE_SAME_LOCAL


# --------------------------------------------------------------------------------------------------
# route classes
# --------------------------------------------------------------------------------------------------

S, N, OS, OO = SELF, SAME_NODE, OTHER_NODE_SAME_LOCAL, OTHER_NODE_OTHER_LOCAL

ROUTE_TABLES = {
    # (world, local): table[src][dst]
    (4, 4): [
        [S, N, N, N],
        [N, S, N, N],
        [N, N, S, N],
        [N, N, N, S],
    ],
    (4, 2): [
        [S, N, OS, OO],
        [N, S, OO, OS],
        [OS, OO, S, N],
        [OO, OS, N, S],
    ],
    (4, 1): [
        [S, OS, OS, OS],
        [OS, S, OS, OS],
        [OS, OS, S, OS],
        [OS, OS, OS, S],
    ],
    (1, 1): [[S]],
}

POSSIBLE = {
    (4, 4): (S, N),
    (4, 2): (S, N, OS, OO),
    (4, 1): (S, OS),
    (1, 1): (S,),
}


def test_route_class_constants() -> None:
    assert ROUTE_CLASSES == (
        "self",
        "same_node",
        "other_node_same_local_rank",
        "other_node_other_local_rank",
    )


@pytest.mark.parametrize(("world", "local"), list(ROUTE_TABLES))
def test_route_class_table(world: int, local: int) -> None:
    table = ROUTE_TABLES[(world, local)]
    for src, dst in itertools.product(range(world), repeat=2):
        assert route_class(src, dst, local) == table[src][dst], (src, dst)


@pytest.mark.parametrize(("world", "local"), list(POSSIBLE))
def test_possible_route_classes(world: int, local: int) -> None:
    expected = POSSIBLE[(world, local)]
    assert possible_route_classes(world, local) == expected
    seen = {route_class(s, d, local) for s, d in itertools.product(range(world), repeat=2)}
    assert tuple(c for c in ROUTE_CLASSES if c in seen) == expected


def test_possible_route_classes_matches_enumeration_broadly() -> None:
    for world in range(1, 13):
        for local in range(1, world + 1):
            if world % local:
                continue
            seen = {route_class(s, d, local) for s, d in itertools.product(range(world), repeat=2)}
            assert possible_route_classes(world, local) == tuple(c for c in ROUTE_CLASSES if c in seen)


@pytest.mark.parametrize(("world", "local"), [(4, 3), (0, 1), (4, 0)])
def test_possible_route_classes_rejects(world: int, local: int) -> None:
    with pytest.raises(ValueError, match=f"world_size={world}"):
        possible_route_classes(world, local)


def test_route_class_rejects() -> None:
    with pytest.raises(ValueError, match="local_world_size=0"):
        route_class(0, 1, 0)
    with pytest.raises(ValueError, match="src_rank=-1"):
        route_class(-1, 1, 2)


# --------------------------------------------------------------------------------------------------
# symmetric heap sizing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("buffers", "heap"),
    [
        (0, 2 * GIB),
        (352 * MIB, 2 * GIB),  # the case that faulted with NVSHMEM's 1 GiB default
        (1 * GIB, 2 * GIB),  # 1.25 GiB + 256 MiB = 1.5 GiB -> 2 GiB
        (2 * GIB, 3 * GIB),  # 2.5 + 0.25 = 2.75 -> 3
        (6 * GIB, 8 * GIB),  # 7.5 + 0.25 = 7.75 -> 8
        (8 * GIB, 11 * GIB),  # 10 + 0.25 = 10.25 -> 11
    ],
)
def test_heap_bytes_for(buffers: int, heap: int) -> None:
    assert heap_bytes_for(buffers) == heap


def test_heap_bytes_for_properties() -> None:
    for buffers in [1, 1000, 123 * MIB + 7, 5 * GIB + 1, 40 * GIB]:
        heap = heap_bytes_for(buffers)
        assert heap % GIB == 0
        assert heap >= buffers * 1.25 + 256 * MIB
    with pytest.raises(ValueError, match="-1"):
        heap_bytes_for(-1)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("1073741824", GIB),
        ("8G", 8 * GIB),
        ("8g", 8 * GIB),
        ("8GB", 8 * GIB),
        ("512M", 512 * MIB),
        ("20m", 20971520),
        ("3.1M", 3250586),
        (".5m", MIB // 2),
        ("1k", 1024),
        ("1T", 1 << 40),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "G", "lots", "8 X", "-1G"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(HeapConfigError, match=HEAP_ENV_VAR):
        parse_size(text)


def test_format_size_round_trips() -> None:
    assert format_size(9 * GIB) == "9G"
    assert format_size(640 * MIB) == "640M"
    assert format_size(1000) == "1000"
    for nbytes in [0, 1, 9 * GIB, 640 * MIB, 12345678]:
        assert parse_size(format_size(nbytes)) == nbytes


def test_configure_symmetric_heap_sets_when_unset() -> None:
    environ: dict[str, str] = {}
    assert configure_symmetric_heap(9 * GIB, environ) == "9G"
    assert environ == {HEAP_ENV_VAR: "9G"}


def test_configure_symmetric_heap_keeps_user_value() -> None:
    environ = {HEAP_ENV_VAR: "16G"}
    assert configure_symmetric_heap(9 * GIB, environ) == "16G"
    assert environ[HEAP_ENV_VAR] == "16G"


def test_configure_symmetric_heap_user_value_too_small() -> None:
    environ = {HEAP_ENV_VAR: "512M"}
    with pytest.raises(HeapConfigError) as info:
        configure_symmetric_heap(9 * GIB, environ)
    message = str(info.value)
    assert "NVSHMEM_SYMMETRIC_SIZE='512M'" in message and "9G" in message
    assert environ[HEAP_ENV_VAR] == "512M"  # not overwritten


def test_configure_symmetric_heap_minimum_bytes() -> None:
    # 8G holds 6 GiB of buffers though it is below the padded recommendation (8 GiB -> 11G)...
    environ = {HEAP_ENV_VAR: "8G"}
    assert configure_symmetric_heap(heap_bytes_for(8 * GIB), environ, minimum_bytes=6 * GIB) == "8G"
    # ...but not 10 GiB of them.
    with pytest.raises(HeapConfigError, match="8G"):
        configure_symmetric_heap(heap_bytes_for(10 * GIB), environ, minimum_bytes=10 * GIB)


def test_configure_symmetric_heap_malformed_user_value() -> None:
    with pytest.raises(HeapConfigError, match="NVSHMEM_SYMMETRIC_SIZE='big'"):
        configure_symmetric_heap(GIB, {HEAP_ENV_VAR: "big"})


# --------------------------------------------------------------------------------------------------
# Runtime without processes
# --------------------------------------------------------------------------------------------------


def test_runtime_module_imports_without_gpu_libraries() -> None:
    import subprocess
    import sys

    code = (
        "import sys, cute_ep.bootstrap.runtime, cute_ep.bootstrap.dist_env\n"
        "bad = [m for m in ('torch', 'nvshmem', 'cuda') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_runtime_rejects_bad_arguments() -> None:
    env = DistEnv.from_environ({})
    with pytest.raises(ValueError, match="backend='mpi'"):
        Runtime(env, backend="mpi")
    with pytest.raises(ValueError, match="symmetric_bytes=-1"):
        Runtime(env, symmetric_bytes=-1)


def test_runtime_close_runs_finalizers_in_reverse_and_reraises_first() -> None:
    # Not started: close() still runs the finalizers (no process group to destroy).
    rt = Runtime(DistEnv.from_environ({}), backend="gloo")
    calls: list[str] = []

    def failing(name: str):
        def fn() -> None:
            calls.append(name)
            raise RuntimeError(name)

        return fn

    rt.add_finalizer(lambda: calls.append("first"))
    rt.add_finalizer(failing("second"))
    rt.add_finalizer(failing("third"))
    with pytest.raises(RuntimeError, match="third"):
        rt.close()
    assert calls == ["third", "second", "first"]
    rt.close()  # idempotent: nothing runs twice
    assert calls == ["third", "second", "first"] and rt.closed


def test_runtime_nvshmem_without_cuda_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    rt = Runtime(DistEnv.from_environ({}), symmetric_bytes=GIB)
    ran: list[str] = []
    rt.add_finalizer(lambda: ran.append("finalizer"))
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*backend='gloo'.*ReferenceEpBuffer"):
        rt.start()
    assert rt.closed and ran == ["finalizer"]
    with pytest.raises(RuntimeError, match="closed"):
        rt.start()


def test_runtime_gloo_single_process_in_process() -> None:
    import numpy as np
    import torch.distributed as dist
    from _launch import free_port

    from cute_ep.bootstrap.runtime import share_unique_id, start

    env = DistEnv.from_environ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    with start(env, backend="gloo") as rt:
        assert dist.is_initialized() and rt.cpu_group is not None
        uid = share_unique_id(rt.cpu_group, lambda: np.arange(128, dtype=np.int8), 0)
        assert uid.dtype == np.uint8 and uid.tolist() == list(range(128))
        with pytest.raises(ValueError, match="rank=1"):
            share_unique_id(rt.cpu_group, lambda: np.zeros(4), 1)
        rt.barrier()
    assert rt.closed and not dist.is_initialized()
    rt.close()  # idempotent after the with-block
