"""The backend profiler (cute_ep.profiler) in a world of one, with reference-backend candidates: the
fastest correct candidate wins, a wrong or crashing one is excluded with the reason, and choices are
cached per shape."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from cute_ep import profiler
from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.bootstrap.dist_env import DistEnv
from cute_ep.kernels.config import EpConfig
from cute_ep.reference_backend import ReferenceEpBuffer

CFG = EpConfig(world_size=1, local_world_size=1, num_experts=8, topk=2, hidden=32, dtype=torch.bfloat16,
               max_tokens=16)


@pytest.fixture
def runtime():
    return SimpleNamespace(env=DistEnv.from_environ({}), device=None, cpu_group=None)


SLOW_S = 0.05  # far above the reference's dispatch even on a loaded 2-core runner (7 ms seen there)


class _Slow(ReferenceEpBuffer):
    def dispatch(self, *args, **kwargs):
        time.sleep(SLOW_S)
        return super().dispatch(*args, **kwargs)


class _Wrong(ReferenceEpBuffer):
    def combine(self, y, handle):
        out = super().combine(y, handle)
        out[0, 0] += 1  # one element off
        return out


class _Crashing(ReferenceEpBuffer):
    def combine(self, y, handle):
        raise RuntimeError("no such primitive here")


def _candidates(rt, *names):
    table = {"reference": ReferenceEpBuffer, "slow": _Slow, "wrong": _Wrong, "crashing": _Crashing,
             "a2a": A2aEpBuffer}
    return {n: (lambda cls: lambda cfg: cls(rt, cfg))(table[n]) for n in names}


def test_the_fastest_correct_candidate_wins(runtime):
    result = profiler.profile(runtime, CFG, _candidates(runtime, "slow", "reference", "wrong", "crashing"),
                              tokens=12, iters=3, warmup=1)
    by_name = {c.name: c for c in result.candidates}
    assert result.winner == "reference" and result.fastest_dispatch == "reference"
    # the sleep is a floor on every timed call: the profiler must time the call itself
    assert by_name["slow"].dispatch_us >= SLOW_S * 1e6 > by_name["reference"].dispatch_us
    assert not by_name["wrong"].ok and "differs from slow in out" in by_name["wrong"].error
    assert not by_name["crashing"].ok and "no such primitive here" in by_name["crashing"].error
    table = profiler.format_table(result)
    assert "reference" in table and "<- chosen" in table and "excluded" in table
    assert isinstance(result.build(CFG), ReferenceEpBuffer)


def test_the_all_to_all_fallback_agrees_with_the_reference(runtime):
    result = profiler.profile(runtime, CFG, _candidates(runtime, "reference", "a2a"), tokens=16, iters=2)
    assert all(c.ok for c in result.candidates), profiler.format_table(result)


def test_no_passing_candidate_cannot_build(runtime):
    result = profiler.profile(runtime, CFG, _candidates(runtime, "crashing"), tokens=4, iters=1, warmup=0)
    assert result.winner is None
    with pytest.raises(RuntimeError, match="no candidate passed"):
        result.build(CFG)


def test_choose_caches_per_shape(runtime, tmp_path, monkeypatch):
    cache = profiler.ProfileCache(tmp_path / "choices.json")
    said = []
    name, buf = profiler.choose(runtime, CFG, _candidates(runtime, "slow", "reference"), tokens=8,
                                cache=cache, say=said.append, iters=2, warmup=0)
    assert name == "reference" and isinstance(buf, ReferenceEpBuffer)
    key = profiler.shape_key(runtime, CFG, 8)
    assert json.loads(cache.path.read_text())[key]["winner"] == "reference"
    assert key.startswith("cpu|R1|L1|T8|H32|K2|E8|bfloat16")

    def no_profiling(*args, **kwargs):
        raise AssertionError("a cached choice must not be profiled again")

    monkeypatch.setattr(profiler, "profile", no_profiling)
    name, _ = profiler.choose(runtime, CFG, _candidates(runtime, "slow", "reference"), tokens=8, cache=cache,
                              say=said.append)
    assert name == "reference" and "cached" in said[-1]
    monkeypatch.undo()
    # Another shape is profiled anew.
    name, _ = profiler.choose(runtime, CFG, _candidates(runtime, "reference"), tokens=4, cache=cache)
    assert len(json.loads(cache.path.read_text())) == 2


def test_argument_errors(runtime, tmp_path):
    with pytest.raises(ValueError, match="at least one backend"):
        profiler.profile(runtime, CFG, {}, tokens=4)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, cfg.max_tokens=16\], got 17"):
        profiler.profile(runtime, CFG, _candidates(runtime, "reference"), tokens=17)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        profiler.ProfileCache(bad).get("k")
