"""Render docs/api.md, the API reference, from the docstrings of the public API.

To run:
    python scripts/gen_api_docs.py              # (re)write docs/api.md
    python scripts/gen_api_docs.py --check      # is docs/api.md up to date? (writes nothing)
    python scripts/gen_api_docs.py --out FILE   # another file (with or without --check)

What it documents: every name ``cute_ep.__all__`` exports, ``cute_ep.bootstrap.Runtime`` and
``cute_ep.bootstrap.DistEnv``, and ``cute_ep.deep_ep``'s ``Buffer``, ``Config`` and ``EventOverlap``. For each
class: its signature (or, for a dataclass, a table of its fields), its docstring, the docstring of the
module that defines it (the first time that module appears), and every public method and property defined
in cute-ep's own classes (those it inherits from torch or from ``Exception`` are left out). A name that
``cute_ep.__all__`` gains later and no section below names lands under "Other exports", so the reference
stays complete. Importing these modules needs no GPU.

Exit status: 0 written, or up to date with --check; 1 out of date with --check (a summary of the
differences on stdout); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "api.md"
EXIT_OK = 0
EXIT_STALE = 1
SIGNATURE_WIDTH = 100  # longer signatures are written one parameter per line
DIFF_LINES = 40  # most lines of the unified diff --check prints

# (section title, a sentence, the documented objects: dotted paths "module:attribute" or "module" alone)
SECTIONS: list[tuple[str, str, list[str]]] = [
    ("Configuration", "One configuration per buffer; every rank builds the same one.",
     ["cute_ep.kernels.config:EpConfig"]),
    ("Buffers: one interface, three backends",
     "Every call is collective: every rank makes the same sequence of calls with the same options.",
     ["cute_ep.api:EpBackend", "cute_ep.buffer:EpBuffer", "cute_ep.reference_backend:ReferenceEpBuffer",
      "cute_ep.a2a_backend:A2aEpBuffer"]),
    ("What a dispatch returns", "Views into the buffer, valid until the next dispatch.",
     ["cute_ep.api:DispatchResult", "cute_ep.api:DispatchHandle"]),
    ("Errors", "The exceptions `cute_ep` exports. Invalid arguments to a call raise `ValueError`, whose "
     "message names the constraint and the value.",
     ["cute_ep.kernels.config:ConfigError", "cute_ep.status:PeerTimeout", "cute_ep.status:CapacityExceeded",
      "cute_ep.status:KernelDidNotRun"]),
    ("Launching: the runtime", "torch.distributed (and NVSHMEM on GPUs) for one process of a launch.",
     ["cute_ep.bootstrap.runtime:Runtime", "cute_ep.bootstrap.dist_env:DistEnv"]),
    ("Training: differentiable dispatch and combine", "", ["cute_ep.autograd"]),
    ("The MoE layer", "", ["cute_ep.moe_layer:MoELayer", "cute_ep.moe_layer:RouterConfig",
                           "cute_ep.swiglu:offset_swiglu"]),
    ("Hot experts", "Static replication and cloning every step.",
     ["cute_ep.replication:ReplicaMap", "cute_ep.elastic:ElasticExperts"]),
    ("DeepEP's API: cute_ep.deep_ep", "",
     ["cute_ep.deep_ep", "cute_ep.deep_ep.buffer:Buffer", "cute_ep.deep_ep.utils:Config",
      "cute_ep.deep_ep.utils:EventOverlap"]),
]  # fmt: skip

# How a documented object is named in the reference (its import path for users).
PUBLIC_NAMES = {
    "cute_ep.bootstrap.runtime:Runtime": "cute_ep.bootstrap.Runtime",
    "cute_ep.bootstrap.dist_env:DistEnv": "cute_ep.bootstrap.DistEnv",
    "cute_ep.deep_ep.buffer:Buffer": "cute_ep.deep_ep.Buffer",
    "cute_ep.deep_ep.utils:Config": "cute_ep.deep_ep.Config",
    "cute_ep.deep_ep.utils:EventOverlap": "cute_ep.deep_ep.EventOverlap",
}
# Objects whose docstring opens with a detail: the overview table takes their module's first line.
SUMMARY_FROM_MODULE = {"cute_ep.replication:ReplicaMap"}
MODULE_MEMBERS = {"cute_ep.autograd": ["dispatch", "combine"]}  # module -> its functions documented here
VERSION_NOTE = "the package version, a string (`cute_ep/_version.py`)."


class _Annotation:
    """An annotation written as its source text (``from __future__ import annotations`` keeps them as
    strings, which ``inspect`` would otherwise print quoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(annotation: Any) -> Any:
    return _Annotation(annotation) if isinstance(annotation, str) else annotation


def load(path: str) -> Any:
    """The object at ``module:attribute`` (or the module itself)."""
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def public_name(path: str) -> str:
    if path in PUBLIC_NAMES:
        return PUBLIC_NAMES[path]
    module_name, _, attr = path.partition(":")
    if not attr:
        return module_name
    import cute_ep

    return f"cute_ep.{attr}" if attr in cute_ep.__all__ else f"{module_name}.{attr}"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than ``-`` and ``_`` dropped,
    spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def doc_of(obj: Any) -> str:
    """The object's own docstring, cleaned (none inherited: an undocumented override says nothing)."""
    raw = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if not raw or (
        inspect.isclass(obj) and dataclasses.is_dataclass(obj) and raw.startswith(obj.__name__ + "(")
    ):
        return ""  # nothing, or the signature dataclasses writes when a class has no docstring
    return "\n".join(line.rstrip() for line in inspect.cleandoc(raw).splitlines())


def first_line(text: str) -> str:
    """The docstring's first paragraph on one line, fit for a table cell."""
    para = text.split("\n\n", 1)[0]
    return " ".join(para.split()).replace("|", "\\|")


def text_block(text: str) -> list[str]:
    return ["```text", *text.splitlines(), "```", ""] if text else []


def signature(name: str, obj: Any, *, drop_first: bool = False) -> str | None:
    """``name(params) -> ret`` with annotations as written in the source, or None (no signature)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if drop_first and params and params[0].name in ("self", "cls"):
        params = params[1:]
    params = [p.replace(annotation=_plain(p.annotation)) for p in params]
    sig = sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation))
    one_line = f"{name}{sig}"
    if len(one_line) <= SIGNATURE_WIDTH:
        return one_line
    ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {sig.return_annotation!r}"
    marked, prev = [], None
    for p in sig.parameters.values():
        if prev is inspect.Parameter.POSITIONAL_ONLY and p.kind is not prev:
            marked.append("/")
        if p.kind is inspect.Parameter.KEYWORD_ONLY and prev not in (p.KEYWORD_ONLY, p.VAR_POSITIONAL):
            marked.append("*")
        marked.append(str(p))
        prev = p.kind
    if prev is inspect.Parameter.POSITIONAL_ONLY:
        marked.append("/")
    return f"{name}(\n" + "".join(f"    {m},\n" for m in marked) + f"){ret}"


def source_link(obj: Any) -> str:
    try:
        path = Path(inspect.getsourcefile(obj)).resolve().relative_to(REPO)
    except (TypeError, ValueError):
        return ""
    return f"[`{path.as_posix()}`](../{path.as_posix()})"


def project_classes(cls: type) -> list[type]:
    """``cls`` and its bases that belong to cute-ep, in method resolution order."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "cute_ep"]


def members(cls: type) -> list[tuple[str, type, Any]]:
    """Public (name, owner, attribute) of ``cls`` from cute-ep's classes: the class's own first, in the
    order of its source, then each base's; dataclass fields left out (the fields table has them)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    seen: set[str] = set()
    found = []
    for owner in project_classes(cls):
        for name, attr in vars(owner).items():
            if name.startswith("_") or name in seen or name in fields:
                continue
            seen.add(name)
            found.append((name, owner, attr))
    return found


def render_member(cls: type, name: str, attr: Any) -> list[str]:
    label = f"{cls.__name__}.{name}"
    if isinstance(attr, property):
        ret = inspect.signature(attr.fget).return_annotation if attr.fget else inspect.Signature.empty
        kind = "property" + ("" if ret is inspect.Signature.empty else f" -> {_plain(ret)!r}")
        out = [f"**`{label}`** ({kind})", ""]
        return out + text_block(doc_of(attr.fget) if attr.fget else "")
    if isinstance(attr, (classmethod, staticmethod)):
        func = attr.__func__
        kind = type(attr).__name__
        sig = signature(label, func, drop_first=isinstance(attr, classmethod))
        return [
            f"**`{label}`** ({kind})",
            "",
            "```python",
            sig or label,
            "```",
            "",
            *text_block(doc_of(func)),
        ]
    if inspect.isfunction(attr):
        sig = signature(label, attr, drop_first=True)
        return [f"**`{label}`**", "", "```python", sig or label, "```", "", *text_block(doc_of(attr))]
    value = repr(attr)
    if len(value) > 80 or re.search(r"0x[0-9a-f]{4,}", value):
        value = type(attr).__name__
    return [f"**`{label}`** = `{value}`", ""]


def fields_table(cls: type) -> list[str]:
    frozen = cls.__dataclass_params__.frozen
    out = [f"A {'frozen ' if frozen else ''}dataclass. Fields, in order:", "",
           "| field | type | default |", "|---|---|---|"]  # fmt: skip
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:
            default = "a new one"
        else:
            default = "required"
        ann = f.type if isinstance(f.type, str) else inspect.formatannotation(f.type)
        out.append(f"| `{f.name}` | `{ann}` | {default} |")
    return [*out, ""]


class Renderer:
    def __init__(self) -> None:
        self.modules_shown: set[str] = set()

    def module_doc(self, module_name: str, *, heading: bool = True) -> list[str]:
        if module_name in self.modules_shown:
            return []
        self.modules_shown.add(module_name)
        module = importlib.import_module(module_name)
        text = doc_of(module)
        if not text:
            return []
        label = (
            [f"From the docstring of the module `{module_name}` ({source_link(module)}):", ""]
            if heading
            else []
        )
        return [*label, *text_block(text)]

    def render_class(self, path: str, cls: type) -> list[str]:
        name = public_name(path)
        out = [f"### `{name}`", ""]
        where = source_link(cls)
        bases = [b for b in cls.__bases__ if b is not object]
        facts = [f"Defined in {where}." if where else ""]
        if issubclass(cls, BaseException):
            facts.append("Subclass of " + ", ".join(f"`{b.__name__}`" for b in bases) + ".")
        if hasattr(cls, "__enter__") and hasattr(cls, "__exit__"):
            facts.append("A context manager.")
        out += [" ".join(f for f in facts if f), ""]
        if dataclasses.is_dataclass(cls):
            out += fields_table(cls)
        else:
            sig = signature(cls.__name__, cls)
            if sig and not sig.endswith("(*args, **kwargs)"):
                out += ["```python", sig, "```", ""]
        out += text_block(doc_of(cls))
        out += self.module_doc(cls.__module__)
        listed = members(cls)
        if listed:
            out += [f"#### `{cls.__name__}`: methods and properties", ""]
            for member_name, _owner, attr in listed:
                out += render_member(cls, member_name, attr)
        return out

    def render_function(self, path: str, func: Any) -> list[str]:
        name = public_name(path)
        where = source_link(func)
        out = [f"### `{name}`", "", *([f"Defined in {where}.", ""] if where else [])]
        out += ["```python", signature(func.__name__, func) or func.__name__, "```", ""]
        out += text_block(doc_of(func))
        return out + self.module_doc(func.__module__)

    def render_module(self, module_name: str) -> list[str]:
        module = importlib.import_module(module_name)
        where = source_link(module)
        out = [f"### `{module_name}`", "", *([f"Defined in {where}.", ""] if where else [])]
        out += self.module_doc(module_name, heading=False)
        for fname in MODULE_MEMBERS.get(module_name, []):
            func = getattr(module, fname)
            out += [
                f"**`{module_name}.{fname}`**",
                "",
                "```python",
                signature(fname, func) or fname,
                "```",
                "",
            ]
            out += text_block(doc_of(func))
        return out

    def render_object(self, path: str) -> list[str]:
        obj = load(path)
        if inspect.ismodule(obj):
            return self.render_module(path)
        if inspect.isclass(obj):
            return self.render_class(path, obj)
        return self.render_function(path, obj)


def sections() -> list[tuple[str, str, list[str]]]:
    """SECTIONS plus "Other exports" for names of ``cute_ep.__all__`` that no section lists."""
    import cute_ep

    placed = {public_name(p) for _, _, paths in SECTIONS for p in paths}
    extra = []
    for export in cute_ep.__all__:
        if export in ("__version__",) or f"cute_ep.{export}" in placed:
            continue
        obj = getattr(cute_ep, export)
        extra.append(obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}:{export}")
    return SECTIONS + ([("Other exports", "", extra)] if extra else [])


def render() -> str:
    """docs/api.md as it should read now."""
    import cute_ep

    secs = sections()
    renderer = Renderer()
    lines = [
        "# API reference",
        "",
        "<!-- Generated by scripts/gen_api_docs.py from the docstrings. Do not edit by hand: edit the",
        "     docstrings, then run `python scripts/gen_api_docs.py`. -->",
        "",
        "Every name `cute_ep` exports (`cute_ep.__all__`), the runtime that starts a launch",
        "(`cute_ep.bootstrap`) and the DeepEP-compatible front (`cute_ep.deep_ep`), rendered from their",
        'docstrings. The README\'s "Using it from Python" shows them working together.',
        "",
        "| name | what it is |",
        "|---|---|",
    ]
    for _title, _intro, paths in secs:
        for path in paths:
            name = public_name(path)
            heading = f"`{name}`"
            source = (
                importlib.import_module(path.split(":")[0]) if path in SUMMARY_FROM_MODULE else load(path)
            )
            lines.append(f"| [`{name}`](#{slug(heading)}) | {first_line(doc_of(source))} |")
    lines.append(f"| `cute_ep.__version__` | {VERSION_NOTE} |")
    exported = [n for n in cute_ep.__all__]
    lines += ["", "`cute_ep.__all__`: " + ", ".join(f"`{n}`" for n in exported) + ".", ""]
    for title, intro, paths in secs:
        lines += [f"## {title}", ""]
        if intro:
            lines += [intro, ""]
        for path in paths:
            lines += renderer.render_object(path)
    text = "\n".join(lines).rstrip("\n") + "\n"
    if re.search(r" at 0x[0-9a-f]+", text):  # an object's address would change from run to run
        raise RuntimeError("the rendered reference holds an object address; give that default a stable repr")
    return text


def diff_summary(old: str, new: str, path: Path) -> str:
    """What --check prints: counts, the sections that changed, and the start of the unified diff."""
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{path} (committed)",
                                     f"{path} (from the docstrings)", lineterm="", n=1))  # fmt: skip
    added = sum(1 for ln in diff if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in diff if ln.startswith("-") and not ln.startswith("---"))
    changed_headings = []
    heading = "(top)"
    new_lines = new.splitlines()
    old_set = set(old.splitlines())
    for ln in new_lines:
        if ln.startswith(("## ", "### ")):
            heading = ln.lstrip("#").strip()
        if ln not in old_set and heading not in changed_headings:
            changed_headings.append(heading)
    out = [f"{path} is out of date: {added} line(s) to add, {removed} to remove."]
    if changed_headings:
        out.append("Changed: " + ", ".join(changed_headings))
    out += diff[:DIFF_LINES]
    if len(diff) > DIFF_LINES:
        out.append(f"... ({len(diff) - DIFF_LINES} more diff lines)")
    out.append("Run: python scripts/gen_api_docs.py")
    return "\n".join(out)


def shown(path: Path) -> str:
    """``path`` as the user named it, relative to the working folder where it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with a summary when the file differs from a fresh render",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the file (default: docs/api.md)")
    args = parser.parse_args(argv)
    new = render()
    if args.check:
        old = args.out.read_text() if args.out.is_file() else ""
        if old == new:
            print(f"{shown(args.out)} is up to date.")
            return EXIT_OK
        print(
            diff_summary(old, new, Path(shown(args.out)))
            if old
            else f"{shown(args.out)} does not exist. Run: python scripts/gen_api_docs.py"
        )
        return EXIT_STALE
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(new)
    print(f"wrote {shown(args.out)} ({len(new.splitlines())} lines)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
