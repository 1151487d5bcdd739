"""``cute_ep.deep_ep`` in a world of one, in this process (``Buffer(None)``: no process group): DeepEP
v1.2.1's names and signatures, the configs and size hints, what is refused and with which error, events,
the byte budget of the GPU buffers, the padded low-latency layout, DeepEP's FP8 cast, and rows that travel
as raw bytes (NaN patterns included). The multi-rank checks are in tests/test_deep_ep_worlds.py."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from _launch import assert_imports_none
from test_deep_ep_worlds import cast_fp8_reference, same_bits

import cute_ep.deep_ep as deep_ep
from cute_ep.deep_ep import low_latency as ll
from cute_ep.deep_ep import normal
from cute_ep.kernels.config import EpConfig

# DeepEP v1.2.1's public signatures: (parameter, default) in order; inspect.Parameter.empty: required.
REQUIRED = inspect.Parameter.empty
# ("group" has no default in DeepEP; here None means the default group, or a world of one.)
DEEPEP_SIGNATURES = {
    "__init__": [("group", None), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                 ("low_latency_mode", False), ("num_qps_per_rank", 24),
                 ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("explicitly_destroy", False), ("comm", None)],
    "get_dispatch_layout": [("topk_idx", REQUIRED), ("num_experts", REQUIRED), ("previous_event", None),
                            ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                 ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                 ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                 ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
                 ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None),
                ("config", None), ("previous_event", None), ("async_finish", False),
                ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                 ("num_experts", REQUIRED)],
    "low_latency_dispatch": [("x", REQUIRED), ("topk_idx", REQUIRED),
                             ("num_max_dispatch_tokens_per_rank", REQUIRED), ("num_experts", REQUIRED),
                             ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                             ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                             ("return_recv_hook", False)],
    "low_latency_combine": [("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED),
                            ("handle", REQUIRED), ("use_logfmt", False), ("zero_copy", False),
                            ("async_finish", False), ("return_recv_hook", False), ("out", None),
                            ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", REQUIRED)],
    "get_local_buffer_tensor": [("dtype", REQUIRED), ("size", None), ("offset", 0),
                                ("use_rdma_buffer", False)],
    "get_comm_stream": [],
    "destroy": [],
}
DEEPEP_STATIC = {
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks",
                                       "num_experts"],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
    "set_num_sms": ["new_num_sms"],
    "capture": [],
    "is_sm90_compiled": [],
}


def _params(fn) -> list[tuple[str, object]]:
    ps = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return [(p.name, p.default) for p in ps if p.kind == p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("name", sorted(DEEPEP_SIGNATURES))
def test_methods_take_deepeps_arguments(name: str) -> None:
    assert _params(getattr(deep_ep.Buffer, name)) == DEEPEP_SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(DEEPEP_STATIC))
def test_static_helpers(name: str) -> None:
    assert isinstance(inspect.getattr_static(deep_ep.Buffer, name), staticmethod)
    assert [n for n, _ in _params(getattr(deep_ep.Buffer, name))] == DEEPEP_STATIC[name]


def test_importing_it_imports_no_gpu_module() -> None:
    """The CPU path imports neither the GPU buffer, CuTe DSL nor NVSHMEM (the GPU backend loads them on
    first use)."""
    assert_imports_none("import cute_ep.deep_ep", ["cute_ep.buffer", "cutlass", "nvshmem"])


def test_star_import_gives_deepeps_top_level_names() -> None:
    scope: dict = {}
    exec("from cute_ep.deep_ep import *", scope)
    assert {"Buffer", "Config", "EventOverlap"} <= set(scope)
    assert deep_ep.Buffer.num_sms == 20
    assert _params(deep_ep.Config) == [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                                       ("num_max_nvl_chunked_recv_tokens", 256),
                                       ("num_max_rdma_chunked_send_tokens", 6),
                                       ("num_max_rdma_chunked_recv_tokens", 256)]
    assert _params(deep_ep.EventOverlap) == [("event", None), ("extra_tensors", None)]


# --------------------------------------------------------------------------------------------------
# configs and hints
# --------------------------------------------------------------------------------------------------


def test_config_checks_and_rounding() -> None:
    c = deep_ep.Config(24, 8, 256, 6, 128)
    assert (c.num_sms, c.num_max_rdma_chunked_recv_tokens) == (24, 132)  # rounded up to a multiple of 6
    bad_configs = [dict(num_sms=-2), dict(num_max_nvl_chunked_send_tokens=256),
                   dict(num_max_rdma_chunked_send_tokens=0),
                   dict(num_max_rdma_chunked_send_tokens=100, num_max_rdma_chunked_recv_tokens=100)]
    for bad in bad_configs:
        with pytest.raises(ValueError, match="Config"):
            deep_ep.Config(**bad)


def test_recommended_configs_follow_deepeps_tables() -> None:
    deep_ep.Buffer.set_num_sms(24)
    try:
        d8, c8 = deep_ep.Buffer.get_dispatch_config(8), deep_ep.Buffer.get_combine_config(8)
        d2 = deep_ep.Buffer.get_dispatch_config(2)
        assert (d8.num_sms, d8.num_max_nvl_chunked_send_tokens) == (24, 6)
        assert d8.num_max_nvl_chunked_recv_tokens == 256
        assert (c8.num_max_nvl_chunked_send_tokens, d2.num_max_nvl_chunked_send_tokens) == (4, 24)
        assert deep_ep.Buffer.get_dispatch_config(3).num_sms == 24  # outside DeepEP's table: still a config
        with pytest.raises(ValueError, match="even"):
            deep_ep.Buffer.set_num_sms(23)
    finally:
        deep_ep.Buffer.set_num_sms(20)


def test_size_hints_are_deepeps() -> None:
    # Worked by hand from DeepEP's layout: M=2, H=128, E=2: messages of 272 (dispatch) and 260 (combine)
    # bytes; send max(544, 1040), receive max(1088, 1040), signals 128: 2 * 2256 = 4512, rounded past 128.
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(2, 128, 2, 2) == 4608
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    assert hint % 128 == 0 and hint > 2 * 288 * 128 * 7168 * 2
    cfg = deep_ep.Config(20, 6, 256, 6, 128)
    # 10 channels x 8 peers: 80 * 5 ints of metadata, 80 * 256 rows of 14336 + 8 + 128 * 12 + 128 * 4 bytes
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) == -(-(80 * 5 * 4 + 80 * 256 * 16392) // 128) * 128
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16) > 0


def test_symmetric_bytes_hint_grows_with_tokens() -> None:
    small = deep_ep.Buffer.get_symmetric_bytes_hint(128, 7168, 8, num_topk=8)
    large = deep_ep.Buffer.get_symmetric_bytes_hint(4096, 7168, 8, num_topk=8)
    assert 0 < small < large
    decode = dict(num_topk=8, num_experts=256, low_latency=True)
    ll_bf16 = deep_ep.Buffer.get_symmetric_bytes_hint(128, 7168, 8, fp8=False, **decode)
    ll_fp8 = deep_ep.Buffer.get_symmetric_bytes_hint(128, 7168, 8, fp8=True, **decode)
    assert 0 < ll_bf16 == ll_fp8  # one buffer: the FP8 dispatch quantizes into its packed rows
    # DeepEP's own low-latency hint holds these buffers at DeepSeek-V3's decode shape
    assert ll_fp8 <= deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)


# --------------------------------------------------------------------------------------------------
# what is refused
# --------------------------------------------------------------------------------------------------


@pytest.fixture()
def buf():
    b = deep_ep.Buffer(None, explicitly_destroy=True)
    yield b
    b.destroy()


def _layout(buf, t: int = 6, e: int = 4, k: int = 2, h: int = 128):
    g = torch.Generator().manual_seed(3)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    w = torch.rand(t, k, generator=g)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    return SimpleNamespace(x=x, idx=idx, w=w, per_rank=per_rank, per_expert=per_expert, in_rank=in_rank, e=e)


def _layout_args(s) -> dict:
    return dict(num_tokens_per_rank=s.per_rank, is_token_in_rank=s.in_rank,
                num_tokens_per_expert=s.per_expert)


def test_refusals_name_the_argument(buf) -> None:
    with pytest.raises(NotImplementedError, match="num_rdma_bytes > 0 with low_latency_mode=False"):
        deep_ep.Buffer(None, 0, 1 << 20)
    with pytest.raises(NotImplementedError, match="comm"):
        deep_ep.Buffer(None, comm=object())
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor"):
        buf.get_local_buffer_tensor(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="internode_dispatch"):
        buf.internode_dispatch(None)
    with pytest.raises(NotImplementedError, match="internode_combine"):
        buf.internode_combine(None, None)
    s = _layout(buf)
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(s.x, s.idx, 8, s.e, dispatch_wait_recv_cost_stats=torch.zeros(1))
    recv, _, handle, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
    with pytest.raises(NotImplementedError, match="use_logfmt"):
        buf.low_latency_combine(recv, s.idx, s.w, handle, use_logfmt=True)
    with pytest.raises(NotImplementedError, match="combine_wait_recv_cost_stats"):
        buf.low_latency_combine(recv, s.idx, s.w, handle, combine_wait_recv_cost_stats=torch.zeros(1))


def test_bad_calls_raise_value_errors(buf) -> None:
    s = _layout(buf)
    args = _layout_args(s)
    with pytest.raises(ValueError, match="use_ue8m0=True needs round_scale=True"):
        buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_ue8m0=True)
    with pytest.raises(ValueError, match="async_finish and return_recv_hook"):
        buf.low_latency_dispatch(s.x, s.idx, 8, s.e, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(s.x, s.idx, 4, s.e)
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        buf.dispatch(s.x, **args, allocate_on_comm_stream=True)
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        buf.dispatch(s.x, num_tokens_per_rank=s.per_rank, is_token_in_rank=s.in_rank)
    with pytest.raises(ValueError, match="topk_idx and topk_weights"):
        buf.dispatch(s.x, **args, topk_idx=s.idx)
    with pytest.raises(ValueError, match="config.num_sms must be even"):
        buf.dispatch(s.x, **args, config=deep_ep.Config(7))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        buf.dispatch(torch.zeros(6, 3), **args)
    _, _, _, _, handle, _ = buf.dispatch(s.x, **args)
    with pytest.raises(ValueError, match="cached handle takes no topk_idx"):
        buf.dispatch(s.x, handle=handle, topk_idx=s.idx, topk_weights=s.w)
    with pytest.raises(ValueError, match="handle must be the NormalHandle"):
        buf.combine(s.x, tuple(handle))  # a plain tuple has lost cute_ep's routing
    with pytest.raises(ValueError, match=r"x must be \[6, H\]"):
        buf.combine(s.x[:3], handle)
    with pytest.raises(ValueError, match="bias must be"):
        buf.combine(s.x, handle, bias=torch.zeros(6, 5, dtype=torch.bfloat16))
    # num_worst_tokens sizes the buffers: fewer than the tokens per rank cannot hold this rank's tokens
    many = torch.zeros(100, 128, dtype=torch.bfloat16)
    in_rank = torch.ones(100, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="num_worst_tokens=10"):
        count = torch.tensor([100], dtype=torch.int32)
        buf.dispatch(many, num_tokens_per_rank=count, is_token_in_rank=in_rank, num_tokens_per_expert=count,
                     num_worst_tokens=10)


def test_wrong_arguments_name_the_argument_and_the_value(buf) -> None:
    """What a ported program can pass wrong, in a world of one (the 2-rank cases, one rank wrong or all:
    tests/test_deep_ep_errors.py): the message names the argument, the value and what is accepted."""
    s = _layout(buf)
    args = _layout_args(s)
    with pytest.raises(ValueError, match="x must be a torch.Tensor") as exc:
        buf.dispatch(s.x.tolist(), **args)
    assert isinstance(exc.value, TypeError)  # InputTypeError: a TypeError and a ValueError
    with pytest.raises(ValueError, match=r"num_tokens_per_rank must be \[1\] int32 .*torch.float32"):
        buf.dispatch(s.x, **{**args, "num_tokens_per_rank": s.per_rank.float()})
    with pytest.raises(ValueError, match=r"topk_idx values must be expert ids .* got 4 at \[2, 1\]"):
        idx = s.idx.clone()
        idx[2, 1] = 4
        buf.dispatch(s.x, **args, topk_idx=idx, topk_weights=s.w)
    with pytest.raises(ValueError, match="num_experts must be a positive multiple of 1 ranks, got 4.0"):
        buf.low_latency_dispatch(s.x, s.idx, 8, 4.0)
    recv_x, _, _, _, handle, _ = buf.dispatch(s.x, **args)
    with pytest.raises(ValueError, match=r"^x must be bfloat16, float16 or float32 .* got torch.float64"):
        buf.combine(recv_x.double(), handle)  # the shape is right: the message is about the dtype
    recv, _, ll_handle, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
    other = s.idx.clone()
    other[0, 0] = next(e for e in range(s.e) if e not in s.idx[0].tolist())  # an expert it was not sent to
    with pytest.raises(ValueError, match=r"topk_idx must be the ids low_latency_dispatch was given, or -1"):
        buf.low_latency_combine(recv, other, s.w, ll_handle)
    dropped = s.idx.clone()
    dropped[0, 0] = -1  # -1 skips a pair: accepted
    buf.low_latency_combine(recv, dropped, s.w, ll_handle)


def test_handles_are_deepeps_tuples(buf) -> None:
    s = _layout(buf)
    out = buf.dispatch(s.x, **_layout_args(s), topk_idx=s.idx, topk_weights=s.w)
    handle = out[4]
    assert isinstance(handle, tuple) and len(handle) == 6
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle  # unpacks
    assert rank_prefix.tolist() == [[6]] and in_rank is s.in_rank
    channels = deep_ep.Buffer.get_dispatch_config(1).num_sms // 2
    assert channel_prefix.shape == recv_channel_prefix.shape == (1, channels)
    assert recv_src_idx.tolist() == list(range(6)) and send_head.dtype == torch.int32
    recv, count, ll_handle, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e)
    assert isinstance(ll_handle, tuple) and len(ll_handle) == 5 and ll_handle[2:] == (8, 128, s.e)
    assert isinstance(recv, tuple) and count.tolist() == s.per_expert.tolist()


def test_low_latency_results_live_in_two_alternating_sets(buf) -> None:
    """As DeepEP's two low-latency buffers: a dispatch's results stay valid through the next low-latency
    call, and the dispatch after that (the same parity) rewrites the same tensors. FP8 values are a view
    of the received rows: values, scale, and the kept rows' zero padding behind them."""
    s = _layout(buf)
    first, count_a, handle_a, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
    kept = (first.clone(), count_a.clone(), handle_a[0].clone(), handle_a[1].clone())
    y = torch.zeros_like(first)
    buf.low_latency_combine(y, s.idx, s.w, handle_a)  # the second call: the first's results intact
    for now, before in zip((first, count_a, handle_a[0], handle_a[1]), kept, strict=True):
        assert same_bits(now, before)
    other = s.x.flip(0).contiguous()
    again, count_b, handle_b, _, _ = buf.low_latency_dispatch(other, s.idx, 8, s.e, use_fp8=False)
    assert again.data_ptr() == first.data_ptr() and count_b.data_ptr() == count_a.data_ptr()
    assert handle_b[0].data_ptr() == handle_a[0].data_ptr()
    n = int(count_b[0])
    assert n and not same_bits(first[0, :n], kept[0][0, :n])  # rewritten with the other rows
    (q, scales), count, _, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e)  # the other parity
    row_bytes = q.stride(-2)  # the packed rows: 128 e4m3 bytes, one fp32 scale, zeros to 16 bytes
    assert q.stride(-1) == 1 and row_bytes == 144
    for e in range(q.shape[0]):
        n = int(count[e])
        raw = q[e].view(torch.uint8).as_strided((n, row_bytes), (row_bytes, 1))
        assert same_bits(raw[:, 128:132].view(torch.float32).view(n), scales[e, :n, 0])
        assert not bool(raw[:, 132:].any())


