"""One table per component, three sources: CLI flags, environment variables, a TOML file.

A component's config is a frozen dataclass whose fields carry `help` (and, where the text
form needs it, `parse`) in their metadata. From that one table come the `--flag` of each
field, its `KVSTORE_FIELD` environment variable and its key in the config file, so
defaults and docs cannot drift. Precedence: flag, then environment, then file, then default.

A table may hold another one whole (`table`: the listener's security, a server's stream
bounds): its fields stay flags, variables and keys of their own (`--tls-cert`, not
nested), and the holder may change their defaults. Config classes are plain data: they
check their values and read no file, bind no port.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvstore.errors import InvalidArgumentError

C = TypeVar("C")
ENV_PREFIX = "KVSTORE_"
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """'268435456', '256MiB', '1.5GiB', '4G' (binary), '1GB' (decimal) -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _BYTES_RE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise InvalidArgumentError(f"not a byte size: {text!r} (e.g. 268435456, 256MiB, 1GiB)")
    number = m.group(1)
    if number.isdigit():  # exact for integers of any size
        return int(number) * _BYTE_UNITS[unit]
    return int(float(number) * _BYTE_UNITS[unit])


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise InvalidArgumentError(f"not a boolean: {text!r}")
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise InvalidArgumentError(f"not a boolean: {text!r}")


def parse_int(value: str | int) -> int:
    """An integer from text or a TOML int; refuses bools and fractional numbers."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidArgumentError(f"not an integer: {value!r}")
    return int(value)


def parse_float(value: str | float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidArgumentError(f"not a number: {value!r}")
    return float(value)


def option(default: Any, help: str, parse: Callable[[Any], Any] | None = None) -> Any:
    """A config field: its default, its help text and how to parse its text form."""
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse})


def table(cls: type, **defaults: Any) -> Any:
    """A config field holding component table `cls` whole, with `defaults` changed."""
    return dataclasses.field(
        default_factory=functools.partial(cls, **defaults), metadata={"table": cls}
    )


def _parser_of(f: dataclasses.Field) -> Callable[[Any], Any]:
    parse = f.metadata.get("parse")
    if parse is not None:
        return parse
    parsers: dict[str, Callable[[Any], Any]] = {
        "int": parse_int,
        "float": parse_float,
        "bool": parse_bool,
    }
    return parsers.get(str(f.type), str)


def add_arguments(parser: argparse.ArgumentParser, cls: type, defaults: Any = None) -> None:
    """Adds one `--field-name` flag per field of config class `cls` (and of the tables it
    holds); `defaults`: an instance whose values are the defaults shown."""
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if "table" in f.metadata:
            add_arguments(parser, f.metadata["table"], f.default_factory())  # type: ignore[misc,operator]
            continue
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        default = f.default if defaults is None else getattr(defaults, f.name)
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {default}]"
        # A boolean flag alone means true (`--insecure`); `--insecure false` still works.
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if str(f.type) == "bool" else {}
        group.add_argument(
            flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text, **extra
        )


def load_file(path: str | Path | None) -> dict[str, Any]:
    """The TOML config file as a flat dict (no file: empty)."""
    if path is None:
        return {}
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def build(
    cls: type[C],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    defaults: C | None = None,
) -> C:
    """An instance of config class `cls` from flags, environment and file values; those
    not given keep their default (`defaults`' value, where given)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "table" in f.metadata:
            held = f.default_factory()  # type: ignore[misc,operator]
            values[f.name] = build(f.metadata["table"], args, env, file_values, held)
            continue
        raw = getattr(args, f.name, None) if args is not None else None
        if raw is None and env is not None:
            raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is None and file_values is not None:
            raw = file_values.get(f.name)
        if raw is not None:
            try:
                values[f.name] = _parser_of(f)(raw)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"{f.name}: {exc}") from exc
    if defaults is not None:
        return dataclasses.replace(defaults, **values)  # type: ignore[type-var]
    return cls(**values)
