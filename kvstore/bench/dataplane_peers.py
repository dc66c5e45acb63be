"""Peer processes of the `dataplane` suite: raw TCP and raw ucxx block servers, and the
client-side drivers that time one batched put or get against each system.

A driver runs in its own spawned process (its own UCX settings), times `reps` batches per
cell and returns per-batch seconds; the suite turns those into rows.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import shutil
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from kvstore.checksum import checksum
from kvstore.dataplane.shm.crew import MIN_SHARED_BYTES, Crew, host_helpers
from kvstore.dataplane.shm.server import GET_SHARED_BYTES, get_helpers
from kvstore.dataplane.ucx.runtime import configure_ucx_env

Cell = tuple[str, int, int]  # op, block_bytes, batch
_REQ = struct.Struct("<cQQ")  # op, batch, block_bytes


MIN_CELL_S = 0.25  # a cell is timed over at least this long, as well as `reps` calls: the
# median of three 64 x 1 MiB gets (7 ms each) moved 10-20% between runs of the suite
MAX_REPS = 200


def _timed(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds of each call of `fn` after an untimed warm-up one: at least `reps` calls,
    and more while they add up to under MIN_CELL_S (at most MAX_REPS). A `fn` that returns
    a float timed itself (leaving out what it does around the call measured)."""
    fn()
    times: list[float] = []
    while len(times) < reps or (sum(times) < MIN_CELL_S and len(times) < MAX_REPS):
        start = time.perf_counter()
        took = fn()
        times.append(took if isinstance(took, float) else time.perf_counter() - start)
    return times