# --------------------------------------------------------------------------------------------------
# events and streams
# --------------------------------------------------------------------------------------------------


def test_events_on_a_cpu(buf) -> None:
    captured = deep_ep.Buffer.capture()
    assert isinstance(captured, deep_ep.EventOverlap) and captured.event is not None
    captured.current_stream_wait()
    with captured:  # the with form waits on exit
        pass
    with pytest.raises(ValueError, match="no event"):
        deep_ep.EventOverlap().current_stream_wait()
    with deep_ep.EventOverlap():  # nothing to wait for: a no-op
        pass
    s = _layout(buf)
    *_, event = buf.get_dispatch_layout(s.idx, s.e, previous_event=captured, async_finish=True)
    assert event.event is not None
    event.current_stream_wait()
    assert buf.get_comm_stream() is None  # no streams on a CPU
    _, _, _, event, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, async_finish=True)
    assert event.extra_tensors is not None and event.extra_tensors[0] is s.x


def test_zero_copy_buffers_alternate_like_deepeps(buf) -> None:
    s = _layout(buf)
    _, _, handle, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
    first = buf.get_next_low_latency_combine_buffer(handle)
    assert first is buf.get_next_low_latency_combine_buffer(handle)  # no call in between: the same one
    assert first.shape == (s.e, 8, 128) and first.dtype == torch.bfloat16
    buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
    assert buf.get_next_low_latency_combine_buffer(handle) is not first  # each call flips the pair


