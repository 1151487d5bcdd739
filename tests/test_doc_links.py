"""The README's and docs/' links inside the repository lead somewhere: the file exists, and a ``#section``
names one of its headings (as GitHub makes heading anchors)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from _launch import REPO as ROOT
from _launch import import_script

slug = import_script(ROOT / "scripts" / "gen_api_docs.py", "gen_api_docs_script").slug  # GitHub's anchor rule
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "baselines").glob("*.md"))]
LINK = re.compile(r"\]\(([^()\s]+)\)")  # [text](target)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor_of(heading: str) -> str:
    """GitHub's anchor of a heading as written in Markdown: its text (markup and a link's target dropped),
    then ``slug``."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip())
    return slug(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text))  # a link in a heading keeps its text


@functools.cache
def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (read once, however many links lead into it)."""
    found, seen = set(), {}
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            a = anchor_of(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            found.add(a if n == 0 else f"{a}-{n}")  # repeated headings get -1, -2, ...
    return found


def test_anchor_of_follows_github():
    assert anchor_of("2026-12-01, 07:00 UTC: one H200, the combine's receiving half") == (
        "2026-12-01-0700-utc-one-h200-the-combines-receiving-half")
    assert anchor_of("Install and run") == "install-and-run"
    assert anchor_of("`cute_ep.deep_ep` (the DeepEP front)") == "cute_epdeep_ep-the-deepep-front"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_inside_the_repository_resolve(page: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, section = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            where = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            broken.append(f"{target}: no file {where}")
        elif section and dest.suffix == ".md" and section not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{section} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)
