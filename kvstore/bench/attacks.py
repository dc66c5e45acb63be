"""Hostile clients to run beside a load: readers that stop reading, and sockets that never
say hello. Each runs as its own process (`python -m kvstore.bench.attacks KIND ...`), prints one
`ready ...` line once its attack is in place, and keeps it up until killed or until its
stdin closes.

- `stalled-readers ADDRESS`: puts `--blocks` blocks of `--block-bytes` in a namespace of its
  own, then opens `--streams` gRPC `Get` streams of all of them over `--channels` channels
  (no BDP probe, so a channel's window never grows to take a whole stream) and reads none.
- `silent-sockets TARGET`: keeps `--sockets` connections open to a data plane and sends
  nothing; whenever the node closes one, it opens another at once. TARGET is HOST:PORT (the
  TCP plane) or @NAME (an abstract Unix socket: the shared-memory plane's).

With `--token` the readers authenticate first (the attack of an admitted tenant); the
sockets never do.

`attack(kind, target, size)` starts one beside a caller and stops it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import Client
from kvstore.config import parse_bytes
from kvstore.keys import KVLayout, Namespace, block_keys

KINDS = ("stalled-readers", "silent-sockets")
_BYTES_PER_TOKEN = 4096  # the layout below: 2 (K, V) x 2 layers x 8 heads x 64 x 2 bytes
READY_TIMEOUT_S = 120.0


def _stall_readers(
    address: str, streams: int, channels: int, blocks: int, block: int, token: str
) -> None:
    namespace = Namespace("attack", KVLayout("float16", 2, 8, 64, block // _BYTES_PER_TOKEN))
    keys = block_keys(namespace, list(range(blocks * namespace.layout.block_tokens)))
    with Client(address, transport="grpc", timeout_s=60.0, auth_token=token) as client:
        ns_id = client.register_namespace(namespace).namespace_id
        client.put(ns_id, keys, [np.full(block, i, np.uint8) for i in range(blocks)])
    options = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.use_local_subchannel_pool", 1),  # a connection of its own per channel
    ]
    stubs = [
        pb_grpc.KVStoreStub(grpc.insecure_channel(address, options=options))
        for _ in range(channels)
    ]
    request = pb.GetRequest(namespace_id=ns_id, keys=keys)
    metadata = [("authorization", f"Bearer {token}")] if token else None
    calls = [stubs[i % channels].Get(request, metadata=metadata) for i in range(streams)]
    print(f"ready streams={len(calls)} channels={channels}", flush=True)
    _hold()


def _connect(target: str) -> socket.socket:
    if target.startswith("@"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(b"\0" + target[1:].encode())
        return sock
    host, _, port = target.rpartition(":")
    return socket.create_connection((host.strip("[]"), int(port)))


def _silent_sockets(target: str, num_sockets: int) -> None:
    sockets = {_connect(target) for _ in range(num_sockets)}
    print(f"ready sockets={len(sockets)}", flush=True)
    num_reopened = 0
    stop = _stdin_closed()
    while not stop.is_set():
        readable, _, _ = select.select(list(sockets), [], [], 0.1)
        for sock in readable:  # the node closed it (it never says anything else)
            sockets.discard(sock)
            sock.close()
            with contextlib.suppress(OSError):
                sockets.add(_connect(target))
                num_reopened += 1
    print(f"reopened={num_reopened}", flush=True)


def _stdin_closed() -> threading.Event:
    """Set once stdin closes (the process that started this one is done with it)."""
    closed = threading.Event()

    def watch() -> None:
        sys.stdin.buffer.read()
        closed.set()

    threading.Thread(target=watch, daemon=True).start()
    return closed


def _hold() -> None:
    _stdin_closed().wait()


@contextlib.contextmanager
def attack(kind: str, target: str, size: int, *flags: str) -> Iterator[str]:
    """Runs attack `kind` against `target` with `size` streams or sockets until the block
    ends; yields its `ready` line. Raises RuntimeError if it never gets ready."""
    assert kind in KINDS, f"unknown attack {kind!r}"
    count = "--streams" if kind == "stalled-readers" else "--sockets"
    cmd = [sys.executable, "-m", "kvstore.bench.attacks", kind, target, count, str(size), *flags]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    try:
        yield _ready_line(proc)
    finally:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _ready_line(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            raise RuntimeError(f"the attack never got ready (exit {proc.poll()})")
        if select.select([proc.stdout], [], [], remaining)[0]:
            line += os.read(proc.stdout.fileno(), 256)
    return line.decode().strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstore.bench.attacks", description=__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("target", help="the node's gRPC address, or a data plane's HOST:PORT")
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--channels", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block-bytes", type=parse_bytes, default=2 << 20)
    parser.add_argument("--sockets", type=int, default=256)
    parser.add_argument("--token", default="", help="bearer token of the readers")
    args = parser.parse_args(argv)
    if args.kind == "stalled-readers":
        _stall_readers(
            args.target, args.streams, args.channels, args.blocks, args.block_bytes, args.token
        )
    else:
        _silent_sockets(args.target, args.sockets)


if __name__ == "__main__":
    main()