def test_destroy_is_idempotent_and_final() -> None:
    b = deep_ep.Buffer(None)
    b.destroy()
    b.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        b.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), 1)


# --------------------------------------------------------------------------------------------------
# backends and the byte budget
# --------------------------------------------------------------------------------------------------


def test_backend_choice() -> None:
    b = deep_ep.Buffer(None)
    assert b.backend == "reference" and b.device.type == "cpu"
    b.destroy()
    with pytest.raises(ValueError, match='backend="cute"'):
        deep_ep.Buffer(None, backend="cute")
    with pytest.raises(ValueError, match="backend must be one of"):
        deep_ep.Buffer(None, backend="a2a")


class _FakeEpBuffer:
    """Stands in for the GPU buffer in the budget test: records builds and closes."""

    log: list = []

    def __init__(self, runtime, cfg, registry=None) -> None:
        self.cfg = cfg
        _FakeEpBuffer.log.append(("build", cfg.max_tokens))

    def close(self) -> None:
        _FakeEpBuffer.log.append(("close", self.cfg.max_tokens))


def test_budget_evicts_the_least_recently_used(monkeypatch) -> None:
    import cute_ep.buffer

    monkeypatch.setattr(cute_ep.buffer, "EpBuffer", _FakeEpBuffer)
    _FakeEpBuffer.log = []
    b = deep_ep.Buffer(None)
    # the GPU path's bookkeeping, on a CPU
    b.backend, b._session = "cute", SimpleNamespace(registry=None, release=lambda: None)
    def need(width: int, tokens: int) -> int:
        return EpConfig(world_size=1, local_world_size=1, num_experts=1, topk=1, hidden=width,
                        dtype=torch.bfloat16, max_tokens=tokens).symmetric_bytes()

    b.symmetric_bytes = need(128, 64) + need(128, 128) + 16  # room for these two, not a third
    for m in (64, 128, 64):
        b._buffer(128, torch.bfloat16, 1, 1, m)
    assert _FakeEpBuffer.log == [("build", 64), ("build", 128)]  # the third call found its buffer
    b._buffer(136, torch.bfloat16, 1, 1, 64)  # another shape: the least recently used (128) goes
    assert _FakeEpBuffer.log[2:] == [("close", 128), ("build", 64)]
    with pytest.raises(ValueError, match=r"need \d+ bytes of symmetric buffers, more than this Buffer's"):
        b._buffer(128, torch.bfloat16, 1, 1, 1 << 16)
    b.destroy()


