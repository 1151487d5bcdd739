"""Bad input gets a clear error that names the constraint and the value (shared by every backend)."""

from __future__ import annotations

import pytest
import torch
from _launch import forkrun

from cute_ep.input_checks import check_dispatch_inputs
from cute_ep.kernels.buffers import SIZE_SCALARS
from cute_ep.kernels.config import ConfigError, EpConfig

BASE = dict(world_size=4, local_world_size=2, num_experts=32, topk=2, hidden=256, dtype=torch.bfloat16,
            max_tokens=64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(num_experts=30), "num_experts must be divisible by world_size=4, got 30"),
        (dict(topk=33), r"topk must be in \[1, min\(num_experts=32, 64\)\], got 33"),
        (dict(topk=0), r"topk must be in \[1, min\(num_experts=32, 64\)\], got 0"),
        (dict(hidden=100), "multiple of 16 bytes: hidden=100 x 2 B = 200 B"),
        (dict(hidden=6, dtype=torch.float32), "multiple of 16 bytes: hidden=6 x 4 B = 24 B"),
        (dict(local_world_size=3), "local_world_size must divide world_size=4, got 3"),
        (dict(dtype=torch.float64), "dtype must be one of"),
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(num_experts=4 * 4096), "num_experts must be <= 6144"),
        (dict(max_tokens=2**28, topk=8), r"world_size \* max_tokens \* topk must be < 2\*\*31"),
        (dict(capacity=100),
         r"capacity must be >= min\(world_size \* max_tokens \* min\(topk, experts per rank\), experts per "
         r"rank \* expert_capacity\) = 512, got 100"),
        (dict(capacity_factor=1.0, capacity=127), r"= 128, got 127"),  # 8 experts/rank x expert_capacity 16
        (dict(capacity_factor=-1.0), r"capacity_factor must be a finite number >= 0 \(0: no limit\), got -1"),
        (dict(capacity_factor=float("nan")), r"capacity_factor must be a finite number >= 0"),
        (dict(on_overflow="ignore"), r"on_overflow must be one of \('raise', 'drop'\), got 'ignore'"),
        (dict(world_size=512, local_world_size=8, num_experts=512), r"world_size must be in \[1, 256\]"),
        (dict(timeout_s=0), r"timeout_s must be in \[0.001, 2147483\] seconds, got 0"),
        (dict(timeout_s=1e7), r"timeout_s must be in \[0.001, 2147483\] seconds, got 10000000.0"),
        (dict(combine_algorithm="push"),
         r"combine_algorithm must be one of \['pull', 'reduced'\], got 'push'"),
        (dict(layout_in_dispatch=-1), r"layout_in_dispatch must be in \[0, 2\*\*31\) tokens .*, got -1"),
        (dict(layout_in_dispatch=2**31), r"layout_in_dispatch must be in \[0, 2\*\*31\) tokens"),
        (dict(layout_in_dispatch=1.5), r"layout_in_dispatch must be .*, got 1.5"),
        (dict(layout_in_dispatch=True), r"layout_in_dispatch must be .*, got True"),
    ],
)
def test_config_constraints(change, message):
    with pytest.raises(ConfigError, match=message):
        EpConfig(**{**BASE, **change})


@pytest.mark.parametrize(("hidden", "dtype", "sizes"), [
    (100, torch.bfloat16, "the nearest valid sizes are 96 and 104 (multiples of 8 for torch.bfloat16)"),
    (6, torch.float32, "the nearest valid sizes are 4 and 8 (multiples of 4 for torch.float32)"),
    (3, torch.float16, "the nearest valid size is 8 (multiples of 8 for torch.float16)"),
])
def test_a_bad_hidden_names_the_nearest_valid_sizes(hidden, dtype, sizes):
    with pytest.raises(ConfigError) as info:
        EpConfig(**{**BASE, "hidden": hidden, "dtype": dtype})
    assert str(info.value).endswith(sizes)


