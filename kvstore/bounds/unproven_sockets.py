"""Sockets a data plane accepted that have not proven themselves yet: no hello has claimed an
admission on them. They are bounded on their own, in all and per address, so they never
take an admitted client's place: admitted connections are counted by their admission (the
authenticated gRPC handshake), not here.

Past a bound a newcomer is not refused: the oldest *silent* socket of the same address (or,
past the bound in all, of any) is shed to make room, so a flood of sockets that never speak
cannot keep a client that does speak out. Silent means nothing of it is waiting to be read;
a client's hello follows its connect at once, so only a socket that sent nothing, or part of
a hello its thread already read, is shed (one shed in the instant between its hello being
read and checked claims nothing: its client says hello again on a new socket). Where every
socket in the way has bytes waiting, the newcomer is refused (closed). Safe to use from any
thread.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import socket
import termios
import threading

log = logging.getLogger("kvstore.dataplane")


class UnprovenSockets:
    """The unproven sockets of data plane `plane` (logs, metrics), at most `max_sockets` in
    all and `max_per_peer` from one address (a Unix socket's peer is None: only the first
    bound applies)."""

    def __init__(self, plane: str, max_sockets: int, max_per_peer: int) -> None:
        assert 1 <= max_per_peer <= max_sockets, "bounds need 1 <= per peer <= in all"
        self.plane = plane
        self.max_sockets = max_sockets
        self.max_per_peer = max_per_peer
        self.num_shed = 0  # silent sockets closed to make room, since start
        self._lock = threading.Lock()
        self._peers: dict[socket.socket, str | None] = {}  # oldest first

    def __len__(self) -> int:
        with self._lock:
            return len(self._peers)

    def __contains__(self, sock: object) -> bool:
        with self._lock:
            return sock in self._peers

    def admit(self, sock: socket.socket, peer: str | None) -> bool:
        """Counts a newly accepted socket from `peer`, shedding a silent one where a bound is
        reached; False (nothing counted) where none of those in the way is silent."""
        with self._lock:
            crowd = self._crowd(peer)
            victim = self._silent(crowd) if crowd else None
            if crowd and victim is None:
                return False
            if victim is not None:
                del self._peers[victim]
                self.num_shed += 1
            self._peers[sock] = peer
        if victim is not None:
            with contextlib.suppress(OSError):  # its thread wakes and ends
                victim.shutdown(socket.SHUT_RDWR)
            # Debug: a flood sheds thousands a second; `kvstore_shed_sockets` counts them.
            log.debug("event=%s_shed_socket peer=%s", self.plane, peer)
        return True

    def prove(self, sock: socket.socket) -> bool:
        """Takes `sock` out: its hello arrived and is checked now. False if it was shed
        meanwhile (the hello must not be honoured: the socket is closing)."""
        with self._lock:
            if sock not in self._peers:
                return False
            del self._peers[sock]
            return True

    def discard(self, sock: socket.socket) -> None:
        """Forgets `sock` (it is closing); idempotent."""
        with self._lock:
            self._peers.pop(sock, None)

    def _crowd(self, peer: str | None) -> list[socket.socket]:
        """The sockets a newcomer from `peer` would be one too many among (none: room)."""
        if peer is not None:
            same = [s for s, p in self._peers.items() if p == peer]
            if len(same) >= self.max_per_peer:
                return same
        return list(self._peers) if len(self._peers) >= self.max_sockets else []

    def _silent(self, candidates: list[socket.socket]) -> socket.socket | None:
        """The oldest of `candidates` with nothing waiting to be read."""
        return next((sock for sock in candidates if not _has_bytes(sock)), None)


def _has_bytes(sock: socket.socket) -> bool:
    """Whether `sock` holds bytes not read yet; asked without waiting (a closed socket has
    none)."""
    pending = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, pending)
    except (OSError, ValueError):
        return False
    return pending[0] > 0