def test_budget_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("CUTE_EP_DEEP_EP_SYMMETRIC_BYTES", "3G")
    b = deep_ep.Buffer(None, num_nvl_bytes=1 << 20)
    assert b.symmetric_bytes == 3 << 30
    b.destroy()
    monkeypatch.delenv("CUTE_EP_DEEP_EP_SYMMETRIC_BYTES")
    assert deep_ep.Buffer(None, 1 << 20, 0).symmetric_bytes == 1 << 20
    assert deep_ep.Buffer(None, 1 << 20, 1 << 10, True, symmetric_bytes=5).symmetric_bytes == 5


# --------------------------------------------------------------------------------------------------
# the torch parts: layout, padded layout, FP8 cast, raw bytes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [4, -5, 10**6])
def test_dispatch_layout_refuses_ids_out_of_range(buf, bad: int) -> None:
    """DeepEP defines -1 (no expert) and the experts [0, E); any other id is an error here (it was counted
    nowhere, so a pair vanished from num_tokens_per_expert without a word), and -1 is skipped."""
    idx = torch.tensor([[0, 3], [-1, 2], [2, -1]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    assert per_expert.tolist() == [1, 0, 2, 1] and per_rank.tolist() == [3]
    assert in_rank.tolist() == [[True], [True], [True]]
    idx[1, 0] = bad
    expected = rf"topk_idx values must be expert ids in \[0, 4\) or -1 \(no expert\), got {bad} at \[1, 0\]"
    with pytest.raises(ValueError, match=expected):
        buf.get_dispatch_layout(idx, 4)


def test_padded_layout_of_expert_major_rows() -> None:
    """Two local experts, 2 ranks, M = 3, K = 2: rows of expert 0 from sources 0, 0, 1; expert 1 from 1;
    then stale rows past the count."""
    m, k = 3, 2
    tags = [(0 * m + 0) * k + 0, (0 * m + 2) * k + 1, (1 * m + 1) * k + 0, (1 * m + 2) * k + 1, -1, -1]
    rows = torch.arange(6 * 8, dtype=torch.float32).view(6, 8).to(torch.bfloat16)
    p = ll.padded_layout(rows, torch.tensor(tags, dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
                         num_ranks=2, max_tokens=m, topk=k)
    assert p.rows.shape == (2, 6, 8) and p.count.tolist() == [3, 1]
    assert same_bits(p.rows[0, :3], rows[:3]) and same_bits(p.rows[1, :1], rows[3:4])
    assert p.src_info[0, :3].tolist() == [0, 2, 1] and p.src_info[1, :1].tolist() == [2]
    begin, count = (p.layout_range >> 32).tolist(), (p.layout_range & 0xFFFFFFFF).tolist()
    assert count == [[2, 1], [0, 1]] and begin == [[0, 2], [0, 0]]
    assert p.slot.tolist() == [0, 1, 2, 6, 11, 11]  # stale rows: the last slot (combine ignores them)
    back = torch.empty(6, 8, dtype=torch.bfloat16)
    ll.expert_major_rows(p.rows, p.slot, back)
    assert same_bits(back[:4], rows[:4])


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_is_deepeps(round_scale: bool) -> None:
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(6, 512, generator=g) * torch.logspace(-6, 3, 6).view(-1, 1)).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero block: amax is the 1e-4 margin
    x[1, 128:256] = 448.0  # exactly the largest e4m3 value after scaling
    q, s = ll.cast_fp8_blocks(x, round_scale)
    want_q, want_s = cast_fp8_reference(x, round_scale)
    assert same_bits(q, want_q) and same_bits(s, want_s)
    if round_scale:
        mant, _ = torch.frexp(s)
        assert bool((mant == 0.5).all())  # powers of two
        packed = ll.ue8m0_pack(s)
        assert packed.shape == (6, 1) and packed.dtype == torch.int32
        assert same_bits(packed.view(torch.uint8), ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8))


def test_rows_travel_as_raw_bytes(buf) -> None:
    """FP8 values with every byte pattern (e4m3 NaNs included), int32 scales and bf16 NaN payloads arrive bit
    for bit, with top-k riding along."""
    t = 256
    q = torch.arange(t * 128, dtype=torch.int64).remainder(256).to(torch.uint8).view(t, 128)
    scales = torch.arange(t, dtype=torch.int32).view(t, 1) * -7919
    idx = torch.zeros(t, 1, dtype=torch.int64)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 1)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=torch.full((t, 1), float("nan")))
    (rq, rs), _, rw, *_ = buf.dispatch((q.view(torch.float8_e4m3fn), scales.T.contiguous().T), **args)
    assert torch.equal(rq.view(torch.uint8), q) and torch.equal(rs, scales) and bool(rw.isnan().all())
    bits = torch.arange(t * 64, dtype=torch.int32).mul(2654435761 % 65536).remainder(65536) - 32768
    x = bits.to(torch.int16).view(t, 64).view(torch.bfloat16)  # includes NaN and inf patterns
    rx = buf.dispatch(x, **args)[0]
    assert torch.equal(rx.view(torch.int16), x.view(torch.int16))


