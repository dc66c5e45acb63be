"""What the node's socket-served data planes share (`shm.server`, `tcp.server`): a listener,
a thread per accepted socket, admission through the gRPC handshake, the hello that claims
an admission with its secret, and the deadlines that drop silent connections.

Admission is the UCX plane's: the gRPC handshake (`DataPlaneInfo`) gives the client a
connection id and secret and counts the connection against the same bounds
(`connections`); the client then connects to the listener and says hello with the secret.
A socket that does not claim a live admission by `hello_timeout_s` is closed; an
admission no socket claims is dropped at the same deadline; a connection silent for
`idle_timeout_s` too. Sockets that said no hello yet are bounded on their own
(`kvstore.bounds.UnprovenSockets`: in all, and per address for a network listener), apart
from admitted connections: past a bound the oldest silent one is shed, so sockets that never
say hello cannot keep an admitted client from claiming its admission. A socket that claimed
one is counted by its admission (`connections`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from abc import abstractmethod

from kvstore import errors
from kvstore.bounds import UnprovenSockets
from kvstore.dataplane.base import Admission, DataPlaneServer, ServerSettings
from kvstore.dataplane.connections import Connection, Connections
from kvstore.dataplane.sockets import messages as socket_messages
from kvstore.metrics import CallMetrics
from kvstore.store import Store
from kvstore.tenancy import Tenants

log = logging.getLogger("kvstore.dataplane")
REAP_PERIOD_S = 1.0


class SocketServer(DataPlaneServer):
    """Serves `store` on `listener` (bound and listening), a thread per socket; subclasses
    say what a connection does once accepted (`_session`). `plane` names it in logs and
    metrics."""

    plane = ""

    def __init__(
        self,
        store: Store,
        listener: socket.socket,
        settings: ServerSettings | None = None,
        metrics: CallMetrics | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.store = store
        self.tenants = tenants or Tenants(None)
        self.settings = settings or ServerSettings()
        self.metrics = metrics
        self._connections = Connections(self.settings)
        self._max_message = socket_messages.max_message_bytes(store.config.max_batch_keys)
        self._listener = listener
        self._lock = threading.Lock()
        self._unproven = UnprovenSockets(
            self.plane,
            self.settings.max_unproven_sockets,
            self.settings.max_unproven_sockets_per_peer,
        )
        self._sockets: set[socket.socket] = set()  # open, said hello or not
        self._bound: dict[int, socket.socket] = {}  # connection id -> its socket
        self._serving: set[threading.Thread] = set()  # a thread per open socket
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._accept_forever, name=f"kvstore-{self.plane}-accept", daemon=True
            ),
            threading.Thread(
                target=self._reap_forever, name=f"kvstore-{self.plane}-reap", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    @property
    def unproven(self) -> UnprovenSockets:
        return self._unproven

    @property
    def num_sockets(self) -> int:
        """Open sockets, whether they said hello or not."""
        with self._lock:
            return len(self._sockets)

    def connect(self, client_address: bytes, peer: str, tenant: str = "") -> Admission:
        if client_address:
            raise errors.InvalidArgumentError(
                f"a {self.plane} client sends no address (it connects)"
            )
        conn = self._connections.admit(peer, self.store, self.tenants.caller(tenant, peer))
        log.info("event=%s_admit client=%d peer=%s", self.plane, conn.client_id, peer)
        return Admission(conn.client_id, conn.tags.secret)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=self.settings.timeout_s)
        with self._lock:
            open_sockets, serving = list(self._sockets), list(self._serving)
        for sock in open_sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its thread wakes, ends its call, exits
        for thread in serving:
            thread.join(timeout=self.settings.timeout_s)
        for client_id in self._connections.ids():
            self._connections.pop(client_id)

    def reap(self, now: float | None = None) -> int:
        """Drops connections past their deadline: admissions no socket claimed in time and
        silent sockets. Runs every second on its own; returns how many."""
        now = time.monotonic() if now is None else now
        late = self._connections.late(now)
        for client_id in late:
            self._connections.pop(client_id)
            with self._lock:
                sock = self._bound.pop(client_id, None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            log.info("event=%s_disconnect client=%d reason=idle", self.plane, client_id)
        return len(late)

    def _reap_forever(self) -> None:
        while not self._stopped.wait(REAP_PERIOD_S):
            self.reap()

    def _accept_forever(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return  # stopped
            peer = address[0] if isinstance(address, tuple) else None
            thread = threading.Thread(
                target=self._serve, args=(sock,), name=f"kvstore-{self.plane}-conn", daemon=True
            )
            if not self._unproven.admit(sock, peer):  # every one in the way is mid-hello
                sock.close()
                continue
            with self._lock:
                self._sockets.add(sock)
                self._serving.add(thread)
            thread.start()

    # -- a connection --------------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        claimed: list[Connection] = []  # the connection the socket's hello claimed
        try:
            sock.settimeout(self.settings.hello_timeout_s)
            self._session(sock, claimed)
        except (OSError, ConnectionError, errors.KVStoreError) as exc:
            # The peer went, fell silent, sent a message past the limit or a bad hello. A
            # socket that claimed nothing logs at debug: a flood of them would fill the log.
            if claimed:
                log.info(
                    "event=%s_disconnect client=%d reason=%s", self.plane, claimed[0].client_id, exc
                )
            else:
                log.debug("event=%s_disconnect client=- reason=%s", self.plane, exc)
        except Exception:
            log.exception("event=%s_error", self.plane)
        finally:
            if claimed:
                self._drop(claimed[0].client_id)
            self._unproven.discard(sock)
            with self._lock:
                self._sockets.discard(sock)
                self._serving.discard(threading.current_thread())
            sock.close()

    @abstractmethod
    def _session(self, sock: socket.socket, claimed: list[Connection]) -> None:
        """Serves one accepted socket until its client closes (raising on anything that
        ends it otherwise); appends the connection its hello claimed (`_claim`) to
        `claimed`."""

    def _claim(self, sock: socket.socket, client_id: int, secret: bytes) -> Connection:
        """The admission `client_id` bound to `sock` if `secret` is its secret and no other
        socket claimed it; PermissionDeniedError otherwise. Either way `sock` leaves the
        unproven sockets; a socket shed while its hello arrived claims nothing."""
        if not self._unproven.prove(sock):
            raise ConnectionAbortedError("shed before its hello was checked")
        conn = self._connections.get(client_id)
        with self._lock:
            claimed = client_id in self._bound
            if conn is None or claimed or not hmac.compare_digest(secret, conn.tags.secret):
                raise errors.PermissionDeniedError("no data-plane connection has that secret")
            self._bound[client_id] = sock
        return conn

    def _drop(self, client_id: int) -> None:
        """Forgets a connection and the socket bound to it."""
        self._connections.pop(client_id)
        with self._lock:
            self._bound.pop(client_id, None)

    def _next_message(self, sock: socket.socket, conn: Connection) -> tuple[memoryview, list[int]]:
        """The connection's next message, its idle deadline moved past it."""
        message = socket_messages.receive(sock, self._max_message)
        conn.deadline = time.monotonic() + self.settings.idle_timeout_s
        return message
