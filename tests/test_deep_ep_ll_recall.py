"""The low-latency calls' recall path, without a GPU (the launches and graphs are the stand-ins of
test_deep_ep_low_latency_host): a call repeated with its tensors where they were is replayed by its call
key, with none of the signature, checks or graph keys of its full path, and returns what that path would;
anything that could change what the graph reads or writes sends the call down the full path again."""

from __future__ import annotations

import pytest
import torch
from test_deep_ep_low_latency_host import _kernels_mode, _pairs

from cute_ep.deep_ep import ll_checks
from cute_ep.deep_ep.ll_graphs import combine_call_key, dispatch_call_key
from cute_ep.input_checks import _DISPATCH_ROWS, note_dispatch_rows


def _counting_signatures(monkeypatch) -> list:
    """Every signature the calls build (their full path's first step), recorded."""
    seen, real = [], ll_checks._signature

    def counted(args):
        seen.append(args)
        return real(args)

    monkeypatch.setattr(ll_checks, "_signature", counted)
    return seen


def _recalls(mode) -> int:
    return len(mode._ll_graphs._recalled)


def _warmed(monkeypatch):
    """A mode whose BF16 pair has been recalled (6 pairs run), the signatures counted from then on, and
    its dispatch on the stand-ins' tensors: (mode, buf, graphs, args, signatures seen, dispatch)."""
    mode, buf, g, args = _kernels_mode(monkeypatch, replays=True)
    x, ids, w, y, stats, t, e = args
    _pairs(mode, args, 6)

    def dispatch(xs=x):
        return mode.low_latency_dispatch(xs, ids, t, e, cumulative_local_expert_recv_stats=stats,
                                         use_fp8=False)[2]

    return mode, buf, g, args, _counting_signatures(monkeypatch), dispatch


@pytest.mark.parametrize("use_fp8", [False, True])
def test_repeated_pairs_are_recalled_with_no_signature_and_the_full_paths_results(monkeypatch, use_fp8):
    mode, buf, g, args = _kernels_mode(monkeypatch, replays=True)
    seen = _counting_signatures(monkeypatch)
    first = _pairs(mode, args, 6, use_fp8)  # sighting, capture, replays (remembered), recalls
    built = len(seen)
    later = _pairs(mode, args, 6, use_fp8)
    assert len(seen) == built  # no signature: every later call recalled
    assert _recalls(mode) == 2  # the dispatches at one parity, the combines at the other
    assert dict(g.graphs.replays) == {"direct": 11, "combine": 11}  # all but the first sighting
    assert dict(g.graphs.captures) == {"direct": 1, "combine": 1}
    notes = [n[0] for n in buf.notes]
    assert notes.count("dispatch") == 11 and notes.count("combine") == 11
    for one, other in zip(first[-2:], later[-2:], strict=True):  # the same tensors as the replays before
        assert one[0] is other[0] and one[3] is other[3] and one[2][0] is other[2][0]
        assert one[4:] == other[4:]
    # the latest handle of a parity is returned again while its ids tensor is unchanged
    x, ids, w, y, stats, t, e = args
    h1 = mode.low_latency_dispatch(x, ids, t, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8)[2]
    mode.low_latency_combine(y, ids, w, h1)
    h2 = mode.low_latency_dispatch(x, ids, t, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8)[2]
    mode.low_latency_combine(y, ids, w, h2)
    assert mode.low_latency_dispatch(x, ids, t, e, cumulative_local_expert_recv_stats=stats,
                                     use_fp8=use_fp8)[2] is h1
    ids.add_(0)  # a new version: a new handle noting it
    h3 = mode.low_latency_dispatch(x, ids, t, e, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8)[2]
    assert h3 is not h2 and h3.cute_ep.given_version == ids._version


def test_a_moved_or_relaid_tensor_takes_the_full_path(monkeypatch):
    mode, buf, g, args, seen, dispatch = _warmed(monkeypatch)
    x, ids, w, y, stats, t, e = args
    dispatch(x.clone())  # new addresses: the full path (a new direct key, a sighting)
    assert len(seen) == 1
    # the same address, another layout: not the call key remembered
    assert dispatch_call_key(0, x, ids, stats, t, e, False, False, False) != dispatch_call_key(
        0, x.view(t * 2, -1), ids, stats, t, e, False, False, False)
    assert dispatch_call_key(0, x, ids, stats, t, e, False, False, False) != dispatch_call_key(
        0, x, ids, None, t, e, False, False, False)
    assert dispatch_call_key(0, torch.nn.Parameter(x), ids, None, t, e) is None  # subclasses: the full path
    assert combine_call_key(0, y, w.numpy(), None) is None


def test_recall_declines_while_capturing_after_clear_and_where_a_combine_must_fence(monkeypatch):
    mode, buf, g, args, seen, dispatch = _warmed(monkeypatch)
    x, ids, w, y, stats, t, e = args
    handle = dispatch()
    mode.low_latency_combine(y, ids, w, handle)
    assert not seen  # both recalled
    for fences in (1, 2):  # more combines, no dispatch between: each fences first (the second at the
        # parity of the remembered combine: not recalled)
        mode.low_latency_combine(y, ids, w, handle)
        assert len(seen) == fences and len(mode.fences) == fences
    g.capturing = True  # the caller's own capture: neither recalled nor replayed
    dispatch()
    assert len(seen) == 3 and len(buf.launched) == 5  # launched eagerly (4 before: sightings and captures)
    g.capturing = False
    g.graphs.clear()  # the buffers freed: nothing recalled
    assert _recalls(mode) == 0
    dispatch()
    assert len(seen) == 4


def test_a_combine_is_recalled_only_on_its_dispatchs_ids_and_where_its_output_lands_again(monkeypatch):
    mode, buf, g, args, seen, dispatch = _warmed(monkeypatch)
    x, ids, w, y, stats, t, e = args
    handle = dispatch()
    other_ids = ids.clone()  # equal ids in another tensor: the full path (it cannot know they are the same)
    mode.low_latency_combine(y, other_ids, w, handle)
    assert len(seen) == 1
    handle = dispatch()
    monkeypatch.setattr(torch, "empty", torch.zeros)  # a new output elsewhere (the stand-ins' is kept)
    combined = mode.low_latency_combine(y, ids, w, handle)[0]
    assert len(seen) == 2 and combined.shape == (t, y.shape[-1])


def test_a_dispatch_noted_again_as_it_was_keeps_its_entry():
    class Handle:
        def __init__(self):
            self.scatter = torch.zeros(3)

    h = Handle()
    note_dispatch_rows(h, None)
    entry = _DISPATCH_ROWS[id(h.scatter)]
    note_dispatch_rows(h, None)
    assert _DISPATCH_ROWS[id(h.scatter)] is entry  # nothing made again
    note_dispatch_rows(h, 7)
    assert _DISPATCH_ROWS[id(h.scatter)][1] == 7
    key = id(h.scatter)
    del h
    assert key not in _DISPATCH_ROWS
