"""``cute_ep.spare.SpareOutputs``: output sets made ahead for the next calls of a kind, many at once, each
handed out once, only for the same key (shape and stream), never during CUDA graph capture, none beyond the
size cap; and the sets of the calls that use it (the layout call's, a dispatch handle's storage): contiguous
views that share no byte."""

from __future__ import annotations

import torch
from _memory import share_no_byte

from cute_ep.deep_ep.token_layout import _outputs
from cute_ep.spare import SPARE_AHEAD, SPARE_MAX_BYTES, SpareOutputs, handle_storage


class _Maker:
    """make(key, n): n new tensors, each numbered by the sets made so far; the batch sizes recorded."""

    def __init__(self) -> None:
        self.made = 0
        self.batches: list[tuple] = []

    def __call__(self, key: tuple, n: int) -> list[torch.Tensor]:
        self.batches.append((key, n))
        first = self.made
        self.made += n
        return [torch.full((key[0],), first + i + 1) for i in range(n)]


def _spare(capturing: list[bool] | None = None) -> tuple[SpareOutputs, _Maker]:
    make = _Maker()
    flag = capturing if capturing is not None else [False]
    return SpareOutputs(make, capturing=lambda: flag[0]), make


def test_a_run_of_one_key_gets_its_sets_made_ahead_in_batches() -> None:
    spare, make = _spare()
    key = (4, 7)  # (size, stream)
    first = spare.take(key)
    spare.refill(key, 16)  # the first call of this key: nothing ahead
    assert make.batches == [(key, 1)]
    second = spare.take(key)
    assert make.made == 2 and second is not first
    spare.refill(key, 16)  # the key repeats: the next calls' sets, SPARE_AHEAD of them at once
    assert make.batches[-1] == (key, SPARE_AHEAD)
    got = []
    for _ in range(SPARE_AHEAD - 1):  # handed out one by one, none made in a call
        got.append(spare.take(key))
        spare.refill(key, 16)  # sets are left: nothing made
    assert make.made == 2 + SPARE_AHEAD
    got.append(spare.take(key))  # the batch's last
    assert make.made == 2 + SPARE_AHEAD and len({int(t[0]) for t in got}) == SPARE_AHEAD
    assert len({id(t) for t in got} | {id(first), id(second)}) == SPARE_AHEAD + 2
    spare.refill(key, 16)  # all handed out: the next batch
    assert make.batches[-1] == (key, SPARE_AHEAD) and make.made == 2 + 2 * SPARE_AHEAD


def test_a_set_goes_only_to_a_call_of_its_key() -> None:
    spare, make = _spare()
    for _ in range(2):
        spare.take((4, 7))
        spare.refill((4, 7), 16)
    ahead = make.made
    other_stream = spare.take((4, 8))  # same size, another stream: made now
    assert make.made == ahead + 1 and int(other_stream[0]) == ahead + 1
    other_size = spare.take((5, 7))
    assert make.made == ahead + 2 and other_size.numel() == 5
    kept = spare.take((4, 7))  # the sets made ahead are still there for their own key
    assert make.made == ahead + 2 and 2 < int(kept[0]) <= ahead
    spare.refill((5, 7), 20)  # the key changed since the last call: nothing ahead
    assert make.made == ahead + 2


def test_nothing_is_taken_or_made_ahead_during_graph_capture() -> None:
    capturing = [False]
    spare, make = _spare(capturing)
    for _ in range(2):
        spare.take((4, 7))
        spare.refill((4, 7), 16)
    ahead = make.made
    capturing[0] = True
    captured = spare.take((4, 7))  # the graph's tensors come from its own pool: made now
    assert make.made == ahead + 1 and int(captured[0]) == ahead + 1
    spare.refill((4, 7), 16)
    assert make.made == ahead + 1
    capturing[0] = False
    after = spare.take((4, 7))  # a set made before the capture, kept through it
    assert make.made == ahead + 1 and int(after[0]) <= ahead


def test_the_sets_made_ahead_hold_at_most_the_size_cap() -> None:
    spare, make = _spare()
    for _ in range(3):
        spare.take((4, 7))
        spare.refill((4, 7), SPARE_MAX_BYTES + 1)  # one set above the cap: none ahead
    assert make.batches == [((4, 7), 1)] * 3
    spare.refill((4, 7), SPARE_MAX_BYTES // 3)
    assert make.batches[-1] == ((4, 7), 3)  # as many as fit under the cap


def _apart(tensors: list[torch.Tensor]) -> bool:
    """Every tensor contiguous, aligned to its element, and no two sharing a byte."""
    aligned = all(x.is_contiguous() and x.data_ptr() % x.element_size() == 0 for x in tensors)
    return aligned and share_no_byte(tensors)


def test_layout_sets_are_contiguous_views_that_share_no_byte() -> None:
    t, r, e, n = 5, 3, 7, 4
    sets = _outputs((t, r, e, torch.device("cpu"), 0), n)
    assert len(sets) == n
    for per_rank, per_expert, in_rank in sets:
        assert (per_rank.shape, per_rank.dtype) == ((r,), torch.int32)
        assert (per_expert.shape, per_expert.dtype) == ((e,), torch.int32)
        assert (in_rank.shape, in_rank.dtype) == ((t, r), torch.bool)
    assert _apart([x for one in sets for x in one])
    sets[0][2].fill_(True)  # a write to one set's tensor leaves every other set's as it was
    sets[1][2].fill_(False)
    assert bool(sets[0][2].all()) and not bool(sets[1][2].any())


def test_handle_storage_sets_are_apart_and_carry_their_addresses() -> None:
    t, k, n = 5, 3, 4
    sets = handle_storage((t, k, torch.device("cpu"), 0), n)
    assert len(sets) == n
    for slots, ids, weights, addrs in sets:
        assert [(x.shape, x.dtype) for x in (slots, ids, weights)] == [
            ((t, k), torch.int32), ((t, k), torch.int32), ((t, k), torch.float32)]
        assert addrs == (slots.data_ptr(), ids.data_ptr(), weights.data_ptr())  # what the launch is given
    assert _apart([x for s in sets for x in s[:3]])
    sets[0][1].fill_(7)  # a write to one set's ids leaves the others' as they were
    sets[1][1].fill_(-1)
    assert bool((sets[0][1] == 7).all()) and not bool((sets[1][0] == 7).any())
    assert handle_storage((0, k, torch.device("cpu"), 0), 2)[1][0].shape == (0, k)  # no tokens: empty sets
