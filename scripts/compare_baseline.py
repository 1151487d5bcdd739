"""Compare two baseline files written by cute_ep.validators.baseline.save_baseline, bit for bit.

To run:
    python scripts/compare_baseline.py EXPECTED.npz ACTUAL.npz
    python scripts/compare_baseline.py baselines/h200x4_bf16.npz out/run.npz --quiet

Prints a one-line summary (and, unless --quiet, one line per differing array and any device /
version / git sha differences). Exit status: 0 identical, 1 some array differs, 2 the
configurations differ (config, seed, dtype, world size, local world size) or a file is unreadable.
"""

from __future__ import annotations

import argparse
import sys

from cute_ep.validators.baseline import BaselineConfigError, compare_baselines, load_baseline

EXIT_IDENTICAL = 0
EXIT_DIFFERS = 1
EXIT_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, compare, print; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("expected", help="the reference baseline (.npz)")
    parser.add_argument("actual", help="the baseline under test (.npz)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary line")
    args = parser.parse_args(argv)

    baselines = []
    for path in (args.expected, args.actual):
        try:
            baselines.append(load_baseline(path))
        except Exception as exc:  # any unreadable or foreign file is exit 2, never a pass or a diff
            print(f"error: cannot read baseline {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_ERROR
    try:
        result = compare_baselines(*baselines)
    except BaselineConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    for line in result.lines[:1] if args.quiet else result.lines:
        print(line)
    return EXIT_IDENTICAL if result.passed else EXIT_DIFFERS


if __name__ == "__main__":
    sys.exit(main())
