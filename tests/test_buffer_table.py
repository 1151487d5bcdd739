"""The one table of buffers (kernels/buffers.py) and what is derived from it: symmetric bytes, the
placeholders of buffers a configuration does not need, the launch bundle's fields, and pointer types."""

from __future__ import annotations

import math

import pytest
import torch

from cute_ep.kernels.buffers import (
    BUFFER_NAMES,
    BUFFERS,
    CALL,
    ELEMENT_TYPES,
    HOST,
    LOCAL,
    ROW,
    SCALARS,
    SIZE_SCALARS,
    STATUS,
    SYMMETRIC,
    EpParams,
    Pointers,
    Scalars,
    packed_fp8_row_bytes,
    symmetric_bytes,
)
from cute_ep.kernels.config import MAX_SMS_PER_GPU, EpConfig

BASE = dict(world_size=4, local_world_size=2, num_experts=32, topk=2, hidden=256, dtype=torch.bfloat16,
            max_tokens=64)


def _expected_symmetric_bytes(c: EpConfig) -> int:
    """The symmetric memory a rank needs, written out by hand (what the table must add up to)."""
    rows = 2 * c.capacity * c.row_bytes  # recv_x, recv_y
    meta = c.capacity * 4 * 3 + c.capacity * c.topk * 4  # recv_w, recv_src, recv_from, each slot's group list
    # counts (+ invalid pairs, + tokens per destination rank), signals
    exchange = c.world_size * (c.num_experts + 1 + c.world_size) * 4 + 3 * c.world_size * 8
    stage = c.stage_rows * c.row_bytes
    packed = c.max_tokens * packed_fp8_row_bytes(c.hidden) if c.hidden % 128 == 0 else 0
    # the rank layout's local ids and weights per (source rank, token), and its CTAs' count words (two
    # parities, per source rank and CTA: tokens per destination rank and invalid pairs), without expert
    # capacity only
    words = 2 * c.world_size * (c.num_sms or MAX_SMS_PER_GPU) * (c.world_size + 1) * 8
    by_rank = 2 * c.world_size * c.max_tokens * c.topk * 4 + words if c.capacity_factor == 0 else 0
    reduced = 0
    if c.combine_algorithm == "reduced":  # partial rows
        reduced = c.max_tokens * c.world_size * c.row_bytes
    return rows + meta + exchange + stage + packed + reduced + by_rank


@pytest.mark.parametrize("change", [{}, {"combine_algorithm": "reduced"}, {"hidden": 200},
                                    {"dtype": torch.float32, "local_world_size": 4},
                                    {"capacity_factor": 1.0}, {"num_sms": 24}])
def test_symmetric_bytes_add_up(change):
    cfg = EpConfig(**{**BASE, **change})
    assert cfg.symmetric_bytes() == symmetric_bytes(cfg) == _expected_symmetric_bytes(cfg)


def test_every_buffer_is_declared_once_and_completely():
    assert len(set(BUFFER_NAMES)) == len(BUFFERS)
    for b in BUFFERS:
        assert b.place in (CALL, SYMMETRIC, LOCAL, STATUS, HOST), b
        assert b.dtype == ROW or b.dtype in ELEMENT_TYPES, b
        assert b.ops and set(b.ops) <= {"layout", "dispatch", "combine"}, b
        assert b.doc, b


def test_shapes_serve_the_host_config_and_the_device_scalars():
    # num_sms as EpBuffer allocates with it: 0 (this rank's share) is resolved before any allocation
    cfg = EpConfig(**{**BASE, "combine_algorithm": "reduced", "num_sms": 24})
    assert all(hasattr(cfg, n) for n in SIZE_SCALARS)  # the kernels' sizes are EpConfig's attributes
    scalars = Scalars(*([0] * (len(SCALARS) - len(SIZE_SCALARS))), *(getattr(cfg, n) for n in SIZE_SCALARS))
    assert scalars.experts_per_rank == cfg.experts_per_rank and scalars.fp8_row_bytes == cfg.fp8_row_bytes
    for b in BUFFERS:
        if b.place != CALL and b.is_needed(cfg):  # the device view of an owned buffer is its full allocation
            assert tuple(b.shape(scalars)) == b.alloc_shape(cfg), b.name
    by = {b.name: b for b in BUFFERS}
    # the low-latency buffers only in a low-latency configuration, which has no recv_x (capacity E * M)
    ll = EpConfig(**{**BASE, "low_latency": True})
    assert ll.capacity == ll.num_experts * ll.max_tokens and by["recv_x"].alloc_shape(ll) == (8,)
    assert by["recv_x"].alloc_shape(cfg) == (cfg.capacity, cfg.hidden)
    assert by["ll_rows"].alloc_shape(ll) == (2 * 4 * ll.max_tokens, ll.hidden)
    assert by["ll_index"].alloc_shape(ll) == (2, 8, 4, ll.max_tokens)
    assert by["ll_rows"].alloc_shape(cfg) == (8,)
    assert by["ll_signals"].alloc_shape(ll) == (2, 8, 4) and by["recv_y"].alloc_shape(ll) == (8,)
    assert by["ll_comb"].alloc_shape(ll) == (ll.max_tokens * ll.topk, ll.hidden)
    assert by["counts"].alloc_shape(cfg) == (4, 37) and by["signals"].alloc_shape(cfg) == (3, 4)
    assert by["recv_group"].alloc_shape(cfg) == (cfg.capacity, 2)
    assert EpParams._fields == SCALARS + tuple(f"{n}_ptr" for n in BUFFER_NAMES)
    assert Pointers._fields == BUFFER_NAMES
    assert all(isinstance(getattr(EpParams, n), property) for n in BUFFER_NAMES)  # p.<name>: the tensor


