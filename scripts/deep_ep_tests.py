"""Run DeepEP's own tests on DeepEP and, import swapped, on ``cute_ep.deep_ep``, and write what they print
side by side into one report: ``baselines/perf/<gpu>x<N>_deep_ep_tests.json`` (and a ``.png`` with
``--plot``).

DeepEP's ``tests/test_intranode.py`` (normal mode: its layout kernel time and its tuned BF16 / FP8 dispatch
and combine times) and ``tests/test_low_latency.py`` (the low-latency dispatch + combine pair and, from
its profiler, each kernel's time) run unchanged from a DeepEP source tree, once with DeepEP's ``deep_ep``
and once with a one-line ``deep_ep.py`` that re-exports ``cute_ep.deep_ep`` first on ``PYTHONPATH``
(docs/deep_ep.md). Each run's output is kept in ``--log-dir`` (``<test>_<module>_ep<N>.log``, with its exit
status in ``.rc``); a run whose log and status are there already is read, not run again (``--rerun`` runs
it again), so the runs of one report may come from several commands on one host.

    # a GPU host with DeepEP v1.2.1 built in /tmp/deepep (intranode) and /tmp/deepep-ll (with NVSHMEM):
    python scripts/deep_ep_tests.py --deepep /tmp/deepep --deepep-ll /tmp/deepep-ll --num-processes 4
    # DeepEP's low-latency kernels start their own NVSHMEM: where that must run before this project's
    # NVSHMEM is installed, run that part first and keep its log, then the rest:
    python scripts/deep_ep_tests.py --deepep /tmp/deepep-ll --num-processes 4 --tests low_latency \\
        --modules deep_ep --no-report
    # render a report's plot (needs matplotlib; any machine):
    python scripts/deep_ep_tests.py --plot baselines/perf/h200x4_deep_ep_tests.json

What a line holds: DeepEP's own printed value for each module and their ratio (ours / DeepEP's; below 1
is faster). ``test_intranode.py`` prints its lines from rank 0 only (its timings are rank 0's);
``test_low_latency.py`` prints every rank's, and the report keeps the slowest rank's. A value a run did not
print (a failed run, or a profiler line that found no kernel of that name) is null, beside the run's exit
status and the last lines of its output. Exit status: 0 when every run exited 0, 1 otherwise, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = ("intranode", "low_latency")
MODULES = ("deep_ep", "cute_ep")
SHIM = "from cute_ep.deep_ep import *  # noqa: F403\n"

# (test, line name, regex, group, scale to us, how: "rank 0" or "slowest rank")
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
LINES = (
    ("intranode", "[layout] Kernel performance", rf"^\[layout\] Kernel performance: {_NUM} ms", 1, 1000.0,
     "rank 0"),
    ("intranode", "[tuning] Best dispatch (BF16)", rf"^\[tuning\] Best dispatch \(BF16\):.* t: {_NUM} us", 1,
     1.0, "rank 0"),
    ("intranode", "[tuning] Best dispatch (FP8)", rf"^\[tuning\] Best dispatch \(FP8\):.* t: {_NUM} us", 1,
     1.0, "rank 0"),
    ("intranode", "[tuning] Best combine", rf"^\[tuning\] Best combine:.* t: {_NUM} us", 1, 1.0, "rank 0"),
    ("low_latency", "dispatch + combine (bench avg_t)",
     rf"^\[rank \d+\] Dispatch \+ combine bandwidth: .*avg_t={_NUM} us", 1, 1.0, "slowest rank"),
    ("low_latency", "dispatch kernel (bench_kineto avg_t)",
     rf"^\[rank \d+\] Dispatch bandwidth: .*avg_t={_NUM} us \| Combine bandwidth", 1, 1.0, "slowest rank"),
    ("low_latency", "combine kernel (bench_kineto avg_t)",
     rf"^\[rank \d+\] Dispatch bandwidth: .*\| Combine bandwidth: .*avg_t={_NUM} us", 1, 1.0, "slowest rank"),
    ("low_latency", "dispatch send (return_recv_hook)",
     rf"^\[rank \d+\] Dispatch send/recv time: {_NUM} \+ {_NUM} us", 1, 1.0, "slowest rank"),
    ("low_latency", "dispatch recv (return_recv_hook)",
     rf"^\[rank \d+\] Dispatch send/recv time: {_NUM} \+ {_NUM} us", 2, 1.0, "slowest rank"),
    ("low_latency", "combine send (return_recv_hook)",
     rf"\| Combine send/recv time: {_NUM} \+ {_NUM} us", 1, 1.0, "slowest rank"),
    ("low_latency", "combine recv (return_recv_hook)",
     rf"\| Combine send/recv time: {_NUM} \+ {_NUM} us", 2, 1.0, "slowest rank"),
)
# test_intranode.py prints "[testing] Running with ... ..." and then " passed" on the same line per check.
_CHECK = re.compile(r"^\[testing\] Running with .*\.\.\.( passed)?")


class UsageError(Exception):
    """Bad arguments: printed with the fix, exit status 2."""


def parse_values(test: str, text: str) -> dict[str, float | None]:
    """Each report line of ``test`` found in a run's output ``text``: its value in us (the slowest rank's
    where every rank prints it), or None where the output has no such line."""
    out: dict[str, float | None] = {}
    for t, name, pattern, group, scale, _ in LINES:
        if t != test:
            continue
        found = [float(m.group(group)) * scale for m in re.finditer(pattern, text, re.MULTILINE)]
        out[name] = max(found) if found else None
    return out


def count_checks(test: str, text: str) -> dict[str, int] | None:
    """test_intranode.py's correctness checks: how many ran and passed (None for the other test, whose
    checks are assertions: its exit status says)."""
    if test != "intranode":
        return None
    lines = [m for m in (_CHECK.match(line) for line in text.splitlines()) if m]
    return {"run": len(lines), "passed": sum(1 for m in lines if m.group(1))}


def build_report(runs: dict[str, dict[str, dict]], *, gpu: str, num_gpus: int, commit: str, date: str,
                 deepep_version: str) -> dict:
    """The report from ``runs[test][module]`` = {"command", "rc", "text"} (one entry per run made)."""
    parsed = {(test, m): parse_values(test, r["text"]) for test, by in runs.items() for m, r in by.items()}
    lines = []
    for test, name, _, _, _, how in LINES:
        if test not in runs:
            continue
        values = {m: parsed[test, m][name] if (test, m) in parsed else None for m in MODULES}
        ratio = None
        if values["deep_ep"] and values["cute_ep"] is not None:
            ratio = round(values["cute_ep"] / values["deep_ep"], 3)
        line = {"test": test, "line": name, "unit": "us", "how": how, **values, "ratio": ratio}
        lines.append(line)
    return {
        "what": "DeepEP's own tests/test_intranode.py and tests/test_low_latency.py, unchanged, run on "
                "DeepEP and (import swapped) on cute_ep.deep_ep on one host; each line's value as the test "
                "prints it, ratio = cute_ep / deep_ep (below 1: faster)",
        "gpu": gpu, "num_gpus": num_gpus, "commit": commit, "date": date, "deep_ep_version": deepep_version,
        "runs": {test: {m: {"command": r["command"], "rc": r["rc"], "checks": count_checks(test, r["text"]),
                            "tail": r["text"].splitlines()[-8:]}
                        for m, r in by_module.items()} for test, by_module in runs.items()},
        "lines": lines,
    }


def check_report(report: dict) -> list[str]:
    """What makes ``report`` incomplete (empty when it is whole): both modules' runs of every test in it,
    one machine and commit, each line with both values and its ratio."""
    problems = []
    for key in ("gpu", "num_gpus", "commit", "date", "deep_ep_version"):
        if not report.get(key):
            problems.append(f"no {key}")
    for test in TESTS:
        for m in MODULES:
            run = report.get("runs", {}).get(test, {}).get(m)
            if run is None:
                problems.append(f"no {test} run on {m}")
            elif run["rc"] != 0:
                problems.append(f"{test} on {m} exited {run['rc']}")
    for line in report.get("lines", []):
        missing = [m for m in MODULES if line[m] is None]
        if missing:
            problems.append(f"{line['test']} {line['line']!r}: no value from {', '.join(missing)}")
        elif line["ratio"] != round(line["cute_ep"] / line["deep_ep"], 3):
            problems.append(f"{line['test']} {line['line']!r}: ratio {line['ratio']} is not "
                            "cute_ep / deep_ep")
    return problems


def gpu_name() -> tuple[str, int]:
    """This host's GPU model (e.g. "H200") and how many GPUs it has, from nvidia-smi."""
    names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    names = [n.strip() for n in names if n.strip()]
    model = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", names[0])
    return (model.group(1) if model else names[0]), len(names)


