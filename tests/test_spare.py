"""``cute_ep.spare.SpareOutputs``: outputs made ahead for the next call of a kind, handed out once, only for
the same key (shape and stream), never during CUDA graph capture, none beyond the size cap."""

from __future__ import annotations

import torch

from cute_ep.spare import SPARE_MAX_BYTES, SpareOutputs


class _Maker:
    """make(key): a new tensor per call, counted."""

    def __init__(self) -> None:
        self.made: list[tuple] = []

    def __call__(self, key: tuple) -> torch.Tensor:
        self.made.append(key)
        return torch.full((key[0],), len(self.made))


def _spare(capturing: list[bool] | None = None) -> tuple[SpareOutputs, _Maker]:
    make = _Maker()
    flag = capturing if capturing is not None else [False]
    return SpareOutputs(make, capturing=lambda: flag[0]), make


def test_the_second_call_of_a_key_makes_the_third_calls_outputs_ahead() -> None:
    spare, make = _spare()
    key = (4, 7)  # (size, stream)
    first = spare.take(key)
    spare.refill(key, 16)  # the first call of this key: nothing ahead
    assert len(make.made) == 1
    second = spare.take(key)
    assert len(make.made) == 2 and second is not first
    spare.refill(key, 16)  # the key repeats: the next call's set is made now
    assert len(make.made) == 3
    third = spare.take(key)
    assert len(make.made) == 3 and int(third[0]) == 3  # the one made ahead, no allocation in the call
    fourth = spare.take(key)  # not refilled in between: a set is never handed out twice
    assert len(make.made) == 4 and fourth is not third


def test_a_set_goes_only_to_a_call_of_its_key() -> None:
    spare, make = _spare()
    for _ in range(2):
        spare.take((4, 7))
        spare.refill((4, 7), 16)
    ahead = len(make.made)
    other_stream = spare.take((4, 8))  # same size, another stream: made now
    assert len(make.made) == ahead + 1 and int(other_stream[0]) == ahead + 1
    other_size = spare.take((5, 7))
    assert len(make.made) == ahead + 2 and other_size.numel() == 5
    kept = spare.take((4, 7))  # the set made ahead is still there for its own key
    assert len(make.made) == ahead + 2 and int(kept[0]) == ahead
    spare.refill((5, 7), 20)  # the key changed since the last call: nothing ahead
    assert len(make.made) == ahead + 2


def test_nothing_is_taken_or_made_ahead_during_graph_capture() -> None:
    capturing = [False]
    spare, make = _spare(capturing)
    for _ in range(2):
        spare.take((4, 7))
        spare.refill((4, 7), 16)
    ahead = len(make.made)
    capturing[0] = True
    captured = spare.take((4, 7))  # the graph's tensors come from its own pool: made now
    assert len(make.made) == ahead + 1 and int(captured[0]) == ahead + 1
    spare.refill((4, 7), 16)
    assert len(make.made) == ahead + 1
    capturing[0] = False
    after = spare.take((4, 7))  # the set made before the capture, kept through it
    assert len(make.made) == ahead + 1 and int(after[0]) == ahead


def test_outputs_beyond_the_size_cap_are_not_made_ahead() -> None:
    spare, make = _spare()
    for _ in range(3):
        spare.take((4, 7))
        spare.refill((4, 7), SPARE_MAX_BYTES + 1)
    assert len(make.made) == 3  # one per call, none ahead
    spare.refill((4, 7), SPARE_MAX_BYTES)
    assert len(make.made) == 4
