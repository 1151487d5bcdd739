"""The three backends implement one interface (``cute_ep.api.EpBackend``), and the package's import
graph keeps its promises: the CPU backends import no GPU module, and library code never imports the
validators."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from cute_ep.a2a_backend import A2aEpBuffer
from cute_ep.api import EpBackend
from cute_ep.buffer import EpBuffer
from cute_ep.reference_backend import ReferenceEpBuffer

REPO = Path(__file__).resolve().parents[1]
BACKENDS = [EpBuffer, ReferenceEpBuffer, A2aEpBuffer]
PROTOCOL_METHODS = [name for name, member in vars(EpBackend).items()
                    if callable(member) and (not name.startswith("_") or name in ("__enter__", "__exit__"))]


def _params(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of every parameter: what a caller relies on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _conforms(impl, proto) -> bool:
    """The protocol's parameters, in order, with the same kinds and defaults; a backend may add options of
    its own after them only as keyword-only parameters with defaults (a call written against the
    protocol then means the same on every backend)."""
    got, want = _params(impl), _params(proto)
    extra = got[len(want):]
    return got[:len(want)] == want and all(
        kind == inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
        for _, kind, default in extra
    )


def test_protocol_lists_the_public_calls():
    assert set(PROTOCOL_METHODS) >= {"dispatch", "combine", "expert_output", "poison", "dropped_rows",
                                     "check_capacity", "close", "__enter__", "__exit__"}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_backend_signature_matches_the_protocol(backend, method):
    assert hasattr(backend, method), f"{backend.__name__} lacks {method}"
    assert _conforms(getattr(backend, method), getattr(EpBackend, method)), (
        f"{backend.__name__}.{method}{inspect.signature(getattr(backend, method))} differs from "
        f"EpBackend.{method}{inspect.signature(getattr(EpBackend, method))}"
    )


def test_a_backend_with_a_drifted_signature_is_caught():
    """The comparison above can fail: a missing parameter, another default, or an extra positional one."""

    def missing(self, x, topk_idx, topk_weights, mode="scatter", fp8=False, algorithm=None, sync=True):
        raise NotImplementedError  # no layout: a backend from before the rank layout

    def other_default(self, x, topk_idx, topk_weights, mode="atomic", fp8=False, algorithm=None, sync=True,
                      layout="expert"):
        raise NotImplementedError

    def other_layout_default(self, x, topk_idx, topk_weights, mode="scatter", fp8=False, algorithm=None,
                             sync=True, layout="rank"):
        raise NotImplementedError

    def extra_positional(self, x, topk_idx, topk_weights, mode="scatter", fp8=False, algorithm=None,
                         sync=True, layout="expert", stream=None):
        raise NotImplementedError

    def extra_keyword(self, x, topk_idx, topk_weights, mode="scatter", fp8=False, algorithm=None, sync=True,
                      layout="expert", *, stream=None):
        raise NotImplementedError

    for drifted in (missing, other_default, other_layout_default, extra_positional):
        assert not _conforms(drifted, EpBackend.dispatch), drifted.__name__
    assert _conforms(extra_keyword, EpBackend.dispatch)  # a GPU option, as EpBuffer's stream


def _imports_of(code: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    return proc.stdout.split()


def test_cpu_backends_import_no_gpu_module():
    # (torch itself may load cuda.bindings; the GPU buffer, CuTe DSL and NVSHMEM must stay out.)
    mods = _imports_of("import cute_ep.reference_backend, cute_ep.a2a_backend, cute_ep.autograd")
    bad = [m for m in mods if m == "cute_ep.buffer" or m.split(".")[0] in ("cutlass", "nvshmem")]
    assert not bad, bad
    assert "cute_ep.reference_backend" in mods  # the probe imported what it names


def test_library_code_never_imports_the_validators():
    """cute_ep/, kernels/ and bootstrap/ may be imported by validators/, never the other way round."""
    offenders = []
    for folder in ("cute_ep", "kernels", "bootstrap"):
        for path in sorted((REPO / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if "validators" in n.split(".")]
    assert not offenders, offenders
