"""Checks a peer's UCX worker address in a separate process before this one trusts it.

UCX unpacks a worker address without defending against hostile bytes: a few random bytes
make it fail an assertion and abort the whole process. A client's address arrives over the
network, so the node never hands one to its own UCX first. A long-lived checker process
(`python -m kvstore.dataplane.ucx.address_check`) creates an endpoint from the address and
drops it again; if that process survives, the same bytes unpack the same way in the node.
If it dies, the address is refused and a fresh checker is started at once, so the next
caller does not wait for its start-up (nor does the first: one starts with the node).

Protocol on the checker's stdin/stdout: a request is a 4-byte little-endian length and the
address; the answer is one byte, 1 for an address UCX accepted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from kvstore import errors

log = logging.getLogger("kvstore.dataplane")
_LEN = struct.Struct("<I")
_OK = b"\x01"
_BAD = b"\x00"


class AddressChecker:
    """Answers whether UCX can unpack an address, without risking this process."""

    def __init__(self, ucx_config: dict[str, str], timeout_s: float = 10.0) -> None:
        self.ucx_config = dict(ucx_config)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one question at a time
        self._proc: subprocess.Popen[bytes] | None = None
        with self._lock:
            self._process()  # warm: its imports run while the node starts

    def check(self, address: bytes) -> None:
        """Raises InvalidArgumentError unless `address` is a worker address UCX accepts."""
        with self._lock:
            if not self._ask(address):
                raise errors.InvalidArgumentError(
                    f"client_address ({len(address)} bytes) is not a UCX worker address"
                )

    def _ask(self, address: bytes) -> bool:
        proc = self._process()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(_LEN.pack(len(address)) + address)
            proc.stdin.flush()
            answer = _read_within(proc.stdout, 1, self.timeout_s)
        except (BrokenPipeError, TimeoutError):
            answer = b""
        if answer != _OK:
            self._kill()  # crashed on it, timed out, or refused
            self._process()  # the next one starts up while this caller hears the refusal
            log.warning("event=ucx_address_refused bytes=%d", len(address))
            return False
        return True

    def _process(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ)
            env.update({f"UCX_{k}": v for k, v in self.ucx_config.items()})
            env["UCX_LOG_LEVEL"] = "fatal"  # its deaths are expected; the node logs the refusal
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.dataplane.ucx.address_check"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
            )
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        with self._lock:
            self._kill()


def _read_within(pipe: IO[bytes], nbytes: int, timeout_s: float) -> bytes:
    ready, _, _ = select.select([pipe], [], [], timeout_s)
    if not ready:
        raise TimeoutError("address checker did not answer")
    return os.read(pipe.fileno(), nbytes)


async def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    import ucxx
    from ucxx._lib_async.application_context import ApplicationContext

    ctx: Any = ApplicationContext(progress_mode="thread", enable_python_future=True)
    while header := stdin.read(_LEN.size):
        (size,) = _LEN.unpack(header)
        address = stdin.read(size)
        try:
            ep = await ctx.create_endpoint_from_worker_address(
                ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False
            )
            ep.abort()
            answer = _OK
        except Exception:
            answer = _BAD
        stdout.write(answer)
        stdout.flush()


def main() -> None:
    asyncio.run(_serve(sys.stdin.buffer, sys.stdout.buffer))
    # Stdin closed: the node is gone (or closed us). Exit now: UCX's progress thread would
    # keep the interpreter alive, spinning, as an orphan of a node that was killed.
    os._exit(0)


if __name__ == "__main__":
    main()
