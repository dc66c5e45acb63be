"""A client of a global pool of nodes (`kvstore serve --cluster`). A read takes what its
home node (the first seed that answers: the node beside the engine) holds of a chain
first, and where that is not all, asks the home node where the rest is (`Locate`: one Redis
round on that node, which maps the caller's namespace through its tenancy, so this client
needs no Redis credentials), then reads each block from a node that holds it, several
nodes at once, each over its own best plane (`Client`: shared memory with a node on this
host, TCP or UCX elsewhere). A chain its home node holds whole costs no lookup.

Hot chains get copies, within a budget: a chain this client read from other nodes
`hot_reads` times while fewer than `max_copies` nodes held every block of it is put once
more, off the read path, from the blocks just read: on the home node where that does not
hold it (its next reads are local), else on another live node. `hot_reads=0` turns that
off.

Puts are placed (`kvstore.client.placement`): a chain is cut into pieces that never
straddle a chain group, each put on the node its first key hashes to, weighted by the
nodes' capacities (the writer's home node where it is one of the two best), all pieces at
once; a piece whose node fails goes to the next node. A piece whose parent another node
holds states its place in the chain, so its node files it where lookups find it. The
index learns of a put off the request path (within the nodes' flush interval), so this
client remembers where it put its last `MAX_PUT_KEYS` blocks, and its own reads and
matches find them there at once (read your writes); a block gone since is a miss.

Every read of a node is bounded by `read_deadline_s`. A node that fails or runs past it is
left out for `quarantine_s` (no call dials it meanwhile) and its blocks are read from
their next holder; what no live holder gives back is a miss. Nothing a node or Redis does
raises out of `locate`, `match`, `get` or `get_into`: it becomes misses, and the caller
recomputes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore import errors
from kvstore.client import placement
from kvstore.client.client import Client
from kvstore.client.common import Buffer, GetResult, check_blocks
from kvstore.dataplane.base import DataPlaneClient
from kvstore.dataplane.buffers import as_transfer_buffer
from kvstore.keys import ChainPosition, Namespace
from kvstore.results import Located, MatchResult, NamespaceInfo, PutResult

log = logging.getLogger("kvstore.client")
# What a node that fails does to a call: typed errors, and what gRPC or a socket raise.
NODE_FAILURES = (errors.KVStoreError, grpc.RpcError, OSError)
SPREAD_BLOCKS = 32  # consecutive blocks read from one holder where several hold them
HOT_READS = 2  # reads of a chain that make it hot
MAX_COPIES = 2  # holders a hot chain is copied up to: the replica budget
MAX_TRACKED = 4096  # chains whose reads are counted (the least recent forgotten)
MEMBERS_TTL_S = 1.0  # how long the pool's member list is taken as current
MAX_PUT_KEYS = 65_536  # blocks this client put whose node it remembers (read your writes)


class PoolClient:
    """Blocking client of the pool that `seeds` ("host:port" of any of its nodes) reach.
    `client_kwargs` are `Client`'s (transport, auth_token, TLS files) for every node."""

    def __init__(
        self,
        seeds: str | Sequence[str],
        read_deadline_s: float = 2.0,
        quarantine_s: float = 5.0,
        max_parallel: int = 8,
        hot_reads: int = HOT_READS,
        max_copies: int = MAX_COPIES,
        **client_kwargs: Any,
    ) -> None:
        self.seeds = [seeds] if isinstance(seeds, str) else list(seeds)
        assert self.seeds, "a pool client needs at least one seed"
        self.read_deadline_s = read_deadline_s
        self.quarantine_s = quarantine_s
        self._kwargs = {"timeout_s": read_deadline_s, **client_kwargs}
        self._lock = threading.Lock()
        self._clients: dict[str, Client] = {}  # by gRPC address
        self._namespaces: dict[bytes, Namespace] = {}  # by id: to register on nodes met
        self._registered: set[tuple[str, bytes]] = set()  # (address, namespace id)
        self._failing: dict[str, float] = {}  # address -> left out until (monotonic)
        self._readers = concurrent.futures.ThreadPoolExecutor(
            max_parallel, thread_name_prefix="kvstore-pool-read"
        )
        self.hot_reads = hot_reads
        self.max_copies = max_copies
        self.num_copies = 0  # hot chains copied to another node
        self._reads: OrderedDict[tuple[bytes, bytes], int] = OrderedDict()  # chain -> reads
        self._copying: set[tuple[bytes, bytes]] = set()
        self._members: tuple[float, dict[str, int]] = (0.0, {})  # read at, capacities
        self._put_at: OrderedDict[tuple[bytes, bytes], str] = OrderedDict()  # -> address
        self._copier = concurrent.futures.ThreadPoolExecutor(1, "kvstore-pool-copy")

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    @property
    def failing_nodes(self) -> list[str]:
        """The nodes left out now (their gRPC addresses)."""
        now = time.monotonic()
        with self._lock:
            return sorted(a for a, until in self._failing.items() if until > now)

    def data_plane(self) -> DataPlaneClient | None:
        """The home node's data-plane connection (made now: not inside a first request)."""
        return self._client(self._home()).data_plane()

    def node(self, address: str) -> Client:
        """The client of the node at `address` ("host:port"), the one this pool client
        reads and puts through (made once)."""
        return self._client(address)

    # -- control -------------------------------------------------------------------------

    def register_namespace(self, namespace: Namespace) -> NamespaceInfo:
        """Registers `namespace` on the home node (and on every node later read from);
        raises what the home node raises."""
        info = self._on_home(lambda client: client.register_namespace(namespace))
        with self._lock:
            self._namespaces[info.namespace_id] = namespace
        return info

    def locate(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> Located:
        """Where each block of the longest prefix of `keys` is held; empty where no node
        answers. `position`: where `keys[0]` sits in its chain where it is not the root
        (`ChainPosition.of`); the same for `match`, `get` and `get_into`."""
        try:
            return self._on_home(lambda client: client.locate(namespace_id, keys, position))
        except NODE_FAILURES as exc:
            log.info("event=pool_locate_failed error=%s", exc)
            return Located((), ())

    def match(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> MatchResult:
        """The longest prefix of `keys` the pool holds: what the home node holds of it, and
        the rest located (no lookup where the home node holds it all)."""
        return self.match_from_home(namespace_id, keys, position)[0]

    def match_from_home(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> tuple[MatchResult, int]:
        """`match`, and how many of its leading blocks the home node holds (the rest are on
        other nodes)."""
        try:
            local = self._on_home(lambda client: client.match(namespace_id, keys))
        except NODE_FAILURES as exc:
            log.info("event=pool_match_failed error=%s", exc)
            local = MatchResult(0, ())
        start = local.num_matched
        if start == len(keys):
            return local, start
        rest = self.locate(namespace_id, keys[start:], ChainPosition.of(keys, start, position))
        tiers = local.tiers + tuple(block[0][1] for block in rest.blocks)
        for key in keys[len(tiers) :]:  # put by this client, maybe not in the index yet
            address = self._put_address(namespace_id, key)
            if address is None or self._is_failing(address):
                break
            tiers += ("dram",)  # a put lands in its node's DRAM
        return MatchResult(len(tiers), tiers), start

    def put_chain(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        parent: bytes | None = None,
        position: ChainPosition | None = None,
    ) -> PutResult:
        """Puts consecutive blocks of one chain that continues after `parent`, placed over
        the pool's live nodes. `position`: where `keys[0]` sits in its chain
        (`ChainPosition.of`); a put with a parent and no position continues its chain on
        the home node. Where no piece was stored, raises what a node that refused one raised, or
        `UnavailableError`."""
        check_blocks(keys, blocks)
        if parent is not None and position is None:
            return self._on_home(
                lambda client: client.put_chain(namespace_id, keys, blocks, parent)
            )
        home = self._home()
        members = {a: c for a, c in self._live_members().items() if not self._is_failing(a)}
        pieces = placement.place(keys, position, members, home)
        results = self._put_pieces(namespace_id, keys, blocks, parent, pieces)
        failed = [p for p, result in zip(pieces, results, strict=True) if result is None]
        if failed:  # placed again without the nodes that failed (home where none is left)
            members = {a: c for a, c in members.items() if not self._is_failing(a)}
            again = [
                p._replace(
                    address=placement.choose(keys[p.start], members, home) if members else home
                )
                for p in failed
            ]
            results = [r for r in results if r is not None]
            results += self._put_pieces(namespace_id, keys, blocks, parent, again)
        done = [r for r in results if isinstance(r, PutResult)]
        if done:
            return PutResult(*(sum(column) for column in zip(*done, strict=True)))
        refused = [r for r in results if isinstance(r, BaseException)]
        raise refused[0] if refused else errors.UnavailableError("no node took the put")

    def _put_pieces(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        blocks: Sequence[Buffer],
        parent: bytes | None,
        pieces: Sequence[placement.Piece],
    ) -> list[PutResult | BaseException | None]:
        """Each piece put on its node, at once; what each returned, or raised where the
        node answered and refused (None where the node failed, and is left out)."""

        def put(piece: placement.Piece) -> PutResult | BaseException | None:
            first_parent = parent if piece.start == 0 else keys[piece.start - 1]
            run = slice(piece.start, piece.stop)
            try:
                client = self._client(piece.address)
                self._register(client, piece.address, namespace_id)
                result = client.put_chain(
                    namespace_id, keys[run], blocks[run], first_parent, piece.position
                )
                self._note_put(namespace_id, keys[run], piece.address)
                return result
            except NODE_FAILURES as exc:
                if _is_refusal(exc):
                    return exc
                self._leave_out(piece.address, exc)
                return None

        if len(pieces) == 1:
            return [put(pieces[0])]
        return list(self._readers.map(put, pieces))

    # -- reads ---------------------------------------------------------------------------

    def get_into(
        self,
        namespace_id: bytes,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        position: ChainPosition | None = None,
    ) -> tuple[bool, ...]:
        """Reads the prefix of `keys` the pool holds into `buffers` (one per key, the block
        size each): what the home node holds first, then the rest located and read from
        every holder at once; returns which keys were read."""
        if not keys:
            return ()
        home = self._home()
        found = [False] * len(keys)
        if not self._is_failing(home):
            found = list(self._read(home, namespace_id, keys, buffers, list(range(len(keys)))))
        start = next((i for i, hit in enumerate(found) if not hit), len(found))
        if start == len(keys):
            return tuple(found)
        at = ChainPosition.of(keys, start, position)
        located = self.locate(namespace_id, keys[start:], at)
        todo: dict[int, list[str]] = {}
        for i in range(start, len(keys)):
            holders = self._holders(located, i - start) if i - start < located.num_located else []
            mine = self._put_address(namespace_id, keys[i])  # this client's put: there too
            if mine is not None and mine not in holders:
                holders.append(mine)
            if not holders:
                break  # nobody holds block i: nothing after it is a prefix hit
            if not found[i]:
                todo[i] = [a for a in holders if a != home]
        while todo:
            plan: dict[str, list[int]] = {}
            for i, holders in todo.items():
                live = [a for a in holders if not self._is_failing(a)]
                if live:  # spread over the live holders: replicas load in parallel
                    plan.setdefault(live[(i // SPREAD_BLOCKS) % len(live)], []).append(i)
            if not plan:
                break
            for address, ids, hits in self._read_all(plan, namespace_id, keys, buffers):
                for i, hit in zip(ids, hits, strict=True):
                    found[i] = found[i] or hit
                    todo[i] = [a for a in todo[i] if a != address]
            todo = {i: holders for i, holders in todo.items() if not found[i] and holders}
        read = next((i for i, hit in enumerate(found) if not hit), len(found))
        indexed = min(read, located.num_located)  # this client's newest puts may be past it
        if indexed and start == 0 and position is None and self.hot_reads > 0:
            self._note_read(namespace_id, keys[:indexed], located, buffers)  # a remote chain
        return tuple(found)

    def get(
        self, namespace_id: bytes, keys: Sequence[bytes], position: ChainPosition | None = None
    ) -> GetResult:
        """The located prefix of `keys`, read from the pool; misses are None."""
        block_bytes = self._block_bytes(namespace_id)
        buffers = [bytearray(block_bytes) for _ in keys]
        found = self.get_into(namespace_id, keys, buffers, position)
        return GetResult(tuple(b if hit else None for b, hit in zip(buffers, found, strict=True)))

    def _read_all(
        self,
        plan: dict[str, list[int]],
        namespace_id: bytes,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
    ) -> list[tuple[str, list[int], tuple[bool, ...]]]:
        """Every node's share of `plan` read, at once (on this thread where one node has it
        all); (address, block indexes, hits) each."""
        if len(plan) == 1:
            ((address, ids),) = plan.items()
            return [(address, ids, self._read(address, namespace_id, keys, buffers, ids))]
        jobs = {
            self._readers.submit(self._read, address, namespace_id, keys, buffers, ids): (
                address,
                ids,
            )
            for address, ids in plan.items()
        }
        done = []
        for job in concurrent.futures.as_completed(jobs):
            address, ids = jobs[job]
            done.append((address, ids, job.result()))
        return done

    def _read(
        self,
        address: str,
        namespace_id: bytes,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        ids: list[int],
    ) -> tuple[bool, ...]:
        """Blocks `ids` from the node at `address`; all misses (and the node left out) where
        it fails or runs past the read deadline."""
        started = time.monotonic()
        try:
            client = self._client(address)
            self._register(client, address, namespace_id)
            hits = client.get_into(namespace_id, [keys[i] for i in ids], [buffers[i] for i in ids])
        except NODE_FAILURES as exc:
            self._leave_out(address, exc)
            return (False,) * len(ids)
        if time.monotonic() - started > self.read_deadline_s:
            self._leave_out(address, TimeoutError("read past its deadline"))
        return hits

    # -- hot chains ----------------------------------------------------------------------

    def _note_read(
        self, namespace_id: bytes, keys: Sequence[bytes], located: Located, buffers: Sequence[Any]
    ) -> None:
        """Counts a read of chain `keys`; copies it to one more node once it is hot."""
        holders = [
            {located.nodes[n].addresses.get("grpc", "") for n, _ in b} for b in located.blocks
        ]
        if min(len(h) for h in holders[: len(keys)]) >= self.max_copies:
            return
        chain = (namespace_id, keys[-1])
        with self._lock:
            reads = self._reads.pop(chain, 0) + 1
            self._reads[chain] = reads
            if len(self._reads) > MAX_TRACKED:
                self._reads.popitem(last=False)
            if reads < self.hot_reads or chain in self._copying:
                return
            self._copying.add(chain)
        held = set().union(*holders[: len(keys)])
        targets = [a for a in self._live_members() if a not in held and not self._is_failing(a)]
        if not targets:
            with self._lock:
                self._copying.discard(chain)
            return
        home = self._home()  # its next reads of the chain are then local
        target = home if home in targets else targets[hash(chain) % len(targets)]
        views = [as_transfer_buffer(b, writable=False) for b in buffers[: len(keys)]]
        if any(v.is_device for v in views):  # copies are made from host memory only
            with self._lock:
                self._copying.discard(chain)
            return
        blocks = [bytes(v.obj) for v in views]  # the caller reuses its buffers
        self._copier.submit(self._copy, target, namespace_id, list(keys), blocks, chain)

    def _copy(
        self,
        address: str,
        namespace_id: bytes,
        keys: list[bytes],
        blocks: list[bytes],
        chain: tuple[bytes, bytes],
    ) -> None:
        try:
            client = self._client(address)
            self._register(client, address, namespace_id)
            client.put_chain(namespace_id, keys, blocks)
            self.num_copies += 1
            log.info("event=pool_hot_copy address=%s blocks=%d", address, len(keys))
        except NODE_FAILURES as exc:
            self._leave_out(address, exc)
        finally:
            with self._lock:
                self._copying.discard(chain)
                self._reads.pop(chain, None)

    def _live_members(self) -> dict[str, int]:
        """The pool's live members as the home node last said: gRPC address -> capacity
        (bytes, all tiers)."""
        read_at, members = self._members
        if time.monotonic() - read_at < MEMBERS_TTL_S:
            return members
        try:
            report = self._on_home(lambda client: client.pool_status())
        except NODE_FAILURES:
            return {}
        members = {
            m.addresses["grpc"]: sum(m.capacity.values())
            for m in report.members
            if m.addresses.get("grpc")
        }
        self._members = (time.monotonic(), members)
        return members

    # -- nodes ---------------------------------------------------------------------------

    def _holders(self, located: Located, i: int) -> list[str]:
        """The gRPC addresses of block i's holders, fastest tier first ("" in a node's
        answer: the node asked, home)."""
        addresses = []
        for node, _ in located.blocks[i]:
            address = located.nodes[node].addresses.get("grpc", "") or self._home()
            if address not in addresses:
                addresses.append(address)
        return addresses

    def _home(self) -> str:
        """The first seed not left out (the first of all where every one is)."""
        return next((s for s in self.seeds if not self._is_failing(s)), self.seeds[0])

    def _on_home(self, call: Any) -> Any:
        """`call(client)` on the home node, then on the other seeds where it fails (none
        left out is dialled: `UnavailableError` where every seed is)."""
        last: BaseException = errors.UnavailableError("every seed is left out for now")
        for address in dict.fromkeys([self._home(), *self.seeds]):
            if self._is_failing(address):
                continue
            try:
                return call(self._client(address))
            except NODE_FAILURES as exc:
                if _is_refusal(exc):
                    raise  # the node answered: the call itself was refused
                self._leave_out(address, exc)
                last = exc
        raise last

    def _client(self, address: str) -> Client:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = Client(address, **self._kwargs)
            return client

    def _register(self, client: Client, address: str, namespace_id: bytes) -> None:
        with self._lock:
            namespace = self._namespaces.get(namespace_id)
            known = (address, namespace_id) in self._registered
        if namespace is None or known:
            return
        client.register_namespace(namespace)
        with self._lock:
            self._registered.add((address, namespace_id))

    def _block_bytes(self, namespace_id: bytes) -> int:
        with self._lock:
            namespace = self._namespaces.get(namespace_id)
        if namespace is None:
            raise errors.UnknownNamespaceError("register the namespace with this client first")
        return namespace.block_bytes

    def _note_put(self, namespace_id: bytes, keys: Sequence[bytes], address: str) -> None:
        with self._lock:
            for key in keys:
                self._put_at[(namespace_id, key)] = address
                self._put_at.move_to_end((namespace_id, key))
            while len(self._put_at) > MAX_PUT_KEYS:
                self._put_at.popitem(last=False)

    def _put_address(self, namespace_id: bytes, key: bytes) -> str | None:
        """Where this client last put `key` (None: not among its last puts)."""
        with self._lock:
            return self._put_at.get((namespace_id, key))

    def _is_failing(self, address: str) -> bool:
        with self._lock:
            return self._failing.get(address, 0.0) > time.monotonic()

    def _leave_out(self, address: str, exc: BaseException) -> None:
        with self._lock:
            self._failing[address] = time.monotonic() + self.quarantine_s
        log.info("event=pool_node_left_out address=%s error=%s", address, exc)


def _is_refusal(exc: BaseException) -> bool:
    """Whether a node answered and refused the call (not failed to answer)."""
    return isinstance(exc, errors.KVStoreError) and not isinstance(
        exc, errors.UnavailableError | errors.DeadlineExceededError
    )