def test_row_format_widths() -> None:
    plain = normal.RowFormat(torch.bfloat16, 7168)
    assert plain.passthrough and plain.elems == 7168
    fp8_topk = normal.RowFormat(torch.float8_e4m3fn, 7168, torch.float32, 56, 8)
    assert fp8_topk.row_bytes == 7168 + 224 + 64 and fp8_topk.elems == fp8_topk.row_bytes // 2
    fp32 = normal.RowFormat(torch.float32, 64)  # fp32 rows travel as their bytes, viewed as bf16
    assert fp32.passthrough and fp32.elems == 128


@pytest.mark.parametrize("hidden, scale_order",
                         [(7168, "column-major"), (7168, "row-major"), (384, "row-major")])
def test_fp8_rows_pack_and_unpack_to_their_bytes(hidden: int, scale_order: str, monkeypatch) -> None:
    """A row of FP8 values and their scales: the values' bytes, then the scales' (any strides), then zeros
    to 16 bytes (hidden 384: 3 scales, 4 bytes of padding), one torch.cat where no padding is due; unpack
    splits them back into new contiguous tensors, into the caller's when given."""
    g = torch.Generator().manual_seed(3)
    t, s = 6, hidden // 128
    x = torch.randn(t, hidden, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(t, s, generator=g)
    if scale_order == "column-major":
        scales = scales.T.contiguous().T
    fmt = normal.RowFormat(torch.float8_e4m3fn, hidden, torch.float32, s)
    cats = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or cat(*a, **k))
    rows = fmt.pack(x, scales, None, None)
    assert len(cats) == (fmt.row_bytes == hidden + 4 * s)
    raw = rows.view(torch.uint8)
    assert rows.dtype == torch.bfloat16 and raw.shape == (t, fmt.row_bytes)
    assert torch.equal(raw[:, :hidden], x.view(torch.uint8))
    assert torch.equal(raw[:, hidden : hidden + 4 * s].view(torch.float32), scales)
    assert not raw[:, hidden + 4 * s :].any()
    got_x, got_scales, ids, weights = fmt.unpack(rows[:4], t)
    assert ids is None and weights is None and got_scales.is_contiguous() and got_x.shape == (t, hidden)
    assert torch.equal(got_x[:4].view(torch.uint8), x[:4].view(torch.uint8))
    assert torch.equal(got_scales[:4], scales[:4])
    into = fmt.outputs(t, torch.device("cpu"))
    again = fmt.unpack(rows, t, into)
    assert again[0] is into[0] and again[1] is into[1] and torch.equal(into[1], scales)