def test_buffers_a_config_does_not_need_are_one_16_byte_placeholder():
    pull = EpConfig(**{**BASE, "hidden": 200})  # no reduced combine, no FP8 (200 % 128 != 0)
    by = {b.name: b for b in BUFFERS}
    for name in ("partials", "packed"):
        assert not by[name].is_needed(pull)
        assert by[name].nbytes(pull) == 16, name
    # the fan-out reads a group's members under dedup with either combine; a low-latency buffer has no fan-out
    assert by["recv_group"].alloc_shape(pull) == (pull.capacity, pull.topk)
    assert by["recv_group"].nbytes(EpConfig(**{**BASE, "low_latency": True})) == 16
    assert math.prod(by["partials"].alloc_shape(EpConfig(**{**BASE, "combine_algorithm": "reduced"}))) == (
        64 * 4 * 256)


def test_pointer_types_follow_the_table():
    from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint64

    from cute_ep.kernels.host import pointer_type

    cfg = EpConfig(**BASE)
    expect = {"x": (BFloat16, 16), "recv_w": (Float32, 4), "scatter": (Int32, 4), "signals": (Uint64, 8),
              "epochs": (Int64, 8), "packed": (Uint8, 16), "recv_y": (BFloat16, 16)}
    for name, want in expect.items():
        assert pointer_type(cfg, name) == want, name


class _Sym:
    """A size as it is written in docs/design.md ("E", "M * R", ...), for rendering shapes symbolically."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __add__(self, other: object) -> _Sym:
        return _Sym(f"{self.text} + {other}")

    def __mul__(self, other: _Sym) -> _Sym:
        return _Sym(f"{self.text} * {other.text}")

    def __rmul__(self, other: int) -> _Sym:
        return _Sym(f"{other} * {self.text}")

    def __str__(self) -> str:
        return self.text


SYMBOLS = dict(num_tokens="T", hidden="H", topk="K", capacity="C", world_size="R", num_experts="E",
               stage_rows="stage_rows", max_tokens="M", fp8_row_bytes="fp8_row_bytes", experts_per_rank="E/R",
               rank_capacity="R * M", num_sms="num_sms", status_words="S", fp8_scales="H / 128",
               layout_ctas="num_sms")
CONDITIONS = {"recv_group": "not with `low_latency`",
              "partials": 'only with `combine_algorithm="reduced"`', "packed": "only when H % 128 == 0",
              "recv_topk_idx": "only with `capacity_factor == 0`",
              "recv_topk_w": "only with `capacity_factor == 0`", "recv_x": "not with `low_latency`",
              "ll_rows": "only with `low_latency`", "ll_index": "only with `low_latency`",
              "ll_signals": "only with `low_latency`", "recv_y": "not with `low_latency`",
              "ll_comb": "only with `low_latency`", "layout_words": "only with `capacity_factor == 0`"}


def design_doc_table() -> str:
    """The buffer table of docs/design.md, rendered from BUFFERS."""
    sizes = type("Sizes", (), {k: _Sym(v) for k, v in SYMBOLS.items()})()
    lines = ["| name | shape | dtype | place | ops | what it holds |", "|---|---|---|---|---|---|"]
    for b in BUFFERS:
        shape = ", ".join(str(n) for n in b.shape(sizes))
        doc = b.doc + (f"; {CONDITIONS[b.name]}" if b.name in CONDITIONS else "")
        dtype = "row dtype" if b.dtype == ROW else b.dtype
        lines.append(f"| `{b.name}` | [{shape}] | {dtype} | {b.place} | {', '.join(b.ops)} | {doc} |")
    return "\n".join(lines)


def test_design_doc_lists_the_table_as_declared():
    from pathlib import Path

    assert set(CONDITIONS) == {b.name for b in BUFFERS if b.needed is not None}
    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    table = design_doc_table()
    assert table in doc, f"docs/design.md's buffer table is not BUFFERS'; it should read:\n{table}"
