"""Suite-specific flags: a suite module may define ``add_arguments(parser)``; the values it
parses reach its ``run`` as `SuiteArgs.extra`, beside the flags every suite shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvstore.bench.suites import SuiteOptions


@dataclass(frozen=True)
class SuiteArgs(SuiteOptions):
    """`SuiteOptions` plus the suite's own parsed flags, by argparse `dest`."""

    extra: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))


def extra_of(options: SuiteOptions) -> Mapping[str, object]:
    """The suite's own flags; empty when `run` was called with plain `SuiteOptions`."""
    return options.extra if isinstance(options, SuiteArgs) else MappingProxyType({})