@pytest.mark.parametrize(("world_size", "num_experts", "counts"), [
    (3, 16, "use 15 or 18"), (4, 30, "use 28 or 32"), (8, 4, "use 8"), (256, 6143, "use 5888 or 6144"),
])  # fmt: skip
def test_experts_that_do_not_split_over_the_ranks_name_the_nearest_counts_that_do(world_size, num_experts,
                                                                                   counts):
    with pytest.raises(ConfigError) as info:
        EpConfig(**{**BASE, "world_size": world_size, "local_world_size": 1, "num_experts": num_experts})
    want = f"num_experts must be divisible by world_size={world_size}, got {num_experts}; {counts}"
    assert str(info.value) == want


def test_timeout_travels_as_milliseconds():
    assert EpConfig(**BASE).timeout_ms == 60_000
    assert EpConfig(**{**BASE, "timeout_s": 2.5}).timeout_ms == 2500
    assert "timeout_ms" in SIZE_SCALARS  # every launch passes it to the kernels


def test_layout_in_dispatch_travels_with_every_launch():
    assert EpConfig(**BASE).layout_in_dispatch == 2**31 - 1  # every batch folds the layout by default
    assert EpConfig(**{**BASE, "layout_in_dispatch": 0}).layout_in_dispatch == 0
    assert "layout_in_dispatch" in SIZE_SCALARS  # the module and the dispatch kernel decide alike from it
    # a size: ranks must agree on it (the config key compared at construction includes it)
    assert EpConfig(**BASE).key() != EpConfig(**{**BASE, "layout_in_dispatch": 0}).key()


def test_config_defaults_to_worst_case_capacity():
    cfg = EpConfig(**BASE)
    assert cfg.capacity == 4 * 64 * min(2, 8)
    assert cfg.experts_per_rank == 8 and cfg.nnodes == 2 and cfg.vec == 8
    assert cfg.expert_capacity == 4 * 64  # no factor: an expert can take every token of every rank


def test_capacity_factor_sizes_experts_and_buffers():
    # share = R * M * K / E = 4 * 64 * 2 / 32 = 16 rows per expert at full batch
    cfg = EpConfig(**{**BASE, "capacity_factor": 1.0})
    assert cfg.expert_capacity == 16 and cfg.capacity == 8 * 16
    assert EpConfig(**{**BASE, "capacity_factor": 1.1}).expert_capacity == 18  # ceil(17.6)
    assert EpConfig(**{**BASE, "capacity_factor": 0.001}).expert_capacity == 1  # at least one row
    big = EpConfig(**{**BASE, "capacity_factor": 100.0})  # never more than the worst case
    assert big.expert_capacity == 4 * 64 and big.capacity == big.worst_case_capacity
    assert cfg.key() != EpConfig(**BASE).key() != EpConfig(**{**BASE, "on_overflow": "drop"}).key()
    assert "expert_capacity" in SIZE_SCALARS  # travels to the kernels


def test_reduced_combine_sizes_its_buffers():
    """The reduced combine allocates M * R partial rows (the group list of K slots per receive slot, which
    it reads, every buffer has: the fan-out reads it too); its phase 1 runs REDUCED_GRID_FACTOR times the
    CTAs and needs a staging row per warp on other nodes."""
    from cute_ep.kernels.config import REDUCED_GRID_FACTOR

    pull = EpConfig(**BASE)
    red = EpConfig(**{**BASE, "combine_algorithm": "reduced"})
    assert pull.partial_rows == 0 and red.partial_rows == 64 * 4
    extra = red.partial_rows * red.row_bytes
    assert red.symmetric_bytes() - pull.symmetric_bytes() == extra
    assert red.key() != pull.key()  # ranks that disagree fail at construction
    for topk in (1, 2, 8):  # nnodes == 2 here: staging rows exist
        cfg = EpConfig(**{**BASE, "topk": topk, "combine_algorithm": "reduced"})
        assert cfg.stage_rows >= cfg.combine_warps * REDUCED_GRID_FACTOR  # one per phase-1 warp
        assert cfg.stage_rows >= cfg.combine_warps * topk  # one per (pull warp, k)
    assert EpConfig(**{**BASE, "local_world_size": 4}).stage_rows == 1  # one node: no staging


