"""docs/api.md is the API reference rendered from the docstrings (scripts/gen_api_docs.py): the committed
file equals a fresh render, so a docstring edited without running ``python scripts/gen_api_docs.py``
fails here; the render covers every name ``cute_ep.__all__`` exports; and ``--check`` exits 0 on a current
file and 1, with a summary of the differences, on a stale or missing one."""

from __future__ import annotations

import inspect

import pytest
from _launch import REPO, import_script, run_single

import cute_ep

SCRIPT = REPO / "scripts" / "gen_api_docs.py"
API_MD = REPO / "docs" / "api.md"


@pytest.fixture(scope="module")
def gen():
    return import_script(SCRIPT, "gen_api_docs_script")


@pytest.fixture(scope="module")
def rendered(gen) -> str:
    return gen.render()


def test_the_committed_reference_is_the_docstrings_rendered(rendered):
    committed = API_MD.read_text() if API_MD.is_file() else ""
    assert committed == rendered, (
        "docs/api.md differs from the docstrings: run `python scripts/gen_api_docs.py` and commit the result"
    )


def test_every_export_and_public_method_is_documented(rendered):
    headings = {line[4:].strip("`") for line in rendered.splitlines() if line.startswith("### ")}
    for name in cute_ep.__all__:
        if name != "__version__":
            assert f"cute_ep.{name}" in headings, name
    assert "`cute_ep.__version__`" in rendered
    for name in ("cute_ep.bootstrap.Runtime", "cute_ep.bootstrap.DistEnv", "cute_ep.deep_ep.Buffer"):
        assert name in headings, name
    for cls in (cute_ep.EpBuffer, cute_ep.ReferenceEpBuffer, cute_ep.A2aEpBuffer):
        for member in ("dispatch", "combine", "expert_output", "close", "check_capacity", "dropped_rows"):
            assert f"**`{cls.__name__}.{member}`**" in rendered, (cls.__name__, member)
    for member in ("launch_dispatch", "launch_combine", "check_faults", "check_ran", "fp8_views"):
        assert f"**`EpBuffer.{member}`**" in rendered, member
    # torch.nn.Module's own methods are not cute-ep's API
    assert "**`MoELayer.forward`**" in rendered and "**`MoELayer.state_dict`**" not in rendered


def test_a_docstring_edit_shows_in_the_render_and_in_check(gen, rendered, monkeypatch, tmp_path, capsys):
    marker = "A sentence that is only in this test's docstring."
    dispatch = cute_ep.EpBuffer.dispatch
    monkeypatch.setattr(dispatch, "__doc__", inspect.getdoc(dispatch) + marker)
    out = tmp_path / "api.md"
    out.write_text(rendered)
    assert gen.main(["--check", "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "is out of date" in said and marker in said and "cute_ep.EpBuffer" in said, said
    assert out.read_text() == rendered  # --check writes nothing
    assert gen.main(["--out", str(out)]) == 0
    assert marker in out.read_text()


def test_check_exit_status(gen, rendered, tmp_path, capsys):
    """0 when current, 1 when stale or missing (and it says how to regenerate); the stale case also as a
    program, whose exit status is what a user or a hook sees."""
    current, stale = tmp_path / "current.md", tmp_path / "stale.md"
    current.write_text(rendered)
    stale.write_text(rendered.replace("## Errors", "## Errors, edited by hand", 1))
    assert gen.main(["--check", "--out", str(current)]) == 0
    assert gen.main(["--check", "--out", str(tmp_path / "none.md")]) == 1
    assert "python scripts/gen_api_docs.py" in capsys.readouterr().out
    proc = run_single(SCRIPT, "--check", "--out", stale, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "python scripts/gen_api_docs.py" in proc.stdout and "line(s) to add" in proc.stdout, proc.stdout