def wait_port(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Until something listens on `host`:`port` (OSError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_ready(address: str, timeout_s: float = 60.0) -> None:
    """Until the kvstore node at `address` says it is ready."""
    from kvstore.client import Client

    with Client(address) as client:
        client.wait_ready(timeout_s=timeout_s)


# -- memcpy ------------------------------------------------------------------------------


def copy_threads(op: str, nbytes: int) -> int:
    """How many threads kvstore's shared-memory plane copies a batch of `nbytes` with, on
    this host: a put's with the node's crew (the caller and a helper per further core, from
    `crew.MIN_SHARED_BYTES`), a get's with the helpers a get may take beside the client's
    check (`shm.server.get_helpers`, from `GET_SHARED_BYTES`)."""
    helpers, least = host_helpers(), MIN_SHARED_BYTES
    if op == "get":
        helpers, least = min(helpers, get_helpers(os.cpu_count() or 1)), GET_SHARED_BYTES
    return 1 + max(0, helpers) if nbytes >= least else 1


def drive_memcpy(cells: list[Cell], reps: int) -> dict[Cell, list[float]]:
    """One copy of every block of a batch, by as many threads as kvstore copies it with
    (`copy_threads`), so kvstore's copy is measured against a limit with the same threads."""
    out = {}
    crew = Crew.for_host()
    for op, size, batch in cells:
        src = [np.ones(size, np.uint8) for _ in range(batch)]
        dst = [np.empty(size, np.uint8) for _ in range(batch)]
        jobs = [functools.partial(np.copyto, d, s) for s, d in zip(src, dst, strict=True)]
        helpers = copy_threads(op, size * batch) - 1

        def copy(jobs: Sequence[Callable[[], None]] = jobs, helpers: int = helpers) -> None:
            crew.run(jobs, 0, least=0, most=helpers)

        out[op, size, batch] = _timed(copy, reps)
    crew.shutdown()
    return out


def drive_crc32c(cells: list[Cell], reps: int) -> dict[Cell, list[float]]:
    """CRC32C of every block of a batch on one core: what a data-plane client adds to a get
    to check the blocks it received (and a sender to a put), before any overlap."""
    out = {}
    for op, size, batch in cells:
        blocks = [np.ones(size, np.uint8) for _ in range(batch)]

        def sums(blocks: list[np.ndarray] = blocks) -> list[int]:
            return [checksum(b) for b in blocks]

        out[op, size, batch] = _timed(sums, reps)
    return out


# -- raw TCP -------------------------------------------------------------------------------


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def serve_tcp(port_queue: Any, host: str = "127.0.0.1") -> None:
    """Raw TCP peer on `host`: 'G' sends batch blocks, 'P' receives them and acks one byte;
    'p' also sums each block it received (CRC32C, as a kvstore node sums what it stores)."""
    buf = np.ones(0, np.uint8).data
    with socket.create_server((host, 0)) as server:
        port_queue.put(server.getsockname()[1])
        while True:  # one connection per driver cell
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buf = _serve_tcp_conn(conn, buf)


def _grown(pool: Any, nbytes: int) -> Any:
    """`pool`, or a bigger one of ones: a raw peer holds one batch of the largest cell yet."""
    return pool if len(pool) >= nbytes else np.ones(nbytes, np.uint8).data


def _serve_tcp_conn(conn: socket.socket, buf: memoryview) -> memoryview:
    head = bytearray(_REQ.size)
    while True:
        try:
            _recv_into(conn, memoryview(head))
        except ConnectionError:
            return buf
        op, batch, size = _REQ.unpack(head)
        buf = _grown(buf, batch * size)
        for i in range(batch):
            block = buf[i * size : (i + 1) * size]
            if op in b"Gg":
                conn.sendall(block)
                continue
            _recv_into(conn, block)
            if op == b"p":
                checksum(block)
        if op in b"Pp":
            conn.sendall(b"k")


def drive_tcp(
    address: tuple[str, int], cells: list[Cell], reps: int, summed: bool = False
) -> dict[Cell, list[float]]:
    """`summed`: every block is checked as kvstore checks it (CRC32C): a get's by the
    client as it lands, a put's by the client before it sends and by the peer on receipt."""
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = {}
    ack = bytearray(1)
    for op, size, batch in cells:
        bufs = [np.ones(size, np.uint8).data for _ in range(batch)]
        code = op[0].encode() if summed else op[0].upper().encode()

        def one(op: str = op, code: bytes = code, bufs: list[memoryview] = bufs) -> None:
            sock.sendall(_REQ.pack(code, len(bufs), len(bufs[0])))
            for b in bufs:
                if op == "get":
                    _recv_into(sock, b)
                if summed:
                    checksum(b)
                if op == "put":
                    sock.sendall(b)
            if op == "put":
                _recv_into(sock, memoryview(ack))

        out[op, size, batch] = _timed(one, reps)
    sock.close()
    return out


# -- raw ucxx ------------------------------------------------------------------------------

_TAG_HELLO, _TAG_REQ, _TAG_ACK, _TAG_BLOCK = 1, 2, 3, 1 << 32


def serve_ucxx(address_queue: Any) -> None:
    """Raw ucxx peer with the kvstore data plane's settings (worker address, no EH)."""
    configure_ucx_env()  # the same transports as the kvstore data plane
    import ucxx

    async def main() -> None:
        ucxx.init(progress_mode="thread", enable_python_future=True)  # as kvstore runs it
        address_queue.put(bytes(ucxx.get_worker_address()))
        hello = bytearray(1 << 16)
        await ucxx.recv(hello, tag=_TAG_HELLO)
        (n,) = struct.unpack_from("<Q", hello)
        addr = ucxx.get_ucx_address_from_buffer(bytes(hello[8 : 8 + n]))
        ep = await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)
        pool: Any = np.ones(0, np.uint8).data
        head = bytearray(_REQ.size)
        while True:
            await ucxx.recv(head, tag=_TAG_REQ)
            op, batch, size = _REQ.unpack(head)
            if batch == 0:
                return
            pool = _grown(pool, batch * size)
            blocks = [pool[i * size : (i + 1) * size] for i in range(batch)]
            if op == b"G":
                await asyncio.gather(
                    *(ep.send(b, tag=_TAG_BLOCK + i, force_tag=True) for i, b in enumerate(blocks))
                )
            else:
                await asyncio.gather(
                    *(ucxx.recv(b, tag=_TAG_BLOCK + i) for i, b in enumerate(blocks))
                )
                await ep.send(np.ones(1, np.uint8), tag=_TAG_ACK, force_tag=True)

    asyncio.run(main())


def drive_ucxx(server_address: bytes, cells: list[Cell], reps: int) -> dict[Cell, list[float]]:
    configure_ucx_env()  # the same transports as the kvstore data plane
    import ucxx

    async def main() -> dict[Cell, list[float]]:
        ucxx.init(progress_mode="thread", enable_python_future=True)  # as kvstore runs it
        addr = ucxx.get_ucx_address_from_buffer(server_address)
        ep = await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)
        mine = bytes(ucxx.get_worker_address())
        await ep.send(struct.pack("<Q", len(mine)) + mine, tag=_TAG_HELLO, force_tag=True)
        out = {}
        for op, size, batch in cells:
            bufs = [np.ones(size, np.uint8) for _ in range(batch)]
            times = []
            for _ in range(reps + 1):
                start = time.perf_counter()
                await ep.send(
                    _REQ.pack(op[0].upper().encode(), batch, size), tag=_TAG_REQ, force_tag=True
                )
                if op == "get":
                    await asyncio.gather(
                        *(ucxx.recv(b, tag=_TAG_BLOCK + i) for i, b in enumerate(bufs))
                    )
                else:
                    await asyncio.gather(
                        *(
                            ep.send(b, tag=_TAG_BLOCK + i, force_tag=True)
                            for i, b in enumerate(bufs)
                        )
                    )
                    await ucxx.recv(np.empty(1, np.uint8), tag=_TAG_ACK)
                times.append(time.perf_counter() - start)
            out[op, size, batch] = times[1:]
        await ep.send(_REQ.pack(b"G", 0, 0), tag=_TAG_REQ, force_tag=True)
        await asyncio.sleep(0.1)  # let the goodbye leave before the endpoint closes
        return out

    return asyncio.run(main())


