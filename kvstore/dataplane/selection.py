"""Which data plane a client opens: shared memory on the node's host, else UCX or a TCP
stream, whichever moves blocks faster from here.

Transport "auto" tries "shm" first: its handshake succeeds only where the node offers it,
and its connect only where the client reaches the node's abstract Unix socket, that is on
the node's host and in its network namespace. A client the node admitted but that could
not reach the socket is elsewhere and does not try shm again (an unclaimed admission costs
the node a connection slot until its hello deadline). Then, on a host with an RDMA device
(`/sys/class/infiniband`), UCX first (where ucxx is installed), then the node's tcp plane;
on a host without one the tcp plane first, then UCX: over TCP, UCX pays a tagged message
per block and moved 64-256 KiB gets at 0.2-0.5x what the tcp plane moves (`tcp.server`).
The second is tried only where the node refuses the first.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from kvstore import errors
from kvstore.dataplane.base import Admission, DataPlaneClient
from kvstore.dataplane.retry import REFUSALS
from kvstore.dataplane.shm.client import ShmClient
from kvstore.dataplane.tcp.client import TcpClient
from kvstore.dataplane.ucx.client import UcxClient
from kvstore.dataplane.ucx.runtime import client_net_devices, has_rdma_device, is_available

log = logging.getLogger("kvstore.dataplane")
# (transport, this client's address on it) -> the node's address, the admission
Handshake = Callable[[str, bytes], tuple[bytes, Admission]]


class Selection:
    """Opens data-plane connections to the node at `address` for transport `transport`
    ("auto", "shm", "ucx" or "tcp"), remembering what this process cannot reach."""

    def __init__(self, transport: str, address: str, timeout_s: float) -> None:
        self.transport = transport
        self.address = address
        self.timeout_s = timeout_s
        self.shm_reachable = transport in ("auto", "shm")

    @property
    def can_succeed(self) -> bool:
        """Whether a later try could connect from this process at all."""
        if self.transport == "ucx":
            return is_available()
        return self.shm_reachable or self.transport in ("auto", "tcp")

    def open(self, handshake: Handshake) -> DataPlaneClient:
        """A new connection; raises one of REFUSALS where none can be made now."""
        if self.shm_reachable:
            answered = []

            def shm_handshake(client_address: bytes) -> tuple[bytes, Admission]:
                admitted = handshake("shm", client_address)
                answered.append(True)
                return admitted

            try:
                return ShmClient(shm_handshake, self.timeout_s)
            except REFUSALS as exc:
                if self.transport == "shm":
                    raise
                if answered:  # admitted, but the socket is out of reach: another host
                    self.shm_reachable = False
                    log.info("event=shm_unreachable address=%s error=%s", self.address, exc)
        if self.transport == "shm":
            raise errors.UnavailableError(f"the shm data plane of {self.address} is out of reach")
        refused: Exception = errors.UnavailableError("ucxx is not installed here")
        planes = network_planes(self.transport, is_available(), has_rdma_device())
        for plane in planes:
            try:
                return self._connect(plane, handshake)
            except REFUSALS as exc:
                refused = exc
        raise refused

    def _connect(self, plane: str, handshake: Handshake) -> DataPlaneClient:
        if plane == "ucx":
            return UcxClient(
                lambda client_address: handshake("ucx", client_address),
                self.timeout_s,
                net_devices=client_net_devices(self.address),
            )
        host = self.address.rpartition(":")[0]
        return TcpClient(functools.partial(handshake, "tcp"), self.timeout_s, host)


def network_planes(transport: str, ucx_installed: bool, rdma_device: bool) -> list[str]:
    """The planes a client of `transport` tries after shm, in order: "auto" takes UCX first
    only on a host with an RDMA device (over TCP, the tcp plane is the faster one)."""
    if transport == "tcp":
        return ["tcp"]
    ucx = ["ucx"] if ucx_installed else []
    if transport == "ucx":
        return ucx
    return [*ucx, "tcp"] if rdma_device else ["tcp", *ucx]
