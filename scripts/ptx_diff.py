"""Compare the EP module's PTX between two versions of the kernel sources, function by function.

Why: a change under kernels/ that should not change what the GPU does (a move, a rename, a helper, a typed
view instead of address arithmetic) can be checked on a machine without a GPU: compile the module for sm_90
before and after, and compare. Each function (entry point or device function) is reported as

    identical   the same text once entry-point suffixes, block labels and call-site numbers are
                normalized (they follow the order of launch sites, not the code);
    same counts the same count of every instruction, but the text differs: register numbers and order,
                or operands (an offset, a constant): read those functions' diff;
    changed     the instructions whose counts differ, before -> after;

plus the functions only one side has. Exit status 0 when every function is identical, 1 otherwise (read
the report: a change may be the point), 2 for bad arguments.

To run (a CPU is enough; about a minute per compile on two cores):
    python scripts/ptx_diff.py --dump before.ptx        # this checkout's bf16 module for sm_90
    # ... change kernels/ ...
    python scripts/ptx_diff.py --dump after.ptx
    python scripts/ptx_diff.py before.ptx after.ptx
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_FUNCTION_START = re.compile(r"(?m)^(?=\.visible \.entry|\.func|\.visible \.func|\.weak \.func)")
_FUNCTION_NAME = re.compile(r"(?:\.visible \.entry|\.func|\.visible \.func|\.weak \.func)[^\n]*?(\w+)\(")
# An entry point's name ends with the index of its launch site: after the DSL's argument signature in
# its default names, after ``...EvE6kernel`` in the names profilers read (kernels/naming.py).
_ENTRY_SUFFIX = re.compile(r"(kernel_cutlass_kernel_\w+?Kernel)_object_at_\w*?_\d+\b"
                           r"|(_ZZN7cute_ep\d+\w+?EvE6kernel)_\d+\b")
# an opcode with every modifier, "::" ones too: st.global.L1::no_allocate.v4.b32 is not st.global.L1
_INSTRUCTION = re.compile(r"(?m)^\s*([a-z]+(?:(?:\.|::)\w+)*)")


def normalize(ptx: str) -> str:
    """``ptx`` without what only follows the order of functions in the file: entry-point suffixes, block
    label numbers, call-sequence and prototype numbers and the ``.globl`` comments."""
    ptx = _ENTRY_SUFFIX.sub(lambda m: m.group(1) or m.group(2), ptx)
    ptx = re.sub(r"\$L__BB\d+_", "$L__BB_", ptx)
    ptx = re.sub(r"callseq \d+", "callseq", ptx)
    ptx = re.sub(r"prototype_\d+", "prototype", ptx)
    return re.sub(r"(?m)^\s*// \.globl.*\n", "", ptx)


def functions(ptx: str) -> dict[str, str]:
    """Normalized text of each function by name ("<header>" for what precedes the first). Kernels compiled
    under one name (a kernel and its receiving half) are told apart by their order: the second one of a
    name is ``<name>#2``."""
    out: dict[str, str] = {}
    for part in _FUNCTION_START.split(normalize(ptx)):
        m = _FUNCTION_NAME.match(part)
        name = m.group(1) if m else "<header>"
        key, n = name, 1
        while key in out:
            n += 1
            key = f"{name}#{n}"
        out[key] = part
    return out


def instruction_counts(text: str) -> Counter:
    """How often each instruction (opcode with its modifiers, e.g. ``st.global.v4.b32``) occurs."""
    return Counter(_INSTRUCTION.findall(text))


@dataclass(frozen=True)
class FunctionDiff:
    name: str
    verdict: str  # "identical", "same counts", "changed", "only before", "only after"
    changes: dict[str, tuple[int, int]]  # instruction -> (count before, count after), for "changed"


def compare(before: str, after: str) -> list[FunctionDiff]:
    """One ``FunctionDiff`` per function of either side, in the order of ``before`` then new ones."""
    a, b = functions(before), functions(after)
    out = []
    for name in [*a, *(n for n in b if n not in a)]:
        if name not in b:
            out.append(FunctionDiff(name, "only before", {}))
        elif name not in a:
            out.append(FunctionDiff(name, "only after", {}))
        elif a[name] == b[name]:
            out.append(FunctionDiff(name, "identical", {}))
        else:
            ca, cb = instruction_counts(a[name]), instruction_counts(b[name])
            changes = {op: (ca[op], cb[op]) for op in sorted(set(ca) | set(cb)) if ca[op] != cb[op]}
            out.append(FunctionDiff(name, "changed" if changes else "same counts", changes))
    return out


def short_name(name: str) -> str:
    """The kernel of an entry point (``DispatchKernel``, or ``cute_ep::dispatch`` for the names profilers
    read), else the name itself."""
    name, hash_, n = name.partition("#")
    m = re.search(r"([A-Z]\w*Kernel)$", name)
    if m:
        return m.group(1) + hash_ + n
    m = re.fullmatch(r"_ZZN7cute_ep\d+(\w+?)EvE6kernel", name)
    return (f"cute_ep::{m.group(1)}" if m else name) + hash_ + n


def report(diffs: list[FunctionDiff]) -> str:
    counts = Counter(d.verdict for d in diffs)
    lines = [f"{len(diffs)} functions: " + ", ".join(f"{counts[v]} {v}" for v in
                                                     ("identical", "same counts", "changed", "only before",
                                                      "only after") if counts[v])]
    for d in diffs:
        if d.verdict != "identical":
            lines.append(f"  {short_name(d.name)}: {d.verdict}")
            lines += [f"      {op}: {x} -> {y}" for op, (x, y) in d.changes.items()]
    return "\n".join(lines)


def dump(path: Path) -> None:
    """Compile this checkout's bf16 EP module for sm_90 (no GPU needed) and write its PTX to ``path``."""
    import torch

    from cute_ep.bootstrap.compile import compile_kernel, ptx_options, use_cpu_target
    from cute_ep.kernels.config import EpConfig
    from cute_ep.kernels.host import build

    use_cpu_target()
    cfg = EpConfig(world_size=2, local_world_size=2, num_experts=8, topk=2, hidden=256, dtype=torch.bfloat16,
                   max_tokens=64, num_sms=8)
    fn, args = build(cfg)
    # ptxas at its fastest: the PTX is made before it runs, and its machine code is not compared here.
    with tempfile.TemporaryDirectory() as folder:
        compiled = compile_kernel(fn, *args, options=ptx_options(folder, fast_ptxas=True))
        path.write_text(compiled.artifacts.PTX)


def main(argv: list[str]) -> int:
    from cute_ep.tools.usage import script_parser

    p = script_parser(__doc__)
    p.add_argument("files", nargs="*", metavar="PTX", help="two PTX files to compare: before, after")
    p.add_argument("--dump", metavar="PATH", help="compile this checkout's module and write its PTX here")
    args = p.parse_args(argv)
    if args.dump:
        if args.files:
            p.error("--dump takes no PTX files to compare")
        dump(Path(args.dump))
        print(f"wrote {args.dump}")
        return 0
    if len(args.files) != 2:
        p.error(f"give two PTX files (before, after) or --dump PATH, got {len(args.files)} files")
    texts = []
    for f in args.files:
        if not Path(f).is_file():
            p.error(f"no such PTX file: {f}")
        texts.append(Path(f).read_text())
    diffs = compare(*texts)
    print(report(diffs))
    return 0 if all(d.verdict == "identical" for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