# -- kvstore -------------------------------------------------------------------------------


def drive_kvstore(
    address: str, transport: str, cells: list[Cell], reps: int
) -> dict[Cell, list[float]]:
    from kvstore.client import Client
    from kvstore.keys import KVLayout, Namespace, block_keys

    out = {}
    seeds = iter(range(1, 1 << 30))  # the keys of a put's batch: never present before
    with Client(address, timeout_s=60.0, max_message_bytes=64 << 20, transport=transport) as client:
        for op, size, batch in cells:
            ns = Namespace(
                "bench-dataplane", KVLayout("float16", 4, 8, 128, size // (32 << 10) * 2)
            )
            assert client.register_namespace(ns).block_bytes == size, "layout math is off"
            # Memory the data plane moves blocks through with the fewest copies (shared
            # with a node on this host, as Mooncake's registered buffers), touched first.
            backing = client.buffer(size * batch)
            backing[:] = 1
            # One array of the batch's blocks: checked once per call, not per block.
            bufs = cast(Sequence[np.ndarray], backing.reshape(batch, size))

            def keys(seed: int, ns: Any = ns, batch: int = batch) -> list[bytes]:
                return block_keys(ns, np.arange(batch * ns.block_tokens) + seed * 10**7)

            if op == "get":
                fixed = keys(0)
                client.put(ns.id, fixed, bufs)
                get = functools.partial(client.get_into, ns.id, fixed, bufs)
                out[op, size, batch] = _timed(get, reps)
                client.remove(ns.id, fixed)
                continue

            def put(ns: Any = ns, bufs: Sequence[np.ndarray] = bufs, keys: Any = keys) -> float:
                fresh = keys(next(seeds))
                start = time.perf_counter()
                client.put(ns.id, fresh, bufs)
                elapsed = time.perf_counter() - start
                client.remove(ns.id, fresh)
                return elapsed

            out[op, size, batch] = _timed(put, reps)
    return out


# -- redis ---------------------------------------------------------------------------------


def drive_redis(address: tuple[str, int], cells: list[Cell], reps: int) -> dict[Cell, list[float]]:
    """LMCache's Redis backend: one pipeline of SET or GET per batch, bytes via redis-py."""
    import redis

    r = redis.Redis(host=address[0], port=address[1])
    out = {}
    for op, size, batch in cells:
        names = [f"blk:{size}:{i}" for i in range(batch)]
        value = np.ones(size, np.uint8).tobytes()
        bufs = [np.empty(size, np.uint8) for _ in range(batch)]

        def put(names: list[str] = names, value: bytes = value) -> None:
            pipe = r.pipeline(transaction=False)
            for n in names:
                pipe.set(n, value)
            pipe.execute()

        def get(names: list[str] = names, bufs: list[np.ndarray] = bufs) -> None:
            pipe = r.pipeline(transaction=False)
            for n in names:
                pipe.get(n)
            for data, buf in zip(pipe.execute(), bufs, strict=True):
                buf[:] = np.frombuffer(data, np.uint8)  # into the caller's buffer, as kvstore

        put()
        out[op, size, batch] = _timed(put if op == "put" else get, reps)
        r.delete(*names)
    return out


# -- Mooncake Store ------------------------------------------------------------------------


def mooncake_store(master: str, metadata: str, segment_bytes: int, hostname: str) -> Any:
    """A Mooncake Store client on `hostname` (its transfer engine's address) over TCP."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(hostname, metadata, segment_bytes, 512 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def serve_mooncake(master: str, metadata: str, ready: Any, hostname: str = "127.0.0.1") -> None:
    """A Mooncake store process on `hostname` that contributes a memory segment and idles."""
    store = mooncake_store(master, metadata, 3 << 30, hostname)
    ready.put("ready")
    while True:
        time.sleep(3600)
    del store


def drive_mooncake(
    master: str, metadata: str, hostname: str, cells: list[Cell], reps: int
) -> dict[Cell, list[float]]:
    """Mooncake Store over TCP: batch_get_into / batch_put_from a buffer of this process,
    registered with the store's transfer engine (on `hostname`)."""
    store = mooncake_store(master, metadata, 16 << 20, hostname)
    region = np.ones(max(size * batch for _, size, batch in cells), np.uint8)
    return _time_mooncake(store, region.ctypes.data, cells, reps)


def drive_mooncake_shm(real_client: str, cells: list[Cell], reps: int) -> dict[Cell, list[float]]:
    """Mooncake Store on one host at its own best: a dummy client (`setup_dummy`) whose
    buffer is allocated from its shared-memory pool (`alloc_from_mem_pool`), which the
    resource-owning real client (`mooncake_client`, holding the segment) maps, so a block is
    copied once between the pool and the segment (its `MC_STORE_MEMCPY`, on by default
    over TCP), as its own dummy-client tests do."""
    from mooncake.store import MooncakeDistributedStore

    nbytes = max(size * batch for _, size, batch in cells)
    store = MooncakeDistributedStore()
    rc = store.setup_dummy(nbytes + (64 << 20), 512 << 20, real_client)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup_dummy returned {rc}")
    base = store.alloc_from_mem_pool(nbytes)
    ctypes.memset(base, 1, nbytes)
    return _time_mooncake(store, base, cells, reps)


def _time_mooncake(store: Any, base: int, cells: list[Cell], reps: int) -> dict[Cell, list[float]]:
    """Every cell's batch_put_from / batch_get_into of blocks laid out from `base`."""
    store.register_buffer(base, max(size * batch for _, size, batch in cells))
    out = {}
    seeds = iter(range(1 << 30))
    for op, size, batch in cells:
        ptrs = [base + i * size for i in range(batch)]
        sizes = [size] * batch
        names = [f"blk:{size}:{i}" for i in range(batch)]

        def put(ptrs: list[int] = ptrs, sizes: list[int] = sizes, size: int = size) -> float:
            keys = [f"p{next(seeds)}:{size}:{i}" for i in range(len(ptrs))]
            start = time.perf_counter()
            rcs = store.batch_put_from(keys, ptrs, sizes)
            elapsed = time.perf_counter() - start
            assert all(rc == 0 for rc in rcs), f"batch_put_from: {rcs[:4]}"
            for k in keys:
                store.remove(k)
            return elapsed

        def get(names: list[str] = names, ptrs: list[int] = ptrs, sizes: list[int] = sizes) -> None:
            got = store.batch_get_into(names, ptrs, sizes)
            assert all(n == s for n, s in zip(got, sizes, strict=True)), f"get: {got[:4]}"

        if op == "get":
            rcs = store.batch_put_from(names, ptrs, sizes)
            assert all(rc == 0 for rc in rcs), f"batch_put_from: {rcs[:4]}"
        out[op, size, batch] = _timed(put if op == "put" else get, reps)
        for n in names if op == "get" else ():
            store.remove(n)
    store.unregister_buffer(base)
    return out


MOONCAKE_LIBS = {"ibverbs": "libibverbs1", "rdmacm": "librdmacm1", "numa": "libnuma1"}


def mooncake_missing() -> str | None:
    """What to install before the Mooncake Store peer can run, or None when nothing."""
    import ctypes.util
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake Store needs its package: pip install 'kvstore[peers]'"
    debs = [deb for lib, deb in MOONCAKE_LIBS.items() if ctypes.util.find_library(lib) is None]
    if debs:
        return f"Mooncake Store needs Debian's {' '.join(debs)}: apt-get install {' '.join(debs)}"
    for binary in (mooncake_master(), mooncake_client()):
        if not os.path.exists(binary):
            return f"Mooncake Store needs {os.path.basename(binary)}: pip install 'kvstore[peers]'"
    return None


def mooncake_master() -> str:
    return _mooncake_binary("mooncake_master")


def mooncake_client() -> str:
    """Mooncake Store's resource-owning real client, which dummy clients on its host use."""
    return _mooncake_binary("mooncake_client")


def _mooncake_binary(name: str) -> str:
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return shutil.which(name) or beside
