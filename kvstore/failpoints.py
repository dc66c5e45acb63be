"""Named failpoints: places in the code where a test can stop a real process on purpose.

A failpoint is a call `failpoints.hit("name")` at a point worth crashing at. It does nothing
unless the environment variable `KVSTORE_FAILPOINTS` names it when this module is first
imported; the setting is read once, into a frozen map, so an unset variable costs one
lookup in an empty mapping.

    KVSTORE_FAILPOINTS="ssd_write_in_txn=pause"   # name=action, comma-separated
    KVSTORE_FAILPOINT_DIR=/tmp/fp                 # where `pause` leaves its marker

Actions:
    pause: writes a marker file `$KVSTORE_FAILPOINT_DIR/<name>` (holding the process id),
        then blocks the calling thread forever. A test waits, with a deadline, for the
        marker, and then SIGKILLs the process: it dies exactly at the failpoint.

Failpoints (the only names accepted):
    ssd_write_in_txn: `SsdTier.write`, inside the LMDB write transaction, after its puts
        and deletes and before it commits.

An unknown name or action, or `pause` without `KVSTORE_FAILPOINT_DIR`, raises
`InvalidArgumentError` at import: a misspelt failpoint must not silently never fire.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from kvstore.errors import InvalidArgumentError

ENV_FAILPOINTS = "KVSTORE_FAILPOINTS"
ENV_FAILPOINT_DIR = "KVSTORE_FAILPOINT_DIR"
NAMES = frozenset({"ssd_write_in_txn"})


def _pause(name: str) -> None:
    marker = Path(os.environ[ENV_FAILPOINT_DIR]) / name
    marker.write_text(f"{os.getpid()}\n")
    threading.Event().wait()  # until the process is killed


_ACTIONS: Mapping[str, Callable[[str], None]] = MappingProxyType({"pause": _pause})


def parse(spec: str, environ: Mapping[str, str]) -> Mapping[str, str]:
    """The failpoints `spec` ("name=action,...") turns on; raises on any mistake in it."""
    active: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, action = item.partition("=")
        if not sep or name not in NAMES or action not in _ACTIONS:
            raise InvalidArgumentError(
                f"{ENV_FAILPOINTS}: bad entry {item!r}; names {sorted(NAMES)}, "
                f"actions {sorted(_ACTIONS)}"
            )
        active[name] = action
    if "pause" in active.values() and not environ.get(ENV_FAILPOINT_DIR):
        raise InvalidArgumentError(f"failpoint action pause needs {ENV_FAILPOINT_DIR}")
    return MappingProxyType(active)


_ACTIVE = parse(os.environ.get(ENV_FAILPOINTS, ""), os.environ)


def hit(name: str) -> None:
    """Runs the action set for failpoint `name`, if any; otherwise returns at once."""
    assert name in NAMES, f"undeclared failpoint {name!r}"
    action = _ACTIVE.get(name)
    if action is not None:
        _ACTIONS[action](name)