def test_fp8_row_layout():
    cfg = EpConfig(**{**BASE, "hidden": 7168})
    assert cfg.fp8_scales == 56 and cfg.fp8_row_bytes == 7168 + 224  # already a multiple of 16
    assert EpConfig(**{**BASE, "hidden": 128}).fp8_row_bytes == 144  # 128 + 4, padded
    with pytest.raises(ConfigError, match=r"needs hidden to be a multiple of 128 .*, got hidden=200"):
        EpConfig(**{**BASE, "hidden": 200}).check_fp8()


def _inputs(t=8, h=256, k=2, dtype=torch.bfloat16):
    x = torch.randn(t, h).to(dtype)
    idx = torch.rand(t, 32).argsort(dim=1)[:, :k].contiguous()  # distinct experts per token, like top-k
    w = torch.rand(t, k)
    return x, idx, w


def test_valid_inputs_pass_and_ids_become_int32():
    cfg = EpConfig(**BASE)
    x, idx, w = _inputs()
    idx[0, 0] = -1  # dropped is allowed
    _, idx32, _ = check_dispatch_inputs(cfg, torch.device("cpu"), x, idx, w)
    assert idx32.dtype == torch.int32 and torch.equal(idx32.long(), idx)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x, i, w: (x, i.clone().fill_(32), w),
         r"topk_idx values must be in \[-1, 32\), got min 32, max 32"),
        (lambda x, i, w: (x, i.clone().fill_(-2), w), r"got min -2"),
        (lambda x, i, w: (x.float(), i, w),
         r"x must be \[T, 256\] torch.bfloat16, got \[8, 256\] torch.float32"),
        (lambda x, i, w: (x[:, :128].contiguous(), i, w), r"x must be \[T, 256\]"),
        (lambda x, i, w: (x.t().contiguous().t(), i, w), "x must be contiguous"),
        (lambda x, i, w: (x, i[:, :1].contiguous(), w),
         r"topk_idx must be \[8, 2\] int32/int64, got \[8, 1\]"),
        (lambda x, i, w: (x, i.float(), w), "topk_idx must be .* int32/int64, got .* torch.float32"),
        (lambda x, i, w: (x, i, w.double()),
         r"topk_weights must be \[8, 2\] float32, got \[8, 2\] torch.float64"),
        (lambda x, i, w: (x, i, w[:4]), r"topk_weights must be \[8, 2\] float32, got \[4, 2\]"),
        (lambda x, i, w: (x, i, w.t().contiguous().t()), "topk_weights must be contiguous"),
        (lambda x, i, w: (x.to("meta"), i, w), "x must be on cpu, got meta"),
    ],
)
def test_bad_inputs_are_named(mutate, message):
    cfg = EpConfig(**BASE)
    with pytest.raises(ValueError, match=message):
        check_dispatch_inputs(cfg, torch.device("cpu"), *mutate(*_inputs()))


@pytest.mark.parametrize(
    ("position", "message"),
    [
        (0, r"x must be a torch.Tensor \[T, 256\] torch.bfloat16 on cpu, got list; convert it with "
            r"torch.as_tensor\(x, dtype=torch.bfloat16, device='cpu'\)"),
        (1, r"topk_idx must be a torch.Tensor \[T, 2\] int32/int64 on cpu, got list; convert it with "
            r"torch.as_tensor\(topk_idx, dtype=torch.int32, device='cpu'\)"),
        (2, r"topk_weights must be a torch.Tensor \[T, 2\] float32 on cpu, got ndarray; convert it with "
            r"torch.as_tensor\(topk_weights, dtype=torch.float32, device='cpu'\)"),
    ],
)
def test_an_argument_that_is_not_a_tensor_is_a_type_error(position, message):
    """Not ``AttributeError: 'list' object has no attribute 'device'``: the argument, the type it got, what
    is expected and how to convert it. Also a ValueError (what every other bad input raises, and what the
    backends catch to tell their peers)."""
    from cute_ep.input_checks import InputTypeError

    args = list(_inputs())
    args[position] = args[position].numpy() if position == 2 else args[position].tolist()
    with pytest.raises(TypeError, match=message) as info:
        check_dispatch_inputs(EpConfig(**BASE), torch.device("cpu"), *args)
    assert isinstance(info.value, (InputTypeError, ValueError))


