"""`kvstore-bench SUITE [--quick] [--json PATH] [--plot PATH] [--no-targets]`: run one
benchmark suite. It exits 1 where a target is missed or could not be measured
(`kvstore.bench.verdict`); `--no-targets` lists them and exits 0, for exploration."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvstore.bench.options import SuiteArgs
from kvstore.bench.report import print_table, write_json
from kvstore.bench.suites import SUITES, SuiteSpec

COMMON_FLAGS = ("suite", "quick", "json", "plot", "no_targets")


def _add_suite_parser(
    subparsers: argparse._SubParsersAction, spec: SuiteSpec, with_own_flags: bool
) -> None:
    sub = subparsers.add_parser(spec.name, help=spec.help, description=spec.help)
    sub.add_argument("--quick", action="store_true", help="short run, same rows and columns")
    sub.add_argument("--json", type=Path, metavar="PATH", help="write the rows as a JSON list")
    sub.add_argument(
        "--no-targets",
        action="store_true",
        help="exit 0 where a target is missed or unmeasured (still listed): for exploration",
    )
    if spec.can_plot:
        sub.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG of the results")
    if with_own_flags:
        add_own = getattr(importlib.import_module(spec.module), "add_arguments", None)
        if add_own is not None:
            add_own(sub)


def build_parser(suite: str | None = None) -> argparse.ArgumentParser:
    """The CLI: one subcommand per registered suite, with the common flags.

    Only `suite`'s module is imported, for its own flags (``add_arguments(parser)``), so a
    suite's heavy imports never slow down another's.
    """
    parser = argparse.ArgumentParser(prog="kvstore-bench", description=__doc__)
    subparsers = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for spec in SUITES.values():
        _add_suite_parser(subparsers, spec, with_own_flags=spec.name == suite)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the suite named in `argv`, prints its table and writes what the flags ask for."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(next((a for a in argv if a in SUITES), None)).parse_args(argv)
    spec = SUITES[args.suite]
    extra = {k: v for k, v in vars(args).items() if k not in COMMON_FLAGS}
    rows = spec.run(SuiteArgs(quick=args.quick, extra=extra))
    print_table(rows, title=f"kvstore-bench {spec.name}" + (" (quick)" if args.quick else ""))
    if args.json is not None:
        write_json(rows, args.json)
    if getattr(args, "plot", None) is not None:
        spec.plot(rows, args.plot)
    status = spec.exit_status(rows)
    return 0 if args.no_targets else status


if __name__ == "__main__":
    raise SystemExit(main())