def test_row_bytes_are_copied_as_wide_integers_where_they_line_up(monkeypatch) -> None:
    """copy_bytes moves 8-byte words where both sides' widths, row strides and offsets allow, narrower ones
    otherwise, single bytes last; the bytes arrive the same either way."""
    raw = torch.randint(0, 256, (5, 7168 + 224 + 16), dtype=torch.uint8)
    used = []
    view = torch.Tensor.view
    monkeypatch.setattr(torch.Tensor, "view", lambda t, *a: used.append(a[0]) or view(t, *a))
    for (a, b), widest in {(0, 7168): torch.int64, (7168, 7392): torch.int64, (7392, 7404): torch.int32,
                           (2, 8): torch.int16, (3, 9): None}.items():
        used.clear()
        dst = torch.full((5, b - a), 7, dtype=torch.uint8)
        normal.copy_bytes(dst, raw[:, a:b])
        assert torch.equal(dst, raw[:, a:b]) and (used[:1] == [widest] if widest else used == [])


def test_callers_torch_defaults_do_not_leak_in(buf) -> None:
    """DeepEP's tests set torch's default dtype (bf16) and device (CUDA); the calls keep torch's own inside
    (here the default device is "meta": a backend tensor made without a device would be an empty shell) and
    restore the caller's after."""
    s = _layout(buf)
    want = buf.dispatch(s.x, **_layout_args(s), topk_idx=s.idx, topk_weights=s.w)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("meta")
    try:
        got = buf.dispatch(s.x, **_layout_args(s), topk_idx=s.idx, topk_weights=s.w)
        recv, _, handle, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
        buf.low_latency_combine(recv, s.idx, s.w, handle)
        assert torch.get_default_dtype() == torch.bfloat16 and torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    for a, b in zip(want[:3], got[:3], strict=True):
        assert same_bits(a, b)


