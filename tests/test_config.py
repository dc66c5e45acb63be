"""Config: byte and bool parsing, flag > env > file > default, generated flags and help."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from kvstore import config as cfg
from kvstore.bounds import StreamSettings
from kvstore.errors import InvalidArgumentError
from kvstore.node.server import ServerConfig
from kvstore.store import StoreConfig

CONFIG_CLASSES = [StoreConfig, ServerConfig]
MIB = 1 << 20


def _make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore-test")
    for cls in CONFIG_CLASSES:
        cfg.add_arguments(parser, cls)
    return parser


def _write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return path


def _build(
    cls: type,
    tmp_path: Path,
    flags: list[str] | None = None,
    env: dict[str, str] | None = None,
    toml: str | None = None,
) -> Any:
    """`cls` built the way the CLI does, from flags, an environment and a TOML file."""
    args = _make_parser().parse_args(flags or [])
    file_values = cfg.load_file(_write_toml(tmp_path, toml) if toml is not None else None)
    return cfg.build(cls, args, env or {}, file_values)


# --- parse_bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("268435456", 268435456),
        ("256MiB", 256 * MIB),
        ("1.5GiB", 1536 * MIB),
        ("4G", 4 << 30),
        ("1GB", 10**9),
        ("64k", 64 << 10),
        (" 2 MiB ", 2 * MIB),
        ("0", 0),
        ("7b", 7),
        ("3kb", 3000),
        ("5mb", 5 * 10**6),
        ("2T", 2 << 40),
        ("1tb", 10**12),
        ("1TiB", 1 << 40),
        ("64KiB", 64 << 10),
        (4096, 4096),
    ],
)
def test_parse_bytes(text: str | int, nbytes: int) -> None:
    assert cfg.parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["abc", "12XB", "-5", "", "   ", "MiB", "1.5.2G", "1 2", "0x10"])
def test_parse_bytes_invalid_raises(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="not a byte size"):
        cfg.parse_bytes(text)


def test_parse_bytes_large_integer_is_exact() -> None:
    assert cfg.parse_bytes("9007199254740993") == 2**53 + 1


# --- parse_bool ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" yes ", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("off", False),
        (True, True),
        (False, False),
    ],
)
def test_parse_bool(text: str | bool, value: bool) -> None:
    assert cfg.parse_bool(text) is value


@pytest.mark.parametrize("text", ["", "2", "maybe", "truee", "y"])
def test_parse_bool_invalid_raises(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="not a boolean"):
        cfg.parse_bool(text)


# --- precedence ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("has_flag", "has_env", "has_file", "dram_bytes"),
    [
        (True, True, True, 1 * MIB),
        (True, False, True, 1 * MIB),
        (True, True, False, 1 * MIB),
        (False, True, True, 2 * MIB),
        (False, True, False, 2 * MIB),
        (False, False, True, 3 * MIB),
        (False, False, False, 1 << 30),
    ],
)
def test_precedence_flag_env_file_default(
    tmp_path: Path, has_flag: bool, has_env: bool, has_file: bool, dram_bytes: int
) -> None:
    config = _build(
        StoreConfig,
        tmp_path,
        flags=["--dram-bytes", "1MiB"] if has_flag else [],
        env={"KVSTORE_DRAM_BYTES": "2MiB"} if has_env else {},
        toml='dram_bytes = "3MiB"\n' if has_file else None,
    )
    assert config.dram_bytes == dram_bytes
    assert config == StoreConfig(dram_bytes=dram_bytes)  # nothing else moved


def test_sources_combine_per_field(tmp_path: Path) -> None:
    config = _build(
        StoreConfig,
        tmp_path,
        flags=["--policy", "lru"],
        env={"KVSTORE_MAX_BATCH_KEYS": "16", "KVSTORE_POLICY": "prefix-lru"},
        toml="slab_bytes = 1048576\nlease_timeout_s = 2.5\nmax_batch_keys = 99\n",
    )
    assert config == StoreConfig(
        slab_bytes=MIB, policy="lru", max_batch_keys=16, lease_timeout_s=2.5
    )


def test_no_sources_gives_defaults() -> None:
    assert cfg.build(StoreConfig) == StoreConfig()
    assert cfg.build(ServerConfig) == ServerConfig()


def test_server_config_from_all_sources(tmp_path: Path) -> None:
    config = _build(
        ServerConfig,
        tmp_path,
        flags=["--port", "0"],
        env={"KVSTORE_CHUNK_BYTES": "64KiB", "KVSTORE_GRACE_S": "0.5"},
        toml='host = "0.0.0.0"\nmax_message_bytes = "16MiB"\nport = 1234\n',
    )
    assert config == ServerConfig(
        host="0.0.0.0", port=0, max_message_bytes=16 * MIB, chunk_bytes=64 << 10, grace_s=0.5
    )
    assert config.address == "0.0.0.0:0"


def test_env_ignores_unprefixed_and_other_names(tmp_path: Path) -> None:
    env = {"DRAM_BYTES": "1MiB", "kvstore_dram_bytes": "1MiB", "KVSTORE_DRAMBYTES": "1MiB"}
    assert _build(StoreConfig, tmp_path, env=env) == StoreConfig()


# --- bad values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "field", "flag_value", "toml_value"),
    [
        (StoreConfig, "policy", "nope", '"nope"'),
        (StoreConfig, "dram_bytes", "lots", '"lots"'),
        (StoreConfig, "dram_bytes", "32", "32"),  # below the 64-byte minimum
        (StoreConfig, "slab_bytes", "-1", "1.5"),
        (StoreConfig, "max_batch_keys", "many", '"many"'),
        (StoreConfig, "max_batch_keys", "0", "0"),
        (StoreConfig, "lease_timeout_s", "soon", '"soon"'),
        (StoreConfig, "reservation_timeout_s", "-1", "0"),
        (StoreConfig, "verify_reads", "maybe", '"maybe"'),
        (ServerConfig, "port", "http", '"http"'),
        (ServerConfig, "port", "70000", "70000"),
        (ServerConfig, "chunk_bytes", "9MiB", '"9MiB"'),  # not below max_message_bytes
        (ServerConfig, "max_message_bytes", "big", "[1]"),
        (ServerConfig, "grace_s", "later", '"later"'),
    ],
)
@pytest.mark.parametrize("source", ["flag", "env", "file"])
def test_bad_value_in_any_source_raises(
    tmp_path: Path, cls: type, field: str, flag_value: str, toml_value: str, source: str
) -> None:
    sources: dict[str, Any] = {
        "flag": {"flags": [f"--{field.replace('_', '-')}", flag_value]},
        "env": {"env": {f"KVSTORE_{field.upper()}": flag_value}},
        "file": {"toml": f"{field} = {toml_value}\n"},
    }[source]
    with pytest.raises(InvalidArgumentError):
        _build(cls, tmp_path, **sources)


def test_bad_value_error_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^dram_bytes: not a byte size: 'lots'"):
        cfg.build(StoreConfig, env={"KVSTORE_DRAM_BYTES": "lots"})


def test_bool_field_given_toml_integer_raises_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        _build(StoreConfig, tmp_path, toml="verify_reads = 1\n")


# --- bools --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ({"env": {"KVSTORE_VERIFY_READS": "false"}}, False),
        ({"env": {"KVSTORE_VERIFY_READS": "0"}}, False),
        ({"env": {"KVSTORE_VERIFY_READS": "yes"}}, True),
        ({"toml": "verify_reads = false\n"}, False),
        ({"toml": 'verify_reads = "off"\n'}, False),
        ({"flags": ["--verify-reads", "false"]}, False),
        ({"flags": ["--verify-reads", "true"], "env": {"KVSTORE_VERIFY_READS": "false"}}, True),
        ({"toml": "verify_reads = true\n"}, True),
        ({}, False),
    ],
)
def test_verify_reads_parsing(tmp_path: Path, source: dict[str, Any], value: bool) -> None:
    assert _build(StoreConfig, tmp_path, **source).verify_reads is value


# --- load_file ----------------------------------------------------------------------------------


def test_load_file_none_is_empty() -> None:
    assert cfg.load_file(None) == {}


def test_load_file_reads_flat_toml(tmp_path: Path) -> None:
    path = _write_toml(tmp_path, 'dram_bytes = "256MiB"\nport = 7\nverify_reads = false\n')
    assert cfg.load_file(path) == {"dram_bytes": "256MiB", "port": 7, "verify_reads": False}
    assert cfg.load_file(str(path)) == cfg.load_file(path)


def test_load_file_missing_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        cfg.load_file(tmp_path / "absent.toml")


def test_file_keys_that_are_no_field_are_ignored(tmp_path: Path) -> None:
    assert _build(StoreConfig, tmp_path, toml='colour = "blue"\nport = 7\n') == StoreConfig()


# --- flags and help -----------------------------------------------------------------------------


def _rows(cls: type, held: Any = None) -> list[tuple[type, dataclasses.Field, Any]]:
    """(class, field, default shown) of every flag of `cls`, the tables it holds included."""
    rows = []
    for f in dataclasses.fields(cls):
        if "table" in f.metadata:
            rows += _rows(f.metadata["table"], f.default_factory())  # type: ignore[misc]
        else:
            rows.append((cls, f, f.default if held is None else getattr(held, f.name)))
    return rows


def _all_fields() -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for c in CONFIG_CLASSES for cls, f, _ in _rows(c)]


ROWS = [row for c in CONFIG_CLASSES for row in _rows(c)]


@pytest.mark.parametrize(("cls", "field", "default"), ROWS, ids=[f.name for _, f, _ in ROWS])
def test_every_field_has_a_flag_with_help(
    monkeypatch: pytest.MonkeyPatch, cls: type, field: dataclasses.Field, default: Any
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: no wrapping inside the help
    help_text = " ".join(_make_parser().format_help().split())
    flag, env = "--" + field.name.replace("_", "-"), "KVSTORE_" + field.name.upper()
    assert field.metadata["help"]
    metavar = f"[{field.name.upper()}]" if field.type == "bool" else field.name.upper()
    expected = f"{flag} {metavar} {field.metadata['help']} [env {env}; default {default}]"
    assert expected in help_text
    assert f"{cls.__name__}:" in help_text  # one argument group per config class


def test_a_held_table_shows_and_builds_its_holders_defaults() -> None:
    """ServerConfig holds StreamSettings with 16 per client: --help says so, and so does
    a config built from no source; a flag still sets it."""
    assert StreamSettings().max_streams_per_client != 16
    assert cfg.build(ServerConfig).streams.max_streams_per_client == 16
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, ServerConfig)
    assert "default 16]" in " ".join(parser.format_help().split())
    built = cfg.build(ServerConfig, parser.parse_args(["--max-streams-per-client", "3"]))
    assert built.streams == StreamSettings(max_streams_per_client=3, max_streams=64)


def test_help_lists_exactly_the_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    flags = set(re.findall(r"--[a-z][a-z-]*", _make_parser().format_help()))
    assert flags == {"--help"} | {"--" + f.name.replace("_", "-") for _, f in _all_fields()}


def test_unset_flags_parse_to_none() -> None:
    args = _make_parser().parse_args([])
    assert all(getattr(args, f.name) is None for _, f in _all_fields())


def test_flags_parse_to_their_field() -> None:
    args = _make_parser().parse_args(["--dram-bytes", "1GiB", "--expire-interval-s", "2"])
    assert (args.dram_bytes, args.expire_interval_s) == ("1GiB", "2")
    assert cfg.build(StoreConfig, args).dram_bytes == 1 << 30
    assert cfg.build(ServerConfig, args).expire_interval_s == 2.0


def test_a_boolean_flag_alone_means_true_and_takes_a_value_too() -> None:
    parser = _make_parser()
    assert cfg.build(StoreConfig, parser.parse_args(["--ssd-sync"])).ssd_sync is True
    assert cfg.build(StoreConfig, parser.parse_args(["--ssd-sync", "false"])).ssd_sync is False
    assert cfg.build(StoreConfig, parser.parse_args([])).ssd_sync is False


@pytest.mark.parametrize(
    "bad",
    [
        {"streams": {"max_streams_per_client": 0}},
        {"streams": {"max_streams_per_client": 65, "max_streams": 64}},
        {"streams": {"stream_stall_timeout_s": 0.0}},
        {"max_unproven_sockets_per_peer": 0},
        {"max_unproven_sockets_per_peer": 300, "max_unproven_sockets": 256},
        {"max_calls_per_connection": 0},
    ],
)
def test_the_bounds_of_hostile_clients_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        tables = {"streams": StreamSettings}
        ServerConfig(**{k: tables[k](**v) if k in tables else v for k, v in bad.items()})
