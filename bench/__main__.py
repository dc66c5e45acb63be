"""`kvstore-bench SUITE [--quick] [--json PATH] [--plot PATH]`: run one benchmark suite."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.report import print_table, write_json
from bench.suites import SUITES, SuiteOptions, SuiteSpec


def _add_suite_parser(subparsers: argparse._SubParsersAction, spec: SuiteSpec) -> None:
    sub = subparsers.add_parser(spec.name, help=spec.help, description=spec.help)
    sub.add_argument("--quick", action="store_true", help="short run, same rows and columns")
    sub.add_argument("--json", type=Path, metavar="PATH", help="write the rows as a JSON list")
    if spec.can_plot:
        sub.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG of the results")


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one subcommand per registered suite, with the common flags."""
    parser = argparse.ArgumentParser(prog="kvstore-bench", description=__doc__)
    subparsers = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for spec in SUITES.values():
        _add_suite_parser(subparsers, spec)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the suite named in `argv`, prints its table and writes what the flags ask for."""
    args = build_parser().parse_args(argv)
    spec = SUITES[args.suite]
    rows = spec.run(SuiteOptions(quick=args.quick))
    print_table(rows, title=f"kvstore-bench {spec.name}" + (" (quick)" if args.quick else ""))
    if args.json is not None:
        write_json(rows, args.json)
    if getattr(args, "plot", None) is not None:
        spec.plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
