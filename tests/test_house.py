"""The package's direction: cute_ep.tools (what the scripts, examples and benchmarks share) imports the
library, and the library never imports the tools.

The library is every module of cute_ep outside cute_ep.tools, with the subpackages installed from the
repository's top-level folders (pyproject.toml's package-dir): cute_ep.kernels, cute_ep.bootstrap and
cute_ep.validators. Importing cute_ep.kernels.* compiles nothing; it imports the CuTe DSL, which must be
installed."""

from __future__ import annotations

import ast
from pathlib import Path

from _launch import REPO, assert_imports_none

PACKAGE_DIRS = {
    "cute_ep": REPO / "cute_ep",
    "cute_ep.kernels": REPO / "kernels",
    "cute_ep.bootstrap": REPO / "bootstrap",
    "cute_ep.validators": REPO / "validators",
}
TOOLS = "cute_ep.tools"
TOOL_MODULES = ("bench_peers", "bench_report", "bench_timing", "cli", "usage")
"""The modules of cute_ep.tools."""


def modules_in(package: str, folder: Path) -> dict[str, Path]:
    """Every module of ``package`` (in ``folder``) and of its subpackages: dotted name -> source file."""
    found = {package: folder / "__init__.py"}
    for path in sorted(folder.glob("*.py")):
        if path.name != "__init__.py":
            found[f"{package}.{path.stem}"] = path
    for sub in sorted(folder.iterdir()):
        if (sub / "__init__.py").is_file():
            found.update(modules_in(f"{package}.{sub.name}", sub))
    return found


def is_tools(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def library_modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        found.update(modules_in(package, folder))
    return {name: path for name, path in found.items() if not is_tools(name)}


def imported_names(module: str, path: Path) -> list[str]:
    """The modules that ``path``'s import statements name, at any depth (function-level imports too),
    relative imports resolved against ``module``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def test_the_tools_are_a_package_of_their_own():
    tools = modules_in(TOOLS, REPO / "cute_ep" / "tools")
    assert set(tools) == {TOOLS, *(f"{TOOLS}.{m}" for m in TOOL_MODULES)}
    for old in TOOL_MODULES:
        assert not (REPO / "cute_ep" / f"{old}.py").exists(), f"cute_ep/{old}.py: it lives in cute_ep/tools/"


def test_no_library_source_imports_the_tools():
    modules = library_modules()
    assert {"cute_ep.api", "cute_ep.kernels.config", "cute_ep.bootstrap.runtime",
            "cute_ep.validators.checks", "cute_ep.deep_ep.buffer"} <= set(modules)  # fmt: skip
    bad = {}
    for name, path in modules.items():
        tools = sorted({n for n in imported_names(name, path) if is_tools(n)})
        if tools:
            bad[name] = tools
    assert not bad, f"library modules import {TOOLS} (the tools import the library, not back): {bad}"


def test_importing_every_library_module_imports_no_tool():
    """Each library module imported in one fresh interpreter: none of them brings in cute_ep.tools (the
    static check above misses an import that a string names, e.g. importlib.import_module)."""
    lines = [f"importlib.import_module({m!r})" for m in sorted(library_modules())]
    code = "\n".join(["import importlib", *lines])
    tools = [TOOLS, *(f"{TOOLS}.{m}" for m in TOOL_MODULES)]
    assert_imports_none(code, tools, timeout=180)
