"""Where a bench's node side and client side run: one host over loopback, or two hosts made
of network namespaces joined by a veth pair, so bytes cross a real network stack between
distinct addresses (`kvstore-bench dataplane --hosts netns`).

The namespaces are the bench's own: created on entry, each holding one end of the veth
pair and its loopback, with one /30 between them and no other route, and deleted on exit
(the veth pair goes with them). Before anything runs, the route from each side to the
other is checked to leave through the pair: no byte can leave the machine. Needs root
(`ip netns`).

A Python process joins a namespace with `enter` (the `setns` call, before it opens a
socket); a command, by running under `ip netns exec` (`Hosts.node_command`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000  # <sched.h>
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2  # <sys/mount.h>
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Hosts:
    """The node side's and the client side's namespace (None: this process's) and address."""

    name: str = "one"
    node_ns: str | None = None
    client_ns: str | None = None
    node_addr: str = LOOPBACK
    client_addr: str = LOOPBACK

    def node_command(self, cmd: list[str]) -> list[str]:
        """`cmd`, run in the node side's namespace."""
        return _in_namespace(self.node_ns, cmd)

    def client_command(self, cmd: list[str]) -> list[str]:
        """`cmd`, run in the client side's namespace."""
        return _in_namespace(self.client_ns, cmd)


def _in_namespace(ns: str | None, cmd: list[str]) -> list[str]:
    return cmd if ns is None else ["ip", "netns", "exec", ns, *cmd]


ONE_HOST = Hosts()


def enter(ns: str | None) -> None:
    """Moves this process (every socket it opens from now on) into namespace `ns`, with
    the namespace's own /sys, as `ip netns exec` does: UCX finds its network devices in
    /sys/class/net, and the host's list would name devices the namespace does not have."""
    if ns is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns into {ns}")
    finally:
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "make / a slave")
    _check(libc.umount2(b"/sys", MNT_DETACH), "detach /sys")
    _check(libc.mount(ns.encode(), b"/sys", b"sysfs", 0, None), "mount the namespace's /sys")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def call_in(ns: str | None, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in namespace `ns`: a target for a spawned process."""
    enter(ns)
    return fn(*args)


def call_from(ns: str | None, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` here where `ns` is None, else in a process spawned into namespace `ns`
    (this process never opens a socket toward an address of the bench's namespaces: from
    here, unrouted, it would leave the machine)."""
    if ns is None:
        return fn(*args)
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(call_in, (ns, fn, *args))


def missing() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "--hosts netns needs iproute2's `ip`: apt-get install iproute2"
    if os.geteuid() != 0:
        return "--hosts netns needs root (it creates network namespaces)"
    return None


@contextlib.contextmanager
def netns_pair(subnet: str = "10.254.77") -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair, `subnet`.1 (node) and `subnet`.2 (client);
    yields their `Hosts` and deletes both on exit."""
    if (why := missing()) is not None:
        raise RuntimeError(why)
    tag = f"kvb{os.getpid()}"
    node, client = f"{tag}-node", f"{tag}-client"
    hosts = Hosts("netns", node, client, f"{subnet}.1", f"{subnet}.2")
    made: list[str] = []
    try:
        for ns in (node, client):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        ends = {node: (f"{tag}n", hosts.node_addr), client: (f"{tag}c", hosts.client_addr)}
        _ip("link", "add", ends[node][0], "netns", node, "type", "veth", "peer", ends[client][0])
        _ip("link", "set", ends[client][0], "netns", client)
        for ns, (dev, addr) in ends.items():
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        for ns, (dev, _) in ends.items():
            _wait_running(ns, dev)
            other = hosts.client_addr if ns == node else hosts.node_addr
            _check_route(ns, other, dev)
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, check=True, timeout=30)


def _wait_running(ns: str, dev: str, timeout_s: float = 10.0) -> None:
    """Until `dev` carries traffic: its carrier comes up a moment after the link, and a
    route check or a first connection made before then would fail for no reason of its own."""
    deadline = time.monotonic() + timeout_s
    while "state UP" not in _link(ns, dev):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{dev} in {ns} is not up after {timeout_s:g} s: {_link(ns, dev)}")
        time.sleep(0.05)


def _link(ns: str, dev: str) -> str:
    cmd = ["ip", "-n", ns, "link", "show", "dev", dev]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _check_route(ns: str, addr: str, dev: str) -> None:
    """Asserts that `addr` is reached from `ns` through `dev` and nothing else."""
    out = subprocess.run(
        ["ip", "-n", ns, "route", "get", addr], capture_output=True, text=True, check=True
    ).stdout
    if f" dev {dev} " not in f"{out} ":
        raise RuntimeError(f"{addr} is not routed through {dev} in {ns}: {out.strip()}")