@pytest.mark.parametrize("backend", ["reference", "a2a"])
def test_host_backends_name_a_list_given_as_x(backend):
    from _worlds import HOST_BACKENDS, host_config, world_of_one

    with HOST_BACKENDS[backend](world_of_one(), host_config()) as buf:
        x, idx, w = _inputs(t=4, h=32)  # (the ids are not looked at: x is refused first)
        with pytest.raises(ValueError, match=r"x must be a torch.Tensor \[T, 32\] torch.bfloat16 on cpu, "
                                             r"got list"):
            buf.dispatch(x.tolist(), idx, w)


def test_repeated_experts_in_a_token_are_refused():
    cfg = EpConfig(**BASE)
    x, idx, w = _inputs()
    idx[:, 0], idx[:, 1] = 3, 4
    idx[5] = torch.tensor([-1, -1])  # dropped slots may repeat
    check_dispatch_inputs(cfg, torch.device("cpu"), x, idx, w)
    idx[6] = torch.tensor([7, 7])
    with pytest.raises(ValueError, match=r"distinct experts per token .* token 6 has \[7, 7\]"):
        check_dispatch_inputs(cfg, torch.device("cpu"), x, idx, w)


def test_more_tokens_than_the_buffer_was_built_for():
    cfg = EpConfig(**BASE)
    with pytest.raises(ValueError, match="x has 65 tokens, more than max_tokens=64"):
        check_dispatch_inputs(cfg, torch.device("cpu"), *_inputs(t=65))


def test_combine_input_is_checked():
    from cute_ep.input_checks import check_combine_input

    cfg = EpConfig(**BASE)
    cpu = torch.device("cpu")
    check_combine_input(cfg, cpu, torch.zeros(10, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"y must be \[num_recv, 256\] torch.bfloat16 on cpu, got \[10, 128"):
        check_combine_input(cfg, cpu, torch.zeros(10, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="y has 513 rows, more than the capacity 512"):
        check_combine_input(cfg, cpu, torch.zeros(513, 256, dtype=torch.bfloat16))


def test_sm_budget_fits_the_gpu(monkeypatch):
    """The layout's num_sms CTAs wait for each other, one per SM: a budget above the GPU's SM count is
    refused at construction (it would wait until the timeout), naming both numbers; the default (0) becomes
    the GPU's SM count."""
    from types import SimpleNamespace

    from cute_ep.input_checks import check_buffer_config, check_sm_budget

    check_sm_budget(132, [(132, 132, 1), (132, 132, 1)])
    check_sm_budget(500, [])  # CPU runtimes: no GPU to fit
    with pytest.raises(ConfigError, match=r"num_sms must be at most the GPU's SM count, 114.*got 132"):
        check_sm_budget(132, [(132, 132, 1), (114, 114, 1)])
    props = SimpleNamespace(multi_processor_count=78)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    runtime = SimpleNamespace(env=SimpleNamespace(world_size=4), device=torch.device("cuda", 0))
    cfg = EpConfig(**{**BASE, "num_sms": 132})
    with pytest.raises(ConfigError, match="SM count, 78.*got 132"):
        check_buffer_config(runtime, cfg, kernels=True)
    assert check_buffer_config(runtime, EpConfig(**{**BASE, "num_sms": 78}), kernels=True).num_sms == 78
    assert check_buffer_config(runtime, EpConfig(**BASE), kernels=True).num_sms == 78  # the default: all
    check_buffer_config(runtime, cfg)  # the CPU / all-to-all backends launch no kernels of ours


WORKER = """
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.bootstrap.runtime import Runtime
from cute_ep.kernels.config import ConfigError, EpConfig
from cute_ep.reference_backend import ReferenceEpBuffer
import torch

env = DistEnv.from_environ()
with Runtime(env, backend="gloo") as rt:
    cfg = EpConfig(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=64 * (1 + env.rank),
                   dtype=torch.float32, max_tokens=4)
    try:
        ReferenceEpBuffer(rt, cfg)
        print(f"rank {env.rank}: built")
    except ConfigError as exc:
        print(f"rank {env.rank}: ConfigError: {exc}")
"""


def test_different_configs_on_different_ranks_fail_at_construction(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = forkrun(script, 2, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: ConfigError: ranks built different EpConfigs" in out, out[-3000:]
    assert "built\n" not in out
