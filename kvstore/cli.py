"""`kvstore` command line: serve, engine, demo, stats, health."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable

from rich.console import Console

from kvstore import config as cfg
from kvstore.auth import read_token_file
from kvstore.client import Client
from kvstore.demo import DemoConfig, run_demo
from kvstore.errors import KVStoreError
from kvstore.node.server import EmbeddedServer, ServerConfig, serve
from kvstore.store.config import StoreConfig

LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def _store_and_server(args: argparse.Namespace) -> tuple[StoreConfig, ServerConfig]:
    file_values = cfg.load_file(args.config)
    return (
        cfg.build(StoreConfig, args, os.environ, file_values),
        cfg.build(ServerConfig, args, os.environ, file_values),
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    store_config, server_config = _store_and_server(args)
    asyncio.run(serve(store_config, server_config))
    return 0


def _cmd_engine(args: argparse.Namespace) -> int:
    # torch loads only for this command, so `kvstore serve` starts without it.
    from gpu_engine.config import EngineConfig
    from gpu_engine.connector import StoreConnectorConfig
    from gpu_engine.service import EngineServiceConfig, serve_engine

    file_values = cfg.load_file(args.config)
    serve_engine(
        cfg.build(EngineConfig, args, os.environ, file_values),
        cfg.build(StoreConnectorConfig, args, os.environ, file_values),
        cfg.build(EngineServiceConfig, args, os.environ, file_values),
    )
    return 0


def _cmd_conductor(args: argparse.Namespace) -> int:
    from kvstore.conductor.front.config import ConductorConfig
    from kvstore.conductor.front.server import serve_conductor

    serve_conductor(cfg.build(ConductorConfig, args, os.environ, cfg.load_file(args.config)))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    console = Console()
    # grpc.aio's process-wide poller can wake the embedded server's closed loop once more
    # (at shutdown or interpreter exit); asyncio would log that harmless EBADF as an error.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    demo = DemoConfig(num_users=args.users)
    if args.store:
        reports = run_demo(args.store, demo, console, pool=args.store_pool)
        return 0 if all(r.is_intact for r in reports) else 1
    store_config = StoreConfig(dram_bytes=cfg.parse_bytes(args.dram_bytes))
    with EmbeddedServer(store_config) as server:
        console.print(f"embedded store at {server.address}, DRAM {args.dram_bytes}")
        reports = run_demo(server.address, demo, console)
    return 0 if all(r.is_intact for r in reports) else 1


def _cmd_stats(args: argparse.Namespace) -> int:
    if args.watch:
        return _watch_stats(args)
    if args.cluster:
        return _pool_stats(args)
    with _client(args) as client:
        stats = client.stats()
    _print_fields(stats._asdict(), "tiers")
    for tier in stats.tiers:
        print(
            f"tier={tier.name} capacity_bytes={tier.capacity_bytes} "
            f"used_bytes={tier.used_bytes} num_blocks={tier.num_blocks}"
        )
    return 0


def _pool_stats(args: argparse.Namespace) -> int:
    """The pool as the node sees it: its part in the index; a line per live member, its
    planes, capacity and what it holds by tier (placement: how the pool's blocks spread);
    and how many live nodes hold each block of a sample of the index (replication). Maps
    are printed by name: a map's order on the wire is no order."""
    with _client(args) as client:
        report = client.pool_status(sample_blocks=args.sample_blocks)
    _print_fields(report._asdict(), "members", "holders_sampled")
    for member in report.members:
        where = " ".join(f"{plane}={at}" for plane, at in sorted(member.addresses.items()))
        capacity = " ".join(f"{tier}_bytes={n}" for tier, n in sorted(member.capacity.items()))
        held = " ".join(f"held_{tier}_bytes={n}" for tier, n in sorted(member.held.items()))
        print(f"member={member.node_id} {where} {capacity} {held}".rstrip())
    sampled = sorted(report.holders_sampled.items())
    if sampled:
        counts = " ".join(f"holders_{n}={blocks}" for n, blocks in sampled)
        print(f"sampled_blocks={sum(b for _, b in sampled)} {counts}")
    return 0


def _print_fields(fields: dict[str, object], *listed_apart: str) -> None:
    """A `name=value` line per field, but those whose items get lines of their own."""
    for name, value in fields.items():
        if name not in listed_apart:
            print(f"{name}={value}")


def _watch_stats(args: argparse.Namespace) -> int:
    """Redraws the node's tables every `--interval-s` (`--count` times; 0: until Ctrl-C)."""
    from rich.console import Group
    from rich.live import Live

    from kvstore.metrics.stats_table import node_table, tier_table

    with _client(args) as client:
        then, then_s = client.stats(), time.monotonic()
        with Live(auto_refresh=False) as live:
            for _ in itertools.count() if args.count == 0 else range(args.count):
                time.sleep(args.interval_s)  # the refresh period the user asked for
                now, now_s = client.stats(), time.monotonic()
                tables = (f(now, then, now_s - then_s) for f in (node_table, tier_table))
                live.update(Group(*tables), refresh=True)
                then, then_s = now, now_s
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        is_serving = client.health()
    print("SERVING" if is_serving else "NOT_SERVING")
    return 0 if is_serving else 1


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a store node (gRPC) until SIGTERM")
    p.add_argument("--config", default=None, help="TOML file with any of the options below")
    cfg.add_arguments(p, StoreConfig)
    cfg.add_arguments(p, ServerConfig)
    p.set_defaults(func=_cmd_serve)


def _add_engine(sub: argparse._SubParsersAction, with_flags: bool) -> None:
    """The engine's flags import torch, so they are added only when `engine` runs."""
    p = sub.add_parser("engine", help="run an engine process (EngineService, gRPC) until SIGTERM")
    p.add_argument("--config", default=None, help="TOML file with any of the options below")
    p.set_defaults(func=_cmd_engine)
    if not with_flags:
        return
    from gpu_engine.config import EngineConfig
    from gpu_engine.connector import StoreConnectorConfig
    from gpu_engine.service import EngineServiceConfig

    cfg.add_arguments(p, EngineConfig)
    cfg.add_arguments(p, StoreConnectorConfig)
    cfg.add_arguments(p, EngineServiceConfig)


def _add_conductor(sub: argparse._SubParsersAction) -> None:
    from kvstore.conductor.front.config import ConductorConfig

    help = "front engine processes with an OpenAI-compatible API and SLO admission"
    p = sub.add_parser("conductor", help=help)
    p.add_argument("--config", default=None, help="TOML file with any of the options below")
    cfg.add_arguments(p, ConductorConfig)
    p.set_defaults(func=_cmd_conductor)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start an embedded store and run a prefix-reuse demo")
    p.add_argument("--dram-bytes", default="256MiB", help="DRAM tier of the embedded store")
    p.add_argument("--users", type=int, default=8, help="users sharing the system prompt")
    p.add_argument("--store", default="", help="HOST:PORT of a running node instead")
    p.add_argument(
        "--store-pool",
        action="store_true",
        help="--store is HOST:PORT,HOST:PORT,... of a global pool: match, load and put there",
    )
    p.set_defaults(func=_cmd_demo, log_level="WARNING")  # the table, not the server's log


def _client(args: argparse.Namespace) -> Client:
    token = read_token_file(args.auth_token_file) if args.auth_token_file else ""
    tls = {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}
    return Client(args.address, timeout_s=args.timeout_s, auth_token=token, **tls)


def _add_client_command(
    sub: argparse._SubParsersAction, name: str, help: str, func: Callable
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help)
    p.add_argument("--address", default="127.0.0.1:50051", help="store node host:port")
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--auth-token-file", default="", help="file holding this client's token")
    p.add_argument("--tls-ca", default="", help="PEM CA of the node's certificate: use TLS")
    p.add_argument("--tls-cert", default="", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    p.set_defaults(func=func)
    return p


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_engine(sub, with_flags=command == "engine")
    _add_conductor(sub)
    _add_demo(sub)
    stats = _add_client_command(sub, "stats", "print a store node's counters", _cmd_stats)
    stats.add_argument("--watch", action="store_true", help="a live table of tiers and rates")
    stats.add_argument("--cluster", action="store_true", help="the global pool as the node sees it")
    stats.add_argument("--interval-s", type=float, default=1.0, help="--watch refresh period")
    stats.add_argument("--count", type=int, default=0, help="--watch refreshes (0: forever)")
    stats.add_argument(
        "--sample-blocks", type=int, default=1000, help="--cluster: index entries sampled"
    )
    _add_client_command(sub, "health", "exit 0 if a store node is serving", _cmd_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser("engine" if "engine" in argv else None).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    try:
        return args.func(args)
    except KVStoreError as exc:
        print(f"kvstore: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