def test_handle_matrices_are_made_when_first_read_and_equal_deeps_formulas(buf) -> None:
    """The four handle matrices cute_ep never reads are made on first read (a combine does not make them),
    equal the formulas of ``normal`` on what the dispatch saw, are kept once made, and a read after
    is_token_in_rank was changed in place raises instead of answering from the changed tensor."""
    s = _layout(buf, t=9)
    config = deep_ep.Config(8, 6, 256)  # 4 channels
    recv_x, _, _, _, handle, _ = buf.dispatch(s.x, **_layout_args(s), topk_idx=s.idx, topk_weights=s.w,
                                              config=config)
    buf.combine(recv_x, handle)
    assert handle.made() == (handle[3], s.in_rank)  # recv_src_idx and is_token_in_rank only, so far
    assert torch.equal(handle[1], normal.channel_prefix_matrix(s.in_rank, 4))
    assert torch.equal(handle[5], normal.send_head(s.in_rank, 4))
    assert handle[0].tolist() == [[s.in_rank.sum().item()]]
    assert torch.equal(handle[2], normal.recv_channel_prefix_matrix(
        torch.zeros(9, dtype=torch.int64), handle[3], None, torch.tensor([9]), 4))
    assert handle[5] is handle[5] and len(handle.made()) == 6
    first, *_, last = handle  # unpacking reads through the same entries
    assert first is handle[0] and last is handle[5] and handle[-1] is handle[5]
    assert handle[4:] == (s.in_rank, handle[5])
    _, _, _, _, fresh, _ = buf.dispatch(s.x, **_layout_args(s), topk_idx=s.idx, topk_weights=s.w)
    s.in_rank[0] = ~s.in_rank[0]
    with pytest.raises(RuntimeError, match="send_head is made from is_token_in_rank when first read, and"):
        fresh[5]


def test_calls_skip_the_callers_torch_function_modes(buf) -> None:
    """A default device is a torch-function mode through which every tensor attribute read passes in
    Python (DeepEP's tests set one); the calls run with the modes skipped, their results unchanged."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen += 1
            return func(*args, **(kwargs or {}))

    s = _layout(buf)
    expected = [t.clone() for t in (s.per_rank, s.per_expert, s.in_rank)]
    with Counting() as mode:
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(s.idx, s.e)
        recv, count, handle, _, _ = buf.low_latency_dispatch(s.x, s.idx, 8, s.e, use_fp8=False)
        assert mode.seen == 0
        y = torch.zeros_like(recv)  # the caller's own work still passes through it
        assert mode.seen == 1
        combined, _, _ = buf.low_latency_combine(y, s.idx, s.w, handle)
    assert mode.seen == 1
    for got, want in zip((per_rank, per_expert, in_rank), expected, strict=True):
        assert same_bits(got, want)
    assert combined.shape == s.x.shape and not bool(combined.any())