def commit_of_checkout() -> str:
    """This checkout's commit (short), with "+changes" when the tracked files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    return head.stdout.strip() + ("+changes" if dirty else "")


def log_of(test: str, module: str, num_processes: int, log_dir: Path) -> Path:
    """Where a run's output is kept (its exit status beside it, ``.rc``)."""
    return log_dir / f"{test}_{module}_ep{num_processes}.log"


def kept_run(test: str, module: str, num_processes: int, log_dir: Path) -> dict | None:
    """A run an earlier command made and kept in ``log_dir``, or None."""
    log = log_of(test, module, num_processes, log_dir)
    if not (log.exists() and log.with_suffix(".rc").exists()):
        return None
    print(f"[deep_ep_tests] {test} on {module}: reading {log} (kept from an earlier run)", flush=True)
    rc = int(log.with_suffix(".rc").read_text())
    return {"command": f"(kept) {log}", "rc": rc, "text": log.read_text()}


def run_one(test: str, module: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """One run of DeepEP's ``test`` on ``module`` (or its log, when kept from an earlier command and not
    ``--rerun``)."""
    kept = None if args.rerun else kept_run(test, module, args.num_processes, log_dir)
    if kept is not None:
        return kept
    log = log_of(test, module, args.num_processes, log_dir)
    rc_file = log.with_suffix(".rc")
    tree = Path(args.deepep_ll if (test == "low_latency" and module == "deep_ep" and args.deepep_ll)
                else args.deepep)
    cmd = [sys.executable, f"test_{test}.py", "--num-processes", str(args.num_processes), *args.test_args]
    env = dict(os.environ)
    if module == "cute_ep":
        shim = log_dir / "shim"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "deep_ep.py").write_text(SHIM)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), env.get("PYTHONPATH", "")])
        env.setdefault("CUTE_EP_DEEP_EP_SYMMETRIC_BYTES", "4G")  # DeepEP's tests ask 1 GB of NVLink buffer
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    shown = f"cd {tree / 'tests'} && PYTHONPATH=<{module}> {' '.join(cmd[1:])}"
    print(f"[deep_ep_tests] {test} on {module}: {shown} (output: {log})", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=tree / "tests", env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n[deep_ep_tests] killed after {args.timeout} s\n"
    log.write_text(text)
    rc_file.write_text(str(rc))
    print(f"[deep_ep_tests] {test} on {module}: exit status {rc}", flush=True)
    return {"command": shown, "rc": rc, "text": text}


def plot(report_path: Path, png: Path) -> None:
    """One bar pair per line (DeepEP's time and ours), both tests, into ``png``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    report = json.loads(report_path.read_text())
    lines = [ln for ln in report["lines"] if ln["deep_ep"] is not None or ln["cute_ep"] is not None]
    fig = Figure(figsize=(10, 0.5 * len(lines) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ys = range(len(lines))
    for off, m, color in ((-0.2, "deep_ep", "tab:gray"), (0.2, "cute_ep", "tab:blue")):
        ax.barh([y + off for y in ys], [ln[m] or 0.0 for ln in lines], height=0.4, label=m, color=color)
    ax.set_yticks(list(ys), [f"{ln['test']}: {ln['line']}" for ln in lines], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us (as DeepEP's tests print; lower is faster)")
    ax.set_title(f"DeepEP's tests, {report['gpu']} x{report['num_gpus']}, {report['commit']}, "
                 f"{report['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepep", help="a DeepEP source tree whose deep_ep imports (its tests/ run from there)")
    p.add_argument("--deepep-ll", default="", help="the tree for DeepEP's low-latency test, when another "
                   "(DeepEP built with NVSHMEM); default: --deepep")
    p.add_argument("--num-processes", type=int, default=0, help="ranks (one per GPU), as DeepEP's tests take")
    p.add_argument("--tests", default=",".join(TESTS), help=f"comma-separated, of {', '.join(TESTS)}")
    p.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of {', '.join(MODULES)}")
    p.add_argument("--log-dir", default="/tmp/deep_ep_tests", help="each run's output and exit status")
    p.add_argument("--rerun", action="store_true", help="run again where a log is kept")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run (default 900)")
    p.add_argument("--out", default="",
                   help="the report (default baselines/perf/<gpu>x<N>_deep_ep_tests.json)")
    p.add_argument("--no-report", action="store_true", help="run and keep the logs only")
    p.add_argument("--deepep-version", default="v1.2.1", help="recorded in the report")
    p.add_argument("--plot", default="", help="render this report's .png beside it, and nothing else")
    p.add_argument("test_args", nargs="*",
                   help="after --: passed to DeepEP's test (e.g. -- --num-tokens 2048)")
    args = p.parse_args(argv)
    if args.plot:
        return args
    args.tests = [t for t in args.tests.split(",") if t]
    args.modules = [m for m in args.modules.split(",") if m]
    bad = [t for t in args.tests if t not in TESTS] + [m for m in args.modules if m not in MODULES]
    if bad:
        raise UsageError(f"unknown test or module {bad}: --tests takes {', '.join(TESTS)}, --modules "
                         f"{', '.join(MODULES)}")
    if not args.deepep or not (Path(args.deepep) / "tests" / "test_intranode.py").exists():
        raise UsageError(f"--deepep must be a DeepEP source tree with tests/test_intranode.py, got "
                         f"{args.deepep!r}; build one with DeepEP's setup.py (docs/deep_ep.md)")
    if args.num_processes < 1:
        raise UsageError(f"--num-processes must be >= 1 (ranks, one per GPU), got {args.num_processes}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"deep_ep_tests.py: {e}", file=sys.stderr)
        return 2
    if args.plot:
        report = Path(args.plot)
        plot(report, report.with_suffix(".png"))
        print(f"wrote {report.with_suffix('.png')}")
        return 0
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, dict]] = {}
    for test in args.tests:
        for module in args.modules:
            runs.setdefault(test, {})[module] = run_one(test, module, args, log_dir)
    status = 0 if all(r["rc"] == 0 for by in runs.values() for r in by.values()) else 1
    if args.no_report:
        return status
    # Runs kept from an earlier command (e.g. DeepEP's low-latency test before this project's NVSHMEM)
    # join the report where their logs are in --log-dir.
    for test in TESTS:
        for module in MODULES:
            if module not in runs.get(test, {}):
                kept = kept_run(test, module, args.num_processes, log_dir)
                if kept is not None:
                    runs.setdefault(test, {})[module] = kept
    gpu, count = gpu_name()
    report = build_report(runs, gpu=gpu, num_gpus=args.num_processes, commit=commit_of_checkout(),
                          date=datetime.date.today().isoformat(), deepep_version=args.deepep_version)
    name = f"{gpu.lower()}x{args.num_processes}_deep_ep_tests.json"
    out = Path(args.out or REPO / "baselines" / "perf" / name)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for line in report["lines"]:
        print(f"{line['test']:12s} {line['line']:40s} deep_ep {line['deep_ep']}  cute_ep {line['cute_ep']}  "
              f"ratio {line['ratio']}")
    problems = check_report(report)
    print(f"wrote {out} (host: {count} GPU(s) {gpu}); " + ("complete" if not problems else
                                                            "incomplete: " + "; ".join(problems)))
    return status


if __name__ == "__main__":
    sys.exit(main())
