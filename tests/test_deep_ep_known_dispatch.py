"""A cached normal dispatch of a kind already checked goes straight to the kernels, without a GPU (the
kernels' backend stood in for by the reference buffers a world of one builds): the kind is the handle, x's
and its scales' dtype, shape, strides and device, and the config's SMs; a call given anything else (stream
options, the layout's tensors, another handle, a subclass, a config never checked) takes the checked path
and its errors; the results are the checked path's."""

from __future__ import annotations

import gc

import pytest
import torch

from cute_ep.api import DispatchHandle
from cute_ep.deep_ep import Buffer, Config, normal, normal_mode


def _fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's test input: FP8 rows and per-128-column scales, the scales column-major."""
    t, h = x.shape
    amax = x.view(t, -1, 128).abs().float().amax(dim=2).clamp(1e-4)
    rows = (x.view(t, -1, 128) * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h)
    return rows, (amax / 448.0).T.contiguous().T


@pytest.fixture
def cached(monkeypatch):
    """[buffer as the kernels' backend, a fresh dispatch's handle, x, checked calls counted] (a list: a test
    may take the handle out)."""
    buf = Buffer(None, explicitly_destroy=True)
    g = torch.Generator().manual_seed(5)
    t, e, k, h = 12, 8, 2, 256
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    handle = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, topk_idx=idx,
                          topk_weights=torch.rand(t, k, generator=g))[4]
    for rows in (x, _fp8(x)):  # the cached rows' buffers, built on the reference backend
        buf.dispatch(rows, handle=handle)
    buf.backend = "cute"  # the buffers are built: the kernels' path, on them
    checked: list = []
    real = normal_mode.NormalMode._dispatch_args

    def counted(self, *args, **kwargs):
        checked.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(normal_mode.NormalMode, "_dispatch_args", counted)
    state = [buf, handle, x, checked]
    del handle  # the list holds it alone
    yield state
    buf.destroy()


@pytest.mark.parametrize("fp8", [False, True])
def test_a_kind_already_checked_skips_the_checks_with_the_same_results(cached, fp8):
    buf, handle, x, checked = cached
    arg = _fp8(x) if fp8 else x
    first = buf.dispatch(arg, handle=handle)
    assert len(checked) == 1
    for config in (None, None, Config(24, 8, 256)):
        got = buf.dispatch(arg, handle=handle, config=config)
        assert got[1:5] == (None, None, None, None) and got[5].event is None
        if fp8:
            assert torch.equal(got[0][0].view(torch.uint8), first[0][0].view(torch.uint8))
            assert torch.equal(got[0][1], first[0][1]) and got[0][1].is_contiguous()
        else:
            assert torch.equal(got[0], first[0]) and got[0] is not first[0]  # a new tensor each call
    assert len(checked) == 2  # the config's SMs (24) are a kind of their own: checked once
    buf.dispatch(arg, handle=handle, config=Config(24, 4, 128))  # other chunk sizes, the same SMs
    assert len(checked) == 2


def test_anything_else_takes_the_checked_path(cached):
    buf, handle, x, checked = cached
    buf.dispatch(x, handle=handle)
    calls = [dict(x=x[:6]), dict(x=x.float()), dict(x=x.as_subclass(type("Rows", (torch.Tensor,), {}))),
             dict(x=x, async_finish=True), dict(x=x, is_token_in_rank=handle[4]), dict(x=list(_fp8(x)))]
    for i, kwargs in enumerate(calls):
        try:
            buf.dispatch(handle=handle, **kwargs)
        except ValueError:
            pass  # the checked path's refusals (x's rows against the handle's, a list for a tuple)
        assert len(checked) == 2 + i, kwargs
    with pytest.raises(ValueError, match="num_sms must be even"):
        buf.dispatch(x, handle=handle, config=Config(23, 8, 256))
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buf.dispatch(x, handle=handle, topk_idx=torch.zeros(12, 2, dtype=torch.int64),
                     topk_weights=torch.zeros(12, 2))


