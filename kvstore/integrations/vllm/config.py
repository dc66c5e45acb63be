"""Settings of the vLLM connector, read from `kv_connector_extra_config`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.auth import read_token_file
from kvstore.client import TRANSPORT_CHOICES
from kvstore.errors import InvalidArgumentError

_PREFIX = "kvstore."
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_NUMBERS: dict[str, type[int] | type[float]] = {
    "timeout_s": float,
    "publish_buffers": int,
    "load_buffers": int,
}


@dataclass(frozen=True)
class ConnectorConfig:
    """How the connector reaches the store and names its blocks.

    Args:
        address: "host:port" of the store node; with `pool`, nodes of the pool
            ("host:port,host:port"), the first the node beside this engine (its home).
        pool: the store is a global pool (`kvstore serve --cluster`): the scheduler
            matches what the whole pool holds (`PoolClient`), loads read every block from a
            node that holds it, and saves are placed over the pool's nodes.
        model_id: namespace model id; empty means vLLM's model name. Processes that
            should share blocks must agree on it.
        timeout_s: deadline of each store call; a slow store costs at most this per step.
        transport: one of `TRANSPORT_CHOICES` (see `kvstore.client.Client`).
        save: publish computed prompt blocks to the store.
        publish_buffers: host staging blocks for publishing (allocated at start, each one
            store block); blocks computed while all are taken are dropped and counted.
        load_buffers: host staging blocks for loads (allocated and touched at start, each
            one store block, even): a load lands half of them at a time while the other
            half is copied into vLLM's pages.
        load_by_layer: where the layout allows (vLLM's CPU pages, over the data plane),
            load straight into vLLM's pages layer by layer while the forward pass runs
            (`layer_load`); else, and when false, load before the forward pass.
        share_pages: with a node on this host and vLLM's CPU pages, share the pages with
            the node at start-up, in place (`Client.share`), so loads land in them with no
            copy on this side; when false, or where that is not possible, loads go through
            `load_buffers` (or straight into the pages, over UCX, by layer).
        auth_token_file: file holding the token the store knows this server by (a store
            started with --auth-token-file refuses calls without one).
        tls_ca: PEM CA of the store's certificate: reach it over TLS.
        log_level: the connector's log level (e.g. "DEBUG": a line per load with its
            phases); empty means vLLM's.
    """

    address: str = "127.0.0.1:50051"
    pool: bool = False
    model_id: str = ""
    timeout_s: float = 5.0
    transport: str = "auto"
    save: bool = True
    publish_buffers: int = 512
    load_buffers: int = 128
    load_by_layer: bool = True
    share_pages: bool = True
    auth_token_file: str = ""
    tls_ca: str = ""
    log_level: str = ""

    def __post_init__(self) -> None:
        if not all(":" in seed and "," not in seed for seed in self.seeds):
            what = "host:port[,host:port...] with pool" if self.pool else "host:port"
            raise InvalidArgumentError(f"address must be {what}, got {self.address!r}")
        if self.timeout_s <= 0:
            raise InvalidArgumentError("timeout_s must be positive")
        if self.transport not in TRANSPORT_CHOICES:
            raise InvalidArgumentError(f"transport must be one of {TRANSPORT_CHOICES}")
        if self.publish_buffers <= 0:
            raise InvalidArgumentError("publish_buffers must be > 0")
        if self.load_buffers < 2 or self.load_buffers % 2:
            raise InvalidArgumentError("load_buffers must be even and >= 2")
        if self.log_level and self.log_level.upper() not in _LOG_LEVELS:
            raise InvalidArgumentError(f"log_level must be one of {_LOG_LEVELS}")

    @property
    def seeds(self) -> list[str]:
        """The node addresses of `address`: one, or several with `pool`."""
        return self.address.split(",") if self.pool else [self.address]

    def auth_token(self) -> str:
        """The token in `auth_token_file`, or "" without one."""
        return read_token_file(self.auth_token_file) if self.auth_token_file else ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorConfig:
        """Reads the `kvstore.*` keys of vLLM's extra config; rejects unknown ones."""
        fields = {k.removeprefix(_PREFIX): v for k, v in extra.items() if k.startswith(_PREFIX)}
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidArgumentError(f"unknown kvstore connector settings: {unknown}")
        for name in ("pool", "save", "load_by_layer", "share_pages"):
            if name in fields:
                fields[name] = str(fields[name]).lower() not in ("0", "false", "no")
        for name, convert in _NUMBERS.items():
            if name in fields:
                try:
                    fields[name] = convert(fields[name])
                except (TypeError, ValueError):
                    raise InvalidArgumentError(f"kvstore.{name}: not a number") from None
        return cls(**fields)
