"""A UCX worker on its own thread and event loop, so no caller's loop ever waits on it.

ucxx ties a worker's progress to an asyncio loop; this module gives each server or client
its own loop thread and runs coroutines there with a deadline. UCX reads its settings from
the environment when the worker is created, so `UCX_TLS=tcp` before start restricts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import importlib
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from kvstore import errors

log = logging.getLogger("kvstore.dataplane")
T = TypeVar("T")
STOP_GRACE_S = 5.0  # how long `stop` waits for the loop's tasks to end once cancelled


def configure_ucx_env() -> None:
    """UCX settings of this process, unless the environment already says otherwise.

    Endpoints run without UCX error handling (with it, same-host traffic falls back to TCP).
    Then a peer that dies during a cross-memory-attach (CMA) copy makes UCX abort the whole
    process, so CMA is left out: same-host transfers go through shared-memory segments.
    """
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_TLS", "^cma")


def load_ucxx() -> Any:
    """The `ucxx` module; raises UnavailableError when the `ucx` extra is not installed."""
    configure_ucx_env()
    try:
        return importlib.import_module("ucxx")
    except ImportError as exc:
        raise errors.UnavailableError(
            f"UCX data plane needs ucxx: pip install 'kvstore[ucx]' ({exc})"
        ) from None


def is_available() -> bool:
    """Whether ucxx imports here."""
    try:
        load_ucxx()
    except errors.UnavailableError:
        return False
    return True


def has_rdma_device(root: str = "/sys/class/infiniband") -> bool:
    """Whether this host has an RDMA device (InfiniBand, RoCE, iWARP: each one the kernel
    knows is listed under `root`)."""
    try:
        with os.scandir(root) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


_SIOCGIFADDR = 0x8915


def net_devices_for(host: str) -> str:
    """UCX_NET_DEVICES that keep a worker on the interface of `host`: "lo" for loopback,
    the interface holding `host`, or "" (every interface) for a wildcard or unknown host."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return ""
    if addr.is_loopback:
        return "lo"
    if addr.is_unspecified:
        return ""
    return next((n for n in _interfaces() if _ipv4_of(n) == str(addr)), "")


def client_net_devices(server_address: str) -> str:
    """UCX_NET_DEVICES for a client of the node at `server_address` ("host:port")."""
    host = server_address.rsplit(":", 1)[0].strip("[]")
    return "lo" if net_devices_for(host) == "lo" else ""


def _interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


class UcxRuntime:
    """Owns one ucxx worker, progressed by a daemon thread with a private event loop.

    `ucx_config`: UCX settings of this worker only, without the `UCX_` prefix
    (`{"NET_DEVICES": "lo"}`); the environment still applies to everything else.
    """

    def __init__(self, name: str, ucx_config: dict[str, str] | None = None) -> None:
        self._ucxx = load_ucxx()
        self.ucx_config = dict(ucx_config or {})
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.ctx: Any = self.call(self._make_context(), timeout_s=60.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _make_context(self) -> Any:
        from ucxx._lib_async.application_context import ApplicationContext

        # Python futures are completed by ucxx's notifier thread; without it every pending
        # request (a server always has its next receive posted) is polled with
        # `asyncio.sleep(0)` and the loop spins a core even when idle.
        return ApplicationContext(
            config_dict=self.ucx_config, progress_mode="thread", enable_python_future=True
        )

    @property
    def ucxx(self) -> Any:
        return self._ucxx

    @property
    def worker_address(self) -> bytes:
        return bytes(self.ctx.worker_address)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules `coro` on the runtime's loop from any other thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs `coro` on the runtime's loop and waits for it, at most `timeout_s`."""
        return self.submit(with_deadline(coro, timeout_s)).result()

    def stop(self) -> None:
        """Stops the loop thread; in-flight coroutines are cancelled."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            # Cancelled here and awaited, a task ends on its loop; left pending, it would be
            # destroyed pending whenever the loop is collected, and asyncio logs that.
            with contextlib.suppress(concurrent.futures.TimeoutError):
                self.submit(_cancel_others()).result(timeout=STOP_GRACE_S)
        if self.ctx is not None:
            # The notifier waits for completions in 1 s periods; waking it first makes the
            # stop immediate instead of up to a second.
            self.ctx.worker.stop_request_notifier_thread()
            self.ctx.stop_notifier_thread()
            # Once more, now that the thread is gone: if the wake-up landed between two of
            # its waits, the next wait restarted the notifier.
            self.ctx.worker.stop_request_notifier_thread()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10.0)
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.worker.stop_progress_thread()
            _quiesce_notifier(ctx.worker)


async def _cancel_others() -> None:
    """Cancels every other task of the running loop and waits until each has ended."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def _quiesce_notifier(worker: Any) -> None:
    """Leaves a worker whose threads have stopped with no request in flight and its
    request notifier marked stopped with nothing pending. A request that completes after
    the notifier thread's last wait (an endpoint's close, a receive cancelled, here or by
    the worker's own end) leaves a notification no thread will take, and ucxx then warns
    at the worker's end that its notifier is still running: here the requests are
    cancelled first, as the worker's end would, and a wait takes what they left (the
    first wait after a stop only marks the notifier running again)."""
    worker.cancel_inflight_requests(period=3_000_000_000, max_attempts=3)  # as ~Worker does
    worker.stop_request_notifier_thread()
    worker.wait_request_notifier(period_ns=1)  # the stop seen: marked running again
    worker.wait_request_notifier(period_ns=1)  # a pending notification taken, if any
    worker.stop_request_notifier_thread()


async def with_deadline(coro: Awaitable[T], timeout_s: float) -> T:
    """`coro`, or DeadlineExceededError after `timeout_s`."""
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except TimeoutError:
        raise errors.DeadlineExceededError(
            f"data-plane call did not finish within {timeout_s:g} s"
        ) from None