def test_a_dead_handle_or_an_evicted_buffer_is_never_used(cached):
    buf, handle, x, checked = cached
    cached[1] = None
    buf.dispatch(x, handle=handle)
    (known,) = buf._known_dispatches.values()
    assert known.route() is handle.cute_ep and known.usable(buf)
    key = known.buf_key
    kept = buf._buffers.pop(key)
    assert not known.usable(buf)  # evicted: the checked path (which would build it again)
    buf._buffers[key] = kept
    checked.clear()  # the counted checks' arguments hold the handle too
    del handle
    gc.collect()
    assert known.route() is None  # the entry keeps nothing of the handle alive
    buf.destroy()
    assert not buf._known_dispatches


@pytest.mark.parametrize("latest", [True, False])
def test_the_kernels_buffers_send_the_rows_in_one_launch_without_a_handle(cached, latest):
    """On a buffer that launches (the kernels'), a cached dispatch's rows go out in one launch with no handle
    kept and no checks (its routing is the cached handle's): ``launch_cached_dispatch`` (no layout) while the
    handle is the buffer's latest dispatch's, else ``launch_dispatch`` on its ids and weights. The launch also
    copies them into the caller's tensors (``deliver``) and, for FP8 rows, puts them together from the values
    and scales (``assemble``: no torch copy before it either); the combines noted before are forgotten, as
    every dispatch does."""
    buf = cached[0]
    calls = []

    class Launching:
        def is_latest(self, handle):
            return latest

        def launch_dispatch(self, *args, **kwargs):
            calls.append(("launch_dispatch", args, kwargs))

        def launch_cached_dispatch(self, *args, **kwargs):
            calls.append(("launch_cached_dispatch", args, kwargs))

    h = 256
    ids, w = torch.zeros(3, 1, dtype=torch.int32), torch.zeros(3, 1)
    sent = DispatchHandle(ids, w, torch.zeros(3, 1, dtype=torch.int32), 3, "scatter", "rank")
    into = (3, (torch.empty(3, 2),))
    plain = normal.RowFormat(torch.bfloat16, h)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    buf._combined.add(("some", "buffer"))
    got = buf._rows_sent_on(Launching(), plain, x, None, sent, into)
    assert got is None and not buf._combined
    (name, args, kwargs), = calls
    assert args[0].data_ptr() == x.data_ptr()
    if latest:
        assert name == "launch_cached_dispatch" and args[1] is sent and kwargs == {"deliver": into}
    else:
        assert name == "launch_dispatch" and args[1] is ids and args[2] is w
        assert kwargs == {"layout": "rank", "deliver": into}
    calls.clear()
    fp8 = normal.RowFormat(torch.float8_e4m3fn, h, torch.float32, h // 128)
    values, scales = _fp8(x.float().add(1).to(torch.bfloat16))
    buf._rows_sent_on(Launching(), fp8, values, scales, sent, into)
    (name, args, kwargs), = calls
    assert args[0].shape == (3, fp8.elems) and args[0].dtype == torch.bfloat16  # written by the launch
    assert kwargs["assemble"][0] is values and kwargs["assemble"][1] is scales and kwargs["deliver"] is into
    calls.clear()
    buf._rows_sent_on(Launching(), fp8, values, scales.double(), sent, into)  # converted: packed here
    (name, args, kwargs), = calls
    assert "assemble" not in kwargs and torch.equal(args[0], fp8.pack(values, scales, None, None))


@pytest.mark.parametrize("fp8", [False, True])
def test_a_cached_dispatch_on_the_kernels_returns_the_tensors_it_had_them_delivered_into(cached, fp8):
    """The cached path on the kernels' buffers: new tensors for the values (and FP8 scales) of the rows the
    handle's dispatch received, handed to the launch as the delivery's parts (no torch copy after it), and
    returned as the call's outputs."""
    buf, handle, x, _ = cached
    arg = _fp8(x) if fp8 else x
    want = buf.dispatch(arg, handle=handle)[0]  # the reference backend's rows
    route = handle.cute_ep
    known = next(iter(buf._known_dispatches.values()))
    sent = []

    class Launching:
        def is_latest(self, handle):
            return False

        def launch_dispatch(self, rows, ids, weights, layout, deliver, assemble=None):
            n, parts = deliver
            sent.append((n, parts))
            for part, got in zip(parts, want if fp8 else (want,), strict=True):  # what the kernel would copy
                part[:n].copy_(got[:n])

    out = normal_mode._cached_rows(buf, Launching(), known.fmt, route, *(arg if fp8 else (arg, None)))
    ((n, parts),) = sent
    assert n == route.num_recv and len(parts) == (2 if fp8 else 1)
    assert out[0] is parts[0] and (out[1] is parts[1] if fp8 else out[1] is None)
    assert out[0].shape == (route.num_recv, x.shape[1])
    assert out[0].dtype == (arg[0].dtype if fp8 else x.dtype)
    assert torch.equal(out[0].view(torch.uint8), (want[0] if fp8 else want).view(torch.uint8))
    if fp8:
        assert out[1].shape == (route.num_recv, x.shape[1] // 128) and out[1].is_contiguous()


def test_a_combine_the_kernels_push_reads_x_where_it_is(cached, monkeypatch):
    """On a buffer that pushes the handle's rows (``EpBuffer.pushes``: its latest dispatch's, a buffer built
    for the reduced combine), combine hands x itself to the launch (no copy into the buffer's expert
    outputs, no fence before it, no check that reads the count back); elsewhere x is copied in first."""
    buf, handle, x, _ = cached
    recv_x = buf.dispatch(x, handle=handle)[0]
    want = buf.combine(recv_x, handle)[0]  # the reference backend's
    launched, fences = [], []

    class Pushing:
        def __init__(self, pushes: bool) -> None:
            self.push = pushes

        def pushes(self, sent):
            return self.push and sent is handle.cute_ep.dispatch_handle

        def launch_combine(self, sent, out, algorithm, y):
            assert algorithm == "reduced"  # the push, asked for by name (the rank layout pulls by default)
            launched.append((sent, out, y))
            out.copy_(want)

        def expert_output(self, rows):
            raise AssertionError("a pushing combine copies nothing into the expert outputs")

    monkeypatch.setattr(buf, "_buffer", lambda *args, **kwargs: (("pushing",), Pushing(True)))
    monkeypatch.setattr(buf, "_fence", lambda key: fences.append(key))
    out = buf.combine(recv_x, handle)[0]
    ((sent, given, y),) = launched
    assert sent is handle.cute_ep.dispatch_handle and given is out and torch.equal(out, want)
    assert y.data_ptr() == recv_x.data_ptr() and y.shape == recv_x.shape and fences == []

    class Pulling(Pushing):
        def expert_output(self, rows):
            self.y = torch.zeros(rows, x.shape[1], dtype=x.dtype)
            return self.y

        def combine(self, y, sent):
            assert y is self.y and torch.equal(y[: recv_x.shape[0]], recv_x)  # copied in first
            return want

    pulling = Pulling(False)
    monkeypatch.setattr(buf, "_buffer", lambda *args, **kwargs: (("pulling",), pulling))
    buf._combined.add(("pulling",))
    assert torch.equal(buf.combine(recv_x, handle)[0], want) and fences == [("pulling",)]


def test_the_normal_modes_combine_is_chosen_by_its_variable(monkeypatch):
    """``CUTE_EP_DEEP_EP_COMBINE``: unset or "pull" builds pull buffers, "push" buffers that hold the rows a
    combine pushes (``EpConfig.combine_algorithm`` "reduced", which the size hint counts too; the
    low-latency mode's are not the normal mode's); anything else is refused naming the variable, the value
    and the choices."""
    from cute_ep.deep_ep.pool import COMBINE_ENV_VAR, normal_combine_algorithm

    def hints() -> tuple[int, int]:
        return (Buffer.get_symmetric_bytes_hint(256, 7168, 2),
                Buffer.get_symmetric_bytes_hint(128, 7168, 2, num_topk=8, num_experts=288, low_latency=True))

    monkeypatch.delenv(COMBINE_ENV_VAR, raising=False)
    assert normal_combine_algorithm() == "pull"
    normal, low_latency = hints()
    monkeypatch.setenv(COMBINE_ENV_VAR, "push")
    assert normal_combine_algorithm() == "reduced"
    # the partial rows (M * R rows of H bf16); the group lists ([C, K] int32) every normal buffer has
    assert hints() == (normal + 256 * 2 * 7168 * 2, low_latency)
    monkeypatch.setenv(COMBINE_ENV_VAR, "pull")
    assert normal_combine_algorithm() == "pull" and hints() == (normal, low_latency)
    monkeypatch.setenv(COMBINE_ENV_VAR, "reduced")
    with pytest.raises(ValueError, match=r"COMBINE must be one of \['pull', 'push'\], got 'reduced'"):
        normal_combine_algorithm()
