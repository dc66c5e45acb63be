"""What `Client` and `AsyncClient` share beside their calls (`calls`) and data planes
(`data_planes`): defaults, result types, error mapping, buffers, the Get stream's assembly."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import grpc
import numpy as np

from kvstore import errors
from kvstore._proto import kvstore_pb2 as pb
from kvstore.checksum import checksum
from kvstore.dataplane.buffers import as_transfer_buffer
from kvstore.results import PutResult, PutStatus, ReserveResult

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
TRANSPORT_CHOICES = ("auto", "shm", "ucx", "tcp", "grpc")
log = logging.getLogger("kvstore.client")

Buffer = bytes | bytearray | memoryview | np.ndarray


class GetResult(NamedTuple):
    """Blocks in key order; None where a key missed."""

    blocks: tuple[bytearray | None, ...]

    @property
    def found(self) -> tuple[bool, ...]:
        return tuple(b is not None for b in self.blocks)

    @property
    def num_found(self) -> int:
        return sum(self.found)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def raise_rpc_error(err: grpc.RpcError) -> NoReturn:
    """Raises the typed error a failed call carries (its name travels in the trailers)."""
    code = err.code()  # type: ignore[attr-defined]
    metadata = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    name = next((v for k, v in metadata if k == errors.ERROR_METADATA_KEY), None)
    cls = errors.error_class(name, code.name)
    raise cls(f"{code.name}: {err.details()}") from err  # type: ignore[attr-defined]


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat byte view of a host block (numpy, torch, bytes, bytearray), no copy."""
    target = as_transfer_buffer(buf, writable=False)
    if target.is_device:
        raise errors.InvalidArgumentError("the gRPC path sends host blocks only; use UCX")
    return target.obj


def blocks_to_write(
    reserved: ReserveResult, blocks: Sequence[Buffer]
) -> list[tuple[int, memoryview]]:
    return [
        (i, as_bytes_view(blocks[i]))
        for i, status in enumerate(reserved.statuses)
        if status is PutStatus.RESERVED
    ]


def put_result(reserved: ReserveResult) -> PutResult:
    statuses = reserved.statuses
    return PutResult(
        num_stored=reserved.num_reserved,
        num_present=statuses.count(PutStatus.PRESENT),
        num_in_flight=statuses.count(PutStatus.IN_FLIGHT),
    )


def check_blocks(keys: Sequence[bytes], blocks: Sequence[Buffer]) -> None:
    if len(keys) != len(blocks):
        raise errors.InvalidArgumentError(f"{len(blocks)} blocks for {len(keys)} keys")


def copy_into(result: GetResult, buffers: Sequence[Any]) -> tuple[bool, ...]:
    """The gRPC path's fallback for `get_into`: one copy from each received block."""
    for block, buf in zip(result.blocks, buffers, strict=True):
        if block is None:
            continue
        target = as_transfer_buffer(buf, writable=True)
        if target.nbytes != len(block):
            raise errors.PayloadSizeError(
                f"buffer of {target.nbytes} bytes for a {len(block)}-byte block"
            )
        if target.is_device:
            import cupy  # device buffers on the gRPC path need the `gpu` extra

            cupy.asarray(buf).view(cupy.uint8).ravel().set(np.frombuffer(block, np.uint8))
        else:
            target.obj[:] = block
    return result.found


class GetAssembler:
    """Rebuilds blocks from a Get stream: a header, then chunks in any block order.

    Every block is checked against the CRC32C the header carries for it; one that does not
    match (damaged on the node or on the way) is reported missed and counted, never returned.
    A stream that does not fit its header raises UnavailableError.
    """

    def __init__(self) -> None:
        self.blocks: list[bytearray | None] = []
        self.checksums: list[int | None] = []
        self.checksum_failures = 0

    def feed(self, msg: pb.GetResponse) -> None:
        if msg.HasField("header"):
            header = msg.header
            if len(header.checksums) != sum(header.found):
                raise errors.UnavailableError("Get header has no checksum for some block")
            sums = iter(header.checksums)
            self.blocks = [bytearray(header.block_bytes) if f else None for f in header.found]
            self.checksums = [next(sums) if f else None for f in header.found]
            return
        chunk = msg.chunk
        block = self.blocks[chunk.index] if chunk.index < len(self.blocks) else None
        end = chunk.offset + len(chunk.data)
        if block is None or end > len(block):
            raise errors.UnavailableError(f"Get stream sent bytes outside block {chunk.index}")
        block[chunk.offset : end] = chunk.data

    def result(self) -> GetResult:
        blocks = []
        for block, crc in zip(self.blocks, self.checksums, strict=True):
            if block is not None and checksum(block) != crc:
                self.checksum_failures += 1
                log.warning("event=checksum_failure path=grpc bytes=%d", len(block))
                block = None
            blocks.append(block)
        return GetResult(tuple(blocks))
